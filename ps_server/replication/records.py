"""Replication records: what the primary logs for each change, and how a backup applies it.

A backup applies a record with the code the primary ran for the change:
the same push decoding, ``begin_push`` and ``ActivePush.apply_many`` (ledger
claims included), the same hash-table reads and the same ``create``; in
the primary's order, one at a time, so its values, optimizer slots and
ledger end up bit-identical. Decisions that depend on other workers
(consistency waits) were taken by the primary before it applied anything;
a backup applies what the primary applied, so it passes no consistency
controller and never waits.
"""

from __future__ import annotations

import json

import numpy as np

from ps_server.core.consistency import ConsistencyController
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

__all__ = ["Divergence", "RecordApplier", "consistency_state", "push_applied", "push_ended", "rows_read",
           "variable_created"]

#: Bytes a record costs beyond its payload (headers, the begin of a small push).
RECORD_OVERHEAD = 128


def push_applied(stream: int, begin: ps_pb2.PushBegin | None, message: bytes
                 ) -> tuple[ps_pb2.ReplicationRecord, int]:
    record = ps_pb2.ReplicationRecord(push=ps_pb2.PushApplied(stream=stream, message=message))
    size = len(message) + RECORD_OVERHEAD
    if begin is not None:
        record.push.begin.CopyFrom(begin)
        size += begin.ByteSize()
    return record, size


def push_ended(stream: int, begin: ps_pb2.PushBegin | None, completed: bool
               ) -> tuple[ps_pb2.ReplicationRecord, int]:
    record = ps_pb2.ReplicationRecord(push_end=ps_pb2.PushEnded(stream=stream, completed=completed))
    size = RECORD_OVERHEAD
    if begin is not None:
        record.push_end.begin.CopyFrom(begin)
        size += begin.ByteSize()
    return record, size


def rows_read(reads: list[tuple[str, np.ndarray]]) -> tuple[ps_pb2.ReplicationRecord, int]:
    tables = [ps_pb2.TableRows(variable=name, ids=np.ascontiguousarray(ids, dtype="<i8").tobytes())
              for name, ids in reads]
    record = ps_pb2.ReplicationRecord(rows_read=ps_pb2.TableRowsRead(tables=tables))
    return record, RECORD_OVERHEAD + sum(len(t.ids) for t in tables)


def variable_created(spec: ps_pb2.VariableSpec) -> tuple[ps_pb2.ReplicationRecord, int]:
    record = ps_pb2.ReplicationRecord()
    record.created.CopyFrom(spec)
    return record, RECORD_OVERHEAD + spec.ByteSize()


def consistency_state(state: dict) -> tuple[ps_pb2.ReplicationRecord, int]:
    record = ps_pb2.ReplicationRecord(consistency=json.dumps(state, sort_keys=True))
    return record, RECORD_OVERHEAD + len(record.consistency)


class Divergence(Exception):
    """A record the backup could not apply as the primary did: its state can no longer be trusted."""


class RecordApplier:
    """A backup's side of the log: applies records in order, one at a time (one thread)."""

    def __init__(self, store: VariableStore, ledger: PushLedger, consistency: ConsistencyController) -> None:
        self._store = store
        self._ledger = ledger
        self._consistency = consistency
        #: Push streams open on the primary, by the primary's stream number.
        self._streams: dict[int, ActivePush | None] = {}

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def apply(self, record: ps_pb2.ReplicationRecord) -> None:
        """Apply one record; Divergence when it fails (the primary applied it)."""
        op = record.WhichOneof("op")
        try:
            if op == "push":
                self._push(record.push)
            elif op == "push_end":
                self._push_end(record.push_end)
            elif op == "rows_read":
                reads = [(self._store.get(t.variable), np.frombuffer(t.ids, dtype="<i8"))
                         for t in record.rows_read.tables]
                self._store.read_rows(reads)
            elif op == "created":
                self._store.create(spec_from_proto(record.created))
            elif op == "consistency":
                self._consistency.restore(json.loads(record.consistency))
            else:
                raise Divergence(f"record {record.sequence} carries no change this backup knows ({op})")
        except (RequestError, SpecError) as error:
            raise Divergence(f"record {record.sequence} ({op}) failed on this backup: {error}") from error

    def forget_streams(self) -> None:
        """Promoted to primary: the old primary's open streams are retried by their workers."""
        self._streams.clear()

    def _begin(self, stream: int, begin: ps_pb2.PushBegin) -> ActivePush | None:
        if not begin.worker_id:
            raise Divergence(f"push stream {stream} has no begin on this backup")
        active = begin_push(self._store, self._ledger, push_start(begin), None, None, 0.0)
        self._streams[stream] = active
        return active

    def _push(self, applied: ps_pb2.PushApplied) -> None:
        active = self._streams.get(applied.stream)
        if active is None:
            active = self._begin(applied.stream, applied.begin)
        _, chunks = decode_push_request(applied.message, max_chunks_per_message(self._store))
        active.apply_many(push_chunks(chunks))

    def _push_end(self, ended: ps_pb2.PushEnded) -> None:
        active = self._streams.pop(ended.stream, None)
        if active is None and ended.HasField("begin"):
            active = self._begin(ended.stream, ended.begin)
            self._streams.pop(ended.stream, None)
        if active is not None and ended.completed:
            try:
                active.finish()
            except RequestError as error:
                if error.reason is Reason.PUSH_INCOMPLETE:
                    raise Divergence(f"push stream {ended.stream} finished on the primary but not here: "
                                     f"{error.message}") from error
                raise
