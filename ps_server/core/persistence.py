"""What the core hands the durability layer and takes back from it.

The store copies its parts out as :class:`PartSnapshot` (a checkpoint
writes them), is rebuilt from :class:`LoadedPart` (a restore reads them),
and records each new spec and uploaded initial value through a
:class:`SpecRecorder` (the spec log) before it acknowledges them. The
checkpoint format lives above the core and imports these types; the core
never imports it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from wehub_ps.specs import VariableSpec

__all__ = ["AccumulatorSnapshot", "DiskRows", "LoadedPart", "PartSnapshot", "RowSource", "SpecRecorder"]


@dataclass(frozen=True)
class DiskRows:
    """A table's rows on disk at a snapshot's instant, left where they lie until the snapshot is written.

    The row file reuses none of ``slots`` until ``release()``: the writer
    reads their records (``read(slots)``, structured records of the row
    file's dtype, safe beside the table's own reads and writes) after the
    apply gate is released. What decides about the rows came out as copies.
    """

    ids: np.ndarray
    slots: np.ndarray
    last_access: np.ndarray
    updated_version: np.ndarray
    updated_before: np.ndarray
    read: Callable[[np.ndarray], np.ndarray]
    release: Callable[[], None]


class RowSource(Protocol):
    """Rows of a table a restore streams in (a checkpoint's file of disk rows), a piece at a time."""

    count: int

    def chunks(self, rows: int) -> Iterator[dict[str, np.ndarray]]:
        """Rows as a snapshot's rows dict (ids, value, slot:<name>, row_steps, last_access, updated_version,
        updated_before), at most ``rows`` at a time."""


@dataclass(frozen=True)
class AccumulatorSnapshot:
    """One part's sum of step ``step``: what a checkpoint stores of it."""

    step: int
    dense: np.ndarray | None
    dense_count: int
    row_ids: np.ndarray | None
    row_grads: np.ndarray | None
    row_count: int


@dataclass(frozen=True)
class PartSnapshot:
    """One variable's part, copied out of the store at the snapshot instant."""

    spec: VariableSpec
    row_start: int
    row_end: int
    holds_part: bool
    version: int
    optimizer_steps: int
    initialized: bool
    value: np.ndarray
    slots: dict[str, np.ndarray]
    #: Dense variables: per-row step counts of sparse Adam updates, if any.
    row_steps: np.ndarray | None = None
    #: Hash tables: ids, value, slot:<name>, row_steps, last_access of the live rows.
    rows: dict[str, np.ndarray] | None = None
    evicted_rows: int = 0
    #: Hash tables: the LRU clock (the newest last_access given), so a restored table keeps counting
    #: from where it was, as a replica restored from a snapshot must to stay bit-identical.
    access_clock: int = 0
    #: Synchronous mode: the open step's sum of gradients (None when empty).
    accumulator: AccumulatorSnapshot | None = None
    #: Hash tables: what admission and expiry did (row_policies.PolicyCounts, as a dict).
    policy_counts: dict | None = None
    #: Hash tables with admission: the count-min filter's counters and its sightings since halving.
    admission_counts: np.ndarray | None = None
    admission_sightings: int = 0
    #: A delta's hash table (checkpoints by change): ``rows`` holds only the rows changed since the
    #: previous checkpoint, and these ids were removed since. None: ``rows`` holds every row.
    removed_ids: np.ndarray | None = None
    #: A table with a disk tier, snapshotted for a checkpoint: ``rows`` holds the rows in memory, these
    #: the rows on disk (written by streaming their records).
    disk_rows: DiskRows | None = None
    #: Restored: rows to stream in besides ``rows`` (a checkpoint's disk rows), each read piece by piece.
    disk_sources: list[RowSource] | None = None


#: A variable part assembled from checkpoint data: the same fields as a snapshot.
LoadedPart = PartSnapshot


class SpecRecorder(Protocol):
    """Makes specs and uploaded initial values durable; each call returns once they are."""

    def record_spec(self, spec: VariableSpec) -> None:
        """Record ``spec``, a variable this shard created."""

    def record_initial_value(self, spec: VariableSpec, row_start: int, row_end: int,
                             value: np.ndarray) -> None:
        """Record this shard's rows [row_start, row_end) of ``spec``'s uploaded initial value."""
