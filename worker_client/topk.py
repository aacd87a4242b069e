"""Top-k gradient sparsification with error feedback, by rows.

Where the network, not the CPU, limits a step, a worker can send only the
rows of each gradient with the largest L2 norm and keep the rest as a
residual that is added to its next gradient (error feedback): nothing is
dropped, only delayed, which is what keeps convergence close to dense
training. Rows, not single elements: a row along axis 0 is the unit the
servers already update sparsely (``push_rows`` on a dense variable), so
the ids travel once per row instead of once per element, and the servers
need nothing new. A 1-D variable's rows are its elements.

A push is two-phase: :meth:`TopKRows.choose` picks the rows of
``owed + gradient`` without changing what is owed (a push refused for a
bad argument changes nothing), and :meth:`TopKRows.settle` records what
was sent. Every gradient settled is taken in; the rows sent are owed
nothing, except rows a shard refused whole, which are owed again. Rows
sent to a shard that did not answer stay sent: the client sends that same
push again (same sequence, so the shard's ledger applies exactly what it
is missing) before its next one (worker_client.pushes, ``Pushes._push_topk``).

The residual is one copy of each variable the worker pushes: the memory
price of error feedback.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator

import numpy as np

__all__ = ["TopKRows"]

# Rows of owed + gradient are summed this many bytes at a time to rank them (no variable-sized temporary).
_BLOCK_BYTES = 1 << 20


class TopKRows:
    """Per-variable residuals. Hold :meth:`pushing` around each push's ``choose`` ... ``settle`` calls."""

    def __init__(self, ratio: float) -> None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"topk_ratio must be in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)
        # One push at a time: what a push chooses depends on what the one before it settled.
        self._lock = threading.Lock()
        self._owed: dict[str, np.ndarray] = {}  # name -> (rows, width), the variable's dtype

    def rows_sent(self, num_rows: int) -> int:
        """How many of ``num_rows`` rows one push sends."""
        return min(num_rows, max(1, math.ceil(self.ratio * num_rows)))

    @contextlib.contextmanager
    def pushing(self) -> Iterator[None]:
        with self._lock:
            yield

    def choose(self, name: str, gradient: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sorted row ids, their rows of owed + ``gradient``): the rows to send now. Changes nothing."""
        rows = gradient.reshape(gradient.shape[0], -1)
        owed = self._owed.get(name)
        if owed is None or owed.shape != rows.shape or owed.dtype != rows.dtype:
            owed = self._owed[name] = np.zeros(rows.shape, dtype=rows.dtype)
        norms = np.empty(len(rows), dtype=np.float64)
        block = max(1, _BLOCK_BYTES // max(1, rows.shape[1] * rows.itemsize))
        scratch = np.empty((min(block, len(rows)), rows.shape[1]), dtype=rows.dtype)
        for start in range(0, len(rows), block):
            stop = min(start + block, len(rows))
            total = np.add(owed[start:stop], rows[start:stop], out=scratch[:stop - start])
            norms[start:stop] = np.einsum("ij,ij->i", total, total)
        k = self.rows_sent(len(rows))
        ids = np.argpartition(norms, len(norms) - k)[len(norms) - k:] if k < len(norms) else np.arange(k)
        ids.sort()
        sent = owed[ids] + rows[ids]
        return ids, sent.reshape((k, *gradient.shape[1:]))

    def settle(self, name: str, gradient: np.ndarray, ids: np.ndarray, back_ids: np.ndarray | None = None,
               back_rows: np.ndarray | None = None) -> None:
        """Take ``gradient`` in and record that rows ``ids`` (chosen for it) were sent.

        The rows sent are owed nothing, except ``back_ids``: rows that were
        not applied after all (a shard refused them), owed again as
        ``back_rows`` (what :meth:`choose` returned for them). Empty ``ids``:
        nothing was sent, the whole gradient is owed.
        """
        owed = self._owed[name]
        owed += gradient.reshape(owed.shape)
        owed[ids] = 0
        if back_ids is not None and len(back_ids):
            owed[back_ids] = back_rows.reshape(len(back_ids), -1)

    def residuals(self) -> dict[str, np.ndarray]:
        """Copies of what each variable is still owed, one row per row of the variable."""
        with self._lock:
            return {name: owed.copy() for name, owed in self._owed.items()}
