"""The primary's side of a backup's stream: a snapshot, then every change, and the answers.

A backup connects to the primary's replication port (wehub_ps.wire.frames) and
sends FollowStart; the primary attaches it to its log in the same hold of
the order lock as it takes the snapshot (role.attach), sends the snapshot,
the push streams open in it, and then the records. Every message sent is answered by the sequence the
backup applied; answers are read on their own thread, so a slow sender
never hides a live backup. The stream ends when the backup goes, falls too
far behind (its link is cut), or this replica stops leading.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ps_server.core.errors import RequestError
from ps_server.durability.writer import ShardSnapshot
from ps_server.replication.log import TAKE_OVER, BackupLink
from ps_server.replication.role import PRIMARY, ReplicaRole
from ps_server.replication.snapshots import SnapshotSender
from wehub_ps.errors import Reason
from wehub_ps.process.logs import event
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.frames import ConnectionClosed, FramedConnection, RefusalLog
from wehub_ps.wire.replication import decode_answer, record_message

__all__ = ["BackupStreams"]

log = logging.getLogger("ps_server.replication")


class BackupStreams:
    """Serves each connected backup (the replication port's FrameListener handler)."""

    def __init__(self, role: ReplicaRole, shard_index: int, num_shards: int,
                 take_snapshot: Callable[[], ShardSnapshot], ping_seconds: float,
                 token_matches: Callable[[bytes], bool] | None = None,
                 snapshot_parent: str | None = None) -> None:
        self._role = role
        self._shard = (shard_index, num_shards)
        self._take_snapshot = take_snapshot
        self._ping_seconds = ping_seconds
        self._token_matches = token_matches
        self._snapshot_parent = snapshot_parent
        self._refusals = RefusalLog(log, "backup refused")

    def serve(self, connection: FramedConnection, first: bytearray) -> None:
        """Serve one backup whose first frame, ``first``, arrived whole (FrameListener's handler)."""
        try:
            start = self._start(first)
            link, snapshot, opened = self._role.attach(start, self._take_snapshot)
            link.transport_alive = connection.peer_acknowledged_within
        except RequestError as error:
            # Anyone who reaches the port can be refused: at WARNING once a minute, with counts.
            self._refusals.refused(error.reason.value, peer=connection.peer, why=error.message)
            try:
                connection.set_timeout(5.0)
                connection.send([ps_pb2.ReplicationMessage(refused=error.message).SerializeToString()])
            except ConnectionClosed:
                pass
            return
        answers = threading.Thread(target=_read_answers, args=(connection, link),
                                   name=f"ps-backup-answers-{start.replica_index}", daemon=True)
        answers.start()
        try:
            self._send(connection, link, snapshot, opened)
        except ConnectionClosed as error:
            link.close(str(error))
        finally:
            link.close(link.closed or "the stream ended")
            connection.close()  # ends the answers' thread too
            self._role.detach(link)
            event(log, logging.INFO, "backup stream ended", replica_index=link.replica_index,
                  why=link.closed, acknowledged=link.acknowledged)

    def _start(self, raw: bytearray) -> ps_pb2.FollowStart:
        first = _parse(raw)
        if first.WhichOneof("kind") != "start":
            raise RequestError(Reason.INVALID_REQUEST, "a replication stream starts with FollowStart")
        start = first.start
        if self._token_matches is not None and not self._token_matches(start.token.encode()):
            raise RequestError(Reason.UNAUTHENTICATED, "the backup presented no or a wrong bearer token")
        if (start.shard_index, start.num_shards) != self._shard:
            raise RequestError(Reason.CLUSTER_MISMATCH,
                               f"this replica serves shard {self._shard[0]} of {self._shard[1]}, the "
                               f"backup is of shard {start.shard_index} of {start.num_shards}")
        return start

    def _send(self, connection: FramedConnection, link: BackupLink, snapshot: ShardSnapshot,
              opened: list[ps_pb2.OpenPush]) -> None:
        epoch = link.epoch
        sender = SnapshotSender(snapshot, self._snapshot_parent)
        try:
            for piece in sender.pieces():
                link.sending(link.start_sequence)
                message = ps_pb2.ReplicationMessage(epoch=epoch, snapshot_file=piece)
                connection.send([message.SerializeToString()])
        finally:
            sender.close()
        for open_push in opened:
            link.sending(link.start_sequence)
            connection.send([ps_pb2.ReplicationMessage(epoch=epoch, open_push=open_push).SerializeToString()])
        link.sending(link.start_sequence)
        connection.send([ps_pb2.ReplicationMessage(epoch=epoch,
                                                   snapshot_done=link.start_sequence).SerializeToString()])
        while link.closed is None and self._role.state == PRIMARY:
            batch = link.take(self._ping_seconds)
            if not batch:
                if link.closed is None:
                    link.sending(link.sent_sequence)
                    connection.send([ps_pb2.ReplicationMessage(epoch=epoch,
                                                               ping=link.sent_sequence).SerializeToString()])
                continue
            for sequence, record in batch:
                if sequence == TAKE_OVER:  # the last message of this term on this stream
                    link.sending(link.sent_sequence)
                    connection.send([ps_pb2.ReplicationMessage(epoch=epoch, take_over=True).SerializeToString()])
                    link.handed_over.set()
                    continue
                link.sending(sequence)
                connection.send(record_message(epoch, record))


def _parse(raw: bytes | bytearray) -> ps_pb2.FollowRequest:
    try:
        return decode_answer(raw)
    except Exception as exc:  # DecodeError, or upb's errors for garbage
        raise RequestError(Reason.MALFORMED_MESSAGE,
                           f"not a valid wehub_ps.v1.FollowRequest: {exc}") from None


def _read_answers(connection: FramedConnection, link: BackupLink) -> None:
    try:
        while link.closed is None:
            request = _parse(connection.receive())
            if request.WhichOneof("kind") == "applied":
                link.answered(request.epoch, request.applied)
    except (ConnectionClosed, RequestError) as error:
        link.close(link.closed or f"the backup's answers ended: {error}")
