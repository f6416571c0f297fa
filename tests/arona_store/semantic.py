"""Marks for tests that need the ``semantic`` extra: skipped without it on a developer's
machine, run (and so failing) under ``CI=true``, where the extra must be installed."""

from __future__ import annotations

import os

import pytest

from arona_store.ranking import semantic_available

needs_semantic = pytest.mark.skipif(
    not semantic_available() and os.environ.get("CI") != "true",
    reason="the semantic extra is not installed (pip install -e '.[semantic]')",
)
