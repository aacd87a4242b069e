"""A push the ledger wrote off is refused with its own reason, never answered as a duplicate.

The ledger keeps at most 64 unfinished pushes per worker incarnation; the
65th writes the oldest off. That push may be partly applied, so a late
retry of it must not look like success (``duplicate``): the server answers
ABORTED with reason PUSH_WRITTEN_OFF, applies nothing, and the client
raises PushWrittenOffError without retrying.
"""

from __future__ import annotations

import itertools

import grpc
import numpy as np
import pytest

from wehub_ps.errors import REASON_METADATA_KEY
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.arrays import byte_view
from wehub_ps.wire.codec import (
    EXCHANGE_ERROR,
    EXCHANGE_PUSH,
    OutgoingChunk,
    decode_envelope,
    encode_envelope,
    encode_push_request,
)
from wehub_ps.wire.rpc import method_path
from worker_client import SGD, PSClient, PushWrittenOffError

MAX_OPEN_PUSHES = 64  # PushLedger's default, the bound under test


def _begin(worker: str, incarnation: str, sequence: int) -> ps_pb2.PushBegin:
    return ps_pb2.PushBegin(worker_id=worker, incarnation=incarnation, sequence=sequence, shard_index=0,
                            num_shards=1, kind=ps_pb2.GRADIENT,
                            items=[ps_pb2.PushItem(variable="w", elements=8, wire_dtype=ps_pb2.FLOAT32)])


def _chunk(offset: int, values: np.ndarray) -> OutgoingChunk:
    header = ps_pb2.ChunkHeader(variable="w", offset=offset, count=values.size, dtype=ps_pb2.FLOAT32)
    return OutgoingChunk(header, byte_view(values))


ONES = np.ones(4, np.float32)


def _push(channel: grpc.Channel, worker: str, incarnation: str, sequence: int,
          halves: int) -> ps_pb2.PushResponse:
    """Push 1 to each of w's 8 elements in two chunks of 4; send only the first ``halves`` of them."""
    messages = [encode_push_request(_begin(worker, incarnation, sequence), [_chunk(0, ONES)]),
                encode_push_request(None, [_chunk(4, ONES)])][:halves]
    raw = channel.stream_unary(method_path("Push"))(iter(messages), timeout=30)
    return ps_pb2.PushResponse.FromString(raw)


def _cut_pushes(channel: grpc.Channel, worker: str, incarnation: str, sequences) -> None:
    """Pushes whose streams end after their first chunk: applied halfway, left open in the ledger."""
    for sequence in sequences:
        with pytest.raises(grpc.RpcError) as info:
            _push(channel, worker, incarnation, sequence, 1)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # PUSH_INCOMPLETE


def _expect_written_off(channel: grpc.Channel, worker: str, incarnation: str, sequence: int) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _push(channel, worker, incarnation, sequence, 2)
    error = info.value
    assert error.code() == grpc.StatusCode.ABORTED, error.details()
    assert dict(error.trailing_metadata())[REASON_METADATA_KEY] == "PUSH_WRITTEN_OFF"
    assert f"push {sequence} of worker {worker!r}" in error.details()
    assert "partly applied" in error.details()


def test_a_retry_of_a_written_off_push_is_refused_and_applies_nothing(cluster_factory, tmp_path):
    cluster = cluster_factory(1, "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-interval", "3600")
    server = cluster.servers[0]
    with PSClient(cluster.addresses, worker_id="observer") as client:
        client.create_variable("w", shape=(8,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
    with grpc.insecure_channel(server.address) as channel:
        # Push 1 is cut after its first half; 64 more cut pushes write it off.
        _cut_pushes(channel, "w0", "inc", range(1, 2 + MAX_OPEN_PUSHES))
        with PSClient(cluster.addresses, register=False) as client:
            before = client.pull(["w"])["w"]
        np.testing.assert_array_equal(before, np.r_[np.full(4, -65.0), np.zeros(4)].astype(np.float32))
        _expect_written_off(channel, "w0", "inc", 1)
        # Pushes still open are completed by their retry, exactly once, and a completed
        # push is still a duplicate; other workers are not affected.
        assert not _push(channel, "w0", "inc", 2, 2).duplicate
        assert _push(channel, "w0", "inc", 2, 2).duplicate
        assert not _push(channel, "w1", "inc", 1, 2).duplicate
        # Over the exchange stream: the same refusal, as an ExchangeError.
        lane = channel.stream_stream(method_path("Exchange"))
        payload = encode_push_request(_begin("w0", "inc", 1), [_chunk(0, ONES), _chunk(4, ONES)])
        answers = list(lane(iter([encode_envelope(7, EXCHANGE_PUSH, payload)]), timeout=30))
        request_id, field, body = decode_envelope(answers[0])
        error = ps_pb2.ExchangeError.FromString(body)
        assert (request_id, field, error.reason) == (7, EXCHANGE_ERROR, "PUSH_WRITTEN_OFF")
        assert error.code == grpc.StatusCode.ABORTED.value[0]
        with PSClient(cluster.addresses, register=False) as client:
            after = client.pull(["w"])["w"]
        # The refused retries applied nothing: only push 2's second half and w1's push came in.
        np.testing.assert_array_equal(after, before - np.r_[np.ones(4), np.full(4, 2.0)].astype(np.float32))
    # The ledger's verdict survives a restart (it travels in the checkpoint).
    server.stop()
    server.start(server.port)
    with grpc.insecure_channel(server.address) as channel:
        _expect_written_off(channel, "w0", "inc", 1)


def test_the_client_raises_push_written_off_and_does_not_retry(cluster_factory):
    cluster = cluster_factory(1)
    with PSClient(cluster.addresses, worker_id="w0", retry_timeout=30.0) as client:
        client.create_variable("w", shape=(8,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        with grpc.insecure_channel(cluster.addresses[0]) as channel:
            # This client's push 1 was cut after its first chunk and written off by 64 later ones.
            _cut_pushes(channel, "w0", client.incarnation, range(1, 2 + MAX_OPEN_PUSHES))
        # The client's next push reuses sequence 1, as a late retry of the cut push would.
        client._session.state.sequences[0] = itertools.count(1)
        retries = client.stats()["retries"]
        with pytest.raises(PushWrittenOffError, match="partly applied") as info:
            client.push({"w": np.ones(8, np.float32)})
        assert info.value.reason == "PUSH_WRITTEN_OFF" and info.value.address == cluster.addresses[0]
        assert client.stats()["retries"] == retries
        np.testing.assert_array_equal(client.pull(["w"])["w"][4:], 0)  # the second half never came
