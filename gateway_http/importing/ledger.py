"""The import's progress file: which turns are in memory already, so that a run stopped
anywhere (Ctrl-C, SIGKILL, the memory service away) goes on where it stopped.

It sits beside the input (``<FILE>.progress`` unless ``--progress`` says otherwise) and is a
log of JSON lines, one ``write()`` each, so a process killed at any moment loses nothing it
wrote (the kernel has the bytes once ``write()`` returns); a line cut short by a crash is
skipped. The first line is ``{"arona_import": 1}``; then ``{"done": KEY, "node_id": ID}`` once
a turn is stored (``ID`` empty when the memory service kept it in its outbox, to be stored
there), and ``{"undone": KEY}`` when the stored turns of a line found bad half-way were deleted
again. A key names one turn of one line's content imported into one destination
(:func:`~gateway_http.importing.lines.line_digest`), so editing or adding lines, or importing the
same file into another scope or service, imports what is new. The file is locked while an
import runs: two imports of one file at once would both send the same turns.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

_HEADER: dict[str, object] = {"arona_import": 1}


class LedgerError(Exception):
    """The progress file cannot be used (the message says why and what to do)."""


class Ledger:
    """The turns imported so far; see the module docstring."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise LedgerError(
                f"cannot open the progress file {path}: {exc.strerror or exc} "
                "(--progress PATH puts it elsewhere)"
            ) from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LedgerError(
                    f"another import is using {path} (the same file is being imported)"
                ) from None
            data = _read_all(fd)
            self._done = _read(data, path)
            if not data:
                _write(fd, _record(_HEADER))
            elif not data.endswith(b"\n"):
                # A record cut short by a crash: the next one starts on a line of its own.
                _write(fd, b"\n")
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def __len__(self) -> int:
        return len(self._done)

    def done(self, key: str) -> bool:
        return key in self._done

    def node_id(self, key: str) -> str | None:
        """The node id a turn was stored as ("" when queued); None when not imported."""
        return self._done.get(key)

    def mark(self, key: str, node_id: str) -> None:
        """The turn is in memory (or in the service's outbox): in the file when this returns."""
        _write(self._fd, _record({"done": key, "node_id": node_id}))
        self._done[key] = node_id

    def unmark(self, key: str) -> None:
        """The turn was deleted again."""
        _write(self._fd, _record({"undone": key}))
        self._done.pop(key, None)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


def _read(data: bytes, path: Path) -> dict[str, str]:
    done: dict[str, str] = {}
    lines = data.split(b"\n")
    if data and _parsed(lines[0]) != _HEADER:
        raise LedgerError(
            f"{path} is not an import progress file; move it away or pass --progress PATH"
        )
    for raw in lines[1:]:
        record = _parsed(raw)
        if record is None:
            continue  # empty, or cut short by a crash
        key = record.get("done")
        if isinstance(key, str):
            node_id = record.get("node_id")
            done[key] = node_id if isinstance(node_id, str) else ""
            continue
        key = record.get("undone")
        if isinstance(key, str):
            done.pop(key, None)
    return done


def _parsed(raw: bytes) -> dict[str, object] | None:
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _record(record: dict[str, object]) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode() + b"\n"


def _read_all(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
