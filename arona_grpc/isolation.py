"""``arona-gateway check-memory``: does this Philia keep users apart?

In ``user`` scope mode each user's episodes are stored as ``episode:<scope id>`` and
recalled with that ``node_type_filter``, so isolation rests on Philia honouring the filter.
:func:`check_isolation` finds out against the real thing: it stores one probe in each of two
fresh scopes (both probes share a rare word, so an unfiltered recall finds both), recalls
that word in each scope, and deletes the probes whatever happened.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from arona_grpc.philia import PhiliaClient, PhiliaError
from arona_grpc.scopes import scope_id, scoped_node_type

PROBE_LIMIT = 10


@dataclass(frozen=True)
class IsolationReport:
    # True: each scope recalled its own probe and only it.
    isolated: bool
    # One line for the operator.
    summary: str
    # Probes left behind because their delete failed (their node ids).
    left_behind: tuple[str, ...] = ()


async def check_isolation(client: PhiliaClient) -> IsolationReport:
    """Store, recall and delete two probes; whether each scope saw only its own.

    Raises :class:`~arona_grpc.philia.PhiliaError` when Philia cannot be reached or
    refuses a call before anything was learned.
    """
    word = "aronaprobe" + secrets.token_hex(6)
    scopes = {label: f"check-memory/{label}-{secrets.token_hex(8)}" for label in ("a", "b")}
    texts = {label: f"{word} isolation probe of scope {label}" for label in scopes}
    stored: dict[str, str] = {}
    try:
        for label, scope in scopes.items():
            stored[label] = await client.store(texts[label], scoped_node_type(scope_id(scope)))
        problems: list[str] = []
        for label, scope in scopes.items():
            other = "b" if label == "a" else "a"
            found = {
                m.text
                for m in await client.query(
                    word, PROBE_LIMIT, node_type=scoped_node_type(scope_id(scope))
                )
            }
            if texts[other] in found:
                problems.append(f"scope {label}'s recall returned scope {other}'s probe")
            elif texts[label] not in found:
                problems.append(f"scope {label}'s recall did not return its own probe")
    finally:
        left = await _delete_all(client, stored.values())
    if problems:
        return IsolationReport(False, "; ".join(problems), left)
    return IsolationReport(
        True, "each of two scopes recalled its own probe and not the other's", left
    )


async def _delete_all(client: PhiliaClient, node_ids: Iterable[str]) -> tuple[str, ...]:
    left: list[str] = []
    for node_id in list(node_ids):
        try:
            await client.delete(node_id)
        except PhiliaError:
            left.append(node_id)
    return tuple(left)
