"""A data directory the gateway cannot write: one line at start, a visible state at run time.

Root writes through ``chmod 0500``, so the directory is made unwritable the ways a server
meets it: a path through a regular file, a read-only file system (a bind mount in a mount
namespace of the gateway's own), another user's directory (the gateway run as ``nobody``
with ``setpriv``), and at run time a disk that fills up (a small tmpfs, in the gateway's own
mount namespace, filled while it serves). A read-only remount cannot be done at run time:
the kernel refuses it (EBUSY) while a file on the mount is open for writing, as the
gateway's journal and databases are. The mount namespaces need root (CAP_SYS_ADMIN); without
it those cases are skipped, and fail under ``CI=true``. ``nobody`` runs the gateway from
wherever this checkout is (:mod:`tests.support.served`); when it cannot, that case is skipped
with the reason, under ``CI=true`` too: the checkout's place is no fault of the gateway.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.served import COMMAND, cannot_run_as, gateway_env, level_of, run

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]

# Turns sent while the disk is full: every one of them used to log two ERROR lines or more.
TURNS = 100


def _can_unshare() -> bool:
    try:
        done = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "true"],
            capture_output=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _needs(ok: bool, what: str) -> None:
    if not ok:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{what} is required under CI", pytrace=False)
        pytest.skip(f"{what} is not available here")


def _refusal(data_dir: Path, reason: str) -> str:
    return (
        f"arona-gateway: error: ARONA_DATA_DIR {data_dir} is not a writable directory "
        f"({reason}): make it writable for this user, or set ARONA_DATA_DIR to one that is\n"
    )


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory other users may enter (pytest's own is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="arona-unwritable-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        subprocess.run(["rm", "-rf", str(path)], check=False)


@pytest.mark.parametrize("command", ["serve", "up", "store"])
async def test_a_data_directory_under_a_file_is_one_line(tmp_path: Path, command: str) -> None:
    (tmp_path / "a-file").write_text("")
    data_dir = tmp_path / "a-file" / "data"
    assert await run(data_dir, command) == (2, _refusal(data_dir, "Not a directory"))


async def test_a_read_only_data_directory_is_one_line(tmp_path: Path) -> None:
    _needs(_can_unshare(), "a mount namespace (unshare, as root)")
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    script = (
        f'mount --bind "{data_dir}" "{data_dir}" && '
        f'mount -o remount,ro,bind "{data_dir}" "{data_dir}" && exec "$@"'
    )
    process = await asyncio.create_subprocess_exec(
        *("unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"),
        *(COMMAND, "serve"),
        env=gateway_env(data_dir),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(process.communicate(), 60)
    assert (process.returncode, err.decode()) == (
        2,
        _refusal(data_dir, "Read-only file system"),
    )


async def test_another_users_data_directory_is_one_line(shared_tmp: Path) -> None:
    _needs(os.geteuid() == 0, "root (to run the gateway as nobody)")
    why_not = cannot_run_as("nobody")
    if why_not is not None:
        pytest.skip(why_not)
    data_dir = shared_tmp / "data"
    data_dir.mkdir(mode=0o755)  # root's: nobody may read it, not write it
    assert await run(data_dir, "serve", user="nobody") == (
        2,
        _refusal(data_dir, "Permission denied"),
    )


class _Up:
    """``arona-gateway up`` on a 64 MB tmpfs of its own (in its own mount namespace)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.log: list[str] = []
        self.url = ""
        self.jwt = ""
        self.process: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        script = f'mount -t tmpfs -o size=64m tmpfs "{self.data_dir}" && exec "$@"'
        self.process = await asyncio.create_subprocess_exec(
            *("unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"),
            *(COMMAND, "up"),
            env=gateway_env(self.data_dir),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert self.process.stdout is not None
        banner = ""
        while "Ctrl-C stops everything." not in banner:
            raw = await asyncio.wait_for(self.process.stdout.readline(), 60)
            assert raw, "up stopped before it served"
            banner += raw.decode()
        url = re.search(r"HTTP\s+(http://\S+)", banner)
        jwt = re.search(r"^  JWT=(\S+)$", banner, re.MULTILINE)
        assert url and jwt, banner
        self.url, self.jwt = url.group(1), jwt.group(1)
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        async for raw in self.process.stderr:
            self.log.append(raw.decode().rstrip("\n"))

    def inside(self, *argv: str) -> None:
        """Run a command in the gateway's mount namespace (where its tmpfs is)."""
        assert self.process is not None
        nsenter = ("nsenter", "--target", str(self.process.pid), "--mount")
        subprocess.run([*nsenter, *argv], check=True, capture_output=True, timeout=60)

    async def stop(self) -> None:
        assert self.process is not None
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGINT)
        try:
            await asyncio.wait_for(self.process.wait(), 60)
        finally:
            if self.process.returncode is None:
                self.process.kill()
                await self.process.wait()
        if self._reader is not None:
            await asyncio.wait_for(self._reader, 30)


async def _status(client: httpx.AsyncClient, up: _Up) -> dict[str, Any]:
    request = {"jsonrpc": "2.0", "id": 1, "method": "memory.status"}
    reply = await client.post(
        f"{up.url}/api/rpc", json=request, headers={"Authorization": f"Bearer {up.jwt}"}
    )
    result: dict[str, Any] = reply.json()["result"]
    return result


async def _failing(client: httpx.AsyncClient, up: _Up) -> dict[str, float]:
    """``arona_storage_write_failing`` by part, from ``/metrics``."""
    exposition = (await client.get(f"{up.url}/metrics")).text
    found = re.findall(r'^arona_storage_write_failing\{part="([^"]+)"\} (\S+)$', exposition, re.M)
    return {part: float(value) for part, value in found}


async def test_a_full_disk_at_run_time_is_said_once_and_shown_until_it_ends(
    tmp_path: Path,
) -> None:
    _needs(_can_unshare(), "a mount namespace (unshare, as root)")
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    up = _Up(data_dir)
    await up.start()
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            chat = {"model": "echo", "messages": [{"role": "user", "content": "I like oolong"}]}
            assert (
                await client.post(f"{up.url}/v1/chat/completions", json=chat)
            ).status_code == 200
            assert (await _status(client, up))["storage_faults"] == []
            assert set((await _failing(client, up)).values()) == {0.0}

            # The disk fills up (dd stops at ENOSPC), while turns keep coming.
            up.inside("sh", "-c", f'dd if=/dev/zero of="{data_dir}/fill" bs=1M || true')
            before = len(up.log)
            for i in range(TURNS):
                turn = {"model": "echo", "messages": [{"role": "user", "content": f"fact {i}"}]}
                reply = await client.post(f"{up.url}/v1/chat/completions", json=turn)
                assert reply.status_code == 200  # chat goes on
            status = await _status(client, up)
            faults = {f["part"]: f for f in status["storage_faults"]}
            assert {"outbox", "journal"} <= set(faults), status
            assert faults["outbox"]["file"] == "outbox.db"
            assert faults["journal"]["reason"] == "No space left on device"
            assert faults["outbox"]["failed_writes"] >= 1
            # What the outbox could not keep is lost, not a depth of 0.
            assert status["outbox_depth"] is None
            failing = await _failing(client, up)
            assert (failing["outbox"], failing["journal"]) == (1.0, 1.0)
            during = up.log[before:]

            # Room again: the journal's next write, and the outbox's directory tried again,
            # end the faults (one line each).
            up.inside("rm", f"{data_dir}/fill")
            deadline = time.monotonic() + 30
            while True:
                assert (await client.post(f"{up.url}/v1/chat/completions", json=chat)).is_success
                status = await _status(client, up)
                if not status["storage_faults"] or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.25)
            assert status["storage_faults"] == [] and status["outbox_depth"] is not None
            assert set((await _failing(client, up)).values()) == {0.0}
    finally:
        await up.stop()
    text = "\n".join(up.log)
    assert "Traceback" not in text
    errors = [line for line in during if level_of(line) == "ERROR"]
    # One ERROR line per part that failed (the memory store's database, the outbox, the
    # journal, and the episode index when a writeback the store took in is indexed while the
    # disk is full), not one per turn. The other lines are the writebacks that failed before
    # the memory breaker opened (as many as were in flight then) and the breaker's own.
    assert len(errors) <= 4, errors
    assert sum("cannot write the episode index" in line for line in errors) <= 1, errors
    assert sum("cannot write the outbox" in line for line in errors) == 1, errors
    assert sum("cannot write the journal" in line for line in errors) == 1, errors
    assert len(during) < TURNS // 2, during
    assert any("the journal" in line and "can be written again" in line for line in up.log)
    assert any("the outbox" in line and "can be written again" in line for line in up.log)
