"""Synchronous-mode pushes through the real push path (ps_server.core.pushes) and the bookkeeping
of workers and clocks; no servers, no network.

A late push is dropped whole even when it completes while its step is being
applied variable by variable; a sync push's table rows are pinned for its
step; the clock table and the worker table stay bounded.
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
from test_store import _begin, _chunks

import ps_server.core.membership as membership_module
from ps_server.core.accumulator import PushStaging
from ps_server.core.consistency import ConsistencyController
from ps_server.core.errors import RequestError
from ps_server.core.ledger import PushLedger
from ps_server.core.membership import Membership
from ps_server.core.pushes import begin_push
from ps_server.core.store import VariableStore
from ps_server.core.tables import HashTablePart
from ps_server.durability.checkpointer import Checkpointer
from ps_server.durability.restore import find_restore_plan, load_parts
from ps_server.service.push_messages import push_start
from wehub_ps.errors import Reason
from wehub_ps.specs import SGD, Constant, VariableSpec, Zeros
from wehub_ps.v1 import ps_pb2

WAIT = 10.0  # generous bound for things that must happen
WINDOW = 1.0  # how long the step's application stays paused for a late push to slip in
LEASE = 10.0
SIZE = 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Shard:
    """A store with dense variables 'x' and 'y' (SGD lr 1, zeros), a ledger and a sync controller."""

    def __init__(self, backup_workers: int = 0, mode: str = "sync") -> None:
        self.clock = FakeClock()
        self.membership = Membership(LEASE, clock=self.clock)
        self.store = VariableStore(0, 1, 1 << 30)
        for name in ("x", "y"):
            self.store.create(VariableSpec(name, (SIZE,), "float32", initializer=Zeros(),
                                           optimizer=SGD(learning_rate=1.0)))
        self.ledger = PushLedger()
        self.ctrl = ConsistencyController(mode, 0, backup_workers, self.membership, self.store)
        self.sequences: dict[str, int] = {}

    def join(self, *workers: str) -> None:
        for w in workers:
            if self.membership.seen(w, f"inc-{w}", 0):
                self.ctrl.forget(w)
            self.ctrl.on_heartbeat(w, 0)

    def begin(self, worker: str, step: int):
        """A push of 'x' and 'y' by ``worker`` at ``step``: its begin (decided, nothing applied)."""
        self.sequences[worker] = self.sequences.get(worker, 0) + 1
        begin = _begin([("x", SIZE, ps_pb2.FLOAT32), ("y", SIZE, ps_pb2.FLOAT32)],
                       sequence=self.sequences[worker], worker_id=worker, incarnation=f"inc-{worker}",
                       step=step)
        self.membership.seen(worker, f"inc-{worker}", step, pushed=True)
        return begin_push(self.store, self.ledger, begin, self.ctrl)

    @staticmethod
    def send(push, value: float):
        """Both variables' chunks in one message, as a small push sends them; the push's result."""
        grad = np.full(SIZE, value, np.float32)
        push.apply_many(_chunks("x", grad, SIZE) + _chunks("y", grad, SIZE))
        return push.finish()

    def value(self, name: str) -> np.ndarray:
        return self.store.get(name).value.copy()


def test_a_push_completing_while_its_step_is_applied_is_dropped_whole():
    """b's push of step 0 arrives whole while step 0 is being applied, 'x' done and 'y' not yet.

    It must be in neither variable's update (answered dropped) or in both; never in 'y' only.
    The application is paused between the two variables for WINDOW seconds, long enough for
    b's push to complete there if nothing keeps it out.
    """
    shard = Shard(backup_workers=1)
    shard.join("a", "b", "c")
    assert not shard.send(shard.begin("a", 0), 2.0).dropped
    late = shard.begin("b", 0)  # b's push begins while step 0 is open
    applying_y = threading.Event()
    b_finished = threading.Event()
    y = shard.store.get("y")
    original = y.apply_accumulated

    def paused(step: int) -> bool:
        applying_y.set()
        b_finished.wait(WINDOW)  # b's push may complete here, unless it is kept out
        return original(step)

    y.apply_accumulated = paused
    results = {}
    # c's push completes step 0 (3 live, 1 backup worker): it applies the step, 'x' then 'y'.
    applier = threading.Thread(target=lambda: results.setdefault("c", shard.send(shard.begin("c", 0), 4.0)),
                               name="test-applier")
    applier.start()
    assert applying_y.wait(WAIT)

    def finish_late() -> None:
        results["b"] = shard.send(late, 100.0)
        b_finished.set()

    pusher = threading.Thread(target=finish_late, name="test-late-push")
    pusher.start()
    applier.join(WAIT)
    pusher.join(WAIT)
    assert not applier.is_alive() and not pusher.is_alive()
    x, y_value = shard.value("x"), shard.value("y")
    if results["b"].dropped:
        expected = -np.full(SIZE, 3.0, np.float32)  # the mean of a's 2 and c's 4
    else:
        expected = -np.full(SIZE, (2.0 + 4.0 + 100.0) / 3, np.float32)
    np.testing.assert_array_equal(x, expected)
    np.testing.assert_array_equal(y_value, expected)
    stats = shard.ctrl.stats()
    assert (stats.steps_applied, stats.dropped_gradients) == (1, 1 if results["b"].dropped else 0)


# ---- bounded hash tables in sync mode ------------------------------------------------------------------


class Reserve:
    def __call__(self, delta: int) -> None:
        pass


def _table(max_rows: int, eviction: str) -> HashTablePart:
    spec = VariableSpec("t", (2,), "float32", initializer=Constant(0.0), optimizer=SGD(learning_rate=1.0),
                        hash_table=True, max_rows=max_rows, eviction=eviction)
    return HashTablePart(spec, max_rows, Reserve())


def test_lru_table_pins_the_open_steps_rows_and_refuses_a_push_that_would_not_fit():
    table = _table(100, "lru")
    table.read_rows(np.arange(1000, 1050, dtype=np.int64))  # 50 rows of earlier steps
    table.pin_rows(np.arange(0, 80, dtype=np.int64))
    assert (table.num_rows, table.evicted_rows) == (100, 30)
    before = table.rows_snapshot()
    with pytest.raises(RequestError) as info:
        table.pin_rows(np.arange(80, 160, dtype=np.int64))
    assert info.value.reason == Reason.MEMORY_LIMIT and "open synchronous step" in info.value.message
    after = table.rows_snapshot()
    assert all(np.array_equal(before[k], after[k]) for k in before), "a refused pin changes nothing"
    # Pulls never evict a pinned row: room comes from the older rows only.
    table.read_rows(np.arange(2000, 2020, dtype=np.int64))
    ids = table.rows_snapshot()["ids"]
    assert np.isin(np.arange(0, 80), ids).all() and table.num_rows == 100
    with pytest.raises(RequestError):  # 80 pinned + 21 more in one request cannot fit
        table.read_rows(np.arange(3000, 3021, dtype=np.int64))
    # Applying (or discarding) the step releases the pins.
    table.start_step(1)
    table.read_rows(np.arange(3000, 3100, dtype=np.int64))
    assert table.num_rows == 100


def test_table_without_eviction_refuses_a_pin_beyond_max_rows():
    table = _table(100, "none")
    table.pin_rows(np.arange(0, 80, dtype=np.int64))
    with pytest.raises(RequestError) as info:
        table.pin_rows(np.arange(80, 160, dtype=np.int64))
    assert info.value.reason == Reason.MEMORY_LIMIT
    assert table.num_rows == 80
    table.pin_rows(np.arange(80, 100, dtype=np.int64))
    assert table.num_rows == 100


# ---- checkpoints -----------------------------------------------------------------------------------


def test_step_sums_clocks_and_workers_travel_in_the_checkpoint(tmp_path):
    """A checkpoint in the middle of a sync step: after a restore, the step is completed by the
    missing worker's push alone, with the checkpointed gradients in the mean."""
    shard = Shard()
    shard.join("a", "b")
    table = shard.store.create(VariableSpec("t", (2,), "float32", initializer=Zeros(),
                                            optimizer=SGD(learning_rate=1.0), hash_table=True))
    assert table[1]
    shard.send(shard.begin("a", 0), 1.0)
    shard.send(shard.begin("b", 0), 3.0)  # step 0 applied: -2
    shard.send(shard.begin("a", 1), 1.0)  # step 1 open, a's gradient in its sum
    ids = np.array([5, 9], np.int64)
    shard.store.get("t").pin_rows(ids)
    staging = PushStaging()
    staging.add_rows(ids, np.full((2, 2), 6.0, np.float32), np.dtype(np.float32))
    shard.store.get("t").merge_staged(1, staging)
    checkpointer = Checkpointer(shard.store, shard.ledger, str(tmp_path), "srv", keep=2, interval=0,
                                persist_open_pushes=False, consistency_state=shard.ctrl.snapshot)
    checkpointer.checkpoint("test")

    restored = Shard()  # a new process: empty store, fresh clock, nobody registered
    plan = find_restore_plan(tmp_path, 0, 1)
    restored.store.restore(load_parts(plan, 0, 1))
    restored.ledger.restore(plan.manifests[0]["ledger"]["entries"])
    assert restored.ctrl.restore(plan.manifests[0]["consistency"])
    stats = restored.ctrl.stats()
    assert (stats.step, stats.steps_applied) == (1, 1)
    assert restored.membership.live_ids() == {"a", "b"}
    assert restored.ledger.is_done("a", "inc-a", 2), "a's push is in the ledger and in the sum"
    restored.sequences = dict(shard.sequences)
    assert not restored.send(restored.begin("b", 1), 3.0).dropped
    np.testing.assert_array_equal(restored.value("x"), np.full(SIZE, -4.0, np.float32))
    np.testing.assert_array_equal(restored.store.get("t").read_rows(ids), np.full((2, 2), -6.0, np.float32))
    assert restored.ctrl.stats().step == 2

    # Another shard count assembles the values but starts the steps afresh.
    other = find_restore_plan(tmp_path, 0, 2)
    assert all(part.accumulator is None for part in load_parts(other, 0, 2))
    # Another mode keeps nothing of it either.
    async_shard = Shard(mode="async")
    async_shard.store.restore(load_parts(plan, 0, 1))
    assert not async_shard.ctrl.restore(plan.manifests[0]["consistency"])
    assert async_shard.store.get("x").accumulator.empty


# ---- bounded bookkeeping -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["ssp", "sync"])
def test_clock_table_keeps_live_workers_only(mode):
    """Workers come and go (a new id per pod): their clocks go with their leases."""
    shard = Shard(mode=mode)
    for i in range(200):
        shard.join(f"w{i}")
        shard.ctrl.on_heartbeat(f"w{i}", 3)
        shard.clock.now += LEASE + 1
        assert shard.membership.expire() == [f"w{i}"]
        assert shard.ctrl.clock_count() == 0
    shard.join("late")
    assert shard.ctrl.clock_count() == 1
    if mode == "ssp":  # a worker joining when nobody else is live starts at the highest clock seen
        assert shard.ctrl.cluster_step() == 3


def test_a_worker_back_after_its_lease_ran_out_rejoins_at_the_clusters_clock():
    shard = Shard(mode="ssp")
    shard.join("a", "b")
    shard.ctrl.on_heartbeat("a", 5)
    shard.ctrl.on_heartbeat("b", 5)
    shard.clock.now += LEASE / 2
    shard.membership.seen("a", "inc-a")
    shard.clock.now += LEASE / 2 + 1
    assert shard.membership.expire() == ["b"]
    assert shard.ctrl.clock_count() == 1
    shard.membership.seen("b", "inc-b")  # back (same incarnation), first seen by a pull
    assert shard.ctrl.clock_count() == 2 and shard.ctrl.cluster_step() == 5


def test_worker_table_forgets_the_least_recently_seen_first(monkeypatch):
    monkeypatch.setattr(membership_module, "MAX_WORKERS", 3)
    clock = FakeClock()
    membership = Membership(LEASE, clock=clock)
    for name in ("a", "b", "c"):
        membership.seen(name, "1")
        clock.now += 1
    membership.seen("a", "1")  # b is now the least recently seen ...
    membership.leave("c", "1")  # ... unless one left: c goes first
    clock.now += 5
    membership.seen("d", "1")
    assert sorted(r.worker_id for r in membership.workers()) == ["a", "b", "d"]
    membership.seen("e", "1")
    assert sorted(r.worker_id for r in membership.workers()) == ["a", "d", "e"]
    assert membership.live_ids() == {"a", "d", "e"}
    clock.now += LEASE - 4  # a was seen 5 s before d and e: its lease runs out first
    assert membership.live_ids() == {"d", "e"}


def test_worker_table_round_trips_through_a_snapshot_with_fresh_leases():
    clock = FakeClock()
    membership = Membership(LEASE, clock=clock)
    membership.seen("gone", "1", step=2)
    clock.now += LEASE + 1
    membership.seen("live", "7", step=4, pushed=True)
    saved = membership.snapshot()
    restored = Membership(LEASE, clock=FakeClock())
    restored.restore(saved)
    records = {r.worker_id: r for r in restored.workers()}
    live = records["live"]
    assert (live.incarnation, live.step, live.pushes, live.live) == ("7", 4, 1, True)
    assert not records["gone"].live and restored.live_ids() == {"live"}


def test_after_the_final_checkpoint_sealed_the_gate_no_step_is_applied():
    """The final checkpoint holds the open step and its sum; applying it later would be lost."""
    shard = Shard()
    shard.join("a", "b")
    shard.send(shard.begin("a", 0), 2.0)
    shard.store.gate.seal()
    assert shard.ctrl.on_heartbeat("b", 1) == 1  # b finished step 0: the step is ready, not applied
    stats = shard.ctrl.stats()
    assert (stats.step, stats.steps_applied) == (0, 0)
    np.testing.assert_array_equal(shard.value("x"), np.zeros(SIZE, np.float32))
    with pytest.raises(RequestError) as info:
        shard.begin("b", 0)
    assert info.value.reason == Reason.SHUTTING_DOWN


# ---- memory: a step's running sums and a push's table rows are booked -----------------------------------

WIDTH = 64  # elements per table row: 256 bytes of float32


def _tables_shard(workers: int) -> Shard:
    """:class:`Shard` with hash tables 't' and 'u' (WIDTH float32 per row) and ``workers`` live workers."""
    shard = Shard()
    for name in ("t", "u"):
        shard.store.create(VariableSpec(name, (WIDTH,), "float32", initializer=Zeros(),
                                        optimizer=SGD(learning_rate=1.0), hash_table=True))
    shard.join(*[f"w{i}" for i in range(workers)])
    return shard


def _rows_push(shard: Shard, worker: str, step: int, rows: dict[str, np.ndarray]):
    """Begin ``worker``'s push of step ``step`` of rows ``rows[table]`` (the real begin_push)."""
    shard.sequences[worker] = shard.sequences.get(worker, 0) + 1
    begin = push_start(ps_pb2.PushBegin(
        worker_id=worker, incarnation=f"inc-{worker}", sequence=shard.sequences[worker], shard_index=0,
        num_shards=1, kind=ps_pb2.GRADIENT, step=step,
        items=[ps_pb2.PushItem(variable=name, elements=len(ids) * WIDTH, wire_dtype=ps_pb2.FLOAT32,
                               row_ids=ids.astype("<i8").tobytes()) for name, ids in rows.items()]))
    shard.membership.seen(worker, f"inc-{worker}", step, pushed=True)
    return begin_push(shard.store, shard.ledger, begin, shard.ctrl)


def _send_rows(push, rows: dict[str, np.ndarray], value: float):
    chunks = []
    for name, ids in rows.items():
        chunks += _chunks(name, np.full(len(ids) * WIDTH, value, np.float32), len(ids) * WIDTH)
    push.apply_many(chunks)
    return push.finish()


def _variable_bytes(shard: Shard) -> int:
    """Bytes the store books for its variables, less the tables' own rows: what the sums hold."""
    return shard.store.reserved_bytes - sum(shard.store.get(name).nbytes for name in ("t", "u"))


def test_a_sparse_steps_running_sum_is_booked_until_the_step_is_applied():
    """Each push of step 0 adds its rows to the sum: the store books them (ids and gradients, three
    copies: the sum, its concatenation and the copy sorted by id when the step is applied) from the
    moment they are staged until the step is applied; the push's own booking is given back."""
    shard = _tables_shard(3)
    base, held = _variable_bytes(shard), shard.store.held_bytes
    per_push = 3 * 100 * (8 + WIDTH * 4)
    for i, worker in enumerate(("w0", "w1")):
        rows = {"t": np.arange(i * 100, i * 100 + 100, dtype=np.int64)}
        assert not _send_rows(_rows_push(shard, worker, 0, rows), rows, 3.0).dropped
        gc.collect()  # the push's ledger session is gone: what it booked is given back
        assert shard.store.held_bytes == held
        assert _variable_bytes(shard) == base + (i + 1) * per_push
        assert shard.store.get("t").accumulator.nbytes == (i + 1) * per_push
    rows = {"t": np.arange(500, 510, dtype=np.int64)}
    assert not _send_rows(_rows_push(shard, "w2", 0, rows), rows, 3.0).dropped  # the step is applied
    gc.collect()
    assert shard.ctrl.stats().steps_applied == 1
    assert (_variable_bytes(shard), shard.store.held_bytes) == (base, held)
    assert shard.store.get("t").read_rows(np.array([0, 150, 505], np.int64)).tolist() == \
        [[-1.0] * WIDTH] * 3  # each row's sum over the 3 pushes that sent rows


def test_a_sparse_step_cannot_grow_its_sum_past_the_memory_limit():
    """Pushes of new rows by ever more workers grow step 0's sum until the memory limit refuses
    one (RESOURCE_EXHAUSTED) before it is staged; the refused push is in no sum and the step
    still applies the pushes it holds."""
    shard = _tables_shard(12)
    per_push = 3 * 100 * (8 + WIDTH * 4)
    table = shard.store.get("t")
    table.read_rows(np.arange(0, 1000, dtype=np.int64))  # the rows exist: pins grow nothing
    # Room for the sums of 4 pushes and one unfinished push's records, not for a fifth sum.
    shard.store.memory_limit = shard.store.reserved_bytes + 4 * per_push + 64 * 1024
    for i in range(4):
        rows = {"t": np.arange(i * 100, i * 100 + 100, dtype=np.int64)}
        assert not _send_rows(_rows_push(shard, f"w{i}", 0, rows), rows, 12.0).dropped
        gc.collect()
    rows = {"t": np.arange(400, 500, dtype=np.int64)}
    refused = _rows_push(shard, "w4", 0, rows)
    with pytest.raises(RequestError) as info:
        _send_rows(refused, rows, 1.0)
    assert info.value.reason == Reason.MEMORY_LIMIT
    assert (table.accumulator.row_count, table.accumulator.nbytes) == (4, 4 * per_push)
    del refused
    gc.collect()  # the refused push's staging and records are given back with its session
    for i in range(4, 12):  # the other workers finish step 0 with nothing new to add
        assert not _send_rows(_rows_push(shard, f"w{i}", 0, {"t": np.arange(0, 1, dtype=np.int64)}),
                              {"t": np.arange(0, 1, dtype=np.int64)}, 0.0).dropped
    assert shard.ctrl.stats().steps_applied == 1
    assert table.accumulator.nbytes == 0
    np.testing.assert_array_equal(table.read_rows(np.array([399, 400], np.int64))[:, 0], [-1.0, 0.0])


def test_a_push_refused_growing_its_second_table_leaves_the_first_as_it_was():
    """A sync push of new rows of 't' and 'u': the memory limit has room for 't''s growth, not for
    both; the push is refused (RESOURCE_EXHAUSTED) and neither table has a new row or a pin."""
    shard = _tables_shard(2)
    t, u = shard.store.get("t"), shard.store.get("u")
    rows = {"t": np.arange(0, 10, dtype=np.int64), "u": np.arange(0, 10, dtype=np.int64)}
    growth = t.nbytes_for(1024) - t.nbytes  # either table's first growth
    shard.store.memory_limit = shard.store.reserved_bytes + growth + growth // 2
    reserved, generation = shard.store.reserved_bytes, shard.store.generation
    with pytest.raises(RequestError) as info:
        _rows_push(shard, "w0", 0, rows)
    assert info.value.reason == Reason.MEMORY_LIMIT
    assert (t.num_rows, u.num_rows, t.capacity, u.capacity) == (0, 0, 0, 0)
    assert (len(t._pinned), len(u._pinned)) == (0, 0)
    assert shard.store.reserved_bytes == reserved and shard.store.generation == generation
    # With room for both, the same push goes through.
    shard.store.memory_limit = reserved + 3 * growth
    assert not _send_rows(_rows_push(shard, "w0", 0, rows), rows, 1.0).dropped
    assert (t.num_rows, u.num_rows) == (10, 10)


def test_a_push_refused_after_waiting_for_its_step_leaves_only_its_workers_clock_moved():
    """w1's push of step 1 waits for step 0 (it moves w1's clock to 1: w1 left step 0, as its
    heartbeats say too), which is then applied with w0's gradient; its rows do not fit the table
    (3 of its 5 rows are taken) and it is refused. w1 counts as having left step 0 only: step 1 waits for w1's
    next push, and is not marked as accumulating (it holds no push)."""
    shard = _tables_shard(0)
    shard.join("w0", "w1")
    shard.store.create(VariableSpec("m", (WIDTH,), "float32", initializer=Zeros(), max_rows=5,
                                    optimizer=SGD(learning_rate=1.0), hash_table=True))
    shard.store.get("m").read_rows(np.arange(100, 103, dtype=np.int64))  # 3 of its 5 rows
    assert not shard.send(shard.begin("w0", 0), 2.0).dropped
    with pytest.raises(RequestError) as info:
        _rows_push(shard, "w1", 1, {"m": np.arange(0, 4, dtype=np.int64)})
    assert info.value.reason == Reason.MEMORY_LIMIT
    state = shard.ctrl.snapshot()
    assert (state["step"], state["clocks"], state["finished"], state["accumulating"]) == \
        (1, {"w0": 1, "w1": 1}, [], False)
    assert shard.store.get("m").num_rows == 3
    np.testing.assert_array_equal(shard.value("x"), np.full(SIZE, -2.0, np.float32))
    assert not shard.send(shard.begin("w0", 1), 2.0).dropped
    assert shard.ctrl.stats().steps_applied == 1, "step 1 waits for w1"
    assert not shard.send(shard.begin("w1", 1), 4.0).dropped
    assert shard.ctrl.stats().steps_applied == 2
    np.testing.assert_array_equal(shard.value("x"), np.full(SIZE, -5.0, np.float32))


def test_a_restored_sum_is_booked_as_its_pushes_booked_it(tmp_path):
    """A checkpoint in the middle of step 0 (rows of 't' from w0, 'x' and 'y' from w1): the restored
    store books the sums as the pushes booked them, refuses a memory limit they do not fit (changing nothing), and gives
    the sums' bytes back once the step is applied."""
    shard = _tables_shard(3)
    rows = {"t": np.arange(0, 100, dtype=np.int64)}
    base = _variable_bytes(shard)
    assert not _send_rows(_rows_push(shard, "w0", 0, rows), rows, 3.0).dropped
    assert not shard.send(shard.begin("w1", 0), 3.0).dropped
    gc.collect()
    sums = sum(part.accumulator.nbytes for part in shard.store.parts())
    assert sums == 3 * 100 * (8 + WIDTH * 4) + 2 * SIZE * 4 and _variable_bytes(shard) == base + sums
    Checkpointer(shard.store, shard.ledger, str(tmp_path), "srv", keep=2, interval=0,
                 persist_open_pushes=False, consistency_state=shard.ctrl.snapshot).checkpoint("test")
    plan = find_restore_plan(tmp_path, 0, 1)

    restored = Shard()
    restored.store.restore(load_parts(plan, 0, 1))
    restored.ledger.restore(plan.manifests[0]["ledger"]["entries"])
    assert restored.ctrl.restore(plan.manifests[0]["consistency"])
    assert _variable_bytes(restored) == base + sums
    needed = restored.store.reserved_bytes

    too_small = Shard()  # room for the variables, not for their sums
    too_small.store.memory_limit = needed - sums // 2
    before = too_small.store.reserved_bytes
    with pytest.raises(RequestError) as info:
        too_small.store.restore(load_parts(plan, 0, 1))
    assert info.value.reason == Reason.MEMORY_LIMIT
    assert too_small.store.reserved_bytes == before
    assert [p.spec.name for p in too_small.store.parts()] == ["x", "y"]

    restored.sequences = dict(shard.sequences)
    assert not _send_rows(_rows_push(restored, "w2", 0, rows), rows, 3.0).dropped  # step 0 applied
    assert restored.ctrl.stats().steps_applied == 1
    assert _variable_bytes(restored) == base
    np.testing.assert_array_equal(restored.store.get("t").read_rows(np.array([7], np.int64)),
                                  np.full((1, WIDTH), -3.0, np.float32))
    np.testing.assert_array_equal(restored.value("x"), np.full(SIZE, -3.0, np.float32))


def _sum_bytes(shard: Shard) -> int:
    """Bytes booked beyond the variables' own values: held for requests plus the step sums."""
    gc.collect()
    own = sum(shard.store.get(name).nbytes for name in ("d",))
    return shard.store.reserved_bytes + shard.store.held_bytes - own


def test_the_open_steps_dense_sum_is_booked_once_per_part():
    """A part's dense sum (a buffer as large as the part) counts against --max-memory-bytes from
    the first push that creates it until the step is applied; later pushes add into it."""
    elements = 1000
    shard = Shard()
    shard.store.create(VariableSpec("d", (elements,), "float32", initializer=Zeros(),
                                    optimizer=SGD(learning_rate=1.0)))
    shard.join("a", "b")
    for sequence in (1, 2):
        begin = _begin([("d", elements, ps_pb2.FLOAT32)], sequence=sequence, worker_id="a",
                       incarnation="inc-a")
        push = begin_push(shard.store, shard.ledger, begin, shard.ctrl)
        push.apply_many(_chunks("d", np.ones(elements, np.float32), elements))
        push.finish()
        del push
        assert elements * 4 <= _sum_bytes(shard) < 2 * elements * 4  # one sum, not one per push
    shard.ctrl.on_heartbeat("b", 1)
    assert shard.ctrl.stats().steps_applied == 1
    np.testing.assert_array_equal(shard.value("d"), -np.ones(elements, np.float32))
    assert _sum_bytes(shard) < elements * 4  # applied: the sum is given back


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_outside_sync_a_push_logs_no_decision(mode):
    """Only sync pushes have a decision to log (ACCUMULATE or DROP): outside sync the consistency order
    holds nothing, so a logged decision would be appended outside the shard's order (and a backup would
    keep it for a stream that never uses it)."""
    shard = Shard(mode=mode)
    shard.join("a")
    logged = []
    begin = _begin([("x", SIZE, ps_pb2.FLOAT32)], sequence=1, worker_id="a", incarnation="inc-a", step=0)
    push = begin_push(shard.store, shard.ledger, begin, shard.ctrl,
                      decided=lambda step, decision, pins: logged.append((step, decision)))
    push.apply_many(_chunks("x", np.ones(SIZE, np.float32), SIZE))
    push.finish()
    assert logged == []
    np.testing.assert_array_equal(shard.value("x"), -np.ones(SIZE, np.float32))


def test_a_sync_push_logs_its_decision():
    shard = Shard()
    shard.join("a")
    logged = []
    begin = _begin([("x", SIZE, ps_pb2.FLOAT32)], sequence=1, worker_id="a", incarnation="inc-a", step=0)
    begin_push(shard.store, shard.ledger, begin, shard.ctrl,
               decided=lambda step, decision, pins: logged.append((step, decision)))
    assert logged == [(0, "accumulate")]


def test_a_retry_of_a_dropped_push_is_answered_dropped_again_also_after_a_restore():
    """The answer of a push dropped whole (late for its step) can be lost; its retry is a duplicate
    for the ledger, and must still say dropped, or the worker counts a gradient the step never had
    and stays behind the cluster's step. The ledger's snapshot (checkpoints, catch-up snapshots)
    keeps what it remembers."""
    shard = Shard()
    shard.join("a", "b")
    shard.send(shard.begin("a", 0), 1.0)
    shard.send(shard.begin("b", 0), 3.0)  # step 0 applied
    late = shard.begin("a", 0)  # a's push of step 0 again, a new sequence: late
    begin_again = _begin([("x", SIZE, ps_pb2.FLOAT32), ("y", SIZE, ps_pb2.FLOAT32)],
                         sequence=shard.sequences["a"], worker_id="a", incarnation="inc-a", step=0)
    first = shard.send(late, 5.0)
    assert first.dropped and not first.duplicate
    before = shard.value("x")
    retry = shard.send(begin_push(shard.store, shard.ledger, begin_again, shard.ctrl), 5.0)
    assert retry.duplicate and retry.dropped, "the retry of a dropped push was answered as applied"
    np.testing.assert_array_equal(shard.value("x"), before)

    restored = PushLedger()
    restored.restore(shard.ledger.snapshot())
    assert restored.was_dropped("a", "inc-a", shard.sequences["a"])
    assert not restored.was_dropped("a", "inc-a", 1), "an applied push is not remembered as dropped"


def test_the_ledger_remembers_a_bounded_number_of_dropped_pushes():
    from ps_server.core import ledger as ledger_module

    ledger = PushLedger()
    kept = ledger_module._DROPPED_KEPT
    for sequence in range(1, 3 * kept + 1):
        session = ledger.begin("w", "i", sequence, 0)
        ledger.finish(session, dropped=True)
    remembered = [s for s in range(1, 3 * kept + 1) if ledger.was_dropped("w", "i", s)]
    assert remembered == list(range(2 * kept + 1, 3 * kept + 1))
