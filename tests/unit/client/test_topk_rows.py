"""TopKRows: the largest rows go out, the rest is owed, and nothing is lost or made up."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker_client.topk import TopKRows


@st.composite
def _pushes(draw):
    rows = draw(st.integers(1, 12))
    width = draw(st.integers(1, 4))
    steps = draw(st.integers(1, 5))
    ratio = draw(st.floats(0.01, 1.0))
    # Small integers: every sum is exact in float32, so conservation is checked bit for bit.
    grads = [np.array(draw(st.lists(st.integers(-50, 50), min_size=rows * width, max_size=rows * width)),
                      np.float32).reshape(rows, width) for _ in range(steps)]
    return ratio, grads


def _push(topk: TopKRows, name: str, gradient: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with topk.pushing():
        ids, rows = topk.choose(name, gradient)
        topk.settle(name, gradient, ids)
    return ids, rows


@settings(max_examples=200, deadline=None)
@given(_pushes())
def test_the_largest_owed_rows_go_out_and_the_rest_is_owed(case):
    ratio, grads = case
    topk = TopKRows(ratio)
    sent_total = np.zeros_like(grads[0])
    for g in grads:
        before = topk.residuals().get("w", np.zeros_like(g)) + g
        ids, rows = _push(topk, "w", g)
        k = topk.rows_sent(len(g))
        assert len(ids) == k and np.all(np.diff(ids) > 0)  # k distinct ids, sorted
        np.testing.assert_array_equal(rows, before[ids])
        norms = np.einsum("ij,ij->i", before, before)
        unsent = np.setdiff1d(np.arange(len(g)), ids)
        if len(unsent):
            assert norms[ids].min() >= norms[unsent].max()
        sent_total[ids] += rows
    # Error feedback: what went out plus what is owed is exactly what came in.
    np.testing.assert_array_equal(sent_total + topk.residuals()["w"], np.sum(grads, axis=0))


def test_settle_takes_the_gradient_in_and_owes_refused_rows_again():
    topk = TopKRows(0.5)
    first = np.arange(12, dtype=np.float32).reshape(4, 3)
    _push(topk, "w", first)  # rows 2 and 3 sent; rows 0 and 1 owed
    owed = topk.residuals()["w"]
    np.testing.assert_array_equal(owed, [[0, 1, 2], [3, 4, 5], [0, 0, 0], [0, 0, 0]])
    second = np.full((4, 3), 10, np.float32)
    with topk.pushing():
        ids, rows = topk.choose("w", second)
        np.testing.assert_array_equal(ids, [0, 1])
        assert np.array_equal(topk._owed["w"], owed)  # choosing changes nothing
        topk.settle("w", second, ids, ids[1:], rows[1:])  # row 1's shard refused its push
    np.testing.assert_array_equal(topk.residuals()["w"],
                                  [[0, 0, 0], [13, 14, 15], [10, 10, 10], [10, 10, 10]])
    with topk.pushing():
        topk.choose("w", second)
        topk.settle("w", second, np.empty(0, np.int64))  # nothing sent: the whole gradient is owed
    np.testing.assert_array_equal(topk.residuals()["w"],
                                  [[10, 10, 10], [23, 24, 25], [20, 20, 20], [20, 20, 20]])


def test_rows_are_ranked_in_blocks_like_all_at_once(monkeypatch):
    import worker_client.topk as topk_module

    g = np.random.default_rng(3).standard_normal((50, 7)).astype(np.float32)
    whole = TopKRows(0.2).choose("w", g)
    monkeypatch.setattr(topk_module, "_BLOCK_BYTES", 3 * 7 * 4)  # 3 rows per block
    blocks = TopKRows(0.2).choose("w", g)
    np.testing.assert_array_equal(whole[0], blocks[0])
    np.testing.assert_array_equal(whole[1], blocks[1])


def test_a_1d_gradient_sends_elements_and_keeps_its_shape():
    ids, values = _push(TopKRows(0.25), "b", np.array([0.5, -4.0, 1.0, 3.0], np.float32))
    np.testing.assert_array_equal(ids, [1])
    assert values.shape == (1,) and values[0] == -4.0


@pytest.mark.parametrize("ratio", [0, -0.1, 1.5, True, "0.1", float("nan")])
def test_bad_ratios_are_refused(ratio):
    with pytest.raises(ValueError, match="topk_ratio"):
        TopKRows(ratio)
