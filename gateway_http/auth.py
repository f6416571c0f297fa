"""Caller authentication for the HTTP layer: HS256 JWTs (JSON-RPC) and API keys (REST).

JWTs are verified with PyJWT pinned to HS256 only, with ``exp`` and ``sub`` required; the
verifier fails closed when no secret is configured. REST API keys are compared in constant
time and mapped to an owner id that is derived from, but never equal to, the key, so the key
itself never ends up in the conversation database or in logs.

Nothing here logs or echoes a token or key: :class:`AuthError` messages are fixed strings that
are safe to send to the caller, and :attr:`AuthError.reason` is a fixed, secret-free label for
the operator's logs.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from typing import Any

import jwt

logger = logging.getLogger(__name__)

ALGORITHM = "HS256"
ANONYMOUS = "anonymous"
AUTH_REQUIRED_MESSAGE = "Authentication required"
INVALID_API_KEY_MESSAGE = "Invalid or missing API key"

# Fixed labels for why a token was refused: logged at debug level, never sent to the caller
# (telling a caller "bad signature" vs "expired" helps nobody but an attacker).
_JWT_REASONS: tuple[tuple[type[jwt.PyJWTError], str], ...] = (
    (jwt.ExpiredSignatureError, "expired"),
    (jwt.MissingRequiredClaimError, "missing required claim"),
    (jwt.InvalidSignatureError, "bad signature"),
    (jwt.InvalidAlgorithmError, "algorithm not allowed"),
    (jwt.ImmatureSignatureError, "not yet valid"),
    (jwt.DecodeError, "malformed"),
    (jwt.InvalidTokenError, "invalid claims"),
)


class AuthError(Exception):
    """The caller is not authenticated; ``str(error)`` is safe to show to the caller."""

    def __init__(self, message: str = AUTH_REQUIRED_MESSAGE, reason: str = "") -> None:
        super().__init__(message)
        self.message = message
        # A fixed label for logs; never contains the token or the key.
        self.reason = reason or message


def bearer(authorization: str | None) -> str | None:
    """Return the credential of an ``Authorization: Bearer <x>`` header, else ``None``."""
    if not authorization:
        return None
    scheme, _, credential = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    credential = credential.strip()
    return credential or None


class JwtVerifier:
    """Verifies HS256 JWTs signed with the configured secret and returns their ``sub``."""

    def __init__(self, secret: str | None) -> None:
        # An empty secret is treated as none at all: HMAC with an empty key would accept tokens
        # anybody can mint.
        self._secret = secret or None

    @property
    def configured(self) -> bool:
        """Whether a secret is set; without one every token is refused."""
        return self._secret is not None

    def verify(self, token: str | None) -> str:
        """Return the token's ``sub``; raise :class:`AuthError` for anything less than valid."""
        if self._secret is None:
            raise AuthError(reason="no JWT secret configured")
        if not token:
            raise AuthError(reason="no token")
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                self._secret,
                algorithms=[ALGORITHM],
                options={"require": ["exp", "sub"]},
            )
        except jwt.PyJWTError as exc:
            raise AuthError(reason=_reason(exc)) from None
        except (ValueError, TypeError):
            # Defensive: garbage that trips the decoder below PyJWT's own error types.
            raise AuthError(reason="malformed") from None
        sub = claims.get("sub")
        if not isinstance(sub, str) or not sub.strip():
            raise AuthError(reason="empty subject")
        return sub


def _reason(exc: jwt.PyJWTError) -> str:
    for kind, label in _JWT_REASONS:
        if isinstance(exc, kind):
            return label
    return "invalid token"


def mint_token(secret: str, sub: str, ttl_s: int = 3600) -> str:
    """Mint an HS256 JWT for ``sub`` valid for ``ttl_s`` seconds (``arona-gateway token``)."""
    if not secret:
        raise ValueError("a JWT secret is required to mint a token")
    if not sub or not sub.strip():
        raise ValueError("sub must be a non-empty string")
    if ttl_s <= 0:
        raise ValueError("ttl_s must be positive")
    now = int(time.time())
    payload = {"sub": sub, "iat": now, "exp": now + ttl_s}
    return jwt.encode(payload, secret, algorithm=ALGORITHM)


def _owner_id(key: str) -> str:
    # A stable id that names the key without being it: stored as the conversation owner.
    return "key:" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]


class ApiKeys:
    """The REST API keys; no keys configured means REST is open to everyone as ``anonymous``."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        # Only an empty tuple opens REST. Empty entries are dropped (they would match an empty
        # credential), so a tuple of only empty strings fails closed rather than open.
        self._open = not keys
        self._keys = tuple(key.encode("utf-8") for key in keys if key)

    @property
    def open(self) -> bool:
        """True when no key is configured (REST is unauthenticated)."""
        return self._open

    def owner(self, authorization: str | None) -> str:
        """Return the owner id for an ``Authorization`` header; raise :class:`AuthError`."""
        if self.open:
            return ANONYMOUS
        credential = bearer(authorization)
        if credential is None:
            raise AuthError(INVALID_API_KEY_MESSAGE, reason="no API key")
        candidate = credential.encode("utf-8")
        match: bytes | None = None
        # Compare against every key without stopping early, so timing does not reveal which
        # (or whether an earlier) key matched. Bytes, because compare_digest refuses non-ASCII
        # str.
        for key in self._keys:
            if hmac.compare_digest(candidate, key):
                match = key
        if match is None:
            raise AuthError(INVALID_API_KEY_MESSAGE, reason="unknown API key")
        return _owner_id(match.decode("utf-8"))
