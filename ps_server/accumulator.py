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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from wehub_ps.segments import sum_by_id

__all__ = ["StepAccumulator", "PushStaging", "AccumulatorSnapshot"]


@dataclass
class PushStaging:
    """One push's gradients for one variable part, before they join the step's sum."""

    dense: np.ndarray | None = None
    row_ids: list[np.ndarray] = field(default_factory=list)
    row_grads: list[np.ndarray] = field(default_factory=list)

    def add_dense(self, elements: int, dtype: np.dtype, offset: int, values: np.ndarray) -> None:
        if self.dense is None:
            self.dense = np.zeros(elements, dtype=dtype)
        np.copyto(self.dense[offset:offset + values.size], values, casting="unsafe")

    def add_rows(self, ids: np.ndarray, grads: np.ndarray, dtype: np.dtype) -> None:
        self.row_ids.append(ids.copy())
        self.row_grads.append(grads.astype(dtype, copy=True))


@dataclass
class StepAccumulator:
    """The sum of the merged gradients of step ``step`` for one part (guarded by the part's lock)."""

    step: int = 0
    dense: np.ndarray | None = None
    dense_count: int = 0
    row_ids: list[np.ndarray] = field(default_factory=list)
    row_grads: list[np.ndarray] = field(default_factory=list)
    row_count: int = 0

    def merge(self, step: int, staging: PushStaging) -> None:
        """Add a complete push of ``step``, the step the shard is accumulating.

        The consistency controller decides that ``step`` is still open (under
        the apply gate, so it cannot be applied meanwhile); a sum left from an
        earlier step (a part created or restored after that step ended) is
        discarded first.
        """
        if step != self.step:
            self.clear()
            self.step = step
        if staging.dense is not None:
            if self.dense is None:
                self.dense = np.zeros_like(staging.dense)
            self.dense += staging.dense
            self.dense_count += 1
        if staging.row_ids:
            self.row_ids += staging.row_ids
            self.row_grads += staging.row_grads
            self.row_count += 1

    def clear(self) -> None:
        """Forget the sum (a step that will never be applied here)."""
        if self.dense is not None:
            self.dense.fill(0)
        self.dense_count = self.row_count = 0
        self.row_ids, self.row_grads = [], []

    @property
    def empty(self) -> bool:
        return not (self.dense_count or self.row_count)

    def take(self, mean: bool) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
        """(dense gradient, row ids, row gradients) of the step, aggregated; then start afresh."""
        dense = None
        if self.dense_count:
            dense = self.dense / self.dense_count if mean else self.dense.copy()
            dense = dense.astype(self.dense.dtype, copy=False)
        ids = grads = None
        if self.row_count:
            ids, grads = sum_by_id(np.concatenate(self.row_ids), np.concatenate(self.row_grads))
            if mean:
                grads /= self.row_count
        self.clear()
        return dense, ids, grads

    def snapshot(self) -> "AccumulatorSnapshot | None":
        """A copy of the sum for a checkpoint (None when empty); caller holds the part's lock."""
        if self.empty:
            return None
        rows = bool(self.row_count)
        return AccumulatorSnapshot(
            self.step, self.dense.copy() if self.dense_count else None, self.dense_count,
            np.concatenate(self.row_ids) if rows else None,
            np.concatenate(self.row_grads) if rows else None, self.row_count)

    @classmethod
    def restore(cls, saved: "AccumulatorSnapshot | None") -> "StepAccumulator":
        acc = cls()
        if saved is None:
            return acc
        acc.step = saved.step
        if saved.dense is not None:
            acc.dense, acc.dense_count = saved.dense.copy(), saved.dense_count
        if saved.row_ids is not None:
            # Concatenated: the sum by id at the step's end does not care how the rows were split.
            acc.row_ids, acc.row_grads, acc.row_count = [saved.row_ids], [saved.row_grads], saved.row_count
        return acc


@dataclass(frozen=True)
class AccumulatorSnapshot:
    """One part's sum of step ``step``: what a checkpoint stores of it."""

    step: int
    dense: np.ndarray | None
    dense_count: int
    row_ids: np.ndarray | None
    row_grads: np.ndarray | None
    row_count: int
