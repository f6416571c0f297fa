"""The writeback journal: what a restarted process would send again."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from gateway_http import journal as journal_module
from gateway_http.journal import Journal, journal_path, read_journal
from tests.support.erasure import files_holding


def _texts(entries: list[journal_module.Journaled]) -> list[str]:
    return [entry.user for entry in entries]


def test_a_dropped_episode_is_not_sent_again_after_a_restart(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.log")
    first = journal.add("one", "1", "")
    second = journal.add("two", "2", "")
    # Outside an event loop a drop is written at once.
    journal.drop(first.id)
    assert _texts(journal.pending()) == ["two"]
    journal.close()
    again = Journal(tmp_path / "journal.log")
    assert again.pending() == [second]
    # Ids go on after the ones the file holds.
    assert again.add("three", "3", "").id > second.id
    again.close()


def test_a_dropped_episode_leaves_no_words_in_the_file(tmp_path: Path) -> None:
    # Once the memory service has a turn, its words are gone from the journal at once: a
    # forget of that memory then leaves nothing of it here, even after a SIGKILL.
    path = tmp_path / "journal.log"
    journal = Journal(path)
    first = journal.add("my locker code is Vorpalnine", "Noted", "alice")
    journal.add("my cat is called Miso", "Noted", "alice")
    journal.drop(first.id)
    assert files_holding(tmp_path, ["Vorpalnine"]) == {}
    assert _texts(read_journal(path)) == ["my cat is called Miso"]
    # Appends go on after the blanked line, and a restart reads the same.
    journal.add("three", "3", "")
    assert _texts(read_journal(path)) == ["my cat is called Miso", "three"]
    journal.close()
    assert _texts(Journal(path).pending()) == ["my cat is called Miso", "three"]


def test_a_journal_of_an_earlier_version_with_drop_lines_is_read(tmp_path: Path) -> None:
    path = tmp_path / "journal.log"
    path.write_bytes(
        b'{"id":1,"user":"one","assistant":"1","scope":"","episode_id":"a","at_us":0}\n'
        b'{"id":2,"user":"two","assistant":"2","scope":"","episode_id":"b","at_us":0}\n'
        b'{"drop":[1]}\n'
    )
    journal = Journal(path)
    assert _texts(journal.pending()) == ["two"]
    journal.close()
    # The start rewrote it with only what waits.
    assert files_holding(tmp_path, ["one"]) == {}


def test_a_line_cut_short_by_a_crash_is_skipped_and_nothing_after_it_is_lost(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal.log"
    journal = Journal(path)
    journal.add("kept", "1", "scope-a")
    journal.close()
    # A crash in the middle of the next write.
    with path.open("ab") as file:
        file.write(b'{"id":2,"user":"half of it')
    again = Journal(path)
    assert [(e.user, e.scope) for e in again.pending()] == [("kept", "scope-a")]
    again.add("after", "2", "")
    again.close()
    assert _texts(read_journal(path)) == ["kept", "after"]


def test_the_file_is_emptied_once_nothing_waits_and_rewritten_when_it_grows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal_module, "COMPACT_BYTES", 2_000)
    monkeypatch.setattr(journal_module, "REWRITE_BYTES", 8_000)
    path = tmp_path / "journal.log"
    journal = Journal(path)
    for i in range(20):
        journal.drop(journal.add(f"turn {i}", "x" * 100, "").id)
    # Everything was taken: the file never grew past the first limit.
    assert path.stat().st_size < 2_000
    waiting = journal.add("still waiting", "x", "")
    for i in range(100):
        journal.drop(journal.add(f"turn {i}", "x" * 100, "").id)
    # The one still waiting kept the file from being emptied; the rewrite kept it and bounded
    # the file.
    assert path.stat().st_size < 8_000 + 1_000
    assert journal.pending() == [waiting]
    journal.close()
    assert read_journal(path) == [waiting]


def _grow_until_rewritten(journal: Journal) -> None:
    """Journal taken episodes until the file passes the rewrite size (bounded)."""
    for _ in range(1_000):
        journal.drop(journal.add("taken", "x" * 100, "").id)
        if journal.rewriting is not None:
            return
    raise AssertionError("no rewrite started")


@pytest.mark.asyncio
async def test_a_rewrite_syncs_off_the_event_loop_and_keeps_what_comes_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal_module, "REWRITE_BYTES", 4_000)
    path = tmp_path / "journal.log"
    journal = Journal(path)
    # A disk that takes its time: the sync waits until the test lets it go.
    real_fsync = os.fsync
    syncing, release = threading.Event(), threading.Event()
    synced_on: list[int] = []

    def slow_fsync(fd: int) -> None:
        synced_on.append(threading.get_ident())
        syncing.set()
        release.wait(60)
        real_fsync(fd)

    monkeypatch.setattr(journal_module.os, "fsync", slow_fsync)
    waiting = journal.add("waiting before the rewrite", "x", "")
    _grow_until_rewritten(journal)
    old_inode = path.stat().st_ino
    assert await asyncio.to_thread(syncing.wait, 60)
    # The sync holds a worker thread, not this loop: turns go on being journaled meanwhile.
    meanwhile = [journal.add(f"during the sync {i}", "y", "") for i in range(5)]
    journal.drop(meanwhile[0].id)
    dropped_meanwhile = journal.add("Thistlewhorl dropped during the sync", "y", "")
    journal.drop(dropped_meanwhile.id)
    assert not journal.rewriting.done()
    release.set()
    await journal.rewriting
    assert synced_on and threading.get_ident() not in synced_on
    # The rewritten file took the journal's place with what waits, the rest included.
    assert path.stat().st_ino != old_inode
    assert path.stat().st_size < 2_000
    expected = [waiting, *meanwhile[1:]]
    assert read_journal(path) == expected == journal.pending()
    # What was dropped while the new file was being synced is not in it either.
    assert files_holding(tmp_path, ["Thistlewhorl", "during the sync 0"]) == {}
    # And it is the file appended to (and blanked in) from now on.
    later = journal.add("after the rewrite", "z", "")
    journal.drop(meanwhile[1].id)
    assert files_holding(tmp_path, ["during the sync 1"]) == {}
    journal.close()
    assert read_journal(path) == [waiting, *meanwhile[2:], later]


@pytest.mark.asyncio
async def test_a_rewrite_that_cannot_sync_keeps_the_journal_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(journal_module, "REWRITE_BYTES", 4_000)
    path = tmp_path / "journal.log"
    journal = Journal(path)
    attempts: list[int] = []

    def failing_fsync(fd: int) -> None:
        attempts.append(fd)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(journal_module.os, "fsync", failing_fsync)
    waiting = journal.add("waiting", "x", "")
    _grow_until_rewritten(journal)
    await asyncio.gather(journal.rewriting, return_exceptions=True)
    assert "could not rewrite the journal" in caplog.text
    assert not path.with_name(path.name + ".new").exists()
    # Nothing lost, and no new attempt on every turn: the next waits for as much growth again.
    for _ in range(20):
        journal.add("still journaled", "y", "")
    assert len(attempts) == 1
    assert read_journal(path)[0] == waiting
    assert len(read_journal(path)) == 21
    journal.close()


def _hold(
    path: str, ready: multiprocessing.synchronize.Event, done: multiprocessing.synchronize.Event
) -> None:
    journal = Journal(Path(path))
    journal.add("from the other process", "1", "")
    ready.set()
    done.wait(60)
    # Exits without closing: a process that died.
    os._exit(0)


def test_a_second_process_gets_its_own_file_and_a_dead_ones_episodes_are_taken_over(
    tmp_path: Path,
) -> None:
    path = journal_path(tmp_path, 0)
    context = multiprocessing.get_context("spawn")
    ready, done = context.Event(), context.Event()
    other = context.Process(target=_hold, args=(str(path), ready, done))
    other.start()
    try:
        assert ready.wait(60)
        # The file is held: this process journals in one of its own, and leaves the held
        # one alone.
        mine = Journal(path)
        assert mine.path != path
        assert mine.pending() == []
        mine.add("from this process", "2", "")
        mine.close()
        assert _texts(read_journal(path)) == ["from the other process"]
    finally:
        done.set()
        other.join(60)
    # The other process is gone: the next start takes over both files' episodes.
    restarted = Journal(path)
    assert sorted(_texts(restarted.pending())) == ["from the other process", "from this process"]
    assert sorted(p.name for p in tmp_path.glob("journal*")) == ["journal.log"]
    restarted.close()


def test_episodes_of_an_earlier_versions_sqlite_journal_are_taken_over(tmp_path: Path) -> None:
    legacy = sqlite3.connect(tmp_path / "journal-1.db")
    legacy.execute(
        "CREATE TABLE episodes (id INTEGER PRIMARY KEY AUTOINCREMENT, user_text TEXT NOT NULL,"
        " assistant TEXT NOT NULL, scope TEXT NOT NULL, episode_id TEXT NOT NULL,"
        " added_us INTEGER NOT NULL)"
    )
    legacy.execute(
        "INSERT INTO episodes (user_text, assistant, scope, episode_id, added_us)"
        " VALUES ('left behind', 'ok', 'key:alice', 'e-1', 0)"
    )
    legacy.commit()
    legacy.close()
    journal = Journal(journal_path(tmp_path, 1))
    [entry] = journal.pending()
    assert (entry.user, entry.assistant, entry.scope, entry.episode_id) == (
        "left behind",
        "ok",
        "key:alice",
        "e-1",
    )
    assert not list(tmp_path.glob("*.db"))
    journal.close()
    # In the new file now: the next start still has it.
    assert read_journal(journal_path(tmp_path, 1)) == [entry]


def test_any_text_survives_a_restart(tmp_path: Path) -> None:
    # A JSON request may carry a lone surrogate ("\ud800"): it must not cost the episode.
    text = 'héllo 日本 \ud800 \n"quoted"'
    journal = Journal(tmp_path / "journal.log")
    journal.add(text, text, "key:ünïcode")
    journal.close()
    [entry] = read_journal(tmp_path / "journal.log")
    assert (entry.user, entry.assistant, entry.scope) == (text, text, "key:ünïcode")


def test_a_turn_keeps_the_time_it_was_journaled_across_restarts(tmp_path: Path) -> None:
    before = time.time()
    journal = Journal(tmp_path / "journal.log")
    entry = journal.add("when was this?", "then", "")
    after = time.time()
    journal.close()
    assert entry.occurred_at is not None and before - 1e-6 <= entry.occurred_at <= after
    # A start rewrites the file, and a process taking over a dead one's file copies it: the
    # episode is sent with the time of its turn, however late that is.
    again = Journal(tmp_path / "journal.log")
    assert [e.occurred_at for e in again.pending()] == [entry.occurred_at]
    again.close()
    os.rename(tmp_path / "journal.log", tmp_path / "journal-3.log")
    taken = Journal(tmp_path / "journal.log")
    assert [(e.user, e.occurred_at) for e in taken.pending()] == [
        ("when was this?", entry.occurred_at)
    ]
    taken.close()
