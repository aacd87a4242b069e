"""sum_by_id: the same sums, bit for bit, as np.add.at on a dense array; sort_ids' contract."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from wehub_ps.kernels.segments import sort_ids, sum_by_id


@given(st.lists(st.integers(-5, 5), max_size=60), st.integers(1, 4), st.sampled_from(["float32", "float64"]),
       st.integers(0, 2**32 - 1))
@settings(max_examples=200, deadline=None)
def test_sums_equal_add_at_in_order_of_occurrence(ids, width, dtype, seed):
    ids = np.array(ids, dtype=np.int64)
    values = np.random.default_rng(seed).standard_normal((len(ids), width)).astype(dtype)
    unique, sums = sum_by_id(ids, values)
    assert np.array_equal(unique, np.unique(ids))
    dense = np.zeros((11, width), dtype)
    np.add.at(dense, ids + 5, values)
    assert sums.dtype == values.dtype
    assert sums.tobytes() == dense[unique + 5].tobytes()


def test_no_repeats_is_a_reordering_only():
    ids = np.array([9, -3, 4])
    values = np.arange(6.0).reshape(3, 2)
    unique, sums = sum_by_id(ids, values)
    assert unique.tolist() == [-3, 4, 9]
    assert sums.tolist() == [[2.0, 3.0], [4.0, 5.0], [0.0, 1.0]]


@given(st.lists(st.integers(0, 3000), max_size=3000), st.booleans())
@settings(max_examples=100, deadline=None)
def test_sort_ids_groups_equal_ids_and_keeps_their_order_when_asked(ids, keep_order):
    ids = np.array(ids, dtype=np.int64)
    order, sorted_ids, first = sort_ids(ids, keep_order_of_repeats=keep_order)
    assert sorted(order.tolist()) == list(range(len(ids)))
    assert np.array_equal(sorted_ids, ids[order]) and np.array_equal(sorted_ids, np.sort(ids))
    assert first.tolist() == [i == 0 or sorted_ids[i] != sorted_ids[i - 1] for i in range(len(ids))]
    if keep_order:  # equal ids in order of occurrence: the stable order
        assert np.array_equal(order, np.argsort(ids, kind="stable"))


@given(st.lists(st.one_of(st.integers(-2**63, 2**63 - 1), st.integers(2**54 - 3, 2**54 + 3),
                          st.integers(2**55 - 3, 2**55 + 3), st.integers(0, 9)), max_size=300), st.booleans())
@settings(max_examples=200, deadline=None)
def test_sort_ids_any_int64_and_the_packed_keys_edge(ids, keep_order):
    """Ids near where (id, position) stops fitting one int64 key, negative and huge ones."""
    ids = np.array(ids, dtype=np.int64)
    order, sorted_ids, first = sort_ids(ids, keep_order_of_repeats=keep_order)
    assert np.array_equal(sorted_ids, np.sort(ids)) and np.array_equal(sorted_ids, ids[order])
    assert first.tolist() == [i == 0 or sorted_ids[i] != sorted_ids[i - 1] for i in range(len(ids))]
    if keep_order:
        assert np.array_equal(order, np.argsort(ids, kind="stable"))


def test_sort_ids_of_unsigned_ids():
    ids = np.array([7, 3, 7, 2**64 - 1, 0], dtype=np.uint64)
    order, sorted_ids, _ = sort_ids(ids)
    assert order.tolist() == [4, 1, 0, 2, 3] and sorted_ids.tolist() == [0, 3, 7, 7, 2**64 - 1]
    order, _, _ = sort_ids(ids[:3])
    assert order.tolist() == [1, 0, 2]
