"""The worker's sort of row ids is reused for equal ids on the same thread, never for other ids."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from wehub_ps.kernels.segments import is_stable, sort_ids
from worker_client.id_sorts import sorted_ids


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_push_after_a_pull_of_the_same_ids_reuses_the_sort():
    ids = np.array([5, 3, 5, 9, 3, 3], np.int64)
    pulled = sorted_ids(ids, keep_order_of_repeats=False)
    pushed = sorted_ids(ids.copy())  # equal ids in another array: the caller's buffer may be new
    assert pushed is pulled and _same(pushed, sort_ids(ids))
    with pytest.raises(ValueError, match="read-only"):
        pushed[0][0] = 1


def test_other_ids_or_the_same_buffer_changed_are_sorted_again():
    ids = np.array([4, 1, 4, 2], np.int64)
    first = sorted_ids(ids)
    ids[0] = 7  # the caller reused its buffer for the next batch
    second = sorted_ids(ids)
    assert second is not first and _same(second, sort_ids(ids))
    assert _same(sorted_ids(ids[:3]), sort_ids(ids[:3]))


def test_an_order_that_keeps_repeats_in_place_is_given_when_asked():
    # Any int64 (a hash table's ids): NumPy's fast argsort, which need not keep repeats in order.
    rng = np.random.default_rng(3)
    ids = rng.choice(rng.integers(-2**62, 2**62, 50), 4000)
    sorted_ids(ids, keep_order_of_repeats=False)
    order, _, first = sorted_ids(ids)
    assert is_stable(order, first) and _same((order,), (sort_ids(ids)[0],))


def test_each_thread_keeps_its_own():
    ids = np.array([2, 2, 1], np.int64)
    mine = sorted_ids(ids)
    other = []
    thread = threading.Thread(target=lambda: other.append(sorted_ids(ids)))
    thread.start()
    thread.join()
    assert other[0] is not mine and _same(other[0], mine)
