"""The writeback journal: what a restarted process would send again."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway_http.journal import Journal


def _texts(journal: Journal) -> list[str]:
    return [entry.user for entry in journal.pending()]


def test_a_dropped_episode_is_not_sent_again_after_a_restart(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.db")
    first = journal.add("one", "1", "")
    journal.add("two", "2", "")
    # Outside an event loop a drop is written at once.
    journal.drop(first.id)
    assert _texts(journal) == ["two"]
    journal.close()
    assert _texts(Journal(tmp_path / "journal.db")) == ["two"]


@pytest.mark.asyncio
async def test_drops_go_with_the_next_episode_or_soon_after(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    journal = Journal(path)
    first = journal.add("one", "1", "")
    second = journal.add("two", "2", "")
    journal.drop(first.id)
    # Written with the next episode, in its transaction: a second connection sees it.
    journal.add("three", "3", "")
    assert _texts(Journal(path)) == ["two", "three"]
    # With no next episode, within the drop delay.
    journal.drop(second.id)
    written = asyncio.Event()
    asyncio.get_running_loop().call_later(0.6, written.set)
    await written.wait()
    assert _texts(Journal(path)) == ["three"]
    journal.close()
