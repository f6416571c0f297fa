"""Memory scopes: whose memory an episode is.

A scope names the owner of a turn's memory: the caller's principal (a JWT ``sub``, or
``key:<name>`` for a REST API key), optionally narrowed by the OpenAI ``user`` field
(``key:team-a/bob``). Philia never sees the name: it sees the **scope id**, a hash of it,
as part of an episode's node type (``episode:<scope id>``), which is also the
``node_type_filter`` of that scope's recalls in ``user`` mode.
"""

from __future__ import annotations

import hashlib

EPISODE_NODE_TYPE = "episode"
# Hex characters of the scope id: 128 bits, so two scopes never share one by chance.
SCOPE_ID_CHARS = 32


def scope_id(scope: str) -> str:
    """The hashed id of a scope name (stable across processes and restarts)."""
    return hashlib.sha256(scope.encode("utf-8")).hexdigest()[:SCOPE_ID_CHARS]


def scoped_node_type(scope_id_: str) -> str:
    """The node type of a ``user``-mode episode: ``episode:<scope id>``."""
    return f"{EPISODE_NODE_TYPE}:{scope_id_}"
