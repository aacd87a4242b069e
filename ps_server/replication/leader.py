"""The primary's side of a backup's Follow stream: a snapshot, then every change, and the answers.

Every message sent is answered by one FollowRequest carrying the backup's
applied sequence; answers are read on their own thread so a slow sender
never hides a live backup. The stream ends when the backup goes, falls too
far behind (its link is cut), or this replica stops leading.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import grpc

from ps_server.core.errors import RequestError
from ps_server.durability.writer import ShardSnapshot
from ps_server.replication.log import BackupLink
from ps_server.replication.role import PRIMARY, ReplicaRole
from ps_server.replication.snapshots import SnapshotSender
from ps_server.service.calls import abort
from wehub_ps.errors import Reason
from wehub_ps.process.logs import event
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.replication import decode_answer, record_message

__all__ = ["ReplicationService", "REPLICATION_SERVICE", "FOLLOW_PATH"]

REPLICATION_SERVICE = ps_pb2.DESCRIPTOR.services_by_name["Replication"].full_name
FOLLOW_PATH = f"/{REPLICATION_SERVICE}/Follow"

log = logging.getLogger("ps_server.replication")


class ReplicationService:
    """Follow, with raw-bytes (de)serialisation: records are framed around the pushes' own bytes."""

    def __init__(self, role: ReplicaRole, shard_index: int, num_shards: int,
                 take_snapshot: Callable[[], ShardSnapshot], ping_seconds: float,
                 snapshot_parent: str | None = None) -> None:
        self._role = role
        self._shard = (shard_index, num_shards)
        self._take_snapshot = take_snapshot
        self._ping_seconds = ping_seconds
        self._snapshot_parent = snapshot_parent

    def generic_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(REPLICATION_SERVICE, {
            "Follow": grpc.stream_stream_rpc_method_handler(self.follow)})

    def follow(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        raw = next(request_iterator, None)
        try:
            first = _parse(raw) if raw is not None else None
            if first is None or first.WhichOneof("kind") != "start":
                raise RequestError(Reason.INVALID_REQUEST, "a Follow stream starts with FollowStart")
            start = first.start
            if (start.shard_index, start.num_shards) != self._shard:
                raise RequestError(Reason.CLUSTER_MISMATCH,
                                   f"this replica serves shard {self._shard[0]} of {self._shard[1]}, the "
                                   f"backup is of shard {start.shard_index} of {start.num_shards}")
            link, snapshot = self._role.attach(start, self._take_snapshot)
        except RequestError as error:
            abort(context, error)
            return
        answers = threading.Thread(target=_read_answers, args=(request_iterator, link),
                                   name=f"ps-backup-answers-{start.replica_index}", daemon=True)
        answers.start()
        epoch = self._role.epoch
        sender = None
        try:
            sender = SnapshotSender(snapshot, self._snapshot_parent)
            for piece in sender.pieces():
                link.sending(link.start_sequence)
                yield ps_pb2.ReplicationMessage(epoch=epoch, snapshot_file=piece).SerializeToString()
            sender.close()
            link.sending(link.start_sequence)
            yield ps_pb2.ReplicationMessage(epoch=epoch, snapshot_done=link.start_sequence).SerializeToString()
            while link.closed is None and self._role.state == PRIMARY and context.is_active():
                batch = link.take(self._ping_seconds)
                if not batch:
                    if link.closed is None:
                        link.sending(link.sent_sequence)
                        yield ps_pb2.ReplicationMessage(epoch=epoch, ping=link.sent_sequence).SerializeToString()
                    continue
                for sequence, record in batch:
                    link.sending(sequence)
                    yield record_message(epoch, record)
        finally:
            if sender is not None:
                sender.close()
            link.close(link.closed or "the stream ended")
            self._role.detach(link)
            event(log, logging.INFO, "backup stream ended", replica_index=link.replica_index,
                  why=link.closed, acknowledged=link.acknowledged)


def _parse(raw: bytes) -> ps_pb2.FollowRequest:
    try:
        return decode_answer(raw)
    except Exception as exc:  # DecodeError, or upb's errors for garbage
        raise RequestError(Reason.MALFORMED_MESSAGE, f"not a valid wehub_ps.v1.FollowRequest: {exc}") from None


def _read_answers(requests: Iterator[bytes], link: BackupLink) -> None:
    try:
        for raw in requests:
            request = _parse(raw)
            if request.WhichOneof("kind") == "applied":
                link.answered(request.applied)
    except (grpc.RpcError, RequestError):
        pass
    except Exception:  # a malformed answer ends the stream like a broken one
        log.exception("backup answer unreadable")
    link.close(link.closed or "the backup's side of the stream ended")
