"""Pull and push throughput of wehub-ps against raw TCP on loopback.

Run from the repository root::

    python benchmarks/bench_throughput.py [--model-mb 100] [--repeats 3]
                                          [--servers 1,2] [--chunk-bytes N] [--json out.json]

Baseline: one plain TCP connection on 127.0.0.1 between two processes. A
child process ``sendall``s a memoryview of a numpy array holding as many
bytes as the model; this process ``recv_into``s a preallocated buffer. That
is the most a single stream can move on this host with one copy per side,
so it is the yardstick: the best of ``--repeats`` runs.

Then, for each server count in ``--servers``, the script starts that many
real ``ps-server`` processes (port 0 + ``--port-file``), creates a dense
model of ``--model-mb`` MiB as 4 float32 variables of shape (rows, 1024)
from one worker (this process), warms up with one pull and one push, and
times ``--repeats`` pulls and pushes. Figures are tensor payload bytes
(model bytes) per second, in GB/s (10**9 bytes). The servers are stopped
by PID in a ``finally`` block, also on Ctrl-C.

The issue's target is pull and push at >= 0.30x raw TCP; each row is
marked PASS or FAIL against it. The exit code does not depend on it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from wehub_ps.rpc import DEFAULT_CHUNK_BYTES  # noqa: E402

TARGET_RATIO = 0.30
NUM_VARIABLES = 4
COLUMNS = 1024
DTYPE = np.dtype("float32")
SERVER_START_TIMEOUT_S = 60.0
SERVER_STOP_TIMEOUT_S = 15.0
GO = b"g"


@dataclass
class Figure:
    """One measured operation: all its timings and what they mean in GB/s."""

    name: str
    nbytes: int
    seconds: list[float] = field(default_factory=list)

    @property
    def best_gbps(self) -> float:
        return self.nbytes / min(self.seconds) / 1e9

    @property
    def median_gbps(self) -> float:
        return self.nbytes / statistics.median(self.seconds) / 1e9


# ---- model shape ----


def rows_for(model_mb: float) -> int:
    """Rows per variable so that 4 x (rows, 1024) float32 is ``model_mb`` MiB (100 -> 6400)."""
    return max(1, round(model_mb * (1 << 20) / (NUM_VARIABLES * COLUMNS * DTYPE.itemsize)))


def model_bytes(rows: int) -> int:
    return NUM_VARIABLES * rows * COLUMNS * DTYPE.itemsize


# ---- raw TCP baseline ----


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; recv_into avoids allocating per read."""
    got, total = 0, len(view)
    while got < total:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"TCP sender closed after {got} of {total} bytes")
        got += n


def run_tcp_sender(address: str, nbytes: int, rounds: int) -> None:
    """Child side of the baseline: on each 'go' byte, sendall the whole array once."""
    host, port = address.rsplit(":", 1)
    payload = np.ones(nbytes, dtype=np.uint8)  # touched, so no page faults while sending
    view = memoryview(payload)
    with socket.create_connection((host, int(port))) as sock:
        for _ in range(rounds):
            if sock.recv(1) != GO:
                raise ConnectionError("TCP receiver went away")
            sock.sendall(view)


def tcp_baseline(nbytes: int, repeats: int) -> Figure:
    """Time ``repeats`` transfers of ``nbytes`` from a child process into this one.

    One untimed warm-up round first, as the ps figures also get one. Each
    timed round starts when this side sends 'go', so it includes one
    loopback round trip (tens of microseconds) on top of the transfer.
    """
    figure = Figure("raw TCP", nbytes)
    buffer = np.empty(nbytes, dtype=np.uint8)
    buffer.fill(0)  # fault the pages in before timing
    view = memoryview(buffer)
    rounds = repeats + 1
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        sender = subprocess.Popen(
            [sys.executable, __file__, "--tcp-sender", f"127.0.0.1:{port}",
             "--tcp-bytes", str(nbytes), "--tcp-rounds", str(rounds)])
        try:
            listener.settimeout(SERVER_START_TIMEOUT_S)
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(None)
                for i in range(rounds):
                    start = time.perf_counter()
                    conn.sendall(GO)
                    recv_exactly(conn, view)
                    if i > 0:
                        figure.seconds.append(time.perf_counter() - start)
            if sender.wait(SERVER_STOP_TIMEOUT_S) != 0:
                raise RuntimeError(f"TCP sender exited with status {sender.returncode}")
        finally:
            stop_process(sender)
    return figure


# ---- ps-server processes ----


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM by PID (the server drains and exits), SIGKILL if it does not in time."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(SERVER_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def server_env() -> dict[str, str]:
    """The environment for a server: the repo importable, no stray PS_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PS_") and k != "TF_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def wait_for_port(proc: subprocess.Popen, port_file: Path, log_file: Path) -> int:
    """Poll for the port file the server writes once serving; fail fast if it died."""
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if port_file.exists():
            text = port_file.read_text().strip()
            if text:
                return int(text)
        if proc.poll() is not None:
            raise RuntimeError(f"ps-server exited with status {proc.returncode}:\n{log_file.read_text()}")
        time.sleep(0.05)
    raise RuntimeError(f"ps-server gave no port within {SERVER_START_TIMEOUT_S}s:\n{log_file.read_text()}")


@contextmanager
def ps_cluster(num_servers: int) -> Iterator[list[str]]:
    """Start ``num_servers`` ps-servers; yield their addresses in shard order; always stop them."""
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="bench-ps-") as tmp:
        try:
            addresses = []
            for i in range(num_servers):
                port_file, log_file = Path(tmp, f"port-{i}"), Path(tmp, f"server-{i}.log")
                with open(log_file, "wb") as log:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "ps_server", "--host", "127.0.0.1", "--port", "0",
                         "--port-file", str(port_file), "--shard-index", str(i),
                         "--num-shards", str(num_servers), "--log-level", "warning"],
                        cwd=REPO_ROOT, env=server_env(), stdout=log, stderr=subprocess.STDOUT))
                addresses.append(f"127.0.0.1:{wait_for_port(procs[-1], port_file, log_file)}")
            yield addresses
        finally:
            for proc in procs:
                stop_process(proc)


# ---- ps measurements ----


def time_calls(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall seconds of each of ``repeats`` calls of ``fn``."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return seconds


def measure_ps(num_servers: int, rows: int, repeats: int, chunk_bytes: int) -> tuple[Figure, Figure]:
    """Pull and push figures for one worker against ``num_servers`` fresh servers."""
    # Imported here so the baseline's sender child does not load gRPC.
    from worker_client import SGD, PSClient

    nbytes = model_bytes(rows)
    names = [f"dense_{i}" for i in range(NUM_VARIABLES)]
    with ps_cluster(num_servers) as addresses, \
            PSClient(addresses, worker_id="bench-worker", chunk_bytes=chunk_bytes) as client:
        for name in names:
            # lr must be > 0; 1e-9 times zero gradients leaves the model as it is.
            client.create_variable(name, (rows, COLUMNS), dtype="float32", initializer="zeros",
                                   optimizer=SGD(learning_rate=1e-9))
        grads = {name: np.zeros((rows, COLUMNS), dtype=DTYPE) for name in names}
        client.pull()
        client.push(grads)
        label = f"{num_servers} server{'s' if num_servers > 1 else ''}"
        pull = Figure(f"pull, {label}", nbytes, time_calls(client.pull, repeats))
        push = Figure(f"push, {label}", nbytes, time_calls(lambda: client.push(grads), repeats))
    return pull, push


# ---- report ----


def print_table(baseline: Figure, figures: Sequence[Figure], args: argparse.Namespace) -> None:
    """One row per figure; the ps rows judged against TARGET_RATIO x the baseline's best."""
    base = baseline.best_gbps
    print(f"model: {NUM_VARIABLES} x float32 ({rows_for(args.model_mb)}, {COLUMNS}) = "
          f"{baseline.nbytes / 1e6:.1f} MB, repeats {args.repeats}, chunk_bytes {args.chunk_bytes}")
    print(f"target: pull and push >= {TARGET_RATIO:.2f}x raw TCP")
    header = (f"{'figure':<18} {'best GB/s':>10} {'median GB/s':>12} {'baseline GB/s':>14} "
              f"{'ratio':>7}  result")
    print(header)
    print("-" * len(header))
    print(f"{baseline.name:<18} {base:>10.3f} {baseline.median_gbps:>12.3f} {base:>14.3f} {1.0:>7.2f}")
    for fig in figures:
        ratio = fig.best_gbps / base
        verdict = "PASS" if ratio >= TARGET_RATIO else "FAIL"
        print(f"{fig.name:<18} {fig.best_gbps:>10.3f} {fig.median_gbps:>12.3f} {base:>14.3f} "
              f"{ratio:>7.2f}  {verdict}")
    print("ratio = best GB/s / baseline best GB/s")


def write_json(path: str, baseline: Figure, figures: Sequence[Figure], args: argparse.Namespace) -> None:
    """All figures with their raw timings, for comparing runs."""
    base = baseline.best_gbps

    def row(fig: Figure) -> dict[str, object]:
        ratio = fig.best_gbps / base
        return {**asdict(fig), "best_gbps": fig.best_gbps, "median_gbps": fig.median_gbps,
                "ratio_to_baseline": ratio, "median_ratio_to_baseline": fig.median_gbps / base,
                "pass": ratio >= TARGET_RATIO}

    report = {
        "config": {"model_mb": args.model_mb, "rows": rows_for(args.model_mb), "columns": COLUMNS,
                   "variables": NUM_VARIABLES, "repeats": args.repeats, "servers": args.servers,
                   "chunk_bytes": args.chunk_bytes, "target_ratio": TARGET_RATIO},
        "baseline": row(baseline),
        "figures": [row(fig) for fig in figures],
    }
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


# ---- command line ----


def parse_servers(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of counts, got {text!r}") from None
    if not counts or any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"server counts must be >= 1, got {text!r}")
    return counts


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-mb", type=float, default=100.0, help="model size in MiB (default 100)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure (default 3)")
    parser.add_argument("--servers", type=parse_servers, default=[1, 2],
                        help="comma-separated server counts to measure (default 1,2)")
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES,
                        help=f"PSClient chunk_bytes (default {DEFAULT_CHUNK_BYTES})")
    parser.add_argument("--json", metavar="PATH", help="also write every figure to this JSON file")
    # The baseline's sender runs this script again in a child process.
    parser.add_argument("--tcp-sender", help=argparse.SUPPRESS)
    parser.add_argument("--tcp-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tcp-rounds", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.model_mb <= 0:
        parser.error("--model-mb must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tcp_sender:
        run_tcp_sender(args.tcp_sender, args.tcp_bytes, args.tcp_rounds)
        return 0
    rows = rows_for(args.model_mb)
    baseline = tcp_baseline(model_bytes(rows), args.repeats)
    figures: list[Figure] = []
    for num_servers in args.servers:
        figures.extend(measure_ps(num_servers, rows, args.repeats, args.chunk_bytes))
    print_table(baseline, figures, args)
    if args.json:
        write_json(args.json, baseline, figures, args)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
