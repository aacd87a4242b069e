"""Top-k gradient sparsification with error feedback, by rows.

Where the network, not the CPU, limits a step, a worker can send only the
rows of each gradient with the largest L2 norm and keep the rest as a
residual that is added to its next gradient (error feedback): nothing is
dropped, only delayed, which is what keeps convergence close to dense
training. Rows, not single elements: a row along axis 0 is the unit the
servers already update sparsely (``push_rows`` on a dense variable), so
the ids travel once per row instead of once per element, and the servers
need nothing new. A 1-D variable's rows are its elements.

The residual is one float32-sized copy of each variable the worker pushes:
the memory price of error feedback.
"""

from __future__ import annotations

import math
import threading

import numpy as np

__all__ = ["TopKRows"]


class TopKRows:
    """Per-variable residuals; ``select`` takes a gradient and returns the rows to send now. Thread-safe."""

    def __init__(self, ratio: float) -> None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"topk_ratio must be in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)
        self._lock = threading.Lock()  # guards _residuals
        self._residuals: dict[str, np.ndarray] = {}  # name -> (rows, width), the variable's dtype

    def rows_sent(self, num_rows: int) -> int:
        """How many of ``num_rows`` rows one push sends."""
        return min(num_rows, max(1, math.ceil(self.ratio * num_rows)))

    def select(self, name: str, gradient: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row ids, rows): the largest rows of ``gradient`` plus what is still owed for ``name``.

        The rows returned are taken out of the residual; if the push that
        carries them fails, give them back with :meth:`restore`.
        """
        rows = gradient.reshape(gradient.shape[0], -1)
        with self._lock:
            owed = self._residuals.get(name)
            if owed is None or owed.shape != rows.shape or owed.dtype != rows.dtype:
                owed = self._residuals[name] = np.zeros(rows.shape, dtype=rows.dtype)
            owed += rows
            norms = np.einsum("ij,ij->i", owed, owed)
            k = self.rows_sent(len(owed))
            ids = np.argpartition(norms, len(norms) - k)[len(norms) - k:] if k < len(norms) else np.arange(k)
            ids.sort()
            sent = owed[ids]  # a copy (fancy indexing)
            owed[ids] = 0
        return ids, sent.reshape((k, *gradient.shape[1:]))

    def restore(self, name: str, ids: np.ndarray, rows: np.ndarray) -> None:
        """Owe again rows that :meth:`select` gave out but were not delivered."""
        with self._lock:
            owed = self._residuals.get(name)
            if owed is not None:
                owed[ids] += rows.reshape(len(ids), -1)

    def residuals(self) -> dict[str, np.ndarray]:
        """Copies of what each variable is still owed, in the variable's shape per row."""
        with self._lock:
            return {name: owed.copy() for name, owed in self._residuals.items()}
