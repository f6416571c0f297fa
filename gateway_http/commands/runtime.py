"""What every command stands on: the one-line failure that stops a command (:class:`StartupError`),
running a coroutine on uvloop, logging configured once, the backends file and ``ARONA_DATA_DIR``
checked, the dev secrets of ``up``, listening sockets bound early, the cycle collector settled for a
server, and gRPC's I/O manager preferred.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import secrets
import socket
import tempfile
from collections.abc import (
    Coroutine,
    Iterator,
    Mapping,
    MutableMapping,
)
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from arona_grpc.config import Settings

if TYPE_CHECKING:
    from gateway_http.upstream.backends_file import BackendsFile

logger = logging.getLogger("arona_gateway")

DEV_SECRETS_FILE = "dev-secrets.json"
STORE_DB_FILE = "memory.db"
# The store's memories in PostgreSQL with pgvector (arona_store.pg) instead of STORE_DB_FILE.
STORE_DATABASE_ENV = "ARONA_STORE_DATABASE_URL"
STORE_DEFAULT_PORT = 8424
HTTP_GRACE_S = 10.0
GRPC_GRACE_S = 5.0
# Allocations (net, of objects the cycle collector tracks) between two collections of its
# youngest generation; Python's default is 700 (see settle_gc).
GC_YOUNG_THRESHOLD = 5000


class StartupError(Exception):
    """A start-up failure explained in one line."""


class Uvicorn(uvicorn.Server):
    # Signals are handled once for every part by run_parts, not by uvicorn.
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def run_main(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` on uvloop (installed with uvicorn[standard]) or, without it, plain asyncio.

    uvloop roughly halves the event-loop cost of a turn (socket writes, selector wake-ups,
    callbacks), and grpc.aio, uvicorn and websockets all run on it unchanged.
    """
    try:
        import uvloop
    except ImportError:  # pragma: no cover - a platform without uvloop wheels
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)


def settle_gc() -> None:
    """Tune the cycle collector for a long-running server, once it has started.

    Start-up leaves about 75,000 long-lived objects (modules, gRPC, protobuf, the apps), and
    every full collection walked them all: a 30 ms pause of the whole event loop every thousand
    turns or so, which was most of the gateway's p99 at 32 in flight. Frozen, they are never
    scanned again. A turn also allocates hundreds of short-lived containers (coroutines, tasks,
    gRPC call state; grpc.aio leaves a few reference cycles per call), and with Python's default
    threshold the youngest generation was collected about 170 times per 2,200 memory turns,
    0.04 ms of CPU per turn; at :data:`GC_YOUNG_THRESHOLD`, 6 times (bench/README.md).
    """
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, oldest)


def configure_logging(settings: Settings, backends: BackendsFile | None = None) -> None:
    from arona_grpc.logs import configure_logging

    masked = settings.secret_values + (backends.secret_values if backends is not None else ())
    configure_logging(settings.log_level, settings.log_format, masked)


def load_backends_file(settings: Settings, env: Mapping[str, str]) -> BackendsFile | None:
    """The checked backends file of ``ARONA_BACKENDS`` (its keys read from ``env``), or None
    when it is unset; a file with mistakes raises ``BackendsFileError``, one line each."""
    if settings.backends_file is None:
        return None
    from gateway_http.upstream.backends_file import load_backends

    return load_backends(settings.backends_file, env)


def listen_now(host: str, port: int) -> socket.socket:
    """Bind and listen now, so the real port is known and early clients queue."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
            sock.listen(2048)
        except OSError:
            sock.close()
            raise
    except OSError as exc:
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


def url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def check_data_dir(data_dir: Path) -> None:
    """``ARONA_DATA_DIR`` exists (made when missing) and takes a file, or one line saying
    what to do: every part keeps files there (conversations, the writeback journal, the
    outbox, the episode index, the embedded store's memories)."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".arona-write-check-", dir=data_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise StartupError(
            f"ARONA_DATA_DIR {data_dir} is not a writable directory "
            f"({exc.strerror or type(exc).__name__}): make it writable for this user, or set "
            "ARONA_DATA_DIR to one that is"
        ) from None


def load_dev_secrets(data_dir: Path) -> dict[str, str]:
    """The dev memory token and JWT secret, generated once under ``data_dir``."""
    path = data_dir / DEV_SECRETS_FILE
    if path.exists():
        try:
            stored = json.loads(path.read_text())
            if isinstance(stored.get("memory_token"), str) and isinstance(
                stored.get("jwt_secret"), str
            ):
                return {"memory_token": stored["memory_token"], "jwt_secret": stored["jwt_secret"]}
        except (OSError, ValueError, AttributeError):
            pass
        raise StartupError(f"{path} is unreadable; remove it to generate new dev secrets")
    data_dir.mkdir(parents=True, exist_ok=True)
    fresh = {"memory_token": secrets.token_urlsafe(24), "jwt_secret": secrets.token_urlsafe(48)}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(fresh, f)
    return fresh


# gRPC releases whose EventEngine client and listener were measured against the older I/O
# manager for this gateway's hop (see prefer_grpc_iomgr).
GRPC_IOMGR_RELEASES = ("1.85.",)
GRPC_IOMGR_EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def prefer_grpc_iomgr(env: MutableMapping[str, str]) -> None:
    """Run gRPC's client and listener on its long-standing I/O manager, not the EventEngine.

    Every chat turn makes two gRPC calls from the HTTP layer to the memory service. With
    grpcio 1.85 one unary call over loopback costs about a quarter less CPU on the I/O
    manager (168 against 224 µs per call at 32 in flight; 0.30 against 0.45 ms alone), which
    is the largest single cost of a turn (bench/README.md). gRPC reads the setting when it is
    first imported, so this runs before that; ``GRPC_EXPERIMENTS`` set by the user wins, and
    other gRPC releases keep their defaults (an experiment a release does not know is logged
    as an error).
    """
    if "GRPC_EXPERIMENTS" in env:
        return
    try:
        release = metadata.version("grpcio")
    except metadata.PackageNotFoundError:
        return
    if release.startswith(GRPC_IOMGR_RELEASES):
        env["GRPC_EXPERIMENTS"] = GRPC_IOMGR_EXPERIMENTS
