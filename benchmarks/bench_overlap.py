"""Steps per second of a training loop: blocking steps against overlapped ones.

The model is the MLP of issue 21: ten 1024x1024 layers with biases (20
variables, 10.5 M parameters, 42 MB of float32), gradients computed with
numpy on a batch of 16, on 2 ps-servers and 1 worker. Measured in one run:

* compute: the same forward and backward pass with no parameter server;
* communication: ``pull(out=)`` plus ``push`` of the same variables;
* ``step()``: the blocking loop, as README teaches it;
* ``step(overlap=True)``: the push of step k in the background while step k+1 pulls and computes;
* ``step(overlap=True, pull_ahead=True)``: the pull for step k+1 too, while step k computes.

    python benchmarks/bench_overlap.py [--steps 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MachineCPU, ps_cluster  # noqa: E402

from worker_client import SGD, PSClient  # noqa: E402

LAYERS = 10
WIDTH = 1024
BATCH = 16
NAMES = [f"{kind}{i}" for i in range(LAYERS) for kind in ("w", "b")]


def initial_values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    values = {}
    for i in range(LAYERS):
        values[f"w{i}"] = (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
        values[f"b{i}"] = np.zeros(WIDTH, dtype=np.float32)
    return values


def gradients(params: dict[str, np.ndarray], x: np.ndarray, target: np.ndarray) -> dict[str, np.ndarray]:
    """Forward and backward of the MLP (ReLU, squared error) in numpy."""
    activations = [x]
    for i in range(LAYERS):
        z = activations[-1] @ params[f"w{i}"] + params[f"b{i}"]
        activations.append(np.maximum(z, 0) if i < LAYERS - 1 else z)
    delta = (activations[-1] - target) / BATCH
    grads = {}
    for i in reversed(range(LAYERS)):
        grads[f"w{i}"] = activations[i].T @ delta
        grads[f"b{i}"] = delta.sum(axis=0)
        if i:
            delta = (delta @ params[f"w{i}"].T) * (activations[i] > 0)
    return grads


def rate(loop: Callable[[], None], steps: int, warmup: int = 3) -> tuple[float, float]:
    """Steps per second of ``loop`` (one step per call) and the machine's busy cores meanwhile."""
    for _ in range(warmup):
        loop()
    cpu = MachineCPU()
    cpu.start()
    start = time.perf_counter()
    for _ in range(steps):
        loop()
    seconds = time.perf_counter() - start
    cpu.stop()
    return steps / seconds, cpu.busy / cpu.wall if cpu.wall else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    target = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    local = initial_values()
    results: dict[str, float] = {}
    results["compute"], results["compute_cores"] = rate(lambda: gradients(local, x, target), args.steps)

    with ps_cluster(2) as (addresses, _), PSClient(addresses, worker_id="bench") as client:
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

        results["communicate"], results["communicate_cores"] = rate(communicate, args.steps)
        results["plain"], results["plain_cores"] = rate(plain, args.steps)
        results["overlap"], results["overlap_cores"] = rate(overlapped(False), args.steps)
        client.flush()
        results["pull_ahead"], results["pull_ahead_cores"] = rate(overlapped(True), args.steps)
        client.flush()

    compute_s, comm_s = 1 / results["compute"], 1 / results["communicate"]
    bound_plain = 1 / (compute_s + comm_s)
    bound_overlap = 1 / max(compute_s, comm_s)
    print(f"model: {LAYERS} x {WIDTH}x{WIDTH} + biases, {len(NAMES)} variables, "
          f"{sum(v.nbytes for v in local.values()) / 1e6:.0f} MB; batch {BATCH}; 1 worker, 2 servers; "
          f"{os.cpu_count()} cores")
    print(f"{'loop':<34}{'steps/s':>9}{'ms/step':>9}{'busy cores':>12}")
    for key, label in (("compute", "compute only (no parameter server)"),
                       ("communicate", "pull(out=) + push, no compute"),
                       ("plain", "step()"), ("overlap", "step(overlap=True)"),
                       ("pull_ahead", "step(overlap=True, pull_ahead=True)")):
        print(f"{label:<34}{results[key]:>9.2f}{1000 / results[key]:>9.1f}{results[key + '_cores']:>12.2f}")
    print(f"step() vs 1/(compute + communication) = {bound_plain:.2f}/s: "
          f"{results['plain'] / bound_plain:.2f}x")
    for key in ("overlap", "pull_ahead"):
        print(f"{key} vs 1/max(compute, communication) = {bound_overlap:.2f}/s: "
              f"{results[key] / bound_overlap:.2f}x; vs step(): {results[key] / results['plain']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
