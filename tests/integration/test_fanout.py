"""Requests to several shards at once over their exchange lanes, against real servers."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.codec import EXCHANGE_PULL, decode_pull_response
from worker_client import SGD, PSClient, PSUnavailableError
from worker_client.errors import InvalidArgumentError, VariableNotFoundError
from worker_client.transport.channels import ShardChannel
from worker_client.transport.fanout import ShardCall, run_shard_calls


def _pull(index: int, name: str) -> bytes:
    return ps_pb2.PullRequest(shard_index=index, num_shards=2,
                              items=[ps_pb2.PullItem(variable=name)]).SerializeToString()


def _call(channel: ShardChannel, payload: bytes, answers: list) -> ShardCall:
    def ordinary() -> None:
        raise AssertionError("a free lane must carry a small request")

    return ShardCall(channel, "pull", ordinary, lambda answer: answers.append((channel.index, answer)) or "done",
                     EXCHANGE_PULL, lambda: payload, lambda answer: bytes(answer))


def _once(shard, what, attempt):
    return attempt()


@pytest.fixture
def channels(cluster2):
    """Channels to both shards, and a small variable held whole by each shard."""
    held_by: dict[int, str] = {}
    with PSClient(cluster2.addresses) as client:
        for i in range(16):
            var = client.create_variable(f"s{i}", shape=(64,), initializer="zeros")
            held_by.setdefault(var.placement.parts[0].shard, var.name)
    assert set(held_by) == {0, 1}
    chans = [ShardChannel(i, address) for i, address in enumerate(cluster2.addresses)]
    yield chans, held_by
    for chan in chans:
        chan.close()


def test_answers_come_back_per_shard_and_every_lane_is_freed_after_an_error(channels):
    chans, held_by = channels
    executor = ThreadPoolExecutor(2)
    answers: list = []
    calls = [_call(chans[0], _pull(0, "missing"), answers), _call(chans[1], _pull(1, held_by[1]), answers)]
    with pytest.raises(VariableNotFoundError, match="missing"):
        run_shard_calls(calls, executor, _once)
    # Shard 1's answer was read although shard 0 failed first: both lanes are free and in step.
    assert [index for index, _ in answers] == [1]
    assert all(chan.lane.try_acquire() for chan in chans)
    for chan in chans:
        chan.lane.release()
    answers.clear()
    good = [_call(chan, _pull(chan.index, held_by[chan.index]), answers) for chan in chans]
    assert run_shard_calls(good, executor, _once) == {0: "done", 1: "done"}
    assert sorted(index for index, _ in answers) == [0, 1]
    for _, answer in answers:
        assert decode_pull_response(answer)[0].header.count == 64
    executor.shutdown()


def test_a_busy_lane_falls_back_to_the_ordinary_call(channels):
    chans, held_by = channels
    assert chans[0].lane.try_acquire()  # someone else holds the lane
    ran = []
    call = ShardCall(chans[0], "pull", lambda: ran.append("ordinary") or "streamed", lambda answer: answer,
                     EXCHANGE_PULL, lambda: _pull(0, held_by[0]))
    try:
        assert run_shard_calls([call], ThreadPoolExecutor(1), _once) == {0: "streamed"}
    finally:
        chans[0].lane.release()
    assert ran == ["ordinary"]


def test_garbage_over_a_lane_is_a_typed_error(channels):
    chans, _ = channels
    call = _call(chans[0], b"\xff" * 11, [])
    with pytest.raises(InvalidArgumentError, match="not a valid wehub_ps.v1.PullRequest"):
        run_shard_calls([call], ThreadPoolExecutor(1), _once)
    assert chans[0].lane.try_acquire()  # the stream carries on
    chans[0].lane.release()


class _InterruptedOnce:
    """A lane's stream whose first wait is interrupted (as by Ctrl-C) with the answer on its way."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self.interrupted = False

    def send(self, pieces: list) -> None:
        self._stream.send(pieces)

    def receive(self, what: str):
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        return self._stream.receive(what)

    def cancel(self) -> None:
        self._stream.cancel()

    def close(self) -> None:
        self._stream.close()


def test_a_lane_interrupted_while_waiting_starts_afresh(channels):
    chans, held_by = channels
    lane, name = chans[0].lane, held_by[0]
    assert lane.try_acquire()
    try:
        lane.request(EXCHANGE_PULL, _pull(0, name), "pull")  # opens the stream
        request_id = lane.send(EXCHANGE_PULL, _pull(0, name))
        lane._stream = interrupted = _InterruptedOnce(lane._stream)
        with pytest.raises(KeyboardInterrupt):
            lane.receive(request_id, "pull")
        assert interrupted.interrupted
        # The answer to the interrupted request is never taken for the next one's.
        _, answer = lane.request(EXCHANGE_PULL, _pull(0, name), "pull")
    finally:
        lane.release()
    assert decode_pull_response(answer)[0].header.variable == name


def test_a_lane_request_to_a_server_that_stopped_answering_ends_at_its_deadline(cluster_factory):
    """A small pull rides the long-lived lane; it still has data_timeout per attempt and gives up at retry_timeout.

    The server is stopped (SIGSTOP), so its connection stays open and only
    the keepalive (tens of seconds) or the stream's lifetime would end the
    wait otherwise.
    """
    cluster = cluster_factory(1)
    server = cluster.servers[0]
    with PSClient(cluster.addresses, data_timeout=1, retry_timeout=3, heartbeat=False) as client:
        client.create_variable("v", shape=(8,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        client.push({"v": np.ones(8, np.float32)})  # the lane is open and in use
        server.freeze()
        try:
            started = time.monotonic()
            with pytest.raises(PSUnavailableError, match="DEADLINE_EXCEEDED") as info:
                client.pull(["v"])
            waited = time.monotonic() - started
            assert "attempts" in str(info.value) and "gave up after 1 attempts" not in str(info.value)
            assert waited < 25, f"a request over the lane waited {waited:.1f}s for a stopped server"
        finally:
            server.signal(signal.SIGCONT)
        # The lane starts afresh: the next requests are answered.
        client.push({"v": np.ones(8, np.float32)})
        np.testing.assert_array_equal(client.pull(["v"])["v"], np.full(8, -2, np.float32))
