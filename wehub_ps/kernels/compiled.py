"""Small loops compiled with numba: one pass over memory where NumPy needs several.

Used for Adam's update and SGD on pushed rows on the server
(ps_server/core/fused.py) and for the float32 -> bfloat16 cast on both sides
(wehub_ps/kernels/convert.py). Each loop is compiled on first use (about 0.4 s per
argument type) and cached next to its module when that directory is
writable; elsewhere (a read-only install) it is compiled once per process.
Without numba every caller has a NumPy path that gives the same bits.

Memory: numba is imported only when a loop is first needed (an Adam
variable, SGD on rows, a bfloat16 wire), and then costs about 140 MB of
RSS per process (65 MB the import, the rest LLVM). ``PS_COMPILED_LOOPS=0`` in the
environment keeps every process on the NumPy paths.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from wehub_ps.process.logs import event

__all__ = ["compiled", "COMPILED_LOOPS_ENV"]

#: '0' (or false, no, off) keeps every process on the NumPy paths; read by servers and workers alike.
COMPILED_LOOPS_ENV = "PS_COMPILED_LOOPS"

log = logging.getLogger("wehub_ps.kernels.compiled")

_lock = threading.Lock()  # guards _built
_built: dict[Callable, Callable | None] = {}


def compiled(fn: Callable, signatures: Callable[[Any], list] | None = None) -> Callable | None:
    """``fn`` compiled by numba (GIL released, NumPy's error model), or None without numba.

    ``error_model="numpy"`` only drops Python's zero-division checks, which
    keep LLVM from vectorising a loop; no fast-math: the float operations
    stay those written, in that order.

    ``signatures(numba.types)``, when given, lists the only argument types
    the loop is compiled for (all at once, on first use). That is how a
    loop declares an argument that may start at any byte: numba types every
    array it is handed as aligned, so only a declared ``aligned=False``
    makes it generate loads that are correct at any address.
    """
    with _lock:
        if fn not in _built:
            _built[fn] = _build(fn, signatures)
        return _built[fn]


def _build(fn: Callable, signatures: Callable[[Any], list] | None) -> Callable | None:
    if os.environ.get(COMPILED_LOOPS_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        import numba
    except ImportError:
        event(log, logging.INFO, "numba is not installed: loops run as NumPy passes", loop=fn.__name__)
        return None
    declared = [signatures(numba.types)] if signatures is not None else []
    try:
        return numba.njit(*declared, nogil=True, cache=True, error_model="numpy")(fn)
    except RuntimeError:  # nowhere writable to cache: compile in this process only
        return numba.njit(*declared, nogil=True, error_model="numpy")(fn)
