"""``arona-gateway import FILE``: chat history into memory, through the gRPC service.

Each line of the file (:mod:`~gateway_http.importing.lines`) is checked whole before any of
its turns is sent; each turn is one ``Writeback`` with its ``occurred_at`` and an episode id of
its own, in the order of the file, and is noted in the progress file
(:mod:`~gateway_http.importing.ledger`) once the service has it, so a run stopped anywhere
goes on where it stopped and sends no turn twice. What the service refuses as bad input
makes the line bad: the turns of that line stored already are deleted again, so a bad line
leaves nothing behind. The service being away (``UNAVAILABLE``, a timeout) is waited out for
a while, then the import stops, to be run again.

A turn is stored exactly once even across a SIGKILL: the one turn whose answer the kill cut
off is sent again with the same text, time and episode id, which the memory service's
outbox knows while it waits there and the embedded store keeps as one memory (another Philia
may keep two copies of that one turn).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from arona_grpc.config import Settings
from gateway_http.chat_request import user_error
from gateway_http.errors import ErrorKind, GatewayError
from gateway_http.grpc_channel import memory_call_metadata, open_memory_channel
from gateway_http.importing.display import Progress
from gateway_http.importing.ledger import Ledger, LedgerError
from gateway_http.importing.lines import BadLine, ImportLine, Turn, parse_line
from gateway_http.memory_client import KeptEpisode, MemoryClient

# How long the service may be away before the import stops: waits of 0.5, 1, 2, 4, 8, 16 s.
RETRIES = 6
FIRST_RETRY_S = 0.5
# A Writeback waits for one Philia store (and, during an outage, for the outbox).
CALL_MARGIN_S = 2.0


class ImportStopped(Exception):
    """The import cannot go on (the message says why and what to do)."""


class _Interrupted(Exception):
    """Stopped (Ctrl-C, SIGTERM) while waiting for the service to come back."""


@dataclass
class Tally:
    imported: int = 0
    episodes: int = 0
    queued: int = 0
    skipped: int = 0
    bad: int = 0


def import_command(
    settings: Settings,
    file: Path,
    *,
    user: str | None = None,
    progress: Path | None = None,
    check: bool = False,
) -> int:
    """Run an import from the command line; its exit code (0, 1: bad lines, 2: stopped,
    130: interrupted)."""
    # The import reports every failure itself, in its own words: the memory client's log
    # line for a failed call would only repeat it.
    logging.getLogger("gateway_http.memory_client").setLevel(logging.ERROR)
    try:
        return asyncio.run(
            run_import(
                settings, file, user=user, progress_path=progress, check=check, out=sys.stdout
            )
        )
    except ImportStopped as exc:
        print(f"arona-gateway: error: {exc}", file=sys.stderr)
        return 2


async def run_import(
    settings: Settings,
    file: Path,
    *,
    user: str | None = None,
    progress_path: Path | None = None,
    check: bool = False,
    out: TextIO,
    err: TextIO | None = None,
) -> int:
    err = err if err is not None else sys.stderr
    if user is not None:
        problem = user_error(user) if user else "--user must not be empty"
        if problem is not None:
            raise ImportStopped(problem.replace("'user'", "--user"))
    total = _count_lines(file)
    # Part of every turn's key: the same file imported elsewhere is imported again there.
    destination = f"{settings.grpc_targets[0]}\n{user or ''}"
    shown = Progress(err, total)
    tally = Tally()
    if check:
        for number, raw in _lines(file):
            try:
                parse_line(raw, principal=user, destination=destination)
            except BadLine as exc:
                tally.bad += 1
                shown.say(f"{file}:{number}: {exc}")
            shown.line_done()
        shown.finish()
        print(f"checked {total:,} lines: {tally.bad:,} bad", file=out)
        return 1 if tally.bad else 0
    try:
        ledger = Ledger(progress_path or file.with_name(file.name + ".progress"))
    except LedgerError as exc:
        raise ImportStopped(str(exc)) from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    channel = open_memory_channel(settings)
    try:
        importer = _Importer(
            settings,
            MemoryClient(
                channel,
                recall_budget_s=settings.recall_budget_s,
                rpc_timeout_s=settings.memory_timeout_s,
                metadata=memory_call_metadata(settings),
            ),
            ledger,
            stop,
        )
        user_scoped = await importer.check_service()
        for number, raw in _lines(file):
            if stop.is_set():
                break
            try:
                line = parse_line(raw, principal=user, destination=destination)
                if user_scoped and not line.scope:
                    raise BadLine(
                        "no user: the memory service keeps each user's memory apart "
                        "(ARONA_MEMORY_SCOPE=user); pass --user or give the line a 'user'"
                    )
                pending = [turn for turn in line.turns if not ledger.done(turn.key)]
                if not pending:
                    tally.skipped += 1
                    shown.line_done()
                    continue
                stored = await importer.send(line, pending, tally)
            except _Interrupted:
                break
            except BadLine as exc:
                tally.bad += 1
                shown.say(f"{file}:{number}: {exc}")
                shown.line_done()
                continue
            tally.imported += 1
            shown.line_done(stored)
        shown.finish()
    except ImportStopped:
        # How far it got, before the reason.
        shown.finish()
        print(_summary(tally), file=out)
        raise
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        ledger.close()
        await channel.close(None)
    print(_summary(tally), file=out)
    if stop.is_set():
        print(
            f"stopped after {shown.lines:,} of {total:,} lines; run the same command again "
            "to go on",
            file=out,
        )
        return 130
    return 1 if tally.bad else 0


class _Importer:
    def __init__(
        self, settings: Settings, client: MemoryClient, ledger: Ledger, stop: asyncio.Event
    ) -> None:
        self._client = client
        self._ledger = ledger
        # Ctrl-C or SIGTERM: the line under way is finished, unless the service is away.
        self._stop = stop
        self._target = settings.grpc_targets[0]
        self._timeout_s = settings.memory_timeout_s + CALL_MARGIN_S

    async def check_service(self) -> bool:
        """Whether the service keeps each user's memory apart; :class:`ImportStopped` when
        it cannot be reached or stores nothing."""
        try:
            status = await self._client.status(1)
        except GatewayError as exc:
            if exc.kind is ErrorKind.UNAVAILABLE:
                raise ImportStopped(
                    f"cannot reach the memory service at {self._target} (is `arona-gateway up` "
                    "or `serve` running? ARONA_GRPC_TARGET names it)"
                ) from None
            raise ImportStopped(self._unreachable(exc)) from None
        if not status["enabled"]:
            raise ImportStopped(
                f"the memory service at {self._target} has no memory configured "
                "(ARONA_MEMORY_URL, ARONA_MEMORY_TOKEN)"
            )
        if not status["writeback"]:
            raise ImportStopped(
                f"the memory service at {self._target} stores no episodes "
                "(ARONA_MEMORY_WRITEBACK=false)"
            )
        return bool(status["scope"] == "user")

    async def send(self, line: ImportLine, pending: list[Turn], tally: Tally) -> int:
        """Send the turns of ``line`` not imported yet; how many were stored or queued."""
        sent = 0
        for turn in pending:
            try:
                kept = await self._keep(line, turn)
            except BadLine as exc:
                raise BadLine(await self._undo(line, str(exc))) from None
            if not kept.stored and not kept.queued:
                # Nothing to store (the service found no text), unless writeback went off.
                await self.check_service()
            self._ledger.mark(turn.key, kept.node_id)
            tally.queued += kept.queued
            sent += 1
        tally.episodes += sent
        return sent

    async def _keep(self, line: ImportLine, turn: Turn) -> KeptEpisode:
        delay_s = FIRST_RETRY_S
        for attempt in range(RETRIES + 1):
            try:
                return await self._client.keep_episode(
                    turn.user,
                    turn.assistant,
                    line.scope,
                    f"import:{turn.key}",
                    turn.occurred_at,
                    self._timeout_s,
                )
            except GatewayError as exc:
                if exc.kind is ErrorKind.BAD_INPUT:
                    raise BadLine(f"the memory service refused it: {exc.message}") from None
                if exc.kind not in (ErrorKind.UNAVAILABLE, ErrorKind.TIMEOUT) or (
                    attempt == RETRIES
                ):
                    raise ImportStopped(
                        f"{self._unreachable(exc)}; run the same command again to go on"
                    ) from None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay_s):
                    await self._stop.wait()
            if self._stop.is_set():
                raise _Interrupted
            delay_s *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    async def _undo(self, line: ImportLine, reason: str) -> str:
        """Delete the turns of ``line`` stored already; ``reason`` and what became of them."""
        deleted = kept = 0
        for turn in line.turns:
            node_id = self._ledger.node_id(turn.key)
            if node_id is None:
                continue
            if node_id:
                with contextlib.suppress(GatewayError):
                    await self._client.delete(node_id, line.scope)
                    self._ledger.unmark(turn.key)
                    deleted += 1
                    continue
            kept += 1
        if deleted:
            reason += f" (its {deleted} turn(s) stored already were deleted again)"
        if kept:
            reason += f" ({kept} turn(s) of it stay: the service stored or queued them)"
        return reason

    def _unreachable(self, exc: GatewayError) -> str:
        if exc.kind is ErrorKind.AUTH:
            return (
                f"the memory service at {self._target} refused the credentials (ARONA_GRPC_TOKEN)"
            )
        return f"the memory service at {self._target}: {exc.message}"


def _summary(tally: Tally) -> str:
    text = f"imported {tally.imported:,} lines ({tally.episodes:,} episodes"
    if tally.queued:
        text += f", {tally.queued:,} of them queued in the memory service's outbox"
    text += ")"
    if tally.skipped:
        text += f"; {tally.skipped:,} lines already imported"
    if tally.bad:
        text += f"; {tally.bad:,} bad lines (listed above; nothing of them is stored)"
    return text


def _lines(file: Path) -> Iterator[tuple[int, bytes]]:
    """The non-blank lines of ``file`` with their line numbers (from 1), line ends off."""
    try:
        with file.open("rb") as f:
            for number, raw in enumerate(f, 1):
                if raw.strip():
                    yield number, raw.rstrip(b"\r\n")
    except OSError as exc:
        raise ImportStopped(f"cannot read {file}: {exc.strerror or exc}") from None


def _count_lines(file: Path) -> int:
    return sum(1 for _ in _lines(file))
