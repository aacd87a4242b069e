"""This shard's variables: values, optimizer slots, versions.

No gRPC here: the store works on numpy arrays and raises
:class:`~ps_server.core.errors.RequestError` for requests it refuses, always
before changing anything.

Each variable part is stored flat (C order of its rows), so a chunk is a
plain slice. Concurrency: every :class:`VariablePart` has its own lock, held
for the duration of one chunk's read or update (a chunk is at most the
negotiated chunk size, so the lock is short); pushes to different variables
therefore proceed in parallel (numpy releases the GIL), and concurrent pushes
to one variable serialise per chunk, so none is ever lost.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Callable, TypeVar

import numpy as np

from ps_server.core.accumulator import PushStaging, StepAccumulator
from ps_server.core.errors import RequestError
from ps_server.core.gate import ApplyGate
from ps_server.core.info import VariableInfo
from ps_server.core.initializers import fill_initial_values
from ps_server.core.optimizers import make_kernel
from ps_server.core.persistence import LoadedPart, PartSnapshot, SpecRecorder
from ps_server.core.tables import HashTablePart, pin_tables_rows, read_tables_rows
from wehub_ps.kernels.rowops import RowGather
from wehub_ps.kernels.convert import cast_into
from wehub_ps.dtypes import WIRE_FLOAT_DTYPES, dtype_name
from wehub_ps.errors import Reason
from wehub_ps.placement import rows_of
from wehub_ps.kernels.rowops import put_rows, take_rows
from wehub_ps.specs import Explicit, VariableSpec

__all__ = ["InitialUpload", "MemoryHold", "VariableInfo", "VariablePart", "VariableStore",
           "check_dtype_allowed"]

T = TypeVar("T")


class _Scratch(threading.local):
    """Per-thread reusable buffers, so applying a chunk allocates nothing."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, np.dtype], np.ndarray] = {}

    def get(self, purpose: str, dtype: np.dtype, size: int) -> np.ndarray:
        buf = self.buffers.get((purpose, dtype))
        if buf is None or buf.size < size:
            buf = np.empty(max(size, 1), dtype=dtype)
            self.buffers[(purpose, dtype)] = buf
        return buf[:size]


_scratch = _Scratch()
# Elements per pass when applying a whole part at once: temporaries stay small.
_APPLY_BLOCK = 1 << 18


class VariablePart:
    """This shard's rows of one variable and their optimizer state."""

    def __init__(self, spec: VariableSpec, row_start: int, row_end: int, holds_part: bool) -> None:
        self.spec = spec
        # False when placement puts no rows of this variable on this shard:
        # the shard then only remembers the spec (for idempotent creates).
        self.holds_part = holds_part
        self.row_start = row_start
        self.row_end = row_end
        self.elements = (row_end - row_start) * rows_of(spec.shape)[1]
        self.kernel = make_kernel(spec.optimizer)
        # float16 variables are updated in float32 (slots too): in float16,
        # Adam's g*g underflows to 0 for |g| < 0.01 and the step explodes.
        self.compute_dtype = np.dtype(np.float32) if spec.dtype == np.float16 else spec.dtype
        # Guards value, slots, version, optimizer_steps and initialized. Held
        # for one chunk at a time (and during the initial fill).
        self.lock = threading.Lock()
        self.value = np.empty(0, dtype=spec.dtype)
        self.slots: dict[str, np.ndarray] = {}
        self.version = 0
        self.optimizer_steps = 0
        self.initialized = False
        #: Per-row step counts of sparse Adam updates (None until the first).
        self.row_steps: np.ndarray | None = None
        #: Synchronous mode: the current step's sum (None until the first push).
        self.accumulator: StepAccumulator | None = None
        #: Books the sum's bytes with the store (given back with a negative delta); None: unbooked.
        self.reserve: Callable[[int], None] | None = None
        #: True once the spec is in the spec log (or came from a checkpoint or the log).
        self.durable = False
        #: Uploads of the explicit initial value in progress (guarded by ``lock``).
        self.uploads: weakref.WeakSet[InitialUpload] = weakref.WeakSet()
        # Serialises installs of uploads (held across the spec log's write, never under the gate):
        # the upload installed is the first the spec log records, the one a restart replays.
        self.install_lock = threading.Lock()
        #: Bytes booked with the part for the buffer of its first initial-value upload (a create from
        #: an array books them with the part, see VariableStore._checked_new), so that the upload of a
        #: validated create is not refused for memory taken meanwhile; 0: none. Guarded by the
        #: store's lock, as is share_free.
        self.upload_share = 0
        #: True while upload_share is booked and no upload holds it.
        self.share_free = False

    @property
    def nbytes(self) -> int:
        """Bytes of values plus optimizer slots."""
        return self.elements * (self.spec.dtype.itemsize
                                + self.compute_dtype.itemsize * len(self.kernel.slot_names))

    def allocate_and_fill(self) -> None:
        """Allocate values and slots and write the initial values (before the part is visible)."""
        dtype = self.spec.dtype
        self.value = np.zeros(self.elements, dtype=dtype)
        first = self.row_start * rows_of(self.spec.shape)[1]
        fill_initial_values(self.spec.initializer, self.spec.shape, self.value, first)
        for name in self.kernel.slot_names:
            slot = np.empty(self.elements, dtype=self.compute_dtype)
            self.kernel.init_slot(name, slot)
            self.slots[name] = slot
        self.initialized = not isinstance(self.spec.initializer, Explicit)

    def snapshot(self) -> PartSnapshot:
        """A copy of values, slots and counters (the caller holds the apply gate exclusive)."""
        with self.lock:
            return PartSnapshot(self.spec, self.row_start, self.row_end, self.holds_part, self.version,
                                self.optimizer_steps, self.initialized, self.value.copy(),
                                {name: slot.copy() for name, slot in self.slots.items()},
                                row_steps=None if self.row_steps is None else self.row_steps.copy(),
                                accumulator=None if self.accumulator is None else self.accumulator.snapshot())

    @classmethod
    def from_checkpoint(cls, loaded: LoadedPart) -> "VariablePart":
        part = cls(loaded.spec, loaded.row_start, loaded.row_end, loaded.holds_part)
        if loaded.value.size != part.elements:
            raise ValueError(f"checkpoint holds {loaded.value.size} elements of {loaded.spec.name!r}, "
                             f"the part needs {part.elements}")
        part.value = loaded.value.astype(loaded.spec.dtype, copy=False)
        for name in part.kernel.slot_names:
            slot = loaded.slots.get(name)
            if slot is None:  # an empty part: nothing was stored
                slot = np.empty(part.elements, dtype=part.compute_dtype)
                part.kernel.init_slot(name, slot)
            part.slots[name] = slot.astype(part.compute_dtype, copy=False)
        part.version = loaded.version
        part.optimizer_steps = loaded.optimizer_steps
        part.initialized = loaded.initialized
        part.row_steps = loaded.row_steps
        if loaded.accumulator is not None:  # its bytes are booked by the caller (accumulator_bytes)
            part.accumulator = StepAccumulator.restore(loaded.accumulator, part._release_sum)
        return part

    @property
    def accumulator_bytes(self) -> int:
        """Bytes of the synchronous step's sum (booked against the memory limit)."""
        return 0 if self.accumulator is None else self.accumulator.nbytes

    def info(self) -> VariableInfo:
        with self.lock:
            return VariableInfo(self.spec, self.row_start, self.row_end, self.version,
                                self.initialized, self.optimizer_steps)

    def read(self, offset: int, count: int, wire_dtype: np.dtype,
             sink: Callable[[np.ndarray, int], T]) -> T:
        """Call ``sink(values, version)`` under the lock and return its result.

        ``values`` is a view of the stored chunk (or a converted copy when
        ``wire_dtype`` is narrower); the sink must copy what it keeps before
        returning, which is how a pull copies each byte exactly once.
        """
        with self.lock:
            view = self.value[offset : offset + count]
            if wire_dtype != view.dtype:
                converted = _scratch.get("wire-out", wire_dtype, count)
                cast_into(converted, view)
                view = converted
            return sink(view, self.version)

    def local_rows(self, ids: np.ndarray) -> np.ndarray:
        """Global row indices -> indices into this part; RequestError when outside it."""
        local = np.asarray(ids, dtype=np.int64) - self.row_start
        # One pass checks both ends: a row before the part wraps to a huge unsigned value.
        if local.size and local.view(np.uint64).max() >= self.row_end - self.row_start:
            bad = ids[(ids < self.row_start) | (ids >= self.row_end)][0]
            raise RequestError(Reason.INVALID_CHUNK,
                               f"row {bad} of {self.spec.name!r} is not on this shard (it holds rows "
                               f"[{self.row_start}, {self.row_end}))")
        return local

    def read_rows(self, ids: np.ndarray) -> np.ndarray:
        """Copies of global rows ``ids``: shape (len(ids), row elements)."""
        local = self.local_rows(ids)
        with self.lock:
            return take_rows(self.value.reshape(-1, self.spec.row_elements), local)

    def rows_to_send(self, local: np.ndarray) -> RowGather:
        """Rows ``local`` (from :meth:`local_rows`), read under the lock when the message is joined.

        Each row is then copied once, from the table into the message. Only
        for an initialised part: its rows never move (a hash table's do).
        """
        return RowGather(self.value.reshape(-1, self.spec.row_elements), local, self.lock)

    def apply_rows(self, ids: np.ndarray, grads: np.ndarray) -> None:
        """Sparse update of global rows ``ids`` (unique): only these rows and their state change.

        Adam keeps a step count per row for sparse updates (created on the
        first one), so a row's bias correction follows its own history.
        """
        self.apply_local_rows(self.local_rows(ids), grads)

    def apply_local_rows(self, local: np.ndarray, grads: np.ndarray) -> None:
        """:meth:`apply_rows` of rows already checked by :meth:`local_rows` (a push's, at its begin)."""
        with self.lock:
            self._apply_local_rows(local, grads)

    def _apply_local_rows(self, local: np.ndarray, grads: np.ndarray) -> None:
        width = self.spec.row_elements
        compute = self.compute_dtype
        values = self.value.reshape(-1, width)
        if values.dtype == compute and self.kernel.update_rows(values, local, grads):
            return  # updated where the rows lie, one pass (ps_server/core/fused.py)
        w = take_rows(values, local).astype(compute, copy=False)
        state = {name: take_rows(slot.reshape(-1, width), local) for name, slot in self.slots.items()}
        if self.kernel.needs_row_steps:
            if self.row_steps is None:
                self.row_steps = np.zeros(self.row_end - self.row_start, np.int64)
            self.row_steps[local] += 1
            steps = self.row_steps[local]
        else:
            steps = np.zeros(0, np.int64)
        self.kernel.apply_rows(w, grads.astype(compute, copy=False), state, steps,
                               _scratch.get("kernel", compute, w.size))
        put_rows(values, local, w)
        for name, rows in state.items():
            put_rows(self.slots[name].reshape(-1, width), local, rows)

    # ---- synchronous mode ----

    def merge_staged(self, step: int, staging: PushStaging) -> int:
        """Add one complete push of ``step``, the open step (see StepAccumulator.merge), to its sum;
        returns the staged bytes the sum took over (their booking moves to the store's variables)."""
        with self.lock:
            return self._accumulator().merge(step, staging)

    def start_step(self, step: int) -> None:
        with self.lock:
            acc = self._accumulator()
            if acc.step != step:
                acc.clear()  # a step that never completed (restart, jump): discard
                acc.step = step

    def apply_accumulated(self, step: int) -> bool:
        """Apply step ``step``'s aggregated gradient once; True if there was one."""
        with self.lock:
            acc = self._accumulator()
            if acc.step != step:
                acc.clear()  # a sum of another step is never applied as this one
                acc.step = step + 1
                return False
            dense, ids, grads = acc.take(mean=self.spec.aggregation == "mean")
            acc.step = step + 1
            try:
                return self._apply_taken(dense, ids, grads)
            finally:
                acc.settle()  # the sum's bytes go back once the step is applied

    def _apply_taken(self, dense: np.ndarray | None, ids: np.ndarray | None,
                     grads: np.ndarray | None) -> bool:
        """Apply a step's aggregated gradient (lock held)."""
        if dense is not None:
            self.optimizer_steps += 1
            compute = self.compute_dtype
            for offset in range(0, self.elements, _APPLY_BLOCK):
                end = min(self.elements, offset + _APPLY_BLOCK)
                stored = self.value[offset:end]
                weights = stored if stored.dtype == compute else stored.astype(compute)
                self.kernel.apply(weights, dense[offset:end],
                                  {n: s[offset:end] for n, s in self.slots.items()},
                                  self.optimizer_steps, _scratch.get("kernel", compute, end - offset))
                if weights is not stored:
                    np.copyto(stored, weights, casting="unsafe")
        if ids is not None:
            self._apply_local_rows(self.local_rows(ids), grads)
        if dense is None and ids is None:
            return False
        self.version += 1
        return True

    def _accumulator(self) -> StepAccumulator:
        if self.accumulator is None:
            self.accumulator = StepAccumulator(release=self._release_sum)
        return self.accumulator

    def _release_sum(self, nbytes: int) -> None:
        """The step's sum gave back ``nbytes`` (applied or discarded)."""
        if self.reserve is not None:
            self.reserve(-nbytes)

    def reserve_step(self) -> int:
        """Take the next optimizer step number for a push that starts now."""
        with self.lock:
            self.optimizer_steps += 1
            return self.optimizer_steps

    def apply_gradient(self, offset: int, grad: np.ndarray, step: int) -> None:
        """Run the optimizer on elements [offset, offset + grad.size)."""
        count = grad.size
        compute = self.compute_dtype
        if grad.dtype != compute:
            widened = _scratch.get("wire-in", compute, count)
            cast_into(widened, grad)
            grad = widened
        scratch = _scratch.get("kernel", compute, count)
        with self.lock:
            end = offset + count
            slots = {name: slot[offset:end] for name, slot in self.slots.items()}
            stored = self.value[offset:end]
            if compute == stored.dtype:
                self.kernel.apply(stored, grad, slots, step, scratch)
            else:
                weights = _scratch.get("weights", compute, count)
                np.copyto(weights, stored, casting="unsafe")
                self.kernel.apply(weights, grad, slots, step, scratch)
                np.copyto(stored, weights, casting="unsafe")

    def finish_push(self) -> int:
        """Count a completed push; return the new version."""
        with self.lock:
            self.version += 1
            return self.version


class InitialUpload:
    """One upload of a part's explicit initial value, kept apart until it is complete.

    Chunks land in the upload's own buffer, never in the part, so an upload
    that loses the race (another one completed first) or arrives after
    training started changes nothing. Its bytes count against the memory
    limit until :meth:`drop` (or until nothing refers to it any more).
    """

    def __init__(self, part: VariablePart, nbytes: int, release: Callable[[int], None]) -> None:
        self.part = part
        # Guards buffer: chunk writes against the drop.
        self.lock = threading.Lock()
        self.buffer: np.ndarray | None = np.empty(part.elements, dtype=part.spec.dtype)
        # Gives the reservation back exactly once: at drop, or when the upload is garbage.
        self._release = weakref.finalize(self, release, nbytes)

    def write(self, offset: int, values: np.ndarray) -> None:
        """Stage elements [offset, offset + values.size); nothing once dropped."""
        with self.lock:
            if self.buffer is not None:
                np.copyto(self.buffer[offset : offset + values.size], values, casting="unsafe")

    def drop(self) -> None:
        """Forget the staged bytes (the part has its value) and give back their memory."""
        with self.lock:
            self.buffer = None
        self._release()


class VariableStore:
    """All variables of one shard; thread-safe.

    ``memory_limit`` bounds the bytes of values plus optimizer slots: a
    create that would exceed it is refused with MEMORY_LIMIT, so a hostile
    or mistaken shape cannot take the server down.
    """

    def __init__(self, shard_index: int, num_shards: int, memory_limit: int,
                 gate: ApplyGate | None = None, max_rows: int = 0, max_variables: int = 100_000,
                 spec_log: SpecRecorder | None = None) -> None:
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index {shard_index} is outside [0, {num_shards})")
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.memory_limit = memory_limit
        #: Server-wide cap on rows per hash table and shard (0: none).
        self.max_rows = max_rows
        #: Variables this shard holds at most: bounds memory for metadata and metric labels.
        self.max_variables = max_variables
        #: Mutations hold it shared, checkpoint snapshots exclusive.
        self.gate = gate or ApplyGate()
        #: Bumped on every mutation; a checkpoint is skipped when it did not move.
        #: (Unlocked increments may collapse under races, but never to "unchanged".)
        self.generation = 0
        # Guards _parts, _filling, _bookings, _reserved and _held. Lock order: this lock, then a
        # part's; it is also taken inside a part's lock (a table books its growth, a synchronous
        # step's sum gives its bytes back), and no part's lock is taken under it then. Reentrant: a
        # staged upload gives its bytes back when it is garbage (InitialUpload), which may happen in
        # a thread that holds this lock.
        self._lock = threading.RLock()
        # Uploads waiting for a buffer (stage_upload) wait here for an upload share given back or
        # a part initialised (on _lock).
        self._upload_changed = threading.Condition(self._lock)
        self._parts: dict[str, VariablePart | HashTablePart] = {}
        #: Variables being created (filled outside the gate): set when installed or given up.
        self._filling: dict[str, threading.Event] = {}
        #: Creates validated but not yet made (see :meth:`validate`), by variable name. Their bytes
        #: are in _held; each counts as a variable against max_variables until used or expired.
        self._bookings: dict[str, _Booking] = {}
        #: Bytes of variables: values, slots, staged uploads, hash tables' rows and id indexes,
        #: synchronous steps' running sums.
        self._reserved = 0
        #: Bytes held for requests rather than variables: rows gathered for pulls in flight,
        #: the ledger's records of unfinished pushes. Counted against the same limit.
        self._held = 0
        # Bytes given back by finalizers (any thread, any moment, so they take no lock; a deque's
        # append is atomic): subtracted from _held under _lock the next time it is read.
        self._given_back: deque[int] = deque()
        #: Where specs and uploaded initial values are made durable (None: no --checkpoint-dir).
        self.spec_log = spec_log

    @property
    def reserved_bytes(self) -> int:
        """Bytes of variables (what Describe reports as stored)."""
        with self._lock:
            return self._reserved

    @property
    def held_bytes(self) -> int:
        """Bytes held for requests in flight and unfinished pushes (see :meth:`hold`)."""
        with self._lock:
            self._collect_given_back()
            return self._held

    def give_back(self, cell: list[int]) -> None:
        """Give back ``cell[0]`` booked bytes; safe in a finalizer (takes no lock)."""
        self._given_back.append(cell[0])

    def _collect_given_back(self) -> None:
        """(_lock held) Also gives back the bytes of bookings that expired."""
        while self._given_back:
            self._held -= self._given_back.popleft()
        if self._bookings:
            now = time.monotonic()
            for name in [n for n, b in self._bookings.items() if b.expires <= now]:
                self._held -= self._bookings.pop(name).nbytes

    def hold(self, nbytes: int, what: str) -> "MemoryHold":
        """Book ``nbytes`` a request is about to allocate; MEMORY_LIMIT when they do not fit.

        Stored bytes and held bytes together stay within ``memory_limit``.
        Call before allocating; release the hold (``with`` or
        :meth:`MemoryHold.release`) when the bytes are freed.
        """
        self.book(nbytes, what)
        return MemoryHold(self, nbytes)

    def _fits_locked(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit beside the variables and the requests in flight (lock held)."""
        return self._reserved + self._held + nbytes <= self.memory_limit

    def book(self, nbytes: int, what: str) -> None:
        """:meth:`hold` without the handle: give the bytes back with ``book(-nbytes, what)``."""
        if nbytes == 0:
            return
        with self._lock:
            self._collect_given_back()
            if nbytes > 0 and not self._fits_locked(nbytes):
                raise RequestError(
                    Reason.MEMORY_LIMIT,
                    f"{what} needs {nbytes} bytes; shard {self.shard_index} holds {self._reserved} bytes of "
                    f"variables and {self._held} for requests in flight of its {self.memory_limit}-byte "
                    "limit (--max-memory-bytes); ask for less at once")
            self._held += nbytes

    def read_rows(self, reads: list[tuple[VariablePart | HashTablePart, np.ndarray]]
                  ) -> list[tuple[np.ndarray, int]]:
        """(values, version) of rows of several parts, all or nothing.

        Hash tables create missing rows: every table's new rows are checked
        and booked before any table changes, so a refusal (row limit, memory
        limit) creates nothing and evicts nothing. Dense parts' rows were
        checked by the caller (:func:`ps_server.core.rows.parse_row_ids`).
        """
        with self.gate.shared():
            tables = [(part, ids) for part, ids in reads if isinstance(part, HashTablePart)]
            table_values = iter(read_tables_rows(tables, self._reserve_bytes) if tables else [])
            out = []
            for part, ids in reads:
                values = next(table_values) if isinstance(part, HashTablePart) else part.read_rows(ids)
                out.append((values, part.version))
            if tables:
                self.generation += 1
            return out

    def pin_rows(self, pins: list[tuple[HashTablePart, np.ndarray]]) -> None:
        """Synchronous mode: create and pin rows of several tables for the open step, all or nothing.

        Every table's rows are checked (row limits) and their growth booked
        before any table changes, so a refusal creates, pins and evicts
        nothing (see :func:`ps_server.core.tables.pin_tables_rows`).
        """
        if pins:
            pin_tables_rows(pins, self._reserve_bytes)
            self.generation += 1

    def adopt_staged(self, staged: int, kept: int) -> None:
        """A synchronous push's staging, ``staged`` bytes booked for the push, joined the step's sums
        (or was dropped), which grew by ``kept`` bytes: those stay booked, as the variables' (until
        the step is applied or discarded), the rest is given back. Never refused: nothing grows."""
        with self._lock:
            self._collect_given_back()
            self._held -= staged
            self._reserved += kept

    def create(self, spec: VariableSpec) -> tuple[VariableInfo, bool]:
        """Create the variable (this shard's part of it); idempotent for the same spec.

        Returns (info, created). The initial values are generated outside the
        apply gate, so pushes and checkpoints carry on while a big variable
        fills; the part is installed under the gate in one step. A second
        create of the same variable blocks until the first one is installed
        (and recorded in the spec log). With a spec log, the spec is durable
        when this returns.
        """
        while True:
            with self._lock:
                existing = self._parts.get(spec.name)
                filling = self._filling.get(spec.name) if existing is None else None
                if existing is None and filling is None:
                    new = self._reserve_new(spec)
                    filling = self._filling[spec.name] = threading.Event()
                    break
            if existing is not None:
                self._check_same(existing, spec)
                self._make_durable(existing)
                return existing.info(), False
            filling.wait()  # another create of this name: use its part (or retry if it failed)
        try:
            if isinstance(new, VariablePart):
                new.allocate_and_fill()
            with self.gate.shared():  # a checkpoint sees the variable either whole or not at all
                with self._lock:
                    self._parts[spec.name] = new
                    del self._filling[spec.name]
                self.generation += 1
        except BaseException as exc:  # out of memory, or the gate sealed by a shutdown: nothing stays
            with self._lock:
                if self._filling.get(spec.name) is filling:
                    del self._filling[spec.name]
                    self._reserved -= _cost(new)
            if isinstance(exc, MemoryError):
                raise RequestError(Reason.MEMORY_LIMIT,
                                   f"out of memory allocating {new.nbytes} bytes for {spec.name!r}") from None
            raise
        finally:
            filling.set()  # waiting creates of this name go on: with the part, or to try again
        self._make_durable(new)
        return new.info(), True

    def validate(self, spec: VariableSpec, booking: str = "") -> VariableInfo | None:
        """Refuse ``spec`` exactly as :meth:`create` would now, without creating anything.

        Returns the existing variable's info (same spec), or None when the
        variable is new or being created by another call. A client validates
        on every shard before it creates on any, so that a create refused by
        one shard (a conflict, --max-memory-bytes, --max-variables) leaves no
        part behind on the others.

        With ``booking`` (an id the client chose), a new variable's bytes
        (from an array: also the buffer its value is uploaded into, see
        :meth:`stage_upload`) and its place under --max-variables are booked
        for :data:`BOOKING_SECONDS` (validating again with the same id renews
        them): a create of the same spec in that time uses them, so memory
        taken by others between the validation and the create cannot refuse
        it. Another spec under the
        same name is refused while a booking of it lasts. Nothing else sees a
        booking: it is not a variable, not in Describe, the spec log or a
        checkpoint.
        """
        with self._lock:
            existing = self._parts.get(spec.name)
            if existing is None and spec.name not in self._filling:
                self._collect_given_back()
                held = self._bookings.get(spec.name)
                if held is not None:
                    self._check_booked_same(held, spec)
                    if held.owner == booking:  # this client again (a renewal or a retry)
                        held.expires = time.monotonic() + BOOKING_SECONDS
                    return None  # another client's booking of the same spec: its create will do
                new = self._checked_new(spec)
                if booking:
                    self._held += _cost(new)
                    self._bookings[spec.name] = _Booking(spec, booking, _cost(new),
                                                         time.monotonic() + BOOKING_SECONDS)
                return None
        if existing is None:
            return None
        self._check_same(existing, spec)
        return existing.info()

    def cancel_booking(self, name: str, booking: str) -> None:
        """Give back ``booking``'s hold on ``name`` (no-op when it was used, expired or is another's)."""
        with self._lock:
            held = self._bookings.get(name)
            if held is not None and held.owner == booking:
                del self._bookings[name]
                self._held -= held.nbytes

    @staticmethod
    def _check_booked_same(held: "_Booking", spec: VariableSpec) -> None:
        differences = held.spec.differences(spec)
        if differences:
            raise RequestError(
                Reason.SPEC_CONFLICT,
                f"variable {spec.name!r} is being created with a different spec: " + "; ".join(differences))

    def _reserve_new(self, spec: VariableSpec) -> VariablePart | HashTablePart:
        """A new, empty part for ``spec`` with its memory booked (called with _lock held).

        A booking of the same spec (whoever validated it) gives its bytes to the part.
        """
        self._collect_given_back()
        held = self._bookings.get(spec.name)
        if held is not None:
            self._check_booked_same(held, spec)
            del self._bookings[spec.name]
            self._held -= held.nbytes
        new = self._checked_new(spec)
        self._reserved += _cost(new)
        return new

    def _checked_new(self, spec: VariableSpec) -> VariablePart | HashTablePart:
        """A new, empty part for ``spec``, refused unless it fits the limits; books nothing (_lock held)."""
        self._check_count()
        if spec.hash_table:
            table = HashTablePart(spec, self._table_limit(spec), self._reserve_bytes)
            self._collect_given_back()
            if not self._fits_locked(table.nbytes):
                raise RequestError(
                    Reason.MEMORY_LIMIT,
                    f"hash table {spec.name!r} needs {table.nbytes} bytes for its empty id index on "
                    f"shard {self.shard_index}; {self._reserved + self._held} of the "
                    f"{self.memory_limit}-byte limit are in use (--max-memory-bytes)")
            return table
        part = spec.placement(self.num_shards).part_on(self.shard_index)
        row_start, row_end = (part.row_start, part.row_end) if part else (0, 0)
        new = VariablePart(spec, row_start, row_end, part is not None)
        new.reserve = self._reserve_bytes
        if isinstance(spec.initializer, Explicit) and new.elements:
            # The buffer its initial value is uploaded into, booked with it (see stage_upload).
            new.upload_share = new.elements * spec.dtype.itemsize
            new.share_free = True
        self._collect_given_back()
        if not self._fits_locked(_cost(new)):
            what = ("values, optimizer slots and the buffer its initial value is uploaded into"
                    if new.upload_share else "values and optimizer slots")
            raise RequestError(
                Reason.MEMORY_LIMIT,
                f"variable {spec.name!r} needs {_cost(new)} bytes on shard "
                f"{self.shard_index} ({what}); {self._reserved + self._held} of "
                f"the {self.memory_limit}-byte limit are in use (--max-memory-bytes)",
            )
        return new

    def _make_durable(self, part: VariablePart | HashTablePart) -> None:
        """Record the part's spec in the spec log unless it is there already (or there is no log)."""
        if self.spec_log is None or part.durable:
            return
        self.spec_log.record_spec(part.spec)
        part.durable = True

    # ---- explicit initial values ----

    def stage_upload(self, part: VariablePart, wait_seconds: float | None = None) -> "InitialUpload | None":
        """A private buffer for one upload of ``part``'s initial value; None when the part has its
        value already; MEMORY_LIMIT if the buffer does not fit.

        The first upload takes the bytes the create booked for it (the part's
        upload share). Another upload while that one runs (equal-array
        creators racing) books its own buffer; when that does not fit it
        waits, at most ``wait_seconds`` (None: :data:`UPLOAD_WAIT_SECONDS`),
        for the running upload to be installed (then None: this one is a
        duplicate) or dropped (then it takes the share), so that concurrent
        creators do not refuse each other. The buffer counts against the
        memory limit until the upload is installed, the part is initialised
        by another upload, or the upload is dropped (its ledger session
        forgotten).
        """
        nbytes = part.elements * part.spec.dtype.itemsize
        wait = UPLOAD_WAIT_SECONDS if wait_seconds is None else min(wait_seconds, UPLOAD_WAIT_SECONDS)
        deadline = time.monotonic() + wait
        with self._lock:
            while True:
                self._collect_given_back()
                if part.initialized:  # (a bool read) another upload was installed meanwhile
                    return None
                if part.share_free:
                    part.share_free = False
                    release: Callable[[int], None] = functools.partial(self._return_share, part)
                    break
                if self._fits_locked(nbytes):
                    self._reserved += nbytes
                    release = self._release
                    break
                remaining = deadline - time.monotonic()
                # Another upload is running: it holds the share (also while it sets up) or a buffer.
                running = bool(part.upload_share and not part.share_free) or _uploading(part)
                if not running or remaining <= 0:
                    raise RequestError(
                        Reason.MEMORY_LIMIT,
                        f"uploading the initial value of {part.spec.name!r} needs a {nbytes}-byte buffer on "
                        f"shard {self.shard_index}; {self._reserved + self._held} of the {self.memory_limit}-byte "
                        "limit are in use (--max-memory-bytes)"
                        + ("; another upload of it is in progress" if running else ""))
                self._upload_changed.wait(remaining)
        try:
            upload = InitialUpload(part, nbytes, release)
        except MemoryError:
            release(nbytes)
            raise RequestError(Reason.MEMORY_LIMIT, f"out of memory allocating the {nbytes}-byte buffer for "
                                                    f"the initial value of {part.spec.name!r}") from None
        with part.lock:
            part.uploads.add(upload)
        return upload

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._reserved -= nbytes
            self._upload_changed.notify_all()  # an upload may wait for room (stage_upload)

    def _return_share(self, part: VariablePart, nbytes: int) -> None:
        """The upload holding ``part``'s upload share was dropped: the share stays booked for the
        next upload while the part waits for its value and no other upload (with its own buffer)
        is in progress; otherwise it is given back. May run in a finalizer: takes no part's lock."""
        with self._lock:
            if part.initialized or _uploading(part):
                part.upload_share = 0
                self._reserved -= nbytes
            else:
                part.share_free = True
            self._upload_changed.notify_all()

    def _settle_share(self, part: VariablePart) -> None:
        """``part`` has its value: a share no upload holds is given back, and waiting uploads learn
        that they are duplicates."""
        with self._lock:
            if part.share_free:
                part.share_free = False
                self._reserved -= part.upload_share
                part.upload_share = 0
            self._upload_changed.notify_all()

    def install_upload(self, upload: "InitialUpload") -> bool:
        """Make a complete upload the part's initial value, unless the part has one already.

        The value is written to the spec log first (when there is one), so
        that whoever sees the part initialised may rely on it surviving a
        crash. Returns True when this upload became the value.
        """
        part = upload.part
        with part.install_lock:  # racing uploads: the first one logged is the one installed
            buffer = upload.buffer  # read once: another upload's install may drop this one meanwhile
            if part.initialized or buffer is None:  # (a bool read: no lock needed)
                upload.drop()
                return False
            if self.spec_log is not None:
                self.spec_log.record_initial_value(part.spec, part.row_start, part.row_end, buffer)
            with self.gate.shared():
                with part.lock:
                    installed = not part.initialized  # (an install drops the others only after this)
                    if installed:
                        part.value = buffer
                        part.initialized = True
                    others = list(part.uploads)
                if installed:
                    self.generation += 1
        for other in others:  # every other upload of this part is now a duplicate
            other.drop()
        if installed:
            self._settle_share(part)
        return installed

    def _table_limit(self, spec: VariableSpec) -> int:
        limits = [n for n in (spec.max_rows, self.max_rows) if n]
        return min(limits) if limits else 0

    def _reserve_bytes(self, delta: int) -> None:
        """Book memory for a growing hash table, or give back a part's bytes (a negative delta:
        never refused); may be called with the part's lock held."""
        with self._lock:
            self._collect_given_back()
            if delta > 0 and not self._fits_locked(delta):
                raise RequestError(
                    Reason.MEMORY_LIMIT,
                    f"growing a hash table by {delta} bytes would pass shard {self.shard_index}'s "
                    f"{self.memory_limit}-byte limit ({self._reserved} in use by variables, {self._held} "
                    "by requests in flight; --max-memory-bytes); set max_rows with eviction='lru', "
                    "or add shards")
            self._reserved += delta

    def _check_count(self) -> None:
        """Called with _lock held, before adding a variable."""
        if len(self._parts) + len(self._filling) + len(self._bookings) >= self.max_variables:
            raise RequestError(Reason.MEMORY_LIMIT,
                               f"shard {self.shard_index} already holds {len(self._parts)} variables and "
                               f"{len(self._filling) + len(self._bookings)} being created, its limit "
                               "(--max-variables); merge small variables or raise the limit")

    @staticmethod
    def _check_same(existing, spec: VariableSpec) -> None:
        differences = existing.spec.differences(spec)
        if differences:
            raise RequestError(
                Reason.SPEC_CONFLICT,
                f"variable {spec.name!r} already exists with a different spec: " + "; ".join(differences),
            )

    def get(self, name: str) -> VariablePart:
        with self._lock:
            part = self._parts.get(name)
        if part is None:
            raise RequestError(Reason.UNKNOWN_VARIABLE,
                               f"variable {name!r} does not exist; create it with create_variable first")
        return part

    def known_names(self, names: list[str]) -> list[str]:
        """The names among ``names`` that are variables here, or ``["-"]`` when none is.

        Metric labels come from it: a request naming unknown variables must
        not create a label value (and a time series) per name it makes up.
        """
        with self._lock:
            known = [name for name in names if name in self._parts]
        return known or ["-"]

    def parts(self) -> list[VariablePart]:
        with self._lock:
            return list(self._parts.values())

    def describe(self) -> list[VariableInfo]:
        return [part.info() for part in self.parts()]

    def apply_accumulated(self, step: int) -> list[str]:
        """Synchronous mode: apply step ``step`` on every part; returns the variables updated.

        The caller holds the gate exclusive: no push merges into the step
        while it is applied part by part, so a push is in every part's sum
        of the step or in none.
        """
        applied = []
        for part in self.parts():
            if part.apply_accumulated(step):
                applied.append(part.spec.name)
        self.generation += 1
        return applied

    def start_step(self, step: int) -> None:
        """Synchronous mode: every part accumulates ``step`` from now on."""
        for part in self.parts():
            part.start_step(step)

    def snapshot(self) -> list[PartSnapshot]:
        """Copies of every part; call with the gate held exclusive for a consistent instant."""
        return [part.snapshot() for part in self.parts()]

    def restore(self, loaded: list[LoadedPart]) -> None:
        """Replace the store's content with parts read from a checkpoint (before serving).

        All or nothing: when the parts would not fit the memory limit, the
        store is left as it was.
        """
        reserved = 0

        def reserve(delta: int) -> None:
            nonlocal reserved
            if reserved + delta > self.memory_limit:
                raise RequestError(Reason.MEMORY_LIMIT,
                                   f"the checkpoint needs more than shard {self.shard_index}'s "
                                   f"{self.memory_limit}-byte limit (--max-memory-bytes)")
            reserved += delta

        parts: dict[str, VariablePart | HashTablePart] = {}
        for item in loaded:
            if item.rows is not None:
                table = HashTablePart(item.spec, self._table_limit(item.spec), reserve)
                reserve(table.nbytes)
                table.load_rows(item.rows, item.version, item.optimizer_steps, item.evicted_rows)
                table.restore_accumulator(item.accumulator)
                parts[item.spec.name] = table
            else:
                part = VariablePart.from_checkpoint(item)
                reserve(part.nbytes + part.accumulator_bytes)  # the step's sum, as its pushes booked it
                parts[item.spec.name] = part
        for part in parts.values():
            part.durable = True  # from a checkpoint or the spec log: already on disk
            part.reserve = self._reserve_bytes
        with self._lock:
            self._parts = parts
            self._reserved = reserved


def _uploading(part: VariablePart) -> bool:
    """Whether an upload of ``part``'s initial value still holds a buffer (read without the part's
    lock, which a finalizer calling this may not take; a stale answer only changes how long an
    upload waits, or whether a share is kept)."""
    return any(upload.buffer is not None for upload in list(part.uploads))


def _cost(part: VariablePart | HashTablePart) -> int:
    """Bytes a new part books: its own, and for a create from an array its upload share."""
    return part.nbytes + (part.upload_share if isinstance(part, VariablePart) else 0)


#: How long an upload of an initial value waits for a buffer while another upload of the same
#: value holds the part's upload share (see VariableStore.stage_upload).
UPLOAD_WAIT_SECONDS = 60.0

#: How long a validated create keeps its booking (see VariableStore.validate): longer than a
#: client takes from validating on every shard to creating, also when it retries a shard that
#: is briefly unavailable; the client validates again (renews) when it took longer.
BOOKING_SECONDS = 60.0


@dataclass
class _Booking:
    """A validated create's hold on a variable's bytes and its place under --max-variables."""
    spec: VariableSpec
    owner: str  # the id the validating client chose
    nbytes: int
    expires: float  # time.monotonic()


class MemoryHold:
    """Bytes booked with :meth:`VariableStore.hold`, given back once (``release`` or leaving ``with``)."""

    def __init__(self, store: VariableStore, nbytes: int) -> None:
        self._store = store
        self.nbytes = nbytes

    def release(self) -> None:
        nbytes, self.nbytes = self.nbytes, 0
        self._store.book(-nbytes, "")

    def __enter__(self) -> "MemoryHold":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def check_dtype_allowed(part: VariablePart, wire_dtype: np.dtype, assign: bool) -> None:
    """A push may send the variable's own dtype, or float16/bfloat16 gradients."""
    own = part.spec.dtype
    if wire_dtype == own:
        return
    if not assign and wire_dtype in WIRE_FLOAT_DTYPES:
        return
    allowed = dtype_name(own) if assign else f"{dtype_name(own)}, float16 or bfloat16"
    raise RequestError(
        Reason.DTYPE_MISMATCH,
        f"variable {part.spec.name!r} is {dtype_name(own)}; data for it must be {allowed}, "
        f"got {dtype_name(wire_dtype)}",
    )
