"""Synchronous mode: summing one step's gradients until the step is applied.

Each push stages its gradient privately (in its ledger session, so a retry
after a cut connection completes the same staging) and merges it into the
part's accumulator only when the whole push has arrived. A push that is
late — its step was applied while it was still streaming — is therefore
dropped whole, never half-counted, and the mean divides by exactly the
number of gradients in the sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from wehub_ps.segments import sum_by_id

__all__ = ["StepAccumulator", "PushStaging"]


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

    def merge(self, step: int, staging: PushStaging) -> bool:
        """Add a complete push of ``step``; False (dropped) when the step is over."""
        if step != self.step:
            return False
        if staging.dense is not None:
            if self.dense is None:
                self.dense = np.zeros_like(staging.dense)
            self.dense += staging.dense
            self.dense_count += 1
        if staging.row_ids:
            self.row_ids += staging.row_ids
            self.row_grads += staging.row_grads
            self.row_count += 1
        return True

    def take(self, mean: bool) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
        """(dense gradient, row ids, row gradients) of the step, aggregated; then start afresh."""
        dense = None
        if self.dense_count:
            dense = self.dense / self.dense_count if mean else self.dense.copy()
            dense = dense.astype(self.dense.dtype, copy=False)
            self.dense.fill(0)
        ids = grads = None
        if self.row_count:
            ids, grads = sum_by_id(np.concatenate(self.row_ids), np.concatenate(self.row_grads))
            if mean:
                grads /= self.row_count
        self.dense_count = self.row_count = 0
        self.row_ids, self.row_grads = [], []
        return dense, ids, grads
