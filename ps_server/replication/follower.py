"""A backup's side of the replication stream: load the snapshot, apply every record, answer each message.

Records are applied one at a time, in the primary's order, on this
stream's thread (see records.RecordApplier), and only when they continue
the log this stream's snapshot started (``positions.continues``); the
push streams open on the primary when the snapshot was taken are reopened
with it, so their later records apply here too (records.OpenPushes). Each
message is answered with the position applied so far, or, before the
snapshot is installed, with none: the primary waits for an answer naming
its term before it acknowledges a change to its worker, and reads any
answer as proof that this backup still follows it (see role.py).
"""

from __future__ import annotations

import functools
import logging
import ssl
import threading
import time
from collections.abc import Callable

from ps_server.coordination.positions import Position, continues
from ps_server.durability.restore import RestoredState
from ps_server.replication.records import Divergence, RecordApplier
from ps_server.replication.role import LeaderInfo, ReplicaRole
from ps_server.replication.snapshots import SnapshotReceiver
from wehub_ps.process.logs import event
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.frames import ConnectionClosed, FramedConnection, connect
from wehub_ps.wire.replication import answer, decode_record_message

__all__ = ["Follower"]

log = logging.getLogger("ps_server.replication")

#: A probe frame: a FollowRequest the primary reads and answers nothing to.
_PROBE = ps_pb2.FollowRequest(probe=True).SerializeToString()

#: Silence tolerated before this stream's snapshot is installed (the primary may be writing a large one
#: first); once in sync, the primary's silence for --failover-after ends the stream.
_CATCH_UP_SILENCE = 60.0

#: Push streams open in one snapshot at most (a primary serves far fewer at once).
_MAX_OPEN_PUSHES = 65536


class Follower:
    def __init__(self, role: ReplicaRole, shard_index: int, num_shards: int, applier: RecordApplier,
                 install: Callable[[RestoredState], None], tls: ssl.SSLContext | None,
                 snapshot_parent: str | None = None, token: Callable[[], str] | None = None) -> None:
        self._role = role
        self._shard_index = shard_index
        self._num_shards = num_shards
        self._applier = applier
        self._install = install
        self._tls = tls
        self._snapshot_parent = snapshot_parent
        self._token = token or (lambda: "")
        self._connection: FramedConnection | None = None

    def follow(self, leader: LeaderInfo) -> str:
        """Follow ``leader`` until the stream ends; says why it ended."""
        role = self._role
        settings = role.settings
        if not leader.replication_address:
            return "the primary announced no replication address"
        start = ps_pb2.FollowRequest(start=ps_pb2.FollowStart(
            shard_index=self._shard_index, num_shards=self._num_shards, replica_index=settings.replica_index,
            incarnation=settings.incarnation, address=settings.address, epoch=role.epoch,
            token=self._token())).SerializeToString()
        self._applier.forget_streams()
        receiver: SnapshotReceiver | None = None
        #: The push streams open in the snapshot being received.
        opened: list[ps_pb2.OpenPush] = []
        try:
            connection = connect(leader.replication_address, self._tls, settings.failover_after)
        except ConnectionClosed as error:
            return str(error)
        # Once in sync, silence longer than --failover-after (the primary pings five times as often) means
        # the primary is gone or cut off; a primary whose term ended is let go sooner, by interrupt().
        connection.set_timeout(_CATCH_UP_SILENCE)
        self._connection = connection
        event(log, logging.INFO, "following the primary", primary=leader.address, epoch=leader.epoch)
        #: Where this stream has brought the state: None until its snapshot is installed.
        held: Position | None = None
        probe: _SilenceProbe | None = None
        try:
            # An interrupt that came while connecting found no connection to close: ask again now.
            ended = role.stream_ended(leader)
            if ended is not None:
                return ended
            connection.send([start])
            while True:
                raw = connection.receive()
                if probe is not None:
                    probe.heard()
                record = decode_record_message(raw)
                if record is not None:
                    if held is None or not continues(held, record.epoch, record.sequence):
                        event(log, logging.ERROR, "a record does not continue the log; starting over",
                              record=f"{record.epoch}/{record.sequence}", held=str(held))
                        return "a record that does not continue the log this replica holds"
                    try:
                        self._applier.apply(record)
                    except Divergence as error:
                        event(log, logging.ERROR, "cannot apply the primary's change", error=str(error))
                        role.lost_state()
                        return "a change could not be applied"
                    held = Position(held.epoch, record.sequence)
                    role.applied = record.sequence
                else:
                    message = ps_pb2.ReplicationMessage.FromString(bytes(raw))
                    if message.epoch < role.epoch:
                        return f"the primary's term {message.epoch} is older than {role.epoch}"
                    kind = message.WhichOneof("kind")
                    if kind == "refused":
                        return f"the primary refused: {message.refused}"
                    if kind == "take_over":
                        if held is None or message.epoch != leader.epoch:
                            return "the primary handed over a term this replica does not hold in sync"
                        role.taking_over()  # every record of the term came before this message
                        return "the primary handed its term over to this replica"
                    if kind == "snapshot_file":
                        if receiver is None:
                            receiver = SnapshotReceiver(self._shard_index, self._num_shards,
                                                        self._snapshot_parent)
                        receiver.add(message.snapshot_file)
                    elif kind == "open_push":
                        if receiver is None or len(opened) >= _MAX_OPEN_PUSHES:
                            return "the primary sent an open push stream outside a snapshot, or too many"
                        opened.append(message.open_push)
                    elif kind == "snapshot_done":
                        if receiver is None:
                            return "the primary sent no snapshot"
                        if message.epoch != leader.epoch:
                            return f"the primary leads term {message.epoch}, not {leader.epoch}"
                        held = Position(message.epoch, message.snapshot_done)
                        try:
                            role.install(functools.partial(self._install_snapshot, receiver.load(), opened), held)
                        except Divergence as error:
                            event(log, logging.ERROR, "cannot apply the primary's change", error=str(error))
                            role.lost_state()
                            return "a push stream open in the snapshot could not be reopened"
                        opened = []
                        connection.set_timeout(settings.failover_after)
                        probe = _SilenceProbe(connection, settings.failover_after)
                        event(log, logging.INFO, "snapshot loaded", position=str(held),
                              bytes=receiver.bytes_received)
                        receiver.close()
                        receiver = None
                # Before the snapshot is installed the answer names no term: it acknowledges nothing.
                reply = answer(held.epoch, held.sequence) if held is not None else answer(0, 0)
                connection.send([reply])
                role.answered_primary(installed=held is not None, epoch=leader.epoch)
        except ConnectionClosed as error:
            if held is not None and isinstance(error.__cause__, TimeoutError):
                host_alive = connection.peer_acknowledged_within(0.75 * settings.failover_after)
                role.primary_silent(host_alive)
                return (f"the primary sent nothing for {settings.failover_after:g}s "
                        f"({'its host still acknowledges' if host_alive else 'nor did its host acknowledge'})")
            return f"stream broke: {error}"
        finally:
            if probe is not None:
                probe.stop()
            self._connection = None
            connection.close()
            if receiver is not None:
                receiver.close()

    def _install_snapshot(self, state: RestoredState, opened: list[ps_pb2.OpenPush]) -> None:
        """The snapshot's state, then its open push streams (Divergence: the state is not whole)."""
        self._install(state)
        self._applier.reopen(opened)

    def interrupt(self) -> None:
        """End the stream being followed (its primary's term is over); follow() then returns."""
        connection = self._connection
        if connection is not None:
            connection.close()


class _SilenceProbe:
    """While in sync: when the primary has sent nothing for half of --failover-after, send it one probe
    frame (answered by nothing). At the silence's end, whether the primary's host acknowledged the probe
    at the TCP level tells a lost host or link (end its term now) from a slow or frozen process (its
    lease decides: etcd ends the term if it stops renewing)."""

    def __init__(self, connection: FramedConnection, failover_after: float) -> None:
        self._connection = connection
        self._after = failover_after / 2
        self._heard = time.monotonic()
        self._probed_for = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ps-follow-probe", daemon=True)
        self._thread.start()

    def heard(self) -> None:
        self._heard = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self._after / 4):
            heard = self._heard
            if time.monotonic() - heard >= self._after and self._probed_for != heard:
                self._probed_for = heard
                try:
                    self._connection.send([_PROBE])
                except ConnectionClosed:
                    return

    def stop(self) -> None:
        self._stop.set()
