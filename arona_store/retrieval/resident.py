"""The stored memories' keys, ids and node types held in memory: the node table a recall reads.

A recall asks the node table for the ids of its candidates, the key of each node found by
meaning, and the neighbours of every candidate (its context: :mod:`arona_store.context`). Asked
of SQLite, these were about a fifth of a hybrid recall's CPU (some 2 ms at 10,000 memories:
one correlated sub-query per candidate for the neighbours). :class:`ResidentNodes` answers them
from memory: each node's id and type by key, each node type's keys in order (a neighbour is a
step along that list).

It follows the database in the recall's own snapshot, by the ``counters`` row the triggers keep
(:mod:`arona_store.schema`): the node count, the count of inserts and deletes, the highest key
and the count of writes below it. Unchanged counters: nothing to read. Nodes only added above
the highest key known (what every new episode and every refreshed one is): those rows are read,
a moved node leaves its old key. Anything else (a delete, a node written in the past, a text
changed): every row is read again (60 ms at 100,000 memories, once per such change). So it holds
exactly what the snapshot holds, whoever wrote it, this process or another.

Memory: about 250 bytes a node (25 MB at 100,000). Only the texts are still read from SQLite
(those a recall returns, and those it has not yet checked for a question).
"""

from __future__ import annotations

import bisect
import json
import sqlite3
from collections.abc import Sequence

from arona_store.context import AFTER, BEFORE
from arona_store.schema import COUNTERS

_ALL = "SELECT seq, id, node_type FROM nodes ORDER BY seq"
_ABOVE = "SELECT seq, id, node_type FROM nodes WHERE seq > ? ORDER BY seq"
_TEXTS_OF = "SELECT seq, text FROM nodes WHERE seq IN (SELECT value FROM json_each(?))"

# (nodes, changes, highest key, writes below it): see schema.COUNTERS.
State = tuple[int, int, int, int]


class KeyTable:
    """Each node's id and type by key, and each node type's keys in order (the module
    docstring); what follows a database is left to a subclass."""

    def __init__(self) -> None:
        self._id_of: dict[int, str] = {}
        self._key_of: dict[str, int] = {}
        self._type_of: dict[int, str] = {}
        # node type -> its keys, ascending.
        self._keys: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self._id_of)

    def _put(self, seq: int, node_id: str, node_type: str) -> None:
        """Add a node at a key no node holds."""
        self._id_of[seq] = node_id
        self._key_of[node_id] = seq
        self._type_of[seq] = node_type
        keys = self._keys.setdefault(node_type, [])
        if not keys or keys[-1] < seq:
            keys.append(seq)  # what nearly every write is: the newest
        else:
            bisect.insort(keys, seq)

    def _drop(self, seq: int) -> None:
        del self._key_of[self._id_of.pop(seq)]
        node_type = self._type_of.pop(seq)
        keys = self._keys[node_type]
        del keys[bisect.bisect_left(keys, seq)]
        if not keys:
            del self._keys[node_type]

    def count_of(self, node_type: str) -> int:
        """How many nodes of ``node_type`` are held."""
        return len(self._keys.get(node_type, ()))

    def type_of(self, seq: int) -> str | None:
        """The node type of the node at ``seq``; None when none is there."""
        return self._type_of.get(seq)

    def key_of(self, node_id: str) -> int | None:
        """The key of the node ``node_id``; None when none is stored."""
        return self._key_of.get(node_id)

    def ids(self, seqs: Sequence[int]) -> dict[int, str]:
        id_of = self._id_of
        return {seq: id_of[seq] for seq in seqs if seq in id_of}

    def neighbours(self, seqs: Sequence[int]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for seq in seqs:
            node_type = self._type_of.get(seq)
            if node_type is not None:
                out[seq] = near(self._keys[node_type], seq)
        return out


class ResidentNodes(KeyTable):
    """:class:`~arona_store.retrieval.NodeTable` in memory, following the store's SQLite file
    through one connection (the store's reader): call :meth:`sync` in each recall's read
    transaction before anything else."""

    def __init__(self, reader: sqlite3.Connection) -> None:
        super().__init__()
        self._reader = reader
        self._state: State | None = None

    def sync(self) -> set[int] | None:
        """Catch up with the snapshot of the open read transaction (module docstring); the keys
        whose own text or context document changed since the last sync (those of the nodes
        added, moved or deleted, and of their neighbours before and after), None when that
        cannot be told (the first sync, a text changed in place)."""
        row = self._reader.execute(COUNTERS).fetchone()
        state: State = (int(row[0]), int(row[1]), int(row[2]), int(row[3]))
        if state == self._state:
            return set()
        changed = None if self._state is None else self._appended(self._state, state)
        if changed is None:
            changed = self._load(first=self._state is None)
        self._state = state
        return changed

    def _appended(self, known: State, state: State) -> set[int] | None:
        """Read the nodes above the highest key known, if that is all that changed (no write
        below it, no delete: the counts move by the new nodes alone), and say which keys'
        documents changed; None otherwise, having changed nothing."""
        nodes, changes, hi, backdated = known
        if state[3] != backdated:
            return None
        rows = self._reader.execute(_ABOVE, (hi,)).fetchall()
        new = sum(1 for _, node_id, _ in rows if node_id not in self._key_of)
        if state[0] - nodes != new or state[1] - changes != new:
            return None
        changed: set[int] = set()
        for seq, node_id, node_type in rows:
            moved = self._key_of.get(node_id)
            if moved is not None:
                changed.add(moved)
                changed.update(near(self._keys[self._type_of[moved]], moved))
                self._drop(moved)
            self._put(int(seq), str(node_id), str(node_type))
            changed.add(int(seq))
            changed.update(near(self._keys[str(node_type)], int(seq)))
        return changed

    def _load(self, *, first: bool) -> set[int] | None:
        """Read every node again; the keys that changed (those that came or went, and their
        neighbours before and after), None on the first load or when none did."""
        old_types, old_keys = self._type_of, self._keys
        self._id_of, self._key_of, self._type_of, self._keys = {}, {}, {}, {}
        for seq, node_id, node_type in self._reader.execute(_ALL):
            self._put(int(seq), str(node_id), str(node_type))
        if first:
            return None
        gone = old_types.keys() - self._type_of.keys()
        came = self._type_of.keys() - old_types.keys()
        if not gone and not came:
            return None  # a text changed in place, or anything else not told by the keys
        changed = gone | came
        for seq in gone:
            changed.update(near(old_keys[old_types[seq]], seq))
        for seq in came:
            changed.update(near(self._keys[self._type_of[seq]], seq))
        return changed

    def texts(self, seqs: Sequence[int]) -> dict[int, str]:
        if not seqs:
            return {}
        rows = self._reader.execute(_TEXTS_OF, (json.dumps(list(seqs)),))
        return {int(seq): str(text) for seq, text in rows}


def near(keys: list[int], seq: int) -> list[int]:
    """The neighbours of ``seq`` among ``keys`` (its node type's, ascending, holding it),
    nearest first on each side."""
    at = bisect.bisect_left(keys, seq)
    return keys[max(0, at - AFTER) : at][::-1] + keys[at + 1 : at + 1 + BEFORE]
