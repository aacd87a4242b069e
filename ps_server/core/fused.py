"""Optimizer updates fused into one pass over memory, compiled with numba.

In NumPy, Adam is twelve passes over each chunk (two moments, a square root,
a division, the step); no formulation with NumPy's ufuncs needs fewer than
eleven, and L2-sized sub-blocks or numexpr were no faster. One compiled
loop reads w, g, m and v once and writes w, m and v: 8.2-9.3 GB/s of
parameters against NumPy's 2.9-3.2 on this machine (100 MB in 1 MiB
chunks; memcpy 18 GB/s). It does the same float operations in the same
order as the NumPy kernel, so the results are bit for bit the same.

SGD on rows (a sparse push): NumPy gathers the rows, updates the copy and
scatters it back, three passes over rows that sit at random places in a
table of gigabytes, each paying the memory latency again. One compiled
loop updates each row where it lies: 2,048 random rows of 64 float32 from
a 1.28 GB part, 0.15-0.17 -> 0.09-0.14 ms through VariablePart.apply_rows.
Same bits as the NumPy path.

Compiling and the fallback without numba: wehub_ps/kernels/compiled.py.
:func:`prepare` loads or compiles the loops a shard's variables will use
ahead of their first push (numba's import, LLVM's set-up and, without a
cached copy, the compile: 0.5-1.5 s on the 2-core machine); a push that
comes meanwhile runs the NumPy kernel, which gives the same bits, rather
than wait (a backup catching up applies thousands of pushes in that time).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from wehub_ps.kernels.compiled import compiled
from wehub_ps.specs import SGD, Adam, VariableSpec

__all__ = ["fused_adam", "fused_sgd_rows", "loops_for", "prepare"]


def _adam(w, g, m, v, b1, c1, b2, c2, eps, lr_t):  # pragma: no cover - runs compiled
    for i in range(w.size):
        mi = m[i] * b1 + g[i] * c1
        vi = v[i] * b2 + (g[i] * g[i]) * c2
        m[i] = mi
        v[i] = vi
        w[i] = w[i] - (mi / (np.sqrt(vi) + eps)) * lr_t


def _sgd_rows(table, rows, g, lr):  # pragma: no cover - runs compiled
    # Every row is checked before any is changed: the loop below checks no bounds.
    for i in range(rows.size):
        if rows[i] < 0 or rows[i] >= table.shape[0]:
            return False
    for i in range(rows.size):
        row = rows[i]
        for j in range(table.shape[1]):
            table[row, j] = table[row, j] - g[i, j] * lr
    return True


def _sgd_rows_signatures(types) -> list:
    """The table and rows as NumPy makes them; the gradient only read, at any alignment.

    A gradient is read in place from the received message, where it may
    start at any byte: typed unaligned, it needs no aligning copy (about
    0.05 ms of a server's 0.3 ms per 2,048-row push, in perf). Same speed
    as aligned on this machine (72-74 us either way for 2,048 random rows).
    """
    # (A writable, aligned gradient converts to this type safely, so one signature per dtype.)
    return [types.boolean(types.Array(dtype, 2, "C"), types.Array(types.int64, 1, "C"),
                          types.Array(dtype, 2, "C", readonly=True, aligned=False), dtype)
            for dtype in (types.float32, types.float64)]


def _adam_signatures(types) -> list:
    """Parameters and slots as the server allocates them; the gradient only read, at any alignment.

    A pushed gradient is read in place from the received message, where it
    starts wherever the rows before it end. Left to numba, which types every
    array it is handed as aligned, the loop would compile (about 0.5 s on
    the 2-core machine) at the first aligned gradient, at a step that
    depends on the batch's ids, and unaligned ones would run NumPy's twelve
    passes; declared so, it compiles at the first Adam apply and takes every
    gradient.
    """
    # (A writable, aligned gradient converts to this type safely, so one signature per dtype.)
    return [types.void(types.Array(dtype, 1, "C"), types.Array(dtype, 1, "C", readonly=True, aligned=False),
                       types.Array(dtype, 1, "C"), types.Array(dtype, 1, "C"), *(dtype,) * 6)
            for dtype in (types.float32, types.float64)]


def fused_adam(w: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray,
               beta_1: float, beta_2: float, epsilon: float, lr_t: float) -> bool:
    """Apply one Adam step in place in one pass; False (nothing done) where it cannot."""
    dtype = w.dtype
    if dtype not in (np.float32, np.float64) or any(
            a.dtype != dtype or a.shape != w.shape or a.ndim != 1 or not a.flags.c_contiguous
            for a in (w, g, m, v)):
        return False  # (the compiled loop checks no bounds: equal sizes are a must)
    if not (w.flags.writeable and m.flags.writeable and v.flags.writeable):
        return False
    if not (w.flags.aligned and m.flags.aligned and v.flags.aligned):
        return False
    kernel = compiled(_adam, _adam_signatures, wait=False)  # None while being prepared: NumPy meanwhile
    if kernel is None:
        return False
    scalar = dtype.type
    # The constants NumPy's kernel uses: Python floats rounded once to the array's dtype.
    kernel(w, g, m, v, scalar(beta_1), scalar(1.0 - beta_1), scalar(beta_2), scalar(1.0 - beta_2),
           scalar(epsilon), scalar(lr_t))
    return True


def fused_sgd_rows(table: np.ndarray, rows: np.ndarray, g: np.ndarray, learning_rate: float) -> bool:
    """``table[rows] -= learning_rate * g`` in place, rows unique; False (nothing done) where it cannot.

    ``table`` is 2-D (rows along axis 0), ``g`` is (len(rows), row width)
    of the same dtype. Repeated rows would be updated once per occurrence
    (NumPy's gather-update-scatter keeps only the last), so callers pass
    unique rows, as every push does.
    """
    dtype = table.dtype
    if dtype not in (np.float32, np.float64) or table.ndim != 2 or g.dtype != dtype \
            or g.shape != (len(rows), table.shape[1]) or rows.ndim != 1 or rows.dtype.kind not in "iu":
        return False
    if not (table.flags.c_contiguous and table.flags.aligned and table.flags.writeable
            and g.flags.c_contiguous):
        return False
    kernel = compiled(_sgd_rows, _sgd_rows_signatures, wait=False)  # None while being prepared: NumPy meanwhile
    if kernel is None:
        return False
    # The only argument types it was compiled for: native int64 rows, contiguous.
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    # The constant NumPy's kernel uses: the Python float rounded once to the table's dtype.
    # False when a row is outside the table (nothing was changed then).
    return bool(kernel(table, rows, g, dtype.type(learning_rate)))


def loops_for(specs: Iterable[VariableSpec]) -> list[str]:
    """The compiled loops pushes to ``specs`` will run: 'adam' for Adam, 'sgd_rows' for SGD hash tables.

    A dense SGD variable is left out: only a push of its rows would use
    the loop, and loading numba for it would cost a process that never
    sees one about 140 MB.
    """
    loops = set()
    for spec in specs:
        if isinstance(spec.optimizer, Adam):
            loops.add("adam")
        elif isinstance(spec.optimizer, SGD) and spec.hash_table:
            loops.add("sgd_rows")
    return sorted(loops)


def prepare(loops: Iterable[str]) -> None:
    """Load (from numba's cache) or compile the named loops now; blocking, thread-safe.

    A push that needs a loop meanwhile runs the NumPy kernel, which gives the
    same bits, so preparing never changes what a push computes.
    """
    for loop in loops:
        if loop == "adam":
            compiled(_adam, _adam_signatures)
        elif loop == "sgd_rows":
            compiled(_sgd_rows, _sgd_rows_signatures)
        else:
            raise ValueError(f"loop must be 'adam' or 'sgd_rows', got {loop!r}")
