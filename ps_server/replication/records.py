"""Replication records: what the primary logs for each change, and how a backup applies it.

A backup applies a record with the code the primary ran for the change:
the same push decoding, ``begin_push`` and ``ActivePush.apply_many`` (ledger
claims included), the same hash-table reads and the same ``create``; in
the primary's order, one at a time, so its values, optimizer slots and
ledger end up bit-identical. Decisions that depend on other workers
(consistency waits) were taken by the primary before it applied anything;
a backup applies what the primary applied and never waits. Of a push
message the primary refused part way (a later chunk past a table's limit),
the record carries the chunks the primary applied before the refusal, so a
backup applies exactly those.

Sync mode: the primary logs each push stream's decision (accumulate, with
the table rows it pinned, or drop) where it took it, and each move of the
open step (applied, or jumped over) where it made it, whether a push, a
heartbeat or a lease running out caused it. A backup takes the same
decision for the stream and moves its step only at those records, with the
same code (``ConsistencyController.follow_decision``, ``follow_step``), so
its step and sums are the primary's at every record. The controller's
clocks and workers travel as ``consistency`` records (their checkpoint
JSON), read under the order, like ssp's.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import numpy as np

from ps_server.core.consistency import ConsistencyController, PushDecision
from ps_server.core.errors import RequestError
from ps_server.core.ledger import PushLedger
from ps_server.core.pushes import ActivePush, begin_push, max_chunks_per_message
from ps_server.core.store import VariableStore
from ps_server.service.push_messages import push_chunks, push_start
from wehub_ps.errors import Reason
from wehub_ps.specs import SpecError
from wehub_ps.specs_proto import spec_from_proto
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.codec import decode_push_request
from wehub_ps.wire.protowire import CodecError
from wehub_ps.wire.replication import PushView, RecordView, other_op, push_op

__all__ = ["Divergence", "OpenPushes", "RecordApplier", "checkpoint", "consistency_state", "finish", "push_applied",
           "push_decided", "push_ended", "rows_expired", "rows_read", "sync_step", "variable_created"]

#: Bytes a record costs beyond its payload (headers, the begin of a small push).
RECORD_OVERHEAD = 128

#: A record's op as pieces to frame (wehub_ps.wire.replication), and the bytes it holds.
Op = tuple[list, int]


def push_applied(stream: int, begin: ps_pb2.PushBegin | None, message: bytes | memoryview,
                 completed: bool) -> Op:
    """A push message applied (``completed``: and the push finished with it); the message is not copied."""
    begin_bytes = begin.SerializeToString() if begin is not None else None
    op = push_op(stream, begin_bytes, message, completed)
    return op, RECORD_OVERHEAD + sum(len(p) if isinstance(p, bytes) else p.nbytes for p in op)


def push_ended(stream: int, begin: ps_pb2.PushBegin | None, completed: bool) -> Op:
    record = ps_pb2.ReplicationRecord(push_end=ps_pb2.PushEnded(stream=stream, completed=completed))
    if begin is not None:
        record.push_end.begin.CopyFrom(begin)
    return _small(record)


def rows_read(reads: list[tuple[str, np.ndarray]]) -> Op:
    return _small(ps_pb2.ReplicationRecord(rows_read=ps_pb2.TableRowsRead(tables=_table_rows(reads))))


def rows_expired(now: float, tables: list[tuple[str, np.ndarray]]) -> Op:
    return _small(ps_pb2.ReplicationRecord(rows_expired=ps_pb2.RowsExpired(time=now, tables=_table_rows(tables))))


def push_decided(stream: int, step: int, accumulate: bool, pins: list[tuple[str, np.ndarray]]) -> Op:
    decision = ps_pb2.SyncDecision(stream=stream, step=step, accumulate=accumulate, tables=_table_rows(pins))
    return _small(ps_pb2.ReplicationRecord(sync_decision=decision))


def sync_step(step: int, applied: bool) -> Op:
    return _small(ps_pb2.ReplicationRecord(sync_step=ps_pb2.SyncStep(step=step, applied=applied)))


def _table_rows(reads: list[tuple[str, np.ndarray]]) -> list[ps_pb2.TableRows]:
    return [ps_pb2.TableRows(variable=name, ids=np.ascontiguousarray(ids, dtype="<i8").tobytes())
            for name, ids in reads]


def variable_created(spec: ps_pb2.VariableSpec) -> Op:
    record = ps_pb2.ReplicationRecord()
    record.created.CopyFrom(spec)
    return _small(record)


def consistency_state(state: dict) -> Op:
    return _small(ps_pb2.ReplicationRecord(consistency=json.dumps(state, sort_keys=True)))


def finish() -> Op:
    return _small(ps_pb2.ReplicationRecord(finish=True))


def checkpoint() -> Op:
    return _small(ps_pb2.ReplicationRecord(checkpoint=True))


def _small(record: ps_pb2.ReplicationRecord) -> Op:
    op = other_op(record)
    return op, RECORD_OVERHEAD + len(op[0])


class OpenPushes:
    """A primary's push streams whose begin is in its log and whose end is not yet.

    A catch-up snapshot holds what such a stream applied so far; the backup
    reopens the stream from its begin, sent with the snapshot, so that the
    stream's later records apply there as well. That works for a push applied
    as it arrives (async and ssp gradients: the snapshot's ledger holds its
    claims). A sync push's gradients and an ASSIGN push's values are staged
    in the primary's memory until the push ends, which no snapshot holds: a
    backup cannot go on with such a stream, so a snapshot waits (a bounded
    time) for an instant when none is open. Thread-safe; ``logged`` is
    called in the log's order, as its record is appended.
    """

    def __init__(self, sync: bool = False) -> None:
        self._sync = sync
        # Guards _begins (open streams by the primary's stream number) and _staged (those of them whose
        # effects are staged in memory until they end); notified when a stream ends.
        self._changed = threading.Condition()
        self._begins: dict[int, ps_pb2.PushBegin] = {}
        self._staged: set[int] = set()

    def logged(self, stream: int, begin: ps_pb2.PushBegin | None, ended: bool) -> None:
        """A record of ``stream`` was logged (``begin``: it carried the push's begin; ``ended``: the last)."""
        with self._changed:
            if ended:
                self._begins.pop(stream, None)
                if stream in self._staged:
                    self._staged.discard(stream)
                    self._changed.notify_all()
            elif begin is not None:
                self._begins[stream] = begin
                if self._sync or begin.kind == ps_pb2.ASSIGN:
                    self._staged.add(stream)

    def clear(self) -> None:
        """A new log (a new term): the streams of the old one end with it."""
        with self._changed:
            self._begins.clear()
            self._staged.clear()
            self._changed.notify_all()

    def staged(self) -> bool:
        """Whether a stream whose effects no snapshot holds is open."""
        with self._changed:
            return bool(self._staged)

    def wait_unstaged(self, seconds: float) -> None:
        """Wait at most ``seconds`` for no stream with staged effects to be open."""
        deadline = time.monotonic() + seconds
        with self._changed:
            while self._staged and (remaining := deadline - time.monotonic()) > 0:
                self._changed.wait(remaining)

    def resumable(self) -> list[ps_pb2.OpenPush]:
        """The open streams a backup can go on with from a snapshot taken now (under the log's order)."""
        with self._changed:
            return [ps_pb2.OpenPush(stream=stream, begin=begin) for stream, begin in self._begins.items()
                    if stream not in self._staged]


class Divergence(Exception):
    """A record the backup could not apply as the primary did: its state can no longer be trusted."""


class RecordApplier:
    """A backup's side of the log: applies records in order, one at a time (one thread)."""

    def __init__(self, store: VariableStore, ledger: PushLedger, consistency: ConsistencyController,
                 on_finish: Callable[[], None] = lambda: None,
                 on_checkpoint: Callable[[], None] = lambda: None) -> None:
        self._on_finish = on_finish
        self._on_checkpoint = on_checkpoint
        self._store = store
        self._ledger = ledger
        self._consistency = consistency
        #: Push streams open on the primary, by the primary's stream number.
        self._streams: dict[int, ActivePush] = {}
        #: Sync: the primary's decision for streams whose first push record is still to come.
        self._decided: dict[int, str] = {}

    def apply(self, record: RecordView) -> None:
        """Apply one record; Divergence when it fails (the primary applied it)."""
        if record.push is not None:
            op = "push"
        else:
            assert record.other is not None
            op = record.other.WhichOneof("op")
        try:
            if record.push is not None:
                self._push(record.push)
            elif op == "push_end":
                self._push_end(record.other.push_end)
            elif op == "rows_read":
                self._store.read_rows(self._tables(record.other.rows_read.tables))
            elif op == "rows_expired":
                expired = record.other.rows_expired
                self._store.apply_sweep(self._tables(expired.tables), expired.time)
            elif op == "sync_decision":
                self._sync_decision(record.other.sync_decision)
            elif op == "sync_step":
                self._consistency.follow_step(record.other.sync_step.step, record.other.sync_step.applied)
            elif op == "created":
                self._store.create(spec_from_proto(record.other.created))
            elif op == "consistency":
                self._consistency.restore(json.loads(record.other.consistency))
            elif op == "finish":
                self._on_finish()
            elif op == "checkpoint":
                self._on_checkpoint()
            else:
                raise Divergence(f"record {record.sequence} carries no change this backup knows ({op})")
        except (RequestError, SpecError, CodecError) as error:
            raise Divergence(f"record {record.sequence} ({op}) failed on this backup: {error}") from error

    def reopen(self, opened: list[ps_pb2.OpenPush]) -> None:
        """After a snapshot is installed: the push streams open on the primary when it was taken."""
        for open_push in opened:
            try:
                self._begin(open_push.stream, open_push.begin)
            except (RequestError, SpecError) as error:
                raise Divergence(f"push stream {open_push.stream}, open in the primary's snapshot, cannot "
                                 f"be reopened on this backup: {error}") from error

    def forget_streams(self) -> None:
        """Promoted to primary: the old primary's open streams are retried by their workers."""
        self._streams.clear()
        self._decided.clear()

    def _tables(self, tables) -> list:
        return [(self._store.get(t.variable), np.frombuffer(t.ids, dtype="<i8")) for t in tables]

    def _sync_decision(self, decided: ps_pb2.SyncDecision) -> None:
        pins = self._tables(decided.tables)
        with self._store.gate.shared():
            self._consistency.follow_decision(decided.step, decided.accumulate,
                                              lambda: self._store.pin_rows(pins))
        self._decided[decided.stream] = PushDecision.ACCUMULATE if decided.accumulate else PushDecision.DROP

    def _begin(self, stream: int, begin: ps_pb2.PushBegin) -> ActivePush:
        if not begin.worker_id:
            raise Divergence(f"push stream {stream} has no begin on this backup (a push staged on the "
                             "primary, open when this backup's snapshot was taken)")
        consistency = decision = None
        if self._consistency.mode == "sync":
            consistency = self._consistency
            # Unknown when this replica's snapshot was taken between the decision and this record: the
            # snapshot holds its effects, and a push of the step still open then accumulated (one of an
            # earlier step is dropped, as are both once the step moved on).
            decision = self._decided.pop(stream, None) or (
                PushDecision.ACCUMULATE if begin.step == consistency.cluster_step() else PushDecision.DROP)
        active = begin_push(self._store, self._ledger, push_start(begin), consistency, None, 0.0,
                            decision=decision)
        self._streams[stream] = active
        return active

    def _push(self, push: PushView) -> None:
        active = self._streams.get(push.stream)
        if active is None:
            begin = ps_pb2.PushBegin.FromString(push.begin) if push.begin is not None else ps_pb2.PushBegin()
            active = self._begin(push.stream, begin)
        _, chunks = decode_push_request(push.message, max_chunks_per_message(self._store))
        active.apply_many(push_chunks(chunks))
        if push.completed:
            del self._streams[push.stream]
            self._finish(push.stream, active)

    def _push_end(self, ended: ps_pb2.PushEnded) -> None:
        active = self._streams.pop(ended.stream, None)
        if active is None and ended.HasField("begin"):
            active = self._begin(ended.stream, ended.begin)
            self._streams.pop(ended.stream, None)
        if active is not None and ended.completed:
            self._finish(ended.stream, active)

    @staticmethod
    def _finish(stream: int, active: ActivePush) -> None:
        try:
            active.finish()
        except RequestError as error:
            if error.reason is Reason.PUSH_INCOMPLETE:
                raise Divergence(f"push stream {stream} finished on the primary but not here: "
                                 f"{error.message}") from error
            raise
