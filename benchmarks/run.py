"""Every performance target of wehub-ps, each as a ratio to a baseline of the same run.

Run from the repository root (about a minute on 2 cores)::

    python benchmarks/run.py [--json results.json] [--plot docs/throughput.png] [--only dense,step]

Sections (``--only`` takes their names):

dense     100 MB model (4 x 6400x1024 float32): pull and push with 1 worker and
          1 or 2 servers, and 2 worker processes at once on 2 servers;
          baseline raw TCP between two processes. Pulls receive into the
          same arrays each time (pull(out=...), as a training loop does);
          one row reports a pull into new arrays. References: gRPC Python
          alone (raw 1 MiB messages, no serialisation) with 1 worker and 1
          server, and with 2 worker processes x 2 servers; CPU per GB of
          pull and of push by process, 1 worker x 2 servers, against gRPC
          alone and gRPC alone plus the copy into out= or NumPy's SGD in
          alternating rounds (bench_dense_cpu.py)
bf16      the same model with bfloat16 on the wire: float32 parameters moved per second
topk      the same model's push with top-k rows (1%) and error feedback: gradient
          parameters per second, and the time choosing the rows takes
apply     server-side optimizer apply of 100 MB (SGD, Adam) against numpy memcpy
step      pull + push of a 100K-parameter model in 20 variables over 2 servers,
          p50 and p99, against the bare gRPC bidi round trip
replication  one shard with 2 replicas (a primary and a backup that applies every
          update before the push is acknowledged; etcd and both on this machine)
          against 1, both running and measured alternately: the dense
          section's 100 MB push (median of 7) and the step section's pull +
          push of 100K parameters in 20 variables, p50 and p99; skipped
          without etcd
memory    server RSS during 4 concurrent 100 MB pushes; a client's peak RSS
sparse    pull_rows / push_rows of 4,096 ids x 64 dims from a 10M-row table on
          2 servers: rows/s and bytes/s (best of 100 warm calls; p50 beside it)
          against raw TCP. Reference: the same calls as a bare row exchange
          (raw ids out, raw rows back, one open stream per server)
zipf      batches of 4,096 Zipf ids (many repeats) on a 1M x 64 table, dense and
          hash, 1 and 2 workers: pull_rows + push_rows of the ids as they come
          against the same batches with repeats merged by the caller
          (bench_sparse.py)
modes     3 workers on 2 servers in ssp (staleness 2) and sync: time pulls waited per step
gpu       (skipped without CuPy and a CUDA GPU) the GPU path: the pull's upload from
          pinned buffers and the push's download into them, against a plain pinned
          copy of 100 MB; whole pull(device=) and push of CuPy gradients against
          the same calls on the host
training  training loops as users write them (a 10.5M and a 100K MLP, the
          recommender example), 1 and 2 worker processes on 2 servers: steps/s
          against 1 / (compute alone + pull and push alone) of the same run;
          the 10.5M pull and push alone also against gRPC Python alone moving
          the same bytes (bench_training.py)
tables    embedding tables at recommender scale (bench_tables.py): a delta checkpoint
          after 1% of a 1M x 64 table's rows changed against a full one; the table
          20x its memory budget against the same table in memory, Zipf batches
          through a server (one cycle of the row file, its compaction included)
          and in process; cold reads against random preads of the same file;
          memory growth against the budget and bookkeeping; the disk store
          (row file, LMDB, RocksDB)

Each figure is printed with its baseline, the ratio and the target; the exit
status does not depend on targets (the machines are shared and noisy).

Longer than 500 lines because it is the list of sections, one function of
30-60 lines each, beside the table they print; what they share (servers,
baselines, CPU accounting) is in common.py, the GPU path in bench_gpu.py,
replicated shards (etcd and the replicas) in bench_replication.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_dense_cpu  # noqa: E402
from common import (  # noqa: E402
    MachineCPU,
    Row,
    bare_rows_seconds,
    best,
    child_env,
    grpc_round_trips,
    grpc_stream_2x2_seconds,
    grpc_stream_seconds,
    median,
    memcpy_seconds,
    peak_rss_bytes,
    ps_cluster,
    rss_bytes,
    tcp_seconds,
    time_calls,
)
from common import make_row as _row  # noqa: E402

from wehub_ps.process.allocator import keep_freed_buffers  # noqa: E402 - importable once common put the repo on sys.path

ROWS, COLUMNS, NUM_VARIABLES = 6400, 1024, 4
MODEL_BYTES = ROWS * COLUMNS * 4 * NUM_VARIABLES
NAMES = [f"dense_{i}" for i in range(NUM_VARIABLES)]
# pull_rows / push_rows: timed calls after warm-up ones (see section_sparse).
SPARSE_CALLS, SPARSE_WARMUP = 100, 10


# ---- model helpers (also run in worker processes) ----


def create_model(client, lr: float = 1e-9) -> None:
    from worker_client import SGD

    for name in NAMES:
        client.create_variable(name, (ROWS, COLUMNS), initializer="zeros", optimizer=SGD(learning_rate=lr))


def gradients() -> dict[str, np.ndarray]:
    """Gradients in written pages, as a model's are (np.zeros maps the kernel's zero page until written)."""
    return {name: np.full((ROWS, COLUMNS), 1e-6, np.float32) for name in NAMES}


def worker_main(args: argparse.Namespace) -> int:
    """A benchmark worker process: waits for 'go' on stdin, runs its job, prints JSON."""
    from worker_client import PSClient

    with PSClient(args.addresses.split(","), worker_id=f"bench-{args.worker}") as client:
        client.variables(refresh=True)
        grads = gradients()
        if args.worker_job == "dense":
            dest = client.pull(NAMES)
            client.push(grads)
            print("ready", flush=True)
            sys.stdin.readline()
            pulls = time_calls(lambda: client.pull(NAMES, out=dest), args.repeats, warmup=0)
            pushes = time_calls(lambda: client.push(grads), args.repeats, warmup=0)
            print(json.dumps({"pull": pulls, "push": pushes}), flush=True)
        elif args.worker_job == "push":
            print("ready", flush=True)
            sys.stdin.readline()
            for _ in range(args.repeats):
                client.push(grads)
            print(json.dumps({}), flush=True)
        elif args.worker_job in ("client-memory", "client-memory-out"):
            # A training loop: gradients live across steps; pulls either allocate
            # each time or receive into the same arrays (pull(out=...)).
            for array in grads.values():
                array.fill(0)
            out = {name: np.empty((ROWS, COLUMNS), np.float32) for name in NAMES}
            for _ in range(args.repeats):
                if args.worker_job == "client-memory-out":
                    client.pull(NAMES, out=out)
                else:
                    client.pull(NAMES)
                client.push(grads)
            # VmHWM, not ru_maxrss: on Linux ru_maxrss survives exec, so a child
            # spawned by a big parent would report the parent's peak.
            print(json.dumps({"peak": peak_rss_bytes()}), flush=True)
    return 0


def _spawn_workers(addresses: list[str], job: str, count: int, repeats: int) -> list[subprocess.Popen]:
    workers = [subprocess.Popen([sys.executable, __file__, "--worker", str(i), "--worker-job", job,
                                 "--addresses", ",".join(addresses), "--repeats", str(repeats)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env())
               for i in range(count)]
    for w in workers:
        if w.stdout.readline().strip() != "ready":
            raise RuntimeError(f"benchmark worker did not start: {w.stderr}")
    return workers


def _go(workers: list[subprocess.Popen], timeout: float = 600,
        cpu: MachineCPU | None = None) -> list[dict]:
    """Start the workers' jobs together; their JSON results.

    ``cpu``, when given, measures the machine until they have all reported.
    """
    if cpu is not None:
        cpu.start()
    for w in workers:
        w.stdin.write("go\n")
        w.stdin.flush()
    results = [json.loads(w.stdout.readline()) for w in workers]
    if cpu is not None:
        cpu.stop()
    for w in workers:
        w.stdin.close()
        w.wait(timeout)
    return results


# ---- sections ----


def section_dense(repeats: int, tcp: float, results: dict) -> list[Row]:
    from worker_client import PSClient

    rows = []
    raw_pull, raw_push = grpc_stream_seconds(MODEL_BYTES, repeats)
    results["grpc_ceiling"] = {"pull": MODEL_BYTES / best(raw_pull) / 1e9, "push": MODEL_BYTES / best(raw_push) / 1e9}
    rows.append(_row("dense", "gRPC Python ceiling: raw 1 MiB stream, pull", results["grpc_ceiling"]["pull"], "GB/s",
                     tcp, "raw TCP", target_text="reference"))
    rows.append(_row("dense", "gRPC Python ceiling: raw 1 MiB stream, push", results["grpc_ceiling"]["push"], "GB/s",
                     tcp, "raw TCP", target_text="reference"))
    for servers in (1, 2):
        with ps_cluster(servers) as (addresses, procs), PSClient(addresses, worker_id="bench") as client:
            create_model(client)
            grads = gradients()
            dest = client.pull(NAMES)
            pull = best(time_calls(lambda: client.pull(NAMES, out=dest), repeats))
            push = best(time_calls(lambda: client.push(grads), repeats))
            results[f"dense_{servers}s_1w"] = {"pull": MODEL_BYTES / pull / 1e9, "push": MODEL_BYTES / push / 1e9}
            rows.append(_row("dense", f"pull(out=), 1 worker, {servers} server(s)", MODEL_BYTES / pull / 1e9, "GB/s",
                             tcp, "raw TCP", 0.45))
            if servers == 1:
                # Into new arrays each time: the kernel zeroes 100 MB of fresh pages per pull.
                fresh = best(time_calls(lambda: client.pull(NAMES), repeats))
                results["dense_1s_1w"]["pull_allocating"] = MODEL_BYTES / fresh / 1e9
                rows.append(_row("dense", "pull into new arrays, 1 worker, 1 server", MODEL_BYTES / fresh / 1e9,
                                 "GB/s", tcp, "raw TCP", target_text="report"))
            rows.append(_row("dense", f"push, 1 worker, {servers} server(s)", MODEL_BYTES / push / 1e9, "GB/s",
                             tcp, "raw TCP", 0.40))
            if servers == 2:
                figures = bench_dense_cpu.measure(lambda: client.pull(NAMES, out=dest), lambda: client.push(grads),
                                                  [p.pid for p in procs], MODEL_BYTES)
                results["cpu_2s_1w"] = figures
                rows += bench_dense_cpu.rows(figures, _row)
                workers = _spawn_workers(addresses, "dense", 2, repeats)
                started = time.perf_counter()
                ours_cpu = MachineCPU()
                out = _go(workers, cpu=ours_cpu)
                # Both workers pull, then push, at the same time: bytes of both over the slower one.
                pull2 = 2 * MODEL_BYTES / max(sum(r["pull"]) for r in out) * repeats / 1e9
                push2 = 2 * MODEL_BYTES / max(sum(r["push"]) for r in out) * repeats / 1e9
                results["dense_2s_2w"] = {"pull": pull2, "push": push2, "wall": time.perf_counter() - started}
                # The same traffic through gRPC Python alone (four processes, raw 1 MiB messages).
                bare_cpu = MachineCPU()
                bare_pull, bare_push = grpc_stream_2x2_seconds(MODEL_BYTES // 2, repeats, bare_cpu)
                results["grpc_ceiling_2s_2w"] = {"pull": 2 * MODEL_BYTES / bare_pull / 1e9,
                                                 "push": 2 * MODEL_BYTES / bare_push / 1e9}
                for what, ours in (("pull", pull2), ("push", push2)):
                    rows.append(_row("dense", f"gRPC Python ceiling, 2 workers x 2 servers, {what}",
                                     results["grpc_ceiling_2s_2w"][what], "GB/s", tcp, "raw TCP",
                                     target_text="reference"))
                    rows.append(_row("dense", f"{what}{'(out=)' if what == 'pull' else ''}, 2 workers together, "
                                              "2 servers", ours, "GB/s", tcp, "raw TCP", 0.6))
                rows += _cpu_bound_rows(ours_cpu, bare_cpu, 2 * 2 * MODEL_BYTES * repeats, tcp, results)
    return rows


def _cpu_bound_rows(ours: MachineCPU, bare: MachineCPU, moved: int, tcp: float, results: dict) -> list[Row]:
    """What the machine's cores allow the 2-worker figure: CPU per GB moved, all processes and the kernel.

    With every core busy, throughput is at most cores / (core-seconds per
    GB): a target above that needs less CPU per GB, not less waiting.
    """
    cores = os.cpu_count() or 1
    ours_per_gb, bare_per_gb = ours.busy / (moved / 1e9), bare.busy / (moved / 1e9)
    results["cpu_2s_2w"] = {"cores": cores, "ours_cores_busy": ours.cores_busy, "ours_core_s_per_gb": ours_per_gb,
                            "bare_cores_busy": bare.cores_busy, "bare_core_s_per_gb": bare_per_gb}
    return [
        _row("dense", f"  CPU per GB, 2 workers ({ours.cores_busy:.2f} of {cores} cores busy)", ours_per_gb,
             "core-s", bare_per_gb, f"gRPC alone, {bare.cores_busy:.2f} busy", target_text="report"),
        _row("dense", f"  at that cost {cores} cores move at most", cores / ours_per_gb, "GB/s", tcp, "raw TCP",
             target_text="report"),
        _row("dense", f"  at gRPC Python's own cost {cores} cores move at most", cores / bare_per_gb, "GB/s", tcp,
             "raw TCP", target_text="reference"),
    ]


def section_bf16(repeats: int, tcp: float, results: dict) -> list[Row]:
    from worker_client import PSClient

    with ps_cluster(1) as (addresses, _), PSClient(addresses, worker_id="bench", wire_dtype="bfloat16") as client:
        create_model(client)
        grads = gradients()
        dest = client.pull(NAMES)
        pull = best(time_calls(lambda: client.pull(NAMES, out=dest), repeats))
        push = best(time_calls(lambda: client.push(grads), repeats))
    results["bf16"] = {"pull": MODEL_BYTES / pull / 1e9, "push": MODEL_BYTES / push / 1e9}
    return [_row("bf16", "pull(out=), bfloat16 wire (float32 params/s)", MODEL_BYTES / pull / 1e9, "GB/s", tcp,
                 "raw TCP", 0.7),
            _row("bf16", "push, bfloat16 wire (float32 params/s)", MODEL_BYTES / push / 1e9, "GB/s", tcp,
                 "raw TCP", 0.7)]


def section_topk(repeats: int, tcp: float, results: dict, ratio: float = 0.01) -> list[Row]:
    """Push with top-k rows and error feedback: gradient parameters per second, and what selecting costs."""
    from worker_client import PSClient
    from worker_client.topk import TopKRows

    with ps_cluster(1) as (addresses, _), PSClient(addresses, worker_id="bench", topk_ratio=ratio) as client:
        create_model(client)
        grads = {name: np.random.default_rng(i).standard_normal((ROWS, COLUMNS), np.float32)
                 for i, name in enumerate(NAMES)}
        push = best(time_calls(lambda: client.push(grads), repeats))
    topk = TopKRows(ratio)

    def choose_and_settle() -> None:
        with topk.pushing():
            for name, g in grads.items():
                topk.settle(name, g, topk.choose(name, g)[0])

    select = best(time_calls(choose_and_settle, repeats))
    results["topk"] = {"ratio": ratio, "push": MODEL_BYTES / push / 1e9, "select_ms": select * 1e3,
                       "push_ms": push * 1e3}
    return [_row("topk", f"push, top {ratio:g} of rows + error feedback (gradient params/s)",
                 MODEL_BYTES / push / 1e9, "GB/s", tcp, "raw TCP", target_text="report"),
            _row("topk", "  of which choosing rows, keeping the rest (4 vars)", select * 1e3, "ms", push * 1e3,
                 "the whole push", target_text="report")]


def section_apply(repeats: int, memcpy: float, results: dict) -> list[Row]:
    from ps_server.core.parts import VariablePart
    from wehub_ps.specs import SGD, Adam, VariableSpec

    elements = 25_000_000  # 100 MB of float32
    chunk = np.full(1 << 18, 1e-3, np.float32)  # the gradient of one 1 MiB chunk, as pushes deliver it
    rows = []
    for optimizer, target in ((SGD(learning_rate=0.1), 0.5), (Adam(), 0.2)):
        part = VariablePart(VariableSpec("x", (elements,), "float32", optimizer=optimizer), 0, elements, True)
        part.allocate_and_fill()
        for slot in part.slots.values():
            slot.fill(1)  # fault the pages in, as a trained server has them

        def apply_all() -> None:
            for offset in range(0, elements, chunk.size):
                part.apply_gradient(offset, chunk[:min(chunk.size, elements - offset)], 1)

        seconds = best(time_calls(apply_all, repeats))
        name = type(optimizer).__name__
        results[f"apply_{name}"] = elements * 4 / seconds / 1e9
        rows.append(_row("apply", f"{name} apply of 100 MB float32", elements * 4 / seconds / 1e9, "GB/s",
                         memcpy, "numpy memcpy", target))
    return rows


def _step_seconds(variables: int, steps: int) -> list[float]:
    """Seconds per step of 100K float32 parameters in ``variables`` variables on 2 servers."""
    from worker_client import PSClient

    with ps_cluster(2) as (addresses, _), PSClient(addresses, worker_id="bench") as client:
        return _steps(client, variables, steps)


def _step_fn(client, variables: int) -> Callable[[], None]:
    """One ``client.step()`` (pull + push) of 100K float32 parameters in ``variables`` new variables."""
    from worker_client import SGD

    names = [f"v{i}" for i in range(variables)]
    size = 100_000 // variables
    for name in names:
        client.create_variable(name, (size,), optimizer=SGD(learning_rate=1e-9))
    grads = {name: np.zeros(size, np.float32) for name in names}

    def step() -> None:
        with client.step(names) as s:
            s.push(grads)

    return step


def _steps(client, variables: int, steps: int) -> list[float]:
    """Seconds per ``client.step()`` (pull + push) of 100K float32 parameters in ``variables`` variables."""
    return time_calls(_step_fn(client, variables), steps, warmup=steps // 10)


def per_variable_seconds(p50_20_vars: float | None = None) -> tuple[float, float]:
    """What each variable adds to a step: (seconds per variable, p50 of the 200-variable step).

    The step section's 100K parameters in 20 and then in 200 variables
    over 2 servers; ``p50_20_vars`` when the 20-variable p50 is known.
    """
    if p50_20_vars is None:
        p50_20_vars = float(np.percentile(_step_seconds(20, 300), 50))
    many = float(np.percentile(_step_seconds(200, 300), 50))
    return (many - p50_20_vars) / 180, many


def section_step(rtt_p50: float, results: dict) -> list[Row]:
    seconds = _step_seconds(20, 1000)
    p50, p99 = float(np.percentile(seconds, 50)), float(np.percentile(seconds, 99))
    per_variable, many = per_variable_seconds(p50)
    results["step"] = {"p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3, "rtt_p50_ms": rtt_p50 * 1e3,
                       "p50_200_vars_ms": many * 1e3, "per_variable_us": per_variable * 1e6}
    return [_row("step", "step p50 (100K params, 20 vars, 2 servers)", p50 * 1e3, "ms", rtt_p50 * 1e3,
                 "gRPC bidi round trip p50", 10, higher=False),
            _row("step", "step p99", p99 * 1e3, "ms", rtt_p50 * 1e3, "gRPC bidi round trip p50", 25,
                 higher=False),
            _row("step", f"  step p50, the same in 200 vars ({per_variable * 1e6:.0f} us per variable)",
                 many * 1e3, "ms", p50 * 1e3, "20 vars", target_text="report")]


def section_replication(repeats: int, results: dict) -> list[Row]:
    """One shard with R=2 replicas (etcd and both on this machine) against R=1, in the same run.

    Both shards run at once and the measurements alternate (a push on
    R=1, then one on R=2; then blocks of steps), so that whatever else
    the machine does in the meantime weighs on both alike. Each figure is
    the median of its kind.
    """
    import bench_replication

    from worker_client import PSClient

    etcd = bench_replication.etcd_binary()
    if etcd is None:
        print("  replication: skipped (no etcd: install it or set ETCD_BINARY)", file=sys.stderr, flush=True)
        return []
    pushes: dict[int, list[float]] = {1: [], 2: []}
    steps: dict[int, list[float]] = {1: [], 2: []}
    with ExitStack() as stack:
        clients = {}
        for replicas in (1, 2):
            address, _ = stack.enter_context(bench_replication.replicated_shard(replicas, etcd))
            clients[replicas] = client = stack.enter_context(PSClient([address], worker_id="bench"))
            create_model(client)
        grads = gradients()
        for client in clients.values():
            client.push(grads)  # warm-up
        for _ in range(max(repeats, 7)):
            for replicas, client in clients.items():
                pushes[replicas] += time_calls(lambda c=client: c.push(grads), 1, warmup=0)
        step_fns = {replicas: _step_fn(client, 20) for replicas, client in clients.items()}
        for block in range(11):  # the first block warms up
            for replicas, step in step_fns.items():
                seconds = time_calls(step, 100, warmup=0)
                if block:
                    steps[replicas] += seconds
    figures = {replicas: {"push": MODEL_BYTES / median(pushes[replicas]) / 1e9,
                          "p50_ms": float(np.percentile(steps[replicas], 50)) * 1e3,
                          "p99_ms": float(np.percentile(steps[replicas], 99)) * 1e3} for replicas in (1, 2)}
    one, two = figures[1], figures[2]
    results["replication"] = {"r1": one, "r2": two}
    return [_row("replication", "push 100 MB, 1 shard, R=2 (acked by the backup)", two["push"], "GB/s",
                 one["push"], "R=1, same run", 0.5),
            _row("replication", "step p50 (100K params, 20 vars, 1 shard), R=2", two["p50_ms"], "ms",
                 one["p50_ms"], "R=1 p50, same run", 2, higher=False),
            _row("replication", "step p99, R=2", two["p99_ms"], "ms", one["p99_ms"], "R=1 p99, same run",
                 target_text="report")]


def section_memory(results: dict) -> list[Row]:
    from worker_client import PSClient

    with ps_cluster(1) as (addresses, procs), PSClient(addresses, worker_id="bench") as client:
        create_model(client)
        server = procs[0].pid
        workers = _spawn_workers(addresses, "push", 4, 3)
        peak = rss_bytes(server)
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, rss_bytes(server))
                time.sleep(0.005)

        sampler = threading.Thread(target=sample, name="rss-sampler")
        sampler.start()
        _go(workers)
        done.set()
        sampler.join()
    budget = 1.25 * MODEL_BYTES + 150e6  # SGD: no optimizer slots
    client_budget = 2 * MODEL_BYTES + 150e6
    rows = [_row("memory", "server RSS, 4 concurrent 100 MB pushes", peak / 1e6, "MB", budget / 1e6,
                 "1.25 x (vars+slots) + 150 MB", 1.0, higher=False)]
    results["memory"] = {"server_peak_rss": peak, "server_budget": budget, "client_budget": client_budget}
    for job, label in (("client-memory-out", "client peak RSS, pull(out=) + push"),
                       ("client-memory", "client peak RSS, allocating pull + push")):
        with ps_cluster(1) as (addresses, _), PSClient(addresses, worker_id="bench") as client:
            create_model(client)
            proc = subprocess.run([sys.executable, __file__, "--worker", "0", "--worker-job", job,
                                   "--addresses", ",".join(addresses), "--repeats", "3"],
                                  capture_output=True, text=True, env=child_env(), timeout=600)
        client_peak = json.loads(proc.stdout.strip().splitlines()[-1])["peak"]
        results["memory"][job] = client_peak
        rows.append(_row("memory", label, client_peak / 1e6, "MB", client_budget / 1e6, "2 x model + 150 MB",
                         1.0, higher=False))
    return rows


def section_sparse(tcp: float, results: dict) -> list[Row]:
    """Warm calls, each on fresh random ids; the figure is the best call, as elsewhere, with the p50 beside it.

    A call moves 1 MiB in about 2 ms, so one descheduling of one of the three
    processes on two cores doubles it: best-of-3 (the other sections' rule,
    where one measurement averages over 100 messages) said more about the
    scheduler than about the code.
    """
    from worker_client import SGD, PSClient

    rows_total, dim, batch = 10_000_000, 64, 4096
    rng = np.random.default_rng(0)
    with ps_cluster(2) as (addresses, _), PSClient(addresses, worker_id="bench") as client:
        client.create_variable("table", (rows_total, dim), initializer="zeros", optimizer=SGD(learning_rate=1e-9))
        batches = [rng.choice(rows_total, batch, replace=False) for _ in range(SPARSE_CALLS + SPARSE_WARMUP)]
        grads = np.zeros((batch, dim), np.float32)
        meters = {kind: MachineCPU() for kind in ("pull", "push", "bare_pull", "bare_push")}
        it = iter(batches)
        pulls = time_calls(lambda: client.pull_rows("table", next(it)), SPARSE_CALLS, warmup=SPARSE_WARMUP,
                           cpu=meters["pull"])
        it = iter(batches)
        pushes = time_calls(lambda: client.push_rows("table", next(it), grads), SPARSE_CALLS, warmup=SPARSE_WARMUP,
                            cpu=meters["push"])
    # The same calls with nothing of ours: what gRPC Python and NumPy alone take (common.bare_rows_seconds).
    bare_pulls, bare_pushes = bare_rows_seconds(rows_total // 2, batches, grads, SPARSE_CALLS, SPARSE_WARMUP,
                                                cpu=(meters["bare_pull"], meters["bare_push"]))
    # Machine CPU per call (every process, the kernel's share included) and the cores busy meanwhile.
    cpu_ms = {kind: meter.busy / SPARSE_CALLS * 1e3 for kind, meter in meters.items()}
    nbytes = batch * dim * 4
    pull, push = best(pulls), best(pushes)
    results["sparse"] = {"pull_rows_per_s": batch / pull, "push_rows_per_s": batch / push,
                         "pull_gbps": nbytes / pull / 1e9, "push_gbps": nbytes / push / 1e9,
                         "pull_p50_ms": median(pulls) * 1e3, "push_p50_ms": median(pushes) * 1e3,
                         "bare_pull_gbps": nbytes / best(bare_pulls) / 1e9,
                         "bare_push_gbps": nbytes / best(bare_pushes) / 1e9,
                         "bare_pull_p50_ms": median(bare_pulls) * 1e3, "bare_push_p50_ms": median(bare_pushes) * 1e3,
                         "cpu_ms_per_call": cpu_ms,
                         "cores_busy": {kind: meter.cores_busy for kind, meter in meters.items()},
                         "calls": SPARSE_CALLS}
    rows = []
    for what, ours, bare in (("pull", pulls, bare_pulls), ("push", pushes, bare_pushes)):
        rows.append(_row("sparse", f"bare gRPC row exchange, {what} (p50 {median(bare) * 1e3:.2f} ms)",
                         nbytes / best(bare) / 1e9, "GB/s", tcp, "raw TCP", target_text="reference"))
        rows.append(_row("sparse", f"{what}_rows 4096x64 ({batch / best(ours):,.0f} rows/s; "
                                   f"p50 {median(ours) * 1e3:.2f} ms)", nbytes / best(ours) / 1e9, "GB/s", tcp,
                         "raw TCP", 0.25))
        rows.append(_row("sparse", f"  {what}: machine CPU per call ({meters[what].cores_busy:.2f} cores busy)",
                         cpu_ms[what], "ms", cpu_ms[f"bare_{what}"],
                         f"bare, {meters[f'bare_{what}'].cores_busy:.2f} busy", target_text="report"))
    return rows


def section_modes(results: dict) -> list[Row]:
    """3 worker threads on 2 servers, random compute time per step; pulls' waiting time per step."""
    from worker_client import SGD, PSClient

    rows = []
    for mode, flags in (("ssp", ("--consistency", "ssp", "--staleness", "2")), ("sync", ("--consistency", "sync"))):
        with ps_cluster(2, *flags, "--expected-workers", "3") as (addresses, _):
            with PSClient(addresses, worker_id="setup", register=False) as setup:
                for i in range(4):
                    setup.create_variable(f"m{i}", (20_000,), optimizer=SGD(learning_rate=1e-3))

            steps = 40

            def worker(index: int) -> None:
                rng = np.random.default_rng(index)
                with PSClient(addresses, worker_id=f"w{index}") as client:
                    for _ in range(steps):
                        with client.step([f"m{i}" for i in range(4)]) as s:
                            time.sleep(rng.uniform(0, 0.004) + (0.002 if index == 2 else 0))  # "compute"
                            s.push({f"m{i}": np.zeros(20_000, np.float32) for i in range(4)})

            threads = [threading.Thread(target=worker, args=(i,), name=f"mode-worker-{i}") for i in range(3)]
            started = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - started
            with PSClient(addresses, worker_id="observer", register=False) as observer:
                stats = [info.consistency for info in observer.describe()]
        blocked = sum(c["blocked_seconds"] for c in stats) / len(stats)  # per shard, averaged
        per_step = blocked / (3 * steps)
        results[f"modes_{mode}"] = {"blocked_seconds_per_worker_step": per_step, "wall": wall,
                                    "pulls_blocked": [c["pulls_blocked"] for c in stats],
                                    "max_staleness_admitted": [c["max_staleness_admitted"] for c in stats]}
        rows.append(_row("modes", f"{mode}: time a pull waited per worker step", per_step * 1e3, "ms",
                         wall / steps * 1e3, "wall time per step", None, target_text="report"))
    return rows


def section_gpu(repeats: int, results: dict) -> list[Row]:
    """The GPU path's device stage and whole calls, against a plain pinned copy; skipped with no GPU."""
    from worker_client import PSClient
    from worker_client.gpu import gpu_available

    if not gpu_available():
        print("  gpu: skipped (no CuPy or no CUDA device)", file=sys.stderr, flush=True)
        return []
    import bench_gpu

    copies = max(repeats, 10)
    shapes = {name: (ROWS, COLUMNS) for name in NAMES}
    gb = MODEL_BYTES / 1e9
    pinned_up, pinned_down = (gb / best(s) for s in bench_gpu.plain_copy_seconds(MODEL_BYTES, copies, True))
    pageable_up, pageable_down = (gb / best(s) for s in bench_gpu.plain_copy_seconds(MODEL_BYTES, copies, False))
    upload, download = (gb / best(s) for s in bench_gpu.transfer_stage_seconds(shapes, copies))
    with ps_cluster(1) as (addresses, _), PSClient(addresses, worker_id="bench-gpu") as client:
        create_model(client)
        seconds = bench_gpu.client_seconds(client, NAMES, shapes, repeats)
    calls = {what: gb / best(s) for what, s in seconds.items()}
    results["gpu"] = {"device": bench_gpu.device_name(), "pinned_h2d": pinned_up, "pinned_d2h": pinned_down,
                      "pageable_h2d": pageable_up, "pageable_d2h": pageable_down, "pull_upload": upload,
                      "push_download": download, **calls}
    pinned = "plain pinned copy"
    return [
        _row("gpu", "plain pinned copy, host to GPU", pinned_up, "GB/s", pinned_up, pinned,
             target_text="baseline"),
        _row("gpu", "plain pinned copy, GPU to host", pinned_down, "GB/s", pinned_down, pinned,
             target_text="baseline"),
        _row("gpu", "pageable copy (cupy.asarray), host to GPU", pageable_up, "GB/s", pinned_up, pinned,
             target_text="reference"),
        _row("gpu", "pageable copy (cupy.asnumpy), GPU to host", pageable_down, "GB/s", pinned_down, pinned,
             target_text="reference"),
        _row("gpu", "pull path: pinned buffers to GPU (4 vars)", upload, "GB/s", pinned_up, pinned,
             target_text="report"),
        _row("gpu", "push path: GPU gradients to pinned buffers", download, "GB/s", pinned_down, pinned,
             target_text="report"),
        _row("gpu", "pull(device='cuda:0'), 1 worker, 1 server", calls["pull_gpu"], "GB/s",
             calls["pull_host"], "pull(out=) to host", target_text="report"),
        _row("gpu", "push of CuPy gradients, 1 worker, 1 server", calls["push_gpu"], "GB/s",
             calls["push_host"], "push from host", target_text="report"),
    ]


def print_table(rows: list[Row]) -> None:
    header = f"{'section':<7} {'figure':<46} {'value':>10} {'unit':<5} {'baseline':>10} {'ratio':>7} {'target':>9}  result"
    print(header)
    print("-" * len(header))
    for r in rows:
        verdict = "" if r.passed is None else ("PASS" if r.passed else "FAIL")
        print(f"{r.section:<7} {r.figure:<46} {r.value:>10.3f} {r.unit:<5} {r.baseline:>10.3f} {r.ratio:>7.2f} "
              f"{r.target:>9}  {verdict}   ({r.baseline_name})")


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, pulls, pushes = [], [], []
    for key, label in (("dense_1s_1w", "1 worker\n1 server"), ("dense_2s_1w", "1 worker\n2 servers"),
                       ("dense_2s_2w", "2 workers\n2 servers"), ("bf16", "1 worker, 1 server\nbfloat16 wire")):
        if key in results:
            labels.append(label)
            pulls.append(results[key]["pull"])
            pushes.append(results[key]["push"])
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(x - 0.2, pulls, 0.4, label="pull")
    ax.bar(x + 0.2, pushes, 0.4, label="push")
    ax.axhline(results["tcp_gbps"], color="k", linestyle="--", label="raw TCP (one stream)")
    ax.set_xticks(x, labels)
    ax.set_ylabel("GB/s of float32 parameters")
    ax.set_title("wehub-ps throughput, 100 MB model, 2-core machine")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


SECTIONS = ("dense", "bf16", "topk", "apply", "step", "replication", "memory", "sparse", "zipf", "modes", "gpu",
            "training", "tables")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--plot", help="write a PNG of throughput against workers and servers here")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker-job", help=argparse.SUPPRESS)
    parser.add_argument("--addresses", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker_main(args)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    # As every ps-server and PSClient does (wehub_ps.process.allocator): the gRPC
    # references measured in this process then run under the same malloc.
    keep_freed_buffers()
    results: dict = {}
    tcp = MODEL_BYTES / best(tcp_seconds(MODEL_BYTES, args.repeats)) / 1e9
    memcpy = MODEL_BYTES / best(memcpy_seconds(MODEL_BYTES, args.repeats)) / 1e9
    rtt = median(grpc_round_trips(2000))
    results.update(tcp_gbps=tcp, memcpy_gbps=memcpy, grpc_rtt_p50_ms=rtt * 1e3)
    print(f"baselines: raw TCP {tcp:.3f} GB/s, memcpy {memcpy:.3f} GB/s, gRPC bidi round trip p50 {rtt * 1e3:.3f} ms",
          flush=True)
    rows: list[Row] = []
    for section in only:
        started = time.perf_counter()
        if section == "dense":
            rows += section_dense(args.repeats, tcp, results)
        elif section == "bf16":
            rows += section_bf16(args.repeats, tcp, results)
        elif section == "topk":
            rows += section_topk(args.repeats, tcp, results)
        elif section == "apply":
            rows += section_apply(args.repeats, memcpy, results)
        elif section == "step":
            rows += section_step(rtt, results)
        elif section == "replication":
            rows += section_replication(args.repeats, results)
        elif section == "memory":
            rows += section_memory(results)
        elif section == "sparse":
            rows += section_sparse(tcp, results)
        elif section == "zipf":
            import bench_sparse

            rows += bench_sparse.section_zipf(results, _row)
        elif section == "modes":
            rows += section_modes(results)
        elif section == "gpu":
            rows += section_gpu(args.repeats, results)
        elif section == "training":
            import bench_training

            per_variable = (results["step"]["per_variable_us"] / 1e6 if "step" in results
                            else per_variable_seconds()[0])
            rows += bench_training.section_training(tcp, rtt, per_variable, results, _row)
        elif section == "tables":
            import bench_tables

            rows += bench_tables.section_tables(results, _row)
        print(f"  {section} measured in {time.perf_counter() - started:.0f}s", file=sys.stderr, flush=True)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "rows": [asdict(r) for r in rows]}, indent=1))
    if args.plot and "dense" in only:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
