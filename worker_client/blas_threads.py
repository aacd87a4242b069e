"""A warning, once per process, when numpy's BLAS runs more threads than this worker has cores.

OpenBLAS starts one thread per core it sees and its idle threads spin for a
while after each call. A worker that shares its cores with servers or other
workers then loses most of its speed to them: two workers of a 100 K-parameter
model on 2 cores ran 98 steps/s with OpenBLAS's default against 869 with one
thread (docs/benchmarks.md, "Training loops"). ``ps-local`` gives the
processes it starts one BLAS thread; a script run otherwise gets the default,
so the client says which setting to change where the pool cannot fit.
"""

from __future__ import annotations

import logging
import os
import threading

from wehub_ps.process.logs import event

__all__ = ["BLAS_THREAD_SETTINGS", "available_cores", "warn_if_blas_oversubscribed"]

log = logging.getLogger("worker_client.blas_threads")

#: The environment variables each BLAS reads for its pool size, by threadpoolctl's internal_api name.
BLAS_THREAD_SETTINGS = {"openblas": "OPENBLAS_NUM_THREADS", "mkl": "MKL_NUM_THREADS", "blis": "BLIS_NUM_THREADS"}

_lock = threading.Lock()
_checked = False


def available_cores() -> float:
    """The cores this process can run on: its CPU affinity, and its cgroup's CPU quota where one is set."""
    cores: float = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/sys/fs/cgroup/cpu.max") as file:  # cgroup v2: "<quota> <period>" or "max <period>"
            quota, period = file.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(int(quota) / int(period), 1.0))
    except (OSError, ValueError):
        pass
    return cores


def warn_if_blas_oversubscribed() -> None:
    """Log one warning per process for each BLAS whose pool has more threads than ``available_cores``,
    naming the variable that sets it. Silent where threadpoolctl or numpy's BLAS cannot be inspected."""
    global _checked
    with _lock:
        if _checked:
            return
        _checked = True
    try:
        import numpy  # noqa: F401 - its BLAS must be loaded to be seen
        import threadpoolctl
        pools = threadpoolctl.threadpool_info()
    except Exception:  # noqa: BLE001 - an inspection that fails must not stop a worker
        return
    cores = available_cores()
    for pool in pools:
        setting = BLAS_THREAD_SETTINGS.get(pool.get("internal_api", ""))
        threads = int(pool.get("num_threads") or 0)
        if setting is None or threads <= cores:
            continue
        event(log, logging.WARNING, f"numpy's BLAS runs more threads than this worker has cores; set "
              f"{setting}=1 (or threadpoolctl.threadpool_limits(1)) unless its compute needs them: idle "
              "BLAS threads spin on the cores that pulls and pushes need", blas=pool["internal_api"],
              threads=threads, cores=round(cores, 2), setting=setting)
