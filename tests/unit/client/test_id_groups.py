"""The worker's grouping of row ids is reused for equal ids on the same thread, never for other ids."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from worker_client.id_groups import grouped_ids


def _check(groups, ids) -> None:
    assert np.array_equal(groups.unique, np.unique(ids))
    assert np.array_equal(groups.unique[groups.inverse], ids)


def test_a_push_after_a_pull_of_the_same_ids_reuses_the_grouping():
    ids = np.array([5, 3, 5, 9, 3, 3], np.int64)
    pulled = grouped_ids(ids)
    pushed = grouped_ids(ids.copy())  # equal ids in another array: the caller's buffer may be new
    assert pushed is pulled and pushed.repeats
    _check(pushed, ids)
    with pytest.raises(ValueError, match="read-only"):
        pushed.inverse[0] = 1
    with pytest.raises(ValueError, match="repeat"):
        pushed.order  # noqa: B018 - a repeated id has no single place


def test_other_ids_or_the_same_buffer_changed_are_grouped_again():
    ids = np.array([4, 1, 4, 2], np.int64)
    first = grouped_ids(ids)
    ids[0] = 7  # the caller reused its buffer for the next batch
    second = grouped_ids(ids)
    assert second is not first
    _check(second, ids)
    _check(grouped_ids(ids[:3]), ids[:3])


def test_without_repeats_the_order_places_each_sorted_id():
    rng = np.random.default_rng(3)
    ids = rng.choice(rng.integers(-2**62, 2**62, 5000), 4000, replace=False)
    groups = grouped_ids(ids)
    assert not groups.repeats and np.array_equal(ids[groups.order], np.sort(ids))
    assert groups.order is groups.order and not groups.order.flags.writeable


def test_each_thread_keeps_its_own():
    ids = np.array([2, 2, 1], np.int64)
    mine = grouped_ids(ids)
    other = []
    thread = threading.Thread(target=lambda: other.append(grouped_ids(ids)))
    thread.start()
    thread.join()
    assert other[0] is not mine
    _check(other[0], ids)
