"""``ps-local``: run a built-in example, or the user's own script (``--script``), on a local wehub-ps cluster."""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import shutil
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, fields
from typing import Any, TextIO

from ps_local.etcd import EtcdUnavailable, start_etcd
from ps_local.examples import EXAMPLES, load_example
from ps_local.processes import ManagedProcess, ProcessGroup
from ps_local.script import ScriptFailed, run_script
from wehub_ps.process.logs import configure, event

log = logging.getLogger("ps_local")

_SERVER_START_TIMEOUT = 60.0


class LocalRunError(RuntimeError):
    """The local cluster could not run; the message says which process and why."""


_EXAMPLE_TIMEOUT = 900.0


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first "--" belongs to the script.
    script_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="ps-local",
        description="Start ps-servers and workers on this machine and train a built-in example, or run "
                    "your own training script once per worker (--script train.py [-- its arguments]).")
    parser.add_argument("--num-ps", "--servers", dest="num_ps", type=int, default=2,
                        help="ps-server processes, one per shard (default 2)")
    parser.add_argument("--num-workers", "--workers", dest="num_workers", type=int, default=2,
                        help="worker processes (default 2)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="processes per shard, a primary and its backups; more than 1 starts etcd, "
                             "which they elect their primary through (default 1)")
    parser.add_argument("--script", default=None, metavar="PATH",
                        help="run this Python script on every worker instead of an example; it finds the "
                             "cluster with PSClient.from_env() and its place in PS_WORKER_INDEX / "
                             "PS_NUM_WORKERS; ps-local exits with its status")
    parser.add_argument("--example", default="digits", choices=sorted(EXAMPLES),
                        help="built-in example to train (default digits)")
    parser.add_argument("--epochs", type=int, default=None, help="override the example's epochs")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override an example setting, e.g. --set learning_rate=0.05")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where workers compute: cuda needs CuPy and a GPU (default auto)")
    parser.add_argument("--consistency", choices=("async", "ssp", "sync"), default="async",
                        help="the servers' consistency mode (default async)")
    parser.add_argument("--staleness", type=int, default=2, help="ssp: bound on staleness in steps (default 2)")
    parser.add_argument("--backup-workers", type=int, default=0,
                        help="sync: apply a step without waiting for this many slowest workers (default 0)")
    parser.add_argument("--wire-dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="dtype of tensors on the wire; servers keep float32 (default float32)")
    parser.add_argument("--topk-ratio", type=float, default=None,
                        help="send only this fraction of each gradient's rows, the largest, and carry "
                             "the rest to the next push (error feedback); default: every row")
    parser.add_argument("--timeout", type=float, default=None,
                        help=f"seconds before the run is abandoned (default: {_EXAMPLE_TIMEOUT:.0f} for an "
                             "example, none for a script)")
    parser.add_argument("--log-level", default="warning", help="log level of ps-local and the servers")
    args = parser.parse_args(argv)
    if args.num_ps < 1 or args.num_workers < 1:
        parser.error(f"--num-ps and --num-workers must be at least 1, got {args.num_ps} and {args.num_workers}")
    if not 1 <= args.replicas <= 9:
        parser.error(f"--replicas must be in [1, 9], got {args.replicas}")
    if script_args and args.script is None:
        parser.error("arguments after '--' are passed to a --script; there is none")
    if args.script is not None and not os.path.isfile(args.script):
        parser.error(f"--script {args.script!r}: no such file")
    if args.script is None and args.timeout is None:
        args.timeout = _EXAMPLE_TIMEOUT
    args.script_args = script_args
    return args


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _example_config(example, args: argparse.Namespace):
    known = {f.name: f for f in fields(example.Config)}
    overrides: dict[str, Any] = {}
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep or key not in known:
            raise LocalRunError(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(known)}")
        default = known[key].default
        try:
            overrides[key] = type(default)(raw) if not isinstance(default, bool) else raw.lower() in ("1", "true", "yes")
        except ValueError:
            raise LocalRunError(f"--set {item!r}: {key} must be {type(default).__name__}") from None
    if args.epochs is not None:
        overrides["epochs"] = args.epochs
    if "device" in known:
        device = args.device
        if device == "auto":
            device = "cuda" if _gpu_available() else "cpu"
        overrides["device"] = device
    return example.Config(**overrides)


def _start_servers(group: ProcessGroup, args: argparse.Namespace, etcd_endpoint: str | None) -> list[str]:
    """Start every shard's replicas; each shard's address ('a' or 'a|b' for replicas) once all serve."""
    servers = []
    num_ps = args.num_ps
    job = f"ps-local-{os.getpid()}"
    for i in range(num_ps):
        for r in range(args.replicas):
            name = f"ps-{i}" if args.replicas == 1 else f"ps-{i}-{r}"
            port_file = os.path.join(group.workdir, f"{name}.port")
            replication = [] if args.replicas == 1 else [
                "--replicas", str(args.replicas), "--replica-index", str(r),
                "--etcd-endpoints", etcd_endpoint, "--job-name", job]
            proc = group.start(name, [
                sys.executable, "-m", "ps_server", "--host", "127.0.0.1", "--port", "0", "--lane-port", "0",
                "--port-file", port_file, "--shard-index", str(i), "--num-shards", str(num_ps),
                "--log-level", args.log_level, "--consistency", args.consistency,
                "--staleness", str(args.staleness), "--backup-workers", str(args.backup_workers),
                # The first steps wait until every worker has joined.
                "--expected-workers", str(args.num_workers), *replication])
            servers.append((i, proc, port_file))
    addresses: list[list[str]] = [[] for _ in range(num_ps)]
    deadline = time.monotonic() + _SERVER_START_TIMEOUT
    for shard, proc, port_file in servers:
        while not os.path.exists(port_file):
            if proc.popen.poll() is not None:
                raise LocalRunError(f"{proc.name} exited with code {proc.popen.returncode}:\n{proc.stderr_tail()}")
            if time.monotonic() > deadline:
                raise LocalRunError(f"{proc.name} did not start within {_SERVER_START_TIMEOUT:.0f}s")
            time.sleep(0.05)
        with open(port_file) as f:
            addresses[shard].append(f"127.0.0.1:{int(f.read())}")
    return ["|".join(replicas) for replicas in addresses]


class _Progress:
    """Aggregates the workers' progress lines into one status line."""

    def __init__(self, num_workers: int, stream: TextIO) -> None:
        self.latest: dict[int, dict[str, Any]] = {}
        self.done: set[int] = set()
        self.wire_dtypes: dict[int, str] = {}  # worker -> what its client sent tensors as
        self.num_workers = num_workers
        self.stream = stream
        self.tty = stream.isatty()
        self.started = time.perf_counter()
        self._last_print = 0.0
        self._last_line = ""

    def update(self, message: dict[str, Any]) -> None:
        if message.get("type") == "progress":
            self.latest[message["worker"]] = message
        elif message.get("type") == "started":
            sent = str(message.get("wire_dtype"))
            if message.get("topk_ratio") is not None:
                sent += f", gradients as the top {message['topk_ratio']:g} of their rows"
            self.wire_dtypes[message["worker"]] = sent
        elif message.get("type") == "done":
            self.done.add(message["worker"])

    def line(self) -> str:
        elapsed = time.perf_counter() - self.started
        if not self.latest:
            return f"[{elapsed:6.1f}s] starting {self.num_workers} workers..."
        steps = sum(m["step"] for m in self.latest.values())
        total = sum(m["total_steps"] for m in self.latest.values())
        total = total * self.num_workers // max(1, len(self.latest))
        loss = sum(m["loss"] for m in self.latest.values()) / len(self.latest)
        rate = sum(m["examples_per_s"] for m in self.latest.values())
        return (f"[{elapsed:6.1f}s] step {steps}/{total} ({100 * steps / max(1, total):3.0f}%)  "
                f"loss {loss:.4f}  {rate:,.0f} examples/s  workers done {len(self.done)}/{self.num_workers}")

    def render(self, final: bool = False) -> None:
        now = time.perf_counter()
        if self.tty:
            self.stream.write("\r" + self.line().ljust(100) + ("\n" if final else ""))
            self.stream.flush()
        elif final or now - self._last_print >= 2.0:
            line = self.line()
            if line.split("]", 1)[-1] != self._last_line.split("]", 1)[-1]:  # same progress: say it once
                self.stream.write(line + "\n")
                self.stream.flush()
            self._last_print, self._last_line = now, line


def _read_lines(proc: ManagedProcess, sink: "queue.Queue[dict[str, Any]]") -> None:
    assert proc.popen.stdout is not None
    for line in proc.popen.stdout:
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            continue  # a stray print from user code; progress lines are JSON
        if isinstance(message, dict):
            sink.put(message)


def _run_workers(group: ProcessGroup, args: argparse.Namespace, addresses: list[str], config,
                 out: TextIO) -> set[str]:
    """Train to the end, showing progress; returns the wire dtypes the workers' clients used."""
    config_json = json.dumps(asdict(config))
    workers = []
    messages: queue.Queue[dict[str, Any]] = queue.Queue()
    for i in range(args.num_workers):
        proc = group.start(f"worker-{i}", [
            sys.executable, "-m", "ps_local.worker", "--example", args.example,
            "--addresses", ",".join(addresses), "--worker-index", str(i),
            "--num-workers", str(args.num_workers), "--config", config_json,
            "--wire-dtype", args.wire_dtype,
            *(["--topk-ratio", str(args.topk_ratio)] if args.topk_ratio is not None else [])],
            capture_stdout=True)
        threading.Thread(target=_read_lines, args=(proc, messages), name=f"read-{proc.name}",
                         daemon=True).start()
        workers.append(proc)
    progress = _Progress(args.num_workers, out)
    deadline = time.monotonic() + args.timeout
    while True:
        try:
            progress.update(messages.get(timeout=0.25))
            while True:
                progress.update(messages.get_nowait())
        except queue.Empty:
            pass
        progress.render()
        failed = [w for w in workers if w.popen.poll() not in (None, 0)]
        if failed:
            progress.render(final=True)
            w = failed[0]
            raise LocalRunError(f"{w.name} failed with exit code {w.popen.returncode}:\n{w.stderr_tail()}")
        if all(w.popen.poll() == 0 for w in workers):
            break
        if time.monotonic() > deadline:
            raise LocalRunError(f"training did not finish within --timeout {args.timeout:.0f}s")
    time.sleep(0.05)
    while not messages.empty():
        progress.update(messages.get_nowait())
    progress.render(final=True)
    return set(progress.wire_dtypes.values())


def _interrupt(signum: int, _frame) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    configure(args.log_level)
    out = sys.stdout
    group = ProcessGroup()
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        etcd = None
        if args.replicas > 1:
            etcd = start_etcd(group)
        if args.script is not None:
            out.write(f"ps-local: {args.num_workers} x {args.script}; {args.num_ps} ps-servers"
                      f"{f' x {args.replicas} replicas' if args.replicas > 1 else ''}, {args.consistency} mode\n")
            addresses = _start_servers(group, args, etcd)
            out.write(f"ps-local: ps-servers at {', '.join(addresses)}\n")
            out.flush()
            run_script(group, args, addresses, out)
            out.write(f"ps-local: every worker of {args.script} exited 0\n")
            return 0
        return _run_example(group, args, etcd, out)
    except ScriptFailed as exc:
        out.write(f"\nps-local: {exc}; stopping every process it started\n")
        return exc.status
    except (LocalRunError, EtcdUnavailable) as exc:
        out.write(f"\nps-local: error: {exc}\n")
        return 1
    except KeyboardInterrupt:
        out.write("\nps-local: interrupted; stopping every process it started\n")
        return 130
    finally:
        group.stop_all()
        shutil.rmtree(group.workdir, ignore_errors=True)


def _run_example(group: ProcessGroup, args: argparse.Namespace, etcd: str | None, out: TextIO) -> int:
    """Train a built-in example, evaluate it and say whether it reached its target (exit status 0)."""
    example = load_example(args.example)
    config = _example_config(example, args)
    out.write(f"ps-local: example {example.NAME!r} ({example.DESCRIPTION}); "
              f"{args.num_ps} ps-servers{f' x {args.replicas} replicas' if args.replicas > 1 else ''}, "
              f"{args.num_workers} workers, {args.consistency} mode, device {getattr(config, 'device', 'cpu')}\n")
    started = time.perf_counter()
    addresses = _start_servers(group, args, etcd)
    out.write(f"ps-local: ps-servers at {', '.join(addresses)}\n")
    out.flush()
    wire = _run_workers(group, args, addresses, config, out)
    out.write(f"ps-local: tensors went over the wire as {', '.join(sorted(wire))}\n")
    from worker_client import PSClient

    with PSClient(addresses, worker_id="ps-local-evaluator", register=False) as client:
        metric = example.evaluate(client, config)
        if args.consistency != "async":
            stats = [info.consistency for info in client.describe()]
            blocked = sum(c["blocked_seconds"] for c in stats)
            pulls = sum(c["pulls"] for c in stats)
            out.write(f"ps-local: {args.consistency}: {sum(c['pulls_blocked'] for c in stats)} of {pulls} "
                      f"pulls waited, {1000 * blocked / max(1, pulls):.2f} ms per pull on average; "
                      f"{sum(c['dropped_gradients'] for c in stats)} late gradients dropped\n")
    if hasattr(example, "oracle_auc"):
        out.write(f"ps-local: best achievable {example.METRIC} on this data: {example.oracle_auc(config):.4f}\n")
    elapsed = time.perf_counter() - started
    reached = metric >= example.TARGET if example.HIGHER_IS_BETTER else metric <= example.TARGET
    out.write(f"ps-local: {example.METRIC} {metric:.4f} (target {example.TARGET}) "
              f"after {elapsed:.1f}s: {'reached' if reached else 'NOT reached'}\n")
    out.flush()
    event(log, logging.INFO, "finished", metric=metric, target=example.TARGET, seconds=elapsed)
    return 0 if reached else 1


if __name__ == "__main__":
    sys.exit(main())
