"""Round trips and wire compatibility of the hand-made codec (wehub_ps.wire.codec)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from wehub_ps.dtypes import BFLOAT16
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.arrays import as_wire_array, byte_view, chunk_ranges, chunk_view
from wehub_ps.wire.codec import (
    BATCH_BELOW_BYTES,
    DATA_ALIGNMENT,
    EXCHANGE_ERROR,
    EXCHANGE_PULL,
    EXCHANGE_PUSH,
    DecodedChunk,
    OutgoingChunk,
    TooManyChunks,
    decode_envelope,
    decode_pull_response,
    decode_push_request,
    encode_envelope,
    encode_pull_response,
    encode_push_request,
)
from wehub_ps.wire.dtypes import to_numpy_dtype, to_wire_dtype
from wehub_ps.wire.protowire import CodecError
from wehub_ps.wire.small_messages import (
    encode_chunk_header,
    encode_pull_item,
    encode_pull_request,
    encode_push_begin,
    encode_push_item,
    encode_push_response,
)

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# dtype name -> (numpy little-endian dtype, unsigned int dtype of the same size
# used to generate arbitrary bit patterns, or None to generate values).
_DTYPES = {
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "bfloat16": BFLOAT16,
    "int8": np.dtype("i1"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}
_BITS = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
_EXPECTED_WIRE = {
    "float16": ps_pb2.FLOAT16, "float32": ps_pb2.FLOAT32, "float64": ps_pb2.FLOAT64,
    "bfloat16": ps_pb2.BFLOAT16, "int8": ps_pb2.INT8, "int16": ps_pb2.INT16,
    "int32": ps_pb2.INT32, "int64": ps_pb2.INT64, "uint8": ps_pb2.UINT8, "bool": ps_pb2.BOOL,
}


def _is_float(dtype: np.dtype) -> bool:
    return dtype == BFLOAT16 or dtype.kind == "f"


def _same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Exact equality of values (NaNs compare equal) and of every bit."""
    if a.shape != b.shape:
        return False
    if _is_float(a.dtype):
        with np.errstate(invalid="ignore"):  # generated NaN bit patterns widen to NaN, which is the point
            af = a.astype(np.float64)
            bf = b.astype(np.float64)
        if not np.array_equal(af, bf, equal_nan=True):
            return False
    elif not np.array_equal(a, b):
        return False
    # Bitwise, after normalising both to little-endian.
    la = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<") if a.dtype.itemsize > 1
                                        and a.dtype != BFLOAT16 else a.dtype)
    lb = np.ascontiguousarray(b).astype(b.dtype.newbyteorder("<") if b.dtype.itemsize > 1
                                        and b.dtype != BFLOAT16 else b.dtype)
    return la.tobytes() == lb.tobytes()


@st.composite
def tensors(draw):
    """(original array as the user holds it, its dtype name)."""
    name = draw(st.sampled_from(sorted(_DTYPES)))
    dtype = _DTYPES[name]
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6))
    layout = draw(st.sampled_from(["plain", "transpose", "strided", "bigendian", "fortran"]))
    if layout == "strided":
        base_shape = tuple(d * 2 for d in shape)
    else:
        base_shape = shape
    if dtype == np.dtype("?"):
        base = draw(hnp.arrays(dtype, base_shape))
    else:
        # Arbitrary bit patterns: every NaN payload, infinities, subnormals, -0.0.
        bits = draw(hnp.arrays(_BITS[dtype.itemsize], base_shape))
        base = bits.view(dtype)
    if layout == "strided":
        arr = base[tuple(slice(None, None, 2) for _ in shape) + (Ellipsis,)]
    elif layout == "transpose":
        arr = base.T
    elif layout == "fortran":
        arr = np.asfortranarray(base)
    elif layout == "bigendian" and dtype.itemsize > 1 and dtype != BFLOAT16:
        arr = base.astype(dtype.newbyteorder(">"))
        assert arr.dtype.byteorder == ">"
    else:
        arr = base
    return arr, name


def _outgoing(wire: np.ndarray, chunk_elements: int, variable: str = "v") -> list[OutgoingChunk]:
    chunks = []
    for offset, count in chunk_ranges(wire.size, chunk_elements):
        header = ps_pb2.ChunkHeader(variable=variable, offset=offset, count=count,
                                    dtype=to_wire_dtype(wire.dtype), version=7,
                                    part_elements=wire.size)
        chunks.append(OutgoingChunk(header, byte_view(wire[offset:offset + count])))
    return chunks


def _group(chunks: list, sizes: list[int]) -> list[list]:
    """Split ``chunks`` into consecutive messages of the given sizes (last takes the rest)."""
    groups, i = [], 0
    for size in sizes:
        if i >= len(chunks):
            break
        groups.append(chunks[i:i + size])
        i += size
    if i < len(chunks):
        groups.append(chunks[i:])
    return groups


def _reassemble(decoded: list[DecodedChunk], total: int, dtype: np.dtype) -> np.ndarray:
    out = np.empty(total, dtype=dtype)
    seen = np.zeros(total, dtype=bool)
    for chunk in decoded:
        h = chunk.header
        assert h.variable == "v"
        assert h.part_elements == total
        assert h.version == 7
        values = chunk.array()
        assert values.dtype == dtype
        assert values.size == h.count
        assert not seen[h.offset:h.offset + h.count].any(), "chunks overlap"
        out[h.offset:h.offset + h.count] = values
        seen[h.offset:h.offset + h.count] = True
    assert seen.all(), "chunks do not cover the tensor"
    return out


def _check_wire_array(wire: np.ndarray, original: np.ndarray, dtype_name: str) -> None:
    expected_dtype = _DTYPES[dtype_name]
    assert wire.dtype == expected_dtype
    assert wire.dtype.byteorder in ("<", "|", "=")
    if wire.dtype.itemsize > 1 and wire.dtype != BFLOAT16:
        assert wire.dtype.str[0] == "<"
    assert wire.ndim == 1
    assert wire.flags.c_contiguous
    assert wire.size == original.size
    assert to_wire_dtype(wire.dtype) == _EXPECTED_WIRE[dtype_name]


@SETTINGS
@given(tensors(), st.integers(1, 50), st.lists(st.integers(1, 4), max_size=8))
def test_pull_response_round_trip(tensor, chunk_elements, group_sizes):
    original, dtype_name = tensor
    wire = as_wire_array(original)
    _check_wire_array(wire, original, dtype_name)
    chunks = _outgoing(wire, chunk_elements)
    decoded = []
    for group in _group(chunks, group_sizes):
        message = encode_pull_response(group)
        assert isinstance(message, bytes)
        decoded += decode_pull_response(message)
    assert len(decoded) == len(chunks)
    result = _reassemble(decoded, wire.size, wire.dtype)
    assert _same_values(result.reshape(original.shape), original)


@SETTINGS
@given(tensors(), st.integers(1, 50), st.lists(st.integers(1, 4), max_size=8), st.booleans())
def test_push_request_round_trip(tensor, chunk_elements, group_sizes, with_begin):
    original, dtype_name = tensor
    wire = as_wire_array(original)
    _check_wire_array(wire, original, dtype_name)
    chunks = _outgoing(wire, chunk_elements)
    begin = ps_pb2.PushBegin(
        worker_id="w-1", incarnation="inc", sequence=3, shard_index=1, num_shards=2,
        kind=ps_pb2.GRADIENT,
        items=[ps_pb2.PushItem(variable="v", elements=wire.size,
                               wire_dtype=to_wire_dtype(wire.dtype), base_version=7)],
    )
    decoded = []
    for i, group in enumerate(_group(chunks, group_sizes)):
        first = begin if (with_begin and i == 0) else None
        got_begin, got_chunks = decode_push_request(encode_push_request(first, group))
        if first is None:
            assert got_begin is None
        else:
            assert got_begin == begin
        decoded += got_chunks
    assert len(decoded) == len(chunks)
    result = _reassemble(decoded, wire.size, wire.dtype)
    assert _same_values(result.reshape(original.shape), original)


def test_push_request_with_begin_and_no_chunks():
    begin = ps_pb2.PushBegin(worker_id="w", incarnation="i", sequence=1, kind=ps_pb2.ASSIGN)
    got_begin, chunks = decode_push_request(encode_push_request(begin, []))
    assert got_begin == begin
    assert chunks == []
    assert decode_push_request(encode_push_request(None, [])) == (None, [])
    assert decode_pull_response(encode_pull_response([])) == []


@pytest.mark.parametrize("size", [4, 40_000])  # small chunks travel in batches, large ones alone
def test_push_request_with_more_chunks_than_allowed_is_refused_before_decoding_them(size):
    data = byte_view(np.zeros(size, np.float32))
    chunks = [OutgoingChunk(encode_chunk_header(f"v{i}", 0, size, ps_pb2.FLOAT32), data) for i in range(10)]
    message = encode_push_request(None, chunks)
    assert len(decode_push_request(message, max_chunks=10)[1]) == 10
    with pytest.raises(TooManyChunks, match="more than 9 chunks"):
        decode_push_request(message, max_chunks=9)


# ---- as_wire_array ---------------------------------------------------------------


@SETTINGS
@given(tensors())
def test_as_wire_array_does_not_copy_when_already_wire_ready(tensor):
    original, _ = tensor
    wire = as_wire_array(original)
    if original.flags.c_contiguous and (original.dtype.byteorder != ">"):
        assert np.shares_memory(wire, original) or original.size == 0
    else:
        assert not np.shares_memory(wire, original)


@SETTINGS
@given(hnp.arrays(np.dtype("<f4"), hnp.array_shapes(min_dims=0, max_dims=3, max_side=5),
                  elements=st.floats(-7e4, 7e4, width=32)),
       st.sampled_from(["float16", "bfloat16", ">f2"]), st.booleans())
def test_as_wire_array_narrows_to_wire_dtype(original, target, transpose):
    source = original.T if transpose else original
    wire_dtype = BFLOAT16 if target == "bfloat16" else np.dtype(target)
    with np.errstate(over="ignore"):  # beyond float16's range: inf, like astype
        wire = as_wire_array(source, wire_dtype)
        expected = np.ravel(source, order="C").astype(
            BFLOAT16 if target == "bfloat16" else np.dtype("<f2"))
    expected_dtype = BFLOAT16 if target == "bfloat16" else np.dtype("<f2")
    assert wire.dtype == expected_dtype
    assert wire.dtype.str != ">f2"
    assert wire.ndim == 1 and wire.flags.c_contiguous
    assert _same_values(wire, expected)


def test_as_wire_array_big_endian_input_is_byteswapped():
    big = np.array([1.5, -2.25, 3.0], dtype=">f8")
    wire = as_wire_array(big)
    assert wire.dtype.str == "<f8"
    assert wire.tobytes() == np.array([1.5, -2.25, 3.0], dtype="<f8").tobytes()


def test_as_wire_array_of_scalar_and_empty():
    scalar = np.array(3.25, dtype=np.float32)
    wire = as_wire_array(scalar)
    assert wire.shape == (1,) and wire[0] == np.float32(3.25)
    empty = np.zeros((3, 0, 2), dtype=np.int16)
    wire = as_wire_array(empty)
    assert wire.shape == (0,) and wire.dtype == np.dtype("<i2")


# ---- chunk_ranges ----------------------------------------------------------------


@given(st.integers(0, 10_000), st.integers(1, 3_000))
@settings(max_examples=200, deadline=None)
def test_chunk_ranges_cover_exactly(total, chunk_elements):
    ranges = list(chunk_ranges(total, chunk_elements))
    if total == 0:
        assert ranges == [(0, 0)]
        return
    expected_offset = 0
    for offset, count in ranges:
        assert offset == expected_offset
        assert 1 <= count <= chunk_elements
        expected_offset += count
    assert expected_offset == total
    # Every chunk but the last is full.
    assert all(count == chunk_elements for _, count in ranges[:-1])
    assert len(ranges) == -(-total // chunk_elements)


@pytest.mark.parametrize("bad", [0, -1])
def test_chunk_ranges_rejects_non_positive_chunks(bad):
    with pytest.raises(ValueError, match="chunk_elements"):
        list(chunk_ranges(10, bad))


# ---- byte-identical to protobuf ---------------------------------------------------


def _proto_chunks(chunks: list[OutgoingChunk]) -> list[ps_pb2.TensorChunk]:
    return [ps_pb2.TensorChunk(header=c.header, data=bytes(c.data)) for c in chunks]


def _proto_parts(chunks: list[OutgoingChunk]) -> dict:
    """The documented layout: two or more chunks under BATCH_BELOW_BYTES go in one ChunkBatch."""
    small = [c for c in chunks if c.data.nbytes < BATCH_BELOW_BYTES]
    if len(small) < 2:
        return {"chunks": _proto_chunks(chunks)}
    batch = ps_pb2.ChunkBatch(headers=ps_pb2.ChunkHeaders(items=[c.header for c in small]),
                              data=b"".join(bytes(c.data) for c in small))
    return {"chunks": _proto_chunks([c for c in chunks if c.data.nbytes >= BATCH_BELOW_BYTES]),
            "batches": [batch]}


def _padding_checked(message: bytes, message_class: type) -> bytes:
    """``message`` as protobuf writes it without padding: each TensorChunk's pad must be zeros that put its
    data at a multiple of DATA_ALIGNMENT (found by searching the message for the data's own bytes)."""
    parsed = message_class.FromString(message)
    for chunk in parsed.chunks:
        if len(chunk.data) >= BATCH_BELOW_BYTES:
            assert chunk.pad == bytes(len(chunk.pad)) and len(chunk.pad) < 2 * DATA_ALIGNMENT
        else:
            assert not chunk.pad, "a small chunk is not padded"
        chunk.ClearField("pad")
    return parsed.SerializeToString()


def _parsed_chunks(parsed) -> list[tuple]:
    """(header, data) of every chunk of a parsed PullResponse/PushRequest, batches split up."""
    out = [(c.header, c.data) for c in parsed.chunks]
    for batch in parsed.batches:
        position = 0
        for header in batch.headers.items:
            size = header.count * to_numpy_dtype(header.dtype).itemsize
            out.append((header, batch.data[position:position + size]))
            position += size
        assert position == len(batch.data)
    return out


@SETTINGS
@given(tensors(), st.integers(1, 40), st.booleans(),
       st.text(alphabet=st.characters(codec="utf-8"), max_size=20))
def test_encoding_is_byte_identical_to_protobuf(tensor, chunk_elements, with_begin, name):
    original, _ = tensor
    wire = as_wire_array(original)
    chunks = _outgoing(wire, chunk_elements, variable=name)

    ours = encode_pull_response(chunks)
    theirs = ps_pb2.PullResponse(**_proto_parts(chunks)).SerializeToString()
    assert ours == theirs
    parsed = ps_pb2.PullResponse.FromString(ours)
    assert _parsed_chunks(parsed) == [(c.header, bytes(c.data)) for c in chunks]

    begin = None
    if with_begin:
        begin = ps_pb2.PushBegin(worker_id="worker-0", incarnation="abc", sequence=2**40,
                                 shard_index=3, num_shards=4, kind=ps_pb2.ASSIGN,
                                 items=[ps_pb2.PushItem(variable=name, elements=wire.size,
                                                        wire_dtype=to_wire_dtype(wire.dtype))])
    ours = encode_push_request(begin, chunks)
    expected = ps_pb2.PushRequest(**_proto_parts(chunks))
    if begin is not None:
        expected.begin.CopyFrom(begin)
    assert ours == expected.SerializeToString()
    parsed = ps_pb2.PushRequest.FromString(ours)
    assert parsed.HasField("begin") == with_begin
    assert _parsed_chunks(parsed) == [(c.header, bytes(c.data)) for c in chunks]


_UINT64 = st.integers(0, 2**64 - 1)
_NAMES = st.text(alphabet=st.characters(codec="utf-8"), max_size=20)


@SETTINGS
@given(_NAMES, _UINT64, _UINT64, st.sampled_from(sorted(ps_pb2.DataType.values())), _UINT64, _UINT64)
def test_chunk_headers_written_by_hand_are_protobufs(name, offset, count, dtype, version, part_elements):
    ours = encode_chunk_header(name, offset, count, dtype, version, part_elements)
    assert ours == ps_pb2.ChunkHeader(variable=name, offset=offset, count=count, dtype=dtype, version=version,
                                      part_elements=part_elements).SerializeToString()


@pytest.mark.parametrize("value", [1, 127, 128, 255, 16383, 16384, 2**21 - 1, 2**21, 2**63, 2**64 - 1])
def test_chunk_header_varints_at_their_length_boundaries(value):
    ours = encode_chunk_header("v", value, value, ps_pb2.FLOAT32, value, value)
    assert ours == ps_pb2.ChunkHeader(variable="v", offset=value, count=value, dtype=ps_pb2.FLOAT32, version=value,
                                      part_elements=value).SerializeToString()


_PUSH_ITEMS = st.lists(st.tuples(_NAMES, _UINT64, st.sampled_from(sorted(ps_pb2.DataType.values())), _UINT64,
                                 st.binary(max_size=300)), max_size=5)


@SETTINGS
@given(_NAMES, _NAMES, _UINT64, st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
       st.sampled_from(sorted(ps_pb2.PushKind.values())), _PUSH_ITEMS, _UINT64,
       st.one_of(st.none(), st.builds(lambda n, s: ps_pb2.PullRequest(
           items=[ps_pb2.PullItem(variable=v) for v in n], step=s), st.lists(_NAMES, max_size=3), _UINT64)))
def test_push_begins_written_by_hand_are_protobufs(worker, incarnation, sequence, shard, shards, kind, items,
                                                  step, pull_after):
    ours = encode_push_begin(worker, incarnation, sequence, shard, shards, kind,
                             [encode_push_item(*item) for item in items], step,
                             pull_after.SerializeToString() if pull_after is not None else None)
    expected = ps_pb2.PushBegin(
        worker_id=worker, incarnation=incarnation, sequence=sequence, shard_index=shard, num_shards=shards,
        kind=kind, step=step, pull_after=pull_after,
        items=[ps_pb2.PushItem(variable=n, elements=e, wire_dtype=d, base_version=b, row_ids=r)
               for n, e, d, b, r in items])
    assert ours == expected.SerializeToString()
    # An empty pull_after is still there: the server asks HasField.
    assert ps_pb2.PushBegin.FromString(ours).HasField("pull_after") == (pull_after is not None)


@SETTINGS
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
       st.lists(st.tuples(_NAMES, st.binary(max_size=300)), max_size=5),
       st.sampled_from(sorted(ps_pb2.DataType.values())), _UINT64, _NAMES, _NAMES, _UINT64,
       st.sampled_from(sorted(ps_pb2.RowLookup.values())))
def test_pull_requests_written_by_hand_are_protobufs(shard, shards, items, wire_dtype, chunk_bytes, worker,
                                                      incarnation, step, lookup):
    ours = encode_pull_request(shard, shards, [encode_pull_item(name, ids) for name, ids in items], wire_dtype,
                               chunk_bytes, worker, incarnation, step, lookup)
    expected = ps_pb2.PullRequest(
        shard_index=shard, num_shards=shards, items=[ps_pb2.PullItem(variable=n, row_ids=r) for n, r in items],
        wire_dtype=wire_dtype, chunk_bytes=chunk_bytes, worker_id=worker, incarnation=incarnation, step=step,
        lookup=lookup)
    assert ours == expected.SerializeToString()


@SETTINGS
@given(st.dictionaries(_NAMES, _UINT64, max_size=5), st.booleans(), _UINT64, st.booleans(), _UINT64)
def test_push_responses_written_by_hand_are_protobufs(versions, duplicate, elements, dropped, cluster_step):
    ours = encode_push_response(versions, duplicate, elements, dropped, cluster_step)
    expected = ps_pb2.PushResponse(
        versions=[ps_pb2.VariableVersion(variable=k, version=v) for k, v in versions.items()],
        duplicate=duplicate, elements_applied=elements, dropped=dropped, cluster_step=cluster_step)
    assert ours == expected.SerializeToString()


@pytest.mark.parametrize("value", [1, 127, 128, 16383, 16384, 2**63, 2**64 - 1])
def test_pull_requests_and_push_responses_at_varint_length_boundaries(value):
    ids = bytes(value % 300)
    ours = encode_pull_request(value % 2**32, value % 2**32, [encode_pull_item("v", ids), encode_pull_item("w")],
                               ps_pb2.BFLOAT16, value, "w0", "i0", value)
    assert ours == ps_pb2.PullRequest(
        shard_index=value % 2**32, num_shards=value % 2**32,
        items=[ps_pb2.PullItem(variable="v", row_ids=ids), ps_pb2.PullItem(variable="w")],
        wire_dtype=ps_pb2.BFLOAT16, chunk_bytes=value, worker_id="w0", incarnation="i0", step=value,
    ).SerializeToString()
    assert encode_push_response({"v": value}, True, value, True, value) == ps_pb2.PushResponse(
        versions=[ps_pb2.VariableVersion(variable="v", version=value)], duplicate=True, elements_applied=value,
        dropped=True, cluster_step=value).SerializeToString()


def test_hand_written_headers_and_protobuf_headers_frame_alike():
    values = [as_wire_array(np.arange(n, dtype="<f4")) for n in (3, 5, BATCH_BELOW_BYTES // 4)]
    as_messages = [OutgoingChunk(ps_pb2.ChunkHeader(variable=f"v{i}", count=v.size, dtype=ps_pb2.FLOAT32),
                                 byte_view(v)) for i, v in enumerate(values)]
    as_bytes = [OutgoingChunk(encode_chunk_header(f"v{i}", 0, v.size, ps_pb2.FLOAT32), byte_view(v))
                for i, v in enumerate(values)]
    assert encode_pull_response(as_bytes) == encode_pull_response(as_messages)
    assert encode_push_request(None, as_bytes) == encode_push_request(None, as_messages)


def test_large_and_small_chunks_together_are_byte_identical_and_round_trip():
    large = as_wire_array(np.arange(BATCH_BELOW_BYTES // 4 + 3, dtype="<f4"))
    small = as_wire_array(np.arange(7, dtype="<i8"))
    chunks = (_outgoing(large, large.size, variable="large") + _outgoing(small, 3, variable="small")
              + _outgoing(large, large.size, variable="large2"))
    message = encode_pull_response(chunks)
    assert _padding_checked(message, ps_pb2.PullResponse) == ps_pb2.PullResponse(
        **_proto_parts(chunks)).SerializeToString()
    parsed = ps_pb2.PullResponse.FromString(message)
    assert len(parsed.chunks) == 2 and len(parsed.batches) == 1
    assert len(parsed.batches[0].headers.items) == 3
    decoded = decode_pull_response(message)
    # Large chunks first (field order), then the batch in the order given.
    assert [d.header.variable for d in decoded] == ["large", "large2", "small", "small", "small"]
    assert [bytes(d.data) for d in decoded] == [bytes(c.data) for c in chunks[:1] + chunks[-1:] + chunks[1:-1]]
    assert all(d.data.obj is message for d in decoded)


def test_a_single_small_chunk_is_not_batched():
    chunks = _outgoing(np.arange(5, dtype="<f4"), 5)
    parsed = ps_pb2.PullResponse.FromString(encode_pull_response(chunks))
    assert len(parsed.chunks) == 1 and not parsed.batches


def test_large_chunk_uses_multi_byte_lengths():
    # 300 KiB of data: the data and chunk lengths need 3-byte varints.
    wire = np.arange(75_000, dtype="<f4")
    chunks = _outgoing(wire, 75_000)
    ours = encode_pull_response(chunks)
    assert _padding_checked(ours, ps_pb2.PullResponse) == ps_pb2.PullResponse(
        chunks=_proto_chunks(chunks)).SerializeToString()
    (decoded,) = decode_pull_response(ours)
    np.testing.assert_array_equal(decoded.array(), wire)


# Names of any length: the header before the data grows a byte at a time.
_NAMES_FOR_ALIGNMENT = st.text(alphabet="ab", max_size=20)


@SETTINGS
@given(st.lists(st.integers(BATCH_BELOW_BYTES // 4, BATCH_BELOW_BYTES // 4 + 40), min_size=1, max_size=4),
       st.lists(st.integers(1, 9), max_size=3), st.booleans(), _NAMES_FOR_ALIGNMENT)
def test_large_chunks_data_starts_aligned_in_pushes_and_pulls(large, small, with_begin, name):
    """Whatever precedes it (a push's begin, other chunks, headers of any length), a large chunk's data
    is at a multiple of DATA_ALIGNMENT in its message, and decoding gives back every chunk unchanged."""
    chunks = [_outgoing(as_wire_array(np.arange(n, dtype="<f4")), n, variable=f"{name}{i}")[0]
              for i, n in enumerate(large)]
    chunks += [_outgoing(as_wire_array(np.arange(n, dtype="<f8")), n, variable=name)[0] for n in small]
    begin = ps_pb2.PushBegin(worker_id=name, sequence=len(name)) if with_begin else None
    for message, decoded in ((m := encode_pull_response(chunks), decode_pull_response(m)),
                             (m := encode_push_request(begin, chunks), decode_push_request(m)[1])):
        for chunk in decoded:
            if chunk.data.nbytes >= BATCH_BELOW_BYTES:
                start = np.frombuffer(chunk.data, np.uint8).ctypes.data - np.frombuffer(message, np.uint8).ctypes.data
                assert start % DATA_ALIGNMENT == 0, f"data of {chunk.header.variable!r} at byte {start}"
        assert sorted((d.header.variable, bytes(d.data)) for d in decoded) == sorted(
            (c.header.variable, bytes(c.data)) for c in chunks)


def test_large_chunks_stay_aligned_where_the_chunk_length_needs_another_varint_byte():
    """Around 2 MiB of data a TensorChunk's length crosses 2**21, where its varint grows from 3 to 4 bytes,
    and a pad can be what pushes it over: the data still starts at a multiple of DATA_ALIGNMENT, with a
    pad shorter than 2 * DATA_ALIGNMENT, and decodes unchanged."""
    values = np.arange((1 << 21) // 4, dtype="<f4")
    lengths = set()
    for elements in range(values.size - 24, values.size + 1):
        for name in ("", "a", "ab", "abc", "abcd", "abcde", "abcdef", "abcdefg"):
            (chunk,) = _outgoing(values[:elements], elements, variable=name)
            message = encode_pull_response([chunk])
            (decoded,) = decode_pull_response(message)
            start = np.frombuffer(decoded.data, np.uint8).ctypes.data - np.frombuffer(message, np.uint8).ctypes.data
            assert start % DATA_ALIGNMENT == 0, f"{elements} elements, name {name!r}: data at byte {start}"
            assert decoded.data == chunk.data
            (parsed,) = ps_pb2.PullResponse.FromString(message).chunks
            assert parsed.pad == bytes(len(parsed.pad)) and len(parsed.pad) < 2 * DATA_ALIGNMENT
            lengths.add(parsed.ByteSize())
    assert min(lengths) < 1 << 21 <= max(lengths)


def test_decoded_data_is_a_view_of_the_message():
    wire = np.arange(10, dtype="<i4")
    message = encode_pull_response(_outgoing(wire, 10))
    (chunk,) = decode_pull_response(message)
    assert isinstance(chunk.data, memoryview)
    assert chunk.data.obj is message
    values = chunk.array()
    assert not values.flags.writeable


@SETTINGS
@given(st.lists(st.builds(lambda name, offset, count, blob: (name, offset, count, blob),
                          st.text(max_size=10), st.integers(0, 2**63), st.integers(0, 2**63),
                          st.binary(max_size=300)), max_size=5))
def test_protobuf_messages_decode_with_our_decoder(specs):
    """The other direction: what protobuf serialises, we decode identically."""
    proto_chunks = [
        ps_pb2.TensorChunk(header=ps_pb2.ChunkHeader(variable=n, offset=o, count=c,
                                                     dtype=ps_pb2.UINT8),
                           data=blob)
        for n, o, c, blob in specs
    ]
    message = ps_pb2.PullResponse(chunks=proto_chunks).SerializeToString()
    decoded = decode_pull_response(message)
    assert [(d.header, bytes(d.data)) for d in decoded] == [(p.header, p.data) for p in proto_chunks]

    # The same chunks in a ChunkBatch (the headers' counts must describe the data).
    headers = [ps_pb2.ChunkHeader(variable=n, offset=o, count=len(blob), dtype=ps_pb2.UINT8)
               for n, o, _, blob in specs]
    batch = ps_pb2.ChunkBatch(headers=ps_pb2.ChunkHeaders(items=headers), data=b"".join(b for *_, b in specs))
    message = ps_pb2.PullResponse(batches=[batch, batch]).SerializeToString()
    decoded = decode_pull_response(message)
    assert [(d.header, bytes(d.data)) for d in decoded] == 2 * [(h, b) for h, (*_, b) in zip(headers, specs)]

    begin = ps_pb2.PushBegin(worker_id="x", sequence=5)
    message = ps_pb2.PushRequest(begin=begin, chunks=proto_chunks).SerializeToString()
    got_begin, decoded = decode_push_request(message)
    assert got_begin == begin
    assert [(d.header, bytes(d.data)) for d in decoded] == [(p.header, p.data) for p in proto_chunks]


# ---- malformed input --------------------------------------------------------------


@pytest.mark.parametrize("garbage", [
    b"\xff" * 11,  # varint longer than 64 bits
    b"\x0a",  # tag, then nothing
    b"\x0a\x80",  # truncated length varint
    b"\x0a\x05abc",  # length runs past the end
    b"\x00\x01",  # field number 0
    b"\x0f",  # wire type 7
    b"\x0e",  # wire type 6
    b"\x08",  # varint field with no value
    b"\x0d\x01\x02",  # fixed32 field cut short
    b"\x09\x01\x02\x03",  # fixed64 field cut short
    b"\x08\x01",  # chunks field (1) with the varint wire type
    b"\x0d\x00\x00\x00\x00",  # chunks field (1) with the fixed32 wire type
    b"\x0a\x02\x08\x01",  # chunk whose header field has the varint wire type
    b"\x0a\x02\x10\x01",  # chunk whose data field has the varint wire type
    b"\x0a\x04\x0a\x02\xff\xff",  # header that protobuf cannot parse
])
def test_garbage_pull_response_raises_codec_error(garbage):
    with pytest.raises(CodecError):
        decode_pull_response(garbage)


@pytest.mark.parametrize("garbage", [
    b"\xff" * 11,
    b"\x12",
    b"\x12\x05ab",
    b"\x08\x01",  # begin (1) with the varint wire type
    b"\x10\x01",  # chunks (2) with the varint wire type
    b"\x0a\x02\xff\xff",  # begin protobuf cannot parse
    b"\x0a\x03\x0a\x01",  # begin whose worker_id runs past the begin
    b"\x00",
])
def test_garbage_push_request_raises_codec_error(garbage):
    with pytest.raises(CodecError):
        decode_push_request(garbage)


def _batch(headers: list[ps_pb2.ChunkHeader], data: bytes) -> ps_pb2.ChunkBatch:
    return ps_pb2.ChunkBatch(headers=ps_pb2.ChunkHeaders(items=headers), data=data)


@pytest.mark.parametrize("batch, match", [
    (_batch([ps_pb2.ChunkHeader(variable="a", count=2, dtype=ps_pb2.FLOAT32)], b"\0" * 7), "headers describe"),
    (_batch([ps_pb2.ChunkHeader(variable="a", count=2, dtype=ps_pb2.FLOAT32)], b"\0" * 9), "carries 9"),
    (_batch([ps_pb2.ChunkHeader(variable="a", count=1, dtype=999)], b"\0" * 4), "'a'"),
    (_batch([ps_pb2.ChunkHeader(variable="a", count=2**62, dtype=ps_pb2.FLOAT64)], b""), "headers describe"),
    (_batch([], b"\0"), "carries 1"),
])
def test_malformed_batches_raise_codec_error(batch, match):
    for message in (ps_pb2.PullResponse(batches=[batch]), ps_pb2.PushRequest(batches=[batch])):
        decode = decode_pull_response if isinstance(message, ps_pb2.PullResponse) else decode_push_request
        with pytest.raises(CodecError, match=match):
            decode(message.SerializeToString())


@pytest.mark.parametrize("garbage", [
    b"\x12\x01\x08",  # PullResponse.batches (2): batch with a varint field, no value
    b"\x12\x02\x08\x01",  # batch whose headers field has the varint wire type
    b"\x12\x02\x10\x01",  # batch whose data field has the varint wire type
    b"\x12\x04\x0a\x02\xff\xff",  # headers protobuf cannot parse
    b"\x10\x01",  # batches with the varint wire type
])
def test_garbage_batches_raise_codec_error(garbage):
    with pytest.raises(CodecError):
        decode_pull_response(garbage)


def test_invalid_utf8_in_header_raises_codec_error():
    # header { variable: <invalid UTF-8> }: protobuf refuses it; so must we.
    header = b"\x0a\x02\xc3\x28"
    chunk = b"\x0a" + bytes([len(header)]) + header
    message = b"\x0a" + bytes([len(chunk)]) + chunk
    with pytest.raises(CodecError):
        decode_pull_response(message)


@SETTINGS
@given(st.binary(max_size=200))
def test_random_bytes_raise_only_codec_error(blob):
    for decode in (decode_pull_response, decode_push_request):
        try:
            decode(blob)
        except CodecError:
            pass


def _outer_boundaries(message: bytes) -> set[int]:
    """Offsets where a top-level field of ``message`` ends (plus 0)."""
    msg = ps_pb2.PushRequest.FromString(message)
    ends, pos = {0}, 0
    parts = []
    if msg.HasField("begin"):
        parts.append(ps_pb2.PushRequest(begin=msg.begin).SerializeToString())
    parts += [ps_pb2.PushRequest(chunks=[c]).SerializeToString() for c in msg.chunks]
    parts += [ps_pb2.PushRequest(batches=[b]).SerializeToString() for b in msg.batches]
    for part in parts:
        pos += len(part)
        ends.add(pos)
    assert pos == len(message)
    return ends


@pytest.mark.parametrize("with_begin", [False, True])
def test_truncated_messages_raise_codec_error(with_begin):
    wire = np.arange(40, dtype="<f8")
    chunks = _outgoing(wire, 9)
    begin = ps_pb2.PushBegin(worker_id="w", incarnation="i", sequence=1) if with_begin else None
    message = encode_push_request(begin, chunks)
    boundaries = _outer_boundaries(message)
    for cut in range(len(message)):
        truncated = message[:cut]
        if cut in boundaries:
            # A prefix made of whole fields is itself a valid, shorter message.
            got_begin, got = decode_push_request(truncated)
            assert len(got) <= len(chunks)
        else:
            with pytest.raises(CodecError):
                decode_push_request(truncated)
    # One ChunkBatch: any cut inside it breaks it.
    pull = encode_pull_response(chunks)
    assert len(ps_pb2.PullResponse.FromString(pull).batches) == 1
    assert decode_pull_response(pull[:0]) == []
    for cut in range(1, len(pull)):
        with pytest.raises(CodecError):
            decode_pull_response(pull[:cut])


@pytest.mark.parametrize("dtype", [ps_pb2.FLOAT32, ps_pb2.FLOAT64, ps_pb2.BFLOAT16, ps_pb2.INT8])
@pytest.mark.parametrize("delta", [-1, 1, 4])
def test_chunk_with_wrong_byte_length_raises_codec_error(dtype, delta):
    itemsize = to_numpy_dtype(dtype).itemsize
    count = 5
    data = b"\x01" * (count * itemsize + delta)
    message = ps_pb2.PullResponse(chunks=[ps_pb2.TensorChunk(
        header=ps_pb2.ChunkHeader(variable="v", count=count, dtype=dtype), data=data)]
    ).SerializeToString()
    (chunk,) = decode_pull_response(message)
    with pytest.raises(CodecError, match=str(count * itemsize)):
        chunk.array()


def test_chunk_with_unknown_dtype_raises_codec_error():
    with pytest.raises(CodecError):
        chunk_view(memoryview(b"\x00" * 4), 0, 1)  # DATA_TYPE_UNSPECIFIED
    with pytest.raises(CodecError):
        chunk_view(memoryview(b"\x00" * 4), 99, 1)


def test_chunk_view_of_exact_size():
    values = np.array([1, -2, 3], dtype="<i2")
    view = chunk_view(memoryview(values.tobytes()), ps_pb2.INT16, 3)
    np.testing.assert_array_equal(view, values)
    assert chunk_view(memoryview(b""), ps_pb2.FLOAT32, 0).size == 0


def test_chunk_without_header_or_data():
    # An empty TensorChunk is valid protobuf: default header, no data.
    (chunk,) = decode_pull_response(b"\x0a\x00")
    assert chunk.header == ps_pb2.ChunkHeader()
    assert chunk.data.nbytes == 0


# ---- unknown fields ---------------------------------------------------------------


_UNKNOWN_FIELDS = (
    b"\x48\x96\x01"  # field 9, varint 150
    + b"\x51" + b"\x01" * 8  # field 10, fixed64
    + b"\x5d" + b"\x02" * 4  # field 11, fixed32
    + b"\x62\x03xyz"  # field 12, length-delimited
)


def test_unknown_fields_are_skipped():
    wire = np.array([1.0, 2.0, 3.0, 4.0], dtype="<f4")
    (chunk,) = _outgoing(wire, 4)
    header = chunk.header.SerializeToString()
    data = bytes(chunk.data)
    # A TensorChunk with unknown fields before, between and after its own.
    inner = (_UNKNOWN_FIELDS + b"\x0a" + bytes([len(header)]) + header + _UNKNOWN_FIELDS
             + b"\x12" + bytes([len(data)]) + data + _UNKNOWN_FIELDS)
    framed = b"\x0a" + bytes([len(inner)]) + inner
    pull = _UNKNOWN_FIELDS + framed + _UNKNOWN_FIELDS + framed
    decoded = decode_pull_response(pull)
    assert len(decoded) == 2
    for d in decoded:
        assert d.header == chunk.header
        np.testing.assert_array_equal(d.array(), wire)
    # protobuf agrees that this is a valid PullResponse with the same content.
    parsed = ps_pb2.PullResponse.FromString(pull)
    assert [c.data for c in parsed.chunks] == [data, data]

    begin = ps_pb2.PushBegin(worker_id="w", sequence=9).SerializeToString()
    push = (_UNKNOWN_FIELDS + b"\x0a" + bytes([len(begin)]) + begin + _UNKNOWN_FIELDS
            + b"\x12" + bytes([len(inner)]) + inner)
    got_begin, decoded = decode_push_request(push)
    assert got_begin.worker_id == "w" and got_begin.sequence == 9
    (d,) = decoded
    np.testing.assert_array_equal(d.array(), wire)


# ---- dtype mapping ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(_DTYPES))
def test_dtype_mapping_both_byte_orders(name):
    dtype = _DTYPES[name]
    wire = to_wire_dtype(dtype)
    assert wire == _EXPECTED_WIRE[name]
    assert to_numpy_dtype(wire) == dtype
    if dtype.itemsize > 1 and dtype != BFLOAT16:
        assert to_wire_dtype(dtype.newbyteorder(">")) == wire
        assert to_wire_dtype(dtype.newbyteorder("=")) == wire


def test_unsupported_dtypes_are_refused():
    for bad in (np.complex64, np.dtype("U3"), np.dtype("O"), np.dtype("M8[s]")):
        with pytest.raises(ValueError):
            to_wire_dtype(bad)
    with pytest.raises(ValueError):
        to_numpy_dtype(ps_pb2.DATA_TYPE_UNSPECIFIED)


def test_repeated_singular_message_fields_merge_like_protobuf():
    h1 = ps_pb2.ChunkHeader(variable="a", offset=3).SerializeToString()
    h2 = ps_pb2.ChunkHeader(count=2, dtype=ps_pb2.UINT8).SerializeToString()
    data = b"\x01\x02"
    inner = (b"\x0a" + bytes([len(h1)]) + h1 + b"\x0a" + bytes([len(h2)]) + h2
             + b"\x12" + bytes([len(data)]) + data)
    message = b"\x0a" + bytes([len(inner)]) + inner
    expected = ps_pb2.PullResponse.FromString(message).chunks[0].header
    assert expected.variable == "a" and expected.count == 2
    (chunk,) = decode_pull_response(message)
    assert chunk.header == expected


@settings(max_examples=200, deadline=None)
@given(request_id=st.integers(0, 2**64 - 1), kind=st.sampled_from(["pull", "push", "error"]),
       payload_size=st.integers(0, 70_000), extra_field=st.booleans())
def test_exchange_envelopes_decode_as_protobuf_reads_them(request_id, kind, payload_size, extra_field):
    """Our envelopes (read by the direct path) and protobuf's own, also with fields we do not know."""
    if kind == "pull":
        inner = ps_pb2.PullRequest(worker_id="w" * (payload_size % 300), chunk_bytes=payload_size)
        message = ps_pb2.ExchangeRequest(id=request_id, pull=inner)
    elif kind == "push":
        inner = ps_pb2.PushRequest(begin=ps_pb2.PushBegin(worker_id="w", items=[
            ps_pb2.PushItem(variable="v", row_ids=bytes(payload_size))]))
        message = ps_pb2.ExchangeRequest(id=request_id, push=inner)
    else:
        inner = ps_pb2.ExchangeError(code=5, message="m" * payload_size)
        message = ps_pb2.ExchangeResponse(id=request_id, error=inner)
    field = {"pull": EXCHANGE_PULL, "push": EXCHANGE_PUSH, "error": EXCHANGE_ERROR}[kind]
    body = inner.SerializeToString()
    ours = encode_envelope(request_id, field, body)
    if request_id:  # (protobuf leaves out an id of 0; we write it, which protobuf reads the same)
        assert ours == message.SerializeToString()
    for encoded in (ours, message.SerializeToString()):
        if extra_field:  # a newer peer's field after the payload: the general path reads it
            encoded += b"\x78\x01"  # field 15, varint 1
        decoded_id, decoded_field, payload = decode_envelope(encoded)
        assert (decoded_id, decoded_field, bytes(payload)) == (request_id, field, body)
