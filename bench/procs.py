"""Child processes of a benchmark run: started with their output in log files, waited on for a
readiness line with a deadline, and stopped with SIGTERM (then SIGKILL) by their own pid; and
the CPU time of a set of processes, read from ``/proc``."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


class ProcError(RuntimeError):
    """A child process did not come up; the message names it and the tail of its log."""


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Proc:
    """One child process whose stdout and stderr go to ``<logs>/<name>.log``."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        logs: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.log = logs / f"{name}.log"
        with self.log.open("wb") as out:
            self.popen = subprocess.Popen(
                list(argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(env) if env is not None else None,
                cwd=cwd,
            )

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        """The first match of ``pattern`` in the log, polled until ``timeout_s`` passes."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                found = regex.search(self.log.read_text(errors="replace"))
            except OSError:
                found = None
            if found:
                return found
            if self.popen.poll() is not None:
                raise ProcError(f"{self.name} exited ({self.popen.returncode}):\n{_tail(self.log)}")
            time.sleep(0.05)
        raise ProcError(f"{self.name} not ready after {timeout_s:.0f} s:\n{_tail(self.log)}")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)


def free_port() -> int:
    """A port free right now on 127.0.0.1, for a child that cannot report the one it bound."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http(port: int, path: str, timeout_s: float, proc: Proc) -> None:
    """Poll ``GET path`` on ``127.0.0.1:port`` until it answers 200 or ``timeout_s`` passes."""
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise ProcError(f"{proc.name} exited ({proc.popen.returncode}):\n{_tail(proc.log)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
                sock.sendall(request)
                if sock.recv(64).startswith((b"HTTP/1.1 200", b"HTTP/1.0 200")):
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise ProcError(f"{proc.name} not ready after {timeout_s:.0f} s:\n{_tail(proc.log)}")


def clean_env(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without any ``ARONA_*`` or ``OTEL_*`` setting (no row
    traces unless it says so), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ARONA_", "OTEL_"))}
    env.update(extra)
    return env


def cpu_ns(pids: Sequence[int]) -> int | None:
    """CPU time so far of every thread of ``pids``, in nanoseconds; None without ``/proc``.

    Read from ``/proc/<pid>/task/<tid>/schedstat`` (its first field: time on a CPU), so a
    thread that has exited no longer counts: take two readings of the same long-lived
    threads and use the difference.
    """
    if not Path("/proc/self/task").is_dir():
        return None
    total = 0
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue  # it has exited
        for task in tasks:
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # a thread that ended meanwhile
    return total


def _children(pid: int) -> list[int]:
    """The child processes of ``pid``: from ``/proc/<pid>/task/*/children`` where the kernel
    has it, else from the parent pid of every process in ``/proc``."""
    tasks = Path(f"/proc/{pid}/task")
    try:
        files = [task / "children" for task in tasks.iterdir()]
    except OSError:
        return []  # it has exited
    if files and files[0].exists():
        found: list[int] = []
        for file in files:
            try:
                found += [int(word) for word in file.read_text().split()]
            except (OSError, ValueError):
                continue
        return found
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The parent pid is the second field after the command name, which may hold
            # spaces and parentheses itself: split after its last ")".
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                children.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return children


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (children, their children, ...), ``pid`` first."""
    tree = [pid]
    for parent in tree:  # grows while it is walked: breadth first
        tree += [child for child in _children(parent) if child not in tree]
    return tree
