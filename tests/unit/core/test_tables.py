"""Hash tables (ps_server.core.tables) and the synchronous-mode accumulator (ps_server.core.accumulator).

No servers: HashTablePart is driven directly, with a reserve callback that
records (or refuses) the memory the table books.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from ps_server.core.accumulator import PushStaging, StepAccumulator
from ps_server.core.errors import RequestError
from ps_server.core.tables import HashTablePart
from wehub_ps.errors import Reason
from wehub_ps.initializers import fill_rows
from wehub_ps.specs import SGD, Adagrad, Adam, Constant, Normal, Uniform, VariableSpec

INT64_EDGES = np.array([-(2**63), -(2**62), -1, 0, 1, 2**62, 2**63 - 1, -12345, 987654321], np.int64)


class Reserve:
    """A reserve callback: records every booking; refuses once ``limit`` would be passed."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.calls: list[int] = []

    @property
    def total(self) -> int:
        return sum(self.calls)

    def __call__(self, delta: int) -> None:
        if self.limit is not None and self.total + delta > self.limit:
            raise RequestError(Reason.MEMORY_LIMIT, f"refusing {delta} bytes")
        self.calls.append(delta)


def _spec(name="t", dim=4, dtype="float32", optimizer=None, initializer=None, max_rows=0, eviction="none"):
    return VariableSpec(name, (dim,) if isinstance(dim, int) else dim, dtype,
                        initializer=initializer if initializer is not None else Uniform(seed=7),
                        optimizer=optimizer if optimizer is not None else SGD(learning_rate=1.0),
                        hash_table=True, max_rows=max_rows, eviction=eviction)


def _table(max_rows=0, reserve=None, **spec_kwargs) -> HashTablePart:
    spec = _spec(max_rows=max_rows, **spec_kwargs)
    return HashTablePart(spec, max_rows, reserve if reserve is not None else Reserve())


def _ids(*values) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _initial(table: HashTablePart, ids) -> np.ndarray:
    ids = np.asarray(ids, np.int64)
    out = np.empty((len(ids), table.row_elements), np.float64)
    fill_rows(table.spec.initializer, table.spec.shape, ids, out)
    return out.astype(table.spec.dtype)


def _state(table: HashTablePart) -> dict:
    """Everything observable about a table, as bytes (for "nothing changed" checks)."""
    snap = table.rows_snapshot()
    return {"rows": {k: v.tobytes() for k, v in snap.items()}, "num_rows": table.num_rows,
            "evicted": table.evicted_rows, "capacity": table.capacity, "version": table.version,
            "free": len(table._free)}


def _live_ids(table: HashTablePart) -> set[int]:
    return set(table.rows_snapshot()["ids"].tolist())


def _check_invariants(table: HashTablePart) -> None:
    """Every slot is either live (exactly once in the index) or free."""
    ids, slots = table._index.items()
    live = slots.tolist()
    free = table._free.tolist()
    assert len(set(live)) == len(live), "two ids share a slot"
    assert len(set(ids.tolist())) == len(live), "an id is in the index twice"
    assert not set(live) & set(free), "a live slot is on the free list"
    assert len(live) + len(free) == table.capacity, (
        f"slots leaked: {len(live)} live + {len(free)} free != capacity {table.capacity}")
    assert len(table._index) == len(live) == table.num_rows
    if table.max_rows:
        assert table.num_rows <= table.max_rows
    assert table.ids[slots].tolist() == ids.tolist()
    assert table._index.lookup(ids).tolist() == live


# ---- create / read / apply ---------------------------------------------------------------------


def test_rows_are_created_on_first_read_from_the_initializer_keyed_by_id():
    reserve = Reserve()
    table = _table(reserve=reserve)
    assert table.num_rows == 0 and table.capacity == 0 and reserve.calls == []
    values = table.read_rows(INT64_EDGES)
    assert values.shape == (len(INT64_EDGES), 4) and values.dtype == np.float32
    np.testing.assert_array_equal(values, _initial(table, INT64_EDGES))
    assert table.num_rows == len(INT64_EDGES)
    # Read again, in another order: the same rows, nothing new created.
    order = np.arange(len(INT64_EDGES))[::-1]
    np.testing.assert_array_equal(table.read_rows(INT64_EDGES[order]), values[order])
    assert table.num_rows == len(INT64_EDGES)
    # Distinct ids get distinct rows; the value does not depend on which ids came with it.
    alone = _table()
    np.testing.assert_array_equal(alone.read_rows(_ids(2**62)), values[INT64_EDGES == 2**62])
    assert len({row.tobytes() for row in values}) == len(INT64_EDGES)
    _check_invariants(table)


def test_constant_and_multi_dimensional_rows():
    table = _table(dim=(2, 3), initializer=Constant(0.25))
    assert table.row_elements == 6
    np.testing.assert_array_equal(table.read_rows(_ids(5, -5)), np.full((2, 6), 0.25, np.float32))


def test_apply_rows_sgd_changes_only_the_rows_pushed():
    table = _table(optimizer=SGD(learning_rate=0.5))
    ids = _ids(1, 2, 3, 4)
    before = table.read_rows(ids).copy()
    grads = np.arange(8, dtype=np.float32).reshape(2, 4)
    table.apply_rows(_ids(3, 1), grads)
    after = table.read_rows(ids)
    np.testing.assert_array_equal(after[2], before[2] - grads[0] * np.float32(0.5))
    np.testing.assert_array_equal(after[0], before[0] - grads[1] * np.float32(0.5))
    assert after[1].tobytes() == before[1].tobytes() and after[3].tobytes() == before[3].tobytes()
    steps = dict(zip(table.rows_snapshot()["ids"].tolist(), table.rows_snapshot()["row_steps"].tolist()))
    assert steps == {1: 1, 2: 0, 3: 1, 4: 0}


@pytest.mark.parametrize("fused", [True, False])
def test_sgd_rows_fused_or_gathered_give_the_same_bits(fused):
    """The compiled in-place update (ps_server/core/fused.py) against gather-update-scatter."""
    rng = np.random.default_rng(3)
    ids = rng.choice(10_000, 300, replace=False).astype(np.int64)
    grads = rng.standard_normal((300, 4)).astype(np.float32)
    tables = {}
    for kernel_fused in (fused, False):
        table = _table(optimizer=SGD(learning_rate=0.3))
        table.kernel.fused = kernel_fused
        table.read_rows(ids)
        table.apply_rows(ids[:200], grads[:200])
        table.apply_rows(ids[100:], grads[100:])  # new rows created on the way too
        tables[kernel_fused] = table
    assert tables[fused].read_rows(ids).tobytes() == tables[False].read_rows(ids).tobytes()
    _check_invariants(tables[fused])


def test_apply_rows_creates_missing_rows_first():
    table = _table(optimizer=SGD(learning_rate=1.0))
    table.apply_rows(_ids(-7), np.ones((1, 4), np.float32))
    assert table.num_rows == 1
    np.testing.assert_array_equal(table.read_rows(_ids(-7)), _initial(table, [-7]) - np.float32(1))


def test_adagrad_rows_match_the_dense_kernel():
    table = _table(dtype="float64", optimizer=Adagrad(learning_rate=0.1, initial_accumulator_value=0.2))
    ids = _ids(10, 20)
    w = table.read_rows(ids).astype(np.float64)
    acc = np.full_like(w, 0.2)
    rng = np.random.default_rng(0)
    for _ in range(3):
        g = rng.standard_normal(w.shape)
        table.apply_rows(ids, g)
        acc += g * g
        w -= 0.1 * g / (np.sqrt(acc) + 1e-7)
    np.testing.assert_allclose(table.read_rows(ids), w, rtol=1e-14, atol=0)


def test_lazy_adam_keeps_a_step_count_per_row():
    b1, b2, lr, eps = 0.9, 0.999, 0.01, 1e-7
    table = _table(dtype="float64", optimizer=Adam(learning_rate=lr))
    ids = _ids(1, 2)
    w0 = table.read_rows(ids).copy()
    g = np.array([[1.0, -2.0, 3.0, 0.5]])
    for _ in range(3):
        table.apply_rows(_ids(1), g)  # row 1: three steps
    table.apply_rows(_ids(2), g)  # row 2: its first step, after row 1's third
    step_size = lr * math.sqrt(1 - b2) / (1 - b1)
    first = w0[1] - step_size * ((1 - b1) * g[0]) / (np.sqrt((1 - b2) * g[0] ** 2) + eps)
    np.testing.assert_allclose(table.read_rows(_ids(2))[0], first, rtol=1e-14)
    m = np.zeros(4)
    v = np.zeros(4)
    w = w0[0].copy()
    for t in (1, 2, 3):
        m = b1 * m + (1 - b1) * g[0]
        v = b2 * v + (1 - b2) * g[0] ** 2
        w -= lr * math.sqrt(1 - b2**t) / (1 - b1**t) * m / (np.sqrt(v) + eps)
    np.testing.assert_allclose(table.read_rows(_ids(1))[0], w, rtol=1e-13)
    snap = table.rows_snapshot()
    assert snap["row_steps"].tolist() == [3, 1]


def test_float16_tables_update_in_float32():
    table = _table(dtype="float16", optimizer=Adam(learning_rate=0.01))
    assert table.value.dtype == np.float16 and table.compute_dtype == np.float32
    before = table.read_rows(_ids(3)).copy()
    table.apply_rows(_ids(3), np.full((1, 4), 1e-3, np.float16))  # g*g underflows in float16
    after = table.read_rows(_ids(3))
    assert after.dtype == np.float16 and np.all(np.isfinite(after))
    np.testing.assert_allclose(after.astype(np.float32), before.astype(np.float32) - 0.01, atol=2e-3)


# ---- limits: refusal (eviction "none") ---------------------------------------------------------


def test_refusal_beyond_max_rows_leaves_the_table_unchanged():
    table = _table(max_rows=5)
    table.read_rows(_ids(1, 2, 3))
    table.apply_rows(_ids(1), np.ones((1, 4), np.float32))
    before = _state(table)
    for request in (_ids(10, 11, 12), _ids(1, 2, 10, 11, 12), _ids(*range(100, 120))):
        with pytest.raises(RequestError) as info:
            table.read_rows(request)
        assert info.value.reason == Reason.MEMORY_LIMIT and "max_rows" in info.value.message
        with pytest.raises(RequestError):
            table.apply_rows(request, np.ones((len(request), 4), np.float32))
        assert _state(table) == before
    # Up to the limit is fine, and the existing rows are untouched.
    table.read_rows(_ids(1, 10, 11))
    assert table.num_rows == 5
    with pytest.raises(RequestError):
        table.read_rows(_ids(12))
    _check_invariants(table)


def test_repeated_new_ids_in_one_read_create_one_row():
    """Pulls may repeat ids (parse_row_ids(..., unique=False)); a row must be created once.

    Bug: _slots_for passes every position of a missing id to _create, which
    makes one slot per occurrence; only the last stays in the index, the
    others leak, and the max_rows check counts the duplicates as new rows.
    """
    table = _table()
    values = table.read_rows(_ids(7, 7, 8, 7))
    np.testing.assert_array_equal(values[0], values[1])
    np.testing.assert_array_equal(values[0], values[3])
    assert table.num_rows == 2
    _check_invariants(table)


def test_repeated_new_ids_count_once_against_max_rows():
    """Same bug: a pull of [9, 9] counts as two new rows, so max_rows=1 refuses it."""
    capped = _table(max_rows=1)
    np.testing.assert_array_equal(capped.read_rows(_ids(9, 9)), _initial(capped, [9, 9]))
    assert capped.num_rows == 1


# ---- limits: LRU eviction ------------------------------------------------------------------------


def test_lru_evicts_the_least_recently_used_rows():
    table = _table(max_rows=4, eviction="lru")
    for i in (1, 2, 3, 4):  # one access each, in this order
        table.read_rows(_ids(i))
    table.apply_rows(_ids(1), np.ones((1, 4), np.float32))  # a push is an access too
    table.read_rows(_ids(5))
    assert _live_ids(table) == {1, 3, 4, 5} and table.evicted_rows == 1
    table.read_rows(_ids(3))
    table.read_rows(_ids(6, 7))  # 4 and 1 are now the oldest
    assert _live_ids(table) == {3, 5, 6, 7} and table.evicted_rows == 3
    _check_invariants(table)


def test_lru_never_evicts_rows_of_the_current_request():
    table = _table(max_rows=4, eviction="lru")
    for i in (1, 2, 3, 4):
        table.read_rows(_ids(i))
    # 1 and 2 are the least recently used, but this request uses them.
    values = table.read_rows(_ids(1, 2, 10))
    assert _live_ids(table) == {1, 2, 4, 10}
    np.testing.assert_array_equal(values, _initial(table, [1, 2, 10]))
    # Same with a push that creates rows.
    table.apply_rows(_ids(4, 1, 11), np.zeros((3, 4), np.float32))
    assert {1, 4, 11} <= _live_ids(table) and table.num_rows == 4
    _check_invariants(table)


def test_lru_refuses_a_request_that_cannot_fit_and_changes_nothing():
    table = _table(max_rows=4, eviction="lru")
    for i in (1, 2, 3, 4):
        table.read_rows(_ids(i))
    before = _state(table)
    # More new rows than max_rows at all.
    with pytest.raises(RequestError) as info:
        table.read_rows(_ids(*range(10, 15)))
    assert info.value.reason == Reason.MEMORY_LIMIT
    assert _state(table) == before
    # Fits max_rows, but only by evicting rows this very request uses.
    with pytest.raises(RequestError) as info:
        table.read_rows(_ids(1, 2, 3, 10, 11))
    assert info.value.reason == Reason.MEMORY_LIMIT
    assert _state(table) == before
    # The LRU order survived the refusals: 1 is still the oldest.
    table.read_rows(_ids(20))
    assert _live_ids(table) == {2, 3, 4, 20}


def test_an_evicted_row_comes_back_from_its_initializer_with_fresh_optimizer_state():
    lr = 0.1
    table = _table(max_rows=2, eviction="lru", dtype="float64",
                   optimizer=Adagrad(learning_rate=lr, initial_accumulator_value=0.1))
    g = np.ones((1, 4))
    table.apply_rows(_ids(1), g)
    table.apply_rows(_ids(1), g)
    table.read_rows(_ids(2, 3))  # evicts 1
    assert 1 not in _live_ids(table) and table.evicted_rows == 1
    np.testing.assert_array_equal(table.read_rows(_ids(1)), _initial(table, [1]))
    table.apply_rows(_ids(1), g)
    expected = _initial(table, [1]) - lr * g / (np.sqrt(0.1 + g * g) + 1e-7)
    np.testing.assert_allclose(table.read_rows(_ids(1)), expected, rtol=1e-15)
    snap = table.rows_snapshot()
    assert dict(zip(snap["ids"].tolist(), snap["row_steps"].tolist()))[1] == 1


def test_lru_keeps_num_rows_bounded_under_many_accesses():
    table = _table(max_rows=50, eviction="lru")
    rng = np.random.default_rng(3)
    created = set()
    for _ in range(40):
        ids = np.unique(rng.integers(-1000, 1000, size=20))
        table.read_rows(ids)
        created.update(ids.tolist())
        assert table.num_rows <= 50
    _check_invariants(table)
    assert table.capacity <= 50  # growth is capped at max_rows too
    assert table.evicted_rows >= len(created) - 50


# ---- memory booking ----------------------------------------------------------------------------


def test_growth_books_memory_through_the_reserve_callback():
    reserve = Reserve()
    table = _table(reserve=reserve, optimizer=Adam())
    # value + m + v; row step, last access, id, free-stack entry, updated version and stamp,
    # changed and occupied flags, a removed id
    row_bytes = 4 * (4 + 4 * 2) + 59
    assert table.row_bytes == row_bytes
    empty = table.nbytes  # booked by the store when it creates the table
    table.read_rows(_ids(1))
    assert reserve.calls == [table.nbytes - empty] and table.capacity == 1024
    table.read_rows(np.arange(2, 1025, dtype=np.int64))  # exactly full
    assert len(reserve.calls) == 1
    table.read_rows(_ids(5000))
    # The growth books the old arrays too while it copies them, and gives them back after.
    assert table.capacity == 2048 and reserve.calls[1:] == [
        table.nbytes_for(2048) - table.nbytes_for(1024) + 1024 * row_bytes, -1024 * row_bytes]
    assert table.nbytes == reserve.total + empty
    # A large request grows by at least what it needs.
    table.read_rows(np.arange(10_000, 15_000, dtype=np.int64))
    assert table.capacity >= 1025 + 5000 and table.nbytes == reserve.total + empty
    _check_invariants(table)


def test_the_id_index_is_booked_and_never_grows_unbooked():
    """The index of ids is part of a table's bytes (counted twice: a rebuild holds two copies)."""
    reserve = Reserve()
    table = _table(reserve=reserve, max_rows=3000, eviction="lru")
    rng = np.random.default_rng(3)
    for _ in range(40):  # LRU churn: deleted buckets force rebuilds of the index
        table.read_rows(np.unique(rng.integers(0, 1 << 40, size=400)))
        assert 2 * table._index.nbytes + table.capacity * table.row_bytes == table.nbytes
        assert table.nbytes == reserve.total + table.nbytes_for(0)
    assert table.evicted_rows > 0
    _check_invariants(table)


def test_growth_is_capped_at_max_rows():
    reserve = Reserve()
    table = _table(reserve=reserve, max_rows=100)
    table.read_rows(_ids(1))
    assert table.capacity == 100 and reserve.total == 100 * table.row_bytes


def test_memory_limit_from_reserve_propagates_and_nothing_changes():
    t = _table()
    reserve = Reserve(limit=t.nbytes_for(1024) - t.nbytes_for(0))  # room for the first 1024 rows only
    table = _table(reserve=reserve)
    table.read_rows(np.arange(1024, dtype=np.int64))
    table.apply_rows(_ids(0, 1), np.ones((2, 4), np.float32))
    before = _state(table)
    with pytest.raises(RequestError) as info:
        table.read_rows(_ids(0, 5000, 5001))
    assert info.value.reason == Reason.MEMORY_LIMIT
    with pytest.raises(RequestError):
        table.apply_rows(_ids(5000), np.ones((1, 4), np.float32))
    assert _state(table) == before
    assert reserve.total == table.nbytes_for(1024) - table.nbytes_for(0)
    # Existing rows still work.
    table.apply_rows(_ids(3), np.ones((1, 4), np.float32))
    _check_invariants(table)


def test_memory_limit_after_lru_eviction_changes_nothing():
    """A refusal must leave the table unchanged, also when LRU eviction ran first.

    Bug: _create evicts (deletes rows from the index, bumps evicted_rows)
    before _grow books the memory the new rows need; when the reserve
    callback then raises MEMORY_LIMIT the evicted rows are gone although the
    request was refused. Happens when max_rows is above the current
    capacity (max_rows > 1024 here).
    """
    t = _table()
    reserve = Reserve(limit=t.nbytes_for(1024) - t.nbytes_for(0))
    table = _table(reserve=reserve, max_rows=2000, eviction="lru")
    table.read_rows(np.arange(1024, dtype=np.int64))
    before = _state(table)
    with pytest.raises(RequestError) as info:
        table.read_rows(np.arange(10_000, 11_000, dtype=np.int64))  # 2024 > 2000: evicts 24, then grows
    assert info.value.reason == Reason.MEMORY_LIMIT
    assert _state(table) == before
    _check_invariants(table)


# ---- checkpoints ---------------------------------------------------------------------------------


def _trained_table(**kwargs) -> HashTablePart:
    table = _table(optimizer=Adam(learning_rate=0.05), **kwargs)
    rng = np.random.default_rng(5)
    for _ in range(4):
        ids = np.unique(rng.integers(-50, 50, size=12))
        table.apply_rows(ids, rng.standard_normal((len(ids), 4)).astype(np.float32))
        table.read_rows(np.unique(rng.integers(-60, 60, size=5)))
    table.finish_push()
    return table


def test_rows_snapshot_is_a_sorted_compact_copy():
    table = _trained_table()
    snap = table.rows_snapshot()
    n = table.num_rows
    assert list(snap["ids"]) == sorted(snap["ids"]) and len(snap["ids"]) == n
    assert set(snap) == {"ids", "value", "row_steps", "last_access", "updated_version", "updated_before",
                         "slot:m", "slot:v"}
    assert snap["value"].shape == (n, 4) and snap["slot:m"].shape == (n, 4)
    np.testing.assert_array_equal(snap["value"], table.read_rows(snap["ids"]))
    # A copy: later updates do not show through.
    saved = snap["value"].copy()
    table.apply_rows(snap["ids"][:1], np.ones((1, 4), np.float32))
    np.testing.assert_array_equal(snap["value"], saved)


def test_rows_snapshot_and_load_rows_round_trip():
    table = _trained_table(max_rows=200, eviction="lru")
    snap = table.rows_snapshot()
    reserve = Reserve()
    copy = HashTablePart(table.spec, table.max_rows, reserve)
    copy.load_rows({k: v.copy() for k, v in snap.items()}, table.version, table.optimizer_steps, 3)
    assert reserve.total + copy.nbytes_for(0) == copy.nbytes > 0  # (the empty table: booked by the store)
    assert (copy.num_rows, copy.version, copy.optimizer_steps, copy.evicted_rows) == (
        table.num_rows, table.version, table.optimizer_steps, 3)
    restored = copy.rows_snapshot()
    assert {k: v.tobytes() for k, v in restored.items()} == {k: v.tobytes() for k, v in snap.items()}
    _check_invariants(copy)
    # Slots and per-row step counts came along: the same updates give the same bits.
    ids = snap["ids"][::3]
    g = np.random.default_rng(9).standard_normal((len(ids), 4)).astype(np.float32)
    table.apply_rows(ids, g)
    copy.apply_rows(ids, g)
    assert copy.read_rows(ids).tobytes() == table.read_rows(ids).tobytes()
    # New rows go into free slots after the loaded ones.
    copy.read_rows(_ids(10**9))
    assert copy.num_rows == table.num_rows + 1
    _check_invariants(copy)


def test_load_rows_keeps_the_lru_order():
    table = _table(max_rows=3, eviction="lru")
    for i in (1, 2, 3):
        table.read_rows(_ids(i))
    table.read_rows(_ids(1))  # 2 is now the oldest
    copy = HashTablePart(table.spec, 3, Reserve())
    copy.load_rows(table.rows_snapshot(), 0, 0, 0)
    copy.read_rows(_ids(4))
    assert _live_ids(copy) == {1, 3, 4}


def test_load_rows_of_an_empty_table():
    table = _table()
    empty = table.rows_snapshot()
    assert len(empty["ids"]) == 0
    copy = HashTablePart(table.spec, 0, Reserve())
    copy.load_rows(empty, 0, 0, 0)
    assert copy.num_rows == 0
    np.testing.assert_array_equal(copy.read_rows(_ids(4)), _initial(copy, [4]))
    _check_invariants(copy)


def test_snapshot_and_info_report_rows_and_evictions():
    table = _table(max_rows=2, eviction="lru")
    table.read_rows(_ids(1, 2))
    table.read_rows(_ids(3))
    info = table.info()
    assert (info.num_rows, info.evicted_rows) == (2, 1)
    snap = table.snapshot()
    assert snap.rows is not None and snap.evicted_rows == 1 and set(snap.rows["ids"].tolist()) == {2, 3}


# ---- synchronous mode: accumulator -----------------------------------------------------------------


def _staging(dense=None, ids=None, grads=None, dtype=np.float32) -> PushStaging:
    staging = PushStaging()
    if dense is not None:
        dense = np.asarray(dense, dtype)
        staging.add_dense(dense.size, np.dtype(dtype), 0, dense)
    if ids is not None:
        staging.add_rows(np.asarray(ids, np.int64), np.asarray(grads, dtype), np.dtype(dtype))
    return staging


def test_merge_of_a_new_step_discards_the_stale_sum():
    """The controller says which step is open; a sum of another step is never added to it."""
    acc = StepAccumulator(step=3)
    acc.merge(3, _staging(dense=[1, 2], ids=[1], grads=[[1, 1]]))
    acc.merge(4, _staging(dense=[10, 10], ids=[2], grads=[[10, 10]]))
    assert (acc.step, acc.dense_count, acc.row_count) == (4, 1, 1)
    dense, ids, grads = acc.take("sum")
    np.testing.assert_array_equal(dense, [10, 10])
    np.testing.assert_array_equal(ids, [2])
    np.testing.assert_array_equal(grads, [[10, 10]])


def test_dense_mean_and_sum():
    for aggregation, expected in (("sum", [4, 6, 8]), ("mean", [2, 3, 4]), ("row_mean", [2, 3, 4])):
        acc = StepAccumulator(step=0)
        acc.merge(0, _staging(dense=[1, 2, 3]))
        acc.merge(0, _staging(dense=[3, 4, 5]))
        dense, ids, grads = acc.take(aggregation)
        assert ids is None and grads is None
        np.testing.assert_array_equal(dense, expected)
        assert dense.dtype == np.float32
        # Afresh: nothing left for the next step.
        assert acc.take(aggregation) == (None, None, None)
        acc.merge(0, _staging(dense=[1, 1, 1]))
        np.testing.assert_array_equal(acc.take(aggregation)[0], [1, 1, 1])


def test_rows_are_summed_by_id():
    acc = StepAccumulator(step=0)
    acc.merge(0, _staging(ids=[3, 1], grads=[[1, 2], [10, 20]]))
    acc.merge(0, _staging(ids=[1, 5], grads=[[100, 200], [7, 8]]))
    dense, ids, grads = acc.take("sum")
    assert dense is None
    np.testing.assert_array_equal(ids, [1, 3, 5])
    np.testing.assert_array_equal(grads, [[110, 220], [1, 2], [7, 8]])
    acc.merge(0, _staging(ids=[3, 1], grads=[[1, 2], [10, 20]]))
    acc.merge(0, _staging(ids=[1, 5], grads=[[100, 200], [7, 8]]))
    _, ids, grads = acc.take("mean")  # the mean over the pushes that sent rows
    np.testing.assert_array_equal(ids, [1, 3, 5])
    np.testing.assert_array_equal(grads, [[55, 110], [0.5, 1], [3.5, 4]])
    assert acc.take("mean") == (None, None, None)


def test_dense_and_row_counts_are_separate():
    acc = StepAccumulator(step=0)
    acc.merge(0, _staging(dense=[2, 2]))
    acc.merge(0, _staging(dense=[4, 4], ids=[9], grads=[[6, 6]]))
    dense, ids, grads = acc.take("mean")
    np.testing.assert_array_equal(dense, [3, 3])  # two dense gradients
    np.testing.assert_array_equal(grads, [[6, 6]])  # one row gradient


def test_staging_copies_and_casts():
    ids = np.array([1, 2], np.int64)
    grads = np.ones((2, 3), np.float16)
    staging = PushStaging()
    staging.add_rows(ids, grads, np.dtype(np.float32))
    ids[0] = 99
    grads[:] = 5
    assert staging.row_ids[0].tolist() == [1, 2]
    assert staging.row_grads[0].dtype == np.float32 and staging.row_grads[0].max() == 1
    staging.add_dense(6, np.dtype(np.float32), 2, np.array([1, 2], np.float16))
    np.testing.assert_array_equal(staging.dense, [0, 0, 1, 2, 0, 0])


def test_table_applies_the_accumulated_rows_once_per_step():
    table = _table(optimizer=SGD(learning_rate=1.0))  # aggregation "mean"
    ids = _ids(1, 2, 3)
    w0 = table.read_rows(ids).copy()
    table.start_step(4)
    table.merge_staged(4, _staging(ids=[1, 2], grads=np.ones((2, 4))))
    table.merge_staged(4, _staging(ids=[2], grads=np.full((1, 4), 3.0)))
    assert table.read_rows(ids).tobytes() == w0.tobytes()
    assert table.apply_accumulated(4)
    expected = w0 - np.array([[0.5], [2.0], [0.0]], np.float32)
    np.testing.assert_array_equal(table.read_rows(ids), expected)
    assert table.version == 1 and table.optimizer_steps == 1
    assert not table.apply_accumulated(4)  # once
    assert not table.apply_accumulated(5)  # the next step had no pushes
    # start_step of a new step discards an unfinished one.
    table.merge_staged(6, _staging(ids=[1], grads=np.ones((1, 4))))
    table.start_step(7)
    assert not table.apply_accumulated(7)
    np.testing.assert_array_equal(table.read_rows(ids), expected)


def test_sum_aggregation_for_tables():
    spec = VariableSpec("s", (2,), "float32", initializer=Constant(0.0), optimizer=SGD(learning_rate=1.0),
                        hash_table=True, aggregation="sum")
    table = HashTablePart(spec, 0, Reserve())
    table.merge_staged(0, _staging(ids=[1], grads=[[1, 1]]))
    table.merge_staged(0, _staging(ids=[1], grads=[[2, 2]]))
    assert table.apply_accumulated(0)
    np.testing.assert_array_equal(table.read_rows(_ids(1)), [[-3, -3]])


def test_normal_initializer_rows_are_finite_and_spread():
    table = _table(initializer=Normal(stddev=1.0, seed=1), dim=64)
    values = table.read_rows(np.arange(200, dtype=np.int64))
    assert np.all(np.isfinite(values)) and 0.8 < values.std() < 1.2
