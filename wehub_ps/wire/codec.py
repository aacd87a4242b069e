"""Framing of the data-path messages without copying tensor bytes.

``PullResponse`` and ``PushRequest`` carry ``TensorChunk`` messages whose
``data`` field is up to a chunk of raw tensor bytes. Serialising them through
protobuf objects would copy every byte two or three times (``tobytes()``,
field assignment, ``SerializeToString``). Here the small headers go through
protobuf and the bulk bytes are spliced in by hand:

* encoding joins ``[tag, length, header, tag, length, <tensor memoryview>]``
  once, so each tensor byte is copied exactly once into the message;
* a payload that must be gathered first (rows of a table in another
  order, :class:`RowGather`) is gathered straight into the message when
  it is joined (:func:`join_pieces`), so that is its one copy too;
* decoding returns ``memoryview`` slices of the received message, so the
  receiver copies each byte once, straight into its destination array;
* the small headers that are written for every variable of every step
  (``ChunkHeader``, ``PushItem``, ``PushBegin``) are written as bytes here
  rather than built as protobuf objects and serialised: a step of a model
  in many variables spent more time building and copying those objects
  than in the rest of its framing;
* chunks under :data:`BATCH_BELOW_BYTES` travel together as one
  ``ChunkBatch`` (one protobuf parse for all headers, one bytes field), because
  framing a chunk in Python costs more than copying a few KiB: a step of
  a model with many small variables spent 40% of the worker's time here.

The output is ordinary protobuf (a test compares it with
``SerializeToString``), so any protobuf client can speak the protocol.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from wehub_ps.wire.dtypes import to_numpy_dtype
from wehub_ps.wire.fresh_bytes import filled_bytes
from wehub_ps.kernels.rowops import take_rows, take_rows_into
from wehub_ps.v1 import ps_pb2

__all__ = [
    "CodecError",
    "TooManyChunks",
    "DecodedChunk",
    "OutgoingChunk",
    "RowGather",
    "join_pieces",
    "piece_size",
    "encode_pull_response",
    "encode_push_request",
    "pull_response_pieces",
    "push_request_pieces",
    "push_response_pieces",
    "split_push_response",
    "decode_pull_response",
    "decode_push_request",
    "as_wire_array",
    "chunk_view",
    "chunk_ranges",
    "byte_view",
    "encode_envelope",
    "decode_envelope",
    "encode_chunk_header",
    "encode_push_item",
    "encode_push_begin",
    "encode_pull_item",
    "encode_pull_request",
    "encode_push_response",
]

_WIRE_VARINT = 0
_WIRE_FIXED64 = 1
_WIRE_LEN = 2
_WIRE_FIXED32 = 5

# Field numbers from protos/wehub_ps/v1/ps.proto.
# TensorChunk and ChunkBatch share a layout: field 1 its header(s), field 2 the bytes.
_FRAMED_HEADER = 1
_FRAMED_DATA = 2
_PULL_RESPONSE_CHUNKS = 1
_PULL_RESPONSE_BATCHES = 2
_PUSH_REQUEST_BEGIN = 1
_PUSH_REQUEST_CHUNKS = 2
_PUSH_REQUEST_BATCHES = 3
_PUSH_RESPONSE_PULLED = 6

#: Chunks smaller than this are sent in a ChunkBatch when there are two or more.
BATCH_BELOW_BYTES = 64 * 1024


class CodecError(ValueError):
    """The bytes are not a valid message of the expected type."""


class TooManyChunks(CodecError):
    """A message carries more chunks than the reader accepts (decoding stopped there)."""


@dataclass(frozen=True, slots=True)
class RowGather:
    """Rows ``rows`` of the C-contiguous 2-D ``source``, to be gathered into a message as it is joined.

    ``rows`` must all be valid row indices of ``source`` (the caller made
    them: they are not checked again). ``lock``, when given, is held while
    the rows are read (a table that others update).
    """

    source: np.ndarray
    rows: np.ndarray
    lock: AbstractContextManager | None = None

    @property
    def size(self) -> int:
        """Elements."""
        return len(self.rows) * self.source.shape[1]

    @property
    def nbytes(self) -> int:
        return self.size * self.source.itemsize

    @property
    def dtype(self) -> np.dtype:
        return self.source.dtype

    def select(self, positions: slice | np.ndarray) -> RowGather:
        """The gather of ``self.rows[positions]``."""
        return RowGather(self.source, self.rows[positions], self.lock)

    def gather(self) -> np.ndarray:
        """The rows as a new 2-D array."""
        with self.lock or nullcontext():
            return take_rows(self.source, self.rows)

    def write_into(self, dest: np.ndarray) -> None:
        """Gather the rows into ``dest``, ``nbytes`` bytes of uint8 at any alignment."""
        with self.lock or nullcontext():
            take_rows_into(dest, self.source, self.rows)


@dataclass(frozen=True, slots=True)
class OutgoingChunk:
    """A chunk to send: its header and its little-endian bytes (or rows to gather into the message).

    The header is a serialised ChunkHeader (:func:`encode_chunk_header`, the
    hot paths) or the message itself.
    """

    header: bytes | ps_pb2.ChunkHeader
    data: memoryview | RowGather


def _header_bytes(header: bytes | ps_pb2.ChunkHeader) -> bytes:
    return header if type(header) is bytes else header.SerializeToString()


def piece_size(piece: bytes | memoryview | RowGather) -> int:
    """Bytes a piece of a message takes."""
    kind = type(piece)
    return piece.nbytes if kind is memoryview or kind is RowGather else len(piece)


def join_pieces(pieces: list) -> bytes:
    """The message made of ``pieces`` (bytes, memoryviews and RowGathers), each byte copied once."""
    if not any(type(p) is RowGather for p in pieces):
        return b"".join(pieces)
    sizes = [piece_size(p) for p in pieces]

    def fill(contents: np.ndarray) -> None:
        writable = memoryview(contents)
        position = 0
        for piece, size in zip(pieces, sizes):
            end = position + size
            if type(piece) is RowGather:
                piece.write_into(contents[position:end])
            else:
                writable[position:end] = piece
            position = end

    return filled_bytes(sum(sizes), fill)


@dataclass(frozen=True, slots=True)
class DecodedChunk:
    """A received chunk; ``data`` is a view into the received message."""

    header: ps_pb2.ChunkHeader
    data: memoryview

    def array(self) -> np.ndarray:
        """The payload as a read-only array of the header's dtype (no copy)."""
        return chunk_view(self.data, self.header.dtype, self.header.count)


_SMALL_VARINTS = [bytes([i]) for i in range(128)]


def _varint(value: int) -> bytes:
    if value < 128:
        return _SMALL_VARINTS[value]
    if value < 16384:  # sizes of small variables, versions: two bytes, written at once
        return bytes((value & 0x7F | 0x80, value >> 7))
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


_TAG_CHUNK_HEADER = _tag(_FRAMED_HEADER, _WIRE_LEN)
_TAG_CHUNK_DATA = _tag(_FRAMED_DATA, _WIRE_LEN)
_TAG_PULL_CHUNKS = _tag(_PULL_RESPONSE_CHUNKS, _WIRE_LEN)
_TAG_PUSH_BEGIN = _tag(_PUSH_REQUEST_BEGIN, _WIRE_LEN)
_TAG_PUSH_CHUNKS = _tag(_PUSH_REQUEST_CHUNKS, _WIRE_LEN)
_TAG_PULL_BATCHES = _tag(_PULL_RESPONSE_BATCHES, _WIRE_LEN)
_TAG_PUSH_BATCHES = _tag(_PUSH_REQUEST_BATCHES, _WIRE_LEN)
_TAG_PUSH_RESPONSE_PULLED = _tag(_PUSH_RESPONSE_PULLED, _WIRE_LEN)
# ChunkHeaders.items, PushBegin.items and PushBegin.pull_after.
_TAG_HEADERS_ITEM = _tag(1, _WIRE_LEN)
_TAG_BEGIN_ITEM = _tag(7, _WIRE_LEN)
_TAG_BEGIN_PULL_AFTER = _tag(9, _WIRE_LEN)
_TAG_ITEM_ROW_IDS = _tag(5, _WIRE_LEN)
# One-byte tags of the varint fields 2-8 (ChunkHeader, PushItem, PushBegin).
_VARINT_TAGS = [_tag(n, _WIRE_VARINT) for n in range(16)]


@lru_cache(maxsize=1 << 16)
def _string_field(field: int, text: str) -> bytes:
    """A string field as written (empty when ``text`` is, as proto3 omits it); cached: names repeat every step."""
    encoded = text.encode()
    return _tag(field, _WIRE_LEN) + _varint(len(encoded)) + encoded if encoded else b""


def _varint_field(field: int, value: int) -> bytes:
    """A uint64 / uint32 / enum field (fields 1-15); proto3 omits zero."""
    return _VARINT_TAGS[field] + _varint(value) if value else b""


@lru_cache(maxsize=1 << 14)
def _chunk_header_head(variable: str, offset: int, count: int, dtype: int) -> bytes:
    """Fields 1-4 of a ChunkHeader; cached: a step sends each variable's chunks alike every time."""
    out = _string_field(1, variable)
    if offset:
        out += _VARINT_TAGS[2] + _varint(offset)
    if count:
        out += _VARINT_TAGS[3] + _varint(count)
    if dtype:
        out += _VARINT_TAGS[4] + _varint(dtype)
    return out


@lru_cache(maxsize=1 << 14)
def _unversioned_chunk_header(variable: str, offset: int, count: int, dtype: int, part_elements: int) -> bytes:
    """A whole ChunkHeader without a version (a worker's pushed chunks); cached like the head."""
    out = _chunk_header_head(variable, offset, count, dtype)
    return out + _VARINT_TAGS[6] + _varint(part_elements) if part_elements else out


def encode_chunk_header(variable: str, offset: int, count: int, dtype: int, version: int = 0,
                        part_elements: int = 0) -> bytes:
    """``ChunkHeader(...).SerializeToString()``, without building the message."""
    if not version:
        return _unversioned_chunk_header(variable, offset, count, dtype, part_elements)
    out = _chunk_header_head(variable, offset, count, dtype) + _VARINT_TAGS[5] + _varint(version)
    if part_elements:
        out += _VARINT_TAGS[6] + _varint(part_elements)
    return out


@lru_cache(maxsize=1 << 16)
def _push_item_head(variable: str, elements: int, wire_dtype: int) -> bytes:
    return _string_field(1, variable) + _varint_field(2, elements) + _varint_field(3, wire_dtype)


def encode_push_item(variable: str, elements: int, wire_dtype: int, base_version: int = 0,
                     row_ids: bytes = b"") -> bytes:
    """``PushItem(...).SerializeToString()``; the fields that repeat every step are cached."""
    out = _push_item_head(variable, elements, wire_dtype)
    if base_version:
        out += _VARINT_TAGS[4] + _varint(base_version)
    if row_ids:
        out += b"".join((_TAG_ITEM_ROW_IDS, _varint(len(row_ids)), row_ids))
    return out


def encode_push_begin(worker_id: str, incarnation: str, sequence: int, shard_index: int, num_shards: int,
                      kind: int, items: Sequence[bytes], step: int = 0, pull_after: bytes | None = None,
                      continued: bool = False) -> bytes:
    """``PushBegin(...).SerializeToString()`` with ``items`` already serialised (:func:`encode_push_item`).

    ``pull_after``: a serialised PullRequest, written even when empty (the
    server tells "no values asked for" from "asked for nothing" by its presence).
    ``continued``: the next message's begin continues this one (PushBegin.continued).
    """
    pieces = [_string_field(1, worker_id), _string_field(2, incarnation), _varint_field(3, sequence),
              _varint_field(4, shard_index), _varint_field(5, num_shards), _varint_field(6, kind)]
    for item in items:
        pieces += (_TAG_BEGIN_ITEM, _varint(len(item)), item)
    pieces.append(_varint_field(8, step))
    if pull_after is not None:
        pieces += (_TAG_BEGIN_PULL_AFTER, _varint(len(pull_after)), pull_after)
    if continued:
        pieces.append(_varint_field(10, 1))
    return b"".join(pieces)


_TAG_PULL_REQUEST_ITEM = _tag(3, _WIRE_LEN)
_TAG_PULL_ITEM_ROW_IDS = _tag(4, _WIRE_LEN)


@lru_cache(maxsize=1 << 16)
def _pull_item_of_whole(variable: str) -> bytes:
    """A PullRequest.items entry for a whole part, framed; cached: a step pulls the same names each time."""
    item = _string_field(1, variable)
    return _TAG_PULL_REQUEST_ITEM + _varint(len(item)) + item


def encode_pull_item(variable: str, row_ids: bytes = b"") -> bytes:
    """A ``PullItem`` (a whole part, or ``row_ids``) as it is framed in :func:`encode_pull_request`."""
    if not row_ids:
        return _pull_item_of_whole(variable)
    item = b"".join((_string_field(1, variable), _TAG_PULL_ITEM_ROW_IDS, _varint(len(row_ids)), row_ids))
    return b"".join((_TAG_PULL_REQUEST_ITEM, _varint(len(item)), item))


def encode_pull_request(shard_index: int, num_shards: int, items: Sequence[bytes], wire_dtype: int = 0,
                        chunk_bytes: int = 0, worker_id: str = "", incarnation: str = "",
                        step: int = 0) -> bytes:
    """``PullRequest(...).SerializeToString()`` with ``items`` from :func:`encode_pull_item`."""
    return b"".join((_varint_field(1, shard_index), _varint_field(2, num_shards), *items,
                     _varint_field(4, wire_dtype), _varint_field(5, chunk_bytes), _string_field(6, worker_id),
                     _string_field(7, incarnation), _varint_field(8, step)))


_TAG_PUSH_RESPONSE_VERSION = _tag(1, _WIRE_LEN)


def encode_push_response(versions: dict[str, int], duplicate: bool = False, elements_applied: int = 0,
                         dropped: bool = False, cluster_step: int = 0) -> bytes:
    """``PushResponse(...).SerializeToString()`` (without ``pulled``: see push_response_pieces)."""
    pieces = []
    for variable, version in versions.items():
        entry = _string_field(1, variable) + _varint_field(2, version)
        pieces += (_TAG_PUSH_RESPONSE_VERSION, _varint(len(entry)), entry)
    pieces += (_varint_field(2, int(duplicate)), _varint_field(3, elements_applied),
               _varint_field(4, int(dropped)), _varint_field(5, cluster_step))
    return b"".join(pieces)


def _append_chunks(pieces: list, chunk_tag: bytes, batch_tag: bytes, chunks: Sequence[OutgoingChunk]) -> None:
    """TensorChunks for the large chunks, then one ChunkBatch for the small ones (field order)."""
    small = [c for c in chunks if c.data.nbytes < BATCH_BELOW_BYTES]
    if len(small) < 2:
        small = []
    for chunk in [c for c in chunks if c.data.nbytes >= BATCH_BELOW_BYTES] if small else chunks:
        _append_framed(pieces, chunk_tag, _header_bytes(chunk.header), [chunk.data])
    if small:
        headers = []
        for c in small:
            header = _header_bytes(c.header)
            headers += (_TAG_HEADERS_ITEM, _varint(len(header)), header)
        _append_framed(pieces, batch_tag, b"".join(headers), [c.data for c in small])


def _append_framed(pieces: list, outer_tag: bytes, header: bytes, data: list[memoryview]) -> None:
    """One TensorChunk or ChunkBatch: its framing and header(s) as one piece, then ``data``, not copied yet.

    Few pieces keep joining cheap: a message is a handful of pieces, not
    one per tag and length (the per-piece Python work showed in profiles).
    """
    data_len = sum(d.nbytes for d in data)
    # proto3 omits an empty bytes field; do the same so that the encoding
    # is byte-identical to protobuf's own.
    inner = _TAG_CHUNK_HEADER + _varint(len(header)) + header
    if data_len:
        inner += _TAG_CHUNK_DATA + _varint(data_len)
    pieces.append(outer_tag + _varint(len(inner) + data_len) + inner)
    if data_len:
        pieces += [d for d in data if d.nbytes]


def pull_response_pieces(chunks: Sequence[OutgoingChunk]) -> list:
    """A ``PullResponse`` as pieces whose concatenation is the message.

    The tensor bytes are not copied yet: joining the pieces (alone, or
    inside an exchange envelope) is their one copy.
    """
    pieces: list = []
    _append_chunks(pieces, _TAG_PULL_CHUNKS, _TAG_PULL_BATCHES, chunks)
    return pieces


def push_request_pieces(begin: ps_pb2.PushBegin | bytes | None, chunks: Sequence[OutgoingChunk]) -> list:
    """A ``PushRequest`` as pieces whose concatenation is the message (see pull_response_pieces).

    ``begin``: the message, or its serialisation (:func:`encode_push_begin`).
    """
    pieces: list = []
    if begin is not None:
        body = begin if type(begin) is bytes else begin.SerializeToString()
        pieces.append(_TAG_PUSH_BEGIN + _varint(len(body)) + body)
    _append_chunks(pieces, _TAG_PUSH_CHUNKS, _TAG_PUSH_BATCHES, chunks)
    return pieces


def push_response_pieces(response: bytes, pulled: list | None) -> list:
    """A serialised ``PushResponse`` with the pieces of a PullResponse as its ``pulled`` field."""
    if pulled is None:
        return [response]
    return [response + _TAG_PUSH_RESPONSE_PULLED + _varint(sum(piece_size(p) for p in pulled)), *pulled]


def split_push_response(message: bytes | memoryview) -> tuple[ps_pb2.PushResponse, list[DecodedChunk] | None]:
    """A ``PushResponse`` without its ``pulled`` field, and the pulled chunks (views of ``message``).

    None for the chunks when the response has no ``pulled`` field (the
    push did not ask for values, or a server that predates pull_after).
    """
    buf = memoryview(message)
    kept, pulled, previous = [], None, 0
    for field, wire_type, start, stop in _iter_fields(buf, 0, len(buf)):
        if field == _PUSH_RESPONSE_PULLED:
            if wire_type != _WIRE_LEN:
                raise CodecError("PushResponse.pulled has the wrong wire type")
            pulled = (pulled or []) + decode_pull_response(buf[start:stop])
        else:
            kept.append(buf[previous:stop])
        previous = stop
    return _merge(ps_pb2.PushResponse(), b"".join(kept)), pulled


def encode_pull_response(chunks: Sequence[OutgoingChunk]) -> bytes:
    """Serialise a ``PullResponse``; copies each tensor byte once."""
    return join_pieces(pull_response_pieces(chunks))


def encode_push_request(
    begin: ps_pb2.PushBegin | bytes | None, chunks: Sequence[OutgoingChunk]
) -> bytes:
    """Serialise a ``PushRequest``; copies each tensor byte once."""
    return join_pieces(push_request_pieces(begin, chunks))


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise CodecError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 64:
            raise CodecError("varint longer than 64 bits")


def _iter_fields(buf: memoryview, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """Yield (field, wire_type, start, stop) of each field; stop is exclusive.

    For varints start/stop delimit the encoded value. Unknown fields are
    yielded too, so callers can skip them (forward compatibility).
    """
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        field, wire_type = key >> 3, key & 7
        if field == 0:
            raise CodecError("field number 0")
        if wire_type == _WIRE_VARINT:
            start = pos
            _, pos = _read_varint(buf, pos, end)
        elif wire_type == _WIRE_LEN:
            length, start = _read_varint(buf, pos, end)
            pos = start + length
        elif wire_type == _WIRE_FIXED64:
            start, pos = pos, pos + 8
        elif wire_type == _WIRE_FIXED32:
            start, pos = pos, pos + 4
        else:
            raise CodecError(f"unsupported wire type {wire_type}")
        if pos > end:
            raise CodecError("field runs past the end of the message")
        yield field, wire_type, start, pos


def _merge(message, buf: memoryview):
    """Merge one occurrence of a message field, as protobuf does for repeats."""
    try:
        message.MergeFromString(buf)
    except Exception as exc:  # protobuf raises DecodeError, upb sometimes others
        raise CodecError(f"invalid {message.DESCRIPTOR.name}: {exc}") from exc
    return message


def _header_and_data(buf: memoryview, start: int, stop: int, header, names: tuple[str, str]) -> memoryview:
    """A TensorChunk or ChunkBatch: field 1 merged into ``header``, field 2 (bytes) returned as a view."""
    data = buf[0:0]
    for field, wire_type, fstart, fstop in _iter_fields(buf, start, stop):
        if field in (_FRAMED_HEADER, _FRAMED_DATA) and wire_type != _WIRE_LEN:
            raise CodecError(f"{names[field - 1]} has the wrong wire type")
        if field == _FRAMED_HEADER:
            _merge(header, buf[fstart:fstop])
        elif field == _FRAMED_DATA:
            data = buf[fstart:fstop]
    return data


def _decode_chunk(buf: memoryview, start: int, stop: int) -> DecodedChunk:
    header = ps_pb2.ChunkHeader()
    data = _header_and_data(buf, start, stop, header, ("TensorChunk.header", "TensorChunk.data"))
    return DecodedChunk(header, data)


def _decode_batch(buf: memoryview, start: int, stop: int, chunks: list[DecodedChunk],
                  max_chunks: int = 0) -> None:
    """Append the chunks of one ChunkBatch, each a view of its slice of the data."""
    headers = ps_pb2.ChunkHeaders()
    data = _header_and_data(buf, start, stop, headers, ("ChunkBatch.headers", "ChunkBatch.data"))
    if max_chunks and len(chunks) + len(headers.items) > max_chunks:
        raise TooManyChunks(f"more than {max_chunks} chunks in one message")
    position = 0
    for header in headers.items:
        try:
            itemsize = to_numpy_dtype(header.dtype).itemsize
        except ValueError as exc:
            raise CodecError(f"chunk for {header.variable!r}: {exc}") from None
        end = position + header.count * itemsize
        if end > data.nbytes:
            raise CodecError(f"ChunkBatch headers describe more than its {data.nbytes} data bytes")
        chunks.append(DecodedChunk(header, data[position:end]))
        position = end
    if position != data.nbytes:
        raise CodecError(f"ChunkBatch carries {data.nbytes} data bytes, but its headers describe {position}")


def decode_pull_response(message: bytes) -> list[DecodedChunk]:
    """Parse a serialised ``PullResponse``; chunk data are views of ``message``."""
    buf = memoryview(message)
    chunks: list[DecodedChunk] = []
    for field, wire_type, start, stop in _iter_fields(buf, 0, len(buf)):
        if field in (_PULL_RESPONSE_CHUNKS, _PULL_RESPONSE_BATCHES) and wire_type != _WIRE_LEN:
            raise CodecError(f"PullResponse field {field} has the wrong wire type")
        if field == _PULL_RESPONSE_CHUNKS:
            chunks.append(_decode_chunk(buf, start, stop))
        elif field == _PULL_RESPONSE_BATCHES:
            _decode_batch(buf, start, stop, chunks)
    return chunks


def decode_push_request(
    message: bytes, max_chunks: int = 0,
) -> tuple[ps_pb2.PushBegin | None, list[DecodedChunk]]:
    """Parse a serialised ``PushRequest``; chunk data are views of ``message``.

    ``max_chunks`` (0: any number): raise :class:`TooManyChunks` as soon as
    more are found, before their headers are decoded (a decoded chunk costs
    about 1 KiB, so a message of tiny chunks would cost far more than its size).
    """
    buf = memoryview(message)
    begin = None
    chunks: list[DecodedChunk] = []
    for field, wire_type, start, stop in _iter_fields(buf, 0, len(buf)):
        if wire_type != _WIRE_LEN and field in (_PUSH_REQUEST_BEGIN, _PUSH_REQUEST_CHUNKS, _PUSH_REQUEST_BATCHES):
            raise CodecError(f"PushRequest field {field} has the wrong wire type")
        if field == _PUSH_REQUEST_BEGIN:
            begin = _merge(begin if begin is not None else ps_pb2.PushBegin(), buf[start:stop])
        elif field == _PUSH_REQUEST_CHUNKS:
            if max_chunks and len(chunks) >= max_chunks:
                raise TooManyChunks(f"more than {max_chunks} chunks in one message")
            chunks.append(_decode_chunk(buf, start, stop))
        elif field == _PUSH_REQUEST_BATCHES:
            _decode_batch(buf, start, stop, chunks, max_chunks)
    return begin, chunks


# ExchangeRequest / ExchangeResponse: id = 1, then one of the payload fields.
EXCHANGE_PULL = 2
EXCHANGE_PUSH = 3
EXCHANGE_ERROR = 4
_TAG_ENVELOPE_ID = _tag(1, _WIRE_VARINT)


def encode_envelope(request_id: int, field: int, payload: bytes | memoryview | list) -> bytes:
    """An ExchangeRequest/ExchangeResponse around an already serialised payload.

    ``payload`` may be a list of pieces (of one or several concatenated
    messages of the payload type, see push_request_pieces): they are joined
    once, with the envelope, so tensor bytes are copied once here too.
    """
    pieces = payload if isinstance(payload, list) else [payload]
    size = sum(piece_size(p) for p in pieces)
    head = _TAG_ENVELOPE_ID + _varint(request_id) + _tag(field, _WIRE_LEN) + _varint(size)
    return join_pieces([head, *pieces])


def decode_envelope(message: bytes) -> tuple[int, int, memoryview]:
    """(id, payload field, payload view) of an ExchangeRequest/ExchangeResponse."""
    buf = memoryview(message)
    end = len(buf)
    # encode_envelope's layout (the id, then the payload, nothing else) read
    # directly: a few lookups instead of the general field loop below.
    if end and buf[0] == _TAG_ENVELOPE_ID[0]:
        request_id, position = _read_varint(buf, 1, end)
        if position < end:
            key = buf[position]  # a one-byte tag: fields 2-4, length-delimited
            if key & 7 == _WIRE_LEN and key >> 3 in (EXCHANGE_PULL, EXCHANGE_PUSH, EXCHANGE_ERROR):
                length, start = _read_varint(buf, position + 1, end)
                if start + length == end:
                    return request_id, key >> 3, buf[start:end]
    request_id, field, payload = 0, 0, buf[0:0]
    for number, wire_type, start, stop in _iter_fields(buf, 0, len(buf)):
        if number == 1 and wire_type == _WIRE_VARINT:
            request_id, _ = _read_varint(buf, start, stop)
        elif number in (EXCHANGE_PULL, EXCHANGE_PUSH, EXCHANGE_ERROR) and wire_type == _WIRE_LEN:
            field, payload = number, buf[start:stop]
    if not field:
        raise CodecError("exchange message carries no payload")
    return request_id, field, payload


_LITTLE_ENDIAN_HOST = sys.byteorder == "little"


def as_wire_array(array: np.ndarray, wire_dtype: np.dtype | None = None) -> np.ndarray:
    """A flat, C-contiguous, little-endian array ready to be viewed as bytes.

    No copy when the input already is one (the common case); a converted copy
    otherwise (non-contiguous, big-endian, or a narrower ``wire_dtype``).
    """
    if wire_dtype is None and _LITTLE_ENDIAN_HOST and array.dtype.isnative and array.flags.c_contiguous:
        return array.reshape(-1)  # the common case, decided in a few attribute reads
    target = np.dtype(wire_dtype) if wire_dtype is not None else array.dtype
    if target.byteorder == ">" or (target.byteorder == "=" and target.itemsize > 1):
        target = target.newbyteorder("<")
    flat = array.reshape(-1) if array.flags.c_contiguous else np.ravel(array, order="C")
    if flat.dtype != target:
        flat = flat.astype(target)
    return np.ascontiguousarray(flat)


def chunk_view(data: memoryview, wire_dtype: int, count: int) -> np.ndarray:
    """View ``count`` elements of a wire dtype in ``data``; CodecError on size mismatch."""
    try:
        dtype = to_numpy_dtype(wire_dtype)
    except ValueError as exc:
        raise CodecError(str(exc)) from None
    if data.nbytes != count * dtype.itemsize:
        raise CodecError(
            f"chunk carries {data.nbytes} bytes, but {count} elements of "
            f"{dtype.name} need {count * dtype.itemsize}"
        )
    return np.frombuffer(data, dtype=dtype, count=count)


def chunk_ranges(total: int, chunk_elements: int) -> list[tuple[int, int]]:
    """(offset, count) covering ``total`` elements; one empty range when total is 0.

    A list, not a generator: most variables of a step are one chunk, and
    resuming a generator cost more than the list of one range.
    """
    if chunk_elements <= 0:
        raise ValueError(f"chunk_elements must be positive, got {chunk_elements}")
    if total <= chunk_elements:
        return [(0, total)]
    return [(offset, min(chunk_elements, total - offset)) for offset in range(0, total, chunk_elements)]


def byte_view(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array as a flat memoryview (no copy).

    Goes through a uint8 view because dtypes such as bfloat16 have no
    buffer-protocol format of their own.
    """
    return memoryview(array.reshape(-1).view(np.uint8))

