"""Hash tables: embedding rows keyed by unbounded 64-bit ids.

A row exists once it is first touched (pulled or pushed) and starts from
the seeded initializer (a pure function of seed and id, so the same id gets
the same first value on any shard). Rows live in growable arrays indexed
through a dict id -> slot; optimizer state is per row, including a step
count per row for Adam's bias correction (lazy Adam).

Memory is bounded: the effective row limit is the table's ``max_rows`` and
the server's ``--max-rows`` (the smaller one that is set), and the server's
memory limit in any case. At the limit a table either refuses new rows
(eviction "none": RESOURCE_EXHAUSTED, nothing changed) or evicts its least
recently used rows (eviction "lru"; an access is a pull or a push of the
row; rows of the request itself are never evicted). A refusal happens
before anything of that request changes (a push that spans several chunks
keeps its earlier chunks, as every push does; see docs/failure-semantics.md).

A table may also admit new ids only once seen often enough, and remove rows
not updated for a while (:mod:`ps_server.core.row_policies`). With
admission, only a training pull makes rows: a pull answers an id not
admitted with its initializer's value (or zeros) and a push drops the
gradient of an id without a row, counting both.

With a disk tier (``DiskTier`` in the spec) a table holds at most
``memory_rows`` rows in memory and the rest in a row file on local disk
(:mod:`ps_server.core.row_file`): when a touch needs room, the least
recently used rows not in the request are written there, and a touched row
on disk is read back. Where a row lies changes nothing else: eviction at
``max_rows`` and expiry choose among all rows, by the same rules.

Synchronous mode applies a step's row gradients when the step ends, after
its pushes were acknowledged; so a push's rows are created and pinned when
the push begins (:meth:`HashTablePart.pin_rows`): a push that would not fit
is refused then, before anything of it is recorded, and LRU eviction never
takes a pinned row, so applying the step never needs a row it cannot have.
No gRPC here; all methods are thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ps_server.core.accumulator import PushStaging, StepAccumulator
from ps_server.core.errors import RequestError
from ps_server.core.id_index import IdIndex, index_bytes_for
from ps_server.core.info import VariableInfo
from ps_server.core.optimizers import make_kernel
from ps_server.core.persistence import AccumulatorSnapshot, DiskRows, PartSnapshot, RowSource
from ps_server.core.row_file import RowFile, RowRecords
from ps_server.core.row_policies import NOT_STAMPED, AdmissionFilter, ExpiryRule, PolicyCounts
from wehub_ps.errors import Reason
from wehub_ps.initializers import fill_rows
from wehub_ps.kernels.rowops import put_rows, take_rows
from wehub_ps.specs import VariableSpec

__all__ = ["HashTablePart", "RowPlan", "pin_tables_rows", "read_tables_rows"]

_MIN_CAPACITY = 1024


#: A spill to disk moves at least this share of memory_rows (1/32): choosing the victims scans every row
#: in memory, so it is done for several requests' cold rows at once (0.2 ms a scan of 50,000 rows).
_SPILL_SHARE = 32
#: Touches of a row that was pulled and pushed once: spilled before rows asked for again.
_TOUCHES_ONCE = 2


def _kth_smallest(values: np.ndarray, k: int) -> int:
    """The ``k``-th smallest of integer ``values`` (1-based). Access clocks of rows in memory span a
    narrow range: counting them beats a selection (0.1 against 0.5 ms for 50,000 rows)."""
    low, high = int(values.min()), int(values.max())
    if high - low > 4 * len(values):
        return int(np.partition(values, k - 1)[k - 1])
    counts = np.cumsum(np.bincount(values - low, minlength=high - low + 1))
    return low + int(np.searchsorted(counts, k))


class RowPlan(NamedTuple):
    """What touching some ids of a table will do (:meth:`HashTablePart.plan`)."""

    ids: np.ndarray
    #: Slot of each id, -1 where it is new (and, after carry_out, where it was not admitted).
    slots: np.ndarray
    #: Positions of the new ids in ``ids``.
    missing: np.ndarray
    #: The new ids, unique (None when there are none), and each missing position's index in them.
    new_ids: np.ndarray | None
    inverse: np.ndarray | None
    #: Rows to evict (LRU) to make room.
    evict: int
    #: Capacity after the read (the current one when it does not grow).
    capacity: int
    #: Bytes to book before carrying the plan out: growth, plus ``transient_bytes``.
    book_bytes: int
    #: The old arrays while a growth copies them (given back after the growth).
    transient_bytes: int = 0
    #: Slots eviction must not take: the request's own rows and a synchronous step's pinned ones.
    protect: np.ndarray | None = None
    #: Admission: the new ids (unique) that get no row, and whether this touch was a sighting of them.
    waiting: np.ndarray | None = None
    sighting: bool = False
    #: A disk tier: which of ``new_ids`` are read back from disk (None: none), and the most rows
    #: that may be written to disk to make room.
    cold: np.ndarray | None = None
    spill_bound: int = 0


def read_tables_rows(reads: Sequence[tuple["HashTablePart", np.ndarray]],
                     reserve: Callable[[int], None]) -> list[np.ndarray]:
    """Values of rows of several tables, creating missing rows, all or nothing.

    Every table is locked (in name order: one lock order for every caller),
    every read planned and checked, and the growth of all of them booked with
    ``reserve`` at once before any table changes: a refusal (a row limit, the
    memory limit) leaves every table as it was, no row created, none evicted.
    A table may appear more than once (its reads are planned together).
    """
    tables: dict[int, HashTablePart] = {}
    for table, _ in reads:
        tables.setdefault(id(table), table)
    with ExitStack() as stack:
        for table in sorted(tables.values(), key=lambda t: t.spec.name):
            stack.enter_context(table.lock)
        ids_of: dict[int, list[np.ndarray]] = {}
        for table, ids in reads:
            ids_of.setdefault(id(table), []).append(ids)
        plans = {key: tables[key].plan(np.concatenate(chunks) if len(chunks) > 1 else chunks[0])
                 for key, chunks in ids_of.items()}
        reserve(sum(plan.book_bytes for plan in plans.values()))
        slots = {key: tables[key].carry_out(plan) for key, plan in plans.items()}
        out = []
        taken: dict[int, int] = {}
        for table, ids in reads:
            first = taken.get(id(table), 0)
            taken[id(table)] = first + len(ids)
            out.append(table.values_of(ids, slots[id(table)][first:first + len(ids)]))
        return out


def pin_tables_rows(pins: Sequence[tuple["HashTablePart", np.ndarray]],
                    reserve: Callable[[int], None]) -> None:
    """Synchronous mode, at a push's begin: create and pin rows of several tables, all or nothing.

    As :func:`read_tables_rows`: every table locked (name order), each pin
    checked against the row limit (:meth:`HashTablePart._check_pin_locked`) and
    planned, the growth of all of them booked at once, and only then are rows
    created and pinned; a refusal leaves every table as it was. Each table
    appears once with unique ids.
    """
    with ExitStack() as stack:
        for table, _ in sorted(pins, key=lambda pin: pin[0].spec.name):
            stack.enter_context(table.lock)
        for table, ids in pins:
            table._check_pin_locked(ids)
        plans = [table.plan(ids, sighting=False) for table, ids in pins]
        reserve(sum(plan.book_bytes for plan in plans))
        for (table, ids), plan in zip(pins, plans):
            table.carry_out(plan)
            table._pinned = np.union1d(table._pinned, ids)


class HashTablePart:
    """This shard's rows of one hash table.

    Longer than 300 lines because the id index, the rows, their optimizer
    state, eviction and the step's pins all change together under the
    table's one lock.
    """

    holds_part = True
    row_start = row_end = 0

    def __init__(self, spec: VariableSpec, max_rows: int, reserve: Callable[[int], None],
                 disk_file: Path | None = None) -> None:
        """``reserve(delta_bytes)`` books memory with the store (raises MEMORY_LIMIT); ``disk_file``:
        where a table with a disk tier keeps its rows beyond ``memory_rows`` (required for one)."""
        if spec.tier is not None and disk_file is None:
            raise RequestError(Reason.DISK_TIER_DISABLED,
                               f"hash table {spec.name!r} keeps rows on disk (tier); start ps-server with "
                               "--disk-tier-dir, or create the table without a tier")
        self.spec = spec
        self.row_elements = spec.row_elements
        self.kernel = make_kernel(spec.optimizer)
        self.compute_dtype = np.dtype(np.float32) if spec.dtype == np.float16 else spec.dtype
        self.max_rows = max_rows  # 0: unbounded (memory limit only)
        self.reserve = reserve
        # Guards every field below, and the arrays' contents.
        self.lock = threading.Lock()
        self._index = IdIndex()
        #: Free slots, used from the end (a stack).
        self._free = np.empty(0, np.int64)
        #: Slots holding a row (the complement of _free, as a mask: eviction's candidates without a scan).
        self._occupied = np.zeros(0, bool)
        self.capacity = 0
        self.ids = np.empty(0, np.int64)
        self.value = np.empty((0, self.row_elements), spec.dtype)
        self.slots: dict[str, np.ndarray] = {n: np.empty((0, self.row_elements), self.compute_dtype)
                                             for n in self.kernel.slot_names}
        self.row_steps = np.empty(0, np.int64)
        self.last_access = np.empty(0, np.int64)
        #: Expiry: each row's version at its last update and its time stamp (row_policies).
        self.updated_version = np.empty(0, np.int64)
        self.updated_before = np.empty(0, np.float64)
        self.admission = AdmissionFilter(spec.admission, spec.name) if spec.admission is not None else None
        self.expiry = ExpiryRule(spec.expiry) if spec.expiry is not None else None
        self.policy_counts = PolicyCounts()
        #: Checkpoints by change: rows changed since the last checkpoint (by slot), the ids removed
        #: since (at most ``capacity`` of them are kept; past that the next checkpoint must be full).
        self._changed = np.zeros(0, bool)
        #: Disk tier: touches of each row in memory since it came in (created or read back), up to 255.
        self._touches = np.zeros(0, np.uint8)
        self._removed: list[np.ndarray] = []
        self._removed_count = 0
        self._changes_lost = False
        self._clock = 0
        self.version = 0
        self.optimizer_steps = 0
        self.initialized = True
        self.evicted_rows = 0
        #: Synchronous mode: the current step's sum of row gradients (its bytes booked with reserve).
        self.accumulator = StepAccumulator(release=self._release_sum)
        #: True once the spec is in the spec log (or came from a checkpoint or the log).
        self.durable = False
        #: Synchronous mode: sorted ids of the rows the open step's pushes will update (never evicted).
        self._pinned = np.empty(0, np.int64)
        #: The disk tier (None: every row in memory), and the rows memory holds at most.
        self.tier_rows = spec.tier.memory_rows if spec.tier is not None else 0
        self.disk = (RowFile(disk_file, self.row_elements, spec.dtype, self.compute_dtype,
                             self.kernel.slot_names, self.lock)
                     if spec.tier is not None and disk_file is not None else None)

    def close(self) -> None:
        """Let go of the disk tier's file (the table is dropped, or replaced by a restore)."""
        if self.disk is not None:
            with self.lock:
                self.disk.close()

    # ---- sizes ----

    @property
    def num_rows(self) -> int:
        """Rows held on this shard, in memory and on disk."""
        return len(self._index) + (len(self.disk) if self.disk is not None else 0)

    @property
    def elements(self) -> int:
        return self.num_rows * self.row_elements

    @property
    def row_bytes(self) -> int:
        """Bytes per row of capacity: value, slots, row step, last access, id, free-stack entry,
        update version and stamp, changed and occupied flags, a touch count and a removed id."""
        return (self.row_elements * (self.spec.dtype.itemsize + self.compute_dtype.itemsize * len(self.slots))
                + 59)

    def nbytes_for(self, capacity: int) -> int:
        """Bytes booked for ``capacity`` rows: the rows, the id index counted twice (a
        rebuild of the index holds the old and the new buckets at once), the admission filter."""
        fixed = AdmissionFilter.nbytes_for(self.spec.admission) if self.spec.admission is not None else 0
        if self.disk is not None:
            fixed += self.disk.nbytes  # the disk tier's bookkeeping, booked as it grows
        return capacity * self.row_bytes + 2 * index_bytes_for(capacity) + fixed

    @property
    def nbytes(self) -> int:
        return self.nbytes_for(self.capacity)

    # ---- row access ----

    def read_rows(self, ids: np.ndarray) -> np.ndarray:
        """Values of unique ``ids`` (creating missing rows, as admitted), shape (len(ids), row elements)."""
        with self.lock:
            slots = self._slots_for(ids)
            return self.values_of(ids, slots)

    def values_of(self, ids: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """The rows at ``slots`` (lock held); an id without a row (-1: not admitted) gets what
        admission answers for it, its initializer's value or zeros."""
        if self.admission is None or not len(slots) or slots.min() >= 0:
            return take_rows(self.value, slots)
        present = slots >= 0
        out = np.zeros((len(ids), self.row_elements), self.value.dtype)
        out[present] = take_rows(self.value, slots[present])
        if not self.spec.admission.zeros:
            self._fill_initial(ids, out, np.flatnonzero(~present))
        return out

    def lookup_rows(self, ids: np.ndarray, zeros: bool) -> np.ndarray:
        """Values of unique ``ids`` without changing the table: a missing id gets the initializer's
        value for it (the row it would be created with), or zeros; no access is recorded."""
        with self.lock:
            out, present = self._held_values(ids)
        if not zeros:
            self._fill_initial(ids, out, np.flatnonzero(~present))
        return out

    def export_rows(self, rows_per_piece: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids, rows) of every row, ``rows_per_piece`` at a time, each piece read under the lock.

        The ids are listed once (the caller books ``16 * num_rows`` bytes for
        them), in memory first and in slot order; each piece reads its rows
        wherever they are by then (a row may have gone to disk or come back,
        or a compaction moved it). A row removed before its piece is read is
        left out, one created after the listing is not in it. Changes nothing.
        """
        with self.lock:
            ids, slots = self._index.items()
            listed = ids[np.argsort(slots, kind="stable")]  # slot order: rows near each other in memory
            if self.disk is not None:
                on_disk = np.sort(self.disk.live_slots())
                listed = np.concatenate([listed, self.disk.ids[on_disk]])
        for start in range(0, len(listed), rows_per_piece):
            piece = listed[start:start + rows_per_piece]
            with self.lock:
                rows, found = self._held_values(piece)
            yield piece[found], rows[found]

    def _held_values(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values, found) of ``ids`` wherever their rows lie, in memory or on disk (read there, not
        brought back); zeros where an id has no row. The lock is held; nothing changes."""
        slots = self._index.lookup(ids)
        found = slots >= 0
        out = np.zeros((len(ids), self.row_elements), self.value.dtype)
        out[found] = take_rows(self.value, slots[found])
        if self.disk is not None and not found.all():
            elsewhere = np.flatnonzero(~found)
            on_disk = self.disk.slots_of(ids[elsewhere])
            there = on_disk >= 0
            out[elsewhere[there]] = self.disk.read(on_disk[there])["value"]
            found[elsewhere[there]] = True
        return out, found

    def _fill_initial(self, ids: np.ndarray, out: np.ndarray, positions: np.ndarray) -> None:
        """``out[positions]``: the initializer's values for those ids (the rows they would start from)."""
        if positions.size:
            rows = np.empty((positions.size, self.row_elements), np.float64)
            fill_rows(self.spec.initializer, self.spec.shape, ids[positions], rows)
            out[positions] = rows

    def apply_rows(self, ids: np.ndarray, grads: np.ndarray) -> None:
        """Run the optimizer on rows ``ids`` (unique) with ``grads`` (len(ids), row elements)."""
        with self.lock:
            self._apply_rows_locked(ids, grads)

    def _apply_rows_locked(self, ids: np.ndarray, grads: np.ndarray) -> None:
        compute = self.compute_dtype
        grads = grads.astype(compute, copy=False)
        slots = self._slots_for(ids, sighting=False)
        if len(slots) and slots.min() < 0:  # admission: ids without a row take no gradient
            kept = slots >= 0
            self.policy_counts.dropped_gradient_rows += int(len(slots) - np.count_nonzero(kept))
            slots, grads = slots[kept], grads[kept]
            if not len(slots):
                return
        self.row_steps[slots] += 1
        self.updated_version[slots] = self.version + 1  # the version this update makes
        self.updated_before[slots] = NOT_STAMPED
        if self.value.dtype == compute and self.kernel.update_rows(self.value, slots, grads):
            return  # updated where the rows lie, one pass (ps_server/core/fused.py)
        w = take_rows(self.value, slots).astype(compute, copy=False)
        state = {name: take_rows(arr, slots) for name, arr in self.slots.items()}
        self.kernel.apply_rows(w, grads, state, self.row_steps[slots])
        put_rows(self.value, slots, w)
        for name, rows in state.items():
            put_rows(self.slots[name], slots, rows)

    # ---- synchronous mode ----

    def _check_pin_locked(self, ids: np.ndarray) -> None:
        """MEMORY_LIMIT if pinning unique ``ids`` cannot fit in ``max_rows``; changes nothing."""
        if not self.max_rows:
            return
        if self.spec.eviction == "lru":
            rows = len(np.union1d(self._pinned, ids))
            if rows <= self.max_rows:
                return
            what = (f"the open synchronous step would update {rows} rows (its pushes' rows with "
                    "this one's); eviction never takes them before the step is applied")
        else:
            new = int(np.count_nonzero(self._index.lookup(ids) < 0))
            if self.num_rows + new <= self.max_rows:
                return
            what = f"it holds {self.num_rows} rows on this shard and this push adds {new}"
        raise RequestError(Reason.MEMORY_LIMIT,
                           f"hash table {self.spec.name!r}: {what}, more than its limit of "
                           f"{self.max_rows} (max_rows / --max-rows); push fewer rows per step, "
                           "raise the limit or add shards")

    def pin_rows(self, ids: np.ndarray) -> None:
        """Synchronous mode, at a push's begin: create rows ``ids`` (unique) and keep them until the
        open step is applied or discarded. Refuses (MEMORY_LIMIT) before changing anything."""
        pin_tables_rows([(self, ids)], self.reserve)

    def merge_staged(self, step: int, staging: PushStaging) -> int:
        """Add a complete push to the step's sum; the staged bytes it took over (StepAccumulator.merge)."""
        with self.lock:
            return self.accumulator.merge(step, staging)

    def _release_sum(self, nbytes: int) -> None:
        """The step's sum gave back ``nbytes`` (applied or discarded; the lock is held)."""
        self.reserve(-nbytes)

    def start_step(self, step: int) -> None:
        with self.lock:
            if self.accumulator.step != step:
                self.accumulator.clear()
                self.accumulator.step = step
                self._pinned = np.empty(0, np.int64)

    def apply_accumulated(self, step: int) -> bool:
        with self.lock:
            if self.accumulator.step != step:
                self.accumulator.clear()  # a sum of another step is never applied as this one
                ids = None
            else:
                _, ids, grads = self.accumulator.take(self.spec.aggregation)
            self.accumulator.step = step + 1
            try:
                if ids is not None:
                    self._apply_rows_locked(ids, grads)  # pinned rows: nothing to create
            finally:
                self.accumulator.settle()  # the sum's bytes go back once the step is applied
            self._pinned = np.empty(0, np.int64)
            if ids is None:
                return False
            self.version += 1
            self.optimizer_steps += 1
            return True

    def restore_accumulator(self, saved: AccumulatorSnapshot | None) -> None:
        """The open step's sum from a checkpoint, its bytes booked with ``reserve`` as its pushes
        booked them; its rows are pinned again (before serving)."""
        with self.lock:
            restored = StepAccumulator.restore(saved, self._release_sum)
            self.reserve(restored.nbytes)  # may refuse: nothing changed yet
            self.accumulator = restored
            if saved is not None and saved.row_ids is not None:
                self._pinned = np.unique(saved.row_ids)

    def finish_push(self) -> int:
        with self.lock:
            self.version += 1
            self.optimizer_steps += 1
            return self.version

    def info(self) -> VariableInfo:
        with self.lock:
            disk = self.disk
            return VariableInfo(self.spec, 0, 0, self.version, True, self.optimizer_steps,
                                self.num_rows, self.evicted_rows, **self.policy_counts.as_dict(),
                                rows_on_disk=len(disk) if disk is not None else 0,
                                disk_bytes=disk.disk_bytes if disk is not None else 0)

    def snapshot(self, stream_disk: bool = False) -> PartSnapshot:
        """Copies of the table's state. ``stream_disk`` (a checkpoint's snapshot): the rows on disk are
        not copied but left in place for the writer (``disk_rows``), so a table bigger than memory is
        never held in memory whole; the writer must release them."""
        with self.lock:
            if self.disk is None or not stream_disk:
                return self._snapshot_locked()
            disk = self.disk
            on_disk = disk.live_slots()
            part = self._snapshot_locked(None, np.empty(0, np.int64))
            disk.freeze()

            def release() -> None:
                with self.lock:
                    disk.thaw()

            return replace(part, disk_rows=DiskRows(
                disk.ids[on_disk], on_disk, disk.last_access[on_disk], disk.updated_version[on_disk],
                disk.updated_before[on_disk], disk.read_records, release))

    def _snapshot_locked(self, slots: np.ndarray | None = None,
                         disk_slots: np.ndarray | None = None) -> PartSnapshot:
        return PartSnapshot(self.spec, 0, 0, True, self.version, self.optimizer_steps, True,
                            np.empty(0, self.spec.dtype), {}, rows=self._rows_snapshot_locked(slots, disk_slots),
                            evicted_rows=self.evicted_rows, accumulator=self.accumulator.snapshot(),
                            access_clock=self._clock, policy_counts=self.policy_counts.as_dict(),
                            admission_counts=(self.admission.counts.copy() if self.admission else None),
                            admission_sightings=self.admission.sightings if self.admission else 0)

    # ---- internals (lock held) ----

    def _slots_for(self, ids: np.ndarray, sighting: bool = True) -> np.ndarray:
        """Slot of each id, creating rows for new ids (all or nothing); -1 for ids admission
        gives no row (``sighting``: a training pull, which admission counts)."""
        plan = self.plan(ids, sighting)
        if plan.book_bytes:
            self.reserve(plan.book_bytes)  # may refuse: nothing changed yet
        return self.carry_out(plan)

    def plan(self, ids: np.ndarray, sighting: bool = True) -> "RowPlan":
        """What touching ``ids`` will create, evict and grow, checked against the row limit.

        ``sighting``: a training pull. With admission, only a sighting may
        make rows, of the ids it admits; other touches (pushes, a sync
        step's pins) make none. Changes nothing (the lock must stay held
        until :meth:`carry_out`); raises MEMORY_LIMIT when the table may not
        take the new rows.
        """
        slots = self._index.lookup(ids)
        missing = np.flatnonzero(slots < 0)
        if not missing.size:
            return RowPlan(ids, slots, missing, None, None, 0, self.capacity, 0)
        new_ids, inverse = np.unique(ids[missing], return_inverse=True)  # a repeated new id: one row
        cold = None
        if self.disk is not None and len(self.disk):
            cold = self.disk.slots_of(new_ids) >= 0  # rows that exist, on disk
        waiting = None
        if self.admission is not None:
            admit = cold.copy() if cold is not None else np.zeros(len(new_ids), bool)
            if sighting:
                admit[~admit] = self.admission.decide(new_ids[~admit], self._clock + 1)
            waiting = new_ids[~admit]
            taken = admit[inverse]
            missing, inverse = missing[taken], (np.cumsum(admit) - 1)[inverse[taken]]
            new_ids = new_ids[admit]
            cold = cold[admit] if cold is not None else None
            if not len(new_ids):
                return RowPlan(ids, slots, missing, None, None, 0, self.capacity, 0, waiting=waiting,
                               sighting=sighting)
        needed = len(new_ids)
        cold_count = int(np.count_nonzero(cold)) if cold is not None else 0
        fresh = needed - cold_count  # rows the table gains
        protect = slots[slots >= 0]
        if len(self._pinned):  # the open synchronous step's rows stay
            pinned = self._index.lookup(self._pinned)
            protect = np.concatenate([protect, pinned[pinned >= 0]])
        evict = 0
        if self.max_rows and self.num_rows + fresh > self.max_rows:
            if self.spec.eviction != "lru" or fresh > self.max_rows:
                raise RequestError(
                    Reason.MEMORY_LIMIT,
                    f"hash table {self.spec.name!r} holds {self.num_rows} rows on this shard; "
                    f"{fresh} new ones would pass its limit of {self.max_rows} (max_rows / --max-rows); "
                    "raise the limit, add shards, or create it with eviction='lru'")
            evict = self.num_rows + fresh - self.max_rows
            if self.num_rows - len(np.unique(protect)) - cold_count < evict:
                pinned = (f", with the {len(self._pinned)} rows the open synchronous step keeps"
                          if len(self._pinned) else "")
                raise RequestError(Reason.MEMORY_LIMIT,
                                   f"hash table {self.spec.name!r}: a single request touches more rows than "
                                   f"max_rows ({self.max_rows}) allows{pinned}")
        capacity = self.capacity
        spill_bound = 0
        if self.disk is not None:
            # Memory holds tier_rows at most: what does not fit goes to disk, least recently used first.
            in_memory = len(self._index)
            spill_bound = max(0, in_memory + needed - self.tier_rows)
            spillable = in_memory - len(np.unique(protect))
            if spillable < spill_bound:
                raise RequestError(Reason.MEMORY_LIMIT,
                                   f"hash table {self.spec.name!r}: a single request touches more rows than "
                                   f"its memory_rows ({self.tier_rows}) holds in memory on this shard")
            if spill_bound:  # room for the next requests' cold rows too: the search for victims is per spill
                spill_bound = max(spill_bound, min(self.tier_rows // _SPILL_SHARE, spillable))
            if len(self._free) < needed and self.capacity < self.tier_rows:
                capacity = min(max(_MIN_CAPACITY, 2 * self.capacity, self.capacity + needed - len(self._free)),
                               self.tier_rows)
        elif len(self._free) + evict < needed:
            at_least = needed - evict - len(self._free)
            capacity = max(_MIN_CAPACITY, 2 * self.capacity, self.capacity + at_least)
            if self.max_rows:
                capacity = max(min(capacity, self.max_rows), self.capacity + at_least)
        # Growing copies every array: the old ones stay alive until the copy is done.
        transient = self.capacity * self.row_bytes if capacity > self.capacity else 0
        book = self.nbytes_for(capacity) - self.nbytes + transient
        if spill_bound:
            book += self.disk.nbytes_for(self.disk.capacity_for_more(spill_bound)) - self.disk.nbytes
        return RowPlan(ids, slots, missing, new_ids, inverse.reshape(-1), evict, capacity, book, transient,
                       protect, waiting, sighting, cold if cold_count else None, spill_bound)

    def carry_out(self, plan: "RowPlan") -> np.ndarray:
        """Create, evict and grow as planned (``plan.book_bytes`` already booked); the slots of the ids."""
        self._clock += 1
        slots = plan.slots
        if self.disk is not None:
            self.policy_counts.memory_hits += int(np.count_nonzero(slots >= 0))
        if plan.new_ids is not None:
            if plan.capacity > self.capacity:
                self._grow(plan.capacity)
                if plan.transient_bytes:
                    self.reserve(-plan.transient_bytes)  # the old arrays are gone
            cold_ids = plan.new_ids[plan.cold] if plan.cold is not None else None
            if plan.evict:
                self._evict(plan.evict, plan.protect, cold_ids)
            if self.disk is not None and len(plan.new_ids) > len(self._free):
                self._spill(max(len(plan.new_ids) - len(self._free), plan.spill_bound), plan.protect)
            created = self._create(plan.new_ids, 0, plan.protect, plan.cold)
            if cold_ids is not None:
                self._read_back(cold_ids, created[plan.cold])
                self.policy_counts.cold_reads += len(cold_ids)
            slots[plan.missing] = created[plan.inverse]
            if self.admission is not None:
                self.policy_counts.admitted_rows += len(plan.new_ids) - (len(cold_ids) if cold_ids is not None
                                                                          else 0)
        if plan.waiting is not None and plan.sighting and len(plan.waiting):
            self.admission.count(plan.waiting)
            self.policy_counts.unadmitted_reads += len(plan.waiting)
        if self.admission is not None and len(slots) and slots.min() < 0:
            touched = slots[slots >= 0]
        else:
            touched = slots
        self.last_access[touched] = self._clock
        self._changed[touched] = True
        if self.disk is not None:
            self._touches[touched] = np.minimum(self._touches[touched], 254) + 1
        return slots

    def _create(self, new_ids: np.ndarray, evict: int, protect: np.ndarray,
                cold: np.ndarray | None = None) -> np.ndarray:
        """Slots for unique new ids, room made (grown, or ``evict`` rows to drop) by the caller's plan;
        rows from the initializer, except those ``cold`` marks (read back from disk by the caller)."""
        needed = len(new_ids)
        if evict:
            self._evict(evict, protect)
        slots = self._free[len(self._free) - needed:][::-1].copy()
        self._free = self._free[:len(self._free) - needed]
        self._occupied[slots] = True
        self._touches[slots] = 0
        self.ids[slots] = new_ids
        self._index.insert(new_ids, slots)
        fresh_ids, fresh_slots = (new_ids, slots) if cold is None else (new_ids[~cold], slots[~cold])
        count = len(fresh_ids)
        if count:
            rows = np.empty((count, self.row_elements), np.float64)
            fill_rows(self.spec.initializer, self.spec.shape, fresh_ids, rows)
            self.value[fresh_slots] = rows
            for name, arr in self.slots.items():
                fresh = np.empty((count, self.row_elements), arr.dtype)
                self.kernel.init_slot(name, fresh)
                arr[fresh_slots] = fresh
            self.row_steps[fresh_slots] = 0
            self.updated_version[fresh_slots] = self.version
            self.updated_before[fresh_slots] = NOT_STAMPED
        return slots

    def _evict(self, count: int, protect: np.ndarray, keep_on_disk: np.ndarray | None = None) -> None:
        """Drop the ``count`` least recently used rows, never those in ``protect`` (memory slots) or
        ``keep_on_disk`` (ids of disk rows being read back)."""
        if not count:
            return
        candidates = self._unprotected(protect)
        if self.disk is not None and len(self.disk):
            self._evict_tiered(count, candidates, keep_on_disk)
            return
        victims = self._least_recent(candidates, count)
        self._remove(victims)
        self.evicted_rows += len(victims)

    def _unprotected(self, protect: np.ndarray) -> np.ndarray:
        """The live slots in memory outside ``protect`` (ascending)."""
        mask = self._occupied.copy()
        mask[protect] = False
        return np.flatnonzero(mask)

    def _least_recent(self, candidates: np.ndarray, count: int) -> np.ndarray:
        """The ``count`` of ``candidates`` used longest ago; among rows last used in the same instant,
        the smallest ids. Never the rows' positions: a replica restored from a snapshot holds them
        elsewhere and must choose the same."""
        if count >= len(candidates):
            return candidates
        access = self.last_access[candidates]
        threshold = _kth_smallest(access, count)
        older = candidates[access < threshold]
        tied = candidates[access == threshold]
        tied = tied[np.argsort(self.ids[tied], kind="stable")][:count - len(older)]
        return np.concatenate([older, tied])

    def _evict_tiered(self, count: int, candidates: np.ndarray, keep_on_disk: np.ndarray | None) -> None:
        """:meth:`_evict` over the rows in memory and on disk alike (the same rule, the same victims
        wherever the rows lie)."""
        disk = self.disk
        on_disk = disk.live_slots()
        if keep_on_disk is not None and len(keep_on_disk):
            on_disk = on_disk[~np.isin(disk.ids[on_disk], keep_on_disk)]
        access = np.concatenate([self.last_access[candidates], disk.last_access[on_disk]])
        ids = np.concatenate([self.ids[candidates], disk.ids[on_disk]])
        chosen = np.lexsort((ids, access))[:count]
        self._remove(candidates[chosen[chosen < len(candidates)]])
        self._remove_from_disk(on_disk[chosen[chosen >= len(candidates)] - len(candidates)])
        self.evicted_rows += len(chosen)

    def _note_removed(self, ids: np.ndarray) -> None:
        """Checkpoints by change: ``ids`` left the table (kept up to what the table books)."""
        if not len(ids) or self._changes_lost:
            return
        room = self.capacity + (self.disk.capacity if self.disk is not None else 0)
        if self._removed_count + len(ids) > room:
            self._changes_lost = True  # more than is booked: the next checkpoint is a full one
            self._removed, self._removed_count = [], 0
        else:
            self._removed.append(ids.copy())
            self._removed_count += len(ids)

    def _remove(self, slots: np.ndarray) -> None:
        """Drop the rows at ``slots``: their ids leave the index, the slots become free."""
        self._note_removed(self.ids[slots])
        self._changed[slots] = False
        self._index.remove(self.ids[slots])
        self._free = np.concatenate([self._free, slots])
        self._occupied[slots] = False

    def _remove_from_disk(self, disk_slots: np.ndarray) -> None:
        self._note_removed(self.disk.ids[disk_slots])
        self.disk.remove(disk_slots)

    # ---- the disk tier ----

    def _spill(self, count: int, protect: np.ndarray) -> None:
        """Move ``count`` rows in memory (:meth:`_spill_victims`), never those in ``protect``, to disk."""
        victims = self._spill_victims(self._unprotected(protect), count)
        records = RowRecords(self.ids[victims], self.value[victims],
                             {name: arr[victims] for name, arr in self.slots.items()}, self.row_steps[victims])
        self.disk.write(self.ids[victims], records, self.last_access[victims], self.updated_version[victims],
                        self.updated_before[victims], self._changed[victims])
        self._index.remove(self.ids[victims])
        self._changed[victims] = False
        self._free = np.concatenate([self._free, victims])
        self._occupied[victims] = False

    def _spill_victims(self, candidates: np.ndarray, count: int) -> np.ndarray:
        """The rows to move to disk: first those touched at most twice since they came in (a pull and
        its push: most rows of a Zipf batch's tail are not asked for again soon), least recent first,
        outside the most recently used quarter; then the least recently used. Rows asked for again stay,
        rather than being pushed out by the next batches' one-off rows (the 2Q policy's idea)."""
        if count >= len(candidates):
            return candidates
        access = self.last_access[candidates]
        recent = _kth_smallest(access, len(candidates) - len(candidates) // 4)
        once = (access < recent) & (self._touches[candidates] <= _TOUCHES_ONCE)
        first = candidates[once]
        if len(first) >= count:
            return self._least_recent(first, count)
        return np.concatenate([first, self._least_recent(candidates[~once], count - len(first))])

    def _read_back(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Rows ``ids`` from disk into memory ``slots`` (made by :meth:`_create`), as they were."""
        disk = self.disk
        on_disk = disk.slots_of(ids)
        records = disk.read(on_disk)
        self.value[slots] = records["value"]
        for name, arr in self.slots.items():
            arr[slots] = records[f"slot:{name}"]
        self.row_steps[slots] = records["row_steps"]
        self.last_access[slots] = disk.last_access[on_disk]
        self.updated_version[slots] = disk.updated_version[on_disk]
        self.updated_before[slots] = disk.updated_before[on_disk]
        self._changed[slots] = disk.changed[on_disk]
        disk.remove(on_disk)

    # ---- expiry ----

    def sweep(self, now: float) -> tuple[np.ndarray, bool]:
        """An expiry sweep at ``now`` (the primary's): remove the rows due, stamp those updated since
        the last sweep. Returns the removed ids (sorted) and whether any row was stamped; the
        caller logs both for the backups, which apply them with :meth:`apply_sweep`."""
        if self.expiry is None:
            return np.empty(0, np.int64), False
        with self.lock:
            live = self._index.live_slots()
            due = self.expiry.due(self.version, self.updated_version[live], self.updated_before[live], now)
            ids = self.ids[live[due]]
            if self.disk is not None:
                on_disk = self.disk.live_slots()
                disk = self.disk
                due = self.expiry.due(self.version, disk.updated_version[on_disk], disk.updated_before[on_disk], now)
                ids = np.concatenate([ids, disk.ids[on_disk[due]]])
            if len(self._pinned) and len(ids):  # the open synchronous step updates them
                ids = ids[~np.isin(ids, self._pinned)]
            ids = np.sort(ids)
            stamped = self._sweep_locked(ids, now)
            return ids, stamped

    def apply_sweep(self, ids: np.ndarray, now: float) -> None:
        """A sweep the primary made: remove rows ``ids`` (unique; those still here) and stamp."""
        with self.lock:
            self._sweep_locked(ids, now)

    def _sweep_locked(self, ids: np.ndarray, now: float) -> bool:
        if len(ids):
            slots = self._index.lookup(ids)
            self._remove(slots[slots >= 0])
            expired = int(np.count_nonzero(slots >= 0))
            if self.disk is not None:
                on_disk = self.disk.slots_of(ids[slots < 0])
                self._remove_from_disk(on_disk[on_disk >= 0])
                expired += int(np.count_nonzero(on_disk >= 0))
            self.policy_counts.expired_rows += expired
        if self.expiry is None or not self.expiry.expiry.seconds:
            return False
        live = self._index.live_slots()
        fresh = live[self.updated_before[live] == NOT_STAMPED]
        self.updated_before[fresh] = now
        self._changed[fresh] = True
        stamped = len(fresh)
        if self.disk is not None:
            on_disk = self.disk.live_slots()
            fresh = on_disk[self.disk.updated_before[on_disk] == NOT_STAMPED]
            self.disk.updated_before[fresh] = now
            self.disk.changed[fresh] = True
            stamped += len(fresh)
        return bool(stamped)

    def _grow(self, new_capacity: int) -> None:
        """Grow every array (and the id index) to ``new_capacity`` rows; the caller booked the bytes."""
        old = self.capacity

        def grown(arr: np.ndarray) -> np.ndarray:
            out = np.empty((new_capacity, *arr.shape[1:]), arr.dtype)
            out[:old] = arr[:old]
            return out

        self.ids = grown(self.ids)
        self.value = grown(self.value)
        self.slots = {name: grown(arr) for name, arr in self.slots.items()}
        self.row_steps = grown(self.row_steps)
        self.last_access = grown(self.last_access)
        self._touches = grown(self._touches)
        self._touches[old:] = 0  # rows a restore loads are not made by _create
        self.updated_version = grown(self.updated_version)
        self.updated_before = grown(self.updated_before)
        changed = np.zeros(new_capacity, bool)
        changed[:old] = self._changed[:old]
        self._changed = changed
        self._free = np.concatenate([self._free, np.arange(new_capacity - 1, old - 1, -1, dtype=np.int64)])
        occupied = np.zeros(new_capacity, bool)
        occupied[:old] = self._occupied[:old]
        self._occupied = occupied
        self.capacity = new_capacity
        self._index.reserve(new_capacity)

    # ---- checkpoints ----

    def rows_snapshot(self) -> dict[str, np.ndarray]:
        """Compact copies of the live rows: ids, values, slots, row steps, last access."""
        with self.lock:
            return self._rows_snapshot_locked()

    def delta_snapshot(self) -> PartSnapshot | None:
        """As :meth:`snapshot`, with only the rows changed since the last :meth:`forget_changes`
        and the ids removed since (``removed_ids``); None when those were not all kept."""
        with self.lock:
            if self._changes_lost:
                return None
            live = self._index.live_slots()
            on_disk = None
            if self.disk is not None:
                on_disk = self.disk.live_slots()
                on_disk = on_disk[self.disk.changed[on_disk]]
            removed = np.concatenate(self._removed) if self._removed else np.empty(0, np.int64)
            return replace(self._snapshot_locked(live[self._changed[live]], on_disk), removed_ids=removed)

    def forget_changes(self) -> None:
        """A checkpoint holds the table as it is now: changes count from here."""
        with self.lock:
            self._changed[:] = False
            if self.disk is not None:
                self.disk.changed[:] = False
            self._removed, self._removed_count, self._changes_lost = [], 0, False

    def _rows_snapshot_locked(self, slots: np.ndarray | None = None,
                              disk_slots: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The rows at memory ``slots`` and ``disk_slots`` (default: every row), sorted by id.

        With a disk tier the rows on disk are read into the copy (for a
        checkpoint, :meth:`snapshot` with ``stream_disk`` leaves them in place).
        """
        slots = self._index.live_slots() if slots is None else slots
        if self.disk is None:  # sorted once, copied once
            slots = slots[np.argsort(self.ids[slots], kind="stable")]
        out = {"ids": self.ids[slots], "value": self.value[slots],
               "row_steps": self.row_steps[slots], "last_access": self.last_access[slots],
               "updated_version": self.updated_version[slots],
               "updated_before": self.updated_before[slots]}
        for name, arr in self.slots.items():
            out[f"slot:{name}"] = arr[slots]
        if self.disk is not None:
            disk = self.disk
            disk_slots = disk.live_slots() if disk_slots is None else disk_slots
            records = disk.read(disk_slots)
            held = {"ids": disk.ids[disk_slots], "value": records["value"], "row_steps": records["row_steps"],
                    "last_access": disk.last_access[disk_slots], "updated_version": disk.updated_version[disk_slots],
                    "updated_before": disk.updated_before[disk_slots],
                    **{f"slot:{name}": records[f"slot:{name}"] for name in self.slots}}
            out = {key: np.concatenate([out[key], held[key]]) for key in out}
            order = np.argsort(out["ids"], kind="stable")
            out = {key: values[order] for key, values in out.items()}
        return out  # fancy indexing: copies, never views of the table

    def load_rows(self, rows: dict[str, np.ndarray], version: int, optimizer_steps: int, evicted: int,
                  access_clock: int = 0, policy_counts: dict | None = None,
                  admission_counts: np.ndarray | None = None, admission_sightings: int = 0,
                  disk_sources: Sequence[RowSource] | None = None) -> None:
        """Install rows from a checkpoint (before serving); a checkpoint from before expiry stamps
        counts its rows as updated at its version, and since the last sweep. ``disk_sources``: rows
        the checkpoint kept on disk, streamed piece by piece onto this table's disk tier."""
        with self.lock:
            count = len(rows["ids"])
            if self.disk is not None and count > self.tier_rows:
                # The most recently used rows stay in memory; the rest go to disk.
                order = np.lexsort((rows["ids"], rows["last_access"]))
                cold, rows_kept = order[:count - self.tier_rows], np.sort(order[count - self.tier_rows:])
                self._load_to_disk({key: values[cold] for key, values in rows.items()}, version)
                rows = {key: values[rows_kept] for key, values in rows.items()}
                count = len(rows["ids"])
            capacity = max(_MIN_CAPACITY, count)
            if self.disk is not None:
                capacity = min(max(capacity, count), max(self.tier_rows, count))
            self.reserve(self.nbytes_for(capacity) - self.nbytes)
            self._grow(capacity)
            slots = np.arange(count, dtype=np.int64)
            self._free = self._free[self._free >= count]
            self._occupied[slots] = True
            self.ids[slots] = rows["ids"]
            self.value[slots] = rows["value"].reshape(count, self.row_elements)
            for name, arr in self.slots.items():
                arr[slots] = rows[f"slot:{name}"].reshape(count, self.row_elements)
            self.row_steps[slots] = rows["row_steps"]
            self.last_access[slots] = rows["last_access"]
            self.updated_version[slots] = rows.get("updated_version", version)
            self.updated_before[slots] = rows.get("updated_before", NOT_STAMPED)
            self.policy_counts = PolicyCounts.from_dict(policy_counts)
            self._changed[:] = False
            self._removed, self._removed_count, self._changes_lost = [], 0, False
            if self.admission is not None:
                self.admission.load(admission_counts, admission_sightings)
            self._clock = max(access_clock, int(rows["last_access"].max()) if count else 0)
            self._index.insert(rows["ids"], slots)
            self.version, self.optimizer_steps, self.evicted_rows = version, optimizer_steps, evicted
            for source in disk_sources or ():
                if self.disk is None:
                    raise RequestError(Reason.DISK_TIER_DISABLED,
                                       f"hash table {self.spec.name!r} has rows on disk in its checkpoint but no "
                                       "disk tier here")
                for piece in source.chunks(65536):
                    self._load_to_disk(piece, version)
            if self.disk is not None and len(self.disk):
                self._clock = max(self._clock, int(self.disk.last_access[self.disk.live_slots()].max()))

    def _load_to_disk(self, rows: dict[str, np.ndarray], version: int) -> None:
        """Restore: rows beyond the memory budget written straight to the disk tier (their bytes booked)."""
        count = len(rows["ids"])
        disk = self.disk
        self.reserve(disk.nbytes_for(disk.capacity_for_more(count)) - disk.nbytes)
        width = self.row_elements
        records = RowRecords(rows["ids"], rows["value"].reshape(count, width),
                             {name: rows[f"slot:{name}"].reshape(count, width) for name in self.slots},
                             rows["row_steps"])
        updated_version = rows.get("updated_version", np.full(count, version, np.int64))
        updated_before = rows.get("updated_before", np.full(count, NOT_STAMPED))
        disk.write(rows["ids"], records, rows["last_access"], updated_version, updated_before,
                   np.zeros(count, bool))
