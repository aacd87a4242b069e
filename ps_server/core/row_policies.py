"""A hash table's row policies beyond LRU: admission of new ids and expiry of idle rows.

Admission (``Admission`` in the spec): a training pull of an id without a
row is a sighting, counted in a count-min filter (4 hash rows of 16-bit
saturating counters: bounded memory, it may overcount an id through
collisions but never undercounts it). An id becomes a row at the sighting
that brings its count to ``min_count``, if a draw seeded by the table, the
id and the table's clock falls under ``probability``. The filter's counts
are halved every ``10 * counters`` sightings, so ids seen long ago fade
(TinyLFU's reset). Every input of a decision (the counts, the clock, the
id) is the same on every replica that applied the same changes in the same
order, so replicas admit the same ids.

Expiry (``Expiry`` in the spec): each row remembers the table's version at
its last update (or creation) and a time stamp: +inf while it was updated
since the table's last sweep, else the time of the first sweep after its
update (so its update happened before that time). A sweep at time ``now``
removes rows ``steps`` or more versions old, or stamped at or before
``now - seconds``, then stamps the rows updated since the previous sweep
with ``now``. The primary takes ``now`` from its clock and logs the sweep;
backups apply the same removals and stamps with the same ``now``.

No gRPC here; the table's lock guards all of it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np

from wehub_ps.placement import splitmix64, stable_hash64
from wehub_ps.specs import Admission, Expiry

__all__ = ["NOT_STAMPED", "AdmissionFilter", "ExpiryRule", "PolicyCounts", "merge_admission_counts"]

#: Hash rows of the count-min filter.
DEPTH = 4
_MAX_COUNT = np.iinfo(np.uint16).max
#: The time stamp of a row updated since its table's last sweep.
NOT_STAMPED = np.inf


@dataclass
class PolicyCounts:
    """What the policies did on this shard, for metrics and ``ps-admin status``; checkpointed."""

    #: Ids that became rows through admission.
    admitted_rows: int = 0
    #: Pull answers for ids not admitted yet (initializer values or zeros; no row made).
    unadmitted_reads: int = 0
    #: Gradient rows dropped because their id had no row (not admitted, evicted or expired).
    dropped_gradient_rows: int = 0
    #: Rows removed by expiry.
    expired_rows: int = 0
    #: A disk tier's rows found in memory when touched, and read back from disk.
    memory_hits: int = 0
    cold_reads: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: dict | None) -> PolicyCounts:
        """From a checkpoint's counts; a count it lacks (an older checkpoint) starts at 0."""
        saved = saved or {}
        return cls(**{f.name: int(saved.get(f.name, 0)) for f in fields(cls)})


class AdmissionFilter:
    """The count-min filter of one table's sightings on this shard, and the admission decision."""

    def __init__(self, admission: Admission, table_name: str) -> None:
        self.admission = admission
        self.width = admission.counters
        seed = stable_hash64(table_name)  # the same on every shard: their filters can be summed
        self._salts = splitmix64(np.arange(DEPTH + 1, dtype=np.uint64) + np.uint64(seed))
        self.counts = np.zeros((DEPTH, self.width), np.uint16)
        #: Sightings since the counts were last halved.
        self.sightings = 0

    @staticmethod
    def nbytes_for(admission: Admission) -> int:
        return DEPTH * admission.counters * 2

    @property
    def nbytes(self) -> int:
        return self.counts.nbytes

    def _columns(self, ids: np.ndarray) -> np.ndarray:
        """Each id's counter in each hash row, shape (DEPTH, len(ids))."""
        keys = ids.astype(np.uint64)
        return np.stack([(splitmix64(keys ^ self._salts[row]) % np.uint64(self.width)).astype(np.int64)
                         for row in range(DEPTH)])

    def decide(self, ids: np.ndarray, clock: int) -> np.ndarray:
        """Which of ``ids`` (unique, without rows) this sighting admits; changes nothing."""
        if not len(ids):
            return np.zeros(0, bool)
        admitted = np.ones(len(ids), bool)
        if self.admission.min_count > 1:
            columns = self._columns(ids)
            estimate = self.counts[np.arange(DEPTH)[:, None], columns].min(axis=0).astype(np.int64)
            admitted &= estimate + 1 >= self.admission.min_count
        if self.admission.probability < 1.0:
            draw_keys = ids.astype(np.uint64) ^ splitmix64(np.array([clock], np.uint64) ^ self._salts[DEPTH])
            draws = (splitmix64(draw_keys) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
            admitted &= draws < self.admission.probability
        return admitted

    def count(self, ids: np.ndarray) -> None:
        """One sighting of each of ``ids`` (unique) that stays without a row."""
        if not len(ids) or self.admission.min_count <= 1:
            return  # nothing to count: each sighting is decided by the draw alone
        columns = self._columns(ids)
        for row in range(DEPTH):
            where, times = np.unique(columns[row], return_counts=True)
            total = self.counts[row, where].astype(np.int64) + times
            self.counts[row, where] = np.minimum(total, _MAX_COUNT)
        self.sightings += len(ids)
        if self.sightings >= 10 * self.width:
            self.counts >>= 1
            self.sightings = 0

    def load(self, counts: np.ndarray | None, sightings: int) -> None:
        if counts is not None and counts.shape == self.counts.shape:
            self.counts[...] = counts
            self.sightings = sightings


def merge_admission_counts(counts: list[np.ndarray]) -> np.ndarray | None:
    """One shard's filter from the filters of the old shards (a restore onto another shard count).

    Each old filter counted only its own ids; their saturated sum counts every
    id at least as often as its old shard did, as a count-min filter must.
    """
    counts = [c for c in counts if c is not None]
    if not counts:
        return None
    total = np.zeros(counts[0].shape, np.int64)
    for c in counts:
        if c.shape != total.shape:
            return None  # filters of different sizes: start counting again
        total += c
    return np.minimum(total, _MAX_COUNT).astype(np.uint16)


class ExpiryRule:
    """Which rows a sweep removes."""

    def __init__(self, expiry: Expiry) -> None:
        self.expiry = expiry

    def due(self, version: int, updated_version: np.ndarray, updated_before: np.ndarray,
            now: float) -> np.ndarray:
        """A mask of the rows that a sweep at ``now`` removes, the table being at ``version``."""
        due = np.zeros(len(updated_version), bool)
        if self.expiry.steps:
            due |= version - updated_version >= self.expiry.steps
        if self.expiry.seconds:
            due |= updated_before <= now - self.expiry.seconds
        return due
