"""Steps per second of a training loop: blocking steps against overlapped ones.

The model is the training section's 10.5 M-parameter MLP
(training_models.MLP_10M: ten 1024x1024 layers and a 1024x16 output, with
biases, 22 variables, 42 MB of float32), gradients computed with numpy on a
batch of 16, on 2 ps-servers and 1 worker. Measured in one run:

* compute: the same forward and backward pass with no parameter server;
* communication: ``pull(out=)`` plus ``push`` of the same variables;
* ``step()``: the blocking loop, as README teaches it;
* ``step(overlap=True)``: the push of step k in the background while step k+1 pulls and computes;
* ``step(overlap=True, pull_ahead=True)``: the pull for step k+1 too, while step k computes.

    python benchmarks/bench_overlap.py [--steps 8] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MachineCPU, ps_cluster  # noqa: E402
from training_models import MLP_10M, Params, mlp_gradients  # noqa: E402

from worker_client import SGD, PSClient  # noqa: E402

SHAPE = MLP_10M
NAMES = SHAPE.names


def initial_values() -> Params:
    rng = np.random.default_rng(0)
    return {name: (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32) if len(shape) == 2
            else np.zeros(shape, np.float32) for name, shape in SHAPE.shapes().items()}


def gradients(params: Params, x: np.ndarray, target: np.ndarray) -> Params:
    return mlp_gradients(SHAPE, params, x, target)


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds used so far by this process (all threads) and the processes ``pids`` (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = time.process_time()
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def rates(loops: dict[str, Callable[[], None]], after: dict[str, Callable[[], None]], steps: int,
          rounds: int, pids: list[int]) -> dict[str, float]:
    """Per loop, steps per second (median over ``rounds``), the machine's busy cores (``{key}_cores``)
    and the CPU seconds a step costs this worker and the servers ``pids`` (``{key}_cpu``).

    The loops take turns, ``steps`` steps each per round, so that a machine
    shared with other work slows them alike; ``after[key]`` ends a turn
    (waits for a push in flight) and counts in it.
    """
    per_round: dict[str, list[float]] = {key: [] for key in loops}
    cores: dict[str, list[float]] = {key: [] for key in loops}
    cpu_per_step: dict[str, list[float]] = {key: [] for key in loops}
    for key, loop in loops.items():  # warm up: buffers, connections, compiled loops
        for _ in range(2):
            loop()
        after.get(key, lambda: None)()
    for _ in range(rounds):
        for key, loop in loops.items():
            cpu = MachineCPU()
            cpu.start()
            used = cpu_seconds(pids)
            start = time.perf_counter()
            for _ in range(steps):
                loop()
            after.get(key, lambda: None)()
            per_round[key].append(steps / (time.perf_counter() - start))
            cpu_per_step[key].append((cpu_seconds(pids) - used) / steps)
            cpu.stop()
            cores[key].append(cpu.busy / cpu.wall if cpu.wall else 0.0)
    results = {key: statistics.median(values) for key, values in per_round.items()}
    results.update({f"{key}_cores": statistics.median(values) for key, values in cores.items()})
    results.update({f"{key}_cpu": statistics.median(values) for key, values in cpu_per_step.items()})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=8, help="steps per loop per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((SHAPE.batch, SHAPE.widths[0])).astype(np.float32)
    target = rng.standard_normal((SHAPE.batch, SHAPE.widths[-1])).astype(np.float32)
    local = initial_values()

    with ps_cluster(2) as (addresses, servers), PSClient(addresses, worker_id="bench") as client:
        for name, value in local.items():
            client.create_variable(name, shape=value.shape, initializer=value,
                                   optimizer=SGD(learning_rate=1e-6))
        params = {name: np.empty_like(value) for name, value in local.items()}
        zeros = {name: np.zeros_like(value) for name, value in local.items()}

        def communicate() -> None:
            client.pull(NAMES, out=params)
            client.push(zeros)

        def plain() -> None:
            with client.step(NAMES) as step:
                step.push(gradients(step.params, x, target))

        def overlapped(pull_ahead: bool) -> Callable[[], None]:
            def loop() -> None:
                with client.step(NAMES, overlap=True, pull_ahead=pull_ahead) as step:
                    step.push(gradients(step.params, x, target))
            return loop

        results = rates({"compute": lambda: gradients(local, x, target), "communicate": communicate,
                         "plain": plain, "overlap": overlapped(False), "pull_ahead": overlapped(True)},
                        {"overlap": client.flush, "pull_ahead": client.flush}, args.steps, args.rounds,
                        [server.pid for server in servers])

    compute_s, comm_s = 1 / results["compute"], 1 / results["communicate"]
    bound_plain = 1 / (compute_s + comm_s)
    bound_overlap = 1 / max(compute_s, comm_s)
    print(f"model: {SHAPE.name}, widths {SHAPE.widths}, {len(NAMES)} variables, "
          f"{sum(v.nbytes for v in local.values()) / 1e6:.0f} MB; batch {SHAPE.batch}; 1 worker, 2 servers; "
          f"{os.cpu_count()} cores")
    print(f"{'loop':<38}{'steps/s':>9}{'ms/step':>9}{'machine busy':>14}{'CPU ms/step':>13}")
    for key, label in (("compute", "compute only (no parameter server)"),
                       ("communicate", "pull(out=) + push, no compute"),
                       ("plain", "step()"), ("overlap", "step(overlap=True)"),
                       ("pull_ahead", "step(overlap=True, pull_ahead=True)")):
        print(f"{label:<38}{results[key]:>9.2f}{1000 / results[key]:>9.1f}{results[key + '_cores']:>14.2f}"
              f"{1000 * results[key + '_cpu']:>13.1f}")
    print(f"step() vs 1/(compute + communication) = {bound_plain:.2f}/s: "
          f"{results['plain'] / bound_plain:.2f}x")
    cores = os.cpu_count() or 1
    cpu_bound = cores / (results["compute_cpu"] + results["communicate_cpu"])
    print(f"CPU allows at most {cores} cores / (compute + communication CPU per step) = {cpu_bound:.2f}/s "
          f"(worker and servers; {results['compute_cpu'] * 1000:.0f} + "
          f"{results['communicate_cpu'] * 1000:.0f} ms)")
    for key in ("overlap", "pull_ahead"):
        print(f"{key} vs 1/max(compute, communication) = {bound_overlap:.2f}/s: "
              f"{results[key] / bound_overlap:.2f}x; vs min(that, CPU bound): "
              f"{results[key] / min(bound_overlap, cpu_bound):.2f}x; "
              f"vs step(): {results[key] / results['plain']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
