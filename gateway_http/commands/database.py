"""``migrate`` (every store's schema brought up to date, alone, so that replicas may start
without racing) and ``store-copy`` (an embedded store's memories into PostgreSQL, or back).
"""

from __future__ import annotations

import logging
from collections.abc import (
    Mapping,
)
from typing import TYPE_CHECKING, Any

from arona_common.redact import redact_url
from arona_grpc.config import Settings

if TYPE_CHECKING:
    pass
from gateway_http.commands.runtime import StartupError

logger = logging.getLogger("arona_gateway")


async def migrate_command(env: Mapping[str, str]) -> None:
    """Bring every store's schema up to date, alone (replicas may then start without racing)."""
    from arona_common.database import DatabaseUnavailable, SchemaRefused, migrate

    settings = Settings.from_env(env)
    if settings.database_url:
        try:
            applied = await migrate(settings.database_url)
        except (DatabaseUnavailable, SchemaRefused) as exc:
            raise StartupError(str(exc)) from None
        where = redact_url(settings.database_url)
        if applied:
            for migration in applied:
                print(f"{where}: applied migration {migration.version}: {migration.name}")
        else:
            print(f"{where}: the schema is up to date")
        return
    from arona_grpc.episodes import SqliteEpisodeIndex
    from arona_grpc.outbox import Outbox
    from gateway_http.conversations import CONVERSATIONS_FILE, SqliteConversationStore
    from gateway_http.usage.sqlite import SqliteUsageStore
    from gateway_http.usage.store import USAGE_FILE

    SqliteConversationStore.open(settings.data_dir / CONVERSATIONS_FILE).close()
    SqliteUsageStore.open(settings.data_dir / USAGE_FILE).close()
    index = SqliteEpisodeIndex(settings.data_dir)
    await index.owner("")  # opens (and migrates) the file
    await index.aclose()
    outbox = Outbox(settings.data_dir, settings.memory_outbox_max_bytes)
    await outbox.load()  # migrates an existing file; a missing one is created when needed
    await outbox.aclose()
    print(f"{settings.data_dir}: the SQLite files' schemas are up to date")


def add_database_parsers(sub: Any) -> None:
    """``migrate`` and ``store-copy``."""
    sub.add_parser(
        "migrate",
        help="apply the database schema migrations (ARONA_DATABASE_URL, or the SQLite files)",
    )
    copy = sub.add_parser(
        "store-copy",
        help="copy an embedded store's memories into PostgreSQL, or back; resumable",
    )
    copy.add_argument(
        "source",
        help="a postgresql:// URL, or an embedded store's file ($ARONA_DATA_DIR/memory.db; "
        "its directory will do)",
    )
    copy.add_argument("dest", help="the same: exactly one of the two is PostgreSQL")
