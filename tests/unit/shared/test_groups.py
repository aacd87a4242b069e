"""group_ids and sum_groups: np.unique's groups and np.add.at's sums, bit for bit, compiled or not."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wehub_ps.kernels import groups
from wehub_ps.kernels.compiled import compiled


@pytest.fixture(params=["compiled", "numpy"])
def path(request, monkeypatch):
    """Each test on the compiled loops (built now) and on the sort they fall back to while numba loads.

    The same for every example hypothesis draws, so a function-scoped fixture is right here.
    """
    if request.param == "compiled":
        if compiled(groups._group, groups._group_signatures) is None or \
                compiled(groups._sum_in_groups, groups._sum_in_groups_signatures) is None:
            pytest.skip("numba is not installed here, or PS_COMPILED_LOOPS=0")
        monkeypatch.setattr(groups, "_COMPILED_FROM", 1)  # small batches through the loop too
    else:
        monkeypatch.setattr(groups, "compiled_soon", lambda *_: None)
    return request.param


def _check_groups(ids: np.ndarray) -> None:
    unique, inverse = groups.group_ids(ids)
    expected, expected_inverse = np.unique(ids, return_inverse=True)
    assert unique.dtype == np.int64 and inverse.dtype == np.int64
    assert np.array_equal(unique, expected) and np.array_equal(inverse, expected_inverse)


@given(ids=st.lists(st.integers(-2**63, 2**63 - 1), max_size=300))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_int64_ids(path, ids):
    _check_groups(np.array(ids, dtype=np.int64))


@given(ids=st.lists(st.integers(-4, 4), max_size=300))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_few_ids_many_repeats(path, ids):
    _check_groups(np.array(ids, dtype=np.int64))


def test_large_batches_and_colliding_ids(path):
    rng = np.random.default_rng(5)
    _check_groups((rng.zipf(1.2, 20000) % 1_000_000).astype(np.int64))  # a Zipf batch
    _check_groups(rng.permutation(50000).astype(np.int64))  # no repeats
    # Multiples of 2^40 share the low bits; the hash's top bits must still spread them.
    _check_groups(np.repeat(np.arange(-300, 300, dtype=np.int64) << 40, 3))
    _check_groups(np.array([], np.int64))


@given(ids=st.lists(st.integers(-5, 5), min_size=1, max_size=80), width=st.integers(1, 5),
       dtype=st.sampled_from(["float32", "float64"]), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_sums_equal_add_at_in_order_of_occurrence(path, ids, width, dtype, seed):
    ids = np.array(ids, dtype=np.int64)
    values = np.random.default_rng(seed).standard_normal((len(ids), width)).astype(dtype)
    unique, inverse = groups.group_ids(ids)
    sums = groups.sum_groups(values, inverse, len(unique))
    dense = np.zeros((11, width), dtype)
    np.add.at(dense, ids + 5, values)
    assert sums.dtype == values.dtype and sums.shape == (len(unique), width)
    assert sums.tobytes() == dense[unique + 5].tobytes()


def test_sums_of_a_zipf_batch_and_of_shaped_rows(path):
    rng = np.random.default_rng(9)
    ids = (rng.zipf(1.2, 4096) % 1000).astype(np.int64)  # the top id repeats hundreds of times
    values = rng.standard_normal((4096, 2, 3)).astype(np.float32)
    unique, inverse = groups.group_ids(ids)
    sums = groups.sum_groups(values, inverse, len(unique))
    dense = np.zeros((1000, 2, 3), np.float32)
    np.add.at(dense, ids, values)
    assert sums.shape == (len(unique), 2, 3) and sums.tobytes() == dense[unique].tobytes()
