"""Hash-table row ids -> row slots, every operation vectorised over a batch of ids.

A Python dict looked up id by id cost about 0.7 us per id: 1.5 ms of server
CPU for a pull of 2,048 rows, three times the whole pull of a dense table's
rows. This index is open addressing with linear probing in two NumPy
arrays, so a batch costs a few array passes per probe round (rounds stay
few: the table is kept at most half full).

Buckets hold an id and its slot; a slot of ``_EMPTY`` ends a probe chain,
``_DELETED`` (a removed id) does not. Inserts reuse deleted buckets (the
ids inserted are known to be absent) and the table is rebuilt when live
plus deleted buckets pass half of it, never to fewer buckets than it had,
so its size changes only in :meth:`IdIndex.reserve`, where the owning table
books the memory first. Not thread-safe: the owning table's lock guards it.

Lookups probe in one compiled loop once numba has it ready (a batch of
1,357 ids: about 10 us against 80 us of NumPy rounds); until then, and
without numba, the NumPy rounds give the same buckets.
"""

from __future__ import annotations

import numpy as np

from wehub_ps.kernels.compiled import compiled_soon

__all__ = ["IdIndex", "index_bytes_for"]

_EMPTY = -1
_DELETED = -2
_CLAIMED = -3  # only while an insert is placing its ids
_MIN_BUCKETS = 1024
# Fibonacci hashing (Knuth): the id times 2^64 / golden ratio, top bits. Not
# SplitMix64, which places the rows on shards: on one shard every id has the
# same SplitMix64 residue, and its low bits would leave buckets unused.
_FIBONACCI = np.uint64(0x9E3779B97F4A7C15)


class IdIndex:
    """A map of unique int64 ids to int64 slots (see the module docstring)."""

    def __init__(self, expected: int = 0) -> None:
        self._allocate(_buckets_for(expected))
        self._live = 0

    def __len__(self) -> int:
        return self._live

    @property
    def nbytes(self) -> int:
        """Bytes of the two bucket arrays."""
        return self._ids.nbytes + self._slots.nbytes

    def reserve(self, capacity: int) -> None:
        """Size the table for ``capacity`` ids now, so no insert up to that many grows it."""
        if _buckets_for(capacity) > len(self._ids):
            self._rebuild(capacity)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id, -1 where absent."""
        ids = np.asarray(ids, np.int64)
        out = np.full(len(ids), -1, np.int64)
        positions = self._find(ids)
        found = positions >= 0
        out[found] = self._slots[positions[found]]
        return out

    def insert(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Add unique ``ids``, none of them present, mapped to ``slots``."""
        ids = np.asarray(ids, np.int64)
        if self._used + len(ids) > len(self._ids) // 2:
            self._rebuild(self._live + len(ids))
        positions, newly_used = self._claim_free(ids)
        self._used += newly_used
        self._ids[positions] = ids
        self._slots[positions] = slots
        self._live += len(ids)

    def remove(self, ids: np.ndarray) -> None:
        """Drop unique ``ids``, all of them present."""
        ids = np.asarray(ids, np.int64)
        positions = self._find(ids)
        if (positions < 0).any():
            raise KeyError(f"id {int(ids[positions < 0][0])} is not in the index")
        self._slots[positions] = _DELETED
        self._live -= len(positions)

    def renumber(self, new_slots: np.ndarray) -> None:
        """Every id at slot ``s`` moves to slot ``new_slots[s]`` (the rows were moved together), in one
        pass over the buckets: no id is hashed again."""
        live = self._slots >= 0
        self._slots[live] = new_slots[self._slots[live]]

    def live_slots(self) -> np.ndarray:
        """The slot of every id in the index (in bucket order)."""
        return self._slots[self._slots >= 0].copy()

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, slots) of every id in the index, in bucket order."""
        live = self._slots >= 0
        return self._ids[live].copy(), self._slots[live].copy()

    def _find(self, ids: np.ndarray) -> np.ndarray:
        """The bucket of each id, -1 where absent."""
        probe = compiled_soon(_probe, _probe_signatures) if len(ids) >= _COMPILED_FROM else None
        if probe is not None:
            found = np.empty(len(ids), np.int64)
            probe(self._ids, self._slots, np.ascontiguousarray(ids, np.int64), len(self._ids).bit_length() - 1,
                  found)
            return found
        return self._find_rounds(ids)

    def _find_rounds(self, ids: np.ndarray) -> np.ndarray:
        """:meth:`_find` as NumPy passes, one per probe round."""
        mask = len(self._ids) - 1
        result = np.full(len(ids), -1, np.int64)
        pending = np.arange(len(ids))
        position = self._home(ids)
        while pending.size:
            slot = self._slots[position]
            hit = (slot >= 0) & (self._ids[position] == ids[pending])
            result[pending[hit]] = position[hit]
            go_on = ~hit & (slot != _EMPTY)
            pending = pending[go_on]
            position = (position[go_on] + 1) & mask
        return result

    def _claim_free(self, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """A distinct free (empty or deleted) bucket on each id's probe chain, marked claimed for
        the caller to fill; and how many of them were empty."""
        mask = len(self._ids) - 1
        result = np.full(len(ids), -1, np.int64)
        pending = np.arange(len(ids))
        position = self._home(ids)
        newly_used = 0
        while pending.size:
            slot = self._slots[position]
            free = (slot == _EMPTY) | (slot == _DELETED)
            taken = np.zeros(len(pending), bool)
            candidates = np.flatnonzero(free)
            if candidates.size:
                # Several ids may probe the same free bucket in one round: the first takes it.
                _, first = np.unique(position[candidates], return_index=True)
                taken[candidates[first]] = True
                won = position[taken]
                newly_used += int(np.count_nonzero(self._slots[won] == _EMPTY))
                self._slots[won] = _CLAIMED  # not free for the ids still probing
                result[pending[taken]] = won
            pending = pending[~taken]
            position = (position[~taken] + 1) & mask
        return result, newly_used

    def _home(self, ids: np.ndarray) -> np.ndarray:
        bits = len(self._ids).bit_length() - 1
        with np.errstate(over="ignore"):
            mixed = ids.view(np.uint64) * _FIBONACCI
        return (mixed >> np.uint64(64 - bits)).astype(np.int64)

    def _allocate(self, buckets: int) -> None:
        self._ids = np.zeros(buckets, np.int64)
        self._slots = np.full(buckets, _EMPTY, np.int64)
        self._used = 0  # buckets not EMPTY: live plus deleted

    def _rebuild(self, live_after: int) -> None:
        """Re-insert the live ids into a table sized for ``live_after`` (drops deleted buckets)."""
        keep = self._slots >= 0
        ids, slots = self._ids[keep], self._slots[keep]
        self._allocate(max(_buckets_for(live_after), len(self._ids)))
        self._live = 0
        self.insert(ids, slots)


# Batches smaller than this probe in NumPy rounds: a call of the compiled loop costs about a microsecond.
_COMPILED_FROM = 16


def _probe(table_ids, table_slots, ids, bits, found):  # pragma: no cover - compiled by numba
    """:meth:`IdIndex._find_rounds` as one loop: each id's chain, from its home bucket to its own or an empty one."""
    mask = table_ids.shape[0] - 1
    shift = np.uint64(64 - bits)
    for i in range(ids.shape[0]):
        wanted = ids[i]
        position = np.int64((np.uint64(wanted) * _FIBONACCI) >> shift)
        while True:
            slot = table_slots[position]
            if slot == _EMPTY:
                found[i] = -1
                break
            if slot >= 0 and table_ids[position] == wanted:
                found[i] = position
                break
            position = (position + 1) & mask


def _probe_signatures(types) -> list:
    table = types.Array(types.int64, 1, "C", readonly=True)
    return [types.void(table, table, table, types.int64, types.Array(types.int64, 1, "C"))]


def index_bytes_for(capacity: int) -> int:
    """Bytes of an index sized for ``capacity`` ids (:meth:`IdIndex.reserve`)."""
    return 16 * _buckets_for(capacity)


def _buckets_for(live: int) -> int:
    """A power of two that keeps ``live`` ids at most a quarter of the buckets (room to grow)."""
    return max(_MIN_BUCKETS, 1 << (4 * max(live, 1) - 1).bit_length())
