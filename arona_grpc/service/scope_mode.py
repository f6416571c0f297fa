"""The start-up check that shared mode is never served from an episode index holding one
user's memories.
"""

from __future__ import annotations

import logging

from arona_common.redact import redact_url
from arona_grpc.config import ConfigError, Settings
from arona_grpc.episodes import (
    INDEX_FILE,
    EpisodeIndex,
    IndexUnavailable,
)

logger = logging.getLogger(__name__)


class ScopeModeRefused(ConfigError):
    """The index holds per-user memories and the service was asked to share memory."""


async def check_scope_mode(settings: Settings, index: EpisodeIndex) -> None:
    """Refuse (:class:`ScopeModeRefused`) to serve shared memory from an episode index that
    holds episodes stored for one user alone: shared recall and ``memory.list`` would be
    everyone's view of them. An index that cannot be read is left to the code that uses it."""
    if settings.user_scoped:
        return
    try:
        scoped = await index.holds_scoped()
    except (IndexUnavailable, OSError):
        return
    if not scoped:
        return
    if settings.database_url:
        where = f"the episode index in {redact_url(settings.database_url)}"
        elsewhere = "another database"
    else:
        where = str(settings.data_dir / INDEX_FILE)
        elsewhere = "another ARONA_DATA_DIR"
    raise ScopeModeRefused(
        f"{where} holds per-user memories (stored with ARONA_MEMORY_SCOPE=user), which "
        "shared mode would show to every caller: set ARONA_MEMORY_SCOPE=user; or forget them "
        "(run it with ARONA_MEMORY_SCOPE=user, then `arona-gateway forget --all` beside it) "
        f"and start again; or, for a new shared memory, use {elsewhere}"
    )
