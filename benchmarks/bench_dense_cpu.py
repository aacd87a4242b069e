"""The dense section's CPU per GB by direction and process: 1 worker, 2 servers, ours beside gRPC Python alone.

The worker (this process) pulls the 100 MB model into the same arrays, or
pushes its gradients, ``REPEATS`` times in a round; the same bytes then go
through gRPC Python alone (two bare stream servers, raw 1 MiB messages, one
thread per server in this process). Rounds alternate ours and bare,
``ROUNDS`` of each, so the machine's drift weighs on both alike; a figure
is the median over the rounds. CPU is each process's own (user + system
from /proc and getrusage), so the split between the worker and the
servers shows where a difference lies. Target: ours ≤ 1.15x gRPC alone,
for pull and for push.

A third party in each round is gRPC alone plus the least work a parameter
server adds to those bytes: the pull copies each message into the caller's
arrays (``pull(out=)``'s copy), the push's servers apply each message to
float32 values of their own with NumPy's SGD, the calls ps-server's SGD
kernel makes. Its ratio to gRPC alone is the floor of ours with NumPy's
apply; what is above it is our framing, checks, ledger and thread hand-offs.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable
from functools import partial

import numpy as np
from common import bare_pull, bare_push, bare_stream_servers, median, on_each

REPEATS, ROUNDS = 6, 7
TARGET = 1.15


def _process_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _round(fn: Callable[[], object], server_pids: list[int], nbytes: int) -> tuple[float, float]:
    """(worker, servers) core-seconds per GB over REPEATS calls of ``fn``, each moving ``nbytes``."""
    servers = [_process_seconds(pid) for pid in server_pids]
    own = _own_seconds()
    for _ in range(REPEATS):
        fn()
    gb = nbytes * REPEATS / 1e9
    return ((_own_seconds() - own) / gb,
            sum(_process_seconds(pid) - before for pid, before in zip(server_pids, servers, strict=True)) / gb)


def measure(pull: Callable[[], object], push: Callable[[], object], server_pids: list[int], nbytes: int) -> dict:
    """{direction: {"ours"|"bare"|"floor": {"worker", "servers", "total"}}}: median core-s per GB of the rounds.

    ``pull`` / ``push`` move ``nbytes`` through ps-servers ``server_pids`` (2 of them); the bare
    servers are started here and stopped before returning.
    """
    half = nbytes // 2
    push_half = bare_push(memoryview(b"\x01" * half))  # written pages, as gradients are
    into = [np.ones(half // 4, np.float32) for _ in range(2)]  # written pages, as out= arrays are

    def copying_pull(channel, index: int) -> None:
        out, start = into[index], 0
        for message in channel.unary_stream("/bench.Raw/Pull")(b""):
            values = np.frombuffer(message, np.float32)
            out[start:start + values.size] = values
            start += values.size

    with bare_stream_servers(half, ([], [], ["sgd"], ["sgd"])) as (channels, bare):
        plain, applying = channels[:2], channels[2:]
        plain_pids, applying_pids = [s.pid for s in bare[:2]], [s.pid for s in bare[2:]]
        calls = {("pull", "ours"): (pull, server_pids),
                 ("pull", "bare"): (partial(on_each, bare_pull, plain), plain_pids),
                 ("pull", "floor"): (partial(on_each, copying_pull, plain), plain_pids),
                 ("push", "ours"): (push, server_pids),
                 ("push", "bare"): (partial(on_each, push_half, plain), plain_pids),
                 ("push", "floor"): (partial(on_each, push_half, applying), applying_pids)}
        for fn, _ in calls.values():  # warm: connections open, loops loaded
            fn()
        rounds: dict[tuple[str, str], list[tuple[float, float]]] = {key: [] for key in calls}
        for _ in range(ROUNDS):
            for key, (fn, pids) in calls.items():
                rounds[key].append(_round(fn, pids, nbytes))
    figures: dict = {}
    for (direction, who), samples in rounds.items():
        figures.setdefault(direction, {})[who] = {
            "worker": median([w for w, _ in samples]), "servers": median([s for _, s in samples]),
            "total": median([w + s for w, s in samples])}
    return figures


def rows(figures: dict, make_row: Callable) -> list:
    """Per direction: ours (target ≤ TARGET x gRPC alone) and the floor, each with the per-process split."""
    least = {"pull": "copy into out=", "push": "NumPy's SGD"}
    out = []
    for direction in ("pull", "push"):
        ours, bare, floor = (figures[direction][who] for who in ("ours", "bare", "floor"))
        out.append(make_row(
            "dense", f"  CPU per GB, 1 worker x 2 servers, {direction}: worker {ours['worker']:.3f} "
                     f"(alone {bare['worker']:.3f}), servers {ours['servers']:.3f} (alone {bare['servers']:.3f})",
            ours["total"], "core-s", bare["total"], "gRPC alone", TARGET, higher=False))
        out.append(make_row(
            "dense", f"    floor: gRPC alone + {least[direction]}: worker {floor['worker']:.3f}, "
                     f"servers {floor['servers']:.3f}",
            floor["total"], "core-s", bare["total"], "gRPC alone", target_text="reference"))
    return out
