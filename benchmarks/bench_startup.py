"""Start-up of a ps-server: from the process's start to serving, against Python's own start in the same run.

Run from the repository root (about two minutes on 2 cores; the replica rows need etcd)::

    python benchmarks/bench_startup.py [--repeats 5] [--json results.json] [--baseline-repo PATH]

Figures (the median of ``--repeats`` starts each; a process's start is the
``Popen`` call, so the interpreter's own start is inside every figure):

single      a bare ``ps-server --port-file``: start -> the port file written
            (health SERVING, work accepted);
restore     one with a checkpoint holding an Adam variable of 1M float32:
            start -> the port file (the restore included); start -> the first
            Adam push answered, the push sent as soon as the port file appears
            (the compiled update's load or compile weighs on it); and that
            first push alone (a new client's connection included) when it is
            sent 1 s after the port file appears;
replica     the backup of a 2-replica shard holding that variable (etcd and
            both replicas on this machine) restarted while its primary
            serves: start -> the port file, and start -> in sync with its
            primary (health '' SERVING).

Baselines, the same run: ``python -c pass`` and
``python -c 'import grpc, numpy'`` from start to exit; the rows' ratio is
to the second. ``--baseline-repo`` names another checkout (an older
commit, say): its ps-server is measured too, each start alternating with
this checkout's, and each figure gets the median of the pairs' ratios.
The client in this process is this checkout's for both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO_ROOT, child_env, median, stop_process  # noqa: E402

_POLL_S = 0.002
_TIMEOUT_S = 60.0
ADAM_PARAMETERS = 1 << 20
_SERVING = 1  # grpc.health.v1 HealthCheckResponse.SERVING
_FIGURES = {
    "single_s": "single server: start -> port file",
    "restore_port_s": "restoring 1M Adam: start -> port file",
    "restore_push_s": "restoring 1M Adam: start -> first push answered",
    "restore_later_push_s": "restoring 1M Adam: first push 1 s after the port file, alone",
    "replica_port_s": "restarted backup: start -> port file",
    "replica_sync_s": "restarted backup: start -> in sync",
}


@dataclass
class Checkout:
    """A source tree whose ps-server is started (this repository, or a baseline)."""

    root: Path
    workdir: Path
    seconds: dict[str, list[float]] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        env = child_env()
        env["PYTHONPATH"] = os.pathsep.join([str(self.root), env["PYTHONPATH"]])
        return env

    def record(self, key: str, value: float) -> None:
        self.seconds.setdefault(key, []).append(value)

    def launch(self, name: str, flags: Sequence[str]) -> tuple[subprocess.Popen, Path, Path, float]:
        """A ps-server with a port file; (process, port file, log, its start on perf_counter)."""
        port_file, log = self.workdir / f"{name}.port", self.workdir / f"{name}.log"
        port_file.unlink(missing_ok=True)
        with open(log, "ab") as out:
            started = time.perf_counter()
            proc = subprocess.Popen(
                [sys.executable, "-m", "ps_server", "--host", "127.0.0.1", "--port", "0",
                 "--port-file", str(port_file), "--shard-index", "0", "--num-shards", "1",
                 "--log-level", "warning", *flags],
                cwd=self.root, env=self.env(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return proc, port_file, log, started


def process_seconds(argv: Sequence[str]) -> float:
    """Wall seconds from ``Popen`` to the process's exit."""
    started = time.perf_counter()
    subprocess.run(argv, check=True, env=child_env(), cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def _until(condition: Callable[[], bool], proc: subprocess.Popen, log: Path, what: str) -> None:
    deadline = time.monotonic() + _TIMEOUT_S
    while not condition():
        if proc.poll() is not None:
            raise RuntimeError(f"ps-server exited with status {proc.returncode} before {what}:\n"
                               f"{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {_TIMEOUT_S}s:\n{log.read_text()[-3000:]}")
        time.sleep(_POLL_S)


def _port(port_file: Path) -> int | None:
    try:
        text = port_file.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text else None


def _serving_port(proc: subprocess.Popen, port_file: Path, log: Path) -> int:
    _until(lambda: _port(port_file) is not None, proc, log, "port file")
    port = _port(port_file)
    assert port is not None
    return port


def _grads() -> dict[str, np.ndarray]:
    return {"w": np.full(ADAM_PARAMETERS, 1e-3, np.float32)}


def _adam_push(address: str) -> None:
    from worker_client import PSClient

    with PSClient([address], worker_id="bench-startup") as client:
        client.push(_grads())


def _create_adam(address: str, push: bool = False) -> None:
    from worker_client import Adam, PSClient

    with PSClient([address], worker_id="bench-startup") as client:
        client.create_variable("w", (ADAM_PARAMETERS,), optimizer=Adam())
        if push:
            client.push(_grads())


def single_once(checkout: Checkout) -> None:
    proc, port_file, log, started = checkout.launch("single", ())
    try:
        _serving_port(proc, port_file, log)
        checkout.record("single_s", time.perf_counter() - started)
    finally:
        stop_process(proc)


def _restore_flags(checkout: Checkout) -> tuple[str, ...]:
    return ("--checkpoint-dir", str(checkout.workdir / "checkpoints"))


def restore_setup(checkout: Checkout) -> None:
    """A checkpoint holding the Adam variable (the final one, written at stop)."""
    proc, port_file, log, _ = checkout.launch("restore", _restore_flags(checkout))
    try:
        _create_adam(f"127.0.0.1:{_serving_port(proc, port_file, log)}")
    finally:
        stop_process(proc)


def restore_once(checkout: Checkout) -> None:
    for wait in (0.0, 1.0):
        proc, port_file, log, started = checkout.launch("restore", _restore_flags(checkout))
        try:
            address = f"127.0.0.1:{_serving_port(proc, port_file, log)}"
            if wait:
                time.sleep(wait)
                pushed = time.perf_counter()
                _adam_push(address)
                checkout.record("restore_later_push_s", time.perf_counter() - pushed)
            else:
                checkout.record("restore_port_s", time.perf_counter() - started)
                _adam_push(address)
                checkout.record("restore_push_s", time.perf_counter() - started)
        finally:
            stop_process(proc)


class ReplicaSet:
    """A 2-replica shard of ``checkout``'s ps-server on an etcd, holding the Adam variable."""

    def __init__(self, checkout: Checkout, endpoint: str, stack: ExitStack) -> None:
        from bench_replication import PRIMARY_LEASE_SECONDS, _wait_for_primary

        self.checkout = checkout
        job = f"bench-{uuid.uuid4().hex[:8]}"
        self._flags = ("--replicas", "2", "--etcd-endpoints", endpoint, "--job-name", job,
                       "--primary-lease-seconds", str(PRIMARY_LEASE_SECONDS))
        self.procs: dict[int, subprocess.Popen] = {}
        stack.callback(lambda: [stop_process(p) for p in self.procs.values()])
        addresses = []
        for index in (0, 1):
            proc, port_file, log, _ = self._launch(index)
            addresses.append(f"127.0.0.1:{_serving_port(proc, port_file, log)}")
        self.primary = _wait_for_primary(addresses, [self.procs[0], self.procs[1]],
                                         [self._log(0), self._log(1)])
        self.backup = 0 if self.primary == addresses[1] else 1
        _create_adam(self.primary, push=True)

    def _log(self, index: int) -> Path:
        return self.checkout.workdir / f"replica-{index}.log"

    def _launch(self, index: int) -> tuple[subprocess.Popen, Path, Path, float]:
        checkpoints = self.checkout.workdir / f"replica-{index}-checkpoints"
        launched = self.checkout.launch(f"replica-{index}", (
            *self._flags, "--replica-index", str(index), "--checkpoint-dir", str(checkpoints)))
        self.procs[index] = launched[0]
        return launched

    def restart_backup(self) -> None:
        from bench_replication import PRIMARY_SERVICE, _health

        stop_process(self.procs[self.backup])
        _adam_push(self.primary)  # a change the restarted backup must catch up with
        proc, port_file, log, started = self._launch(self.backup)
        address = f"127.0.0.1:{_serving_port(proc, port_file, log)}"
        self.checkout.record("replica_port_s", time.perf_counter() - started)
        _until(lambda: _health(address, "") == _SERVING, proc, log, "in sync")
        self.checkout.record("replica_sync_s", time.perf_counter() - started)
        primary = self.procs[1 - self.backup]
        _until(lambda: _health(self.primary, PRIMARY_SERVICE) == _SERVING, primary,
               self._log(1 - self.backup), "primary serving")


def measure(repeats: int, checkouts: list[Checkout]) -> dict[str, float]:
    """Every figure into each checkout's ``seconds``, the starts of the checkouts alternating; the baselines."""
    import bench_replication

    python = [sys.executable, "-c", "pass"]
    imports = [sys.executable, "-c", "import grpc, numpy"]
    bare, grpc_numpy = [], []
    for checkout in checkouts:
        restore_setup(checkout)
    etcd = bench_replication.etcd_binary()
    if etcd is None:
        print("  replica: skipped (no etcd: install it or set ETCD_BINARY)", file=sys.stderr, flush=True)
    with ExitStack() as stack:
        replica_sets = []
        if etcd is not None:
            endpoint = stack.enter_context(bench_replication.etcd_server(etcd, checkouts[0].workdir))
            replica_sets = [ReplicaSet(checkout, endpoint, stack) for checkout in checkouts]
        for _ in range(repeats):
            bare.append(process_seconds(python))
            grpc_numpy.append(process_seconds(imports))
            for checkout in checkouts:
                single_once(checkout)
            for checkout in checkouts:
                restore_once(checkout)
            for replica_set in replica_sets:
                replica_set.restart_backup()
    return {"python_pass_s": median(bare), "python_grpc_numpy_s": median(grpc_numpy)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--baseline-repo", type=Path,
                        help="another checkout whose ps-server is measured alternately with this one's")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        roots = [REPO_ROOT] + ([args.baseline_repo.resolve()] if args.baseline_repo else [])
        checkouts = []
        for i, root in enumerate(roots):
            (Path(tmp) / str(i)).mkdir()
            checkouts.append(Checkout(root, Path(tmp) / str(i)))
        baselines = measure(args.repeats, checkouts)
    base = baselines["python_grpc_numpy_s"]
    print(f"baselines: python -c pass {baselines['python_pass_s']:.3f} s, "
          f"python -c 'import grpc, numpy' {base:.3f} s (medians of {args.repeats})")
    this = checkouts[0]
    other = checkouts[1] if len(checkouts) > 1 else None
    header = "| figure | median | x import grpc, numpy |"
    if other is not None:
        header += f" {other.root.name} | x import grpc, numpy | this / {other.root.name} (median of pairs) |"
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    figures: dict = {"baselines": baselines, "this": {}, "baseline_repo": {}}
    for key, name in _FIGURES.items():
        if key not in this.seconds:
            continue
        value = median(this.seconds[key])
        figures["this"][key] = this.seconds[key]
        line = f"| {name} | {value:.3f} s | {value / base:.2f} |"
        if other is not None:
            theirs = median(other.seconds[key])
            pairs = median([a / b for a, b in zip(this.seconds[key], other.seconds[key])])
            figures["baseline_repo"][key] = other.seconds[key]
            line += f" {theirs:.3f} s | {theirs / base:.2f} | {pairs:.2f} |"
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
