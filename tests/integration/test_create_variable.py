"""create_variable against real ps-servers: idempotent under races, never in the way of
pushes, and durable the moment it returns."""

from __future__ import annotations

import hashlib
import inspect
import json
import signal
import threading
import time

import grpc
import numpy as np

from wehub_ps.codec import OutgoingChunk, as_wire_array, byte_view, encode_push_request
from wehub_ps.rpc import method_path
from wehub_ps.specs import Explicit, VariableSpec
from wehub_ps.v1 import ps_pb2
from worker_client import SGD, PSClient

HANG = 120  # seconds: a generous bound that only detects hangs


def _ckpt_args(root, interval: float = 300) -> tuple[str, ...]:
    return ("--checkpoint-dir", str(root), "--checkpoint-interval", str(interval))


def _size(name: str) -> int:
    """Small variables (one chunk, one shard) race most: an upload completes between another
    creator's create and its upload; "large" is split over both shards and uploaded in many
    chunks, so its uploads overlap."""
    return 120_000 if name == "large" else 2000


def _initial(name: str, size: int) -> np.ndarray:
    """A variable's explicit initial value; every creator builds the same one from the name."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
    return np.random.default_rng(seed).standard_normal(size).astype(np.float32)


# A creator process: connects, says "ready", waits for the start file, creates every variable.
_CREATOR = """
import hashlib, json, os, sys, time
import numpy as np
from worker_client import PSClient
""" + inspect.getsource(_size) + inspect.getsource(_initial) + """
addresses, names, go = sys.argv[1].split(","), sys.argv[2].split(","), sys.argv[3]
outcomes = {}
with PSClient(addresses, chunk_bytes=8192) as client:
    client.describe()  # connected
    print("ready", flush=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(go) and time.monotonic() < deadline:  # start with the other creators
        time.sleep(0.005)
    for name in names:
        try:
            client.create_variable(name, shape=(_size(name),), initializer=_initial(name, _size(name)))
            outcomes[name] = "ok"
        except Exception as exc:
            outcomes[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(outcomes), flush=True)
"""


def test_concurrent_creates_from_equal_arrays_all_succeed(cluster_factory, tmp_path):
    """Threads and processes create the same variables from their own equal arrays at once."""
    cluster = cluster_factory(2, *_ckpt_args(tmp_path / "ckpt"))
    names = [f"w{i}" for i in range(10)] + ["large"]
    go = tmp_path / "go"
    processes = [cluster_factory.python(_CREATOR, ",".join(cluster.addresses), ",".join(names), str(go))
                 for _ in range(3)]
    outcomes: list[dict[str, str]] = []
    lock = threading.Lock()
    barrier = threading.Barrier(5)

    def create() -> None:
        result = {}
        with PSClient(cluster.addresses, chunk_bytes=8192) as client:
            barrier.wait(HANG)
            for name in names:
                try:
                    client.create_variable(name, shape=(_size(name),),
                                           initializer=_initial(name, _size(name)))
                    result[name] = "ok"
                except Exception as exc:  # recorded, asserted below
                    result[name] = f"{type(exc).__name__}: {exc}"
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=create, name=f"creator-{i}") for i in range(4)]
    for thread in threads:
        thread.start()
    for process in processes:
        assert process.stdout.readline().strip() == "ready", process.stderr.read()[-3000:]
    go.touch()
    barrier.wait(HANG)
    for thread in threads:
        thread.join(HANG)
    for process in processes:
        out, err = process.communicate(timeout=HANG)
        assert process.returncode == 0, err[-3000:]
        outcomes.append(json.loads(out.strip().splitlines()[-1]))
    failures = [(name, outcome) for result in outcomes for name, outcome in result.items() if outcome != "ok"]
    assert not failures, failures
    assert len(outcomes) == 7 and all(len(result) == len(names) for result in outcomes)
    with PSClient(cluster.addresses) as client:
        values = client.pull(names)
        for name in names:
            np.testing.assert_array_equal(values[name], _initial(name, _size(name)))
        infos = client.describe()
        # Every staging buffer was given back: only the variables themselves are stored.
        assert sum(info.stored_bytes for info in infos) == sum(_size(name) * 4 for name in names)


def test_a_late_slow_upload_never_overwrites_trained_values(cluster_factory):
    """An upload stalls after its first chunk; another completes, training starts; the rest arrives."""
    cluster = cluster_factory(1)
    address = cluster.addresses[0]
    size, quarter = 4000, 1000
    value = _initial("v", size)
    digest = hashlib.sha256(value.tobytes()).digest()
    spec = VariableSpec("v", (size,), "float32", initializer=Explicit(digest),
                        optimizer=SGD(learning_rate=1.0))
    release = threading.Event()
    answers: list[ps_pb2.PushResponse | grpc.RpcError] = []

    def chunk(offset: int) -> OutgoingChunk:
        header = ps_pb2.ChunkHeader(variable="v", offset=offset, count=quarter, dtype=ps_pb2.FLOAT32)
        return OutgoingChunk(header, byte_view(as_wire_array(value[offset:offset + quarter])))

    def messages():
        item = ps_pb2.PushItem(variable="v", elements=size, wire_dtype=ps_pb2.FLOAT32)
        begin = ps_pb2.PushBegin(worker_id="slow", incarnation="slow-1", sequence=1, shard_index=0,
                                 num_shards=1, kind=ps_pb2.ASSIGN, items=[item])
        yield encode_push_request(begin, [chunk(0)])
        assert release.wait(HANG)
        for offset in range(quarter, size, quarter):
            yield encode_push_request(None, [chunk(offset)])

    def slow_upload() -> None:
        try:
            raw = channel.stream_unary(method_path("Push"))(messages(), timeout=HANG)
            answers.append(ps_pb2.PushResponse.FromString(raw))
        except grpc.RpcError as exc:
            answers.append(exc)

    with grpc.insecure_channel(address) as channel, PSClient(cluster.addresses) as client:
        request = ps_pb2.CreateVariableRequest(spec=spec.to_proto(), shard_index=0, num_shards=1)
        created = ps_pb2.CreateVariableResponse.FromString(
            channel.unary_unary(method_path("CreateVariable"))(request.SerializeToString(), timeout=HANG))
        assert created.created and not created.variable.initialized
        uploader = threading.Thread(target=slow_upload, name="slow-upload")
        uploader.start()
        deadline = time.monotonic() + HANG
        while "slow" not in client.describe()[0].workers:  # its first message has reached the server
            assert time.monotonic() < deadline, "the slow upload never reached the server"
            time.sleep(0.01)
        # Another worker creates the variable from its own (equal) array: its upload completes first.
        client.create_variable("v", shape=(size,), initializer=value, optimizer=SGD(learning_rate=1.0))
        np.testing.assert_array_equal(client.pull(["v"])["v"], value)
        client.push({"v": np.ones(size, np.float32)})
        trained = value - np.float32(1.0)
        np.testing.assert_array_equal(client.pull(["v"])["v"], trained)
        release.set()  # the slow upload's last three chunks arrive now
        uploader.join(HANG)
        assert len(answers) == 1 and isinstance(answers[0], ps_pb2.PushResponse), answers
        assert answers[0].duplicate and answers[0].elements_applied == 0, "a late upload changes nothing"
        np.testing.assert_array_equal(client.pull(["v"])["v"], trained)


def test_a_push_and_a_checkpoint_complete_while_a_big_variable_fills(cluster_factory, tmp_path):
    cluster = cluster_factory(1, *_ckpt_args(tmp_path / "ckpt", interval=0))
    elements = 48_000_000  # 192 MB of `normal` values: seconds of filling on this machine
    created = threading.Event()
    errors: list[BaseException] = []

    def create_big() -> None:
        try:
            with PSClient(cluster.addresses) as other:
                other.create_variable("big", shape=(elements,), initializer="normal")
        except BaseException as exc:  # reported below
            errors.append(exc)
        created.set()

    with PSClient(cluster.addresses) as client:
        client.create_variable("small", shape=(4,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        creator = threading.Thread(target=create_big, name="create-big")
        creator.start()
        deadline = time.monotonic() + HANG
        while client.describe()[0].stored_bytes < elements * 4:  # booked: its fill has begun
            assert time.monotonic() < deadline and not created.is_set(), errors
            time.sleep(0.01)
        client.checkpoint()
        client.push({"small": np.ones(4, np.float32)})
        pushed_while_filling = not created.is_set()
        creator.join(HANG)
        assert not errors, errors
        assert pushed_while_filling, "the checkpoint and the push waited for the create"
        np.testing.assert_array_equal(client.pull(["small"])["small"], np.full(4, -1, np.float32))
        assert client.describe()[0].variables["big"]["initialized"]
    server = cluster.servers[0]
    server.signal(signal.SIGKILL)  # (no final checkpoint of 192 MB to write)
    server.wait(30)


def _create_all(client: PSClient) -> None:
    """One variable of each kind: initializer-made (split over shards), uploaded (split), table, small."""
    client.create_variable("dense", shape=(2000, 128), initializer="normal", optimizer=SGD(learning_rate=1.0))
    client.create_variable("arr", shape=(3000, 100), initializer=_initial("arr", 300_000).reshape(3000, 100),
                           optimizer=SGD(learning_rate=1.0))
    client.create_embedding("emb", dim=8, initializer="normal", optimizer=SGD(learning_rate=1.0))
    client.create_variable("z", shape=(4,), initializer="zeros", optimizer=SGD(learning_rate=1.0))


def _state(client: PSClient) -> dict[str, np.ndarray]:
    values = client.pull(["dense", "arr", "z"])
    values["emb"] = client.pull_rows("emb", np.array([1, 2, 3, 1 << 40]))
    return values


def _kill_all_and_restart(cluster) -> None:
    for server in cluster.servers:
        server.signal(signal.SIGKILL)
    for server in cluster.servers:
        server.wait(30)
    for server in cluster.servers:
        server.launch(server.port)
    for server in cluster.servers:
        server.wait_ready()


def test_variables_survive_a_crash_before_the_first_checkpoint(cluster_factory, tmp_path):
    cluster = cluster_factory(2, *_ckpt_args(tmp_path / "ckpt"))  # periodic checkpoints every 300 s
    with PSClient(cluster.addresses, retry_timeout=HANG) as client:
        _create_all(client)
        assert len(client.variables()["dense"].placement.parts) == 2
        assert len(client.variables()["arr"].placement.parts) == 2
        initial = _state(client)
        np.testing.assert_array_equal(initial["arr"].ravel(), _initial("arr", 300_000))
        assert not any(info.last_checkpoint for info in client.describe())
        _kill_all_and_restart(cluster)
        # The same worker carries on: every variable is there with its initial value.
        after = _state(client)
        for name, value in initial.items():
            assert after[name].tobytes() == value.tobytes(), name
        # Pushes after that follow the loss rule: lost with a crash unless a checkpoint has them.
        client.push({"z": np.ones(4, np.float32)})
        _kill_all_and_restart(cluster)
        np.testing.assert_array_equal(client.pull(["z"])["z"], np.zeros(4, np.float32))
        client.push({"z": np.ones(4, np.float32)})
        client.checkpoint()
        client.push({"z": np.ones(4, np.float32)})
        _kill_all_and_restart(cluster)
        np.testing.assert_array_equal(client.pull(["z"])["z"], np.full(4, -1, np.float32))
        assert client.pull(["arr"])["arr"].tobytes() == initial["arr"].tobytes()


def test_variables_created_before_a_crash_restore_onto_another_shard_count(cluster_factory, tmp_path):
    root = tmp_path / "ckpt"
    two = cluster_factory(2, *_ckpt_args(root))
    with PSClient(two.addresses) as client:
        _create_all(client)
        initial = _state(client)
    for server in two.servers:  # no checkpoint was ever written
        server.signal(signal.SIGKILL)
    for server in two.servers:
        server.wait(30)
    three = cluster_factory(3, *_ckpt_args(root))
    with PSClient(three.addresses) as client:
        assert len(client.variables(refresh=True)["arr"].placement.parts) == 3
        after = _state(client)
        for name, value in initial.items():
            assert after[name].tobytes() == value.tobytes(), name
