"""A push that brings the next step's values back (PushBegin.pull_after), end to end.

Server side over raw gRPC: the answer holds the values right after the
push, a retried push answers them too, and a bad pull_after is refused
before anything is applied. Client side: steps use those values only when
they are what a pull would return.
"""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

import worker_client.prefetch as prefetch_module
from wehub_ps.errors import REASON_METADATA_KEY
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.arrays import byte_view
from wehub_ps.wire.codec import OutgoingChunk, decode_pull_response, encode_push_request, split_push_response
from wehub_ps.wire.rpc import method_path
from worker_client import SGD, PSClient

LR = 0.5


@pytest.fixture
def cluster(cluster_factory):
    cluster = cluster_factory(1)
    with PSClient(cluster.addresses, worker_id="setup") as client:
        client.create_variable("w", shape=(40, 30), initializer="uniform", optimizer=SGD(learning_rate=LR))
        client.create_variable("b", shape=(7,), initializer="normal", optimizer=SGD(learning_rate=LR))
    return cluster


def _state(address: str) -> dict:
    with PSClient([address], register=False) as client:
        values = {k: v.tobytes() for k, v in client.pull().items()}
        versions = {k: v["version"] for k, v in client.describe()[0].variables.items()}
    return {"values": values, "versions": versions}


def _push_with_pull_after(address: str, sequence: int, grad: np.ndarray, pull_names: list[str],
                          row_ids: bytes = b"") -> bytes:
    pull_after = ps_pb2.PullRequest(shard_index=0, num_shards=1, worker_id="raw", incarnation="i1",
                                    items=[ps_pb2.PullItem(variable=n, row_ids=row_ids) for n in pull_names])
    begin = ps_pb2.PushBegin(worker_id="raw", incarnation="i1", sequence=sequence, shard_index=0, num_shards=1,
                             kind=ps_pb2.GRADIENT, pull_after=pull_after,
                             items=[ps_pb2.PushItem(variable="b", elements=7, wire_dtype=ps_pb2.FLOAT32)])
    chunk = OutgoingChunk(ps_pb2.ChunkHeader(variable="b", offset=0, count=7, dtype=ps_pb2.FLOAT32,
                                             part_elements=7), byte_view(grad))
    with grpc.insecure_channel(address) as channel:
        return channel.stream_unary(method_path("Push"))(iter([encode_push_request(begin, [chunk])]), timeout=10)


def _pulled(answer: bytes) -> tuple[ps_pb2.PushResponse, dict[str, np.ndarray]]:
    response, chunks = split_push_response(answer)
    assert chunks is not None
    values: dict[str, list] = {}
    for chunk in chunks:
        values.setdefault(chunk.header.variable, []).append((chunk.header.offset, chunk.array()))
    return response, {name: np.concatenate([a for _, a in sorted(parts, key=lambda p: p[0])])
                      for name, parts in values.items()}


def test_the_answer_holds_the_values_right_after_the_push_and_a_retry_gets_them_too(cluster):
    address = cluster.servers[0].address
    with PSClient([address], register=False) as reader:
        before = reader.pull()
    grad = np.arange(7, dtype=np.float32)
    response, values = _pulled(_push_with_pull_after(address, 1, grad, ["b", "w"]))
    assert not response.duplicate and response.elements_applied == 7
    assert {v.variable: v.version for v in response.versions} == {"b": 1}
    np.testing.assert_array_equal(values["b"], before["b"] - np.float32(LR) * grad)
    np.testing.assert_array_equal(values["w"], before["w"].reshape(-1))
    # The same push again (a retry after a lost answer): applied once, values answered again.
    response, again = _pulled(_push_with_pull_after(address, 1, grad, ["b"]))
    assert response.duplicate and response.elements_applied == 0
    np.testing.assert_array_equal(again["b"], values["b"])
    # A plain push's answer has no pulled field.
    with PSClient([address]) as client:
        client.push({"b": np.zeros(7, np.float32)})


@pytest.mark.parametrize("names, row_ids, code, reason, fragment", [
    (["nope"], b"", grpc.StatusCode.NOT_FOUND, "UNKNOWN_VARIABLE", "nope"),
    (["w"], np.array([1, 2], "<i8").tobytes(), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", "not rows"),
    ([], b"", grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", "at least one variable"),
])
def test_a_bad_pull_after_is_refused_before_the_push_is_applied(cluster, names, row_ids, code, reason, fragment):
    address = cluster.servers[0].address
    before = _state(address)
    with pytest.raises(grpc.RpcError) as info:
        _push_with_pull_after(address, 1, np.ones(7, np.float32), names, row_ids)
    assert info.value.code() == code
    assert dict(info.value.trailing_metadata())[REASON_METADATA_KEY] == reason
    assert fragment in info.value.details()
    assert _state(address) == before
    # The refused push left no trace in the exactly-once ledger: the same sequence applies now.
    response, _ = _pulled(_push_with_pull_after(address, 1, np.ones(7, np.float32), ["b"]))
    assert not response.duplicate


@pytest.mark.parametrize("mode", ["ssp", "sync"])
def test_pull_after_is_refused_outside_async_mode(cluster_factory, mode):
    cluster = cluster_factory(1, "--consistency", mode)
    address = cluster.servers[0].address
    with PSClient([address], worker_id="setup") as client:
        client.create_variable("b", shape=(7,), initializer="zeros", optimizer=SGD(learning_rate=LR))
        client.create_variable("w", shape=(4,), initializer="zeros")
        before = _state(address)
        with pytest.raises(grpc.RpcError) as info:
            _push_with_pull_after(address, 1, np.ones(7, np.float32), ["b"])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "--consistency async" in info.value.details()
        assert _state(address) == before
        # The client never asks for it there: steps pull, and train.
        for _ in range(3):
            with client.step(["b"]) as step:
                step.push({"b": np.ones(7, np.float32)})
        assert client.stats()["prefetched_steps"] == 0
        np.testing.assert_array_equal(client.pull(["b"])["b"], np.full(7, -3 * LR, np.float32))


def _train(client: PSClient, steps: int, names=None, between=None) -> list[dict[str, np.ndarray]]:
    seen = []
    for k in range(steps):
        with client.step(names) as step:
            seen.append({n: v.copy() for n, v in step.params.items()})
            step.push({n: np.full(v.shape, k + 1, np.float32) for n, v in step.params.items()})
        if between is not None:
            between(k)
    return seen


@pytest.mark.parametrize("wire_dtype", [None, "bfloat16"])
def test_steps_start_from_the_values_the_previous_push_brought_back(cluster_factory, wire_dtype):
    cluster = cluster_factory(2)
    with PSClient(cluster.addresses, worker_id="w0", wire_dtype=wire_dtype) as client:
        for i in range(6):
            client.create_variable(f"v{i}", shape=(50 * (i + 1),), initializer="zeros",
                                   optimizer=SGD(learning_rate=1.0))
        seen = _train(client, 5)
        assert client.stats()["prefetched_steps"] == 4  # every step but the first
        for k, params in enumerate(seen):
            expected = -sum(range(1, k + 1))  # exact in bfloat16 too
            for name, value in params.items():
                np.testing.assert_array_equal(value, np.full(value.shape, expected, np.float32), err_msg=name)
        final = client.pull()
        assert all((v == -15).all() for v in final.values())


def test_a_push_between_steps_is_seen_by_the_next_step(cluster):
    with PSClient(cluster.addresses, worker_id="w0") as client:
        start = client.pull(["b"])["b"]

        def push_more(k: int) -> None:
            if k == 1:
                client.push({"b": np.full(7, 100, np.float32)})

        seen = _train(client, 4, ["b"], between=push_more)
        # Steps 1 and 3 used the values brought back; step 2 pulled because of the push.
        assert client.stats()["prefetched_steps"] == 2
        lr = np.float32(LR)
        expected = [start, start - lr * 1, start - lr * 3 - lr * 100, start - lr * 6 - lr * 100]
        for params, want in zip(seen, expected):
            np.testing.assert_array_equal(params["b"], want)


def test_values_older_than_the_limit_or_for_other_names_are_not_used(cluster, monkeypatch):
    with PSClient(cluster.addresses, worker_id="w0") as client:
        _train(client, 3, ["b"])
        assert client.stats()["prefetched_steps"] == 2
        _train(client, 1, ["w"])  # different names: pulls
        assert client.stats()["prefetched_steps"] == 2
        monkeypatch.setattr(prefetch_module, "PREFETCH_MAX_AGE_SECONDS", 0.0)
        _train(client, 3, ["b"])
        assert client.stats()["prefetched_steps"] == 2
    with PSClient(cluster.addresses, worker_id="w1", prefetch=False) as client:
        _train(client, 3, ["b"])
        assert client.stats()["prefetched_steps"] == 0


def test_values_brought_back_on_one_thread_are_not_used_by_another(cluster):
    """A step uses prefetched values only on the thread whose push brought them back."""
    with PSClient(cluster.addresses, worker_id="w0") as client:
        _train(client, 1, ["b"])  # this thread's push brought values back
        other = threading.Thread(target=_train, args=(client, 1, ["b"]), name="other-trainer")
        other.start()
        other.join(60)
        assert client.stats()["prefetched_steps"] == 0  # the other thread pulled
        _train(client, 1, ["b"])  # and its push invalidated what this thread holds
        assert client.stats()["prefetched_steps"] == 0
        _train(client, 1, ["b"])
        assert client.stats()["prefetched_steps"] == 1


def test_chunk_bytes_flag_sizes_the_pull_messages_of_a_request_that_names_none(cluster_factory):
    """--chunk-bytes is the default per pull message; a request's own chunk_bytes wins."""
    cluster = cluster_factory(1, "--chunk-bytes", str(64 << 10))
    with PSClient(cluster.addresses) as client:
        client.create_variable("w", shape=(250_000,), initializer="uniform")
        expected = client.pull(["w"])["w"]
    for asked, most in [(0, 64 << 10), (8 << 10, 8 << 10), (1 << 20, 1_000_000)]:
        request = ps_pb2.PullRequest(shard_index=0, num_shards=1, chunk_bytes=asked,
                                     items=[ps_pb2.PullItem(variable="w")])
        with grpc.insecure_channel(cluster.addresses[0]) as channel:
            messages = list(channel.unary_stream(method_path("Pull"))(request.SerializeToString(), timeout=30))
        chunks = [decode_pull_response(message) for message in messages]
        assert max(sum(c.data.nbytes for c in message) for message in chunks) == most, asked
        assert b"".join(bytes(c.data) for message in chunks for c in message) == expected.tobytes()
