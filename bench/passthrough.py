"""The pass-through rows: ``POST /v1/embeddings`` sent straight to the upstream (6a) and through
the memory-disabled gateway of row 2 (6b), measured in the same interleaved rounds as the chat
rows.

What the gateway adds to an OpenAI route it only passes on (routing, API keys, budgets, usage
metering, the answer's bytes copied through) is held to what it adds to a memory-off chat turn:
6b's added p50 over 6a at most row 2's added p50 over row 1, at c=1. The rows are declared here
(:data:`ROWS`), the load generator's arguments for them given by :func:`loadgen_args`, and the
target computed by :func:`target`; ``bench.run`` only lists them.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Mapping
from typing import Any

import orjson

ROUTE = "/v1/embeddings"
# The zero-latency upstream's embedding: text-embedding-3-small's size, base64 as the OpenAI SDK
# asks for it by default.
DIMENSIONS = 1536
# (key, label, target process, baseline key, expected X-Arona-Memory).
ROWS = (
    ("embed_direct", "6a. embeddings direct to the upstream (no gateway)", "upstream", "", "any"),
    (
        "embed_gw",
        "6b. embeddings through the gateway (pass-through, row 2's gateway)",
        "gw_off",
        "embed_direct",
        "disabled",
    ),
)
KEYS = frozenset(key for key, *_ in ROWS)
# 6b's added p50 at most this × row 2's, c=1.
WITHIN = 1.0


def embeddings_body(model: str, text: str) -> dict[str, Any]:
    """One embeddings request, as the OpenAI SDK sends it."""
    return {"model": model, "input": text, "encoding_format": "base64"}


def embeddings_answer(model: str) -> bytes:
    """The upstream's precomputed answer to every embeddings request."""
    vector = [((i * 37) % 101 - 50) / 100 for i in range(DIMENSIONS)]
    encoded = base64.b64encode(struct.pack(f"<{DIMENSIONS}f", *vector)).decode()
    return orjson.dumps(
        {
            "object": "list",
            "data": [{"object": "embedding", "index": 0, "embedding": encoded}],
            "model": model,
            "usage": {"prompt_tokens": 8, "total_tokens": 8},
        }
    )


def loadgen_args(key: str) -> list[str]:
    """What the load generator is told for row ``key`` (nothing for the chat rows)."""
    return ["--path", ROUTE, "--body", "embeddings"] if key in KEYS else []


def target(results: Mapping[tuple[str, int], Mapping[str, Any]]) -> tuple[str, str, bool] | None:
    """6b's added p50 over 6a against row 2's over row 1, c=1; None unless all four ran."""
    keys = ("embed_gw", "embed_direct", "mem_off", "direct")
    if not all((key, 1) in results for key in keys):
        return None
    p50 = {key: float(results[(key, 1)]["p50_ms"]) for key in keys}
    ours = p50["embed_gw"] - p50["embed_direct"]
    theirs = p50["mem_off"] - p50["direct"]
    ratio = ours / theirs if theirs > 0 else float("inf")
    return (
        f"pass-through embeddings (6b − 6a): added p50 ≤ {WITHIN:.2f} × the memory-off chat "
        "turn's (2 − 1), c=1",
        f"{ratio:.2f}× ({ours:.3f} ms vs {theirs:.3f} ms)",
        ratio <= WITHIN,
    )
