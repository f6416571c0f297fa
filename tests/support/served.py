"""``arona-gateway serve`` as a real process, with every line it logs, for the fault tests
whose point is what an operator reads in the log.

:func:`served` starts the command on ``127.0.0.1`` port 0, waits until it serves, and keeps
reading its stderr into :attr:`Served.log` as it comes; :meth:`Served.wait_for` awaits a
line (no sleeping), and on the way out the process gets SIGTERM and the rest of its log is
read. :func:`run` runs a command that is expected to stop by itself (a refused start).

Both run the command as another system user when asked (``setpriv``, as root). The command is
this checkout's, from its virtual environment; a checkout in a directory other users cannot
enter (root's home, ``mktemp -d``) is out of that user's reach, so the user is then given
``CAP_DAC_READ_SEARCH`` too: the right to enter and read any directory, never to write one, so
what it may write (the point of such a test) is unchanged. Copying the environment somewhere
readable instead would mean some hundreds of MB for each run. :func:`cannot_run_as` says why
a user cannot run it even so.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import pwd
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

COMMAND = str(Path(sys.executable).parent / "arona-gateway")
# "2026-12-02 04:56:03,614 INFO gateway_http.bodies [request id]: message"
_LINE = re.compile(r"^\S+ \S+ (?P<level>[A-Z]+) (?P<logger>[\w.]+)")


def gateway_env(data_dir: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment without any ARONA_ variable, then the data directory, ports 0 and
    ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARONA_")}
    env.update(ARONA_DATA_DIR=str(data_dir), ARONA_HTTP_PORT="0", ARONA_GRPC_PORT="0")
    env.update(extra or {})
    return env


# Enter and read any directory, write none (capabilities(7)); kept across exec as ambient.
_READ_ANYWHERE = ("--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search")


@functools.cache
def _launch(user: str) -> tuple[str, ...] | str:
    """The ``setpriv`` words that run this checkout's gateway as ``user``, or why none do."""
    entry = pwd.getpwnam(user)
    ids = ("setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--clear-groups")
    failed: list[str] = []
    for extra in ((), _READ_ANYWHERE):
        try:
            done = subprocess.run(
                [*ids, *extra, COMMAND, "--help"], capture_output=True, timeout=60, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            failed.append(str(exc))
            continue
        if done.returncode == 0:
            return (*ids, *extra)
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        failed.append(lines[-1] if lines else f"exit code {done.returncode}")
    return (
        f"{user} cannot run this checkout's {COMMAND} ({failed[0]}), not even with "
        f"CAP_DAC_READ_SEARCH ({failed[1]})"
    )


def cannot_run_as(user: str) -> str | None:
    """Why the system user ``user`` cannot run this checkout's gateway; None when it can."""
    launch = _launch(user)
    return launch if isinstance(launch, str) else None


def _as_user(user: str | None, command: list[str]) -> list[str]:
    """``command``, run as the system user ``user`` (its uid and group) when one is given."""
    if user is None:
        return command
    launch = _launch(user)
    assert not isinstance(launch, str), launch
    return [*launch, *command]


def level_of(line: str) -> str | None:
    """The level of a log line (``INFO``, ``WARNING``…), None for a line that is not one."""
    found = _LINE.match(line)
    return found.group("level") if found else None


@dataclass
class Served:
    process: asyncio.subprocess.Process
    url: str
    log: list[str] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _reader: asyncio.Task[None] | None = None

    def matching(self, text: str) -> list[str]:
        return [line for line in self.log if text in line]

    async def wait_for(self, text: str, count: int = 1, timeout_s: float = 30.0) -> list[str]:
        """The lines holding ``text``, once there are ``count`` of them."""
        async with asyncio.timeout(timeout_s):
            while len(self.matching(text)) < count:
                self._changed.clear()
                await self._changed.wait()
        return self.matching(text)

    async def ended(self, timeout_s: float = 60.0) -> None:
        """Wait for the process to end and for the rest of its log."""
        await asyncio.wait_for(self.process.wait(), timeout_s)
        if self._reader is not None:
            await asyncio.wait_for(self._reader, timeout_s)

    async def _read(self) -> None:
        assert self.process.stderr is not None
        async for raw in self.process.stderr:
            self.log.append(raw.decode().rstrip("\n"))
            self._changed.set()


@contextlib.asynccontextmanager
async def served(
    data_dir: Path,
    *argv: str,
    env: Mapping[str, str] | None = None,
    user: str | None = None,
    new_session: bool = False,
) -> AsyncIterator[Served]:
    """``arona-gateway serve ARGV`` until the block ends (then SIGTERM, and its whole log).

    ``user`` runs it as that system user (``setpriv``, as root), the way a service account
    runs it, so that file permissions apply to it; ``new_session`` in a session (and process
    group) of its own, as a service manager starts it.
    """
    command = _as_user(user, [COMMAND, "serve", *argv])
    process = await asyncio.create_subprocess_exec(
        *command,
        env=gateway_env(data_dir, env),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=new_session,
    )
    assert process.stderr is not None
    log: list[str] = []
    url = ""
    # Under --workers, the supervisor's own line comes once every child serves.
    ready = (
        re.compile(r"^serving on (http://[\d.:]+) \(\d+ HTTP workers\)")
        if "--workers" in argv
        else re.compile(r"serving on (http://[\d.:]+)")
    )
    try:
        while not url:
            raw = await asyncio.wait_for(process.stderr.readline(), 60)
            assert raw, "the gateway stopped before it served:\n" + "\n".join(log)
            log.append(raw.decode().rstrip("\n"))
            found = ready.search(log[-1])
            url = found.group(1) if found else ""
        gateway = Served(process, url, log)
        gateway._reader = asyncio.create_task(gateway._read())
        if "--workers" not in argv:
            await gateway.wait_for("Application startup complete")
        yield gateway
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 60)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert gateway._reader is not None
    await asyncio.wait_for(gateway._reader, 30)


async def run(
    data_dir: Path, *argv: str, env: Mapping[str, str] | None = None, user: str | None = None
) -> tuple[int, str]:
    """``arona-gateway ARGV`` to its end: the exit code and all it wrote to stderr."""
    code, _, err = await run_both(data_dir, *argv, env=env, user=user)
    return code, err


async def run_both(
    data_dir: Path, *argv: str, env: Mapping[str, str] | None = None, user: str | None = None
) -> tuple[int, str, str]:
    """``arona-gateway ARGV`` to its end: the exit code, its stdout and its stderr."""
    command = _as_user(user, [COMMAND, *argv])
    process = await asyncio.create_subprocess_exec(
        *command,
        env=gateway_env(data_dir, env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()
