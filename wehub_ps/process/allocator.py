"""Keep freed message-sized blocks in the process instead of handing them back to the kernel.

Every message gRPC Python receives becomes a new ``bytes`` object, and
every chunk we send or gather is a new buffer: blocks of 64 KiB to a few
MiB, allocated and freed thousands of times a second. glibc returns
blocks above its mmap threshold (128 KiB at start, raised automatically
up to 32 MiB) to the kernel on free, and trims the heap top beyond twice
that, so the next block of the same size faults in a fresh zeroed page
every 4 KiB. Measured with ``perf record -a`` on a pull_rows loop (2
servers, 4,096 x 64 rows): page faults were about a fifth of the worker's
CPU time and half its system time; fixing the thresholds took pull_rows
from 3.0-3.7 to 2.0-2.3 ms best and the 1-server dense push from 1.1-1.5
to 2.1-2.5 GB/s on this 2-core machine (docs/benchmarks.md).

The cost is memory kept for reuse: at most ``trim_threshold`` bytes of
free space at the top of each malloc arena, and blocks up to
``mmap_threshold`` served from the heap. Server RSS during 4 concurrent
100 MB pushes went from 219 to 232-236 MB (budget 281).

That bound is per arena, and glibc makes up to 8 arenas per core, one for
each thread that finds the others locked: gRPC's threads allocate outside
the GIL, so a process on a big machine keeps more. The number of arenas is
therefore capped too (``arena_max``). On the 2-core machine 2 arenas took
server RSS from 231-245 to 222-224 MB and the client's peak from 301-328
to 290-295 MB, with dense throughput unchanged within noise; a 16-core
machine ran 1-6% over the memory budget with glibc's default
(docs/benchmarks.md). Our processes call malloc for message-sized buffers
only (Python's small objects come from its own allocator), so two arenas
are rarely contended. ``MALLOC_ARENA_MAX`` in the environment, read by glibc
at start, is left as it is.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading

from wehub_ps.process.logs import event

__all__ = [
    "DEFAULT_ARENA_MAX",
    "DEFAULT_MMAP_THRESHOLD",
    "DEFAULT_TRIM_THRESHOLD",
    "WORKER_MMAP_THRESHOLD",
    "keep_freed_buffers",
    "keep_room_for_step",
]

log = logging.getLogger("wehub_ps.process.allocator")

#: Blocks below this come from the heap and are reused (a message is at most a few chunk sizes).
DEFAULT_MMAP_THRESHOLD = 4 << 20
#: A worker's threshold: glibc's largest, so that the arrays a training step allocates and frees (a
#: 1024x1024 float32 gradient is 4 MiB plus malloc's header, over the default above) come back from the
#: heap. Above the threshold each is a fresh mmap whose pages the kernel zeroes at first touch: a
#: numpy forward and backward of ten 1024x1024 layers (batch 16) took 41 ms, 14 ms of it in the kernel,
#: and 27 ms with this threshold (docs/benchmarks.md, "Training loops").
WORKER_MMAP_THRESHOLD = 32 << 20
#: Free space kept at the top of a heap before it is handed back to the kernel.
DEFAULT_TRIM_THRESHOLD = 64 << 20
#: malloc arenas at most, so that what is kept for reuse does not grow with the number of cores.
DEFAULT_ARENA_MAX = 2

# mallopt parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# glibc caps the mmap threshold at HEAP_MAX_SIZE / 2 (32 MiB on 64-bit).
_MAX_MMAP_THRESHOLD = 32 << 20
# mallopt takes a C int.
_MAX_TRIM_THRESHOLD = (1 << 31) - 1

_lock = threading.Lock()  # guards _applied and _step_trim
_applied: tuple[int, int, int | None] | None = None
#: The trim threshold keep_room_for_step asked for: later settings do not go below it.
_step_trim = 0


def _mallopt():
    """glibc's ``mallopt(param, value)``, or None where the C library has none."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt


def keep_freed_buffers(mmap_threshold: int = DEFAULT_MMAP_THRESHOLD,
                       trim_threshold: int = DEFAULT_TRIM_THRESHOLD,
                       arena_max: int | None = DEFAULT_ARENA_MAX) -> bool:
    """Set glibc's malloc thresholds and arena cap for this whole process; False where that is not possible.

    Process-wide and idempotent; a trim threshold raised by
    :func:`keep_room_for_step` stays raised. ``arena_max=None`` leaves the number of
    arenas to glibc, as does ``MALLOC_ARENA_MAX`` set in the environment.
    Arenas made before the call stay. Not glibc (musl, macOS): nothing is
    changed and False is returned. Raises ValueError for values glibc
    would refuse.
    """
    global _applied
    if not 0 < mmap_threshold <= _MAX_MMAP_THRESHOLD:
        raise ValueError(f"mmap_threshold must be in (0, {_MAX_MMAP_THRESHOLD}] bytes, got {mmap_threshold}")
    if trim_threshold <= 0:
        raise ValueError(f"trim_threshold must be positive, got {trim_threshold}")
    if arena_max is not None and arena_max < 1:
        raise ValueError(f"arena_max must be at least 1 (or None: glibc's own), got {arena_max}")
    if os.environ.get("MALLOC_ARENA_MAX"):
        arena_max = None  # the operator's choice, already applied by glibc
    with _lock:
        trim_threshold = max(trim_threshold, _step_trim)
        if _applied == (mmap_threshold, trim_threshold, arena_max):
            return True
        if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
            return False
        mallopt = _mallopt()
        if mallopt is None:
            return False
        # mallopt answers 1 on success, 0 on error.
        if not (mallopt(_M_MMAP_THRESHOLD, mmap_threshold) and mallopt(_M_TRIM_THRESHOLD, trim_threshold)
                and (arena_max is None or mallopt(_M_ARENA_MAX, arena_max))):
            return False
        _applied = (mmap_threshold, trim_threshold, arena_max)
    event(log, logging.DEBUG, "malloc thresholds set", mmap_threshold=mmap_threshold,
          trim_threshold=trim_threshold, arena_max=arena_max)
    return True


def keep_room_for_step(step_bytes: int) -> bool:
    """Keep free heap space for a training step that allocates ``step_bytes``; False where nothing changed.

    A step allocates its gradients (and, pulled without ``out=``, its
    values), pushes them and frees them all at once. Once that exceeds
    the trim threshold, glibc hands the freed heap top back to the kernel
    at the end of every step, and the next step faults it in again page by
    page: with ``client.step()`` on the 10.5 M-parameter MLP (84 MB a
    step), about 4,300 page faults a step, in the kernel's zeroing of the
    matmul outputs. So the threshold follows the largest step seen:
    twice ``step_bytes`` (values and gradients) above the default, up to
    glibc's limit. Only raises it, and only in a process where
    :func:`keep_freed_buffers` applied its settings.
    """
    global _applied, _step_trim
    wanted = min(DEFAULT_TRIM_THRESHOLD + 2 * max(step_bytes, 0), _MAX_TRIM_THRESHOLD)
    applied = _applied
    if applied is None or wanted <= applied[1]:
        return False  # the common case, without the lock
    with _lock:
        if _applied is None or wanted <= _applied[1]:
            return False
        mallopt = _mallopt()
        if mallopt is None or not mallopt(_M_TRIM_THRESHOLD, wanted):
            return False
        _applied = (_applied[0], wanted, _applied[2])
        _step_trim = wanted
    event(log, logging.DEBUG, "malloc trim threshold raised for a step", step_bytes=step_bytes,
          trim_threshold=wanted)
    return True
