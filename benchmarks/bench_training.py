"""The ``training`` section of run.py: steps per second of training loops, as users write them.

Three models on 2 servers (``training_models``): the 10.5 M-parameter MLP
(22 variables, 42 MB, batch 16), the 100 K-parameter MLP (6 variables) and
the recommender example (hash-table embeddings and an MLP). Each runs in 1
and then 2 worker processes at once; every worker runs, in turn and in step
with the others, each loop of its model for a fixed number of steps:

* compute only (no parameter server): what the loop's compute allows;
* communication only (the same pulls and pushes, zero gradients);
* the plain loop (README: ``pull(out=params)`` then ``push(grads)``) and,
  for the MLPs, ``with client.step()``.

The plain loop is judged against 1 / (compute + communication) of the same
run (target 0.8x), communication against raw TCP moving the same bytes; the
100K plain step also against two bare round trips plus what its variables
cost, and against bare gRPC servers moving its bytes the same way; and
what one small request costs (a pull and a push of 4 floats on 1 server)
against bare framed sockets making the same round trips. For
each loop the run also reports the CPU it took per step: the worker
processes', the servers' and the whole machine's (kernel included), which
says what the cores allow when they are all busy.

Also a worker process: ``bench_training.py --worker N --model M --addresses A``
reads ``LOOP STEPS WARMUP`` lines on stdin and answers each with one JSON
line of per-step seconds and its CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    MachineCPU,
    child_env,
    grpc_pull_push_seconds,
    grpc_stream_round_trip_seconds,
    median,
    ps_cluster,
    socket_pull_push_seconds,
    stop_process,
)
from training_models import MLP_10M, MLP_100K, MLPLoops, RecommenderLoops, torch_installed  # noqa: E402

#: (timed steps, warm-up steps) per loop and model: about a minute for the section on 2 busy cores.
STEPS = {"mlp10m": (10, 2), "mlp100k": (200, 20), "recommender": (100, 10)}
WORKER_COUNTS = (1, 2)
TITLES = {"mlp10m": "10.5M MLP (22 vars, batch 16)", "mlp100k": "100K MLP (6 vars, batch 16)",
          "recommender": "recommender (hash emb + MLP, batch 256)"}
LOOP_TITLES = {"plain": "plain loop: pull(out=) + push", "step": "client.step() loop",
               "recommender_plain": "example loop: step + pull_rows",
               "torch": "the same model in worker_client.torch (PSEmbedding, attach, step)"}


def _loops_for(model: str, seed: int):
    if model == "mlp10m":
        return MLPLoops(MLP_10M, seed)
    if model == "mlp100k":
        return MLPLoops(MLP_100K, seed)
    if model == "recommender":
        return RecommenderLoops(seed)
    raise ValueError(f"unknown model {model!r}; choose from {', '.join(STEPS)}")


def _setup(client, model: str) -> None:
    if model == "recommender":
        RecommenderLoops.setup(client)
    else:
        MLPLoops.setup(client, MLP_10M if model == "mlp10m" else MLP_100K)


def worker_main(argv: list[str]) -> int:
    """A worker process: build the model's loops, run each loop the parent names, one JSON line each.

    The worker's PSClient is made when a loop first needs it, after the
    compute-only loop: PSClient sets malloc's thresholds for the whole
    process, and compute alone is measured as in a process without one.
    """
    from worker_client import PSClient

    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--addresses", required=True)
    args = parser.parse_args(argv)
    model = _loops_for(args.model, args.worker)
    client = None
    loops = model.loops(None)
    print("ready", flush=True)
    try:
        for line in sys.stdin:
            loop, steps, warmup = line.split()
            if loop != "compute" and client is None:
                client = PSClient(args.addresses.split(","), worker_id=f"train-{args.worker}")
                client.variables(refresh=True)
                loops = model.loops(client)
            print(json.dumps(_run_loop(loops[loop], int(steps), int(warmup))), flush=True)
    finally:
        if client is not None:
            client.close()
    return 0


def _run_loop(fn: Callable[[], None], steps: int, warmup: int) -> dict:
    """Seconds of each of ``steps`` steps after ``warmup``; this process's CPU, page faults, context switches."""
    for _ in range(warmup):
        fn()
    seconds = []
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {"seconds": seconds, "cpu": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
            "minflt": after.ru_minflt - before.ru_minflt,
            "switches": after.ru_nvcsw + after.ru_nivcsw - before.ru_nvcsw - before.ru_nivcsw}


def _process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far, from /proc (Linux)."""
    import os

    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Workers:
    """Worker processes of one model, each told in turn to run a loop, all at once."""

    def __init__(self, addresses: list[str], model: str, count: int) -> None:
        self.procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(i), "--model", model,
                                        "--addresses", ",".join(addresses)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env())
                      for i in range(count)]
        for proc in self.procs:
            if proc.stdout.readline().strip() != "ready":
                self.close()
                raise RuntimeError(f"training benchmark worker for {model} did not start")

    def run(self, loop: str, steps: int, warmup: int, servers: list[int]) -> dict:
        """Per-worker step seconds, and CPU seconds per step: workers, servers, machine."""
        machine = MachineCPU()
        server_start = sum(_process_cpu_seconds(pid) for pid in servers)
        machine.start()
        for proc in self.procs:
            proc.stdin.write(f"{loop} {steps} {warmup}\n")
            proc.stdin.flush()
        answers = [json.loads(proc.stdout.readline()) for proc in self.procs]
        machine.stop()
        server_cpu = sum(_process_cpu_seconds(pid) for pid in servers) - server_start
        workers = len(self.procs)
        # Warm-up steps ran within the machine's and servers' window: count per step of all of them.
        all_steps = workers * (steps + warmup)
        return {"seconds": [a["seconds"] for a in answers],
                "rate": sum(len(a["seconds"]) / sum(a["seconds"]) for a in answers),
                "p50_ms": median([s for a in answers for s in a["seconds"]]) * 1e3,
                "worker_cpu_ms": sum(a["cpu"] for a in answers) / (workers * steps) * 1e3,
                "worker_page_faults": sum(a["minflt"] for a in answers) / (workers * steps),
                "worker_context_switches": sum(a["switches"] for a in answers) / (workers * steps),
                "server_cpu_ms": server_cpu / all_steps * 1e3,
                "machine_cpu_ms": machine.busy / all_steps * 1e3,
                "cores_busy": machine.cores_busy}

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdin:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                stop_process(proc)


def measure(model: str, steps: int, warmup: int, worker_counts=WORKER_COUNTS, lane: bool = True,
            loops: tuple[str, ...] | None = None) -> dict:
    """Every loop of ``model`` (or ``loops``) with each number of workers on 2 fresh servers.

    {workers: {loop: figures}}. ``lane``: the servers have TCP lanes (else small requests take the
    gRPC Exchange stream).
    """
    from worker_client import PSClient

    figures: dict = {}
    with ps_cluster(2, lane=lane) as (addresses, procs):
        with PSClient(addresses, worker_id="train-setup", register=False) as client:
            _setup(client, model)
        servers = [proc.pid for proc in procs]
        for count in worker_counts:
            workers = _Workers(addresses, model, count)
            try:
                run = loops or ("compute", "comm", "plain") + (
                    ("step",) if model != "recommender" else ("torch",) if torch_installed() else ())
                figures[count] = {loop: workers.run(loop, steps, warmup, servers) for loop in run}
            finally:
                workers.close()
    return figures


def request_cost(count: int) -> dict:
    """What one small request costs beyond its round trip: a pull(out=) and a push of one variable of
    4 floats on 1 server with a TCP lane, ``count`` of each, in this process.

    p50 of each call, and the CPU per request of this process and of the server (kernel included).
    """
    import numpy as np

    from worker_client import PSClient

    with ps_cluster(1) as (addresses, procs), PSClient(addresses, worker_id="train-request") as client:
        client.create_variable("tiny", (4,))
        out, grad = {"tiny": np.zeros(4, np.float32)}, {"tiny": np.ones(4, np.float32)}
        pulls, pushes = [], []
        for i in range(count + count // 10):
            if i == count // 10:  # warmed up
                pulls.clear()
                pushes.clear()
                before = resource.getrusage(resource.RUSAGE_SELF)
                server_start = _process_cpu_seconds(procs[0].pid)
            start = time.perf_counter()
            client.pull("tiny", out=out)
            pulled = time.perf_counter()
            client.push(grad)
            pushes.append(time.perf_counter() - pulled)
            pulls.append(pulled - start)
        after = resource.getrusage(resource.RUSAGE_SELF)
        server_cpu = _process_cpu_seconds(procs[0].pid) - server_start
    worker_cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"pull_p50_ms": median(pulls) * 1e3, "push_p50_ms": median(pushes) * 1e3,
            "worker_cpu_us": worker_cpu / (2 * count) * 1e6, "server_cpu_us": server_cpu / (2 * count) * 1e6}


def request_rows(cost: dict, bare_ms: float, make_row: Callable) -> list:
    """The rows of :func:`request_cost`, against bare framed sockets making the same two round trips."""
    return [make_row("training", f"  one small request: pull + push of 4 floats, 1 server, TCP lane (p50 "
                                 f"pull {cost['pull_p50_ms']:.2f}, push {cost['push_p50_ms']:.2f} ms)",
                     cost["pull_p50_ms"] + cost["push_p50_ms"], "ms", bare_ms,
                     "bare socket pull + push p50, same bytes", target_text="report", higher=False),
            make_row("training", f"    CPU per request: worker {cost['worker_cpu_us']:.0f} us, server "
                                 f"{cost['server_cpu_us']:.0f} us",
                     cost["worker_cpu_us"] + cost["server_cpu_us"], "us", bare_ms * 1e3 / 2,
                     "bare socket round trip", target_text="report", higher=False)]


def bytes_per_step(model: str) -> int:
    if model == "recommender":
        return RecommenderLoops.bytes_per_step()
    return MLPLoops.bytes_per_step(MLP_10M if model == "mlp10m" else MLP_100K)


def rows_for(model: str, count: int, loops: dict, tcp: float, rtt: float, per_variable: float,
             bare: dict[str, float], make_row: Callable) -> list:
    """The section's rows for one model and number of workers (rates summed over the workers)."""
    compute, comm = loops["compute"], loops["comm"]
    # Per worker: seconds per step of compute and of communication, each measured alone.
    compute_s, comm_s = count / compute["rate"], count / comm["rate"]
    serial = count / (compute_s + comm_s)
    nbytes = bytes_per_step(model)
    tcp_ms = nbytes / (tcp * 1e9) * 1e3
    head = f"{TITLES[model]}, {count}w"
    rows = [make_row("training", f"{head}: compute only (no PS)", compute["rate"], "step/s", compute["rate"],
                     "itself", target_text="baseline"),
            make_row("training", f"  comm only: pull + push ({nbytes / 1e6:.2f} MB), per step", comm_s * 1e3, "ms",
                     tcp_ms, "raw TCP, same bytes", target_text="report"),
            make_row("training", "  1 / (compute + comm)", serial, "step/s", compute["rate"], "compute only",
                     target_text="report")]
    if model == "mlp10m" and count == 1 and "dense_stream" in bare:
        # What gRPC Python alone takes for the same bytes laid out alike: the comm row's ceiling over gRPC.
        rows[2:2] = [make_row("training", "    gRPC Python alone, the same bytes (1 MiB streams, 2 servers)",
                              bare["dense_stream"] * 1e3, "ms", tcp_ms, "raw TCP, same bytes",
                              target_text="reference"),
                     make_row("training", "    comm only against gRPC Python alone", comm_s * 1e3, "ms",
                              bare["dense_stream"] * 1e3, "gRPC alone, same bytes", target_text="report")]
    for loop in ("plain", "step"):
        if loop not in loops:
            continue
        figures = loops[loop]
        title = LOOP_TITLES["recommender_plain" if model == "recommender" else loop]
        rows.append(make_row("training", f"  {title} (p50 {figures['p50_ms']:.1f} ms)", figures["rate"], "step/s",
                             serial, "1/(compute+comm)", 0.8 if loop == "plain" else None,
                             target_text=None if loop == "plain" else "report"))
        rows.append(make_row("training", f"    CPU per step: worker {figures['worker_cpu_ms']:.1f}, servers "
                                         f"{figures['server_cpu_ms']:.1f}; machine "
                                         f"({figures['cores_busy']:.2f} cores busy)",
                             figures["machine_cpu_ms"], "ms", count / figures["rate"] * 1e3, "wall ms per step",
                             target_text="report"))
    if "torch" in loops:
        figures = loops["torch"]
        rows.append(make_row("training", f"  {LOOP_TITLES['torch']} (p50 {figures['p50_ms']:.1f} ms)",
                             figures["rate"], "step/s", loops["plain"]["rate"], "the example's numpy loop",
                             target_text="report"))
        rows.append(make_row("training", f"    CPU per step: worker {figures['worker_cpu_ms']:.1f}, servers "
                                         f"{figures['server_cpu_ms']:.1f}; machine "
                                         f"({figures['cores_busy']:.2f} cores busy)",
                             figures["machine_cpu_ms"], "ms", count / figures["rate"] * 1e3, "wall ms per step",
                             target_text="report"))
    if model == "mlp100k" and count == 1:
        # The floor for a small model's step: two round trips and what each variable costs.
        variables = len(MLP_100K.names)
        floor = 2 * rtt + variables * per_variable
        rows.append(make_row("training", f"  plain loop p50 against 2 gRPC round trips + {variables} x "
                                         f"{per_variable * 1e6:.0f} us per variable",
                             loops["plain"]["p50_ms"], "ms", floor * 1e3, "that floor", 1, higher=False))
        rows.append(make_row("training", "  plain loop p50 against bare gRPC moving the same bytes alike",
                             loops["plain"]["p50_ms"], "ms", bare["grpc"] * 1e3,
                             "bare gRPC pull + push p50, 2 servers", target_text="report"))
        rows.append(make_row("training", "  plain loop p50 against bare sockets moving the same bytes alike",
                             loops["plain"]["p50_ms"], "ms", bare["socket"] * 1e3,
                             "bare socket pull + push p50, 2 servers", target_text="report"))
        if "plain_grpc" in loops:
            rows.append(make_row("training", "  plain loop p50 over gRPC Exchange streams (servers without "
                                             "--lane-port)", loops["plain_grpc"]["p50_ms"], "ms",
                                 loops["plain"]["p50_ms"], "over TCP lanes", target_text="report",
                                 higher=False))
    return rows


def section_training(tcp: float, rtt: float, per_variable: float, results: dict, make_row: Callable,
                     steps: dict[str, tuple[int, int]] | None = None, models=tuple(STEPS)) -> list:
    """The section: every model's loops with 1 and 2 workers; figures into ``results['training']``.

    ``per_variable``: seconds each variable adds to a step (run.per_variable_seconds).
    """
    steps = steps or STEPS
    rows = []
    results["training"] = {}
    # The 100K step's communication with nothing but gRPC, and with nothing but sockets: its bytes
    # from and to 2 bare servers at once.
    per_server = bytes_per_step("mlp100k") // 4
    bare = {"grpc": median(grpc_pull_push_seconds(2, per_server, 1000)),
            "socket": median(socket_pull_push_seconds(2, per_server, 1000))}
    if "mlp10m" in models:
        bare["dense_stream"] = median(grpc_stream_round_trip_seconds(bytes_per_step("mlp10m") // 4, 10))
        results["training"]["grpc_alone_mlp10m_comm_ms"] = bare["dense_stream"] * 1e3
    if "mlp100k" in models:
        results["training"]["request"] = cost = request_cost(2000)
        cost["bare_socket_ms"] = median(socket_pull_push_seconds(1, 16, 2000)) * 1e3
    for model in models:
        figures = measure(model, *steps[model])
        if model == "mlp100k" and 1 in figures:
            # The same plain loop where small requests take the gRPC Exchange stream: what the lane gains.
            figures[1]["plain_grpc"] = measure(model, *steps[model], worker_counts=(1,), lane=False,
                                               loops=("plain",))[1]["plain"]
        results["training"][model] = {str(count): {loop: {k: v for k, v in f.items() if k != "seconds"}
                                                   for loop, f in loops.items()}
                                      for count, loops in figures.items()}
        for count, loops in figures.items():
            rows += rows_for(model, count, loops, tcp, rtt, per_variable, bare, make_row)
            if model == "mlp100k" and count == 1:
                rows += request_rows(cost, cost["bare_socket_ms"], make_row)
    return rows


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
