"""Admission and expiry of hash-table rows, exactly: counts, boundaries, replicas and checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_server.core.row_policies import NOT_STAMPED, AdmissionFilter, merge_admission_counts
from ps_server.core.tables import HashTablePart, read_tables_rows
from wehub_ps.initializers import fill_rows
from wehub_ps.specs import SGD, Admission, Expiry, SpecError, Uniform, VariableSpec


class Reserve:
    def __init__(self) -> None:
        self.total = 0

    def __call__(self, delta: int) -> None:
        self.total += delta


def _table(admission=None, expiry=None, max_rows=0, eviction="none", name="t") -> HashTablePart:
    spec = VariableSpec(name, (4,), "float32", initializer=Uniform(seed=7), optimizer=SGD(learning_rate=1.0),
                        hash_table=True, max_rows=max_rows, eviction=eviction, admission=admission,
                        expiry=expiry)
    return HashTablePart(spec, max_rows, Reserve())


def _ids(*values) -> np.ndarray:
    return np.array(values, np.int64)


def _initial(table: HashTablePart, ids) -> np.ndarray:
    out = np.empty((len(ids), 4), np.float64)
    fill_rows(table.spec.initializer, table.spec.shape, np.asarray(ids, np.int64), out)
    return out.astype(np.float32)


def _pull(table: HashTablePart, ids) -> np.ndarray:
    return read_tables_rows([(table, np.asarray(ids, np.int64))], table.reserve)[0]


def _push(table: HashTablePart, ids, grads) -> None:
    table.apply_rows(np.asarray(ids, np.int64), np.asarray(grads, np.float32))
    table.finish_push()


def _live(table: HashTablePart) -> list[int]:
    return sorted(table.rows_snapshot()["ids"].tolist())


# ---- specs ----


@pytest.mark.parametrize("bad", [dict(min_count=0), dict(min_count=70000), dict(probability=0.0),
                                 dict(probability=1.5), dict(counters=8), dict(zeros="yes")])
def test_admission_settings_are_checked(bad):
    with pytest.raises(SpecError):
        Admission(**bad)


def test_expiry_needs_a_rule_and_tables_only():
    with pytest.raises(SpecError, match="steps > 0 or seconds > 0"):
        Expiry()
    with pytest.raises(SpecError, match="hash tables only"):
        VariableSpec("d", (3, 4), "float32", expiry=Expiry(steps=2))


# ---- admission ----


def test_an_id_becomes_a_row_at_its_min_count_th_pull_and_reads_its_initial_value_before():
    table = _table(Admission(min_count=3))
    for sighting in (1, 2):
        values = _pull(table, [5, 9])
        np.testing.assert_array_equal(values, _initial(table, [5, 9]))
        assert table.num_rows == 0, sighting
    assert table.policy_counts.unadmitted_reads == 4
    assert _live(table) == [] and table.policy_counts.admitted_rows == 0
    _pull(table, [5])  # the third sighting of 5 (the second of 9 was the last)
    assert _live(table) == [5] and table.policy_counts.admitted_rows == 1
    _pull(table, [9])
    assert _live(table) == [5, 9] and table.policy_counts.admitted_rows == 2


def test_zeros_answer_ids_not_admitted():
    table = _table(Admission(min_count=2, zeros=True))
    np.testing.assert_array_equal(_pull(table, [1, 2]), np.zeros((2, 4), np.float32))
    values = _pull(table, [1, 3])  # 1 admitted now: its row, created from the initializer
    np.testing.assert_array_equal(values[0], _initial(table, [1])[0])
    np.testing.assert_array_equal(values[1], np.zeros(4, np.float32))


def test_a_push_never_admits_and_drops_the_gradients_of_ids_without_a_row():
    table = _table(Admission(min_count=2))
    _pull(table, [1])
    _pull(table, [1])  # admitted
    before = table.rows_snapshot()["value"].copy()
    _push(table, [1, 2, 3], np.ones((3, 4)))
    assert _live(table) == [1]
    np.testing.assert_array_equal(table.rows_snapshot()["value"], before - 1.0)
    assert table.policy_counts.dropped_gradient_rows == 2
    _push(table, [2], np.ones((1, 4)))
    _pull(table, [2])  # pushes were not sightings: this is 2's first
    assert _live(table) == [1] and table.policy_counts.dropped_gradient_rows == 3


def test_probability_admits_the_same_ids_on_every_replica_and_about_that_share():
    a, b = _table(Admission(probability=0.25)), _table(Admission(probability=0.25))
    ids = np.arange(20_000, dtype=np.int64)
    for chunk in np.array_split(ids, 10):
        _pull(a, chunk)
        _pull(b, chunk)
    assert _live(a) == _live(b)
    assert 0.23 < a.num_rows / len(ids) < 0.27
    # A second sighting is a new draw (the clock moved): some of the rest get in.
    before = a.num_rows
    _pull(a, ids)
    assert a.num_rows > before


def test_the_filter_is_booked_with_the_table():
    plain, admitting = _table(), _table(Admission(min_count=2, counters=1 << 12))
    assert admitting.nbytes - plain.nbytes == 4 * (1 << 12) * 2
    assert AdmissionFilter.nbytes_for(Admission(counters=1 << 12)) == 4 * (1 << 12) * 2


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(-2**63, 2**63 - 1), min_size=1, max_size=30, unique=True),
                min_size=1, max_size=30))
def test_the_filter_never_undercounts(batches):
    counting = AdmissionFilter(Admission(min_count=100, counters=64), "t")  # small: many collisions
    true: dict[int, int] = {}
    for batch in batches:
        ids = np.array(batch, np.int64)
        counting.count(ids)
        for i in batch:
            true[i] = true.get(i, 0) + 1
    if counting.sightings == 0 and sum(true.values()) >= 640:
        return  # halved: counts fade by design
    ids = np.array(list(true), np.int64)
    admitted = counting.decide(ids, 0)  # decide asks whether count + 1 reaches min_count
    columns = counting._columns(ids)
    estimate = counting.counts[np.arange(4)[:, None], columns].min(axis=0)
    assert (estimate >= np.array([true[i] for i in ids.tolist()])).all()
    assert not admitted.any() or (estimate[admitted] + 1 >= 100).all()


def test_counts_are_halved_after_ten_times_the_counters_sightings():
    counting = AdmissionFilter(Admission(min_count=50, counters=64), "t")
    counting.count(np.arange(639, dtype=np.int64))
    total = int(counting.counts.sum())
    assert total == 4 * 639 and counting.sightings == 639
    counting.count(_ids(10_000))
    assert counting.sightings == 0
    assert int(counting.counts.sum()) < total // 2 + 4


def test_merged_filters_count_every_id_at_least_as_its_old_shard_did():
    a = AdmissionFilter(Admission(min_count=9, counters=128), "t")
    b = AdmissionFilter(Admission(min_count=9, counters=128), "t")
    a.count(_ids(1, 2, 3))
    a.count(_ids(1))
    b.count(_ids(7, 8))
    merged = AdmissionFilter(Admission(min_count=9, counters=128), "t")
    merged.load(merge_admission_counts([a.counts, b.counts]), 0)
    for ids, source in ((_ids(1, 2, 3), a), (_ids(7, 8), b)):
        cols = merged._columns(ids)
        rows = np.arange(4)[:, None]
        assert (merged.counts[rows, cols].min(axis=0) >= source.counts[rows, cols].min(axis=0)).all()
    saturated = merge_admission_counts([np.full((4, 128), 60000, np.uint16)] * 2)
    assert saturated.max() == 65535


def test_lru_with_admission_evicts_only_rows_and_waiting_ids_take_no_room():
    table = _table(Admission(min_count=2), max_rows=2, eviction="lru")
    for ids in ([1], [1], [2], [2], [3], [3]):
        _pull(table, ids)
    assert _live(table) == [2, 3] and table.evicted_rows == 1
    _pull(table, [4, 5, 6])  # first sightings: no row, nothing evicted
    assert _live(table) == [2, 3] and table.evicted_rows == 1


def test_policy_state_survives_a_snapshot():
    table = _table(Admission(min_count=3, counters=256), Expiry(steps=5))
    _pull(table, [1, 2])
    _pull(table, [1])
    _pull(table, [1])
    _push(table, [1, 2], np.ones((2, 4)))
    snap = table.snapshot()
    restored = _table(Admission(min_count=3, counters=256), Expiry(steps=5))
    restored.load_rows(snap.rows, snap.version, snap.optimizer_steps, snap.evicted_rows, snap.access_clock,
                       snap.policy_counts, snap.admission_counts, snap.admission_sightings)
    assert restored.policy_counts == table.policy_counts
    np.testing.assert_array_equal(restored.admission.counts, table.admission.counts)
    for table_ in (table, restored):  # 2's second sighting, then its third, which admits it on both
        _pull(table_, [2])
        assert _live(table_) == [1]
        _pull(table_, [2])
    assert _live(restored) == _live(table) == [1, 2]
    assert {k: v.tobytes() for k, v in restored.rows_snapshot().items()} == \
        {k: v.tobytes() for k, v in table.rows_snapshot().items()}


# ---- expiry ----


def test_steps_expiry_removes_a_row_exactly_when_it_is_steps_versions_old():
    table = _table(expiry=Expiry(steps=3))
    _pull(table, [1, 2])  # both created at version 0
    _push(table, [1], np.ones((1, 4)))  # 1 updated by the push that makes version 1
    assert table.sweep(0.0)[0].tolist() == []
    _push(table, [2], np.ones((1, 4)))  # version 2; 2 updated at 2
    _push(table, [2], np.ones((1, 4)))  # version 3
    ids, _ = table.sweep(0.0)
    assert ids.tolist() == []  # 1 is 2 versions old
    _push(table, [2], np.ones((1, 4)))  # version 4: 1 is 3 versions old
    ids, _ = table.sweep(0.0)
    assert ids.tolist() == [1] and _live(table) == [2]
    assert table.policy_counts.expired_rows == 1


def test_seconds_expiry_is_never_early_and_at_most_one_sweep_late():
    table = _table(expiry=Expiry(seconds=10.0))
    _pull(table, [1])  # created between sweeps: unstamped
    assert table.updated_before[table._index.lookup(_ids(1))][0] == NOT_STAMPED
    ids, stamped = table.sweep(100.0)  # 1 was updated before 100
    assert ids.tolist() == [] and stamped
    _push(table, [1], np.ones((1, 4)))  # an update after the sweep at 100: unstamped again
    ids, stamped = table.sweep(105.0)
    assert ids.tolist() == [] and stamped  # now stamped 105
    assert table.sweep(114.999)[0].tolist() == []
    ids, stamped = table.sweep(115.0)
    assert ids.tolist() == [1] and not stamped


def test_a_backup_applying_the_primarys_sweeps_holds_the_same_bits():
    spec_kwargs = dict(admission=Admission(min_count=2, probability=0.5), expiry=Expiry(steps=4, seconds=3.0))
    primary, backup = _table(**spec_kwargs), _table(**spec_kwargs)
    rng = np.random.default_rng(3)
    now = 1000.0
    for step in range(60):
        ids = np.unique(rng.integers(0, 50, 12)).astype(np.int64)
        grads = rng.normal(size=(len(ids), 4)).astype(np.float32)
        for table in (primary, backup):
            _pull(table, ids)
            _push(table, ids[: len(ids) // 2], grads[: len(ids) // 2])
        if step % 5 == 4:
            now += 1.0
            removed, _ = primary.sweep(now)
            backup.apply_sweep(removed, now)
    assert primary.policy_counts.expired_rows > 0 and primary.policy_counts.admitted_rows > 0
    assert primary.policy_counts == backup.policy_counts
    assert {k: v.tobytes() for k, v in primary.rows_snapshot().items()} == \
        {k: v.tobytes() for k, v in backup.rows_snapshot().items()}


def test_a_synchronous_steps_pinned_rows_are_not_expired():
    table = _table(expiry=Expiry(steps=1))
    _pull(table, [1, 2])
    table.start_step(0)
    table.pin_rows(_ids(1))
    _push(table, [3], np.ones((1, 4)))  # version 1: 1 and 2 are a version old
    ids, _ = table.sweep(0.0)
    assert ids.tolist() == [2] and 1 in _live(table)
