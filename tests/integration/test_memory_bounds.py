"""Hostile request patterns against a real ps-server with --max-memory-bytes: memory stays bounded.

Each pattern speaks raw gRPC (what PSClient never sends) to one server and
checks three things: the answer is a precise refusal, the store is as it
was (values pulled before and after, Describe), and the server's peak RSS
(``VmHWM`` of /proc/<pid>/status, reset before each pattern) stays below
``LIMIT + OVERHEAD``. OVERHEAD is the bound docs/failure-semantics.md
states: the process itself (interpreter, gRPC, NumPy, and numba's compiled
loops, loaded here before the first pattern), what malloc keeps for reuse
(``--keep-freed-bytes`` per arena, two arenas), and a request message being
received and decoded. The figures are printed per pattern (``pytest -s``).

The patterns run in order against one server; the abandoned pushes come
last, because the ledger keeps holding their bytes.

The framed ports (the TCP lane, a replicated primary's replication port)
get their own servers: raw sockets play peers that never authenticate
(slow-drip first frames, huge incomplete ones, connections past every cap)
while a real worker pushes and pulls; the server's peak RSS growth and its
threads stay within the handshake's bounds (docs/failure-semantics.md).
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
import urllib.request
import uuid

import grpc
import numpy as np
import pytest
from ps_testing import memory_status

from wehub_ps.errors import REASON_METADATA_KEY
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.arrays import byte_view
from wehub_ps.wire.codec import (
    EXCHANGE_ERROR,
    EXCHANGE_PULL,
    OutgoingChunk,
    decode_envelope,
    decode_pull_response,
    encode_envelope,
    encode_push_request,
)
from wehub_ps.wire.frames import MAX_FRAME_BYTES
from wehub_ps.wire.rpc import method_path
from wehub_ps.wire.small_messages import (
    encode_chunk_header,
    encode_pull_item,
    encode_pull_request,
    encode_push_begin,
    encode_push_item,
)
from worker_client import SGD, PSClient, ResourceExhaustedError, Uniform

MiB = 1 << 20
LIMIT = 64 * MiB
KEEP_FREED = 4 * MiB
MAX_MESSAGE = 16 * MiB
MAX_VARIABLES = 1000
# The process at rest with numba's loops loaded (~200 MiB measured), 2 arenas x --keep-freed-bytes,
# and one request message being received and decoded: its bytes, the arrays of its ids (3 x
# --max-message-bytes) and its decoded chunk headers (~1 KiB each, at most --max-variables + 1,024).
OVERHEAD = 224 * MiB + 2 * KEEP_FREED + 3 * MAX_MESSAGE + (MAX_VARIABLES + 1024) * 1024
StatusCode = grpc.StatusCode


def _reset_peak(pid: int) -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0); the peak then belongs to one pattern."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, process, metrics_port: int) -> None:
        self.process = process
        self.address = process.address
        self.pid = process.popen.pid
        self.metrics_port = metrics_port
        self.channel = grpc.insecure_channel(self.address, options=[
            ("grpc.max_receive_message_length", 256 * MiB), ("grpc.max_send_message_length", 256 * MiB)])

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as response:
            return response.read().decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from ps_testing import ClusterFactory

    factory = ClusterFactory(tmp_path_factory.mktemp("memory-bounds"))
    metrics_port = _free_port()
    try:
        cluster = factory(1, "--max-memory-bytes", str(LIMIT), "--keep-freed-bytes", str(KEEP_FREED),
                          "--max-message-bytes", str(MAX_MESSAGE), "--metrics-port", str(metrics_port),
                          "--max-variables", str(MAX_VARIABLES))
        with PSClient(cluster.addresses) as client:
            client.create_variable("dense", shape=(2048, 256), initializer=Uniform(seed=1),
                                   optimizer=SGD(learning_rate=1.0))
            client.create_variable("narrow", shape=(4096, 4), initializer=Uniform(seed=2),
                                   optimizer=SGD(learning_rate=1.0))
            client.create_embedding("emb", 256, initializer=Uniform(seed=3), optimizer=SGD(learning_rate=1.0))
            client.pull_rows("emb", np.arange(8000))
            client.push_rows("emb", [8000], np.zeros((1, 256), np.float32))  # loads the compiled loops
        srv = _Server(cluster.servers[0], metrics_port)
        yield srv
        srv.channel.close()
    finally:
        factory.stop_all()


@pytest.fixture(scope="module")
def figures():
    rows: list[str] = []
    yield rows
    print("\nserver RSS per hostile pattern (MiB; limit %d + overhead bound %d = %d):"
          % (LIMIT // MiB, OVERHEAD // MiB, (LIMIT + OVERHEAD) // MiB))
    for row in rows:
        print("  " + row)


def _state(server: _Server, table_rows: bool = True) -> tuple:
    """Values of every variable (the table's existing rows: a pull that creates none) and Describe.

    ``table_rows=False``: the table's rows are not read (reading them books memory for the answer).
    """
    with PSClient([server.address]) as client:
        values = client.pull(["dense", "narrow"])
        rows = client.pull_rows("emb", np.arange(8001)).tobytes() if table_rows else None
        info = client.describe()[0]
    return ({k: v.tobytes() for k, v in values.items()}, rows,
            {k: (v["version"], v["optimizer_steps"], v["num_rows"], v["evicted_rows"])
             for k, v in info.variables.items()}, info.stored_bytes)


@pytest.fixture
def pattern(server, figures, request):
    """Runs one pattern: state and RSS before, state unchanged and RSS bounded after."""
    before = _state(server)
    rss_before = memory_status(server.pid)["VmRSS"]
    _reset_peak(server.pid)
    yield
    now = memory_status(server.pid)
    name = request.node.name.removeprefix("test_")
    figures.append(f"{name:<40} before {rss_before / MiB:6.1f}  after {now['VmRSS'] / MiB:6.1f}  "
                   f"peak {now['VmHWM'] / MiB:6.1f}")
    assert now["VmHWM"] <= LIMIT + OVERHEAD, f"{name}: peak RSS {now['VmHWM'] / MiB:.1f} MiB"
    if name == "abandoned_pushes":  # the ledger now fills the limit: the table's rows cannot be read
        assert _state(server, table_rows=False) == (*before[:1], None, *before[2:])
    else:
        assert _state(server) == before


def _expect(call, code: StatusCode, reason: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    error = info.value
    assert error.code() == code, error.details()
    assert dict(error.trailing_metadata() or ()).get(REASON_METADATA_KEY) == reason, error.details()
    return error


def _pull(server: _Server, items: list[bytes], **kw) -> list:
    request = encode_pull_request(0, 1, items, **kw)
    return list(server.channel.unary_stream(method_path("Pull"))(request, timeout=60))


def _push(server: _Server, begin: bytes, chunks: list[OutgoingChunk]):
    return server.channel.stream_unary(method_path("Push"))(iter([encode_push_request(begin, chunks)]),
                                                             timeout=60)


def _begin(items: list[bytes], incarnation: str | None = None, sequence: int = 1) -> bytes:
    return encode_push_begin("hostile", incarnation or uuid.uuid4().hex, sequence, 0, 1, ps_pb2.GRADIENT,
                             items)


def _ids(*values) -> bytes:
    return np.asarray(values, "<i8").tobytes()


# ---- the patterns ------------------------------------------------------------------------------


def test_repeated_ids(server, pattern):
    """One id a million times (8 MB of ids; 1 KiB rows would answer 1 GiB): read once, never gathered
    per repetition. Over Exchange the answer is one message: refused, it would not fit the limit;
    a Pull stream answers every repetition, one message at a time."""
    repeated = np.full(1 << 20, 7, "<i8").tobytes()
    exchange = server.channel.stream_stream(method_path("Exchange"))
    request = encode_envelope(1, EXCHANGE_PULL,
                              encode_pull_request(0, 1, [encode_pull_item("emb", repeated)]))
    (reply,) = list(exchange(iter([request]), timeout=60))
    _, field, payload = decode_envelope(reply)
    assert field == EXCHANGE_ERROR
    error = ps_pb2.ExchangeError.FromString(bytes(payload))
    assert (error.code, error.reason) == (StatusCode.RESOURCE_EXHAUSTED.value[0], "MEMORY_LIMIT"), \
        error.message
    # A Pull stream of 200,000 repetitions (200 MiB answered) holds one row and one message at a time.
    ids = np.tile(np.array([7, 3, 7, 5], "<i8"), 50_000)
    received = 0
    first = None
    for message in server.channel.unary_stream(method_path("Pull"))(
            encode_pull_request(0, 1, [encode_pull_item("emb", ids.tobytes())]), timeout=120):
        received += len(message)
        if first is None:
            first = decode_pull_response(message)[0].array()[:256 * 4].copy()
    assert received >= len(ids) * 1024
    with PSClient([server.address]) as client:
        assert first.tobytes() == client.pull_rows("emb", [7, 3, 7, 5]).tobytes()


def test_tiny_chunks(server, pattern):
    """One message of 200,000 one-element chunks: refused before its chunks are decoded. A push
    whose messages each pass but together record more chunks than a push of its size may: the
    message that would pass that is refused whole (the first one's chunks add zeros)."""
    begin = _begin([encode_push_item("dense", 2048 * 256, ps_pb2.FLOAT32)])
    zero = byte_view(np.zeros(1, np.float32))
    chunks = [OutgoingChunk(encode_chunk_header("dense", offset, 1, ps_pb2.FLOAT32), zero)
              for offset in range(0, 400_000, 2)]
    error = _expect(lambda: _push(server, begin, chunks), StatusCode.RESOURCE_EXHAUSTED, "MEMORY_LIMIT")
    assert "send larger chunks" in error.details()
    # 4,096 rows of 4 elements may be pushed in 1,024 + 1 + 64 chunks: two messages of 1,000 rows.
    rows = np.arange(4096, dtype="<i8")
    zero_row = byte_view(np.zeros(4, np.float32))
    begin = _begin([encode_push_item("narrow", 4 * 4096, ps_pb2.FLOAT32, row_ids=rows.tobytes())])
    messages = [encode_push_request(
        begin if m == 0 else None,
        [OutgoingChunk(encode_chunk_header("narrow", 4 * r, 4, ps_pb2.FLOAT32), zero_row)
         for r in range(1000 * m, 1000 * (m + 1))]) for m in range(2)]
    error = _expect(lambda: server.channel.stream_unary(method_path("Push"))(iter(messages), timeout=60),
                    StatusCode.RESOURCE_EXHAUSTED, "MEMORY_LIMIT")
    assert "1000 more would pass the 1089" in error.details()


def test_unknown_names(server, pattern):
    """Thousands of made-up variable names: NOT_FOUND, and not one of them becomes a metric label."""
    series_before = {line.rsplit(" ", 1)[0] for line in server.metrics().splitlines()
                     if not line.startswith("#")}
    for round_ in range(4):
        names = [f"made-up-{round_}-{i}-{uuid.uuid4().hex}" for i in range(5000)]
        _expect(lambda: _pull(server, [encode_pull_item(name) for name in names]),
                StatusCode.NOT_FOUND, "UNKNOWN_VARIABLE")
        begin = _begin([encode_push_item(name, 1, ps_pb2.FLOAT32) for name in names])
        _expect(lambda: _push(server, begin, []), StatusCode.NOT_FOUND, "UNKNOWN_VARIABLE")
    text = server.metrics()
    assert "made-up" not in text
    series_after = {line.rsplit(" ", 1)[0] for line in text.splitlines() if not line.startswith("#")}
    assert {s for s in series_after - series_before if "_created" not in s} <= {
        'wehub_ps_pulls_total{outcome="UNKNOWN_VARIABLE",variable="-"}',
        'wehub_ps_pushes_total{outcome="UNKNOWN_VARIABLE",variable="-"}'}


def test_huge_declared_sizes(server, pattern):
    """Sizes far beyond the limit, declared in a few bytes: refused before anything is allocated."""
    create = server.channel.unary_unary(method_path("CreateVariable"))
    huge = ps_pb2.VariableSpec(name="huge", shape=[1 << 40], dtype=ps_pb2.FLOAT32)
    huge.initializer.zeros.SetInParent()
    huge.optimizer.sgd.learning_rate = 0.1
    _expect(lambda: create(ps_pb2.CreateVariableRequest(spec=huge, shard_index=0, num_shards=1)
                           .SerializeToString(), timeout=30), StatusCode.RESOURCE_EXHAUSTED, "MEMORY_LIMIT")
    # 100,000 new rows of 1 KiB in one pull: the table's growth does not fit.
    _expect(lambda: _pull(server, [encode_pull_item("emb", np.arange(10**6, 10**6 + 100_000).astype("<i8")
                                                    .tobytes())]),
            StatusCode.RESOURCE_EXHAUSTED, "MEMORY_LIMIT")
    # A push declaring 2^60 elements of a variable, and a pull of a range far outside it.
    _expect(lambda: _push(server, _begin([encode_push_item("dense", 1 << 60, ps_pb2.FLOAT32)]), []),
            StatusCode.INVALID_ARGUMENT, "SHAPE_MISMATCH")
    pull = ps_pb2.PullRequest(shard_index=0, num_shards=1,
                              items=[ps_pb2.PullItem(variable="dense", offset=1 << 62, count=1 << 62)])
    call = server.channel.unary_stream(method_path("Pull"))
    _expect(lambda: list(call(pull.SerializeToString(), timeout=30)),
            StatusCode.INVALID_ARGUMENT, "INVALID_CHUNK")


def test_many_streams(server, pattern):
    """24 Pull streams of the table's 8,000 rows (8 MiB gathered each) left unread: the rows they
    hold together stay within the limit; the streams past it are refused."""
    ids = np.arange(8000, dtype="<i8")
    order = np.random.default_rng(0).permutation(ids)  # unsorted: each stream gathers its rows
    request = encode_pull_request(0, 1, [encode_pull_item("emb", order.tobytes())])
    calls = [server.channel.unary_stream(method_path("Pull"))(request, timeout=60) for _ in range(24)]
    outcomes: list[str] = []
    lock = threading.Lock()

    def first_message(call) -> None:
        try:
            next(call)
            outcome = "holding"
        except grpc.RpcError as error:
            outcome = error.code().name
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=first_message, args=(call,), name=f"stream-{i}")
               for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    peak_while_held = memory_status(server.pid)["VmHWM"]
    for call in calls:
        call.cancel()
    assert outcomes.count("holding") >= 1 and outcomes.count("RESOURCE_EXHAUSTED") >= 1, outcomes
    assert set(outcomes) <= {"holding", "RESOURCE_EXHAUSTED"}, outcomes
    assert peak_while_held <= LIMIT + OVERHEAD


def test_abandoned_pushes(server, pattern):
    """Pushes of many small chunks that never finish: the ledger's records of them are booked,
    and once they fill the limit the next one is refused (the pushes add zeros: values stay)."""
    rows = np.arange(1000, dtype="<i8")
    zero_row = byte_view(np.zeros(4, np.float32))
    incarnation = uuid.uuid4().hex
    refused = None
    for n in range(2000):
        if n % 60 == 0:  # (an incarnation keeps 64 unfinished pushes)
            incarnation = uuid.uuid4().hex
        begin = _begin([encode_push_item("narrow", 4000, ps_pb2.FLOAT32, row_ids=rows.tobytes())],
                       incarnation, sequence=n % 60 + 1)
        chunks = [OutgoingChunk(encode_chunk_header("narrow", 4 * r, 4, ps_pb2.FLOAT32), zero_row)
                  for r in range(999)]  # one row short: the push stays open
        try:
            _push(server, begin, chunks)
        except grpc.RpcError as error:
            if error.code() == StatusCode.FAILED_PRECONDITION:  # PUSH_INCOMPLETE: abandoned
                continue
            refused = (n, error)
            break
    assert refused is not None, "2,000 abandoned pushes were all accepted"
    n, error = refused
    assert error.code() == StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert n > 50  # ~250 KiB each: the limit's free room, not a smaller bound
    # Reading the table's rows needs memory for the answer: refused now, until the ledger drops
    # these pushes (written off by later pushes of their incarnations, or forgotten with them).
    _expect(lambda: _pull(server, [encode_pull_item("emb", _ids(*range(8000)))]),
            StatusCode.RESOURCE_EXHAUSTED, "MEMORY_LIMIT")


def test_a_hash_table_filling_the_limit(cluster_factory, figures):
    """New rows of a narrow table until the limit: every byte a row costs is booked (its id index
    among them), so RESOURCE_EXHAUSTED comes before the limit is passed, and it changes nothing.
    Its own server, with a larger limit: the rows' bytes, not the process, dominate its RSS."""
    limit = 256 * MiB
    cluster = cluster_factory(1, "--max-memory-bytes", str(limit), "--keep-freed-bytes", str(KEEP_FREED),
                              "--max-message-bytes", str(MAX_MESSAGE), "--max-variables", str(MAX_VARIABLES))
    pid = cluster.servers[0].popen.pid
    with PSClient(cluster.addresses) as client:
        client.create_embedding("narrow_table", 4, initializer="zeros")
        rss_before = memory_status(pid)["VmRSS"]
        _reset_peak(pid)
        batch = 100_000
        for start in range(0, 100 * batch, batch):
            try:
                client.pull_rows("narrow_table", np.arange(start, start + batch))
            except ResourceExhaustedError as error:
                assert error.reason == "MEMORY_LIMIT"
                break
        else:
            pytest.fail(f"{100 * batch} rows of 16 bytes fitted a {limit}-byte limit")
        info = client.describe()[0]
        assert info.variables["narrow_table"]["num_rows"] == start  # the refused pull created none
        assert info.stored_bytes <= limit
    now = memory_status(pid)
    figures.append(f"{'a_hash_table_filling_the_limit (256 MiB)':<40} before {rss_before / MiB:6.1f}  "
                   f"after {now['VmRSS'] / MiB:6.1f}  peak {now['VmHWM'] / MiB:6.1f}  ({start} rows)")
    assert now["VmHWM"] <= limit + OVERHEAD
    # What the table added, over the process at rest: the limit, and malloc's and a message's share.
    assert now["VmHWM"] - rss_before <= limit + 2 * KEEP_FREED + 3 * MAX_MESSAGE


def test_abandoned_synchronous_pushes(cluster_factory, figures):
    """In sync mode a push stages its gradient until it is whole: an abandoned one keeps a copy of
    the variable, booked against the limit, so the next one that does not fit is refused."""
    cluster = cluster_factory(1, "--max-memory-bytes", str(LIMIT), "--keep-freed-bytes", str(KEEP_FREED),
                              "--max-message-bytes", str(MAX_MESSAGE), "--consistency", "sync")
    pid = cluster.servers[0].popen.pid
    with PSClient(cluster.addresses) as client:
        client.create_variable("big", shape=(2048, 1024), initializer=Uniform(seed=4),  # 8 MiB
                               optimizer=SGD(learning_rate=1.0))
        before = client.pull(["big"])["big"].tobytes(), client.describe()[0].variables["big"]
    rss_before = memory_status(pid)["VmRSS"]
    _reset_peak(pid)
    zeros = byte_view(np.zeros(1024, np.float32))
    refused = None
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        for n in range(20):
            begin = encode_push_begin("hostile", uuid.uuid4().hex, 1, 0, 1, ps_pb2.GRADIENT,
                                      [encode_push_item("big", 2048 * 1024, ps_pb2.FLOAT32)], step=0)
            message = encode_push_request(begin, [OutgoingChunk(
                encode_chunk_header("big", 0, 1024, ps_pb2.FLOAT32), zeros)])
            try:
                channel.stream_unary(method_path("Push"))(iter([message]), timeout=60)
            except grpc.RpcError as error:
                if error.code() == StatusCode.FAILED_PRECONDITION:  # PUSH_INCOMPLETE: abandoned
                    continue
                refused = (n, error)
                break
    assert refused is not None, "20 abandoned pushes, each staging 8 MiB, fitted a 64 MiB limit"
    n, error = refused
    assert error.code() == StatusCode.RESOURCE_EXHAUSTED and n >= 3, (n, error.details())
    with PSClient(cluster.addresses) as client:
        assert (client.pull(["big"])["big"].tobytes(), client.describe()[0].variables["big"]) == before
    now = memory_status(pid)
    figures.append(f"{'abandoned_synchronous_pushes':<40} before {rss_before / MiB:6.1f}  "
                   f"after {now['VmRSS'] / MiB:6.1f}  peak {now['VmHWM'] / MiB:6.1f}  (refused at {n})")
    assert now["VmHWM"] <= LIMIT + OVERHEAD


def test_a_synchronous_steps_sum_of_rows_filling_the_limit(cluster_factory, figures):
    """Complete sync pushes of 1,000 rows of 4 KiB each, from ever more workers, to a step that a
    registered worker never finishes: the step's running sum is booked (three copies of each row:
    the sum, and the copies that sum it by id when the step is applied), so RESOURCE_EXHAUSTED comes
    before the limit is passed and the refused push joins no sum."""
    cluster = cluster_factory(1, "--max-memory-bytes", str(LIMIT), "--keep-freed-bytes", str(KEEP_FREED),
                              "--max-message-bytes", str(MAX_MESSAGE), "--consistency", "sync")
    pid = cluster.servers[0].popen.pid
    rows, width = 1000, 1024
    ids = np.arange(rows, dtype="<i8")
    with PSClient(cluster.addresses, worker_id="never-pushes") as client:  # keeps step 0 open
        client.create_embedding("wide", width, initializer="zeros", optimizer=SGD(learning_rate=1.0))
        client.pull_rows("wide", ids)  # the rows exist: the pushes below add to the sum only
        rss_before = memory_status(pid)["VmRSS"]
        _reset_peak(pid)
        grads = byte_view(np.ones(rows * width, np.float32))
        refused = None
        with grpc.insecure_channel(cluster.addresses[0]) as channel:
            push = channel.stream_unary(method_path("Push"))
            for n in range(60):  # without booking, 60 sums of 4 MiB would pass the bound
                begin = encode_push_begin(f"worker-{n}", uuid.uuid4().hex, 1, 0, 1, ps_pb2.GRADIENT,
                                          [encode_push_item("wide", rows * width, ps_pb2.FLOAT32,
                                                            row_ids=ids.tobytes())], step=0)
                message = encode_push_request(begin, [OutgoingChunk(
                    encode_chunk_header("wide", 0, rows * width, ps_pb2.FLOAT32), grads)])
                try:
                    assert not ps_pb2.PushResponse.FromString(push(iter([message]), timeout=60)).dropped
                except grpc.RpcError as error:
                    refused = (n, error)
                    break
        assert refused is not None, "60 pushes of 4 MiB of rows to one open step fitted a 64 MiB limit"
        n, error = refused
        assert error.code() == StatusCode.RESOURCE_EXHAUSTED and n >= 3, (n, error.details())
        assert dict(error.trailing_metadata() or ()).get(REASON_METADATA_KEY) == "MEMORY_LIMIT"
        info = client.describe()[0]
        assert info.stored_bytes <= LIMIT
        assert info.stored_bytes >= n * 3 * rows * (8 + 4 * width), "the sums of the n pushes are booked"
        assert info.variables["wide"]["version"] == 0, "step 0 is still open"
    now = memory_status(pid)
    figures.append(f"{'a_synchronous_steps_sum_of_rows':<40} before {rss_before / MiB:6.1f}  "
                   f"after {now['VmRSS'] / MiB:6.1f}  peak {now['VmHWM'] / MiB:6.1f}  (refused at {n})")
    assert now["VmHWM"] <= LIMIT + OVERHEAD


# ---- the framed ports: the TCP lane and the replication port ------------------------------------

_LENGTH = struct.Struct("<I")
# What hostile peers may add to a server's peak RSS through a framed port: at most 64 first frames of
# 16 KiB, their threads' stacks as far as touched, and the refusals' logs (measured: under 16 MiB).
# Without the handshake's bounds the patterns below add hundreds of MiB.
PORT_GROWTH = 48 * MiB
# How long the hostile peers keep at it, and how long a connection may stay in its handshake (10 s
# deadline, with slack for a loaded machine).
FLOOD_SECONDS = 24.0
HANDSHAKE_CUT_SECONDS = 14.0


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


class _HostilePeers:
    """Raw sockets against one loopback port, for at most ``FLOOD_SECONDS``.

    ``drips`` connections send a first frame one byte every ``drip_seconds`` (each replaced when the
    server cuts it, as an attacker would); ``huge`` announces first frames of ``announced`` bytes and
    sends ``sent`` of them; ``crowd`` opens connections past every cap. ``stop`` closes every socket
    and says how long the cut drips lasted.
    """

    def __init__(self, port: int, drips: int, drip_seconds: float = 3.0) -> None:
        self._port = port
        self._drips = drips
        self._drip_seconds = drip_seconds
        self._stop = threading.Event()
        self._started = time.monotonic()
        # Guards _sockets and lifetimes (the drip thread and the test's thread both add).
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        #: Seconds each drip connection lasted before the server cut it.
        self.lifetimes: list[float] = []
        self._thread = threading.Thread(target=self._drip, name="hostile-drips", daemon=True)

    def _connect(self) -> socket.socket | None:
        try:
            sock = socket.create_connection(("127.0.0.1", self._port), timeout=5)
        except OSError:
            return None
        with self._lock:
            self._sockets.append(sock)
        return sock

    def start(self) -> _HostilePeers:
        self._thread.start()
        return self

    def _drip(self) -> None:
        frame = _LENGTH.pack(200) + bytes(200)  # would take 10 minutes at a byte every 3 s
        live: dict[socket.socket, list] = {}  # socket -> [connected at, bytes sent, last sent at]
        while not self._stop.is_set() and time.monotonic() - self._started < FLOOD_SECONDS:
            while len(live) < self._drips and not self._stop.is_set():
                sock = self._connect()
                if sock is None:
                    break
                sock.setblocking(False)
                live[sock] = [time.monotonic(), 0, 0.0]
            now = time.monotonic()
            for sock, state in list(live.items()):
                try:
                    if sock.recv(1) == b"":  # the server cut it (nothing is ever sent to a drip)
                        raise ConnectionResetError
                except BlockingIOError:
                    pass
                except OSError:
                    with self._lock:
                        self.lifetimes.append(now - state[0])
                    del live[sock]
                    sock.close()
                    continue
                if now - state[2] >= self._drip_seconds and state[1] < len(frame):
                    try:
                        sock.send(frame[state[1]:state[1] + 1])
                        state[1] += 1
                        state[2] = now
                    except OSError:
                        pass  # seen as cut on the next round
            self._stop.wait(0.1)

    def huge(self, count: int, announced: int, sent: int, prefix: bytes = b"") -> None:
        """``count`` first frames announcing ``announced`` bytes, ``sent`` of them sent, then left open."""
        body = prefix + bytes(sent - len(prefix))
        for _ in range(count):
            sock = self._connect()
            if sock is None:
                continue
            sock.settimeout(2.0)
            try:
                sock.sendall(_LENGTH.pack(announced) + body)
            except OSError:
                pass  # refused on its length, or the kernel's buffers are full: either way left open

    def crowd(self, count: int) -> int:
        """``count`` silent connections; how many the server closed at once (past its caps)."""
        opened = [sock for sock in (self._connect() for _ in range(count)) if sock is not None]
        time.sleep(1.0)
        closed = 0
        for sock in opened:
            sock.setblocking(False)
            try:
                closed += sock.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
        return closed

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            sock.close()


def _flood_figures(figures: list, name: str, pid: int, rss_before: int, threads: tuple[int, int],
                   extra: str) -> int:
    now = memory_status(pid)
    figures.append(f"{name:<40} before {rss_before / MiB:6.1f}  after {now['VmRSS'] / MiB:6.1f}  "
                   f"peak {now['VmHWM'] / MiB:6.1f}  threads {threads[0]} -> {threads[1]} at most  {extra}")
    return now["VmHWM"] - rss_before


def test_hostile_peers_on_the_lane_port(cluster_factory, token_file, figures, caplog):
    """Slow-drip hellos holding every handshake slot, hellos announcing 16 MiB without a token, and
    connections past every cap, against a server with --lane-port and a token: the drips are cut at
    the handshake's deadline, nothing is buffered past 16 KiB before the token is checked, the RSS
    stays bounded; a real worker's pushes and pulls are exact meanwhile (its lane, closed as it is
    accepted, falls back to the Exchange stream) and over the lane again afterwards."""
    cluster = cluster_factory(1, "--lane-port", "0", "--auth-token-file", str(token_file),
                              "--max-exchange-streams", "16", "--max-message-bytes", str(MAX_MESSAGE),
                              "--keep-freed-bytes", str(KEEP_FREED))
    pid = cluster.servers[0].popen.pid
    address = cluster.addresses[0]
    gradient = np.arange(1024, dtype=np.float32)
    with PSClient([address], auth_token="s3cret-token", register=False) as client:
        client.create_variable("w", shape=(1024,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        client.push({"w": gradient})  # the lane opens, and its answers' code is loaded
    with grpc.insecure_channel(address) as channel:
        port = ps_pb2.DescribeResponse.FromString(channel.unary_unary(method_path("Describe"))(
            ps_pb2.DescribeRequest().SerializeToString(), timeout=10,
            metadata=(("authorization", "Bearer s3cret-token"),))).lane_port
    assert port
    rss_before = memory_status(pid)["VmRSS"]
    threads_before, threads_peak = _threads(pid), 0
    _reset_peak(pid)
    hostile = _HostilePeers(port, drips=64).start()
    try:
        time.sleep(1.0)  # the drips hold every handshake slot
        hostile.huge(40, 16 * MiB, 4 * MiB)  # 160 MiB buffered if hellos were read to the message bound
        crowded = hostile.crowd(150)
        threads_peak = _threads(pid)
        # A worker now: its lane is closed as it is accepted, twice, and its requests go over the stream.
        with caplog.at_level(logging.WARNING, logger="worker_client"), \
                PSClient([address], auth_token="s3cret-token", worker_id="during", retry_timeout=20,
                         connect_timeout=10) as worker:
            for step in range(1, 4):
                worker.push({"w": gradient})
                np.testing.assert_array_equal(worker.pull(["w"])["w"], -gradient * (1 + step))
            threads_peak = max(threads_peak, _threads(pid))
        fell_back = [r for r in caplog.records if "broke 2 times in a row" in r.getMessage()]
        deadline = time.monotonic() + FLOOD_SECONDS
        while len(hostile.lifetimes) < 64 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        hostile.stop()
    grown = _flood_figures(figures, "lane port: drips, huge hellos, crowd", pid, rss_before,
                           (threads_before, threads_peak), f"({len(hostile.lifetimes)} drips cut)")
    assert crowded >= 100, f"only {crowded} of 150 connections past the caps were closed at once"
    assert len(fell_back) == 1, "the worker's lane, closed at its accept, did not fall back to the stream"
    assert len(hostile.lifetimes) >= 64, "slow-drip hellos were never cut off"
    assert max(hostile.lifetimes) <= HANDSHAKE_CUT_SECONDS, sorted(hostile.lifetimes)[-5:]
    assert threads_peak - threads_before <= 16 + 64 + 8
    assert grown <= PORT_GROWTH, f"the server's peak RSS grew {grown / MiB:.1f} MiB"
    # The flood over: a new worker's lane is the TCP lane again, and its values are exact.
    with PSClient([address], auth_token="s3cret-token", worker_id="after") as worker:
        worker.push({"w": gradient})
        np.testing.assert_array_equal(worker.pull(["w"])["w"], -gradient * 5)
        shard = worker._session.shards[0]
        assert shard._conn.tcp_lane.on_tcp and shard._conn.lane._stream is not None


def _replication_port(replica) -> int:
    """The replication port the replica announced (its 'replica started' log line)."""
    for line in replica.process.log_text().splitlines():
        if '"replica started"' in line:
            return int(json.loads(line)["replication_address"].rpartition(":")[2])
    raise AssertionError("no 'replica started' line:\n" + replica.process.log_text()[-3000:])


def test_hostile_peers_on_the_replication_port(tmp_path, etcd_server, token_file, figures):
    """A replicated primary's replication port: 100 peers announcing 65 MiB frames, slow-drip
    FollowStarts, FollowStarts with a wrong token, connections past every cap. The primary's RSS and
    threads stay bounded, its backup stays in sync, and a worker's pushes and pulls are exact."""
    from replica_testing import ReplicatedCluster

    cluster = ReplicatedCluster(tmp_path / "replicated", etcd_server.endpoint, 1, 2,
                                ("--auth-token-file", str(token_file)), health_token="s3cret-token")
    try:
        cluster.start()
        primary = cluster.primary(0)
        pid = primary.process.popen.pid
        port = _replication_port(primary)
        gradient = np.arange(1024, dtype=np.float32)
        with PSClient(cluster.addresses, auth_token="s3cret-token", register=False) as client:
            client.create_variable("w", shape=(1024,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
            client.push({"w": gradient})
        rss_before = memory_status(pid)["VmRSS"]
        threads_before, threads_peak = _threads(pid), 0
        _reset_peak(pid)
        hostile = _HostilePeers(port, drips=4).start()
        try:
            time.sleep(1.0)
            # 100 x 2 MiB of frames announcing 65 MiB: 200 MiB if read before the token is checked.
            hostile.huge(100, MAX_FRAME_BYTES, 2 * MiB)
            wrong = ps_pb2.FollowRequest(start=ps_pb2.FollowStart(shard_index=0, num_shards=1, token="nope"))
            for _ in range(20):  # whole FollowStarts with a wrong token: refused, logged at a bounded rate
                hostile.huge(1, len(wrong.SerializeToString()), len(wrong.SerializeToString()),
                             prefix=wrong.SerializeToString())
            crowded = hostile.crowd(100)
            threads_peak = _threads(pid)
            with PSClient(cluster.addresses, auth_token="s3cret-token", worker_id="during",
                          retry_timeout=20) as worker:
                for step in range(1, 4):
                    worker.push({"w": gradient})
                    np.testing.assert_array_equal(worker.pull(["w"])["w"], -gradient * (1 + step))
            threads_peak = max(threads_peak, _threads(pid))
            deadline = time.monotonic() + FLOOD_SECONDS
            while len(hostile.lifetimes) < 4 and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            hostile.stop()
        grown = _flood_figures(figures, "replication port: huge, drips, crowd", pid, rss_before,
                               (threads_before, threads_peak), f"({len(hostile.lifetimes)} drips cut)")
        assert crowded >= 90, f"only {crowded} of 100 connections past the caps were closed at once"
        assert len(hostile.lifetimes) >= 4 and max(hostile.lifetimes) <= HANDSHAKE_CUT_SECONDS
        assert threads_peak - threads_before <= 2 + 4 + 8
        assert grown <= PORT_GROWTH, f"the primary's peak RSS grew {grown / MiB:.1f} MiB"
        warnings = [line for line in primary.process.log_text().splitlines()
                    if '"level": "warning"' in line and "refused" in line]
        assert len(warnings) <= 4, warnings  # once a minute per kind of refusal, not once per peer
        # The flood over: the backup is still in sync and the primary serves.
        cluster.wait_all_ready(timeout=30)
        with PSClient(cluster.addresses, auth_token="s3cret-token", worker_id="after") as worker:
            worker.push({"w": gradient})
            np.testing.assert_array_equal(worker.pull(["w"])["w"], -gradient * 5)
    finally:
        cluster.stop()
