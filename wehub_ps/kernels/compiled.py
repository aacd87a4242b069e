"""Small loops compiled with numba: one pass over memory where NumPy needs several.

Used for Adam's update and SGD on pushed rows on the server
(ps_server/core/fused.py), for the float32 -> bfloat16 cast on both sides
(wehub_ps/kernels/convert.py), for summing the rows of repeated ids
(wehub_ps/kernels/groups.py: a worker's rows calls, grouping ids by a hash) and for
a hash table's id lookups (ps_server/core/id_index.py). Each loop is compiled on first use (about 0.4 s per
argument type) and kept in numba's on-disk cache, where numba finds one, in
this order: ``NUMBA_CACHE_DIR``, the module's ``__pycache__`` when writable,
the user's cache directory (``$XDG_CACHE_HOME/numba`` or ``~/.cache/numba``);
with none writable it is compiled once per process. A ps-server with a
checkpoint directory caches there (:func:`cache_in`), which survives a
restarted container. A cached loop loads in milliseconds, but the first
loop of a process still pays numba's import and LLVM's set-up (about 0.5 s).
Without numba every caller has a NumPy path that gives the same bits.

Memory: numba is imported only when a loop is first needed (an Adam
variable, SGD on rows, a hash table's lookup of 16 ids or more, a bfloat16 wire, a worker's first rows call), and then costs about 140 MB of
RSS per process (65 MB the import, the rest LLVM). ``PS_COMPILED_LOOPS=0`` in the
environment keeps every process on the NumPy paths.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from wehub_ps.process.logs import event

__all__ = ["compiled", "compiled_soon", "cache_in", "COMPILED_LOOPS_ENV", "NUMBA_CACHE_ENV"]

#: '0' (or false, no, off) keeps every process on the NumPy paths; read by servers and workers alike.
COMPILED_LOOPS_ENV = "PS_COMPILED_LOOPS"

#: numba's own setting for where its cache is; read once, when numba is imported.
NUMBA_CACHE_ENV = "NUMBA_CACHE_DIR"

log = logging.getLogger("wehub_ps.kernels.compiled")

_lock = threading.Lock()  # guards _built
_built: dict[Callable, Callable | None] = {}
_NOT_BUILT = object()
_starting = threading.Lock()  # guards _started
_started: set[Callable] = set()  # loops compiled_soon started building


def compiled(fn: Callable, signatures: Callable[[Any], list] | None = None,
             wait: bool = True, cache: bool = True) -> Callable | None:
    """``fn`` compiled by numba (GIL released, NumPy's error model), or None without numba.

    ``error_model="numpy"`` only drops Python's zero-division checks, which
    keep LLVM from vectorising a loop; no fast-math: the float operations
    stay those written, in that order.

    ``signatures(numba.types)``, when given, lists the only argument types
    the loop is compiled for (all at once, on first use). That is how a
    loop declares an argument that may start at any byte: numba types every
    array it is handed as aligned, so only a declared ``aligned=False``
    makes it generate loads that are correct at any address.

    ``wait=False``: None at once while another thread builds a loop (a
    server preparing its loops ahead), so a caller with a NumPy path of
    the same bits runs that instead of waiting up to a second.

    ``cache=False``: compiled once per process, never cached on disk (a loop
    calling C functions through ctypes, whose addresses change per process).
    """
    built = _built.get(fn, _NOT_BUILT)  # one dict read: no lock needed
    if built is not _NOT_BUILT:
        return built
    if not _lock.acquire(blocking=wait):
        return None  # ``wait=False``: another thread is building a loop; the caller's NumPy path meanwhile
    try:
        if fn not in _built:
            _built[fn] = _build(fn, signatures, cache)
        return _built[fn]
    finally:
        _lock.release()


def compiled_soon(fn: Callable, signatures: Callable[[Any], list] | None = None,
                  cache: bool = True) -> Callable | None:
    """``fn`` compiled if it is ready; else None at once, its build started on a thread (once).

    For loops a caller meets in its hot path with no prepared moment before
    (a worker's first push of repeated rows): that call and the next ones
    run the caller's NumPy path, of the same bits, while numba loads.
    """
    built = _built.get(fn, _NOT_BUILT)
    if built is not _NOT_BUILT:
        return built
    with _starting:
        if fn not in _started:
            _started.add(fn)
            threading.Thread(target=compiled, args=(fn, signatures, True, cache), name="ps-compile",
                             daemon=True).start()
    return None


def cache_in(directory: str) -> None:
    """Cache compiled loops in ``directory`` unless ``NUMBA_CACHE_DIR`` names another directory.

    numba reads the variable when it is imported, which this package does
    only when a loop is first needed; once imported, this changes nothing.
    """
    if "numba" not in sys.modules:
        os.environ.setdefault(NUMBA_CACHE_ENV, directory)


def _build(fn: Callable, signatures: Callable[[Any], list] | None, cache: bool = True) -> Callable | None:
    if os.environ.get(COMPILED_LOOPS_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        import numba
    except ImportError:
        event(log, logging.INFO, "numba is not installed: loops run as NumPy passes", loop=fn.__name__)
        return None
    declared = [signatures(numba.types)] if signatures is not None else []
    if not cache:
        return numba.njit(*declared, nogil=True, error_model="numpy")(fn)
    try:
        return numba.njit(*declared, nogil=True, cache=True, error_model="numpy")(fn)
    except RuntimeError:  # nowhere writable to cache: compile in this process only
        return numba.njit(*declared, nogil=True, error_model="numpy")(fn)
