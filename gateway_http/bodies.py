"""Reading a request body under a size limit, for every HTTP route that takes one."""

from __future__ import annotations

from starlette.requests import Request

from arona_grpc.config import DEFAULT_MAX_BODY_BYTES

# The default of ARONA_HTTP_MAX_BODY_BYTES; the app reads its own from the settings.
MAX_BODY_BYTES = DEFAULT_MAX_BODY_BYTES


async def read_limited(request: Request, limit: int = MAX_BODY_BYTES) -> bytes | None:
    """The request body, or ``None`` as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    # Content-Length may be absent (chunked) or wrong, so count what actually arrives.
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)
