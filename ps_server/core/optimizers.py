"""Optimizer updates applied in place, one chunk at a time.

Each kernel updates a slice of a variable and its slots from a gradient
slice of the same length, using ``scratch`` (chunk-sized, reused) instead of
allocating: no temporary ever has the size of the variable, and a chunk of a
few hundred KiB stays in cache between the passes. The math matches the
formulas in :mod:`wehub_ps.specs`; tests check each against a plain numpy
reference written independently.

Kernels are pure numpy and hold no locks: the caller (the store) holds the
variable's lock around ``apply``.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

from ps_server.core.fused import fused_adam, fused_sgd_rows
from wehub_ps.specs import SGD, Adagrad, Adam, Momentum, Optimizer

__all__ = ["OptimizerKernel", "make_kernel"]


class OptimizerKernel(Protocol):
    #: Names of the per-element state arrays this optimizer keeps.
    slot_names: tuple[str, ...]
    #: True when the update depends on a step count (Adam's bias correction):
    #: sparse updates then keep one count per row.
    needs_row_steps: bool

    def init_slot(self, name: str, out: np.ndarray) -> None:
        """Fill a freshly allocated slot with its initial value."""

    def apply(self, w: np.ndarray, g: np.ndarray, slots: dict[str, np.ndarray],
              step: int, scratch: np.ndarray) -> None:
        """Update ``w`` (and ``slots``) in place; ``step`` counts from 1."""

    def update_rows(self, table: np.ndarray, rows: np.ndarray, g: np.ndarray) -> bool:
        """A sparse update made where the rows lie (``table`` 2-D, ``rows`` unique), in one pass.

        Only for optimizers with no slots and no per-row step count (the
        arguments carry neither). False when this optimizer or these arrays
        have no such form: nothing was changed and the caller gathers, runs
        apply_rows and scatters.
        """

    def apply_rows(self, w: np.ndarray, g: np.ndarray, slots: dict[str, np.ndarray],
                   steps: np.ndarray, scratch: np.ndarray | None = None) -> None:
        """Sparse update of gathered rows, (k, row_elements) each, in place.

        ``steps`` holds each row's own step count (from 1), so rows touched
        rarely get the bias correction of their own history (lazy Adam).
        ``scratch`` (at least ``w.size`` elements) saves an allocation per call.
        """


class _FlatRows:
    """apply_rows for optimizers whose update ignores the step count."""

    needs_row_steps = False

    def update_rows(self, table, rows, g):
        return False

    def apply_rows(self, w, g, slots, steps, scratch=None):
        flat_slots = {name: slot.reshape(-1) for name, slot in slots.items()}
        if scratch is None:
            scratch = np.empty(w.size, dtype=w.dtype)
        self.apply(w.reshape(-1), g.reshape(-1), flat_slots, 0, scratch)


class _SGDKernel(_FlatRows):
    slot_names: tuple[str, ...] = ()

    def __init__(self, config: SGD) -> None:
        self.lr = config.learning_rate
        #: Update rows in place with a compiled loop where it can run (False: gather, update, scatter).
        self.fused = True

    def update_rows(self, table, rows, g):
        # The same float operations as apply: g * lr rounded to the dtype, then w - that.
        return self.fused and fused_sgd_rows(table, rows, g, self.lr)

    def init_slot(self, name: str, out: np.ndarray) -> None:  # pragma: no cover - no slots
        raise KeyError(name)

    def apply(self, w, g, slots, step, scratch):
        s = scratch[: w.size]
        np.multiply(g, self.lr, out=s, casting="unsafe")
        np.subtract(w, s, out=w)


class _MomentumKernel(_FlatRows):
    slot_names = ("momentum",)

    def __init__(self, config: Momentum) -> None:
        self.lr = config.learning_rate
        self.momentum = config.momentum
        self.nesterov = config.nesterov

    def init_slot(self, name: str, out: np.ndarray) -> None:
        out.fill(0)

    def apply(self, w, g, slots, step, scratch):
        a = slots["momentum"]
        s = scratch[: w.size]
        np.multiply(a, self.momentum, out=a, casting="unsafe")
        np.add(a, g, out=a)
        if self.nesterov:
            np.multiply(a, self.momentum, out=s, casting="unsafe")
            np.add(s, g, out=s)
            np.multiply(s, self.lr, out=s, casting="unsafe")
        else:
            np.multiply(a, self.lr, out=s, casting="unsafe")
        np.subtract(w, s, out=w)


class _AdagradKernel(_FlatRows):
    slot_names = ("accumulator",)

    def __init__(self, config: Adagrad) -> None:
        self.lr = config.learning_rate
        self.initial = config.initial_accumulator_value
        self.epsilon = config.epsilon

    def init_slot(self, name: str, out: np.ndarray) -> None:
        out.fill(self.initial)

    def apply(self, w, g, slots, step, scratch):
        acc = slots["accumulator"]
        s = scratch[: w.size]
        np.multiply(g, g, out=s)
        np.add(acc, s, out=acc)
        np.sqrt(acc, out=s)
        np.add(s, self.epsilon, out=s, casting="unsafe")
        np.divide(g, s, out=s)
        np.multiply(s, self.lr, out=s, casting="unsafe")
        np.subtract(w, s, out=w)


class _AdamKernel:
    slot_names = ("m", "v")
    needs_row_steps = True

    def __init__(self, config: Adam) -> None:
        self.lr = config.learning_rate
        self.beta_1 = config.beta_1
        self.beta_2 = config.beta_2
        self.epsilon = config.epsilon
        #: Use the compiled one-pass update where it can run (False: NumPy's twelve passes).
        self.fused = True

    def init_slot(self, name: str, out: np.ndarray) -> None:
        out.fill(0)

    def update_rows(self, table, rows, g):
        return False  # lazy Adam keeps a step count per row: gathered rows (apply_rows)

    def apply(self, w, g, slots, step, scratch):
        m, v = slots["m"], slots["v"]
        b1, b2 = self.beta_1, self.beta_2
        lr_t = self.lr * math.sqrt(1.0 - b2**step) / (1.0 - b1**step)
        if self.fused and fused_adam(w, g, m, v, b1, b2, self.epsilon, lr_t):
            return  # one compiled pass, the same bits as below (ps_server/core/fused.py)
        s = scratch[: w.size]
        # m = b1 m + (1 - b1) g
        np.multiply(m, b1, out=m, casting="unsafe")
        np.multiply(g, 1.0 - b1, out=s, casting="unsafe")
        np.add(m, s, out=m)
        # v = b2 v + (1 - b2) g^2
        np.multiply(v, b2, out=v, casting="unsafe")
        np.multiply(g, g, out=s)
        np.multiply(s, 1.0 - b2, out=s, casting="unsafe")
        np.add(v, s, out=v)
        # w -= lr_t m / (sqrt(v) + eps)
        np.sqrt(v, out=s)
        np.add(s, self.epsilon, out=s, casting="unsafe")
        np.divide(m, s, out=s)
        np.multiply(s, lr_t, out=s, casting="unsafe")
        np.subtract(w, s, out=w)

    def apply_rows(self, w, g, slots, steps, scratch=None):
        m, v = slots["m"], slots["v"]
        b1, b2 = self.beta_1, self.beta_2
        t = steps.astype(np.float64)[:, None]
        lr_t = (self.lr * np.sqrt(1.0 - b2**t) / (1.0 - b1**t)).astype(w.dtype)
        m *= b1
        m += (1.0 - b1) * g
        v *= b2
        v += (1.0 - b2) * (g * g)
        w -= lr_t * m / (np.sqrt(v) + self.epsilon)


_KERNELS = {SGD: _SGDKernel, Momentum: _MomentumKernel, Adagrad: _AdagradKernel, Adam: _AdamKernel}


def make_kernel(config: Optimizer) -> OptimizerKernel:
    """The in-place kernel for an optimizer config."""
    return _KERNELS[type(config)](config)
