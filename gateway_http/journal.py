"""Durable before answered: the HTTP layer's journal of episodes on their way to memory.

A turn's writeback runs in the background after the reply, so a process killed hard (SIGKILL,
the OOM killer) a few milliseconds after answering would lose the episodes still in flight.
Each episode is therefore appended to a local file before the reply's last byte leaves, and
dropped once the ``MemoryService`` has stored it or queued it in its outbox. What is left at
start (or after the gRPC service was unreachable) is sent again.

The file is a log of JSON lines, one ``write()`` each. A process crash loses nothing (the
kernel has the bytes once ``write()`` returns), a power cut at most the last moments, as with
a database that does not sync every commit; a line cut short by a crash is skipped when the
file is read. One write a turn on the event loop's thread costs a few microseconds, where a
SQLite transaction cost tens (and several system calls).

**A dropped episode leaves no text behind.** Its line is overwritten with spaces where it
stands (one ``pwrite``), so the file never holds the words of a turn the memory service has
taken: once that turn is forgotten, nothing of it is left here either. (Earlier versions
appended ``{"drop": [...]}`` lines instead; they are still read.) The episodes still waiting
live in memory too: once the file passes :data:`COMPACT_BYTES` it is emptied as soon as none
is waiting, and past :data:`REWRITE_BYTES` rewritten with only them. A rewrite syncs its new
file on a worker thread, not on the event loop (a slow disk stalls no turn); what is written
meanwhile goes on into the current file and is copied over before the new one replaces it.

Each HTTP process holds its own file, locked while it runs (``serve --workers``: one per
worker; a second process given the same file takes one named after its pid). At start a
process also takes over the episodes of any journal file no running process holds (a
process that died; the SQLite ``journal*.db`` of earlier versions), so nothing is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import json
import logging
import os
import sqlite3
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arona_common.storage import StorageFaults

logger = logging.getLogger(__name__)

# Past this size the file is emptied as soon as no episode is waiting...
COMPACT_BYTES = 4 << 20
# ...and past this one rewritten with only the episodes waiting (they are synced first).
REWRITE_BYTES = 16 << 20
_PREFIX = "journal"


def journal_path(data_dir: Path, worker: int) -> Path:
    """Each HTTP process has its own journal (``serve --workers``: one per worker)."""
    return data_dir / (f"{_PREFIX}.log" if worker == 0 else f"{_PREFIX}-{worker}.log")


@dataclass(frozen=True)
class Journaled:
    id: int
    user: str
    assistant: str
    scope: str
    episode_id: str
    # When the turn was journaled (POSIX microseconds): sent as its time when it is sent
    # again, so a turn that waited out an outage keeps its own time. 0: unknown (now).
    at_us: int = 0

    @property
    def occurred_at(self) -> float | None:
        """When the turn happened, in POSIX seconds; None when unknown."""
        return self.at_us / 1_000_000 if self.at_us else None


def _line(entry: Journaled) -> bytes:
    record = {
        "id": entry.id,
        "user": entry.user,
        "assistant": entry.assistant,
        "scope": entry.scope,
        "episode_id": entry.episode_id,
        "at_us": entry.at_us,
    }
    # ASCII: any str survives the trip, a lone surrogate included.
    return json.dumps(record, separators=(",", ":")).encode() + b"\n"


def _records(data: bytes) -> Iterator[dict[str, Any]]:
    """The whole JSON objects of a journal file; a line cut short by a crash is skipped."""
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            logger.warning("skipped a journal line cut short (a crash while it was written)")
            continue
        if isinstance(record, dict):
            yield record


def read_journal(path: Path) -> list[Journaled]:
    """The episodes a journal file still holds, oldest first (without taking it over)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    live: dict[int, Journaled] = {}
    for record in _records(data):
        dropped = record.get("drop")
        if isinstance(dropped, list):
            for entry_id in dropped:
                live.pop(entry_id, None)
            continue
        try:
            entry = Journaled(
                int(record["id"]),
                str(record["user"]),
                str(record["assistant"]),
                str(record["scope"]),
                str(record["episode_id"]),
                int(record.get("at_us") or 0),
            )
        except (KeyError, TypeError, ValueError):
            logger.warning("skipped a journal line that is not an episode")
            continue
        live[entry.id] = entry
    return list(live.values())


def _read_legacy(path: Path) -> list[tuple[str, str, str, str]]:
    """The episodes of an earlier version's SQLite journal (empty when it has none)."""
    try:
        db = sqlite3.connect(path, timeout=5.0)
        try:
            rows = db.execute(
                "SELECT user_text, assistant, scope, episode_id FROM episodes ORDER BY id"
            ).fetchall()
        finally:
            db.close()
    except sqlite3.Error as exc:
        logger.warning("could not read the earlier journal %s: %s", path, exc)
        return []
    return [(str(a), str(b), str(c), str(d)) for a, b, c, d in rows]


def _lock(path: Path) -> int | None:
    """``path`` opened for writing and locked, or None when a running process holds it.

    Not ``O_APPEND``: a dropped episode's line is overwritten where it stands, and Linux
    appends every ``pwrite`` to a file opened so; appends go to the size this process keeps.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        # Another process may have taken the file over and removed it meanwhile: then this
        # is a file nobody will read; start again with the one at the path now.
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


JOURNAL_PART = "journal"
# What a turn the journal cannot take costs (its writeback still goes out).
JOURNAL_COST = (
    "answered turns are not kept against a crash of this process until it can be written "
    "(their writebacks still go out)"
)


class Journal:
    """Episodes answered but not yet taken by the memory service; see the module docstring.
    A write of drops that fails is reported to ``storage`` (said once per fault)."""

    def __init__(self, path: Path, storage: StorageFaults | None = None) -> None:
        self._storage = storage
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = _lock(path)
        if fd is None:
            # Another running process journals there: a file of this process's own.
            path = path.with_name(f"{path.stem}-p{os.getpid()}{path.suffix}")
            fd = _lock(path)
            if fd is None:  # pragma: no cover - a pid is one process at a time
                raise OSError(f"the journal {path} is in use")
        self.path = path
        self._fd = fd
        self._live: dict[int, Journaled] = {entry.id: entry for entry in read_journal(path)}
        self._next = max(self._live, default=0) + 1
        # Where each waiting episode's line is in the current file: offset, length.
        self._lines: dict[int, tuple[int, int]] = {}
        # A write failed halfway: the next one starts on a new line.
        self._torn = False
        self._closed = False
        self._size = 0
        # A rewrite being synced off the event loop (see the module docstring).
        self._fresh: _Fresh | None = None
        # The sync of that rewrite, done once the new file is in place or given up.
        self.rewriting: asyncio.Future[None] | None = None
        # After a failed rewrite, the next waits until the file has grown this much more.
        self._rewrite_at = 0
        orphans: list[tuple[Path, int]] = []
        legacies: list[Path] = []
        try:
            orphans, legacies = self._take_over_orphans()
            # A clean file to append to: what is still waiting, nothing cut short at its end
            # (and the orphans' episodes, in this file before theirs are removed).
            self._rewrite()
        except BaseException:
            os.close(self._fd)
            for _, orphan_fd in orphans:
                os.close(orphan_fd)
            raise
        for other, orphan_fd in orphans:
            # Removed while still locked, so no other starting process takes them again.
            other.unlink(missing_ok=True)
            os.close(orphan_fd)
        for legacy in legacies:
            for suffix in ("", "-wal", "-shm"):
                Path(f"{legacy}{suffix}").unlink(missing_ok=True)

    def add(self, user: str, assistant: str, scope: str) -> Journaled:
        """Keep one episode (in the file when this returns)."""
        entry = Journaled(
            self._next, user, assistant, scope, uuid.uuid4().hex, int(time.time() * 1_000_000)
        )
        self._next += 1
        line = _line(entry)
        self._lines[entry.id] = (self._write(line, entry.id), len(line))
        self._live[entry.id] = entry
        if self._size >= max(REWRITE_BYTES, self._rewrite_at) and self._fresh is None:
            self._start_rewrite()
        return entry

    def drop(self, entry_id: int) -> None:
        """The memory service has the episode: its line is blanked in the file now."""
        if self._closed or self._live.pop(entry_id, None) is None:
            return
        where = self._lines.pop(entry_id, None)
        try:
            if where is not None:
                _blank(self._fd, *where)
            if self._size >= COMPACT_BYTES and not self._live and self._fresh is None:
                self._rewrite()
        except OSError as exc:
            # Sent again after a restart, and known by its id while it waits in the outbox.
            if self._storage is None:
                logger.warning("could not drop a journaled episode: %s", exc)
            else:
                self._storage.failed(JOURNAL_PART, str(self.path), exc, JOURNAL_COST)

    def pending(self) -> list[Journaled]:
        """Every episode still journaled, oldest first."""
        return list(self._live.values())

    def close(self) -> None:
        if self._closed:
            return
        if self._fresh is not None:
            # The current file still holds everything: the rewrite is not needed.
            self._abandon(self._fresh)
        if not self._live:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
        self._closed = True
        os.close(self._fd)

    def _write(self, data: bytes, entry_id: int) -> int:
        """Append ``data`` (one line) to the file; the offset it starts at."""
        prefix = b"\n" if self._torn else b""
        payload = prefix + data
        try:
            _write_all(self._fd, payload, self._size)
        except OSError:
            self._torn = True
            self._size = os.fstat(self._fd).st_size
            raise
        self._torn = False
        at = self._size + len(prefix)
        self._size += len(payload)
        fresh = self._fresh
        if fresh is not None:
            # Where the same line will be in the rewritten file, once copied over.
            fresh.lines[entry_id] = (fresh.size + fresh.tailed + len(prefix), len(data))
            fresh.tail.append(payload)
            fresh.tailed += len(payload)
        return at

    def _rewrite(self) -> None:
        """Leave only the episodes still waiting in the file (none: empty it), synced on
        this thread."""
        if not self._live:
            os.ftruncate(self._fd, 0)
            self._torn = False
            self._size = 0
            self._lines.clear()
            return
        fresh = self._copy()
        try:
            # On disk before it replaces the file that holds them now.
            os.fsync(fresh.fd)
            os.replace(fresh.path, self.path)
        except BaseException:
            self._abandon(fresh)
            raise
        self._switch(fresh)

    def _start_rewrite(self) -> None:
        """:meth:`_rewrite`, with the sync on a worker thread when there is an event loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._rewrite()
            return
        try:
            self._fresh = self._copy()
        except OSError as exc:
            self._rewrite_failed(exc)
            return
        self.rewriting = loop.run_in_executor(None, os.fsync, self._fresh.fd)
        self.rewriting.add_done_callback(functools.partial(self._synced, self._fresh))

    def _synced(self, fresh: _Fresh, sync: asyncio.Future[None]) -> None:
        """The new file of a rewrite is on disk: add what came meanwhile, blank what was
        dropped meanwhile, and put it in place."""
        failure = sync.exception() if not sync.cancelled() else OSError("the sync was cancelled")
        if self._fresh is not fresh:
            return  # closed meanwhile
        self._fresh = None
        if failure is None:
            try:
                _write_all(fresh.fd, b"".join(fresh.tail), fresh.size)
                for entry_id, where in fresh.lines.items():
                    if entry_id not in self._live:
                        _blank(fresh.fd, *where)
                os.replace(fresh.path, self.path)
            except OSError as exc:
                failure = exc
        if failure is not None:
            self._abandon(fresh)
            self._rewrite_failed(failure)
            return
        fresh.size += fresh.tailed
        self._switch(fresh)

    def _rewrite_failed(self, failure: BaseException) -> None:
        # The current file still holds everything; try again once it has grown as much again.
        self._rewrite_at = self._size + REWRITE_BYTES
        logger.warning("could not rewrite the journal %s: %s", self.path, failure)

    def _abandon(self, fresh: _Fresh) -> None:
        """Give up a rewrite's new file (the current one still holds everything)."""
        self._fresh = None
        os.close(fresh.fd)
        fresh.path.unlink(missing_ok=True)

    def _copy(self) -> _Fresh:
        """A new file next to the journal holding only the episodes waiting (not synced)."""
        lines: dict[int, tuple[int, int]] = {}
        parts: list[bytes] = []
        size = 0
        for entry in self._live.values():
            line = _line(entry)
            lines[entry.id] = (size, len(line))
            parts.append(line)
            size += len(line)
        path = self.path.with_name(self.path.name + ".new")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            # Locked before it takes the journal's name, so no starting process takes it over.
            fcntl.flock(fd, fcntl.LOCK_EX)
            _write_all(fd, b"".join(parts), 0)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return _Fresh(path, fd, size, lines)

    def _switch(self, fresh: _Fresh) -> None:
        """Write to the rewritten file from now on."""
        os.close(self._fd)
        self._fd = fresh.fd
        self._torn = False
        self._size = fresh.size
        self._lines = {entry_id: fresh.lines[entry_id] for entry_id in self._live}
        self._rewrite_at = 0

    def _take_over_orphans(self) -> tuple[list[tuple[Path, int]], list[Path]]:
        """Take the episodes of the journal files no running process holds, and of the
        SQLite journals of earlier versions; those files (the former locked), to remove once
        their episodes are in this one."""
        taken = 0
        orphans: list[tuple[Path, int]] = []
        for other in sorted(self.path.parent.glob(f"{_PREFIX}*.log")):
            if other == self.path:
                continue
            fd = _lock(other)
            if fd is None:
                continue  # a running process's
            orphans.append((other, fd))
            for entry in read_journal(other):
                self._keep(entry.user, entry.assistant, entry.scope, entry.episode_id, entry.at_us)
                taken += 1
        legacies = sorted(self.path.parent.glob(f"{_PREFIX}*.db"))
        for legacy in legacies:
            for user, assistant, scope, episode_id in _read_legacy(legacy):
                self._keep(user, assistant, scope, episode_id)
                taken += 1
        if taken:
            logger.info("took over %d journaled episode(s) of a stopped process", taken)
        return orphans, legacies

    def _keep(self, user: str, assistant: str, scope: str, episode_id: str, at_us: int = 0) -> None:
        entry = Journaled(self._next, user, assistant, scope, episode_id, at_us)
        self._next += 1
        self._live[entry.id] = entry


@dataclass
class _Fresh:
    """A rewrite's new file: its path, descriptor and size, where each episode's line is in
    it, and what was appended to the current file since it was written (and how much)."""

    path: Path
    fd: int
    size: int
    lines: dict[int, tuple[int, int]]
    tail: list[bytes] = field(default_factory=list)
    tailed: int = 0


def _write_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of ``data`` to ``fd`` at ``offset`` (``os.pwrite`` may take only part)."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def _blank(fd: int, offset: int, length: int) -> None:
    """Overwrite the line at ``offset`` with spaces, its newline kept: read back, it is an
    empty line, and its words are gone from the file."""
    if length > 1:
        _write_all(fd, b" " * (length - 1), offset)
