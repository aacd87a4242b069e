"""Synchronous mode: summing one step's gradients until the step is applied.

Each push stages its gradient privately (in its ledger session, so a retry
after a cut connection completes the same staging) and merges it into the
parts' accumulators only when the whole push has arrived, all parts in one
hold of the apply gate; a step is applied with the gate held exclusive (see
:mod:`.consistency`). A push that is late — its step was applied while it
was still streaming — is therefore dropped whole, never half-counted, and
the mean divides by exactly the number of gradients in the sum.

The sums are part of a shard's state: they are checkpointed with the values
and the ledger of the same instant (:meth:`StepAccumulator.snapshot`).

Memory: a push books its staging (:attr:`PushStaging.nbytes`) before it
allocates it; a merge takes the staged arrays over without copying, so the
sum holds only bytes booked before they were allocated (the caller moves
the booking from the push to the variable, see :meth:`StepAccumulator.merge`),
and gives them back through its ``release`` callback when it is applied or
discarded. Rows are booked :data:`ROW_COPIES` times over: applying a step
concatenates them and sums a sorted copy by id.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ps_server.core.persistence import AccumulatorSnapshot
from wehub_ps.kernels.segments import numpy_sum_sorted, sort_ids

__all__ = ["StepAccumulator", "PushStaging", "ROW_COPIES", "pushes_per_id", "staged_rows_bytes"]

#: Copies of a sum's rows that may exist at once: the merged arrays until they are concatenated
#: when the step is applied (then dropped), the concatenation, the copy sorted by id and the sums
#: by id (at most as large as the sorted copy).
ROW_COPIES = 3


def staged_rows_bytes(ids: np.ndarray, elements: int, dtype: np.dtype) -> int:
    """Bytes booked for staging rows ``ids`` with ``elements`` gradient elements of ``dtype``."""
    return ROW_COPIES * (ids.nbytes + elements * np.dtype(dtype).itemsize)


def pushes_per_id(first: np.ndarray) -> np.ndarray:
    """How often each id occurs in sorted ids, from :func:`sort_ids`'s first-occurrence mask."""
    starts = np.flatnonzero(first)
    return np.diff(starts, append=len(first))


@dataclass
class PushStaging:
    """One push's gradients for one variable part, before they join the step's sum."""

    dense: np.ndarray | None = None
    row_ids: list[np.ndarray] = field(default_factory=list)
    row_grads: list[np.ndarray] = field(default_factory=list)
    #: Bytes to book for what is staged: the dense array, and the rows :data:`ROW_COPIES` times.
    nbytes: int = 0

    def add_dense(self, elements: int, dtype: np.dtype, offset: int, values: np.ndarray) -> None:
        if self.dense is None:
            self.dense = np.zeros(elements, dtype=dtype)
            self.nbytes += self.dense.nbytes
        np.copyto(self.dense[offset:offset + values.size], values, casting="unsafe")

    def add_rows(self, ids: np.ndarray, grads: np.ndarray, dtype: np.dtype) -> None:
        self.row_ids.append(ids.copy())
        self.row_grads.append(grads.astype(dtype, copy=True))
        self.nbytes += staged_rows_bytes(ids, grads.size, dtype)


@dataclass
class StepAccumulator:
    """The sum of the merged gradients of step ``step`` for one part (guarded by the part's lock)."""

    step: int = 0
    dense: np.ndarray | None = None
    dense_count: int = 0
    row_ids: list[np.ndarray] = field(default_factory=list)
    row_grads: list[np.ndarray] = field(default_factory=list)
    row_count: int = 0
    #: Bytes the sum holds, as booked (see :class:`PushStaging`); given back through ``release``.
    nbytes: int = 0
    #: Called with the bytes the sum stops holding (applied or discarded); None: nobody books them.
    release: Callable[[int], None] | None = field(default=None, repr=False, compare=False)

    def merge(self, step: int, staging: PushStaging) -> int:
        """Add a complete push of ``step``, the step the shard is accumulating; never allocates.

        The consistency controller decides that ``step`` is still open (under
        the apply gate, so it cannot be applied meanwhile); a sum left from an
        earlier step (a part created or restored after that step ended) is
        discarded first. The staging's arrays are taken over (the staging
        must not be used afterwards). Returns the bytes the sum took over
        (the rest of ``staging.nbytes`` is freed with the staging): the
        caller moves their booking from the push to the sum.
        """
        if step != self.step:
            self.clear()
            self.step = step
        taken = 0
        if staging.dense is not None:
            if self.dense is None:
                self.dense = staging.dense
                taken += staging.dense.nbytes
            else:
                self.dense += staging.dense
            self.dense_count += 1
        if staging.row_ids:
            self.row_ids += staging.row_ids
            self.row_grads += staging.row_grads
            taken += staging.nbytes - (0 if staging.dense is None else staging.dense.nbytes)
            self.row_count += 1
        self.nbytes += taken
        return taken

    def clear(self) -> None:
        """Forget the sum (a step that will never be applied here) and give back its bytes."""
        self.dense = None
        self.dense_count = self.row_count = 0
        self.row_ids, self.row_grads = [], []
        self._give_back()

    def _give_back(self) -> None:
        freed, self.nbytes = self.nbytes, 0
        if freed and self.release is not None:
            self.release(freed)

    @property
    def empty(self) -> bool:
        return not (self.dense_count or self.row_count)

    def take(self, aggregation: str) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
        """(dense gradient, row ids, row gradients) of the step, aggregated; then start afresh.

        ``aggregation`` is the spec's: "sum" applies the sums; "mean"
        divides the dense sum by the pushes that carried a dense gradient and
        every row's sum by the pushes that carried rows of this part (a
        push's rows need not include that row); "row_mean" divides the dense
        sum as "mean" does and each row's sum by the pushes that carried that
        row (a push sends an id at most once, see ps_server.core.rows). The
        dense sum is handed over (divided in place), the rows are summed by
        id from one concatenation; the bytes are given back once the caller
        is done with the result (:meth:`settle`), so that nothing booked is
        freed while the step is still being applied.
        """
        dense = None
        if self.dense_count:
            dense = self.dense
            if aggregation != "sum":
                dense /= self.dense_count
        ids = grads = None
        if self.row_count:
            all_ids, self.row_ids = np.concatenate(self.row_ids), []
            all_grads, self.row_grads = np.concatenate(self.row_grads), []
            order, sorted_ids, first = sort_ids(all_ids)
            # An id repeats here at most once per push of the step (each push's rows are unique): the
            # NumPy passes, without loading numba into a server that may need it for nothing else.
            ids, grads = numpy_sum_sorted(all_grads, order, sorted_ids, first)
            del all_ids, all_grads, order, sorted_ids
            if aggregation == "mean":
                grads /= self.row_count
            elif aggregation == "row_mean":
                grads /= pushes_per_id(first).astype(grads.dtype).reshape(-1, *(1,) * (grads.ndim - 1))
        self.dense = None
        self.dense_count = self.row_count = 0
        self.row_ids, self.row_grads = [], []
        return dense, ids, grads

    def settle(self) -> None:
        """Give back the bytes of a sum :meth:`take` handed over (the step was applied)."""
        if self.empty:
            self._give_back()

    def snapshot(self) -> AccumulatorSnapshot | None:
        """A copy of the sum for a checkpoint (None when empty); caller holds the part's lock."""
        if self.empty:
            return None
        rows = bool(self.row_count)
        return AccumulatorSnapshot(
            self.step, self.dense.copy() if self.dense_count else None, self.dense_count,
            np.concatenate(self.row_ids) if rows else None,
            np.concatenate(self.row_grads) if rows else None, self.row_count)

    @classmethod
    def restore(cls, saved: AccumulatorSnapshot | None,
                release: Callable[[int], None] | None = None) -> "StepAccumulator":
        """The sum of a checkpoint; its :attr:`nbytes` (counted as a push's merge counts them) are
        for the caller to book."""
        acc = cls(release=release)
        if saved is None:
            return acc
        acc.step = saved.step
        if saved.dense is not None:
            acc.dense, acc.dense_count = saved.dense.copy(), saved.dense_count
            acc.nbytes += acc.dense.nbytes
        if saved.row_ids is not None:
            # Concatenated: the sum by id at the step's end does not care how the rows were split.
            acc.row_ids, acc.row_grads, acc.row_count = [saved.row_ids], [saved.row_grads], saved.row_count
            acc.nbytes += staged_rows_bytes(saved.row_ids, saved.row_grads.size, saved.row_grads.dtype)
        return acc
