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
import pytest

from wehub_ps.specs import Explicit, VariableSpec
from wehub_ps.specs_proto import spec_to_proto
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.arrays import as_wire_array, byte_view
from wehub_ps.wire.codec import OutgoingChunk, encode_push_request
from wehub_ps.wire.rpc import method_path
from worker_client import SGD, PSClient, ResourceExhaustedError, VariableConflictError

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
import pytest
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
        request = ps_pb2.CreateVariableRequest(spec=spec_to_proto(spec), shard_index=0, num_shards=1)
        created = ps_pb2.CreateVariableResponse.FromString(
            channel.unary_unary(method_path("CreateVariable"))(request.SerializeToString(), timeout=HANG))
        assert created.created and not created.variable.initialized
        # Registered (a push registers nobody), so Describe counts its pushes as they arrive.
        beat = ps_pb2.HeartbeatRequest(worker_id="slow", incarnation="slow-1")
        channel.unary_unary(method_path("Heartbeat"))(beat.SerializeToString(), timeout=HANG)
        uploader = threading.Thread(target=slow_upload, name="slow-upload")
        uploader.start()
        deadline = time.monotonic() + HANG
        while not client.describe()[0].workers["slow"]["pushes"]:  # its first message reached the server
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


# A create refused by one shard. Limit 2 MB per shard; "x" (240 KB) lands on shard 0 only, "big"
# needs 1.9 MB on each of the two shards: shard 1 accepts it, shard 0 (with "x") refuses it.
_LIMIT = ("--max-memory-bytes", "2000000")
_BIG = (950_000,)
# 1.6 MB on each shard: fits next to "x", but not next to 1.9 MB still booked for "big" on shard 1.
_MID = (800_000,)


def _held(client: PSClient) -> list[tuple[dict[str, tuple[int, int]], int]]:
    """Each shard's variables (with their rows) and stored bytes, as Describe reports them."""
    return [({name: (v["row_start"], v["row_end"]) for name, v in info.variables.items()}, info.stored_bytes)
            for info in client.describe()]


def test_a_create_refused_by_one_shard_leaves_nothing_on_any_shard(cluster_factory):
    cluster = cluster_factory(2, *_LIMIT)
    with PSClient(cluster.addresses) as client:
        client.create_variable("x", shape=(60_000,), optimizer=SGD(learning_rate=1.0))
        before = _held(client)
        assert before[0][0] == {"x": (0, 60_000)} and before[1][1] == 0
        with pytest.raises(ResourceExhaustedError, match="--max-memory-bytes"):
            client.create_variable("big", shape=_BIG, optimizer=SGD(learning_rate=1.0))
        assert _held(client) == before, "a refused create leaves no part on any shard"
        assert list(client.pull()) == ["x"]
        assert sorted(client.variables(refresh=True)) == ["x"]
    with PSClient(cluster.addresses) as fresh:
        assert sorted(fresh.variables(refresh=True)) == ["x"]
        assert list(fresh.pull()) == ["x"]
        fresh.push({"x": np.ones(60_000, np.float32)})
        np.testing.assert_array_equal(fresh.pull(["x"])["x"], np.full(60_000, -1.0, np.float32))
        # Shard 1 gave back what it set aside for "big": a variable that needs it fits.
        fresh.create_variable("mid", shape=_MID, optimizer=SGD(learning_rate=1.0))
        assert sorted(fresh.variables(refresh=True)) == ["mid", "x"]


def test_a_booked_create_is_not_refused_for_memory_taken_after_its_validation(cluster_factory):
    """The server side of a create: validate (book), then create, cancel, conflict (raw requests)."""
    cluster = cluster_factory(1, *_LIMIT)
    booked = VariableSpec("a", (400_000,), "float32")  # 1.6 MB

    def request(spec: VariableSpec, **fields) -> ps_pb2.CreateVariableResponse:
        message = ps_pb2.CreateVariableRequest(spec=spec_to_proto(spec), shard_index=0, num_shards=1, **fields)
        return ps_pb2.CreateVariableResponse.FromString(
            create(message.SerializeToString(), timeout=HANG))

    with grpc.insecure_channel(cluster.addresses[0]) as channel, PSClient(cluster.addresses) as client:
        create = channel.unary_unary(method_path("CreateVariable"))
        answer = request(booked, validate_only=True, booking="first")
        assert not answer.created and not answer.HasField("variable")
        assert _held(client) == [({}, 0)], "a validation creates nothing"
        # Memory taken by another create after the validation: the booked bytes are not free.
        with pytest.raises(ResourceExhaustedError, match="--max-memory-bytes"):
            client.create_variable("other", shape=(200_000,))
        # Another spec under the booked name is refused, validated or created.
        other_spec = VariableSpec("a", (400_001,), "float32")
        for fields in ({"validate_only": True, "booking": "second"}, {}):
            with pytest.raises(grpc.RpcError) as refused:
                request(other_spec, **fields)
            assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS, refused.value.details()
        assert request(booked, validate_only=True, booking="first").created is False  # a renewal
        answer = request(booked)
        assert answer.created and answer.variable.spec.name == "a"
        assert _held(client) == [({"a": (0, 400_000)}, 1_600_000)]
        # A cancelled booking gives its bytes back at once: 0.4 MB are free again after it.
        request(VariableSpec("c", (50_000,), "float32"), validate_only=True, booking="third")
        request(VariableSpec("c", (50_000,), "float32"), validate_only=True, booking="third",
                cancel_booking=True)
        client.create_variable("d", shape=(100_000,))
        assert sorted(client.variables(refresh=True)) == ["a", "d"]


def test_concurrent_creators_leave_every_variable_on_every_shard_or_on_none(cluster_factory):
    """Threads create the same small variables, a refused one, and conflicting specs, at once."""
    cluster = cluster_factory(2, *_LIMIT)
    with PSClient(cluster.addresses) as client:
        client.create_variable("x", shape=(60_000,))
    names = [f"s{i}" for i in range(10)]
    contested = [f"c{i}" for i in range(10)]
    threads_n = 4
    barrier = threading.Barrier(threads_n)
    outcomes: dict[tuple[int, str], str] = {}
    lock = threading.Lock()  # guards outcomes

    def create(index: int) -> None:
        with PSClient(cluster.addresses) as worker:
            barrier.wait(HANG)
            for name, contested_name in zip(names, contested):
                for key, call in ((name, lambda: worker.create_variable(name, shape=(200,))),
                                  ("big", lambda: worker.create_variable("big", shape=_BIG)),
                                  # Each thread its own spec of this name: at most one can win.
                                  (contested_name,
                                   lambda: worker.create_variable(contested_name, shape=(100 + index,)))):
                    try:
                        call()
                        outcome = "ok"
                    except (ResourceExhaustedError, VariableConflictError) as exc:
                        outcome = type(exc).__name__
                    with lock:
                        outcomes[(index, key)] = outcome

    threads = [threading.Thread(target=create, args=(i,), name=f"creator-{i}") for i in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG)
        assert not thread.is_alive()
    assert all(outcomes[(i, name)] == "ok" for i in range(threads_n) for name in names), outcomes
    assert all(outcomes[(i, "big")] == "ResourceExhaustedError" for i in range(threads_n)), outcomes
    with PSClient(cluster.addresses) as fresh:
        infos = fresh.describe()
        held = [set(info.variables) for info in infos]
        assert held[0] == held[1], "every variable is on every shard or on none"
        assert "big" not in held[0]
        for name in contested:
            winners = [i for i in range(threads_n) if outcomes[(i, name)] == "ok"]
            assert len(winners) <= 1, (name, winners)
            assert (name in held[0]) == bool(winners), (name, winners)
            if winners:
                assert fresh.variables()[name].shape == (100 + winners[0],)
            assert all(outcomes[(i, name)] in ("ok", "VariableConflictError") for i in range(threads_n))
        assert sorted(fresh.pull()) == sorted(held[0])
        # Every booking of "big" was given back.
        fresh.create_variable("mid", shape=_MID)
        assert "mid" in fresh.variables(refresh=True)


# An array create books its part and the buffer its value is uploaded into (the same bytes again).
_ARRAY_REFUSED = 600_000  # 1.2 MB per shard, 2.4 MB with the buffer: over the 2 MB limit
_ARRAY = 400_000  # 0.8 MB per shard, 1.6 MB with the buffer


def test_an_array_create_that_cannot_fit_its_upload_leaves_nothing_on_any_shard(cluster_factory):
    cluster = cluster_factory(2, *_LIMIT)
    with PSClient(cluster.addresses) as client:
        client.create_variable("x", shape=(60_000,), optimizer=SGD(learning_rate=1.0))
        before = _held(client)
        with pytest.raises(ResourceExhaustedError, match="initial value is uploaded"):
            client.create_variable("arr", shape=(_ARRAY_REFUSED,),
                                   initializer=_initial("arr", _ARRAY_REFUSED))
        assert _held(client) == before, "a refused array create leaves no part on any shard"
        assert list(client.pull()) == ["x"]
    with PSClient(cluster.addresses) as fresh:
        assert sorted(fresh.variables(refresh=True)) == ["x"]
        assert list(fresh.pull()) == ["x"]
        # One that fits is created; its upload buffers are given back once it has its value.
        fresh.create_variable("arr", shape=(_ARRAY,), initializer=_initial("arr", _ARRAY))
        np.testing.assert_array_equal(fresh.pull(["arr"])["arr"], _initial("arr", _ARRAY))
        assert [stored for _, stored in _held(fresh)] == [240_000 + _ARRAY * 2, _ARRAY * 2]


def _fill(client: PSClient, prefix: str) -> list[str]:
    """Create 160 KB variables (one shard each) until a shard refuses one: memory taken by others."""
    names = []
    for i in range(20):
        try:
            client.create_variable(f"{prefix}{i}", shape=(40_000,))
        except ResourceExhaustedError:
            return names
        names.append(f"{prefix}{i}")
    raise AssertionError("the shard never filled up")


def test_a_validated_array_create_is_not_refused_for_memory_taken_before_its_upload(cluster_factory):
    """Validate (book) on both shards, fill the shards, create, fill again, then upload."""
    cluster = cluster_factory(2, *_LIMIT)
    value = _initial("arr", _ARRAY)
    spec = VariableSpec("arr", (_ARRAY,), "float32",
                        initializer=Explicit(hashlib.sha256(byte_view(as_wire_array(value))).digest()))
    channels = [grpc.insecure_channel(address) for address in cluster.addresses]
    try:
        def on_both(**fields) -> None:
            for index, channel in enumerate(channels):
                message = ps_pb2.CreateVariableRequest(spec=spec_to_proto(spec), shard_index=index, num_shards=2,
                                                       **fields)
                channel.unary_unary(method_path("CreateVariable"))(message.SerializeToString(), timeout=HANG)

        with PSClient(cluster.addresses) as client, PSClient(cluster.addresses) as other:
            on_both(validate_only=True, booking="validated")
            fillers = _fill(other, "f")
            on_both()
            fillers += _fill(other, "g")
            assert fillers, "memory was taken between the validation and the upload"
            # The creator goes on: its create_variable finds the variable and uploads the value.
            client.create_variable("arr", shape=(_ARRAY,), initializer=value)
            np.testing.assert_array_equal(client.pull(["arr"])["arr"], value)
            client.variables(refresh=True)
            assert sorted(client.pull()) == sorted(["arr", *fillers])
            stored = sum(stored for _, stored in _held(client))
            assert stored == _ARRAY * 4 + 160_000 * len(fillers), "the upload buffers were given back"
    finally:
        for channel in channels:
            channel.close()


def test_concurrent_array_creates_on_a_nearly_full_shard_all_succeed(cluster_factory):
    """Only one upload buffer fits beside the variable: the other creators' uploads wait for it."""
    cluster = cluster_factory(2, *_LIMIT)
    value = _initial("arr", _ARRAY)
    threads_n = 4
    barrier = threading.Barrier(threads_n)
    outcomes: list[str] = []
    lock = threading.Lock()  # guards outcomes

    def create() -> None:
        with PSClient(cluster.addresses, chunk_bytes=8192) as worker:
            barrier.wait(HANG)
            try:
                worker.create_variable("arr", shape=(_ARRAY,), initializer=value)
                outcome = "ok"
            except ResourceExhaustedError as exc:
                outcome = f"ResourceExhaustedError: {exc}"
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=create, name=f"creator-{i}") for i in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG)
        assert not thread.is_alive()
    assert outcomes == ["ok"] * threads_n, outcomes
    with PSClient(cluster.addresses) as fresh:
        np.testing.assert_array_equal(fresh.pull()["arr"], value)
        assert [stored for _, stored in _held(fresh)] == [_ARRAY * 2, _ARRAY * 2]
