"""take_rows / put_rows: the same bytes as fancy indexing, for every table dtype."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wehub_ps.kernels.rowops import put_rows, take_rows, take_rows_into

DTYPES = ["float16", "float32", "float64", "int64"]


@given(st.sampled_from(DTYPES), st.integers(1, 40), st.integers(1, 9), st.data())
@settings(max_examples=150, deadline=None)
def test_take_and_put_match_fancy_indexing(dtype, num_rows, width, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    table = (rng.standard_normal((num_rows, width)) * 100).astype(dtype)
    rows = np.array(data.draw(st.lists(st.integers(0, num_rows - 1), max_size=3 * num_rows)), dtype=np.int64)
    assert take_rows(table, rows).tobytes() == table[rows].tobytes()
    offset = data.draw(st.integers(0, 7))  # a message's payload may start at any byte
    message = np.zeros(offset + table[rows].nbytes, np.uint8)
    take_rows_into(message[offset:], table, rows)
    assert message[offset:].tobytes() == table[rows].tobytes() and not message[:offset].any()

    unique = np.unique(rows)
    values = (rng.standard_normal((len(unique), width)) * 100).astype(np.float64)  # cast on the way in
    expected = table.copy()
    expected[unique] = values
    put_rows(table, unique, values)
    assert table.tobytes() == expected.tobytes()


def test_put_of_a_repeated_row_keeps_the_last_value():
    table = np.zeros((3, 2), np.float32)
    put_rows(table, np.array([1, 1]), np.array([[1, 1], [2, 2]], np.float32))
    assert table.tolist() == [[0, 0], [2, 2], [0, 0]]


def test_put_into_a_strided_table_falls_back_to_fancy_indexing():
    table = np.zeros((4, 6), np.float32)[:, ::2]  # not contiguous: rows are not records
    put_rows(table, np.array([2]), np.ones((1, 3), np.float32))
    assert table.sum() == 3 and table[2].tolist() == [1, 1, 1]


def test_rows_outside_the_table_raise():
    with pytest.raises(IndexError):
        put_rows(np.zeros((2, 2)), np.array([2]), np.ones((1, 2)))
    with pytest.raises(IndexError):
        take_rows(np.zeros((2, 2)), np.array([5]))
