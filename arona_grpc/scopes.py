"""Memory scopes: whose memory an episode is.

A scope names the owner of a turn's memory: the caller's principal (a JWT ``sub``, or
``key:<name>`` for a REST API key), optionally narrowed by the OpenAI ``user`` field
(``key:team-a/bob``). Philia never sees the name: it sees the **scope id**, a hash of it,
as part of an episode's node type (``episode:<scope id>``), which is also the
``node_type_filter`` of that scope's recalls in ``user`` mode.

Two callers never share a scope by accident of naming: a principal has no ``/`` (so the
principal of ``alice/bob`` is ``alice``, narrowed to ``bob``), and a JWT ``sub`` may not
start with ``key:``, the API keys' namespace (:func:`subject_error`).
"""

from __future__ import annotations

import hashlib

EPISODE_NODE_TYPE = "episode"
# Hex characters of the scope id: 128 bits, so two scopes never share one by chance.
SCOPE_ID_CHARS = 32
# The API keys' principals: ``key:<name>``, or ``key:`` and a hash of an unnamed key.
KEY_PREFIX = "key:"
MAX_PRINCIPAL_CHARS = 128
# The OpenAI ``user`` field that narrows a principal's scope: bounded, no control characters.
MAX_USER_CHARS = 256
SUBJECT_RULE = (
    f"1 to {MAX_PRINCIPAL_CHARS} printable characters, without '/', "
    f"not starting with '{KEY_PREFIX}'"
)


def principal_error(principal: str) -> str | None:
    """Why ``principal`` cannot name a caller (None when it can): 1 to 128 printable
    characters without ``/``, not blank."""
    if not principal.strip() or len(principal) > MAX_PRINCIPAL_CHARS:
        return f"must be 1 to {MAX_PRINCIPAL_CHARS} characters, not blank"
    if not principal.isprintable():
        return "must be printable characters only"
    if "/" in principal:
        return "must not contain '/' (it separates a principal from the user it narrows to)"
    return None


def subject_error(sub: str) -> str | None:
    """Why a JWT ``sub`` cannot be a principal (None when it can): a principal outside the
    API keys' ``key:`` namespace, so no token can speak as a key or as another's user."""
    if principal_error(sub) is not None or sub[: len(KEY_PREFIX)].lower() == KEY_PREFIX:
        return f"the token's 'sub' must be {SUBJECT_RULE}"
    return None


def user_error(user: str) -> str | None:
    """Why an OpenAI ``user`` value cannot narrow a scope (None when it can)."""
    if len(user) > MAX_USER_CHARS:
        return f"must be at most {MAX_USER_CHARS} characters"
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in user):
        return "must not contain control characters"
    return None


def scope_error(scope: str) -> str | None:
    """Why a scope name is not ``<principal>`` or ``<principal>/<user>`` (None when it is)."""
    principal, narrowed, user = scope.partition("/")
    problem = principal_error(principal)
    if problem is not None:
        return f"scope: its principal (before the first '/') {problem}"
    if narrowed:
        problem = user_error(user) if user else "must not be empty after '/'"
        if problem is not None:
            return f"scope: its user (after the first '/') {problem}"
    return None


def scope_id(scope: str) -> str:
    """The hashed id of a scope name (stable across processes and restarts)."""
    return hashlib.sha256(scope.encode("utf-8")).hexdigest()[:SCOPE_ID_CHARS]


def principal_id(scope: str) -> str:
    """The scope id of ``scope``'s principal (its part before the first ``/``), which is
    also the id of that principal's own scope; "" for no scope."""
    return scope_id(scope.partition("/")[0]) if scope else ""


def is_scoped_node_type(node_type: str) -> bool:
    """Whether a node is an episode stored for one scope alone (``user`` mode)."""
    return node_type.startswith(f"{EPISODE_NODE_TYPE}:")


def scoped_node_type(scope_id_: str) -> str:
    """The node type of a ``user``-mode episode: ``episode:<scope id>``."""
    return f"{EPISODE_NODE_TYPE}:{scope_id_}"
