"""PullReceiver: answers written into place, rows scattered to the caller's order, bad answers refused."""

from __future__ import annotations

import numpy as np
import pytest

from wehub_ps.dtypes import BFLOAT16
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.codec import OutgoingChunk, encode_pull_response
from wehub_ps.wire.dtypes import to_wire_dtype
from worker_client.errors import PSInternalError
from worker_client.pull_receiver import PullItem, PullReceiver


def _answer(name: str, values: np.ndarray, offset: int = 0, version: int = 3) -> bytes:
    flat = values.reshape(-1)
    header = ps_pb2.ChunkHeader(variable=name, offset=offset, count=flat.size, dtype=to_wire_dtype(flat.dtype),
                                part_elements=flat.size, version=version)
    return encode_pull_response([OutgoingChunk(header, memoryview(flat.tobytes()))])


def test_rows_land_at_their_places_in_two_chunks():
    result = np.full((5, 3), -1.0, np.float32)
    rows = np.arange(12, dtype=np.float32).reshape(4, 3)  # rows 0..3 of the answer, in sorted-id order
    receiver = PullReceiver("h:1", [PullItem("t", result, np.array([1, 2, 5, 9]), rows_at=np.array([4, 0, 3, 1]))])
    receiver.take_message(_answer("t", rows[:2]))
    receiver.take_message(_answer("t", rows[2:], offset=6))
    receiver.check_complete()
    assert result.tolist() == [rows[1].tolist(), rows[3].tolist(), [-1.0] * 3, rows[2].tolist(), rows[0].tolist()]
    assert receiver.versions == {"t": 3}


def test_rows_arrive_cast_from_the_wire_dtype():
    result = np.zeros((2, 2), np.float32)
    receiver = PullReceiver("h:1", [PullItem("t", result, np.array([0, 1]), rows_at=np.array([1, 0]))])
    receiver.take_message(_answer("t", np.array([[1.5, 2.0], [-3.0, 4.0]], np.float32).astype(BFLOAT16)))
    assert result.tolist() == [[-3.0, 4.0], [1.5, 2.0]]


@pytest.mark.parametrize("offset, values, words", [
    (1, np.zeros(3, np.float32), "whole rows"),  # starts inside a row
    (0, np.zeros(4, np.float32), "whole rows"),  # ends inside a row
    (3, np.zeros(6, np.float32), "outside 6 elements"),  # a row past the last one asked
])
def test_answers_that_are_not_the_rows_asked_are_refused(offset, values, words):
    result = np.zeros((3, 3), np.float32)
    receiver = PullReceiver("h:1", [PullItem("t", result, np.array([4, 7]), rows_at=np.array([2, 0]))])
    with pytest.raises(PSInternalError, match=words):
        receiver.take_message(_answer("t", values, offset=offset))
    assert not result.any()


def test_an_answer_short_of_rows_is_an_error():
    result = np.zeros((2, 2), np.float32)
    receiver = PullReceiver("h:1", [PullItem("t", result, np.array([4, 7]), rows_at=np.array([1, 0]))])
    receiver.take_message(_answer("t", np.ones(2, np.float32)))
    with pytest.raises(PSInternalError, match=r"ended early.*'t': \(2, 4\)"):
        receiver.check_complete()


def test_flat_destination_as_before():
    dest = np.zeros(6, np.float64)
    receiver = PullReceiver("h:1", [PullItem("v", dest)])
    receiver.take_message(_answer("v", np.arange(3.0), offset=3))
    receiver.take_message(_answer("v", np.arange(3.0)))
    receiver.check_complete()
    assert dest.tolist() == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0]


def test_rows_of_no_elements():
    result = np.zeros((2, 0), np.float32)
    receiver = PullReceiver("h:1", [PullItem("t", result, np.array([4, 7]), rows_at=np.array([1, 0]))])
    receiver.take_message(_answer("t", np.zeros(0, np.float32)))
    receiver.check_complete()
    assert result.shape == (2, 0)
