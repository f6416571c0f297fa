"""``up``, ``serve`` and ``store``: the parts started in one event loop and stopped in order by
SIGINT/SIGTERM (the HTTP listener first, in-flight turns finishing and pending writebacks given a
grace period, then the gRPC service, then the embedded store).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
from collections.abc import (
    AsyncIterator,
    Callable,
    Mapping,
)
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from arona_common.redact import redact_url
from arona_grpc.config import Settings
from arona_store.ranking import Ranking, ranking_from_env

if TYPE_CHECKING:
    from gateway_http.upstream.backends_file import BackendsFile
from gateway_http.commands.runtime import (
    GRPC_GRACE_S,
    HTTP_GRACE_S,
    STORE_DATABASE_ENV,
    STORE_DB_FILE,
    STORE_DEFAULT_PORT,
    StartupError,
    Uvicorn,
    listen_now,
    load_dev_secrets,
    run_main,
    settle_gc,
    url_host,
)

logger = logging.getLogger("arona_gateway")


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
    from arona_common.database import DatabaseUnavailable, SchemaRefused, open_pool
    from arona_grpc.server import GrpcBindError, GrpcServer
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
    http_server: Uvicorn | None = None

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
            except GrpcBindError as exc:
                raise StartupError(str(exc)) from None
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
                sock = listen_now(settings.http_host, settings.http_port)
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
            http_server = Uvicorn(config)
            http_task = asyncio.create_task(http_server.serve(sockets=[sock]))
            running.http_url = f"http://{url_host(settings.http_host)}:{port}"
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
    from arona_common.database import DatabaseUnavailable, SchemaRefused
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


async def up(env: Mapping[str, str], backends: BackendsFile | None = None) -> None:
    from gateway_http.banner import banner

    data_dir = Path(env.get("ARONA_DATA_DIR", "").strip() or ".arona")
    dev = load_dev_secrets(data_dir)
    env = dict(env)
    if not env.get("ARONA_JWT_SECRET"):
        env["ARONA_JWT_SECRET"] = dev["jwt_secret"]
    await _check_scope_mode(Settings.from_env(env))
    async with contextlib.AsyncExitStack() as stack:
        store_url: str | None = None
        store_database_url = env.get(STORE_DATABASE_ENV, "").strip() or None
        if not env.get("ARONA_MEMORY_URL", "").strip():
            token = env.get("ARONA_MEMORY_TOKEN", "").strip() or dev["memory_token"]
            store_url = await stack.enter_async_context(
                embedded_store(
                    data_dir / STORE_DB_FILE,
                    token,
                    "127.0.0.1",
                    0,
                    ranking_from_env(env),
                    store_database_url,
                )
            )
            env["ARONA_MEMORY_URL"] = store_url
            env["ARONA_MEMORY_TOKEN"] = token
        settings = Settings.from_env(env)
        secret = settings.jwt_secret or dev["jwt_secret"]

        def ready(running: Running) -> None:
            settle_gc()
            echo = settings.upstream_url is None
            print(
                banner(running, secret, echo, store_url, backends, store_database_url),
                flush=True,
            )

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


def serve_workers(env: Mapping[str, str], workers: int, *, grpc_part: bool) -> int:
    from gateway_http.workers import run_workers

    settings = Settings.from_env(env)
    if grpc_part:
        run_main(_check_scope_mode(settings))  # one line, before any child starts
    listener = listen_now(settings.http_host, settings.http_port)
    try:
        return run_workers(settings, env, workers, listener, grpc_part=grpc_part)
    finally:
        listener.close()


async def serve(
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


async def store(env: Mapping[str, str], host: str, port: int) -> None:
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


def warn_short_token(settings: Settings, args: argparse.Namespace) -> None:
    """The short memory token's warning, once per start: by the process that uses the token
    (not by an HTTP-only one, nor by the supervisor of workers, whose gRPC child warns)."""
    warning = settings.short_memory_token_warning
    if warning is None:
        return
    if args.command == "serve" and (args.only == "http" or args.workers > 1):
        return
    logger.warning("%s", warning)


def add_serving_parsers(sub: Any) -> None:
    """``up``, ``serve`` and ``store``."""
    sub.add_parser("up", help="run everything on embedded defaults (store, gRPC, HTTP, echo)")
    serving = sub.add_parser("serve", help="run the gRPC service and the HTTP gateway")
    serving.add_argument("--only", choices=("grpc", "http"), help="run one part only")
    serving.add_argument(
        "--workers",
        type=int,
        default=1,
        help="HTTP worker processes sharing the port (default 1); the gRPC service runs in "
        "a process of its own when there are more",
    )
    # Set by the supervisor of --workers for its children.
    serving.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)
    serving.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    serving.add_argument("--supervised", action="store_true", help=argparse.SUPPRESS)
    storing = sub.add_parser(
        "store",
        help="run the embedded Philia-compatible store alone (its memories in PostgreSQL "
        f"with {STORE_DATABASE_ENV})",
    )
    storing.add_argument("--host", default="127.0.0.1")
    storing.add_argument("--port", type=int, default=STORE_DEFAULT_PORT)
