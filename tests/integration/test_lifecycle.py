"""Health, restoring, draining and SIGTERM: every RPC answers as documented in each phase.

docs/failure-semantics.md ("Servers: starting and stopping") states what these tests check.
"""

from __future__ import annotations

import pathlib
import platform
import signal
import threading
import time

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ps_server import ServerConfig, create_server
from wehub_ps.errors import REASON_METADATA_KEY
from wehub_ps.specs import VariableSpec
from wehub_ps.specs_proto import spec_to_proto
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.arrays import byte_view
from wehub_ps.wire.codec import (
    EXCHANGE_ERROR,
    EXCHANGE_PULL,
    EXCHANGE_PUSH,
    OutgoingChunk,
    decode_envelope,
    encode_envelope,
    encode_push_request,
)
from wehub_ps.wire.rpc import method_path
from worker_client import SGD, PSClient, PSUnavailableError

SERVICE = "wehub_ps.v1.ParameterServer"


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status


@pytest.fixture
def in_process_server():
    server = create_server(ServerConfig(host="127.0.0.1", port=0, drain_timeout=20))
    yield server
    server.grpc_server.stop(0)


def test_health_is_not_serving_until_started(in_process_server):
    server = in_process_server
    # Bound but not serving yet: the servicer already answers NOT_SERVING.
    server.start_transport()
    assert _health(f"127.0.0.1:{server.port}") == health_pb2.HealthCheckResponse.NOT_SERVING
    server.mark_serving()
    assert _health(f"127.0.0.1:{server.port}") == health_pb2.HealthCheckResponse.SERVING


def test_stop_drains_a_push_in_flight_and_refuses_new_work(in_process_server):
    server = in_process_server
    server.start()
    address = f"127.0.0.1:{server.port}"
    with PSClient([address]) as client:
        client.create_variable("w", shape=(1000,), initializer="zeros", optimizer=SGD(learning_rate=1.0))

    # A push whose second half waits until the server has started draining.
    release = threading.Event()
    ones = np.ones(1000, np.float32)

    def messages():
        begin = ps_pb2.PushBegin(worker_id="slow", incarnation="i", sequence=1, shard_index=0, num_shards=1,
                                 kind=ps_pb2.GRADIENT,
                                 items=[ps_pb2.PushItem(variable="w", elements=1000, wire_dtype=ps_pb2.FLOAT32)])
        header = ps_pb2.ChunkHeader(variable="w", offset=0, count=500, dtype=ps_pb2.FLOAT32)
        yield encode_push_request(begin, [OutgoingChunk(header, byte_view(ones[:500]))])
        release.wait(10)
        header = ps_pb2.ChunkHeader(variable="w", offset=500, count=500, dtype=ps_pb2.FLOAT32)
        yield encode_push_request(None, [OutgoingChunk(header, byte_view(ones[500:]))])

    channel = grpc.insecure_channel(address)
    future = channel.stream_unary(method_path("Push")).future(messages(), timeout=30)
    while server.lifecycle.in_flight == 0:
        time.sleep(0.01)
    stopper = threading.Thread(target=server.stop, kwargs={"grace": 5})
    stopper.start()
    while server.lifecycle.accepting:
        time.sleep(0.01)
    assert _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(PSUnavailableError, match="shutting down"):
        with PSClient([address], connect_timeout=5, retry_timeout=0.5) as late:
            late.push({"w": ones})
    release.set()
    response = ps_pb2.PushResponse.FromString(future.result())
    assert response.elements_applied == 1000
    stopper.join(30)
    assert not stopper.is_alive()
    np.testing.assert_array_equal(server.store.get("w").value, -ones)
    channel.close()


def test_finish_is_acknowledged_again_while_finishing_and_refused_while_draining_otherwise():
    def finish(address: str) -> tuple[grpc.StatusCode, str | None, str]:
        with grpc.insecure_channel(address) as channel:
            request = ps_pb2.FinishRequest(worker_id="chief").SerializeToString()
            return _answer(lambda: channel.unary_unary(method_path("Finish"))(request, timeout=10))

    for finishing in (True, False):
        server = create_server(ServerConfig(host="127.0.0.1", port=0, allow_finish=True))
        try:
            server.start()
            address = f"127.0.0.1:{server.port}"
            if finishing:
                assert finish(address)[0] == grpc.StatusCode.OK
            server.lifecycle.drain(0)  # what stop() does first, for SIGTERM and finish() alike
            code, reason, details = finish(address)
            if finishing:
                assert code == grpc.StatusCode.OK
            else:
                assert (code, reason) == (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN"), details
                assert not server.finish_requested.is_set()
        finally:
            server.grpc_server.stop(0)


def test_sigterm_during_pushes_finishes_them_and_exits_zero(cluster_factory):
    cluster = cluster_factory(1)
    server = cluster.servers[0]
    applied = []
    failures = []
    with PSClient(cluster.addresses, retry_timeout=2) as client:
        client.create_variable("w", shape=(2000, 1000), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        grad = np.ones((2000, 1000), np.float32)
        stop = threading.Event()

        def pusher():
            while not stop.is_set():
                try:
                    client.push({"w": grad})
                    applied.append(1)
                except PSUnavailableError as exc:
                    failures.append(exc)
                    return

        thread = threading.Thread(target=pusher)
        thread.start()
        while len(applied) < 3:
            time.sleep(0.01)
        server.signal(signal.SIGTERM)
        assert server.wait(30) == 0
        stop.set()
        thread.join(30)
    log = server.log_text()
    assert '"event": "stopped", "drained": true' in log
    # Every push that was acknowledged was applied; none was cut in half:
    # the server answered each one in full or refused it before it began.
    assert failures, "the pusher should have been refused once the server stopped"


def test_sigterm_ends_idle_exchange_streams_after_the_final_checkpoint(cluster_factory, tmp_path):
    """An idle client's Exchange stream is cancelled once the final checkpoint is written, instead of
    holding gRPC's stop grace period open; the client carries on against the restarted server."""
    cluster = cluster_factory(1, "--checkpoint-dir", str(tmp_path / "ckpt"))
    server = cluster.servers[0]
    with PSClient(cluster.addresses, worker_id="idle", retry_timeout=60) as client:
        client.create_variable("x", shape=(4,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        client.push({"x": np.ones(4, np.float32)})  # small: over the Exchange stream, which stays open
        server.signal(signal.SIGTERM)
        assert server.wait(30) == 0
        stopped = [line for line in server.log_text().splitlines() if '"event": "stopped"' in line]
        assert stopped and '"ended_exchange_streams": 1' in stopped[-1], stopped
        server.start(server.port)
        client.push({"x": np.ones(4, np.float32)})
        np.testing.assert_array_equal(client.pull(["x"])["x"], np.full(4, -2.0, np.float32))


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="malloc settings exist in glibc only")
@pytest.mark.parametrize("flags, arena_max", [((), "2"), (("--malloc-arenas", "0"), "null"),
                                              (("--malloc-arenas", "6"), "6")])
def test_the_server_caps_malloc_arenas_as_configured(cluster_factory, flags, arena_max):
    server = cluster_factory(1, "--log-level", "debug", *flags).servers[0]
    with PSClient(server.address) as client:
        client.create_variable("w", shape=(4,))  # the server is up and serving
    assert f'"arena_max": {arena_max}' in server.log_text()


# ---- every RPC in every phase, against real ps-server processes ----------------------------------------

def _reason(error: grpc.RpcError) -> str | None:
    return dict(error.trailing_metadata() or ()).get(REASON_METADATA_KEY)


def _answer(call) -> tuple[grpc.StatusCode, str | None, str]:
    """(code, reason, details) of a raw call; (OK, None, "") when it was answered."""
    try:
        call()
    except grpc.RpcError as error:
        return error.code(), _reason(error), error.details() or ""
    return grpc.StatusCode.OK, None, ""


def _push_message(variable: str, sequence: int, worker: str = "probe", elements: int = 4,
                  chunk: tuple[int, int] = (0, 4), value: float = 1.0, begin: bool = True) -> bytes:
    """One PushRequest message: the PushBegin of a push of ``elements`` (when ``begin``) and one chunk."""
    head = ps_pb2.PushBegin(worker_id=worker, incarnation=f"{worker}-incarnation", sequence=sequence,
                            shard_index=0, num_shards=1, kind=ps_pb2.GRADIENT,
                            items=[ps_pb2.PushItem(variable=variable, elements=elements,
                                                   wire_dtype=ps_pb2.FLOAT32)]) if begin else None
    offset, count = chunk
    header = ps_pb2.ChunkHeader(variable=variable, offset=offset, count=count, dtype=ps_pb2.FLOAT32)
    return encode_push_request(head, [OutgoingChunk(header, byte_view(np.full(count, value, np.float32)))])


def _every_rpc(address: str, sequence: int) -> dict[str, tuple[grpc.StatusCode, str | None, str]]:
    """One call of each ParameterServer RPC, each of which acts on the shard when it is served.

    The push and the pulls address "small"; the create makes a variable "fresh".
    """
    pull = ps_pb2.PullRequest(shard_index=0, num_shards=1, items=[ps_pb2.PullItem(variable="small")],
                              worker_id="probe", incarnation="probe-incarnation").SerializeToString()
    push = _push_message("small", sequence)
    create = ps_pb2.CreateVariableRequest(spec=spec_to_proto(VariableSpec("fresh", (4,), np.dtype(np.float32))),
                                          shard_index=0, num_shards=1).SerializeToString()
    heartbeat = ps_pb2.HeartbeatRequest(worker_id="probe", incarnation="probe-incarnation",
                                        step=7).SerializeToString()
    with grpc.insecure_channel(address) as channel:
        def unary(method: str, request: bytes):
            return lambda: channel.unary_unary(method_path(method))(request, timeout=10)

        answers = {
            "Checkpoint": _answer(unary("Checkpoint", ps_pb2.CheckpointRequest().SerializeToString())),
            "Heartbeat": _answer(unary("Heartbeat", heartbeat)),
            "Describe": _answer(unary("Describe", ps_pb2.DescribeRequest().SerializeToString())),
            "CreateVariable": _answer(unary("CreateVariable", create)),
            "Finish": _answer(unary("Finish", ps_pb2.FinishRequest(worker_id="probe").SerializeToString())),
            "Push": _answer(lambda: channel.stream_unary(method_path("Push"))(iter([push]), timeout=10)),
            "Pull": _answer(lambda: list(channel.unary_stream(method_path("Pull"))(pull, timeout=10))),
        }
        requests = [encode_envelope(1, EXCHANGE_PULL, pull), encode_envelope(2, EXCHANGE_PUSH, push)]
        replies = channel.stream_stream(method_path("Exchange"))(iter(requests), timeout=10)
        for name, reply in zip(("Exchange pull", "Exchange push"), replies):
            _, field, payload = decode_envelope(reply)
            if field != EXCHANGE_ERROR:
                answers[name] = (grpc.StatusCode.OK, None, "")
                continue
            error = ps_pb2.ExchangeError.FromString(payload)
            code = next(c for c in grpc.StatusCode if c.value[0] == error.code)
            answers[name] = (code, error.reason, error.message)
    return answers


def _health_list(address: str) -> dict[str, int]:
    with grpc.insecure_channel(address) as channel:
        listed = health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=10).statuses
    return {name: s.status for name, s in listed.items()}


def _checkpoints_on_disk(root: pathlib.Path) -> dict[str, bytes]:
    """Every checkpoint of shard 0 of 1: its directory name and its manifest's bytes."""
    shard = root / "shard-0-of-1"
    return {p.name: (p / "manifest.json").read_bytes() for p in sorted(shard.glob("ckpt-*"))}


def _values(address: str, names: list[str]) -> dict[str, np.ndarray]:
    with PSClient([address], register=False) as client:
        return client.pull(names)


def _wait_for_log(server, fragment: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while fragment not in server.log_text():
        assert server.popen.poll() is None or fragment in server.log_text(), server.log_text()[-3000:]
        assert time.monotonic() < deadline, (fragment, server.log_text()[-3000:])
        time.sleep(0.01)


def _kill_and_relaunch_restoring(server) -> None:
    """SIGKILL, start again on the same port, return once the transport is up (and the restore runs)."""
    server.signal(signal.SIGKILL)
    server.wait(30)
    server.launch(port=server.port)
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline and server.popen.poll() is None, server.log_text()[-3000:]
        try:
            status = server.health()
            break
        except grpc.RpcError:
            time.sleep(0.005)
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING


# Big enough that restoring it takes far longer than one call of every RPC (2.3 s measured on the
# 2-core test machine; the calls take milliseconds), small enough for a test: 256 MB.
_BIG_ELEMENTS = 64 << 20


def test_every_rpc_during_restore_is_refused_and_the_checkpoints_survive(cluster_factory):
    root = cluster_factory.workdir / "ckpt"
    cluster = cluster_factory(1, "--checkpoint-dir", str(root), "--checkpoint-interval", "0",
                              "--keep-checkpoints", "2", "--allow-finish")
    server = cluster.servers[0]
    small = np.array([1, 2, 3, 4], np.float32)
    with PSClient(cluster.addresses, heartbeat=False) as client:
        client.create_variable("big", shape=(_BIG_ELEMENTS,), initializer="zeros",
                               optimizer=SGD(learning_rate=1.0))
        client.create_variable("small", shape=(4,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        client.push({"big": np.ones(_BIG_ELEMENTS, np.float32), "small": small})
        client.checkpoint()
        client.push({"small": small})
        client.checkpoint()
    before = _checkpoints_on_disk(root)
    assert len(before) == 2

    _kill_and_relaunch_restoring(server)
    # The transport is up (health answers) before the restore is done: call every RPC now.
    rounds = [_every_rpc(server.address, sequence=1) for _ in range(3)]  # 3 checkpoints > --keep-checkpoints
    health_list = _health_list(server.address)
    # The log is the witness that every call above was answered while the restore was in progress.
    assert '"event": "restored"' not in server.log_text(), \
        "the restore finished before the calls did: make _BIG_ELEMENTS bigger for this machine"
    assert health_list == {"": health_pb2.HealthCheckResponse.NOT_SERVING,
                           SERVICE: health_pb2.HealthCheckResponse.NOT_SERVING}
    for answers in rounds:
        assert set(answers) == {"Checkpoint", "Heartbeat", "Describe", "CreateVariable", "Finish", "Push",
                                "Pull", "Exchange pull", "Exchange push"}
        for name, (code, reason, details) in answers.items():
            assert (code, reason) == (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN"), (name, code, details)
            assert "restoring its checkpoint" in details, (name, details)
    server.wait_ready()

    # Nothing acted: the checkpoints on disk are the same, the restored values are the last
    # checkpoint's, no probe push or heartbeat counted, no variable created, no finish.
    assert _checkpoints_on_disk(root) == before
    values = _values(server.address, ["big", "small"])
    np.testing.assert_array_equal(values["small"], -2 * small)
    assert values["big"].min() == values["big"].max() == -1
    with PSClient(cluster.addresses, register=False) as client:
        info = client.describe()[0]
    assert set(info.variables) == {"big", "small"}
    assert "probe" not in info.workers
    assert server.popen.poll() is None

    # A worker's checkpoint() that lands during a restore is retried until the server is ready,
    # then writes the restored state: a crash right after it restarts with every value.
    with PSClient(cluster.addresses, register=False, retry_timeout=120) as worker:
        _kill_and_relaunch_restoring(server)
        worker.checkpoint()
        assert worker.stats()["retries"] > 0  # refused at least once while restoring
    after = _checkpoints_on_disk(root)
    newest = max(before)
    assert len(after) == 2 and newest in after and after[newest] == before[newest]
    _kill_and_relaunch_restoring(server)
    server.wait_ready()
    values = _values(server.address, ["big", "small"])
    np.testing.assert_array_equal(values["small"], -2 * small)
    assert values["big"].min() == values["big"].max() == -1


class _StalledPush:
    """A raw multi-chunk push that sends its first chunk, then waits until told to go on (or to give up)."""

    def __init__(self, address: str, variable: str, worker: str, value: float) -> None:
        self._go_on = threading.Event()
        self._give_up = threading.Event()
        self.variable, self.worker, self.value = variable, worker, value
        self._channel = grpc.insecure_channel(address)
        self.future = self._channel.stream_unary(method_path("Push")).future(self._messages(), timeout=120)

    def _messages(self):
        yield _push_message(self.variable, 1, self.worker, chunk=(0, 2), value=self.value)
        while not self._go_on.wait(0.05):
            if self._give_up.is_set():
                return
        yield _push_message(self.variable, 1, self.worker, chunk=(2, 2), value=self.value, begin=False)

    def send_the_rest(self) -> None:
        self._go_on.set()

    def close(self) -> None:
        self._give_up.set()
        self._channel.close()

    def retry_whole(self, address: str) -> ps_pb2.PushResponse:
        """The client's retry: the same push (worker, incarnation, sequence) with the same chunking."""
        messages = [_push_message(self.variable, 1, self.worker, chunk=(0, 2), value=self.value),
                    _push_message(self.variable, 1, self.worker, chunk=(2, 2), value=self.value, begin=False)]
        with grpc.insecure_channel(address) as channel:
            return ps_pb2.PushResponse.FromString(
                channel.stream_unary(method_path("Push"))(iter(messages), timeout=30))


def _wait_for_values(address: str, name: str, expected: np.ndarray, timeout: float = 30) -> None:
    """Until the first chunk of a stalled push is applied (seen by a pull)."""
    deadline = time.monotonic() + timeout
    while not np.array_equal(_values(address, [name])[name], expected):
        assert time.monotonic() < deadline, f"{name} never became {expected}"
        time.sleep(0.02)


def test_every_rpc_during_the_drain_answers_as_documented(cluster_factory):
    root = cluster_factory.workdir / "ckpt"
    cluster = cluster_factory(1, "--checkpoint-dir", str(root), "--checkpoint-interval", "0",
                              "--drain-timeout", "120", "--allow-finish")
    server = cluster.servers[0]
    with PSClient(cluster.addresses, heartbeat=False) as client:
        for name in ("small", "slow"):
            client.create_variable(name, shape=(4,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
    slow = _StalledPush(server.address, "slow", "slow-worker", 1.0)
    try:
        _wait_for_values(server.address, "slow", np.array([-1, -1, 0, 0], np.float32))
        server.signal(signal.SIGTERM)
        _wait_for_log(server, '"event": "draining"')  # held open by the push in flight
        assert server.health() == health_pb2.HealthCheckResponse.NOT_SERVING
        assert set(_health_list(server.address).values()) == {health_pb2.HealthCheckResponse.NOT_SERVING}
        answers = _every_rpc(server.address, sequence=1)
        describe = answers.pop("Describe")
        assert describe[0] == grpc.StatusCode.OK, describe  # the state is real: it is reported
        for name, (code, reason, details) in answers.items():
            assert (code, reason) == (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN"), (name, code, details)
            assert "shutting down" in details, (name, details)
        assert server.popen.poll() is None
        slow.send_the_rest()  # the push in flight finishes within the drain timeout: acknowledged
        response = ps_pb2.PushResponse.FromString(slow.future.result(timeout=60))
        assert response.elements_applied == 4 and not response.duplicate
    finally:
        slow.close()
    assert server.wait(60) == 0
    log = server.log_text()
    assert '"reason": "shutdown"' in log and '"drained": true' in log
    assert len(_checkpoints_on_disk(root)) == 1  # the final one; the refused Checkpoint wrote none
    server.start(port=server.port)
    # The final checkpoint holds the acknowledged push whole, and nothing the refused calls carried.
    values = _values(server.address, ["small", "slow"])
    np.testing.assert_array_equal(values["slow"], np.full(4, -1, np.float32))
    np.testing.assert_array_equal(values["small"], np.zeros(4, np.float32))
    with PSClient(cluster.addresses, register=False) as client:
        assert set(client.describe()[0].variables) == {"small", "slow"}
    assert slow.retry_whole(server.address).duplicate


def test_a_push_open_past_the_drain_timeout_is_cut_off_unacknowledged_and_its_retry_is_exact(cluster_factory):
    root = cluster_factory.workdir / "ckpt"
    cluster = cluster_factory(1, "--checkpoint-dir", str(root), "--checkpoint-interval", "0",
                              "--drain-timeout", "0.5")
    server = cluster.servers[0]
    with PSClient(cluster.addresses, heartbeat=False) as client:
        for name in ("a", "b"):
            client.create_variable(name, shape=(4,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
    # a: its second chunk comes right after the final checkpoint, within gRPC's grace period;
    # b: its second chunk never comes.
    late = _StalledPush(server.address, "a", "late-worker", 1.0)
    stalled = _StalledPush(server.address, "b", "stalled-worker", 2.0)
    try:
        _wait_for_values(server.address, "a", np.array([-1, -1, 0, 0], np.float32))
        _wait_for_values(server.address, "b", np.array([-2, -2, 0, 0], np.float32))
        server.signal(signal.SIGTERM)
        _wait_for_log(server, '"reason": "shutdown"')  # the final checkpoint is written
        late.send_the_rest()
        for push in (late, stalled):
            with pytest.raises(grpc.RpcError) as info:
                push.future.result(timeout=60)
            # Not acknowledged; both codes are retried by the client.
            assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), \
                info.value.details()
    finally:
        late.close()
        stalled.close()
    assert server.wait(60) == 0
    assert '"event": "drain timed out"' in server.log_text()
    server.start(port=server.port)
    # The final checkpoint holds the halves that were applied, with their ledger: the retries
    # apply exactly the rest.
    values = _values(server.address, ["a", "b"])
    np.testing.assert_array_equal(values["a"], np.array([-1, -1, 0, 0], np.float32))
    np.testing.assert_array_equal(values["b"], np.array([-2, -2, 0, 0], np.float32))
    for push in (late, stalled):
        response = push.retry_whole(server.address)
        assert response.elements_applied == 2 and not response.duplicate
    values = _values(server.address, ["a", "b"])
    np.testing.assert_array_equal(values["a"], np.full(4, -1, np.float32))
    np.testing.assert_array_equal(values["b"], np.full(4, -2, np.float32))
    assert late.retry_whole(server.address).duplicate


_REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


@pytest.mark.parametrize("ending", ["sigterm", "finish"])
def test_garbage_sent_to_reflection_does_not_keep_the_server_from_exiting(cluster_factory, ending):
    root = cluster_factory.workdir / "ckpt"
    cluster = cluster_factory(1, "--checkpoint-dir", str(root), "--checkpoint-interval", "0",
                              "--allow-finish")
    server = cluster.servers[0]
    garbage = b"\xff\xff\xff"
    with grpc.insecure_channel(server.address) as channel:
        calls = [lambda: channel.unary_unary(_REFLECTION)(garbage, timeout=10),
                 lambda: channel.stream_unary(_REFLECTION)(iter([garbage]), timeout=10),
                 lambda: list(channel.stream_stream(_REFLECTION)(iter([garbage]), timeout=10))]
        for call in calls:
            for _ in range(5):
                code, _, details = _answer(call)
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid" in details, (code, details)
    if ending == "sigterm":
        server.signal(signal.SIGTERM)
    else:
        with PSClient(cluster.addresses, worker_id="chief") as client:
            client.finish(wait_for_workers=False)
    assert server.wait(60) == 0
    log = server.log_text()
    assert '"reason": "shutdown"' in log and '"event": "stopped"' in log
    assert "did not stop" not in log  # gRPC released every call: a clean stop, not the fallback


def test_every_health_method_reflection_lists_answers(cluster_factory):
    server = cluster_factory(1).servers[0]
    with grpc.insecure_channel(server.address) as channel:
        answers = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol="grpc.health.v1.Health")]),
            timeout=10)
        files = [descriptor_pb2.FileDescriptorProto.FromString(raw) for answer in answers
                 for raw in answer.file_descriptor_response.file_descriptor_proto]
        methods = {m.name for f in files for s in f.service if s.name == "Health" for m in s.method}
        assert methods == {"Check", "List", "Watch"}
        stub = health_pb2_grpc.HealthStub(channel)
        listed = stub.List(health_pb2.HealthListRequest(), timeout=10).statuses
        assert {name: s.status for name, s in listed.items()} == {
            "": health_pb2.HealthCheckResponse.SERVING, SERVICE: health_pb2.HealthCheckResponse.SERVING}
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
