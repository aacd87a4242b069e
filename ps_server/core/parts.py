"""Dense variable parts: this shard's rows of one variable, their optimizer state and updates.

Each part is stored flat (C order of its rows), so a chunk is a plain
slice. Concurrency: every :class:`VariablePart` has its own lock, held for
the duration of one chunk's read or update (a chunk is at most the
negotiated chunk size, so the lock is short); pushes to different variables
therefore proceed in parallel (numpy releases the GIL), and concurrent
pushes to one variable serialise per chunk, so none is ever lost.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Callable, TypeVar

import numpy as np

from ps_server.core.accumulator import PushStaging, StepAccumulator
from ps_server.core.errors import RequestError
from ps_server.core.info import VariableInfo
from ps_server.core.optimizers import make_kernel
from ps_server.core.persistence import LoadedPart, PartSnapshot
from wehub_ps.dtypes import dtype_name, is_wire_float
from wehub_ps.errors import Reason
from wehub_ps.initializers import fill_initial_values
from wehub_ps.kernels.convert import cast_into
from wehub_ps.kernels.rowops import RowGather, put_rows, take_rows
from wehub_ps.placement import rows_of
from wehub_ps.specs import Explicit, VariableSpec

if TYPE_CHECKING:
    from ps_server.core.uploads import InitialUpload

__all__ = ["VariablePart", "check_dtype_allowed"]

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
            dense, ids, grads = acc.take(self.spec.aggregation)
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


def check_dtype_allowed(part: VariablePart, wire_dtype: np.dtype, assign: bool) -> None:
    """A push may send the variable's own dtype, or float16/bfloat16 gradients."""
    own = part.spec.dtype
    if wire_dtype == own:
        return
    if not assign and is_wire_float(wire_dtype):
        return
    allowed = dtype_name(own) if assign else f"{dtype_name(own)}, float16 or bfloat16"
    raise RequestError(
        Reason.DTYPE_MISMATCH,
        f"variable {part.spec.name!r} is {dtype_name(own)}; data for it must be {allowed}, "
        f"got {dtype_name(wire_dtype)}",
    )
