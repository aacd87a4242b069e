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
* the small messages that are written for every variable of every step
  (``ChunkHeader``, ``PushItem``, ``PushBegin``, ...) are written as bytes
  (:mod:`wehub_ps.wire.small_messages`) rather than built as protobuf
  objects and serialised;
* chunks under :data:`BATCH_BELOW_BYTES` travel together as one
  ``ChunkBatch`` (one protobuf parse for all headers, one bytes field), because
  framing a chunk in Python costs more than copying a few KiB: a step of
  a model with many small variables spent 40% of the worker's time here;
* a larger chunk's data starts at a multiple of :data:`DATA_ALIGNMENT` bytes
  from the start of its message (``TensorChunk.pad`` before it), so a
  receiver's array of it is aligned: NumPy runs an optimizer's arithmetic
  on a misaligned gradient through a buffer, a quarter slower.

The output is ordinary protobuf (a test compares it with
``SerializeToString``, padding aside), so any protobuf client can speak the protocol. Every
tag is read from the generated descriptors at import
(:func:`wehub_ps.wire.protowire.field_tag`).

Its parts: the protobuf wire-format primitives and :class:`CodecError`
(:mod:`~wehub_ps.wire.protowire`), the small-message encoders
(:mod:`~wehub_ps.wire.small_messages`), the array views
(:mod:`~wehub_ps.wire.arrays`) and the packing of chunks into messages
(:mod:`~wehub_ps.wire.chunking`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from wehub_ps.kernels.rowops import RowGather
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.arrays import chunk_view
from wehub_ps.wire.dtypes import to_numpy_dtype
from wehub_ps.wire.fresh_bytes import filled_bytes
from wehub_ps.wire.protowire import (
    WIRE_LEN,
    WIRE_VARINT,
    CodecError,
    field_number,
    field_tag,
    iter_fields,
    merge,
    read_varint,
    tag,
    varint,
)

__all__ = [
    "TooManyChunks",
    "DATA_ALIGNMENT",
    "DecodedChunk",
    "OutgoingChunk",
    "join_pieces",
    "buffer_pieces",
    "piece_size",
    "encode_pull_response",
    "encode_push_request",
    "pull_response_pieces",
    "push_request_pieces",
    "push_response_pieces",
    "split_push_response",
    "decode_pull_response",
    "decode_push_request",
    "encode_envelope",
    "envelope_pieces",
    "decode_envelope",
]

# Tags written and field numbers read, from the generated descriptors.
_TAG_TENSOR_CHUNK_HEADER = field_tag(ps_pb2.TensorChunk, "header", WIRE_LEN)
_TAG_TENSOR_CHUNK_DATA = field_tag(ps_pb2.TensorChunk, "data", WIRE_LEN)
_TAG_TENSOR_CHUNK_PAD = field_tag(ps_pb2.TensorChunk, "pad", WIRE_LEN)
_TAG_CHUNK_BATCH_HEADERS = field_tag(ps_pb2.ChunkBatch, "headers", WIRE_LEN)
_TAG_CHUNK_BATCH_DATA = field_tag(ps_pb2.ChunkBatch, "data", WIRE_LEN)
_TAG_CHUNK_HEADERS_ITEMS = field_tag(ps_pb2.ChunkHeaders, "items", WIRE_LEN)
_TAG_PULL_RESPONSE_CHUNKS = field_tag(ps_pb2.PullResponse, "chunks", WIRE_LEN)
_TAG_PULL_RESPONSE_BATCHES = field_tag(ps_pb2.PullResponse, "batches", WIRE_LEN)
_TAG_PUSH_REQUEST_BEGIN = field_tag(ps_pb2.PushRequest, "begin", WIRE_LEN)
_TAG_PUSH_REQUEST_CHUNKS = field_tag(ps_pb2.PushRequest, "chunks", WIRE_LEN)
_TAG_PUSH_REQUEST_BATCHES = field_tag(ps_pb2.PushRequest, "batches", WIRE_LEN)
_TAG_PUSH_RESPONSE_PULLED = field_tag(ps_pb2.PushResponse, "pulled", WIRE_LEN)

# (header field, data field) of a TensorChunk and of a ChunkBatch.
_TENSOR_CHUNK_FIELDS = (field_number(ps_pb2.TensorChunk, "header"), field_number(ps_pb2.TensorChunk, "data"))
_CHUNK_BATCH_FIELDS = (field_number(ps_pb2.ChunkBatch, "headers"), field_number(ps_pb2.ChunkBatch, "data"))
_PULL_RESPONSE_CHUNKS = field_number(ps_pb2.PullResponse, "chunks")
_PULL_RESPONSE_BATCHES = field_number(ps_pb2.PullResponse, "batches")
_PUSH_REQUEST_BEGIN = field_number(ps_pb2.PushRequest, "begin")
_PUSH_REQUEST_CHUNKS = field_number(ps_pb2.PushRequest, "chunks")
_PUSH_REQUEST_BATCHES = field_number(ps_pb2.PushRequest, "batches")
_PUSH_RESPONSE_PULLED = field_number(ps_pb2.PushResponse, "pulled")

#: Chunks smaller than this are sent in a ChunkBatch when there are two or more.
BATCH_BELOW_BYTES = 64 * 1024
#: A TensorChunk's data of BATCH_BELOW_BYTES or more starts at a multiple of this from its message's start
#: (a received message's buffer is 16-byte aligned: a bytes object's, or malloc's for a lane's frame).
DATA_ALIGNMENT = 8


class TooManyChunks(CodecError):
    """A message carries more chunks than the reader accepts (decoding stopped there)."""


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


def buffer_pieces(pieces: list) -> list:
    """``pieces`` as buffers a scatter-gather send takes: each RowGather gathered, nothing else copied."""
    return [memoryview(p.gather()).cast("B") if type(p) is RowGather else p for p in pieces]


@dataclass(frozen=True, slots=True)
class DecodedChunk:
    """A received chunk; ``data`` is a view into the received message."""

    header: ps_pb2.ChunkHeader
    data: memoryview

    def array(self) -> np.ndarray:
        """The payload as a read-only array of the header's dtype (no copy)."""
        return chunk_view(self.data, self.header.dtype, self.header.count)


def _append_chunks(pieces: list, chunk_tag: bytes, batch_tag: bytes, chunks: Sequence[OutgoingChunk]) -> None:
    """TensorChunks for the large chunks, then one ChunkBatch for the small ones (field order)."""
    small = [c for c in chunks if c.data.nbytes < BATCH_BELOW_BYTES]
    if len(small) < 2:
        small = []
    offset = -1  # the message's bytes so far, once a large chunk needs it
    for chunk in [c for c in chunks if c.data.nbytes >= BATCH_BELOW_BYTES] if small else chunks:
        header = _header_bytes(chunk.header)
        if chunk.data.nbytes < BATCH_BELOW_BYTES:
            _append_framed(pieces, chunk_tag, _TAG_TENSOR_CHUNK_HEADER, _TAG_TENSOR_CHUNK_DATA, header,
                           [chunk.data])
            offset = -1
            continue
        if offset < 0:
            offset = sum(piece_size(p) for p in pieces)
        offset += _append_aligned(pieces, chunk_tag, header, chunk.data, offset)
    if small:
        headers = []
        for c in small:
            header = _header_bytes(c.header)
            headers += (_TAG_CHUNK_HEADERS_ITEMS, varint(len(header)), header)
        _append_framed(pieces, batch_tag, _TAG_CHUNK_BATCH_HEADERS, _TAG_CHUNK_BATCH_DATA, b"".join(headers),
                       [c.data for c in small])


def _append_framed(pieces: list, outer_tag: bytes, header_tag: bytes, data_tag: bytes, header: bytes,
                   data: list[memoryview]) -> None:
    """One TensorChunk or ChunkBatch: its framing and header(s) as one piece, then ``data``, not copied yet.

    Few pieces keep joining cheap: a message is a handful of pieces, not
    one per tag and length (the per-piece Python work showed in profiles).
    """
    data_len = sum(d.nbytes for d in data)
    pieces.append(_framing(outer_tag, header_tag, data_tag, header, data_len))
    if data_len:
        pieces += [d for d in data if d.nbytes]


def _append_aligned(pieces: list, outer_tag: bytes, header: bytes, data: memoryview | RowGather,
                    offset: int) -> int:
    """One TensorChunk at ``offset`` in its message, padded so that its data starts at a multiple of
    DATA_ALIGNMENT; the bytes it adds."""
    data_len = piece_size(data)
    framing = _framing(outer_tag, _TAG_TENSOR_CHUNK_HEADER, _TAG_TENSOR_CHUNK_DATA, header, data_len)
    short = -(offset + len(framing)) % DATA_ALIGNMENT
    if short:
        # A pad field of p >= 2 bytes adds p bytes (1 byte of p - 2 < 128 zeros' length): one try lands
        # unless the outer length's varint grows with it, which the search below then corrects.
        first = short if short > 1 else short + DATA_ALIGNMENT
        for pad in (first, *range(2, 2 * DATA_ALIGNMENT + 2)):
            framing = _framing(outer_tag, _TAG_TENSOR_CHUNK_HEADER, _TAG_TENSOR_CHUNK_DATA, header, data_len,
                               pad)
            if (offset + len(framing)) % DATA_ALIGNMENT == 0:
                break
    pieces.append(framing)
    pieces.append(data)
    return len(framing) + data_len


def _framing(outer_tag: bytes, header_tag: bytes, data_tag: bytes, header: bytes, data_len: int,
             pad: int = 0) -> bytes:
    """Everything of a TensorChunk or ChunkBatch but its data: ``pad`` > 1 bytes of TensorChunk.pad (its
    tag, its length and zeros) go between the header and the data."""
    inner = header_tag + varint(len(header)) + header
    if pad:
        inner += _TAG_TENSOR_CHUNK_PAD + varint(pad - 2) + bytes(pad - 2)
    # proto3 omits an empty bytes field; do the same so that the encoding
    # is byte-identical to protobuf's own.
    if data_len:
        inner += data_tag + varint(data_len)
    return outer_tag + varint(len(inner) + data_len) + inner


def pull_response_pieces(chunks: Sequence[OutgoingChunk]) -> list:
    """A ``PullResponse`` as pieces whose concatenation is the message.

    The tensor bytes are not copied yet: joining the pieces (alone, or
    inside an exchange envelope) is their one copy.
    """
    pieces: list = []
    _append_chunks(pieces, _TAG_PULL_RESPONSE_CHUNKS, _TAG_PULL_RESPONSE_BATCHES, chunks)
    return pieces


def push_request_pieces(begin: ps_pb2.PushBegin | bytes | None, chunks: Sequence[OutgoingChunk]) -> list:
    """A ``PushRequest`` as pieces whose concatenation is the message (see pull_response_pieces).

    ``begin``: the message, or its serialisation (:func:`encode_push_begin`).
    """
    pieces: list = []
    if begin is not None:
        body = begin if type(begin) is bytes else begin.SerializeToString()
        pieces.append(_TAG_PUSH_REQUEST_BEGIN + varint(len(body)) + body)
    _append_chunks(pieces, _TAG_PUSH_REQUEST_CHUNKS, _TAG_PUSH_REQUEST_BATCHES, chunks)
    return pieces


def push_response_pieces(response: bytes, pulled: list | None) -> list:
    """A serialised ``PushResponse`` with the pieces of a PullResponse as its ``pulled`` field."""
    if pulled is None:
        return [response]
    return [response + _TAG_PUSH_RESPONSE_PULLED + varint(sum(piece_size(p) for p in pulled)), *pulled]


def split_push_response(message: bytes | memoryview) -> tuple[ps_pb2.PushResponse, list[DecodedChunk] | None]:
    """A ``PushResponse`` without its ``pulled`` field, and the pulled chunks (views of ``message``).

    None for the chunks when the response has no ``pulled`` field (the
    push did not ask for values, or a server that predates pull_after).
    """
    buf = memoryview(message)
    kept, pulled, previous = [], None, 0
    for field, wire_type, start, stop in iter_fields(buf, 0, len(buf)):
        if field == _PUSH_RESPONSE_PULLED:
            if wire_type != WIRE_LEN:
                raise CodecError("PushResponse.pulled has the wrong wire type")
            pulled = (pulled or []) + decode_pull_response(buf[start:stop])
        else:
            kept.append(buf[previous:stop])
        previous = stop
    return merge(ps_pb2.PushResponse(), b"".join(kept)), pulled


def encode_pull_response(chunks: Sequence[OutgoingChunk]) -> bytes:
    """Serialise a ``PullResponse``; copies each tensor byte once."""
    return join_pieces(pull_response_pieces(chunks))


def encode_push_request(
    begin: ps_pb2.PushBegin | bytes | None, chunks: Sequence[OutgoingChunk]
) -> bytes:
    """Serialise a ``PushRequest``; copies each tensor byte once."""
    return join_pieces(push_request_pieces(begin, chunks))


def _header_and_data(buf: memoryview, start: int, stop: int, header, fields: tuple[int, int],
                     names: tuple[str, str]) -> memoryview:
    """A TensorChunk or ChunkBatch: its header field merged into ``header``, its data returned as a view.

    ``fields`` and ``names``: the numbers and names of the header field and the data field.
    """
    header_field, data_field = fields
    data = buf[0:0]
    for field, wire_type, fstart, fstop in iter_fields(buf, start, stop):
        if field == header_field:
            if wire_type != WIRE_LEN:
                raise CodecError(f"{names[0]} has the wrong wire type")
            merge(header, buf[fstart:fstop])
        elif field == data_field:
            if wire_type != WIRE_LEN:
                raise CodecError(f"{names[1]} has the wrong wire type")
            data = buf[fstart:fstop]
    return data


def _decode_chunk(buf: memoryview, start: int, stop: int) -> DecodedChunk:
    header = ps_pb2.ChunkHeader()
    data = _header_and_data(buf, start, stop, header, _TENSOR_CHUNK_FIELDS,
                            ("TensorChunk.header", "TensorChunk.data"))
    return DecodedChunk(header, data)


def _decode_batch(buf: memoryview, start: int, stop: int, chunks: list[DecodedChunk],
                  max_chunks: int = 0) -> None:
    """Append the chunks of one ChunkBatch, each a view of its slice of the data."""
    headers = ps_pb2.ChunkHeaders()
    data = _header_and_data(buf, start, stop, headers, _CHUNK_BATCH_FIELDS,
                            ("ChunkBatch.headers", "ChunkBatch.data"))
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
    for field, wire_type, start, stop in iter_fields(buf, 0, len(buf)):
        if field in (_PULL_RESPONSE_CHUNKS, _PULL_RESPONSE_BATCHES) and wire_type != WIRE_LEN:
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
    for field, wire_type, start, stop in iter_fields(buf, 0, len(buf)):
        if wire_type != WIRE_LEN and field in (_PUSH_REQUEST_BEGIN, _PUSH_REQUEST_CHUNKS, _PUSH_REQUEST_BATCHES):
            raise CodecError(f"PushRequest field {field} has the wrong wire type")
        if field == _PUSH_REQUEST_BEGIN:
            begin = merge(begin if begin is not None else ps_pb2.PushBegin(), buf[start:stop])
        elif field == _PUSH_REQUEST_CHUNKS:
            if max_chunks and len(chunks) >= max_chunks:
                raise TooManyChunks(f"more than {max_chunks} chunks in one message")
            chunks.append(_decode_chunk(buf, start, stop))
        elif field == _PUSH_REQUEST_BATCHES:
            _decode_batch(buf, start, stop, chunks, max_chunks)
    return begin, chunks


def _envelope_field(name: str, wire_type: int) -> int:
    """The number of field ``name`` in the exchange messages that have it.

    One constant serves requests and responses, so their numbers must agree.
    """
    messages = [message for message in (ps_pb2.ExchangeRequest, ps_pb2.ExchangeResponse)
                if name in message.DESCRIPTOR.fields_by_name]
    if len({field_tag(message, name, wire_type) for message in messages}) != 1:
        raise TypeError(f"ExchangeRequest and ExchangeResponse number their field {name!r} differently")
    return field_number(messages[0], name)


# The payload fields of ExchangeRequest / ExchangeResponse: the ``field`` of an envelope.
EXCHANGE_PULL = _envelope_field("pull", WIRE_LEN)
EXCHANGE_PUSH = _envelope_field("push", WIRE_LEN)
EXCHANGE_ERROR = _envelope_field("error", WIRE_LEN)
_ENVELOPE_PAYLOADS = frozenset((EXCHANGE_PULL, EXCHANGE_PUSH, EXCHANGE_ERROR))
_ENVELOPE_ID = _envelope_field("id", WIRE_VARINT)
_TAG_ENVELOPE_ID = tag(_ENVELOPE_ID, WIRE_VARINT)
# decode_envelope's fast path reads one-byte tags as single bytes: the id's
# (-1, never a byte, when it takes more) and the payloads' by their byte.
_ENVELOPE_ID_KEY = _TAG_ENVELOPE_ID[0] if len(_TAG_ENVELOPE_ID) == 1 else -1
_ENVELOPE_PAYLOAD_KEYS = {tag(number, WIRE_LEN)[0]: number for number in _ENVELOPE_PAYLOADS
                          if len(tag(number, WIRE_LEN)) == 1}


def envelope_pieces(request_id: int, field: int, payload: bytes | memoryview | list) -> list:
    """An ExchangeRequest/ExchangeResponse around an already serialised payload, as pieces.

    ``payload`` may be a list of pieces (of one or several concatenated
    messages of the payload type, see push_request_pieces); they are not
    copied, so a socket writes them with one scatter-gather send.
    """
    pieces = payload if isinstance(payload, list) else [payload]
    size = sum(piece_size(p) for p in pieces)
    return [_TAG_ENVELOPE_ID + varint(request_id) + tag(field, WIRE_LEN) + varint(size), *pieces]


def encode_envelope(request_id: int, field: int, payload: bytes | memoryview | list) -> bytes:
    """:func:`envelope_pieces` joined once: tensor bytes are copied once here too."""
    return join_pieces(envelope_pieces(request_id, field, payload))


def decode_envelope(message: bytes) -> tuple[int, int, memoryview]:
    """(id, payload field, payload view) of an ExchangeRequest/ExchangeResponse."""
    buf = memoryview(message)
    end = len(buf)
    # encode_envelope's layout (the id, then the payload, nothing else) read
    # directly: a few lookups instead of the general field loop below.
    if end and buf[0] == _ENVELOPE_ID_KEY:
        request_id, position = read_varint(buf, 1, end)
        if position < end:
            key = buf[position]
            if key in _ENVELOPE_PAYLOAD_KEYS:  # a one-byte, length-delimited payload tag
                length, start = read_varint(buf, position + 1, end)
                if start + length == end:
                    return request_id, _ENVELOPE_PAYLOAD_KEYS[key], buf[start:end]
    request_id, field, payload = 0, 0, buf[0:0]
    for number, wire_type, start, stop in iter_fields(buf, 0, len(buf)):
        if number == _ENVELOPE_ID and wire_type == WIRE_VARINT:
            request_id, _ = read_varint(buf, start, stop)
        elif number in _ENVELOPE_PAYLOADS and wire_type == WIRE_LEN:
            field, payload = number, buf[start:stop]
    if not field:
        raise CodecError("exchange message carries no payload")
    return request_id, field, payload
