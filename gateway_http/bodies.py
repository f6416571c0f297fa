"""Reading a request body under a size limit, for every HTTP route that takes one.

A client that goes away before its body is whole (or that the edge gives up on) is its own
doing, not the gateway's fault: one INFO line says so (:class:`DisconnectLog`, at most one
a :data:`DISCONNECT_LOG_EVERY_S` with a count of the others), and the caller gets
``ClientDisconnect`` to stop the request.
"""

from __future__ import annotations

import logging

from starlette.requests import ClientDisconnect, Request

from arona_grpc.config import DEFAULT_MAX_BODY_BYTES, DEFAULT_RPC_MAX_BODY_BYTES
from arona_grpc.failure_log import FailureLog

logger = logging.getLogger(__name__)

# The defaults of ARONA_HTTP_MAX_BODY_BYTES and ARONA_RPC_MAX_BODY_BYTES; the app reads its
# own from the settings.
MAX_BODY_BYTES = DEFAULT_MAX_BODY_BYTES
RPC_MAX_BODY_BYTES = DEFAULT_RPC_MAX_BODY_BYTES
DISCONNECT_LOG_EVERY_S = 10.0


class DisconnectLog:
    """The app's INFO lines for clients gone mid-body (kept in ``app.state.disconnects``)."""

    def __init__(self, every_s: float = DISCONNECT_LOG_EVERY_S) -> None:
        self._log = FailureLog(logger, "clients", every_s, level=logging.INFO)

    def gone(self, request: Request, received: int) -> None:
        declared = request.headers.get("content-length")
        of = f" of {declared}" if declared is not None and declared.isdigit() else ""
        self._log.failed(
            f"{request.method} {request.url.path}: the request body ended after {received}{of} "
            "bytes (the client went away, or sent it too slowly); the request was dropped"
        )


async def read_limited(request: Request, limit: int = MAX_BODY_BYTES) -> bytes | None:
    """The request body, or ``None`` as soon as it is known to exceed ``limit`` bytes;
    ``ClientDisconnect`` (said once at INFO) when the client leaves before it is whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    # Content-Length may be absent (chunked) or wrong, so count what actually arrives.
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
    except ClientDisconnect:
        disconnects = getattr(request.app.state, "disconnects", None)
        if isinstance(disconnects, DisconnectLog):
            disconnects.gone(request, size)
        raise
    return b"".join(chunks)
