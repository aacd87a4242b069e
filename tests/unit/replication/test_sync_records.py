"""Sync steps through the replication log: a backup's step and sums are the primary's at every record.

In one process: a primary (store, ledger, membership on a fake clock, sync
controller) logs its records the way a replicated primary does (the push's
decision where it was taken, the push's message after it was applied, the
step it finished after that, a step a lease running out applied), and a
backup applies each record with ``RecordApplier``. After every record the
two hold the same values, sums, ledger and step; the backup takes no
decision and moves no step of its own, whatever its own membership says.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ps_server.core.consistency import ConsistencyController
from ps_server.core.errors import RequestError
from ps_server.core.ledger import PushLedger
from ps_server.core.membership import Membership
from ps_server.core.pushes import begin_push
from ps_server.core.store import VariableStore
from ps_server.replication import records
from ps_server.replication.records import RecordApplier
from ps_server.service.push_messages import chunks_message, push_chunks, push_start
from wehub_ps.errors import Reason
from wehub_ps.specs import SGD, Constant, VariableSpec
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.arrays import byte_view
from wehub_ps.wire.codec import DecodedChunk, decode_push_request
from wehub_ps.wire.replication import decode_record_message, record_message, record_pieces

LEASE = 10.0
SIZE = 4
DIM = 2


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Replica:
    """One replica's shard state: a dense variable and a hash table, trained with SGD(1)."""

    def __init__(self, clock: FakeClock) -> None:
        self.store = VariableStore(0, 1, 1 << 30)
        self.store.create(VariableSpec("w", (SIZE,), "float32", initializer=Constant(0.0), optimizer=SGD(1.0)))
        self.store.create(VariableSpec("t", (DIM,), "float32", initializer=Constant(0.0), optimizer=SGD(1.0),
                                       hash_table=True))
        self.ledger = PushLedger()
        self.membership = Membership(LEASE, clock)
        self.consistency = ConsistencyController("sync", 0, 0, self.membership, self.store)

    def state(self) -> tuple:
        with self.store.gate.exclusive():
            parts = []
            for snap in sorted(self.store.snapshot(), key=lambda s: s.spec.name):
                arrays = {"value": snap.value, **(snap.rows or {})}
                acc = snap.accumulator
                if acc is not None:
                    arrays.update({f"acc:{k}": v for k, v in (("dense", acc.dense), ("ids", acc.row_ids),
                                                               ("grads", acc.row_grads)) if v is not None})
                bits = {name: arr.tobytes() for name, arr in sorted(arrays.items())}
                parts.append((snap.spec.name, snap.version, bits,
                              None if acc is None else (acc.step, acc.dense_count, acc.row_count)))
            consistency = self.consistency.snapshot()
        return (parts, self.ledger.snapshot(),
                {key: consistency[key] for key in ("step", "steps_applied", "dropped", "accumulating")})


class Log:
    """The primary's side: its order (re-entrant on one thread, as ReplicaRole.ordered) and its records,
    each with the primary's state at the moment it was appended."""

    def __init__(self, primary: Replica) -> None:
        self.primary = primary
        self.records: list[tuple[object, tuple]] = []
        self._order = threading.RLock()
        self._streams = 0

    def ordered(self):
        return self._order

    def table_rows_read(self, reads) -> None:
        raise AssertionError("no pull in these tests")

    def sync_step(self, step: int, applied: bool) -> None:
        self._append(records.sync_step(step, applied))

    def _append(self, op) -> None:
        pieces = record_message(1, record_pieces(len(self.records) + 1, op[0]))
        record = decode_record_message(b"".join(bytes(p) for p in pieces))
        self.records.append((record, None))

    def snap(self) -> None:
        """After the change an append logged is whole (the primary's state as the backup must hold it)."""
        for index, (record, state) in enumerate(self.records):
            if state is None:
                self.records[index] = (record, self.primary.state())

    def push(self, worker: str, sequence: int, step: int, dense: float | None = None,
             rows: tuple[np.ndarray, float] | None = None) -> None:
        """One whole push (one message) as the servicer's replicated path runs it."""
        self._streams += 1
        stream = self._streams
        items, chunks = [], []
        if dense is not None:
            items.append(ps_pb2.PushItem(variable="w", elements=SIZE, wire_dtype=ps_pb2.FLOAT32))
            chunks.append(_chunk("w", np.full(SIZE, dense, np.float32)))
        if rows is not None:
            ids, value = rows
            items.append(ps_pb2.PushItem(variable="t", elements=len(ids) * DIM, wire_dtype=ps_pb2.FLOAT32,
                                         row_ids=ids.astype("<i8").tobytes()))
            chunks.append(_chunk("t", np.full(len(ids) * DIM, value, np.float32)))
        begin = ps_pb2.PushBegin(worker_id=worker, incarnation=f"{worker}-0", sequence=sequence, step=step,
                                 shard_index=0, num_shards=1, kind=ps_pb2.GRADIENT, items=items)

        def decided(at: int, decision: str, pins: list) -> None:
            self._append(records.push_decided(stream, at, decision == "accumulate",
                                              [(part.spec.name, ids) for part, ids in pins]))

        primary = self.primary
        active = begin_push(primary.store, primary.ledger, push_start(begin), primary.consistency, None, 1.0,
                            decided)
        self.snap()  # (the ledger opened the push since: a backup does at the push's record)
        message = chunks_message(chunks)
        with self.ordered():
            active.apply_many(push_chunks(decode_push_request(message)[1]))
            active.finish()
            self._append(records.push_applied(stream, begin, message, completed=True))
            self.snap()
        active.settle()
        self.snap()

    def heartbeat(self, worker: str) -> None:
        self.primary.membership.seen(worker, f"{worker}-0")
        self.snap()


def _chunk(name: str, values: np.ndarray) -> DecodedChunk:
    header = ps_pb2.ChunkHeader(variable=name, offset=0, count=values.size, dtype=ps_pb2.FLOAT32)
    return DecodedChunk(header, byte_view(values))


class NotPrimary:
    """A backup's order: refused (its steps move only at its primary's records)."""

    def ordered(self):
        raise RequestError(Reason.NOT_PRIMARY, "this replica is backup")

    def table_rows_read(self, reads) -> None:
        raise AssertionError("a backup logs nothing")

    def sync_step(self, step: int, applied: bool) -> None:
        raise AssertionError("a backup logs nothing")


@pytest.fixture
def replicas():
    clock = FakeClock()
    primary, backup = Replica(clock), Replica(clock)
    log = Log(primary)
    primary.consistency.changes = log
    backup.consistency.changes = NotPrimary()
    backup.membership.follow()
    applier = RecordApplier(backup.store, backup.ledger, backup.consistency)
    return clock, primary, backup, log, applier


def _replay(log: Log, applier: RecordApplier, backup: Replica, start: int = 0) -> int:
    """Apply the records from ``start`` on; after each, the backup holds what the primary held then."""
    for record, state in log.records[start:]:
        applier.apply(record)
        held = backup.state()
        if record.push is None and record.other.WhichOneof("op") == "sync_decision":
            held, state = (held[0], held[2]), (state[0], state[2])  # the ledger opens the push later
        assert held == state, f"after record {record.sequence}"
    return len(log.records)


def test_a_step_a_lease_expiry_applies_on_the_primary_is_applied_at_the_same_record(replicas):
    clock, primary, backup, log, applier = replicas
    for worker in ("a", "b", "c"):
        log.heartbeat(worker)
    log._append(records.consistency_state(primary.consistency.snapshot()))
    log.snap()
    ids = np.array([7, 3], np.int64)
    log.push("a", 1, 0, dense=1.0, rows=(ids, 2.0))
    log.push("b", 1, 0, dense=3.0, rows=(ids[:1], 4.0))
    assert primary.consistency.snapshot()["steps_applied"] == 0  # c holds the step
    done = _replay(log, applier, backup)
    # c's lease runs out on the primary (a and b renew theirs): the reaper applies step 0 there. The
    # backup's own clock says the same of every worker, yet it applies nothing until the record says so.
    clock.now += LEASE / 2
    log.heartbeat("a")
    log.heartbeat("b")
    clock.now += LEASE / 2 + 1
    assert backup.membership.expire() == []
    assert primary.membership.expire() == ["c"]
    log.snap()
    assert primary.consistency.snapshot()["steps_applied"] == 1
    assert backup.consistency.snapshot()["steps_applied"] == 0
    np.testing.assert_array_equal(primary.store.get("w").value, np.full(SIZE, -2.0, np.float32))
    assert [r.other.WhichOneof("op") for r, _ in log.records[done:]] == ["sync_step"]
    done = _replay(log, applier, backup, done)
    np.testing.assert_array_equal(backup.store.get("w").value, np.full(SIZE, -2.0, np.float32))
    # Step 1 goes on without c on both.
    log.push("a", 2, 1, dense=5.0)
    log.push("b", 2, 1, dense=7.0)
    assert primary.consistency.snapshot()["steps_applied"] == 2
    _replay(log, applier, backup, done)
    np.testing.assert_array_equal(backup.store.get("w").value, np.full(SIZE, -8.0, np.float32))


def test_the_step_a_push_finishes_is_logged_after_the_push_and_late_pushes_are_dropped_alike(replicas):
    _, primary, backup, log, applier = replicas
    for worker in ("a", "b"):
        log.heartbeat(worker)
    log.push("a", 1, 0, dense=1.0)
    log.push("b", 1, 0, dense=3.0)  # finishes step 0: its record, then the step's
    ops = [r.other.WhichOneof("op") if r.push is None else "push" for r, _ in log.records]
    assert ops == ["sync_decision", "push", "sync_decision", "push", "sync_step"]
    log.push("a", 2, 0, dense=100.0)  # a late push of step 0: dropped whole, on both
    assert primary.consistency.snapshot()["dropped"] == 1
    _replay(log, applier, backup)
    np.testing.assert_array_equal(backup.store.get("w").value, np.full(SIZE, -2.0, np.float32))
    assert backup.consistency.snapshot()["dropped"] == 1


def test_a_promoted_backup_gives_the_workers_it_followed_a_fresh_lease(replicas):
    clock, primary, backup, log, applier = replicas
    for worker in ("a", "b"):
        log.heartbeat(worker)
    log._append(records.consistency_state(primary.consistency.snapshot()))
    log.snap()
    log.push("a", 1, 0, dense=1.0)
    _replay(log, applier, backup)
    clock.now += 3 * LEASE  # long after the last record: the backup's table still says a and b are live
    assert backup.membership.live_ids() == {"a", "b"}
    backup.consistency.changes = Log(backup)  # promoted: it orders (and logs) from now on
    backup.membership.lead()
    assert backup.membership.live_ids() == {"a", "b"}
    state = backup.consistency.snapshot()
    assert (state["step"], state["steps_applied"]) == (0, 0), "the step waits for b, as on the old primary"
    clock.now += LEASE + 1  # b never comes back: one lease after the election it stops counting
    backup.membership.seen("a", "a-0")
    assert backup.membership.expire() == ["b"]
    assert backup.consistency.snapshot()["steps_applied"] == 1
    np.testing.assert_array_equal(backup.store.get("w").value, np.full(SIZE, -1.0, np.float32))
