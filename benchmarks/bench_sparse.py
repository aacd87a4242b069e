"""The ``zipf`` section of run.py: embedding rows at the rate of their unique ids, whatever the repeats.

One table of 1,000,000 x 64 float32 rows over 2 servers, SGD, as a dense
variable and as a hash table. Every worker runs the same stream of batches
of 4,096 Zipf-distributed ids (exponent 1.2: about 1,350 unique ids per
batch, the top one repeated hundreds of times), one step per batch:
``pull_rows`` of the batch's ids, then ``push_rows`` of a gradient per id.

* as they come: the ids with their repeats, as a user passes them;
* merged: the same batches with repeats merged by the caller before the
  timing (unique ids, one summed gradient each): the bound for the first.

rows/s = ids of the batches (repeats counted) per second, summed over the
workers; each worker's figure is the median of its passes over the stream,
the two modes' passes alternating; warm (rows created, compiled loops loaded).
Target: as they come >= 0.85x merged, with 1 and 2 workers, both tables.

Also a worker process: ``bench_sparse.py --worker N --addresses A`` answers
each ``TABLE MODE PASSES`` line on stdin with one JSON line of pass seconds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import child_env, median, ps_cluster, stop_process  # noqa: E402

ROWS, DIM, BATCH, EXPONENT = 1_000_000, 64, 4096, 1.2
#: Batches per pass and passes per figure (the median is kept), plus one warm-up pass.
BATCHES, PASSES = 48, 9
TABLES = ("dense", "hash")
MODES = ("as_they_come", "merged")
WORKER_COUNTS = (1, 2)
TARGET = 0.85


def zipf_batches(count: int, seed: int = 7) -> list[np.ndarray]:
    """The id stream every worker runs: ``count`` batches of Zipf ids below ROWS."""
    rng = np.random.default_rng(seed)
    return [(rng.zipf(EXPONENT, BATCH) % ROWS).astype(np.int64) for _ in range(count)]


def _steps(client, table: str, mode: str) -> list[Callable[[], None]]:
    """One closure per batch: pull its rows and push a gradient per id (merged: per unique id)."""
    rng = np.random.default_rng(11)
    steps = []
    for ids in zipf_batches(BATCHES):
        grads = rng.standard_normal((len(ids), DIM)).astype(np.float32) * 1e-3
        if mode == "merged":
            ids, inverse = np.unique(ids, return_inverse=True)
            summed = np.zeros((len(ids), DIM), np.float32)
            np.add.at(summed, inverse, grads)
            grads = summed

        def step(ids: np.ndarray = ids, grads: np.ndarray = grads) -> None:
            client.pull_rows(table, ids)
            client.push_rows(table, ids, grads)
        steps.append(step)
    return steps


def worker_main(argv: list[str]) -> int:
    from wehub_ps.kernels import groups
    from wehub_ps.kernels.compiled import compiled
    from worker_client import PSClient

    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", type=int, required=True)
    parser.add_argument("--addresses", required=True)
    args = parser.parse_args(argv)
    # Warm figures: the grouping and summing loops are loaded before the timing (a worker loads them on
    # a thread at its first rows call, running the NumPy sort meanwhile).
    compiled(groups._group, groups._group_signatures)
    compiled(groups._sum_in_groups, groups._sum_in_groups_signatures)
    prepared: dict[tuple[str, str], list[Callable[[], None]]] = {}
    with PSClient(args.addresses.split(","), worker_id=f"sparse-{args.worker}") as client:
        client.variables(refresh=True)
        print("ready", flush=True)
        for line in sys.stdin:
            table, mode, passes = line.split()
            steps = prepared.get((table, mode))
            if steps is None:
                steps = prepared[table, mode] = _steps(client, table, mode)
                for step in steps:  # warm-up: the hash table's rows exist, the servers' loops are loaded
                    step()
            seconds = []
            for _ in range(int(passes)):
                start = time.perf_counter()
                for step in steps:
                    step()
                seconds.append(time.perf_counter() - start)
            print(json.dumps({"seconds": seconds}), flush=True)
    return 0


def measure(worker_counts=WORKER_COUNTS, passes: int = PASSES) -> dict:
    """{workers: {table: {mode: rows/s}}} on 2 fresh servers; modes alternate per table."""
    from worker_client import SGD, PSClient

    figures: dict = {}
    with ps_cluster(2) as (addresses, _):
        with PSClient(addresses, worker_id="sparse-setup", register=False) as client:
            client.create_variable("dense", (ROWS, DIM), initializer="zeros", optimizer=SGD(learning_rate=0.01))
            client.create_embedding("hash", DIM, initializer="zeros", optimizer=SGD(learning_rate=0.01))
        for count in worker_counts:
            workers = [subprocess.Popen([sys.executable, __file__, "--worker", str(i), "--addresses",
                                         ",".join(addresses)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, env=child_env()) for i in range(count)]
            try:
                for w in workers:
                    if w.stdout.readline().strip() != "ready":
                        raise RuntimeError("a sparse benchmark worker did not start")
                figures[count] = {}
                for table in TABLES:
                    # The modes alternate pass by pass: a machine's drift weighs on both alike.
                    seconds: dict[str, list[list[float]]] = {mode: [[] for _ in workers] for mode in MODES}
                    for _ in range(passes):
                        for mode in MODES:
                            for w in workers:
                                w.stdin.write(f"{table} {mode} 1\n")
                                w.stdin.flush()
                            for i, w in enumerate(workers):
                                seconds[mode][i] += json.loads(w.stdout.readline())["seconds"]
                    figures[count][table] = {mode: sum(BATCHES * BATCH / median(s) for s in per_worker)
                                             for mode, per_worker in seconds.items()}
            finally:
                for w in workers:
                    w.stdin.close()
                for w in workers:
                    try:
                        w.wait(60)
                    except subprocess.TimeoutExpired:
                        stop_process(w)
    return figures


def section_zipf(results: dict, make_row: Callable) -> list:
    figures = measure()
    results["zipf"] = {str(count): tables for count, tables in figures.items()}
    rows = []
    for count, tables in figures.items():
        for table, modes in tables.items():
            rows.append(make_row("zipf", f"{table} table, {count} worker{'s' if count > 1 else ''}: ids as they "
                                         f"come (rows/s)", modes["as_they_come"], "rows/s", modes["merged"],
                                 "repeats merged by the caller", TARGET))
    return rows


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
