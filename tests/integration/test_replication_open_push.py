"""A backup caught up with a snapshot while a push stream is open goes on with that stream.

Real ps-server processes (--replicas 2) on a real etcd (tests/etcd_server.py
skips where etcd is not installed). A worker's push stream applies its
first message on the primary and stays open; the backup is restarted and
caught up with a snapshot meanwhile, so the push's first chunk reaches it
inside the snapshot and its second as a record of a stream the backup never
saw begin. The primary sends the streams open in the snapshot with it
(records.OpenPushes): the backup applies the second chunk in place, with
no second snapshot, and holds the same bits; after the primary is
SIGKILLed, the push is whole on the new primary and a retry of it is a
duplicate.

In sync mode a push's gradients are staged on the primary until it ends,
which no snapshot holds: there the snapshot waits for the push to end.
"""

from __future__ import annotations

import queue
import signal
import threading
import time

import grpc
import numpy as np
from replica_testing import ReplicatedCluster, assert_same_bits, log_events, wait_for

from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.arrays import byte_view
from wehub_ps.wire.codec import OutgoingChunk, encode_push_request
from wehub_ps.wire.rpc import method_path
from worker_client import SGD, PSClient, Zeros

SHAPE = (64, 8)
HALF = SHAPE[0] * SHAPE[1] // 2


def _cluster(tmp_path, etcd_server, consistency: str) -> ReplicatedCluster:
    return ReplicatedCluster(tmp_path / "replicated", etcd_server.endpoint, 1, 2,
                             ("--consistency", consistency))


def _begin() -> ps_pb2.PushBegin:
    return ps_pb2.PushBegin(worker_id="w-open", incarnation="i-open", sequence=1, shard_index=0, num_shards=1,
                            kind=ps_pb2.GRADIENT,
                            items=[ps_pb2.PushItem(variable="a", elements=2 * HALF, wire_dtype=ps_pb2.FLOAT32)])


def _chunk(gradient: np.ndarray, offset: int) -> OutgoingChunk:
    values = np.ascontiguousarray(gradient.reshape(-1)[offset:offset + HALF])
    return OutgoingChunk(ps_pb2.ChunkHeader(variable="a", offset=offset, count=HALF, dtype=ps_pb2.FLOAT32),
                         byte_view(values))


class _OpenPush:
    """A Push stream fed message by message from the test; ``close`` ends it and returns the response."""

    def __init__(self, address: str) -> None:
        self._messages: queue.Queue[bytes | None] = queue.Queue()
        self._channel = grpc.insecure_channel(address)
        self._future = self._channel.stream_unary(method_path("Push")).future(self._feed(), timeout=60)

    def _feed(self):
        while (message := self._messages.get()) is not None:
            yield message

    def send(self, message: bytes) -> None:
        self._messages.put(message)

    def close(self) -> ps_pb2.PushResponse:
        self._messages.put(None)
        try:
            return ps_pb2.PushResponse.FromString(self._future.result(timeout=60))
        finally:
            self._channel.close()


def _caught_up(cluster: ReplicatedCluster):
    def check() -> bool:
        primary = cluster.primary(0)
        status = primary.status()
        backup = next(r for r in cluster.shards[0] if r is not primary)
        return (len(status.backups) == 1 and status.backups[0].in_sync
                and backup.status().applied_sequence == status.applied_sequence)
    return check


def _applied_on_primary(cluster: ReplicatedCluster, before: int):
    return lambda: cluster.primary(0).status().applied_sequence > before


def _half_pushed(cluster: ReplicatedCluster, seed: int):
    """Variable "a" created and the backup caught up, then a push whose first message the primary
    applied and whose stream stays open: (primary, backup, the push's gradient, the open push)."""
    primary = cluster.primary(0)
    backup = next(r for r in cluster.shards[0] if r is not primary)
    with PSClient(cluster.addresses, worker_id="setup", register=False) as client:
        client.create_variable("a", SHAPE, initializer=Zeros(), optimizer=SGD(1.0))
    wait_for(_caught_up(cluster), 30, "the backup caught up", cluster)
    gradient = np.random.default_rng(seed).integers(-4, 5, SHAPE).astype(np.float32)
    push = _OpenPush(primary.address)
    before = primary.status().applied_sequence
    push.send(encode_push_request(_begin(), [_chunk(gradient, 0)]))
    wait_for(_applied_on_primary(cluster, before), 30, "the push's first message applied", cluster)
    return primary, backup, gradient, push


def test_a_backup_caught_up_during_an_open_push_applies_its_later_chunks(tmp_path, etcd_server):
    cluster = _cluster(tmp_path, etcd_server, "async").start()
    try:
        primary, backup, gradient, push = _half_pushed(cluster, seed=3)
        try:
            backup.process.signal(signal.SIGKILL)
            backup.process.popen.wait(10)
            backup.start()  # catches up with a snapshot while the push is open
            wait_for(_caught_up(cluster), 30, "the restarted backup caught up", cluster)
            push.send(encode_push_request(None, [_chunk(gradient, HALF)]))
        finally:
            response = push.close()
        assert response.elements_applied == 2 * HALF and not response.duplicate
        wait_for(_caught_up(cluster), 30, "the backup applied the push's end", cluster)

        primary_log, backup_log = primary.process.log_text(), backup.process.log_text()
        assert not log_events(backup_log, "cannot apply the primary's change"), backup_log[-3000:]
        assert len(log_events(backup_log, "snapshot loaded")) == 2, backup_log[-3000:]  # one per start
        assert log_events(primary_log, "backup attached")[-1]["open_pushes"] == 1, "the push was not open"

        with PSClient([primary.address], worker_id="observer", register=False) as client:
            client.checkpoint()
        wait_for(_caught_up(cluster), 30, "the backup applied the checkpoint record", cluster)
        primary_checkpoint = primary.newest_checkpoint()
        assert_same_bits(primary_checkpoint, backup.newest_checkpoint())

        primary.process.signal(signal.SIGKILL)
        assert cluster.primary(0, timeout=15) is backup
        with PSClient([backup.address], worker_id="observer-2", register=False) as client:
            np.testing.assert_array_equal(client.pull(["a"])["a"], -gradient)
        with grpc.insecure_channel(backup.address) as channel:
            raw = channel.stream_unary(method_path("Push"))(
                iter([encode_push_request(_begin(), [_chunk(gradient, 0), _chunk(gradient, HALF)])]), timeout=30)
        retry = ps_pb2.PushResponse.FromString(raw)
        assert retry.duplicate and retry.elements_applied == 0
    finally:
        cluster.stop()


def test_in_sync_mode_a_catch_up_snapshot_waits_for_an_open_push_to_end(tmp_path, etcd_server):
    """A sync push staged on the primary: the restarted backup's snapshot is taken once the push ended
    (within the wait's bound), so the backup needs no second snapshot."""
    cluster = _cluster(tmp_path, etcd_server, "sync").start()
    try:
        primary, backup, gradient, push = _half_pushed(cluster, seed=4)
        try:
            followed = backup.process.log_text().count("following the primary")
            backup.process.signal(signal.SIGKILL)
            backup.process.popen.wait(10)
            restarted = threading.Thread(target=backup.start)
            restarted.start()
            # The backup asks to follow while the push is open; its snapshot waits for the push's end.
            wait_for(lambda: backup.process.log_text().count("following the primary") > followed,
                     30, "the restarted backup asked to follow", cluster)
            time.sleep(0.3)
            push.send(encode_push_request(None, [_chunk(gradient, HALF)]))
        finally:
            response = push.close()
        restarted.join(60)
        assert response.elements_applied == 2 * HALF
        wait_for(_caught_up(cluster), 30, "the restarted backup caught up", cluster)
        backup_log = backup.process.log_text()
        assert not log_events(backup_log, "cannot apply the primary's change"), backup_log[-3000:]
        assert len(log_events(backup_log, "snapshot loaded")) == 2, backup_log[-3000:]  # one per start
        assert log_events(primary.process.log_text(), "backup attached")[-1]["open_pushes"] == 0
    finally:
        cluster.stop()

