"""Synchronous mode's aggregations of a step's sum: "sum", "mean" and the per-row "row_mean"."""

from __future__ import annotations

import numpy as np

from ps_server.core.accumulator import PushStaging, StepAccumulator, pushes_per_id
from ps_server.core.parts import VariablePart
from ps_server.core.tables import HashTablePart
from wehub_ps.kernels.segments import sort_ids
from wehub_ps.specs import SGD, Constant, VariableSpec


class Reserve:
    """Books nothing: these parts have no memory limit."""

    def __call__(self, nbytes: int) -> None:
        return None


def _staging(ids, grads) -> PushStaging:
    staging = PushStaging()
    staging.add_rows(np.asarray(ids, np.int64), np.asarray(grads, np.float32), np.dtype(np.float32))
    return staging


def _ids(*ids: int) -> np.ndarray:
    return np.array(ids, np.int64)


def test_row_mean_divides_each_row_by_the_pushes_that_carried_it():
    acc = StepAccumulator(step=0)
    acc.merge(0, _staging([3, 1], [[6, 12], [6, 6]]))
    acc.merge(0, _staging([1, 5], [[12, 18], [9, 3]]))
    acc.merge(0, _staging([1, 3], [[3, 3], [0, 6]]))
    _, ids, grads = acc.take("row_mean")
    np.testing.assert_array_equal(ids, [1, 3, 5])
    # Row 1 from three pushes, row 3 from two, row 5 from one; "mean" would divide all by 3.
    np.testing.assert_array_equal(grads, [[7, 9], [3, 9], [9, 3]])
    assert grads.dtype == np.float32


def test_row_mean_counts_survive_a_snapshot():
    """A checkpoint keeps the rows concatenated: each id once per push, so the counts come back."""
    acc = StepAccumulator(step=2)
    acc.merge(2, _staging([4, 8], [[2, 2], [4, 4]]))
    acc.merge(2, _staging([8], [[6, 6]]))
    restored = StepAccumulator.restore(acc.snapshot())
    restored.merge(2, _staging([8, 9], [[2, 2], [1, 1]]))
    _, ids, grads = restored.take("row_mean")
    np.testing.assert_array_equal(ids, [4, 8, 9])
    np.testing.assert_array_equal(grads, [[2, 2], [4, 4], [1, 1]])


def test_pushes_per_id():
    ids = np.array([5, 1, 5, 9, 5, 1], np.int64)
    _, sorted_ids, first = sort_ids(ids)
    np.testing.assert_array_equal(sorted_ids[first], [1, 5, 9])
    np.testing.assert_array_equal(pushes_per_id(first), [2, 3, 1])
    assert pushes_per_id(np.zeros(0, bool)).tolist() == []


def test_row_mean_aggregation_for_tables_and_dense_parts():
    """A row pushed by 2 of 3 pushes: "row_mean" divides by 2, "mean" by 3, "sum" by 1."""
    pushes = [([1, 2], [[6, 6], [12, 12]]), ([1], [[18, 18]]), ([3], [[6, 6]])]
    expected = {"sum": [[-24, -24], [-12, -12], [-6, -6]], "mean": [[-8, -8], [-4, -4], [-2, -2]],
                "row_mean": [[-12, -12], [-12, -12], [-6, -6]]}
    for aggregation, values in expected.items():
        spec = VariableSpec("t", (2,), "float32", initializer=Constant(0.0), optimizer=SGD(learning_rate=1.0),
                            hash_table=True, aggregation=aggregation)
        table = HashTablePart(spec, 0, Reserve())
        dense = VariablePart(VariableSpec("d", (4, 2), "float32", optimizer=SGD(learning_rate=1.0),
                                          aggregation=aggregation), 0, 4, True)
        dense.allocate_and_fill()
        for ids, grads in pushes:
            table.merge_staged(0, _staging(ids, grads))
            dense.merge_staged(0, _staging(ids, grads))
        assert table.apply_accumulated(0) and dense.apply_accumulated(0)
        np.testing.assert_array_equal(table.read_rows(_ids(1, 2, 3)), values, err_msg=aggregation)
        np.testing.assert_array_equal(dense.value.reshape(4, 2)[1:], values, err_msg=aggregation)
