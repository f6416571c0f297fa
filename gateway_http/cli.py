"""The ``arona-gateway`` command line: ``up``, ``serve``, ``store``, ``token``, ``check-memory``,
``import``, ``migrate``, ``usage``, ``budget``.

The entry point is the only place that configures logging and reads the
environment (once, into :class:`~arona_grpc.config.Settings`). Every part runs
in one event loop; SIGINT/SIGTERM stop them in order: the HTTP listener first
(in-flight turns finish, pending writebacks get a grace period), then the gRPC
service, then the embedded store.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import os
import secrets
import shlex
import signal
import socket
import sys
import tempfile
from collections.abc import (
    AsyncIterator,
    Callable,
    Coroutine,
    Iterator,
    Mapping,
    MutableMapping,
    Sequence,
)
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from arona_grpc import tracing
from arona_grpc.config import ConfigError, Settings
from arona_grpc.redact import redact_url
from arona_store.ranking import Ranking, RankingError, ranking_from_env
from gateway_http.mcp.command import COMMAND as MCP_COMMAND
from gateway_http.mcp.command import mcp_command, mcp_parser

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
UP_TOKEN_TTL_S = 24 * 3600
# Allocations (net, of objects the cycle collector tracks) between two collections of its
# youngest generation; Python's default is 700 (see settle_gc).
GC_YOUNG_THRESHOLD = 5000


class StartupError(Exception):
    """A start-up failure explained in one line."""


class _Uvicorn(uvicorn.Server):
    # Signals are handled once for every part by run_parts, not by uvicorn.
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _run(main: Coroutine[Any, Any, None]) -> None:
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


def _configure_logging(settings: Settings, backends: BackendsFile | None = None) -> None:
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


def _listen(host: str, port: int) -> socket.socket:
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


def _url_host(host: str) -> str:
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


@dataclasses.dataclass
class Running:
    """Addresses of the parts that came up, for the start-up banner."""

    settings: Settings
    http_url: str | None = None
    grpc_target: str | None = None


async def run_parts(
    settings: Settings,
    *,
    grpc_part: bool = True,
    http_part: bool = True,
    on_ready: Callable[[Running], None] | None = None,
    stop: asyncio.Event | None = None,
    listen_fd: int | None = None,
    worker: int = 0,
    supervised: bool = False,
    backends: BackendsFile | None = None,
) -> None:
    """Run the gRPC service and/or the HTTP gateway until ``stop`` or a signal.

    ``backends`` is the checked backends file (``ARONA_BACKENDS``), if any.
    ``listen_fd`` is a listening socket handed down by ``serve --workers``; ``worker`` is
    this HTTP worker's number among them. ``supervised`` (the gRPC service of ``serve
    --workers``): no signal stops it, the end of its stdin does
    (:func:`gateway_http.workers.stop_when_supervisor_closes`).
    """
    from arona_grpc.database import DatabaseUnavailable, SchemaRefused, open_pool
    from arona_grpc.server import GrpcServer
    from gateway_http.app import create_app
    from gateway_http.edge import uvicorn_options

    stop = stop or asyncio.Event()
    pool: Any | None = None
    if settings.database_url:
        # One pool for the process, opened (and the schema migrated) before anything listens.
        try:
            pool = await open_pool(settings.database_url)
        except (DatabaseUnavailable, SchemaRefused) as exc:
            raise StartupError(str(exc)) from None
    loop = asyncio.get_running_loop()
    unwatch: Callable[[], None] | None = None
    if supervised:
        from gateway_http.workers import stop_when_supervisor_closes

        unwatch = stop_when_supervisor_closes(stop)
    running = Running(settings)
    metrics_collectors = []
    grpc_server: GrpcServer | None = None
    http_server: _Uvicorn | None = None

    def on_signal(sig: signal.Signals) -> None:
        # A second Ctrl-C forces the HTTP part out (as uvicorn's own does); a second SIGTERM
        # (a supervisor's, after the process group's) changes nothing.
        if stop.is_set() and sig == signal.SIGINT and http_server is not None:
            http_server.force_exit = True
        stop.set()

    if unwatch is None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
    http_task: asyncio.Task[None] | None = None
    try:
        if grpc_part:
            try:
                grpc_server = await GrpcServer.start(settings, pool=pool)
            except (OSError, RuntimeError) as exc:
                raise StartupError(
                    f"cannot listen on {settings.grpc_host}:{settings.grpc_port}: {exc}"
                ) from None
            running.grpc_target = grpc_server.target
            if grpc_server.domain.metrics is not None:
                # One process: its /metrics shows the gRPC service's metrics too.
                metrics_collectors.append(grpc_server.domain.metrics.collector)
            if not settings.grpc_target:
                # Port 0 asks for a free port: the HTTP layer must call the real one.
                settings = dataclasses.replace(settings, grpc_port=grpc_server.port)
        if http_part:
            if listen_fd is not None:
                from gateway_http.workers import listen_fd_socket

                sock = listen_fd_socket(listen_fd)
            else:
                sock = _listen(settings.http_host, settings.http_port)
            port = sock.getsockname()[1]
            config = uvicorn.Config(
                create_app(
                    settings,
                    metrics_collectors=metrics_collectors,
                    pool=pool,
                    worker=worker,
                    backends=backends,
                ),
                log_config=None,
                # Access logs would print WebSocket URLs, which may carry a JWT.
                access_log=False,
                timeout_graceful_shutdown=int(HTTP_GRACE_S),
                lifespan="on",
                # The header, body, WebSocket message and idle limits (gateway_http.edge).
                **uvicorn_options(settings),
            )
            http_server = _Uvicorn(config)
            http_task = asyncio.create_task(http_server.serve(sockets=[sock]))
            running.http_url = f"http://{_url_host(settings.http_host)}:{port}"
        if on_ready is not None:
            on_ready(running)
        waiters: set[asyncio.Future[Any]] = {asyncio.ensure_future(stop.wait())}
        if http_task is not None:
            waiters.add(http_task)
        done, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for waiter in pending:
            if waiter is not http_task:
                waiter.cancel()
        if http_task is not None and http_task in done:
            # uvicorn ended on its own: its lifespan failed at start-up.
            with contextlib.suppress(SystemExit, Exception):
                http_task.result()
            raise StartupError("the HTTP gateway failed to start (see the log above)")
    finally:
        if unwatch is not None:
            unwatch()
        if http_server is not None and http_task is not None:
            http_server.should_exit = True
            with contextlib.suppress(SystemExit, Exception, asyncio.CancelledError):
                await http_task
        if grpc_server is not None:
            await grpc_server.stop(GRPC_GRACE_S)
        if pool is not None:
            await pool.close()
        forget_live_metrics()
        if unwatch is None:
            # Only now: a second SIGTERM while the turns drain (the supervisor's, after the
            # process group's) must not find the default action and kill the drain.
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


def forget_live_metrics() -> None:
    """In multiprocess mode, drop this process's live gauges from the shared directory.

    ``prometheus_client`` keeps each process's values in ``PROMETHEUS_MULTIPROC_DIR``;
    counters and histograms of an ended process keep counting in the totals (as they must),
    live gauges must not. A no-op in one process.
    """
    from arona_grpc.metrics import multiprocess_dir

    directory = multiprocess_dir()
    if directory is not None:
        from prometheus_client.multiprocess import mark_process_dead

        mark_process_dead(os.getpid(), directory)  # type: ignore[no-untyped-call]


@contextlib.asynccontextmanager
async def embedded_store(
    db_path: Path,
    token: str,
    host: str,
    port: int,
    ranking: Ranking,
    database_url: str | None = None,
) -> AsyncIterator[str]:
    """Run the embedded Philia-compatible store (its memories in ``db_path``, or in the
    PostgreSQL database at ``database_url``); yields its URL (without the token)."""
    from arona_grpc.database import DatabaseUnavailable, SchemaRefused
    from arona_store.server import StoreServer

    try:
        store = await StoreServer.start(
            db_path=db_path,
            token=token,
            host=host,
            port=port,
            ranking=ranking,
            database_url=database_url,
        )
    except (DatabaseUnavailable, SchemaRefused) as exc:
        raise StartupError(str(exc)) from None
    except OSError as exc:
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    try:
        yield store.url
    finally:
        await store.stop()


_SCOPE_WORDS = {
    "shared": "one memory pool for every caller",
    "user": "each caller recalls only their own memories",
}


def _banner(
    running: Running,
    jwt_secret: str,
    upstream_echo: bool,
    store_url: str | None,
    backends: BackendsFile | None = None,
) -> str:
    """What ``up`` prints once it serves: its addresses, a JWT, and hints that work as
    printed in the mode it started in (run them from the directory ``up`` was started in)."""
    from gateway_http.auth import mint_token

    settings = running.settings
    # In user mode memory.status (and the console) are an admin's: the dev token is one, so
    # everything the banner offers works with it.
    admin = settings.user_scoped
    token = mint_token(jwt_secret, "dev", UP_TOKEN_TTL_S, admin=admin)
    http = running.http_url or ""
    grpc_target = running.grpc_target or ""
    # The chat hint asks for a model that is routed: echo, or the backends file's first one.
    model = (backends.example_model() if backends is not None else None) or "echo"
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "I prefer oolong tea"}]}
    )
    status = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "memory.status"})
    bearer = '-H "Authorization: Bearer $JWT" '
    # A turn needs a caller when REST takes keys (else 401) or memory is per user (else a
    # turn of nobody, which recalls and stores nothing); the JWT is one on REST as well.
    chat_bearer = bearer if settings.user_scoped or settings.api_keys else ""
    scope = settings.memory_scope
    lines = [
        "Arona Memory Gateway is up.",
        f"  HTTP     {http}  (REST /v1, JSON-RPC {http}/api/rpc)",
        f"  console  {http}/console  (sign in with the JWT below)",
        f"  gRPC     {grpc_target}  (arona.memory.v1.MemoryService)",
    ]
    if settings.metrics:
        lines.append(f"  metrics  {http}/metrics  (Prometheus; ARONA_METRICS)")
    lines += [
        f"  scope    {scope}  ({_SCOPE_WORDS[scope]}; ARONA_MEMORY_SCOPE)",
    ]
    if store_url is not None:
        lines.append(f"  memory   {store_url}  (embedded Philia-compatible store)")
    else:
        shown = ", ".join(redact_url(url) for url in settings.memory_urls)
        lines.append(f"  memory   {shown}")
    if backends is not None:
        names = ", ".join(spec.name for spec in backends.backends)
        lines.append(f"  models   routed to {names}  ({backends.path}; ARONA_BACKENDS)")
    elif upstream_echo:
        lines.append("  model    echo  (development default: replies show the recalled memories)")
    role = ", admin" if admin else ""
    lines += [
        "",
        f"JWT for JSON-RPC (sub=dev{role}, valid 24 h): {token}",
        "",
        "Try it (in this directory; the first line puts the JWT in $JWT):",
        f"  JWT={token}",
        f"  curl -si {http}/v1/chat/completions {chat_bearer}"
        f"-H 'Content-Type: application/json' -d {shlex.quote(body)}",
        f"  curl -s {http}/api/rpc {bearer}-d {shlex.quote(status)}",
        f"  {_beside_python('grpcurl')} {_grpcurl_flags(settings)}{grpc_target} "
        "arona.memory.v1.MemoryService/Status",
        "",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)


def _beside_python(name: str) -> str:
    """How to run the command ``name`` installed beside this Python (``make`` installs
    grpcurl into ``.venv/bin``, which is not on the PATH): a path relative to the current
    directory when it is below it, else absolute; plain ``name`` when it is not there."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        return name
    try:
        relative = path.absolute().relative_to(Path.cwd())
    except ValueError:
        return shlex.quote(str(path.absolute()))
    return shlex.quote(str(relative) if len(relative.parts) > 1 else f"./{relative}")


def _grpcurl_flags(settings: Settings) -> str:
    """grpcurl's flags for the listener: TLS or not, and the token (by name, never its value)."""
    flags = ""
    if settings.grpc_tls_ca is not None:
        flags += f"-cacert {shlex.quote(str(settings.grpc_tls_ca))} "
    elif settings.grpc_tls_cert is None:
        flags += "-plaintext "
    if settings.grpc_token:
        flags += '-H "authorization: Bearer $ARONA_GRPC_TOKEN" '
    return flags


async def _up(env: Mapping[str, str], backends: BackendsFile | None = None) -> None:
    data_dir = Path(env.get("ARONA_DATA_DIR", "").strip() or ".arona")
    dev = load_dev_secrets(data_dir)
    env = dict(env)
    if not env.get("ARONA_JWT_SECRET"):
        env["ARONA_JWT_SECRET"] = dev["jwt_secret"]
    await _check_scope_mode(Settings.from_env(env))
    async with contextlib.AsyncExitStack() as stack:
        store_url: str | None = None
        if not env.get("ARONA_MEMORY_URL", "").strip():
            token = env.get("ARONA_MEMORY_TOKEN", "").strip() or dev["memory_token"]
            store_url = await stack.enter_async_context(
                embedded_store(
                    data_dir / STORE_DB_FILE,
                    token,
                    "127.0.0.1",
                    0,
                    ranking_from_env(env),
                    env.get(STORE_DATABASE_ENV, "").strip() or None,
                )
            )
            env["ARONA_MEMORY_URL"] = store_url
            env["ARONA_MEMORY_TOKEN"] = token
        settings = Settings.from_env(env)
        secret = settings.jwt_secret or dev["jwt_secret"]

        def ready(running: Running) -> None:
            settle_gc()
            echo = settings.upstream_url is None
            print(_banner(running, secret, echo, store_url, backends), flush=True)

        await run_parts(settings, on_ready=ready, backends=backends)


async def _check_scope_mode(settings: Settings) -> None:
    """Shared mode over a data directory of per-user memories, refused before anything starts
    (the gRPC service checks again, and checks a PostgreSQL index, before it listens)."""
    from arona_grpc.episodes import SqliteEpisodeIndex
    from arona_grpc.service import check_scope_mode

    if settings.database_url or settings.user_scoped:
        return
    index = SqliteEpisodeIndex(settings.data_dir)
    try:
        await check_scope_mode(settings, index)
    finally:
        await index.aclose()


def _serve_workers(env: Mapping[str, str], workers: int, *, grpc_part: bool) -> int:
    from gateway_http.workers import run_workers

    settings = Settings.from_env(env)
    if grpc_part:
        _run(_check_scope_mode(settings))  # one line, before any child starts
    listener = _listen(settings.http_host, settings.http_port)
    try:
        return run_workers(settings, env, workers, listener, grpc_part=grpc_part)
    finally:
        listener.close()


async def _serve(
    env: Mapping[str, str],
    only: str | None,
    listen_fd: int | None = None,
    worker: int = 0,
    supervised: bool = False,
    backends: BackendsFile | None = None,
) -> None:
    settings = Settings.from_env(env)

    def ready(running: Running) -> None:
        settle_gc()
        parts = [p for p in (running.http_url, running.grpc_target) if p]
        logger.info("serving on %s", ", ".join(parts))
        logger.info("memory scope: %s (ARONA_MEMORY_SCOPE)", settings.memory_scope)
        if backends is not None:
            names = [spec.name for spec in backends.backends]
            logger.info(
                "routing models to %d backend%s (%s) from %s (ARONA_BACKENDS)",
                len(names),
                "" if len(names) == 1 else "s",
                ", ".join(names),
                backends.path,
            )
        elif settings.upstream_url is None and only != "grpc":
            logger.info("no ARONA_UPSTREAM_URL: using the echo model (a development default)")

    await run_parts(
        settings,
        grpc_part=only != "http",
        http_part=only != "grpc",
        on_ready=ready,
        listen_fd=listen_fd,
        worker=worker,
        supervised=supervised,
        backends=backends,
    )


async def _store(env: Mapping[str, str], host: str, port: int) -> None:
    data_dir = Path(env.get("ARONA_DATA_DIR", "").strip() or ".arona")
    token = env.get("ARONA_MEMORY_TOKEN", "").strip() or load_dev_secrets(data_dir)["memory_token"]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    ranking = ranking_from_env(env)
    database_url = env.get(STORE_DATABASE_ENV, "").strip() or None
    where = redact_url(database_url) if database_url else str(data_dir / STORE_DB_FILE)
    async with embedded_store(
        data_dir / STORE_DB_FILE, token, host, port, ranking, database_url
    ) as url:
        settle_gc()
        print(f"embedded memory store on {url} (database {where})", flush=True)
        await stop.wait()


def _token(env: Mapping[str, str], sub: str, ttl: int, admin: bool = False) -> str:
    from gateway_http.auth import mint_token

    settings = Settings.from_env(env)
    secret = settings.jwt_secret
    if secret is None:
        dev = settings.data_dir / DEV_SECRETS_FILE
        if not dev.exists():
            raise StartupError("ARONA_JWT_SECRET is not set (and no dev secret exists yet)")
        secret = load_dev_secrets(settings.data_dir)["jwt_secret"]
    return mint_token(secret, sub, ttl, admin=admin)


async def _check_memory(env: Mapping[str, str]) -> int:
    """Probe the configured Philia (each store, when ``ARONA_MEMORY_URL`` names several) for
    user isolation; 0 when every one isolates, 1 otherwise."""
    settings = Settings.from_env(env)
    if not settings.memory_enabled:
        raise StartupError(
            "ARONA_MEMORY_URL and ARONA_MEMORY_TOKEN must be set: there is no Philia to check"
        )
    assert settings.memory_token is not None
    # Every store is asked: the processes behind one list may run different versions (a
    # rolling update), and one that ignores the filter would leak through the others.
    codes = [
        await _check_store(url, settings.memory_token, settings.memory_timeout_s)
        for url in settings.memory_urls
    ]
    return max(codes)


async def _check_store(url: str, token: str, timeout_s: float) -> int:
    """``check-memory`` on one store: 0 when it isolates users, 1 otherwise."""
    from arona_grpc.isolation import check_isolation
    from arona_grpc.philia import PhiliaClient, PhiliaError

    client = PhiliaClient(url, token, timeout_s)
    where = redact_url(url)
    try:
        report = await check_isolation(client)
    except PhiliaError as exc:
        print(f"check-memory: cannot tell: {client.redact(str(exc))}", flush=True)
        return 1
    finally:
        await client.aclose()
    if report.left_behind:
        print(
            f"check-memory: {len(report.left_behind)} probe(s) could not be deleted: "
            + ", ".join(report.left_behind),
            flush=True,
        )
    if report.isolated:
        print(f"check-memory: {where} isolates users: {report.summary}.", flush=True)
        return 0
    print(
        f"check-memory: {where} does NOT isolate users: {report.summary}. "
        "Do not run ARONA_MEMORY_SCOPE=user against it.",
        flush=True,
    )
    return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="arona-gateway",
        description="OpenAI-compatible chat gateway with long-term memory (Philia).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="run everything on embedded defaults (store, gRPC, HTTP, echo)")
    serve = sub.add_parser("serve", help="run the gRPC service and the HTTP gateway")
    serve.add_argument("--only", choices=("grpc", "http"), help="run one part only")
    serve.add_argument(
        "--workers",
        type=int,
        default=1,
        help="HTTP worker processes sharing the port (default 1); the gRPC service runs in "
        "a process of its own when there are more",
    )
    # Set by the supervisor of --workers for its children.
    serve.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)
    serve.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    serve.add_argument("--supervised", action="store_true", help=argparse.SUPPRESS)
    store = sub.add_parser(
        "store",
        help="run the embedded Philia-compatible store alone (its memories in PostgreSQL "
        f"with {STORE_DATABASE_ENV})",
    )
    store.add_argument("--host", default="127.0.0.1")
    store.add_argument("--port", type=int, default=STORE_DEFAULT_PORT)
    token = sub.add_parser("token", help="mint a JWT for the JSON-RPC surface")
    token.add_argument("--sub", required=True, help="the user id (JWT sub)")
    token.add_argument("--ttl", type=int, default=3600, help="lifetime in seconds")
    token.add_argument(
        "--admin", action="store_true", help='add "role": "admin" (status and others\' memory)'
    )
    sub.add_parser(
        "migrate",
        help="apply the database schema migrations (ARONA_DATABASE_URL, or the SQLite files)",
    )
    sub.add_parser(
        "check-memory",
        help="check that the configured Philia keeps users' memories apart (exit 0 if so)",
    )
    copy = sub.add_parser(
        "store-copy",
        help="copy an embedded store's memories into PostgreSQL, or back; resumable",
    )
    copy.add_argument(
        "source",
        help="a postgresql:// URL, or an embedded store's file ($ARONA_DATA_DIR/memory.db; "
        "its directory will do)",
    )
    copy.add_argument("dest", help="the same: exactly one of the two is PostgreSQL")
    _import_parser(sub)
    _usage_parsers(sub)
    _forget_parser(sub)
    mcp_parser(sub)
    return parser


def _forget_parser(sub: Any) -> None:
    forget = sub.add_parser(
        "forget",
        help="erase the memory (and conversations) of one scope, one principal, the turns of "
        "no principal, or everyone, through the gRPC service",
    )
    whose = forget.add_mutually_exclusive_group(required=True)
    whose.add_argument("--scope", help="one scope: PRINCIPAL or PRINCIPAL/USER")
    whose.add_argument(
        "--principal", help="every scope of one principal (a JWT sub, key:NAME), users included"
    )
    whose.add_argument(
        "--anonymous",
        action="store_true",
        help="the turns of no principal (shared mode, REST without a bearer)",
    )
    whose.add_argument("--all", action="store_true", help="everything the memory service stored")
    forget.add_argument(
        "--keep-conversations",
        action="store_true",
        help="leave the owner's conversations (default: they are deleted too)",
    )


def _forget_command(settings: Settings, args: argparse.Namespace) -> None:
    from gateway_http import forgetting
    from gateway_http.memory_client import ForgetTarget

    target = ForgetTarget(
        scope=args.scope or "",
        principal=args.principal or "",
        anonymous=args.anonymous,
        everything=args.all,
    )
    printed: list[str] = []

    async def run() -> None:
        try:
            printed.append(
                await forgetting.forget(
                    settings, target, keep_conversations=args.keep_conversations
                )
            )
        except forgetting.ForgetRefused as exc:
            raise StartupError(str(exc)) from None

    _run(run())
    print(printed[0], flush=True)


def _usage_parsers(sub: Any) -> None:
    usage = sub.add_parser(
        "usage",
        help="tokens used by principal, user, model, backend or day (what usage.summary answers)",
    )
    usage.add_argument(
        "--from", dest="start", help="YYYY-MM-DD or an RFC 3339 time (default: this month's start)"
    )
    usage.add_argument(
        "--to", dest="end", help="YYYY-MM-DD (that day included) or an RFC 3339 time (now)"
    )
    usage.add_argument(
        "--group-by",
        default="",
        help="comma-separated: principal, user, model, backend, day (default: one total)",
    )
    usage.add_argument("--principal", help="one principal's usage only (key:NAME, a JWT sub)")
    usage.add_argument("--csv", action="store_true", help="CSV instead of a table")
    budget = sub.add_parser(
        "budget", help="monthly token or cost budgets per principal: set, clear, list"
    )
    actions = budget.add_subparsers(dest="action", required=True)
    setting = actions.add_parser("set", help="set a principal's budget (or the default one)")
    clearing = actions.add_parser("clear", help="remove a principal's budget (or the default)")
    for action in (setting, clearing):
        action.add_argument("principal", nargs="?", help="key:NAME or a JWT sub")
        action.add_argument(
            "--default", action="store_true", help="the budget of every principal without one"
        )
    setting.add_argument("--tokens", type=int, help="prompt + completion tokens a month")
    setting.add_argument(
        "--cost", type=float, help="cost a month, in the prices' currency (the backends file)"
    )
    actions.add_parser("list", help="every budget and this month's spending")


def _usage_commands(settings: Settings, args: argparse.Namespace) -> None:
    from gateway_http.usage import commands

    work: Coroutine[Any, Any, str]
    if args.command == "usage":
        work = commands.usage_command(
            settings, args.start, args.end, args.group_by, args.principal, as_csv=args.csv
        )
    elif args.action == "list":
        work = commands.budget_list(settings)
    else:
        if (args.principal is None) == (not args.default):
            raise StartupError("name a PRINCIPAL or give --default (one of the two)")
        if args.action == "set":
            change = commands.BudgetChange(args.principal, args.tokens, args.cost)
            work = commands.budget_set(settings, change)
        else:
            work = commands.budget_clear(settings, args.principal)
    printed: list[str] = []

    async def run() -> None:
        try:
            printed.append(await work)
        except commands.CommandError as exc:
            raise StartupError(str(exc)) from None

    _run(run())
    print(printed[0], flush=True)


def _import_parser(sub: Any) -> None:
    imports = sub.add_parser(
        "import",
        help="store chat history (OpenAI messages, one conversation or turn a line) as dated "
        "episodes through the gRPC service; resumable (exit 1 if any line was bad)",
    )
    imports.add_argument("file", type=Path, help="the JSON lines file (see the README)")
    imports.add_argument(
        "--user",
        help="whose memory: the principal a chat would have (a JWT sub, key:NAME); a line's "
        "'user' narrows it as in a chat request; without it, shared memory or the line's user",
    )
    imports.add_argument(
        "--progress", type=Path, help="the progress file (default: FILE.progress beside FILE)"
    )
    imports.add_argument(
        "--check", action="store_true", help="only check the file: report bad lines, store nothing"
    )
    imports.add_argument(
        "--concurrency",
        type=int,
        default=32,
        help="turns sent at a time (default 32; 1: strictly one after another)",
    )


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


async def _migrate(env: Mapping[str, str]) -> None:
    """Bring every store's schema up to date, alone (replicas may then start without racing)."""
    from arona_grpc.database import DatabaseUnavailable, SchemaRefused, migrate

    settings = Settings.from_env(env)
    if settings.database_url:
        try:
            applied = await migrate(settings.database_url)
        except (DatabaseUnavailable, SchemaRefused) as exc:
            raise StartupError(str(exc)) from None
        where = redact_url(settings.database_url)
        if applied:
            for migration in applied:
                print(f"{where}: applied migration {migration.version}: {migration.name}")
        else:
            print(f"{where}: the schema is up to date")
        return
    from arona_grpc.episodes import SqliteEpisodeIndex
    from arona_grpc.outbox import Outbox
    from gateway_http.conversations import CONVERSATIONS_FILE, SqliteConversationStore
    from gateway_http.usage.sqlite import SqliteUsageStore
    from gateway_http.usage.store import USAGE_FILE

    SqliteConversationStore.open(settings.data_dir / CONVERSATIONS_FILE).close()
    SqliteUsageStore.open(settings.data_dir / USAGE_FILE).close()
    index = SqliteEpisodeIndex(settings.data_dir)
    await index.owner("")  # opens (and migrates) the file
    await index.aclose()
    outbox = Outbox(settings.data_dir, settings.memory_outbox_max_bytes)
    await outbox.load()  # migrates an existing file; a missing one is created when needed
    await outbox.aclose()
    print(f"{settings.data_dir}: the SQLite files' schemas are up to date")


def _check_memory_sync(env: Mapping[str, str]) -> int:
    outcome: list[int] = []

    async def run() -> None:
        outcome.append(await _check_memory(env))

    _run(run())
    return outcome[0]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == MCP_COMMAND:
        # The stdio bridge: its settings are its own (gateway_http.mcp.bridge).
        return mcp_command(os.environ)
    if getattr(args, "supervised", False):
        # Before anything else: a group-wide SIGTERM arriving while it starts is ignored too.
        from gateway_http.workers import ignore_stop_signals

        ignore_stop_signals()
    env = os.environ
    prefer_grpc_iomgr(env)
    try:
        settings = Settings.from_env(env)
        only = getattr(args, "only", None)  # `serve --only`; `up` runs every part
        # Read and checked before anything starts, by every process that serves HTTP.
        backends = (
            load_backends_file(settings, env)
            if args.command == "up" or (args.command == "serve" and only != "grpc")
            else None
        )
        _configure_logging(settings, backends)
        if args.command in ("up", "serve", "store"):
            check_data_dir(settings.data_dir)
        if args.command == "up" or (args.command == "serve" and only != "http"):
            # Before any part starts: a gRPC listener it would refuse (beyond loopback
            # without a token, unusable TLS files) is one line, nothing started and stopped.
            from arona_grpc.security import check_listener

            check_listener(settings)
            local_tls = settings.grpc_tls_cert is not None and settings.grpc_target is None
            if only is None and local_tls and settings.grpc_tls_ca is None:
                raise StartupError(
                    "ARONA_GRPC_TLS_CA must be set with ARONA_GRPC_TLS_CERT: the HTTP gateway "
                    "calls its own gRPC listener over TLS and checks its certificate"
                )
        if args.command == "token":
            from arona_grpc.scopes import subject_error

            if args.ttl <= 0:
                raise StartupError("--ttl must be positive")
            problem = subject_error(args.sub)
            if problem is not None:
                raise StartupError(problem.replace("the token's 'sub'", "--sub"))
            print(_token(env, args.sub, args.ttl, args.admin))
        elif args.command == "check-memory":
            return _check_memory_sync(env)
        elif args.command == "import":
            from gateway_http.importing import import_command

            return import_command(
                settings,
                args.file,
                user=args.user,
                progress=args.progress,
                check=args.check,
                concurrency=args.concurrency,
            )
        elif args.command == "migrate":
            _run(_migrate(env))
        elif args.command == "store-copy":
            from arona_store.pg.copy import copy_command

            return copy_command(args.source, args.dest)
        elif args.command in ("usage", "budget"):
            _usage_commands(settings, args)
        elif args.command == "forget":
            _forget_command(settings, args)
        elif args.command == "up":
            with tracing.started(env, tracing.GATEWAY_SERVICE):
                _run(_up(env, backends))
        elif args.command == "serve":
            if args.workers < 1:
                raise StartupError("--workers must be at least 1")
            if args.workers > 1:
                if args.only == "grpc":
                    raise StartupError("--workers is for the HTTP layer; not with --only grpc")
                # The supervisor serves nothing: each worker traces itself.
                return _serve_workers(env, args.workers, grpc_part=args.only != "http")
            service = tracing.MEMORY_SERVICE if args.only == "grpc" else tracing.GATEWAY_SERVICE
            with tracing.started(env, service):
                _run(_serve(env, args.only, args.listen_fd, args.worker, args.supervised, backends))
        else:
            with tracing.started(env, tracing.STORE_SERVICE):
                _run(_store(env, args.host, args.port))
    except (ConfigError, StartupError, RankingError) as exc:
        # One line per mistake (a backends file may have several).
        for line in str(exc).splitlines():
            print(f"arona-gateway: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
