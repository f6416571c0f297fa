"""``arona-gateway serve --workers N``: every core of one machine, one port.

The supervisor binds the HTTP port once, starts the gRPC ``MemoryService`` in a process of
its own (``serve --only grpc``), then N HTTP worker processes (``serve --only http``) that
all accept on the one inherited listening socket, each calling that gRPC service. It imports
neither gRPC nor asyncio machinery of its own: children are fresh interpreters, so nothing is
forked from a process that holds threads or sockets it should not share.

SIGTERM or SIGINT drains everything in order: the workers first (in-flight turns finish,
writebacks get their grace), then the gRPC service (its outbox is kept). A child that dies
on its own stops the others, and the supervisor exits non-zero with one line saying which.

The order holds when the signal reaches every process at once too (systemd's default
``KillMode=control-group``, Ctrl-C in a terminal, ``kill -- -PGID``): the gRPC service
ignores SIGINT and SIGTERM and stops only when its standard input, a pipe from the
supervisor, closes. The supervisor closes it once the workers have ended (or when it dies
itself, so the service never outlives it).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence

from arona_grpc.config import Settings

# What a child logs once it serves: the gRPC service its address
# (gateway_http.commands.serving.serve), an HTTP worker uvicorn's end of start-up.
_GRPC_READY = re.compile(r"serving on (\S+)")
_HTTP_READY = re.compile(r"Application startup (complete)")
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
# The hidden ``serve`` flag of a child that stops when the supervisor closes its stdin.
SUPERVISED_FLAG = "--supervised"


class WorkersError(RuntimeError):
    """The workers could not start, or one of them died (one line)."""


class _Child:
    """One child process whose stderr is copied to ours, line by line."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        fds: Sequence[int],
        ready: re.Pattern[str],
    ):
        self.name = name
        self._ready_line = ready
        self.ready = threading.Event()
        self.address: str | None = None
        # A supervised child is stopped by closing its stdin, not by a signal.
        self.supervised = SUPERVISED_FLAG in argv
        self.process = subprocess.Popen(
            list(argv),
            env=dict(env),
            pass_fds=tuple(fds),
            stdin=subprocess.PIPE if self.supervised else subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self._copier = threading.Thread(target=self._copy, name=f"log-{name}", daemon=True)
        self._copier.start()

    def _copy(self) -> None:
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            sys.stderr.buffer.write(raw)
            sys.stderr.buffer.flush()
            if not self.ready.is_set():
                found = self._ready_line.search(raw.decode("utf-8", "replace"))
                if found:
                    self.address = found.group(1).rstrip(",")
                    self.ready.set()
        self.ready.set()  # ended: nobody waits for it any more

    def wait_ready(self, timeout_s: float) -> None:
        if not self.ready.wait(timeout_s) or self.process.poll() is not None:
            raise WorkersError(f"the {self.name} did not start (see its log above)")

    def stop(self) -> None:
        """Ask the child to stop: close its stdin (supervised) or send it SIGTERM."""
        if self.supervised:
            assert self.process.stdin is not None
            self.process.stdin.close()
        elif self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> int:
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
    return port


def run_workers(
    settings: Settings,
    env: Mapping[str, str],
    workers: int,
    listener: socket.socket,
    *,
    grpc_part: bool = True,
) -> int:
    """Run the gRPC service (unless ``grpc_part`` is false: ``--only http``) and ``workers``
    HTTP workers on ``listener``; the exit code."""
    base = dict(env)
    if METRICS_DIR_ENV not in base:
        # Metrics of N processes add up through one directory (prometheus_client's
        # multiprocess mode); a fresh one per run, so no dead process's counts linger.
        metrics = settings.data_dir / "metrics"
        metrics.mkdir(parents=True, exist_ok=True)
        base[METRICS_DIR_ENV] = tempfile.mkdtemp(prefix="run-", dir=metrics)
    command = [sys.executable, "-m", "gateway_http.cli", "serve"]
    children: list[_Child] = []
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        grpc_env = dict(base)
        grpc_target: str | None = settings.effective_grpc_target
        if grpc_part:
            port = settings.grpc_port or _free_port(settings.grpc_host)
            grpc_env["ARONA_GRPC_PORT"] = str(port)
            argv = [*command, "--only", "grpc", SUPERVISED_FLAG]
            grpc_service = _Child("gRPC service", argv, grpc_env, (), _GRPC_READY)
            children.append(grpc_service)
            grpc_service.wait_ready(START_TIMEOUT_S)
            grpc_target = grpc_service.address
        assert grpc_target is not None
        worker_env = {**base, "ARONA_GRPC_TARGET": grpc_target}
        fd = listener.fileno()
        for index in range(workers):
            argv = [*command, "--only", "http", "--listen-fd", str(fd), "--worker", str(index)]
            children.append(_Child(f"HTTP worker {index}", argv, worker_env, (fd,), _HTTP_READY))
        for child in children[1:] if grpc_part else children:
            child.wait_ready(START_TIMEOUT_S)
        host, port = listener.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(
            f"serving on http://{shown}:{port} ({workers} HTTP workers), {grpc_target}",
            file=sys.stderr,
            flush=True,
        )
        died = _watch(children, stop)
    except WorkersError as exc:
        died = None
        print(f"arona-gateway: error: {exc}", file=sys.stderr, flush=True)
        _stop_all(children)
        return 2
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _stop_all(children)
    if died is not None:
        print(f"arona-gateway: error: the {died.name} exited unexpectedly", file=sys.stderr)
        return 1
    return 0


def _watch(children: list[_Child], stop: threading.Event) -> _Child | None:
    """Wait for a stop signal (None) or for a child to end on its own (that child)."""
    while not stop.wait(0.2):
        for child in children:
            if child.process.poll() is not None:
                return child
    return None


def _stop_all(children: list[_Child]) -> None:
    """HTTP workers first (they drain their turns and hand over their writebacks), then the
    gRPC service."""
    workers = [c for c in children if c.name.startswith("HTTP")]
    services = [c for c in children if not c.name.startswith("HTTP")]
    for group in (workers, services):
        for child in group:
            child.stop()
        for child in group:
            child.wait(STOP_TIMEOUT_S)


def listen_fd_socket(fd: int) -> socket.socket:
    """The listening socket a supervisor handed down as file descriptor ``fd``."""
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    return sock


def ignore_stop_signals() -> None:
    """A supervised child: SIGINT and SIGTERM meant for the whole process group are the
    supervisor's to act on (it stops this child after the HTTP workers)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def stop_when_supervisor_closes(stop: asyncio.Event) -> Callable[[], None]:
    """Set ``stop`` when stdin, the supervisor's pipe, reaches its end (closed by the
    supervisor, or the supervisor is gone); returns the function that stops watching."""
    loop = asyncio.get_running_loop()
    fd = sys.stdin.fileno()

    def readable() -> None:
        try:
            more = os.read(fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            more = b""
        if not more:
            loop.remove_reader(fd)
            stop.set()

    loop.add_reader(fd, readable)

    def unwatch() -> None:
        loop.remove_reader(fd)

    return unwatch
