"""Caller authentication for the HTTP layer: HS256 JWTs and API keys, on REST and JSON-RPC.

JWTs are verified with PyJWT pinned to HS256 only, with ``exp`` and ``sub`` required; the
verifier fails closed when no secret is configured. REST API keys are compared in constant
time and mapped to an owner id that is derived from, but never equal to, the key, so the key
itself never ends up in the conversation database or in logs.

Nothing here logs or echoes a token or key: :class:`AuthError` messages are fixed strings that
are safe to send to the caller, and :attr:`AuthError.reason` is a fixed, secret-free label for
the operator's logs. A token whose signature holds but whose ``sub`` could collide with
another principal (:func:`arona_grpc.scopes.subject_error`) is :class:`InvalidSubject`, whose
message says what a ``sub`` must be: its issuer has to mint it differently.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

import jwt

from arona_grpc.scopes import subject_error

logger = logging.getLogger(__name__)

ALGORITHM = "HS256"
ANONYMOUS = "anonymous"
ADMIN_ROLE = "admin"
# A key entry ``name=key`` names its key when the name is made of these characters.
_KEY_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
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


@dataclass(frozen=True)
class Principal:
    """Who is calling: a JWT ``sub`` or ``key:<name>``; ``admin`` for a JWT with role admin."""

    id: str
    admin: bool = False


def memory_scope(principal: Principal | None, user: str | None) -> str | None:
    """Whose memory a turn uses: the principal, narrowed by the OpenAI ``user`` field
    (``<principal>/<user>``); None without a principal (never a guessed scope)."""
    if principal is None:
        return None
    return f"{principal.id}/{user}" if user else principal.id


class AuthError(Exception):
    """The caller is not authenticated; ``str(error)`` is safe to show to the caller."""

    def __init__(self, message: str = AUTH_REQUIRED_MESSAGE, reason: str = "") -> None:
        super().__init__(message)
        self.message = message
        # A fixed label for logs; never contains the token or the key.
        self.reason = reason or message


class InvalidSubject(AuthError):
    """A validly signed JWT whose ``sub`` is not a principal (the message says why)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="subject not allowed")


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
        return self.principal(token).id

    def principal(self, token: str | None) -> Principal:
        """The token's ``sub`` and whether it carries ``"role": "admin"``; raise
        :class:`AuthError` for anything less than valid."""
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
        if not isinstance(sub, str):
            raise AuthError(reason="subject not a string")
        problem = subject_error(sub)
        if problem is not None:
            raise InvalidSubject(problem)
        return Principal(sub, admin=claims.get("role") == ADMIN_ROLE)


def _reason(exc: jwt.PyJWTError) -> str:
    for kind, label in _JWT_REASONS:
        if isinstance(exc, kind):
            return label
    return "invalid token"


def mint_token(secret: str, sub: str, ttl_s: int = 3600, *, admin: bool = False) -> str:
    """Mint an HS256 JWT for ``sub`` valid for ``ttl_s`` seconds (``arona-gateway token``);
    ``admin`` adds ``"role": "admin"``."""
    if not secret:
        raise ValueError("a JWT secret is required to mint a token")
    problem = subject_error(sub)
    if problem is not None:
        raise ValueError(problem.replace("the token's 'sub'", "sub"))
    if ttl_s <= 0:
        raise ValueError("ttl_s must be positive")
    now = int(time.time())
    payload: dict[str, Any] = {"sub": sub, "iat": now, "exp": now + ttl_s}
    if admin:
        payload["role"] = ADMIN_ROLE
    return jwt.encode(payload, secret, algorithm=ALGORITHM)


def _owner_id(key: str) -> str:
    # A stable id that names the key without being it: stored as the conversation owner.
    return "key:" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]


def parse_key_entry(entry: str) -> tuple[str, str]:
    """``(principal, key)`` of one ``ARONA_API_KEYS`` entry: ``name=key`` or a bare key.

    A named key's principal is ``key:<name>``; a bare key's is ``key:`` and a short hash of
    it (never the key). An entry is named only when what stands before its first ``=`` is a
    name (letters, digits, ``_ . -``) and what follows is a key that does not start with
    ``=``, so base64 keys ending in ``=`` padding stay bare keys.
    """
    name, sep, key = entry.partition("=")
    if sep and key and not key.startswith("=") and _KEY_NAME.fullmatch(name):
        return f"key:{name}", key
    return _owner_id(entry), entry


class ApiKeys:
    """The REST API keys; no keys configured means REST is open to everyone as ``anonymous``."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        # Only an empty tuple opens REST. Empty entries are dropped (they would match an empty
        # credential), so a tuple of only empty strings fails closed rather than open.
        self._open = not keys
        self._keys = tuple(
            (key.encode("utf-8"), principal)
            for principal, key in (parse_key_entry(entry) for entry in keys if entry)
        )

    @property
    def open(self) -> bool:
        """True when no key is configured (REST is unauthenticated)."""
        return self._open

    def match(self, credential: str) -> str | None:
        """The principal of the configured key equal to ``credential``, else None."""
        candidate = credential.encode("utf-8")
        match: str | None = None
        # Compare against every key without stopping early, so timing does not reveal which
        # (or whether an earlier) key matched. Bytes, because compare_digest refuses non-ASCII
        # str.
        for key, principal in self._keys:
            if hmac.compare_digest(candidate, key):
                match = principal
        return match

    def owner(self, authorization: str | None) -> str:
        """Return the owner id for an ``Authorization`` header; raise :class:`AuthError`."""
        if self.open:
            return ANONYMOUS
        credential = bearer(authorization)
        if credential is None:
            raise AuthError(INVALID_API_KEY_MESSAGE, reason="no API key")
        principal = self.match(credential)
        if principal is None:
            raise AuthError(INVALID_API_KEY_MESSAGE, reason="unknown API key")
        return principal


class RestAuth:
    """Who a REST caller is: one of ``ARONA_API_KEYS``, or a valid JWT (its ``sub``).

    A person is then the same owner on REST and JSON-RPC. With keys configured, a bearer that
    is neither is refused; with REST open, a caller without a valid JWT is nobody (None).
    """

    def __init__(self, keys: ApiKeys, verifier: JwtVerifier) -> None:
        self.keys = keys
        self._verifier = verifier

    @property
    def open(self) -> bool:
        return self.keys.open

    def principal(self, authorization: str | None) -> Principal | None:
        credential = bearer(authorization)
        if credential is None:
            if self.keys.open:
                return None
            raise AuthError(INVALID_API_KEY_MESSAGE, reason="no API key")
        if not self.keys.open:
            key_principal = self.keys.match(credential)
            if key_principal is not None:
                return Principal(key_principal)
        if self._verifier.configured and credential.count(".") == 2:
            try:
                return self._verifier.principal(credential)
            except InvalidSubject:
                # Signed by our issuer, but not a principal: refused even on an open REST,
                # so that the issuer hears of it.
                raise
            except AuthError as exc:
                logger.debug("REST bearer refused as a JWT: %s", exc.reason)
        if self.keys.open:
            return None
        raise AuthError(INVALID_API_KEY_MESSAGE, reason="unknown API key")


class RpcAuth:
    """Who a JSON-RPC caller is: one of ``ARONA_API_KEYS`` (its principal, ``key:<name>``,
    never an admin), or a valid JWT (its ``sub``; an admin with ``"role": "admin"``).

    A key holder manages its own memories and conversations on JSON-RPC as on REST, with no
    JWT to mint. Without ``ARONA_JWT_SECRET`` JWTs are refused (fail closed); keys still work.
    """

    def __init__(self, verifier: JwtVerifier, keys: ApiKeys | None = None) -> None:
        self._verifier = verifier
        self._keys = keys if keys is not None and not keys.open else None

    def principal(self, token: str | None) -> Principal:
        """The caller's principal; raise :class:`AuthError` for anything less than valid."""
        if token and self._keys is not None:
            key_principal = self._keys.match(token)
            if key_principal is not None:
                return Principal(key_principal)
        return self._verifier.principal(token)
