"""The Philia WebSocket JSON-RPC client: connection, handshake, id -> future, timeouts.

One :class:`PhiliaClient` owns at most one WebSocket to Philia. It connects lazily
(the first call opens the link and sends ``Sync.ConnectHandshake``), shares the link
between concurrent calls (one reader task matches replies to callers by id), and
treats any fault (refused, rejected handshake, JSON-RPC error, timeout, malformed
frame, close) as the end of that link: every pending caller fails, the transport is
aborted and the next call connects afresh. The exception is a call refused for what it
is (:attr:`PhiliaError.permanent`: a request over :data:`MAX_REQUEST_BYTES`, which is never
sent, or a ``-32600``/``-32602`` error reply): the link stays for the other callers. Should
Philia close the link with 1009 (message too big) all the same, the largest pending request
is the one refused, and the others' failure does not count against Philia
(:attr:`PhiliaError.philia_fault`). Every await on the socket runs under the
per-call deadline (``timeout_s``, or a shorter one the caller passes, e.g. the recall
budget), connect and handshake included.

A link left idle is kept open with ``Base.Heartbeat`` notifications (see :data:`HEARTBEAT_S`):
Philia closes links idle for about 45 s, and a chat whose turns come a minute apart would
otherwise pay a new connect and handshake on every turn.

A call that runs out of time drops the link only when the link looks dead (nothing
received since the call was sent): on a live link shared by concurrent calls, one slow
answer must not fail the others, and its late reply is simply skipped because no
waiter is left for its id. A link the peer has started to close (a close frame, even
with the TCP connection left open) is never reused.

The WebSocket is aiohttp's (one ``ClientSession`` per client, frames parsed in C): on the
benchmark's memory turn it cost the gateway's event loop about 0.05 ms less than the
``websockets`` client (bench/README.md). Frames are encoded and decoded with ``orjson``
(the standard ``json`` module is the fallback only for what orjson refuses but JSON
allows, such as an escaped lone surrogate), text frames are read as bytes, and request
ids come from a counter: all of that is paid on every call.

Each call is a client span (arona_common.tracing). A peer whose handshake result lists
:data:`TRACE_CONTEXT` among its ``capabilities`` (the embedded store) also gets the caller's
``traceparent`` in each request's params and continues the trace; the wire protocol does not
say that a Philia takes params it does not know, so any other gets exactly the params above.

The token travels on the upgrade URL and in the handshake, so nothing here ever
prints it: URLs go through :func:`~arona_common.redact.redact_url` and free text through
:func:`~arona_common.redact.redact_text`; aiohttp logs neither request lines nor frames.

Its modules: :mod:`~arona_grpc.philia.wire` (methods, limits, errors, frames and results),
:mod:`~arona_grpc.philia.connection` (one open link and its reader) and
:mod:`~arona_grpc.philia.client` (the client).
"""

from __future__ import annotations

from arona_grpc.philia.client import PhiliaClient
from arona_grpc.philia.wire import (
    DELETE_METHOD,
    HEARTBEAT_S,
    MAX_FRAME_BYTES,
    MAX_REQUEST_BYTES,
    OCCURRED_AT,
    QUERY_METHOD,
    STORE_METHOD,
    TRACE_CONTEXT,
    PhiliaError,
    PhiliaMemory,
    PhiliaRPCError,
    PhiliaTimeout,
    PhiliaTooLarge,
    PhiliaUnavailable,
    build_upgrade_url,
    occurred_at_text,
    request_bytes,
)

__all__ = [
    "DELETE_METHOD",
    "HEARTBEAT_S",
    "MAX_FRAME_BYTES",
    "MAX_REQUEST_BYTES",
    "OCCURRED_AT",
    "PhiliaClient",
    "PhiliaError",
    "PhiliaMemory",
    "PhiliaRPCError",
    "PhiliaTimeout",
    "PhiliaTooLarge",
    "PhiliaUnavailable",
    "QUERY_METHOD",
    "STORE_METHOD",
    "TRACE_CONTEXT",
    "build_upgrade_url",
    "occurred_at_text",
    "request_bytes",
]
