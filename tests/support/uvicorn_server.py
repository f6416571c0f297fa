"""Run any ASGI app under a real uvicorn server on ``127.0.0.1``, port 0, inside the test's loop.

:func:`serve_app` owns the server's whole life: a listening socket bound before uvicorn starts
(so the port is known and nothing races for it), start-up awaited through an event set by
uvicorn's own start-up step (no polling), and a shutdown that is bounded even when a response
hangs: uvicorn cancels what is still running after a short grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import uvicorn


class _TestServer(uvicorn.Server):
    """A uvicorn server that reports start-up through an event and leaves signals alone."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = asyncio.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self.ready.set()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Several servers may run in one test and stop in any order; letting each one swap
        # the process's SIGINT handler could leave Ctrl+C pointing at a dead server.
        yield


@contextlib.asynccontextmanager
async def serve_app(
    app: Callable[..., Any],
    *,
    startup_timeout_s: float = 10.0,
    graceful_shutdown_s: int = 2,
    log_level: str = "warning",
    options: dict[str, Any] | None = None,
) -> AsyncIterator[str]:
    """Serve ``app`` on ``127.0.0.1`` port 0 and yield its base URL ``http://127.0.0.1:<port>``.

    The app's lifespan runs (start-up before the URL is yielded, shutdown on exit). A start-up
    failure raises ``RuntimeError``. On exit, responses still running after
    ``graceful_shutdown_s`` seconds are cancelled, so a hanging handler cannot hang the test.
    ``options`` are more ``uvicorn.Config`` options (the gateway's edge limits).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(2048)
        sock.setblocking(False)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    config = uvicorn.Config(
        app,
        log_config=None,  # leave the test run's logging (and caplog) alone
        log_level=log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=graceful_shutdown_s,
        **(options or {}),
    )
    server = _TestServer(config)

    async def run() -> None:
        try:
            await server.serve(sockets=[sock])
        except SystemExit as exc:
            # uvicorn exits the process when the app's start-up fails; inside a test that
            # must be an ordinary error instead.
            raise RuntimeError(f"uvicorn start-up failed (exit code {exc.code})") from None
        finally:
            sock.close()

    serve_task = asyncio.create_task(run(), name=f"uvicorn-127.0.0.1:{port}")
    ready_task = asyncio.create_task(server.ready.wait())
    try:
        done, _ = await asyncio.wait(
            {serve_task, ready_task},
            timeout=startup_timeout_s,
            return_when=asyncio.FIRST_COMPLETED,
        )
        if ready_task not in done:
            if serve_task in done:
                serve_task.result()  # raises the start-up error
                raise RuntimeError("uvicorn stopped before it started serving")
            raise RuntimeError(f"uvicorn did not start within {startup_timeout_s} s")
    except BaseException:
        ready_task.cancel()
        await _stop(server, serve_task, graceful_shutdown_s)
        raise

    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        error = await _stop(server, serve_task, graceful_shutdown_s)
    if error is not None:
        raise RuntimeError("uvicorn failed while serving") from error


async def _stop(
    server: uvicorn.Server, task: asyncio.Task[None], graceful_s: float
) -> BaseException | None:
    """Stop the server and return what its task failed with, if anything."""
    server.should_exit = True
    # uvicorn cancels hanging responses after its own grace period; the margin covers its
    # polling and the app's lifespan shutdown.
    done, _ = await asyncio.wait({task}, timeout=graceful_s + 5.0)
    if not done:
        server.force_exit = True
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
    if not task.done() or task.cancelled():
        return None
    return task.exception()
