"""``arona-gateway import FILE``: chat history into memory, through the gRPC service.

Each line of the file (:mod:`~gateway_http.importing.lines`) is checked whole before any of
its turns is sent. Each turn is one ``Writeback`` with its ``occurred_at`` and an episode id of
its own, started in the order of the file, up to :data:`WINDOW` at a time, and is noted in the
progress file (:mod:`~gateway_http.importing.ledger`) once the service has it, so a run
stopped anywhere goes on where it stopped. What the service refuses as bad input makes the
line bad: the turns of that line stored already are deleted again, so a bad line leaves
nothing behind. The service being away (``UNAVAILABLE``, a timeout) is waited out for about
30 s, then the import stops, to be run again.

A turn is stored once even across a SIGKILL: the turns whose answers the kill cut off are sent
again with the same text, time and episode id, which the memory service knows (one it stored
lately, or one waiting in its outbox, is not stored again). Only if the service restarted
in between may such a turn, at most :data:`WINDOW` of them, be stored again (the embedded
store then still keeps one copy).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO, TypeVar

from arona_grpc.config import Settings
from arona_grpc.scopes import principal_error
from gateway_http.errors import ErrorKind, GatewayError
from gateway_http.grpc_channel import open_memory_channel
from gateway_http.importing.display import Progress
from gateway_http.importing.ledger import Ledger, LedgerError
from gateway_http.importing.lines import BadLine, ImportLine, Turn, parse_line
from gateway_http.memory_client import KeptEpisode, MemoryClient, command_client

T = TypeVar("T")

# How long the service may be away before the import stops: waits of 0.5, 1, 2, 4, 8, 16 s;
# at the start, before anything is sent, 0.5, 1 and 2 s.
RETRIES = 6
STATUS_RETRIES = 3
FIRST_RETRY_S = 0.5
# A Writeback waits for one Philia store (and, during an outage, for the outbox).
CALL_MARGIN_S = 2.0
# Turns sent at a time. A store commits the writes that come together in one transaction
# (the embedded store waits 10 ms for company), so one at a time would be about 70 turns/s;
# 32 at a time, about 1,500 (lexical store, loaded 2-core machine).
WINDOW = 32


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
    concurrency: int = WINDOW,
) -> int:
    """Run an import from the command line; its exit code (0, 1: bad lines, 2: stopped,
    130: interrupted)."""
    # The import reports every failure itself, in its own words: the memory client's log
    # line for a failed call would only repeat it.
    logging.getLogger("gateway_http.memory_client").setLevel(logging.ERROR)
    try:
        return asyncio.run(
            run_import(
                settings,
                file,
                user=user,
                progress_path=progress,
                check=check,
                window=concurrency,
                out=sys.stdout,
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
    window: int = WINDOW,
    out: TextIO,
    err: TextIO | None = None,
) -> int:
    """Import ``file``; the exit code (see :func:`import_command`). Raises
    :class:`ImportStopped` when it cannot run or go on (after printing how far it got)."""
    err = err if err is not None else sys.stderr
    if window < 1:
        raise ImportStopped("--concurrency must be at least 1")
    if user is not None:
        # A principal, as a chat's caller is: a line's `user` narrows it after a '/'.
        problem = principal_error(user)
        if problem is not None:
            raise ImportStopped(f"--user (a JWT sub or key:NAME) {problem}")
    total = _count_lines(file)
    # Part of every turn's key: the same file imported elsewhere is imported again there.
    destination = f"{settings.grpc_targets[0]}\n{user or ''}"
    shown = Progress(err, total, checking=check)
    if check:
        for number, raw in _lines(file):
            try:
                parse_line(raw, principal=user, destination=destination)
            except BadLine as exc:
                shown.say(f"{file}:{number}: {exc}")
                shown.line_done(bad=True)
                continue
            shown.line_done()
        shown.finish()
        print(
            f"checked {_many(shown.lines, 'line')}: {shown.lines - shown.bad:,} valid, "
            f"{shown.bad:,} bad",
            file=out,
        )
        return 1 if shown.bad else 0
    try:
        ledger = Ledger(progress_path or file.with_name(file.name + ".progress"))
    except LedgerError as exc:
        raise ImportStopped(str(exc)) from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    channel = open_memory_channel(settings)
    client = command_client(settings, channel)
    importer = _Importer(settings, client, ledger, shown, stop, window)
    try:
        try:
            user_scoped = await importer.check_service()
        except _Interrupted:
            return 130
        for number, raw in _lines(file):
            if importer.halted:
                break
            try:
                line = parse_line(raw, principal=user, destination=destination)
            except BadLine as exc:
                importer.bad(file, number, str(exc))
                continue
            if user_scoped and not line.scope:
                importer.bad(
                    file,
                    number,
                    "no user: the memory service keeps each user's memory apart "
                    "(ARONA_MEMORY_SCOPE=user); pass --user or give the line a 'user'",
                )
                continue
            await importer.start(file, number, line)
        await importer.drain()
        shown.finish()
    except BaseException:
        await importer.drain()
        shown.finish()
        if shown.lines:
            print(_summary(importer.tally), file=out)  # how far it got
        raise
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        ledger.close()
        await channel.close(None)
    print(_summary(importer.tally), file=out)
    if importer.failure is not None:
        raise importer.failure
    if stop.is_set() and shown.lines < total:
        print(
            f"stopped after {shown.lines:,} of {total:,} lines; run the same command again "
            "to go on",
            file=out,
        )
        return 130
    return 1 if importer.tally.bad else 0


@dataclass
class _Line:
    """One line on its way: its turns in flight, and what became of the others."""

    file: Path
    number: int
    line: ImportLine
    in_flight: int = 0
    sent: int = 0
    # Every turn not imported yet has been started.
    started: bool = False
    # Some turn was not sent (the import stopped): the line is for the next run.
    unfinished: bool = False
    # Why the service refused one of its turns.
    refused: str | None = None
    done: bool = False


class _Importer:
    """Sends turns, up to ``window`` at a time, in the order of the file."""

    def __init__(
        self,
        settings: Settings,
        client: MemoryClient,
        ledger: Ledger,
        shown: Progress,
        stop: asyncio.Event,
        window: int,
    ) -> None:
        self._client = client
        self._ledger = ledger
        self._shown = shown
        # Ctrl-C or SIGTERM: no more turns are started; those under way finish.
        self._stop = stop
        self._slots = asyncio.Semaphore(window)
        self._tasks: set[asyncio.Task[None]] = set()
        self._target = settings.grpc_targets[0]
        self._timeout_s = settings.memory_timeout_s + CALL_MARGIN_S
        self.tally = Tally()
        # Why the import cannot go on (the service away too long, the credentials refused).
        self.failure: ImportStopped | None = None

    @property
    def halted(self) -> bool:
        return self._stop.is_set() or self.failure is not None

    async def check_service(self) -> bool:
        """Whether the service keeps each user's memory apart; :class:`ImportStopped` when
        it cannot be reached or stores nothing."""
        try:
            # Waited for a little (the service starting, a loaded machine), not for long.
            status = await self._retrying(lambda: self._client.status(1), STATUS_RETRIES)
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

    def bad(self, file: Path, number: int, reason: str) -> None:
        self.tally.bad += 1
        self._shown.say(f"{file}:{number}: {reason}")
        self._shown.line_done()

    async def start(self, file: Path, number: int, line: ImportLine) -> None:
        """Start sending the turns of ``line`` not imported yet (waiting for room in the
        window); its outcome is counted and shown once they have all ended."""
        pending = [turn for turn in line.turns if not self._ledger.done(turn.key)]
        if not pending:
            # Turns all in memory: an earlier run imported the line. No turns at all (a tool
            # loop's step, stored with the loop's last line): imported as it is.
            if line.turns:
                self.tally.skipped += 1
            else:
                self.tally.imported += 1
            self._shown.line_done()
            return
        state = _Line(file, number, line)
        for turn in pending:
            await self._slots.acquire()
            if self.halted or state.refused is not None:
                self._slots.release()
                state.unfinished = state.refused is None
                break
            state.in_flight += 1
            task = asyncio.get_running_loop().create_task(self._send(state, turn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        state.started = True
        await self._settle(state)

    async def drain(self) -> None:
        """Wait for every turn (and line) under way."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    async def _send(self, state: _Line, turn: Turn) -> None:
        try:
            kept = await self._keep(state.line, turn)
            if not kept.stored and not kept.queued:
                # Nothing to store (the service found no text), unless writeback went off.
                await self.check_service()
            try:
                self._ledger.mark(turn.key, kept.node_id)
            except OSError as exc:
                raise ImportStopped(
                    f"cannot write the progress file {self._ledger.path}: {exc.strerror or exc}"
                ) from None
            self.tally.queued += kept.queued
            state.sent += 1
        except BadLine as exc:
            if state.refused is None:
                state.refused = str(exc)
        except ImportStopped as exc:
            state.unfinished = True
            if self.failure is None:
                self.failure = exc
        except _Interrupted:
            state.unfinished = True
        finally:
            self._slots.release()
            state.in_flight -= 1
        await self._settle(state)

    async def _settle(self, state: _Line) -> None:
        """Count and show a line once every turn started for it has ended (once)."""
        if state.done or not state.started or state.in_flight:
            return
        state.done = True
        if state.refused is not None:
            self.bad(state.file, state.number, await self._undo(state.line, state.refused))
        elif not state.unfinished:
            self.tally.imported += 1
            self.tally.episodes += state.sent
            self._shown.line_done(state.sent)
        else:
            self.tally.episodes += state.sent

    async def _keep(self, line: ImportLine, turn: Turn) -> KeptEpisode:
        try:
            return await self._retrying(
                lambda: self._client.keep_episode(
                    turn.user,
                    turn.assistant,
                    line.scope,
                    f"import:{turn.key}",
                    turn.occurred_at,
                    self._timeout_s,
                ),
                RETRIES,
            )
        except GatewayError as exc:
            if exc.kind is ErrorKind.BAD_INPUT:
                raise BadLine(f"the memory service refused it: {exc.message}") from None
            raise ImportStopped(
                f"{self._unreachable(exc)}; run the same command again to go on"
            ) from None

    async def _retrying(self, call: Callable[[], Awaitable[T]], retries: int) -> T:
        """``call()``, made again after waits of 0.5, 1, 2… s while the service is away
        (``UNAVAILABLE``, a timeout), ``retries`` times at most; :class:`_Interrupted` when
        the import is stopped meanwhile."""
        delay_s = FIRST_RETRY_S
        for attempt in range(retries + 1):
            try:
                return await call()
            except GatewayError as exc:
                away = exc.kind in (ErrorKind.UNAVAILABLE, ErrorKind.TIMEOUT)
                if not away or attempt == retries:
                    raise
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay_s):
                    await self._stop.wait()
            if self.halted:
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
    text = f"imported {_many(tally.imported, 'line')} ({_many(tally.episodes, 'episode')}"
    if tally.queued:
        text += f", {tally.queued:,} of them queued in the memory service's outbox"
    text += ")"
    if tally.skipped:
        text += f"; {_many(tally.skipped, 'line')} already imported"
    if tally.bad:
        text += f"; {_many(tally.bad, 'bad line')} (listed above; nothing of them is stored)"
    return text


def _many(count: int, thing: str) -> str:
    return f"{count:,} {thing}" + ("" if count == 1 else "s")


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
