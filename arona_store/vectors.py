"""The in-memory copy of the stored node vectors that a ``hybrid`` recall searches.

Vectors live in the store's SQLite file (table ``vectors``: an AUTOINCREMENT ``vid``, the node
id, the vector as float16, 768 bytes); :class:`VectorIndex` holds them as one float32 matrix
(converting the rows a search reads from float16 cost 0.35-0.45 ms per recall), and a search
is brute force (exact, and nothing to keep balanced). Up to
:data:`REDUCE_FROM` vectors it computes every cosine. Beyond, reading every full vector would
cost about 9 ms at 100,000 nodes on one core, so the index also keeps each vector's projection
on the :data:`REDUCED_DIMS` principal directions of the stored vectors (float32, 384 bytes): a
search ranks those projections first and computes the exact cosine of the best
:func:`coarse_depth` only (about 2 ms at 100,000 nodes, 0.4 at 10,000). Memory: 1.9 KB a node
(192 MB at 100,000).

The index follows the database by ``vid``: before each recall it reads the vectors added since
(in the recall's own snapshot, a few microseconds when there are none), so vectors written by
the store's writer, its background fill or another process all appear. Vectors of deleted
nodes may linger in the matrix; a recall checks its candidates against the snapshot, where
they are gone.
"""

from __future__ import annotations

import sqlite3
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

# The vectors added since `vid`, with their node's type (as the snapshot sees them).
_VECTORS_SINCE = (
    "SELECT v.vid, n.node_type, v.vec, v.node_id FROM vectors v JOIN nodes n ON n.id = v.node_id"
    " WHERE v.vid > ? ORDER BY v.vid"
)
_INITIAL_CAPACITY = 1024
# From this many vectors on, a search first ranks the vectors' projections on their
# REDUCED_DIMS principal directions (a quarter of the memory read) and then computes the exact
# cosine of the best coarse_depth() only. The directions are fitted on up to FIT_SAMPLE rows,
# again each time the index has doubled.
#
# Measured on public text (12,761 vectors: LoCoMo's dialog turns and Natural Questions'
# questions; 600 questions: LoCoMo's and Natural Questions'), with the depth scaled to the
# share of the store it is at 10,000 and at 100,000 nodes, the share of the exact 40 best that a
# search returns: 128 directions and a depth of 512 at any size (before): 1.000 and 0.933;
# 96 directions and a depth of one node in COARSE_SHARE: 0.997 and 0.968 (of the exact 10
# best: 0.999 and 0.991, as before). 64 directions lose more (0.985 at 10,000 with 512).
REDUCE_FROM = 1024
REDUCED_DIMS = 96
COARSE_DEPTH = 512
COARSE_FACTOR = 8
COARSE_SHARE = 80
FIT_SAMPLE = 20_000
# From this many rows on, the first pass's product is computed in two halves, one on a helper
# thread: it reads memory at the pace of one core (the projections are 38 MB at 100,000 rows),
# and the recall's other core is idle then (the question is embedded). Measured at 100,000 rows,
# caches cold: 2.5-2.9 ms on one thread, 1.6-1.9 ms on two.
SPLIT_FROM = 50_000

Vector = npt.NDArray[np.float32]


def to_blob(vector: Vector) -> bytes:
    """A vector as stored (float16, little-endian)."""
    return vector.astype("<f2").tobytes()


def coarse_depth(size: int, k: int) -> int:
    """How many of ``size`` rows, ranked by their projections, a search for the ``k`` best
    computes the exact cosine of: :data:`COARSE_DEPTH`, more for a large ``k`` or a large
    store (one row in :data:`COARSE_SHARE`), so the share of the exact best it finds does not
    fall as the store grows."""
    return max(COARSE_DEPTH, COARSE_FACTOR * k, size // COARSE_SHARE)


def _single_threaded_blas() -> None:
    """Keep numpy's BLAS on the calling thread (for the whole process, which uses numpy for
    nothing else). A search's products take a millisecond or two; a second BLAS thread halves
    little of that and spins for longer after each one, measured as 10 ms more CPU per recall
    at 10,000 nodes, taken from the gateway sharing the cores."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")


class VectorIndex:
    """Every stored vector (float32) with its ``vid`` and node type, and, once there
    are :data:`REDUCE_FROM` of them, their projection on the :data:`REDUCED_DIMS` principal
    directions (float32) for a first, cheap pass (module docstring)."""

    def __init__(self, dimension: int) -> None:
        _single_threaded_blas()
        self.dimension = dimension
        self._full = np.zeros((_INITIAL_CAPACITY, dimension), dtype=np.float32)
        self._vids = np.zeros(_INITIAL_CAPACITY, dtype=np.int64)
        self._types = np.zeros(_INITIAL_CAPACITY, dtype=np.int32)
        self._type_codes: dict[str, int] = {}
        self._size = 0
        self._last_vid = 0
        # node id -> its row (the newest, should a node's vector be stored again), and back.
        self._rows: dict[str, int] = {}
        self._node_ids: list[str] = []
        # The projection (dimension x REDUCED_DIMS), the projected rows, and how many rows
        # there were when it was fitted (it is fitted again each time they have doubled).
        self._basis: npt.NDArray[np.float32] | None = None
        self._reduced = np.zeros((0, REDUCED_DIMS), dtype=np.float32)
        self._fitted_at = 0
        # The thread that computes half of a large first pass (SPLIT_FROM), once needed.
        self._helper: ThreadPoolExecutor | None = None

    def __len__(self) -> int:
        return self._size

    def sync(self, conn: sqlite3.Connection) -> int:
        """Add the vectors stored since the last sync (read transaction open); how many."""
        rows = conn.execute(_VECTORS_SINCE, (self._last_vid,)).fetchall()
        if not rows:
            return 0
        start, end = self._size, self._size + len(rows)
        self._grow(end)
        blobs = b"".join(row[2] for row in rows)
        block = (
            np.frombuffer(blobs, dtype="<f2").reshape(len(rows), self.dimension).astype(np.float32)
        )
        self._full[start:end] = block
        self._vids[start:end] = [row[0] for row in rows]
        self._types[start:end] = [self._code(row[1]) for row in rows]
        self._rows.update((row[3], start + i) for i, row in enumerate(rows))
        self._node_ids.extend(str(row[3]) for row in rows)
        self._size = end
        self._last_vid = int(rows[-1][0])
        if end >= REDUCE_FROM and end >= 2 * self._fitted_at:
            self._fit()
        elif self._basis is not None:
            self._reduced[start:end] = block @ self._basis
        return len(rows)

    def top(self, query: Vector, k: int, node_type: str | None = None) -> list[tuple[float, int]]:
        """The ``k`` most similar rows as (cosine, vid), best first; only rows of
        ``node_type`` when given."""
        return [(cosine, int(self._vids[row])) for cosine, row in self._top(query, k, node_type)]

    def top_nodes(
        self, query: Vector, k: int, node_type: str | None = None
    ) -> list[tuple[float, str]]:
        """:meth:`top` as (cosine, node id): the node may have been deleted since its vector
        was read (the caller checks it against its snapshot)."""
        return [(cosine, self._node_ids[row]) for cosine, row in self._top(query, k, node_type)]

    def _top(self, query: Vector, k: int, node_type: str | None) -> list[tuple[float, int]]:
        """The ``k`` most similar rows as (cosine, row), best first."""
        if self._size == 0 or k <= 0:
            return []
        mask: npt.NDArray[np.bool_] | None = None
        if node_type is not None:
            code = self._type_codes.get(node_type)
            if code is None:
                return []
            mask = self._types[: self._size] == code
        if self._basis is None:
            rows = np.arange(self._size)
            scores = self._full[: self._size] @ query
        else:
            # First pass on the projections, then the exact cosine of the best few.
            coarse = self._projected(query @ self._basis)
            if mask is not None:
                coarse = np.where(mask, coarse, -np.inf)
            depth = min(self._size, coarse_depth(self._size, k))
            rows = (
                np.argpartition(-coarse, depth - 1)[:depth]
                if depth < self._size
                else np.arange(self._size)
            )
            if mask is not None:
                rows = rows[np.isfinite(coarse[rows])]
            mask = None
            scores = self._full[rows] @ query
        if mask is not None:
            keep = mask[rows]
            rows, scores = rows[keep], scores[keep]
        k = min(k, len(rows))
        if k == 0:
            return []
        best = np.argpartition(-scores, k - 1)[:k] if k < len(rows) else np.arange(len(rows))
        best = best[np.argsort(-scores[best], kind="stable")]
        return [(float(scores[i]), int(rows[i])) for i in best]

    def _projected(self, projected: Vector) -> Vector:
        """The product of every row's projection with the query's (``projected``): in two
        halves from :data:`SPLIT_FROM` rows on, one on the helper thread. Called by one search
        at a time (the store's read lock)."""
        rows = self._reduced[: self._size]
        if self._size < SPLIT_FROM:
            return rows @ projected
        if self._helper is None:
            self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="arona-vectors")
        out = np.empty(self._size, dtype=np.float32)
        half = self._size // 2
        pending = self._helper.submit(np.dot, rows[half:], projected, out[half:])
        np.dot(rows[:half], projected, out[:half])
        pending.result()
        return out

    def close(self) -> None:
        """Stop the helper thread, if started (the store is closing)."""
        if self._helper is not None:
            self._helper.shutdown(wait=False)

    def cosines(self, query: Vector, node_ids: list[str]) -> list[float | None]:
        """The cosine of ``query`` with the vector of each of ``node_ids`` (None for a node
        without one), from the matrix: no stored vector is read or converted."""
        rows = [self._rows.get(node_id) for node_id in node_ids]
        held = [row for row in rows if row is not None]
        if not held:
            return [None] * len(rows)
        found = iter((self._full[held] @ query).tolist())
        return [None if row is None else next(found) for row in rows]

    def _fit(self) -> None:
        """Fit the projection on (a sample of) the rows and project them all."""
        rows = self._full[: self._size]
        step = max(1, self._size // FIT_SAMPLE)
        sample = rows[::step]
        _, _, directions = np.linalg.svd(sample, full_matrices=False)
        basis = np.ascontiguousarray(directions[:REDUCED_DIMS].T, dtype=np.float32)
        capacity = len(self._vids)
        reduced = np.zeros((capacity, REDUCED_DIMS), dtype=np.float32)
        for begin in range(0, self._size, 16384):
            stop = min(self._size, begin + 16384)
            reduced[begin:stop] = rows[begin:stop] @ basis
        self._basis, self._reduced, self._fitted_at = basis, reduced, self._size

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
        full = np.zeros((capacity, self.dimension), dtype=np.float32)
        full[: self._size] = self._full[: self._size]
        vids = np.zeros(capacity, dtype=np.int64)
        vids[: self._size] = self._vids[: self._size]
        types = np.zeros(capacity, dtype=np.int32)
        types[: self._size] = self._types[: self._size]
        self._full, self._vids, self._types = full, vids, types
        if self._basis is not None:
            reduced = np.zeros((capacity, REDUCED_DIMS), dtype=np.float32)
            reduced[: self._size] = self._reduced[: self._size]
            self._reduced = reduced
