"""Where a forgotten word still is: every file under a directory, searched byte for byte.

A forget must leave a memory's text in no file the product keeps: not a database, not its
write-ahead log, not an index segment, a journal or a ledger. These helpers read the files
themselves (not through the product), so a copy left in a freed page or an unmerged index
segment is found as surely as a row.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


def _forms(word: str) -> set[bytes]:
    """The ways ``word`` can sit in a file: as written, lower-cased (the word indexes keep
    terms folded), in UTF-8 and as the UTF-16 some databases use."""
    forms: set[bytes] = set()
    for text in {word, word.lower(), word.upper()}:
        forms.add(text.encode())
        forms.add(text.encode("utf-16-le"))
    return forms


def files_holding(root: Path, words: Iterable[str]) -> dict[str, list[str]]:
    """Each file under ``root`` (relative path) that holds any of ``words``, with those
    words; empty when none does."""
    wanted = {word: _forms(word) for word in words}
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        folded = data.lower()
        held = [
            word
            for word, forms in wanted.items()
            if any(form in data or form.lower() in folded for form in forms)
        ]
        if held:
            found[str(path.relative_to(root))] = held
    return found


async def tables_holding(database_url: str, words: Iterable[str]) -> dict[str, list[str]]:
    """Each table of a PostgreSQL database that holds any of ``words`` (any case) in any
    column, with those words; empty when none does."""
    import asyncpg

    words = list(words)
    conn = await asyncpg.connect(database_url)
    try:
        tables = [
            str(row[0])
            for row in await conn.fetch(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
            )
        ]
        found: dict[str, list[str]] = {}
        for table in tables:
            held = [
                word
                for word in words
                if await conn.fetchval(
                    f'SELECT count(*) FROM "{table}" t WHERE t::text ILIKE $1', f"%{word}%"
                )
            ]
            if held:
                found[table] = held
        return found
    finally:
        await conn.close()
