"""The one error table of the HTTP layer.

Every failure a client can see is a :class:`GatewayError` of one
:class:`ErrorKind`; the table below says what each kind becomes on each surface
(REST status + OpenAI error type, JSON-RPC code) and which gRPC status codes map
to it. Errors are translated in exactly one place per surface, from this table.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import grpc
import orjson


class ErrorKind(enum.Enum):
    BAD_INPUT = "bad_input"
    NOT_CONFIGURED = "not_configured"
    UNAVAILABLE = "unavailable"
    TIMEOUT = "timeout"
    AUTH = "auth"
    FORBIDDEN = "forbidden"
    # Authenticated, but this caller may not do that (an admin's right in user scope mode).
    NOT_ALLOWED = "not_allowed"
    NOT_FOUND = "not_found"
    TOO_LARGE = "too_large"
    # Refused at the HTTP edge: a header block over its limit, a request that did not arrive
    # in time, a chat body that is not JSON.
    HEADERS_TOO_LARGE = "headers_too_large"
    REQUEST_TIMEOUT = "request_timeout"
    UNSUPPORTED_MEDIA = "unsupported_media_type"
    UPSTREAM = "upstream"
    # The caller's monthly budget is used up (gateway_http.usage.budgets).
    QUOTA = "quota"
    INTERNAL = "internal"


@dataclass(frozen=True)
class Mapping:
    http_status: int
    openai_type: str
    jsonrpc_code: int


# JSON-RPC codes: -32602 invalid params, -32000 application error,
# -32005 authentication, -32007 authenticated but not allowed, -32603 internal.
TABLE: dict[ErrorKind, Mapping] = {
    ErrorKind.BAD_INPUT: Mapping(400, "invalid_request_error", -32602),
    ErrorKind.NOT_CONFIGURED: Mapping(400, "invalid_request_error", -32000),
    ErrorKind.UNAVAILABLE: Mapping(503, "service_unavailable", -32000),
    ErrorKind.TIMEOUT: Mapping(504, "timeout", -32000),
    ErrorKind.AUTH: Mapping(401, "authentication_error", -32005),
    ErrorKind.FORBIDDEN: Mapping(403, "permission_error", -32000),
    ErrorKind.NOT_ALLOWED: Mapping(403, "permission_error", -32007),
    ErrorKind.NOT_FOUND: Mapping(404, "invalid_request_error", -32000),
    ErrorKind.TOO_LARGE: Mapping(413, "invalid_request_error", -32600),
    ErrorKind.HEADERS_TOO_LARGE: Mapping(431, "invalid_request_error", -32600),
    ErrorKind.REQUEST_TIMEOUT: Mapping(408, "invalid_request_error", -32600),
    ErrorKind.UNSUPPORTED_MEDIA: Mapping(415, "invalid_request_error", -32600),
    ErrorKind.UPSTREAM: Mapping(502, "upstream_error", -32000),
    # OpenAI's answer to an account out of credit: 429 insufficient_quota.
    ErrorKind.QUOTA: Mapping(429, "insufficient_quota", -32000),
    ErrorKind.INTERNAL: Mapping(500, "server_error", -32603),
}

GRPC_TO_KIND: dict[grpc.StatusCode, ErrorKind] = {
    grpc.StatusCode.INVALID_ARGUMENT: ErrorKind.BAD_INPUT,
    grpc.StatusCode.FAILED_PRECONDITION: ErrorKind.NOT_CONFIGURED,
    grpc.StatusCode.UNAVAILABLE: ErrorKind.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorKind.TIMEOUT,
    grpc.StatusCode.UNAUTHENTICATED: ErrorKind.AUTH,
}


# Every answer of the REST surface (a path under /v1) says what memory did for it, errors and
# answers that are not turns included: one that recalled nothing says "disabled". A turn's
# answer sets it (gateway_http.routes.rest); the app adds it to every other answer
# (gateway_http.app.GatewayApp), the edge to its refusals (gateway_http.edge).
MEMORY_HEADER = "X-Arona-Memory"
NO_RECALL = "disabled"
REST_PREFIX = "/v1"


def is_rest(path: str) -> bool:
    """Whether ``path`` is one of the REST surface's (``/v1`` and below)."""
    return path == REST_PREFIX or path.startswith(REST_PREFIX + "/")


class GatewayError(Exception):
    """A failure with a message that is safe to show to the client.

    Most take their REST status and body from the table. One that passes on an upstream's own
    answer (gateway_http.routes.rest.upstream_failure) has its ``status`` and its ``body``
    (bytes, sent as they are) instead; its ``headers`` then carry the content type.
    """

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        code: str | None = None,
        *,
        headers: dict[str, str] | None = None,
        status: int | None = None,
        body: bytes | None = None,
        data: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        # A stable machine-readable code, e.g. "conversation_not_found".
        self.code = code or kind.value
        # Headers of the REST answer (a turn's memory state when it failed after recalling).
        self.headers = headers
        self._status = status
        self._body = body
        # More for the JSON-RPC error's data than its code (an upstream's status, ...).
        self._data = data

    @property
    def mapping(self) -> Mapping:
        return TABLE[self.kind]

    @property
    def http_status(self) -> int:
        """The REST answer's status."""
        return self._status if self._status is not None else self.mapping.http_status

    def response_body(self) -> bytes:
        """The REST answer's body."""
        return self._body if self._body is not None else orjson.dumps(self.openai_body())

    def openai_body(self) -> dict[str, Any]:
        if self._body is not None:
            # An upstream's own answer (a JSON object, or it would not be passed on as is).
            try:
                answer = orjson.loads(self._body)
            except orjson.JSONDecodeError:
                answer = None
            if isinstance(answer, dict):
                return answer
        return {
            "error": {"message": self.message, "type": self.mapping.openai_type, "code": self.code}
        }

    def jsonrpc_error(self) -> tuple[int, str, dict[str, Any]]:
        return self.mapping.jsonrpc_code, self.message, {"code": self.code, **(self._data or {})}


def bad_input(message: str) -> GatewayError:
    return GatewayError(ErrorKind.BAD_INPUT, message, "invalid_request")
