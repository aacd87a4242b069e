"""Shared pieces of the benchmarks: baselines, server processes, timing.

Baselines are measured in the same run as the figures they judge:

* raw TCP: one connection on 127.0.0.1 between two processes; a child
  ``sendall``s a memoryview of a numpy array, this process ``recv_into``s a
  preallocated buffer — the most one stream can move here with one copy per
  side;
* memcpy: ``np.copyto`` between two warm arrays of the same size;
* gRPC round trip: 8 bytes there and back on an open bidirectional stream.
"""

from __future__ import annotations

import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

SERVER_START_TIMEOUT_S = 60.0
SERVER_STOP_TIMEOUT_S = 15.0


@dataclass
class Row:
    """One figure of run.py's table: a value, its baseline of the same run, their ratio and the target."""

    section: str
    figure: str
    value: float
    unit: str
    baseline: float
    baseline_name: str
    ratio: float
    target: str
    passed: bool | None


def make_row(section, figure, value, unit, baseline, baseline_name, target_ratio=None, higher=True,
             target_text=None) -> Row:
    ratio = value / baseline if baseline else float("nan")
    passed = None
    if target_ratio is not None:
        passed = ratio >= target_ratio if higher else ratio <= target_ratio
    text = target_text or (f"{'>=' if higher else '<='} {target_ratio}x" if target_ratio is not None else "")
    return Row(section, figure, value, unit, baseline, baseline_name, ratio, text, passed)


def best(seconds: Sequence[float]) -> float:
    return min(seconds)


def median(seconds: Sequence[float]) -> float:
    return statistics.median(seconds)


def time_calls(fn: Callable[[], object], repeats: int, warmup: int = 1,
               cpu: MachineCPU | None = None) -> list[float]:
    """Wall seconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones.

    ``cpu``, when given, measures the machine during the timed calls.
    """
    for _ in range(warmup):
        fn()
    seconds = []
    if cpu is not None:
        cpu.start()
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    if cpu is not None:
        cpu.stop()
    return seconds


def child_env() -> dict[str, str]:
    """The environment for child processes: the repo importable, no stray PS_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PS_") and k != "TF_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM by PID (a server drains and exits), SIGKILL if it does not in time."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(SERVER_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---- baselines ----


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got, total = 0, len(view)
    while got < total:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"TCP sender closed after {got} of {total} bytes")
        got += n


_TCP_SENDER = """
import socket, sys, numpy as np
host, port, nbytes, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
payload = np.ones(nbytes, dtype=np.uint8)
with socket.create_connection((host, port)) as sock:
    for _ in range(rounds):
        if sock.recv(1) != b"g":
            raise SystemExit("receiver went away")
        sock.sendall(memoryview(payload))
"""


def tcp_seconds(nbytes: int, repeats: int) -> list[float]:
    """Seconds per transfer of ``nbytes`` from a child process into this one (after one warm-up)."""
    buffer = np.zeros(nbytes, dtype=np.uint8)
    view = memoryview(buffer)
    rounds = repeats + 1
    seconds = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        sender = subprocess.Popen([sys.executable, "-c", _TCP_SENDER, "127.0.0.1", str(port), str(nbytes),
                                   str(rounds)], env=child_env())
        try:
            listener.settimeout(SERVER_START_TIMEOUT_S)
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(None)
                for i in range(rounds):
                    start = time.perf_counter()
                    conn.sendall(b"g")
                    _recv_exactly(conn, view)
                    if i:
                        seconds.append(time.perf_counter() - start)
        finally:
            stop_process(sender)
    return seconds


def memcpy_seconds(nbytes: int, repeats: int) -> list[float]:
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    return time_calls(lambda: np.copyto(dst, src), repeats)


#: A bare gRPC server: each request on its bidi stream starts with 8 bytes, the size of the answer.
_SIZED_ECHO = """
import struct, sys, grpc
from concurrent import futures
def echo(it, ctx):
    for m in it:
        yield bytes(struct.unpack("<Q", m[:8])[0])
h = grpc.method_handlers_generic_handler("bench.Echo", {"Echo": grpc.stream_stream_rpc_method_handler(echo)})
s = grpc.server(futures.ThreadPoolExecutor(4), options=[("grpc.max_receive_message_length", 64 << 20)])
s.add_generic_rpc_handlers((h,))
port = s.add_insecure_port("127.0.0.1:0"); s.start(); print(port, flush=True); sys.stdin.read()
"""


def _close_bare(channels: list, servers: list[subprocess.Popen]) -> None:
    """Close the channels to bare gRPC servers, then stop the servers (their stdin closed first)."""
    for channel in channels:
        channel.close()
    for server in servers:
        server.stdin.close()
        stop_process(server)


@contextmanager
def _bare_grpc_streams(count: int) -> Iterator[Callable[[bytes], None]]:
    """``count`` bare gRPC servers (child processes), an open stream to each; yields ``round_trip(request)``.

    ``round_trip`` sends the request to every server, then reads every answer.
    """
    import queue

    import grpc

    servers = [subprocess.Popen([sys.executable, "-c", _SIZED_ECHO], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env=child_env()) for _ in range(count)]
    channels = []
    try:
        options = [("grpc.max_receive_message_length", 64 << 20)]
        channels = [grpc.insecure_channel(f"127.0.0.1:{int(s.stdout.readline())}", options=options)
                    for s in servers]
        requests = [queue.SimpleQueue() for _ in channels]
        streams = [c.stream_stream("/bench.Echo/Echo")(iter(q.get, None)) for c, q in zip(channels, requests)]

        def round_trip(request: bytes) -> None:
            for q in requests:
                q.put(request)
            for stream in streams:
                next(stream)

        yield round_trip
        for q, stream in zip(requests, streams):
            q.put(None)
            stream.cancel()
    finally:
        _close_bare(channels, servers)


# A bare framed-socket server: each frame (4-byte length, then the bytes) whose first 8 bytes say n is
# answered by a frame of n zero bytes; a thread per connection, as ps-server's TCP lane.
_SIZED_SOCKET_ECHO = """
import socket, struct, sys, threading
def read(sock, n):
    data = bytearray(n); view = memoryview(data); got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k: raise EOFError
        got += k
    return data
def serve(sock):
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        while True:
            body = read(sock, struct.unpack("<I", read(sock, 4))[0])
            (n,) = struct.unpack("<Q", body[:8])
            sock.sendall(struct.pack("<I", n) + bytes(n))
    except (EOFError, OSError):
        sock.close()
listener = socket.socket(); listener.bind(("127.0.0.1", 0)); listener.listen()
print(listener.getsockname()[1], flush=True)
threading.Thread(target=lambda: sys.stdin.read() or listener.close(), daemon=True).start()
while True:
    try:
        connection, _ = listener.accept()
    except OSError:
        break
    threading.Thread(target=serve, args=(connection,), daemon=True).start()
"""


def socket_pull_push_seconds(servers: int, nbytes_per_server: int, count: int) -> list[float]:
    """:func:`grpc_pull_push_seconds` over bare framed sockets: what a TCP lane's step could cost at best."""
    procs = [subprocess.Popen([sys.executable, "-c", _SIZED_SOCKET_ECHO], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=child_env()) for _ in range(servers)]
    socks: list[socket.socket] = []
    try:
        socks = [socket.create_connection(("127.0.0.1", int(p.stdout.readline()))) for p in procs]
        for sock in socks:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        answers = [bytearray(nbytes_per_server) for _ in socks]
        head = bytearray(4)

        def read_into(sock: socket.socket, buffer) -> None:
            view, got = memoryview(buffer), 0
            while got < len(view):
                got += sock.recv_into(view[got:])

        def round_trip(request: bytes) -> None:
            for sock in socks:
                sock.sendall(struct.pack("<I", len(request)) + request)
            for sock, answer in zip(socks, answers):
                read_into(sock, head)
                read_into(sock, memoryview(answer)[:struct.unpack("<I", head)[0]])

        pull = struct.pack("<Q", nbytes_per_server)
        push = struct.pack("<Q", 8) + bytes(nbytes_per_server)

        def step() -> None:
            round_trip(pull)
            round_trip(push)
        return time_calls(step, count, warmup=count // 10)
    finally:
        for sock in socks:
            sock.close()
        for proc in procs:
            proc.stdin.close()
            stop_process(proc)


def grpc_round_trips(count: int) -> list[float]:
    """Seconds of ``count`` 8-byte round trips on an open bidi stream (another process echoes)."""
    import queue

    import grpc

    code = """
import sys, grpc
from concurrent import futures
def echo(it, ctx):
    for m in it:
        yield m
h = grpc.method_handlers_generic_handler("bench.Echo", {"Echo": grpc.stream_stream_rpc_method_handler(echo)})
s = grpc.server(futures.ThreadPoolExecutor(4)); s.add_generic_rpc_handlers((h,))
port = s.add_insecure_port("127.0.0.1:0"); s.start(); print(port, flush=True); sys.stdin.read()
"""
    server = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=child_env())
    try:
        port = int(server.stdout.readline())
        requests: queue.SimpleQueue = queue.SimpleQueue()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            responses = channel.stream_stream("/bench.Echo/Echo")(iter(requests.get, None))
            seconds = []
            for i in range(count + 100):
                start = time.perf_counter()
                requests.put(b"12345678")
                next(responses)
                if i >= 100:
                    seconds.append(time.perf_counter() - start)
            requests.put(None)
            responses.cancel()
        return seconds
    finally:
        server.stdin.close()
        stop_process(server)


def grpc_pull_push_seconds(servers: int, nbytes_per_server: int, count: int) -> list[float]:
    """Seconds of a bare gRPC "pull then push" of ``nbytes_per_server`` to each of ``servers`` at once.

    The floor of a plain training step's communication: one round trip in
    which every server answers with its bytes, then one in which it gets
    them and answers 8 bytes, over open streams to bare servers.
    """
    pull = struct.pack("<Q", nbytes_per_server)
    push = struct.pack("<Q", 8) + bytes(nbytes_per_server)

    def step() -> None:
        round_trip(pull)
        round_trip(push)

    with _bare_grpc_streams(servers) as round_trip:
        return time_calls(step, count, warmup=count // 10)


# ---- ps-server processes ----


def wait_for_port(proc: subprocess.Popen, port_file: Path, log_file: Path) -> int:
    """The port ``proc`` (a ps-server started with --port-file) bound; RuntimeError if it exits first."""
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if port_file.exists() and port_file.read_text().strip():
            return int(port_file.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"ps-server exited with status {proc.returncode}:\n{log_file.read_text()}")
        time.sleep(0.05)
    raise RuntimeError(f"ps-server gave no port within {SERVER_START_TIMEOUT_S}s:\n{log_file.read_text()}")


@contextmanager
def ps_cluster(num_servers: int, *flags: str,
               lane: bool = True) -> Iterator[tuple[list[str], list[subprocess.Popen]]]:
    """Start ``num_servers`` ps-servers; yield (addresses in shard order, processes); always stop them.

    ``lane``: with a TCP lane each (``--lane-port 0``), as README recommends; clients then use it.
    """
    if lane:
        flags = ("--lane-port", "0", *flags)
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
                         "--num-shards", str(num_servers), "--log-level", "warning", *flags],
                        cwd=REPO_ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT))
            for i, proc in enumerate(procs):
                port = wait_for_port(proc, Path(tmp, f"port-{i}"), Path(tmp, f"server-{i}.log"))
                addresses.append(f"127.0.0.1:{port}")
            yield addresses, procs
        finally:
            for proc in procs:
                stop_process(proc)


class MachineCPU:
    """Core-seconds the whole machine spent busy (every process, kernel included) between start() and stop().

    From /proc/stat (Linux): what limits a figure when every core is busy,
    as with two workers and two servers on two cores.
    """

    def __init__(self) -> None:
        self.busy = self.wall = 0.0
        self._start: tuple[float, float] = (0.0, 0.0)

    @staticmethod
    def _busy_seconds() -> float:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        # guest time is counted in user already (fields 8-9)
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    def start(self) -> None:
        self._start = (self._busy_seconds(), time.perf_counter())

    def stop(self) -> None:
        self.busy = self._busy_seconds() - self._start[0]
        self.wall = time.perf_counter() - self._start[1]

    @property
    def cores_busy(self) -> float:
        """Cores busy on average."""
        return self.busy / self.wall if self.wall else 0.0


def _status_field(pid: int | str, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss_bytes(pid: int) -> int:
    """Resident set size of a process now, from /proc (Linux)."""
    return _status_field(pid, "VmRSS")


def peak_rss_bytes() -> int:
    """This process's peak resident set size since its exec (VmHWM)."""
    return _status_field("self", "VmHWM")


# Same malloc thresholds as ps-server and PSClient (wehub_ps.process.allocator), so the
# reference differs from our figures by our code only. With "sgd" as its second argument the
# server also applies each pushed message to float32 values of its own as a gradient, with the
# NumPy calls of ps-server's SGD kernel (ps_server.core.optimizers): the least a parameter
# server's push must do beyond gRPC.
_GRPC_STREAM_SERVER = """
import sys, grpc
import numpy as np
from concurrent import futures
from wehub_ps.process.allocator import keep_freed_buffers
keep_freed_buffers()
N, CHUNK = int(sys.argv[1]), 1 << 20
SGD = sys.argv[2:] == ["sgd"]
data = b"\x01" * N  # written pages, as a ps-server's variables are (bytes(N) reads the kernel's zero page)
weights = np.ones(N // 4, np.float32) if SGD else None
scratch = np.empty(CHUNK // 4, np.float32)
def pull(request, context):
    view = memoryview(data)
    for i in range(0, N, CHUNK):
        yield bytes(view[i:i + CHUNK])
def push(requests, context):
    start = 0
    for message in requests:
        if SGD:
            g = np.frombuffer(message, np.float32)
            w, s = weights[start:start + g.size], scratch[:g.size]
            np.multiply(g, 0.01, out=s, casting="unsafe")
            np.subtract(w, s, out=w)
            start += g.size
    return b"ok"
h = grpc.method_handlers_generic_handler("bench.Raw", {
    "Pull": grpc.unary_stream_rpc_method_handler(pull), "Push": grpc.stream_unary_rpc_method_handler(push)})
options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
s = grpc.server(futures.ThreadPoolExecutor(4), options=options); s.add_generic_rpc_handlers((h,))
print(s.add_insecure_port("127.0.0.1:0"), flush=True); s.start(); sys.stdin.read()
"""


@contextmanager
def bare_stream_servers(nbytes: int,
                        modes: Sequence[Sequence[str]]) -> Iterator[tuple[list, list[subprocess.Popen]]]:
    """One ``_GRPC_STREAM_SERVER`` of ``nbytes`` per entry of ``modes`` (its extra arguments: ``["sgd"]`` or
    none) and a channel to each: yields (channels, processes); closes and stops them all after."""
    import grpc

    servers = [subprocess.Popen([sys.executable, "-c", _GRPC_STREAM_SERVER, str(nbytes), *mode],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env())
               for mode in modes]
    channels = []
    try:
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        channels = [grpc.insecure_channel(f"127.0.0.1:{int(s.stdout.readline())}", options=options)
                    for s in servers]
        yield channels, servers
    finally:
        for channel in channels:
            channel.close()
        for proc in servers:
            proc.stdin.close()
            stop_process(proc)


#: The size of the bare servers' messages, ps-server's default chunk.
BARE_CHUNK = 1 << 20


def bare_pull(channel: Any, index: int = 0) -> None:
    """One Pull stream from a ``_GRPC_STREAM_SERVER``, its messages dropped."""
    for _ in channel.unary_stream("/bench.Raw/Pull")(b""):
        pass


def bare_push(source: memoryview) -> Callable[[Any, int], None]:
    """``fn(channel, index)`` pushing ``source`` to a ``_GRPC_STREAM_SERVER`` as one stream of 1 MiB messages."""
    def push(channel: Any, index: int = 0) -> None:
        channel.stream_unary("/bench.Raw/Push")(bytes(source[i:i + BARE_CHUNK])
                                                for i in range(0, len(source), BARE_CHUNK))
    return push


def on_each(fn: Callable[[Any, int], object], channels: Sequence) -> None:
    """``fn(channel, index)`` for every channel at once, a thread each (as PSClient calls its shards)."""
    threads = [threading.Thread(target=fn, args=(channel, i)) for i, channel in enumerate(channels)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def grpc_stream_seconds(nbytes: int, repeats: int) -> tuple[list[float], list[float]]:
    """gRPC Python's own ceiling: (pull, push) seconds of ``nbytes`` as a stream of 1 MiB raw-bytes messages."""
    push = bare_push(memoryview(np.ones(nbytes, np.uint8)))  # written pages, as gradients are
    with bare_stream_servers(nbytes, [[]]) as ((channel,), _):
        pulls = time_calls(lambda: bare_pull(channel), repeats)
        pushes = time_calls(lambda: push(channel), repeats)
    return pulls, pushes


def grpc_stream_round_trip_seconds(nbytes_per_server: int, count: int) -> list[float]:
    """Seconds of gRPC Python alone pulling, then pushing, ``nbytes_per_server`` from and to 2 servers.

    A dense training loop's communication with nothing of ours: raw 1 MiB
    messages on a Pull and a Push stream per server, a thread per server (as
    PSClient's calls), the pulled messages dropped and the pushed ones made
    from written pages. ``count`` timed round trips after two for warm-up.
    """
    push = bare_push(memoryview(np.ones(nbytes_per_server, np.uint8)))
    with bare_stream_servers(nbytes_per_server, [[], []]) as (channels, _):
        return time_calls(lambda: (on_each(bare_pull, channels), on_each(push, channels)), count, warmup=2)


# The least a sparse call can do over gRPC Python: ids out as raw int64 and
# rows back as raw bytes on one open bidirectional stream per server; the
# server gathers (or updates) its rows with the same NumPy calls ps-server
# uses, with no framing, checks, ledger or metrics.
_BARE_ROWS_SERVER = """
import sys, grpc, numpy as np
from concurrent import futures
from wehub_ps.process.allocator import keep_freed_buffers
from wehub_ps.kernels.rowops import put_rows, take_rows
keep_freed_buffers()
rows, dim = int(sys.argv[1]), int(sys.argv[2])
table = np.zeros((rows, dim), np.float32)
table += 0.5  # every page touched, as a ps-server's initialised part
def exchange(requests, context):
    for raw in requests:
        n = int.from_bytes(raw[1:8], "little")
        ids = np.frombuffer(raw, np.int64, n, 8)
        if raw[0] == 0:
            yield take_rows(table, ids).tobytes()
        else:
            w = take_rows(table, ids)
            w -= np.float32(1e-9) * np.frombuffer(raw, np.float32, n * dim, 8 + 8 * n).reshape(n, dim)
            put_rows(table, ids, w)
            yield b"ok"
h = grpc.method_handlers_generic_handler("bench.Rows", {"Exchange": grpc.stream_stream_rpc_method_handler(exchange)})
options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
s = grpc.server(futures.ThreadPoolExecutor(4), options=options); s.add_generic_rpc_handlers((h,))
print(s.add_insecure_port("127.0.0.1:0"), flush=True); s.start(); sys.stdin.read()
"""


def bare_rows_seconds(rows_per_server: int, batches: Sequence[np.ndarray], grads: np.ndarray, calls: int,
                      warmup: int, cpu: Sequence[MachineCPU] = ()) -> tuple[list[float], list[float]]:
    """(pull, push) seconds per call of the bare row exchange with 2 servers, each holding ``rows_per_server``.

    The client does what any row client must: sort the ids, split them by
    server, send, and put each answer's rows back in the caller's order.
    ``cpu``: two meters, for the machine during the timed pulls and pushes.
    """
    import queue

    import grpc

    from wehub_ps.kernels.rowops import put_rows, take_rows

    dim = grads.shape[1]
    servers = [subprocess.Popen([sys.executable, "-c", _BARE_ROWS_SERVER, str(rows_per_server), str(dim)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env())
               for _ in range(2)]
    channels = []
    try:
        lanes = []
        for server in servers:
            channel = grpc.insecure_channel(f"127.0.0.1:{int(server.stdout.readline())}",
                                            options=[("grpc.max_receive_message_length", 64 << 20)])
            channels.append(channel)
            requests: queue.SimpleQueue = queue.SimpleQueue()
            lanes.append((requests, channel.stream_stream("/bench.Rows/Exchange")(iter(requests.get, None))))

        def split(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
            order = np.argsort(ids)
            sorted_ids = ids[order]
            return order, sorted_ids, int(np.searchsorted(sorted_ids, rows_per_server))

        def pull(ids: np.ndarray) -> np.ndarray:
            order, sorted_ids, cut = split(ids)
            parts = ((sorted_ids[:cut], order[:cut]), (sorted_ids[cut:] - rows_per_server, order[cut:]))
            for (requests, _), (local, _) in zip(lanes, parts):
                requests.put(b"\0" + len(local).to_bytes(7, "little") + local.tobytes())
            out = np.empty((len(ids), dim), np.float32)
            for (_, answers), (_, places) in zip(lanes, parts):
                put_rows(out, places, np.frombuffer(next(answers), np.float32).reshape(-1, dim))
            return out

        def push(ids: np.ndarray) -> None:
            order, sorted_ids, cut = split(ids)
            rows = take_rows(grads, order)
            parts = ((sorted_ids[:cut], rows[:cut]), (sorted_ids[cut:] - rows_per_server, rows[cut:]))
            for (requests, _), (local, values) in zip(lanes, parts):
                requests.put(b"".join([b"\1" + len(local).to_bytes(7, "little"), local.tobytes(),
                                       memoryview(values).cast("B")]))
            for _, answers in lanes:
                next(answers)

        results = []
        for i, fn in enumerate((pull, push)):
            it = iter(batches)
            results.append(time_calls(lambda: fn(next(it)), calls, warmup=warmup,
                                      cpu=cpu[i] if cpu else None))
        for requests, answers in lanes:
            requests.put(None)
            answers.cancel()
        return results[0], results[1]
    finally:
        _close_bare(channels, servers)


# A worker of the bare 2-worker reference: pulls then pushes ``nbytes`` per
# server (1 MiB raw messages), both servers at once, ``repeats`` times.
_GRPC_STREAM_WORKER = """
import json, sys, threading, time, grpc
from wehub_ps.process.allocator import keep_freed_buffers
keep_freed_buffers()
ports, nbytes, repeats = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
channels = [grpc.insecure_channel(f"127.0.0.1:{p}", options=options) for p in ports]
source = memoryview(b"\x01" * nbytes)  # written pages, as gradients are
def pull(channel):
    for message in channel.unary_stream("/bench.Raw/Pull")(b""):
        pass
def push(channel):
    channel.stream_unary("/bench.Raw/Push")(bytes(source[i:i + (1 << 20)]) for i in range(0, nbytes, 1 << 20))
def both(fn):
    threads = [threading.Thread(target=fn, args=(c,)) for c in channels]
    start = time.perf_counter()
    for t in threads: t.start()
    for t in threads: t.join()
    return time.perf_counter() - start
both(pull); both(push)
print("ready", flush=True)
sys.stdin.readline()
result = {"pull": [both(pull) for _ in range(repeats)]}
result["push"] = [both(push) for _ in range(repeats)]
print(json.dumps(result), flush=True)
"""


def grpc_stream_2x2_seconds(nbytes_per_server: int, repeats: int,
                            cpu: MachineCPU | None = None) -> tuple[float, float]:
    """gRPC Python alone, 2 worker processes x 2 servers at once: (pull, push) seconds of the slower worker.

    The same traffic as the benchmark's 2-worker figure (each worker moves
    ``nbytes_per_server`` to or from each server, both servers at once), as
    raw 1 MiB messages with no serialisation: what four processes on this
    machine's cores can move through gRPC Python with nothing of ours.
    ``cpu``, when given, measures the machine while they do.
    """
    import json

    servers = [subprocess.Popen([sys.executable, "-c", _GRPC_STREAM_SERVER, str(nbytes_per_server)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env())
               for _ in range(2)]
    workers: list[subprocess.Popen] = []
    try:
        ports = ",".join(str(int(s.stdout.readline())) for s in servers)
        workers = [subprocess.Popen([sys.executable, "-c", _GRPC_STREAM_WORKER, ports, str(nbytes_per_server),
                                     str(repeats)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                    env=child_env()) for _ in range(2)]
        for w in workers:
            if w.stdout.readline().strip() != "ready":
                raise RuntimeError("bare gRPC benchmark worker did not start")
        if cpu is not None:
            cpu.start()
        for w in workers:
            w.stdin.write("go\n")
            w.stdin.flush()
        out = [json.loads(w.stdout.readline()) for w in workers]
        if cpu is not None:
            cpu.stop()
        return max(sum(r["pull"]) for r in out) / repeats, max(sum(r["push"]) for r in out) / repeats
    finally:
        for proc in workers + servers:
            if proc.stdin:
                proc.stdin.close()
            stop_process(proc)
