"""The in-memory copy of the stored node vectors that a ``hybrid`` recall searches.

Vectors live in the store's SQLite file (table ``vectors``: an AUTOINCREMENT ``vid``, the node
id, the vector as float16); :class:`VectorIndex` holds them as one float32 matrix, so a recall
is one matrix-vector product over every node (brute force: about 9 ms for 100,000 nodes on one
core, exact, and nothing to keep balanced). The index follows the database by ``vid``: before
each recall it reads the vectors added since (in the recall's own snapshot, a few microseconds
when there are none), so vectors written by the store's writer, its background fill or another
process all appear. Vectors of deleted nodes may linger in the matrix; a recall checks its
candidates against the snapshot, where they are gone.
"""

from __future__ import annotations

import sqlite3

import numpy as np
import numpy.typing as npt

# The vectors added since `vid`, with their node's type (as the snapshot sees them).
_VECTORS_SINCE = (
    "SELECT v.vid, n.node_type, v.vec FROM vectors v JOIN nodes n ON n.id = v.node_id"
    " WHERE v.vid > ? ORDER BY v.vid"
)
_INITIAL_CAPACITY = 1024
VECTOR_DTYPE = np.float16

Vector = npt.NDArray[np.float32]


def to_blob(vector: Vector) -> bytes:
    """A vector as stored (float16, little-endian)."""
    return vector.astype("<f2").tobytes()


def from_blob(blob: bytes) -> Vector:
    return np.frombuffer(blob, dtype="<f2").astype(np.float32)


def cosines_of(query: Vector, blobs: list[bytes]) -> list[float]:
    """The cosine of ``query`` with each stored vector (both unit length)."""
    matrix = np.frombuffer(b"".join(blobs), dtype="<f2").reshape(len(blobs), -1)
    return [float(x) for x in matrix.astype(np.float32) @ query]


class VectorIndex:
    """Every stored vector as rows of one float32 matrix, with its ``vid`` and node type."""

    def __init__(self, dimension: int) -> None:
        self.dimension = dimension
        self._matrix = np.zeros((_INITIAL_CAPACITY, dimension), dtype=np.float32)
        self._vids = np.zeros(_INITIAL_CAPACITY, dtype=np.int64)
        self._types = np.zeros(_INITIAL_CAPACITY, dtype=np.int32)
        self._type_codes: dict[str, int] = {}
        self._size = 0
        self._last_vid = 0

    def __len__(self) -> int:
        return self._size

    def sync(self, conn: sqlite3.Connection) -> int:
        """Add the vectors stored since the last sync (read transaction open); how many."""
        rows = conn.execute(_VECTORS_SINCE, (self._last_vid,)).fetchall()
        if not rows:
            return 0
        self._grow(self._size + len(rows))
        blobs = b"".join(row[2] for row in rows)
        block = np.frombuffer(blobs, dtype="<f2").reshape(len(rows), self.dimension)
        end = self._size + len(rows)
        self._matrix[self._size : end] = block
        self._vids[self._size : end] = [row[0] for row in rows]
        self._types[self._size : end] = [self._code(row[1]) for row in rows]
        self._size = end
        self._last_vid = int(rows[-1][0])
        return len(rows)

    def top(self, query: Vector, k: int, node_type: str | None = None) -> list[tuple[float, int]]:
        """The ``k`` most similar rows as (cosine, vid), best first; only rows of
        ``node_type`` when given."""
        if self._size == 0 or k <= 0:
            return []
        scores = self._matrix[: self._size] @ query
        if node_type is not None:
            code = self._type_codes.get(node_type)
            if code is None:
                return []
            scores = np.where(self._types[: self._size] == code, scores, -np.inf)
        k = min(k, self._size)
        picked = np.argpartition(-scores, k - 1)[:k] if k < self._size else np.arange(self._size)
        picked = picked[np.argsort(-scores[picked], kind="stable")]
        return [(float(scores[i]), int(self._vids[i])) for i in picked if np.isfinite(scores[i])]

    def _code(self, node_type: str) -> int:
        code = self._type_codes.get(node_type)
        if code is None:
            code = self._type_codes[node_type] = len(self._type_codes)
        return code

    def _grow(self, needed: int) -> None:
        capacity = len(self._vids)
        if needed <= capacity:
            return
        while capacity < needed:
            capacity *= 2
        matrix = np.zeros((capacity, self.dimension), dtype=np.float32)
        matrix[: self._size] = self._matrix[: self._size]
        vids = np.zeros(capacity, dtype=np.int64)
        vids[: self._size] = self._vids[: self._size]
        types = np.zeros(capacity, dtype=np.int32)
        types[: self._size] = self._types[: self._size]
        self._matrix, self._vids, self._types = matrix, vids, types
