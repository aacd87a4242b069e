"""Sums by id, sorted (numpy_sum_sorted) or grouped (sum_groups): np.add.at's bits; sort_ids' contract."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wehub_ps.kernels import groups, segments
from wehub_ps.kernels.compiled import compiled
from wehub_ps.kernels.segments import numpy_sum_sorted, sort_ids


def _grouped_sums(ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    unique, inverse = groups.group_ids(ids)
    return unique, groups.sum_groups(values, inverse, len(unique))


#: Both ways of summing: the NumPy passes over sorted ids, and the compiled hash grouping (built now).
_SUMS = {"numpy": lambda ids, values: numpy_sum_sorted(values, *sort_ids(ids)),
         "compiled": _grouped_sums}


@pytest.fixture(scope="module", autouse=True)
def compiled_loop_ready():
    if compiled(groups._sum_in_groups, groups._sum_in_groups_signatures) is None or \
            compiled(groups._group, groups._group_signatures) is None:
        _SUMS.pop("compiled")  # numba not installed, or PS_COMPILED_LOOPS=0


@pytest.mark.parametrize("path", ["numpy", "compiled"])
@given(st.lists(st.integers(-5, 5), max_size=60), st.integers(1, 4), st.sampled_from(["float32", "float64"]),
       st.integers(0, 2**32 - 1))
@settings(max_examples=200, deadline=None)
def test_sums_equal_add_at_in_order_of_occurrence(path, ids, width, dtype, seed):
    if path not in _SUMS:
        pytest.skip("numba is not installed here")
    ids = np.array(ids, dtype=np.int64)
    values = np.random.default_rng(seed).standard_normal((len(ids), width)).astype(dtype)
    unique, sums = _SUMS[path](ids, values)
    assert np.array_equal(unique, np.unique(ids))
    dense = np.zeros((11, width), dtype)
    np.add.at(dense, ids + 5, values)
    assert sums.dtype == values.dtype
    assert sums.tobytes() == dense[unique + 5].tobytes()


def test_no_repeats_is_a_reordering_only():
    ids = np.array([9, -3, 4])
    values = np.arange(6.0).reshape(3, 2)
    unique, sums = numpy_sum_sorted(values, *sort_ids(ids))
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


@pytest.mark.parametrize("path", ["numpy", "compiled"])
@given(st.integers(1, 3000), st.floats(1.05, 3.0), st.integers(1, 2000), st.integers(1, 70),
       st.sampled_from(["float32", "float64"]), st.integers(0, 2**32 - 1))
@settings(max_examples=60, deadline=None)
def test_heavily_repeated_ids_sum_as_add_at(path, n, exponent, distinct, width, dtype, seed):
    if path not in _SUMS:
        pytest.skip("numba is not installed here")
    """Zipf-distributed ids (some repeated hundreds of times, most a few times or once) take the rounds
    and the per-id accumulations; every sum keeps np.add.at's bits."""
    rng = np.random.default_rng(seed)
    ids = (rng.zipf(exponent, n) % distinct).astype(np.int64)
    values = rng.standard_normal((n, width)).astype(dtype)
    values[rng.random((n, width)) < 0.01] = -0.0
    values.flags.writeable = seed % 2 == 0  # read-only gradients too (JAX hands those)
    unique, sums = _SUMS[path](ids, values)
    _, inverse = np.unique(ids, return_inverse=True)
    expected = np.zeros((len(unique), width), dtype)
    first = np.zeros(len(ids), dtype=bool)
    first[np.unique(inverse, return_index=True)[1]] = True
    expected[inverse[first]] = values[first]  # np.add.at onto each id's first row, as the sums start
    np.add.at(expected, inverse[~first], values[~first])
    assert sums.tobytes() == expected.tobytes()


def test_the_python_steps_do_not_grow_with_the_repeats():
    """One id repeated 4,000 times among others: the lines the NumPy path runs (a round per occurrence
    would run thousands) stay bounded by the rounds' cap and the heavy ids' count."""
    import sys

    rng = np.random.default_rng(3)
    ids = np.concatenate([np.zeros(4000, np.int64), rng.integers(1, 200, 2000)])
    rng.shuffle(ids)
    values = rng.standard_normal((len(ids), 8)).astype(np.float32)
    lines = 0

    def trace(frame, event, arg):
        nonlocal lines
        if frame.f_code is numpy_sum_sorted.__code__:
            lines += event == "line"
            return trace
        return None

    sys.settrace(trace)
    try:
        unique, _ = _SUMS["numpy"](ids, values)
    finally:
        sys.settrace(None)
    bound = 40 + 3 * segments._MAX_ROUNDS + 5 * (segments._HEAVY + 1)
    assert 0 < lines <= bound, f"{lines} lines run for one id repeated 4,000 times (bound {bound})"
    assert unique.tolist() == np.unique(ids).tolist()
