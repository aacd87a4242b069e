"""The worker's BLAS thread check (worker_client/blas_threads.py) and ps-local's one-thread default.

The check runs in a child Python whose OpenBLAS pool is set by its environment and the machine's
cores when numpy loads it, and which is then pinned to one core (as a container's CPU limit leaves
a worker fewer cores than the node's, which OpenBLAS sizes its pool by); the child builds a PSClient (to an address where nothing listens) as a
user's script would, and the warning must appear once, naming the setting, or not at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_CHILD = r"""
import logging, os, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(name)s %(message)s")
import numpy as np
np.ones((64, 64)) @ np.ones((64, 64))  # OpenBLAS starts its pool for the cores it sees
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # then the worker gets one core
from worker_client import PSClient
for _ in range(2):
    try:
        PSClient("127.0.0.1:1", register=False, connect_timeout=0.2, retry_timeout=0.2)
    except Exception as error:
        print("connect failed:", type(error).__name__)
import threadpoolctl
print("pools", [(p["internal_api"], p["num_threads"]) for p in threadpoolctl.threadpool_info()])
"""


def _run_child(threads: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    if threads is not None:
        env["OPENBLAS_NUM_THREADS"] = threads
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120,
                          env=env, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _openblas_pool(output: str) -> int | None:
    pools = dict(json.loads(output.split("pools ", 1)[1].replace("'", '"').replace("(", "[").replace(")", "]")))
    return pools.get("openblas")


def test_a_pool_larger_than_the_cores_is_named_once():
    output = _run_child("4")
    if _openblas_pool(output) is None:
        pytest.skip("numpy here does not use OpenBLAS")
    if _openblas_pool(output) < 2:
        pytest.skip("one core here: OpenBLAS starts one thread, more than no core")
    warnings = [line for line in output.splitlines() if line.startswith("worker_client.blas_threads")]
    assert len(warnings) == 1, output
    assert "OPENBLAS_NUM_THREADS=1" in warnings[0]
    assert output.count("connect failed") == 2, output


def test_one_thread_is_not_warned_about():
    output = _run_child("1")
    if _openblas_pool(output) is None:
        pytest.skip("numpy here does not use OpenBLAS")
    assert _openblas_pool(output) == 1
    assert "worker_client.blas_threads" not in output, output


def test_ps_local_gives_its_processes_one_blas_thread_unless_told_otherwise(monkeypatch):
    from ps_local.processes import repo_python_env

    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    env = repo_python_env()
    assert (env["OPENBLAS_NUM_THREADS"], env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"]) == ("1", "1", "1")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    assert repo_python_env()["OPENBLAS_NUM_THREADS"] == "2"
