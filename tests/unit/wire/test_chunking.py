"""The chunk packer: where messages end, for pushes (begin + chunks) and pull answers (chunks only)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wehub_ps.wire.chunking import ChunkPacker, split_spans


def _frame(head, chunks):
    return (head, list(chunks))


def _pack_with_add(sizes, limit, head=None, used=0):
    packer = ChunkPacker(_frame, limit, head, used)
    messages = [m for i, n in enumerate(sizes) if (m := packer.add(i, n)) is not None]
    last = packer.flush()
    return messages + ([last] if last is not None else [])


def _pack_with_before(sizes, limit, head=None, used=0):
    packer = ChunkPacker(_frame, limit, head, used)
    messages = []
    for i, n in enumerate(sizes):
        message = packer.before(n)
        if message is not None:
            messages.append(message)
        packer.append(i, n)
    last = packer.flush()
    return messages + ([last] if last is not None else [])


@pytest.mark.parametrize("pack", [_pack_with_add, _pack_with_before])
def test_chunks_fill_messages_up_to_the_limit(pack):
    assert pack([4, 4, 4, 4, 4], 10) == [(None, [0, 1]), (None, [2, 3]), (None, [4])]


@pytest.mark.parametrize("pack", [_pack_with_add, _pack_with_before])
def test_a_chunk_larger_than_the_limit_goes_alone(pack):
    assert pack([3, 20, 3], 10) == [(None, [0]), (None, [1]), (None, [2])]


@pytest.mark.parametrize("pack", [_pack_with_add, _pack_with_before])
def test_the_head_goes_with_the_first_message_and_its_bytes_count(pack):
    # A begin carrying 6 bytes of row ids leaves room for one 4-byte chunk in the first message.
    assert pack([4, 4, 4], 10, head="begin", used=6) == [("begin", [0]), (None, [1, 2])]


def test_a_head_with_no_chunks_is_still_a_message():
    assert _pack_with_add([], 10, head="begin") == [("begin", [])]


def test_nothing_pending_and_no_head_is_no_message():
    packer = ChunkPacker(_frame, 10)
    assert packer.flush() is None
    packer.add(0, 4)
    assert packer.flush() == (None, [0])
    assert packer.flush() is None


def test_full_tells_a_caller_that_sends_once_the_limit_is_reached():
    # The pull stream's small column chunks: add, then send when full.
    packer = ChunkPacker(_frame, 10)
    assert packer.add(0, 6) is None and not packer.full
    assert packer.add(1, 4) is None and packer.full
    assert packer.flush() == (None, [0, 1])
    assert not packer.full


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=30), st.integers(1, 50), st.integers(0, 20))
def test_every_chunk_is_sent_once_in_order_and_no_message_overflows_but_a_lone_chunk(sizes, limit, used):
    messages = _pack_with_add(sizes, limit, "begin", used)
    assert messages == _pack_with_before(sizes, limit, "begin", used)
    assert [i for _, chunks in messages for i in chunks] == list(range(len(sizes)))
    assert [head for head, _ in messages] == ["begin"] + [None] * (len(messages) - 1)
    for k, (_, chunks) in enumerate(messages):
        total = sum(sizes[i] for i in chunks) + (used if k == 0 else 0)
        assert total <= limit or len(chunks) == 1 or (k == 0 and not chunks)
        if k + 1 < len(messages):  # a message ends only where the next chunk does not fit
            following = messages[k + 1][1][0]
            assert chunks and total + sizes[following] > limit


def test_spans_fill_parts_and_the_first_part_names_every_item():
    assert split_spans([16, 8, 0, 24], 24) == [
        [(0, 0, 16), (1, 0, 8), (2, 0, 0), (3, 0, 0)],
        [(3, 0, 24)],
    ]
    assert split_spans([40], 16) == [[(0, 0, 16)], [(0, 16, 32)], [(0, 32, 40)]]


def test_spans_that_fit_are_one_part():
    assert split_spans([8, 8], 64) == [[(0, 0, 8), (1, 0, 8)]]
    assert split_spans([], 8) == [[]]
    assert split_spans([0, 0], 0) == [[(0, 0, 0), (1, 0, 0)]]


def test_spans_need_room_to_split():
    with pytest.raises(ValueError, match="positive"):
        split_spans([8], 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 12), max_size=12), st.integers(1, 8))
def test_spans_cover_each_item_once_in_order_at_unit_multiples(units, room_units):
    lengths, limit = [8 * u for u in units], 8 * room_units
    parts = split_spans(lengths, limit)
    assert [index for index, _, _ in parts[0]] == list(range(len(lengths)))
    covered: dict[int, int] = {}
    for part in parts:
        assert sum(stop - start for _, start, stop in part) <= limit
        for index, start, stop in part:
            assert start == covered.get(index, 0) and start <= stop and start % 8 == stop % 8 == 0
            covered[index] = stop
    assert [covered.get(i, 0) for i in range(len(lengths))] == lengths
    assert all(part for part in parts[1:])
