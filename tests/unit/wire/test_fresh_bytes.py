"""Bytes objects filled in place (wehub_ps.wire.fresh_bytes) and messages joined from gathered rows (codec)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wehub_ps.kernels.rowops import RowGather
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.arrays import byte_view
from wehub_ps.wire.codec import (
    OutgoingChunk,
    decode_envelope,
    decode_push_request,
    encode_envelope,
    encode_push_request,
    join_pieces,
    piece_size,
    push_request_pieces,
)
from wehub_ps.wire.fresh_bytes import filled_bytes


def test_filled_bytes_holds_what_the_fill_wrote():
    message = filled_bytes(6, lambda contents: contents.__setitem__(slice(None), np.arange(6)))
    assert type(message) is bytes and message == bytes(range(6))
    assert hash(message) == hash(bytes(range(6)))  # an ordinary, immutable bytes object


def test_filled_bytes_of_nothing_never_writes_the_shared_empty_bytes():
    seen = []
    assert filled_bytes(0, lambda contents: seen.append(contents.size)) == b""
    assert seen == [0]


def test_a_failed_fill_returns_nothing():
    def fail(contents: np.ndarray) -> None:
        contents[:2] = 7
        raise RuntimeError("fill failed")

    with pytest.raises(RuntimeError, match="fill failed"):
        filled_bytes(4, fail)


def _table(rows: int, width: int, dtype: str = "<f4") -> np.ndarray:
    return np.arange(rows * width, dtype=dtype).reshape(rows, width)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 40), st.integers(0, 9), st.sampled_from(["<f4", "<f8", "<i2", "u1"]), st.data())
def test_joined_gathers_equal_joined_copies(rows, width, dtype, data):
    table = _table(rows, width, dtype)
    picks = np.array(data.draw(st.lists(st.integers(0, rows - 1), max_size=60)), dtype=np.intp)
    prefix = data.draw(st.binary(max_size=7))  # any offset: gathered rows need no alignment
    gather = RowGather(table, picks)
    assert gather.nbytes == piece_size(gather) == len(picks) * width * table.itemsize
    pieces = [prefix, gather, memoryview(b"tail")]
    assert join_pieces(pieces) == b"".join([prefix, table[picks].tobytes(), b"tail"])
    assert gather.gather().tobytes() == table[picks].tobytes()
    half = len(picks) // 2
    assert gather.select(slice(half, None)).gather().tobytes() == table[picks[half:]].tobytes()


def test_pieces_without_gathers_are_joined_as_before():
    assert join_pieces([b"a", memoryview(b"bc"), bytearray(b"d")]) == b"abcd"
    assert piece_size(bytearray(b"xyz")) == 3


def test_a_push_of_gathered_rows_is_the_push_of_the_rows():
    """Chunk data given as a RowGather frames exactly like the gathered bytes (protobuf's own encoding)."""
    table = _table(50, 3)
    picks = np.array([7, 0, 49, 12])
    header = ps_pb2.ChunkHeader(variable="t", offset=0, count=12, dtype=ps_pb2.FLOAT32, part_elements=12)
    begin = ps_pb2.PushBegin(worker_id="w", sequence=1, items=[ps_pb2.PushItem(variable="t", elements=12)])
    gathered = encode_push_request(begin, [OutgoingChunk(header, RowGather(table, picks))])
    copied = encode_push_request(begin, [OutgoingChunk(header, byte_view(table[picks]))])
    assert gathered == copied
    decoded_begin, (chunk,) = decode_push_request(gathered)
    assert decoded_begin == begin
    np.testing.assert_array_equal(chunk.array().reshape(4, 3), table[picks])
    # Inside an exchange envelope, as the lane sends it.
    request_id, field, payload = decode_envelope(
        encode_envelope(9, 3, push_request_pieces(begin, [OutgoingChunk(header, RowGather(table, picks))])))
    assert (request_id, field, bytes(payload)) == (9, 3, copied)
