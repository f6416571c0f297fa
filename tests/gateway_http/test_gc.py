"""A started server freezes its start-up heap and collects young objects less often."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from gateway_http.commands import runtime


@pytest.fixture
def gc_state() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


@pytest.mark.usefixtures("gc_state")
def test_settle_gc_freezes_what_exists_and_raises_the_young_threshold() -> None:
    _, middle, oldest = gc.get_threshold()
    long_lived = [[] for _ in range(1000)]  # stands for start-up state: containers the GC tracks
    runtime.settle_gc()
    # Frozen objects are left out of every later collection, full ones included.
    assert gc.get_freeze_count() >= len(long_lived)
    tracked = {id(obj) for obj in gc.get_objects()}
    assert not any(id(obj) in tracked for obj in long_lived)
    assert gc.get_threshold() == (runtime.GC_YOUNG_THRESHOLD, middle, oldest)
