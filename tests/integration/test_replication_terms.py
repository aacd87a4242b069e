"""A real backup against a primary the test plays: what its answers acknowledge, which records it applies.

The test writes a leader key into a real etcd naming its own listener as
the primary's replication port, starts a real ps-server replica, and
speaks the replication protocol (ps.proto, "Replication") to it over a
plain socket. That lets it send what a stale or confused primary would:
a second stream to a backup already holding state, and a record of
another term. The rules under test are ps_server/coordination/positions.py's.
"""

from __future__ import annotations

import socket
import struct
import time
import uuid

import grpc
import numpy as np
import pytest
from ps_testing import ServerProcess

from ps_server.coordination import EtcdClient, Leader, ShardKeys
from ps_server.core.store import VariableStore
from ps_server.durability.writer import ShardSnapshot
from ps_server.replication.snapshots import SnapshotSender
from wehub_ps.specs import VariableSpec
from wehub_ps.specs_proto import spec_to_proto
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.rpc import method_path

_LENGTH = struct.Struct("<I")


class PlayedPrimary:
    """The test's side of one replication stream: frames in and out on a socket."""

    def __init__(self, connection: socket.socket) -> None:
        self.connection = connection
        connection.settimeout(10)

    def receive(self) -> ps_pb2.FollowRequest:
        header = self._exactly(_LENGTH.size)
        return ps_pb2.FollowRequest.FromString(self._exactly(_LENGTH.unpack(header)[0]))

    def send(self, message: ps_pb2.ReplicationMessage) -> ps_pb2.FollowRequest:
        """Send one message and read the backup's answer to it."""
        data = message.SerializeToString()
        self.connection.sendall(_LENGTH.pack(len(data)) + data)
        return self.receive()

    def closed_by_backup(self, timeout: float = 10.0) -> bool:
        self.connection.settimeout(timeout)
        try:
            return self.connection.recv(1) == b""
        except ConnectionResetError:
            return True

    def _exactly(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.connection.recv(size - len(data))
            if not chunk:
                raise ConnectionError("the backup closed the stream")
            data += chunk
        return data


def _snapshot_pieces(tmp_path) -> list[ps_pb2.SnapshotFile]:
    store = VariableStore(0, 1, 1 << 30)
    sender = SnapshotSender(ShardSnapshot(0, 1, "played-primary", store.snapshot(), {"entries": []}),
                            str(tmp_path))
    try:
        return list(sender.pieces())
    finally:
        sender.close()


def _created(epoch: int, sequence: int, name: str) -> ps_pb2.ReplicationMessage:
    spec = spec_to_proto(VariableSpec(name, (2,), np.dtype("float32")))
    return ps_pb2.ReplicationMessage(epoch=epoch, record=ps_pb2.ReplicationRecord(sequence=sequence,
                                                                                  created=spec))


def _applied_sequence(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        raw = channel.unary_unary(method_path("Describe"))(
            ps_pb2.DescribeRequest(any_replica=True).SerializeToString(), timeout=5)
    return ps_pb2.DescribeResponse.FromString(raw).replication.applied_sequence


@pytest.fixture
def backup_of_played_primary(tmp_path, etcd_server):
    """``(backup process, accept() -> PlayedPrimary, epoch)``: a real replica following the test's listener."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(30)
    job = f"test-{uuid.uuid4().hex[:8]}"
    client = EtcdClient([etcd_server.endpoint])
    keys = ShardKeys(job, 0)
    client.put(keys.leader, Leader.encode(1, "127.0.0.1:1", 1, f"127.0.0.1:{listener.getsockname()[1]}"))
    epoch = client.get(keys.leader).create_revision
    (tmp_path / "backup").mkdir()
    process = ServerProcess(0, 1, tmp_path / "backup", (
        "--replicas", "2", "--replica-index", "0", "--etcd-endpoints", etcd_server.endpoint,
        "--job-name", job, "--primary-lease-seconds", "1", "--replication-timeout", "30",
        "--failover-after", "31", "--backup-stall-timeout", "30",
        "--checkpoint-dir", str(tmp_path / "backup" / "checkpoints")))
    process.start()

    def accept() -> PlayedPrimary:
        connection, _ = listener.accept()
        return PlayedPrimary(connection)

    try:
        yield process, accept, epoch
    finally:
        process.stop()
        listener.close()
        client.close()


def test_answers_before_the_snapshot_acknowledge_nothing_and_records_must_continue_the_log(
        backup_of_played_primary, tmp_path):
    backup, accept, epoch = backup_of_played_primary
    pieces = _snapshot_pieces(tmp_path)

    first = accept()
    assert first.receive().WhichOneof("kind") == "start"
    for piece in pieces:
        answer = first.send(ps_pb2.ReplicationMessage(epoch=epoch, snapshot_file=piece))
        assert (answer.epoch, answer.applied) == (0, 0), "an answer before the snapshot named a term"
    answer = first.send(ps_pb2.ReplicationMessage(epoch=epoch, snapshot_done=10))
    assert (answer.epoch, answer.applied) == (epoch, 10)
    answer = first.send(_created(epoch, 11, "a"))
    assert (answer.epoch, answer.applied) == (epoch, 11)
    # A record of another term never continues this term's log, whatever its sequence says.
    first.connection.sendall(_LENGTH.pack(len(raw := _created(epoch + 5, 12, "b").SerializeToString())) + raw)
    assert first.closed_by_backup(), "the backup applied a record of another term"
    assert _applied_sequence(backup.address) == 11

    # The backup follows again and holds state at (epoch, 11): until the new stream's snapshot is
    # installed, its answers must not claim that state, or a primary whose log restarted lower would
    # count them as acknowledgements of changes the backup never saw.
    second = accept()
    assert second.receive().WhichOneof("kind") == "start"
    for piece in pieces:
        answer = second.send(ps_pb2.ReplicationMessage(epoch=epoch, snapshot_file=piece))
        assert (answer.epoch, answer.applied) == (0, 0), (
            f"before its snapshot the backup answered {answer.epoch}/{answer.applied}")
    answer = second.send(ps_pb2.ReplicationMessage(epoch=epoch, snapshot_done=3))
    assert (answer.epoch, answer.applied) == (epoch, 3)
    # A gap in the sequence ends the stream too.
    second.connection.sendall(_LENGTH.pack(len(raw := _created(epoch, 5, "c").SerializeToString())) + raw)
    assert second.closed_by_backup(), "the backup applied a record past a gap"
    deadline = time.monotonic() + 10
    while _applied_sequence(backup.address) != 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _checkpoints(process: ServerProcess) -> list:
    return sorted((process.workdir / "checkpoints").glob("shard-*/ckpt-*"))


def test_a_replica_stopped_before_it_holds_state_writes_no_checkpoint(backup_of_played_primary, tmp_path):
    """Its empty store must never shadow the real checkpoint it wrote before, nor be restored later."""
    backup, accept, epoch = backup_of_played_primary
    stream = accept()
    assert stream.receive().WhichOneof("kind") == "start"
    for piece in _snapshot_pieces(tmp_path):
        stream.send(ps_pb2.ReplicationMessage(epoch=epoch, snapshot_file=piece))
    stream.send(ps_pb2.ReplicationMessage(epoch=epoch, snapshot_done=0))
    stream.send(_created(epoch, 1, "kept"))
    checkpoint = ps_pb2.ReplicationRecord(sequence=2, checkpoint=True)
    assert stream.send(ps_pb2.ReplicationMessage(epoch=epoch, record=checkpoint)).applied == 2
    backup.stop()  # holding state: its final checkpoint is a real one
    real = _checkpoints(backup)
    assert real and "kept" in (real[-1] / "manifest.json").read_text()

    backup.start()  # holds nothing until a snapshot arrives, and none will
    assert accept().receive().WhichOneof("kind") == "start"
    backup.stop()
    assert _checkpoints(backup) == real, "a replica holding no state wrote a checkpoint"
    assert "checkpoint skipped: this replica holds no state yet" in backup.log_path.read_text()
