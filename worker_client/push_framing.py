"""One shard's part of a push, and its messages as they go on the wire.

A push to a shard is a PushBegin (who, which sequence, the items, their row
ids) followed by chunks of values, packed into messages of at most
``chunk_bytes`` (wehub_ps.wire.chunking). Messages come as pieces
(codec.push_request_pieces) that the caller joins once, the one copy of
the tensor bytes; chunks converted to a narrower wire dtype live in this
thread's :class:`ConversionArena` until their message is joined.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from wehub_ps.kernels.convert import cast_into
from wehub_ps.kernels.rowops import RowGather
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.arrays import byte_view, chunk_ranges
from wehub_ps.wire.chunking import ChunkPacker, split_spans
from wehub_ps.wire.codec import OutgoingChunk, push_request_pieces
from wehub_ps.wire.dtypes import to_wire_dtype
from wehub_ps.wire.small_messages import encode_chunk_header, encode_push_begin, encode_push_item
from worker_client.pull_receiver import PullItem
from worker_client.session import Session

__all__ = ["ConversionArena", "PushFramer", "PushItem", "ShardPush"]

# The packer's limit for a push sent as one message whatever its size (the exchange lane).
_ONE_MESSAGE = sys.maxsize


@dataclass
class PushItem:
    """One variable's part (or rows) pushed to one shard.

    ``values``: flat values, or rows still to be gathered from the caller's
    gradients (straight into the message, rowops.RowGather).
    """

    name: str
    values: np.ndarray | RowGather
    row_ids: bytes = b""
    row_elements: int = 1


@dataclass
class ShardPush:
    """One shard's part of a push as it is sent: every retry sends exactly this again."""

    shard_index: int
    items: list[PushItem]
    kind: int
    sequence: int
    base_versions: dict[str, int]
    step: int
    pull_after: bytes | None = None
    #: Where the values pull_after asks for go.
    after: list[PullItem] | None = None

    def detached(self) -> ShardPush:
        """The same push with its own copy of the values (the caller's arrays may change), no pull_after."""
        items = [PushItem(i.name, RowGather(i.values.gather(), np.arange(len(i.values.rows)))
                          if isinstance(i.values, RowGather) else i.values.copy(), i.row_ids, i.row_elements)
                 for i in self.items]
        return ShardPush(self.shard_index, items, self.kind, self.sequence, self.base_versions, self.step)


_conversion = threading.local()


class ConversionArena:
    """This thread's reusable memory for chunks converted to a narrower wire dtype.

    Every converted chunk of one message gets its own region. A message's
    regions are its own from its first ``take`` until the ``reset`` before
    the next message built on this thread takes any: the caller joins
    (copies out) each message before it asks for the next one, so a chunk
    is never overwritten before it is sent, and a retry converts its chunks
    again from the unchanged gradient (the same bytes). The memory holds
    one message's converted chunks at most and is reused by the next, so a
    training loop allocates it once per thread.
    """

    def __init__(self) -> None:
        self._buffers: dict[np.dtype, np.ndarray] = {}
        self._used: dict[np.dtype, int] = {}

    def take(self, dtype: np.dtype, size: int) -> np.ndarray:
        used = self._used.get(dtype, 0)
        buffer = self._buffers.get(dtype)
        if buffer is None or used + size > buffer.size:
            # A bigger buffer; views handed out earlier keep the old one alive.
            buffer = self._buffers[dtype] = np.empty(max(size, 2 * used + size), dtype=dtype)
            used = 0
        self._used[dtype] = used + size
        return buffer[used:used + size]

    def reset(self) -> None:
        self._used.clear()

    @staticmethod
    def of_this_thread() -> ConversionArena:
        arena = getattr(_conversion, "arena", None)
        if arena is None:
            arena = _conversion.arena = ConversionArena()
        return arena


class PushFramer:
    """Frames one shard's push as messages of at most the session's ``chunk_bytes``.

    ``wire_dtype`` (float16 or bfloat16, or None): gradients are converted
    to it chunk by chunk as they are framed.
    """

    def __init__(self, session: Session, wire_dtype: np.dtype | None) -> None:
        self._session = session
        self._wire_dtype = wire_dtype

    def fits_one_message(self, items: list[PushItem]) -> bool:
        """A push of at most chunk_bytes (values and row ids) is one message: it may use the exchange lane."""
        return sum(i.values.nbytes + len(i.row_ids) for i in items) <= self._session.chunk_bytes

    def one_message(self, push: ShardPush) -> list:
        """A push that fits in one message, as pieces (see :meth:`messages`)."""
        return next(self.messages(push, single=True))

    def messages(self, push: ShardPush, single: bool = False) -> Iterator[list]:
        """The messages of one push to one shard: begin first, chunks packed up to chunk_bytes.

        A begin with more row ids than chunk_bytes takes several messages
        (see _begin_parts); the row ids in a message count towards its chunk_bytes.

        Each message comes as pieces (codec.push_request_pieces) that the
        caller joins once, before asking for the next message (or building
        another push on this thread): converted chunks live in this thread's
        arena, which the next message reuses (see ConversionArena).
        ``single``: everything in one message, whatever its size.
        """
        items = push.items
        target = self._wire_dtype
        convert = target is not None and push.kind == ps_pb2.GRADIENT
        wire_dtypes = [target if convert and item.values.dtype != target else item.values.dtype
                       for item in items]
        wires = [to_wire_dtype(dtype) for dtype in wire_dtypes]
        chunk_bytes = self._session.chunk_bytes
        *continued, (begin, id_bytes) = self._begin_parts(push, wires, chunk_bytes, single)
        for part, _ in continued:
            yield push_request_pieces(part, [])
        arena = ConversionArena.of_this_thread()
        arena.reset()
        packer = ChunkPacker(push_request_pieces, _ONE_MESSAGE if single else chunk_bytes, begin, id_bytes)
        add = packer.add
        for item, wire_dtype, wire in zip(items, wire_dtypes, wires):
            values = item.values
            if type(values) is np.ndarray and item.row_elements == 1 and wire_dtype == values.dtype:
                nbytes = values.nbytes
                if nbytes <= chunk_bytes:
                    # A small model's common case: a whole variable, unconverted, is one chunk.
                    size = values.size
                    message = add(OutgoingChunk(encode_chunk_header(item.name, 0, size, wire, 0, size),
                                                byte_view(values)), nbytes)
                    if message is not None:
                        yield message
                        arena.reset()
                    continue
            # Whole rows per chunk for row pushes (the server applies rows).
            per_chunk = max(1, chunk_bytes // (wire_dtype.itemsize * item.row_elements)) * item.row_elements
            for offset, count in chunk_ranges(values.size, per_chunk):
                if isinstance(values, RowGather):  # whole rows (per_chunk is)
                    width = item.row_elements
                    piece = values.select(slice(offset // width, (offset + count) // width))
                    if wire_dtype != values.dtype:
                        piece = piece.gather().reshape(-1)
                else:
                    piece = values if count == values.size else values[offset:offset + count]
                nbytes = count * wire_dtype.itemsize
                # The message is sent (and the arena reset) before this chunk is
                # converted: its region must not be handed out again while it waits.
                message = packer.before(nbytes)
                if message is not None:
                    yield message
                    arena.reset()
                if wire_dtype != values.dtype:
                    # Converted into this thread's arena (joining the message copies it out):
                    # no model-sized temporary, and the conversion overlaps the sending.
                    buffer = arena.take(wire_dtype, count)
                    cast_into(buffer, piece)
                    piece = buffer
                header = encode_chunk_header(item.name, offset, count, wire, 0, values.size)
                data = piece if isinstance(piece, RowGather) else byte_view(piece)
                packer.append(OutgoingChunk(header, data), nbytes)
        # No reset after the last message: its chunks are still to be joined (the
        # next push built on this thread resets the arena when it starts).
        last = packer.flush()
        if last is not None:  # (always: the begin, or the chunk that closed the message before it)
            yield last

    def _begin_parts(self, push: ShardPush, wires: list[int], chunk_bytes: int,
                     single: bool) -> list[tuple[bytes, int]]:
        """The PushBegin of one push, as parts of at most chunk_bytes of row ids each, with their id bytes.

        Row ids travel in the begin; more than fit one message continue in
        the next ones (PushBegin.continued), so the push keeps its one
        sequence and the server's ledger claims its chunks as one push. The
        first part declares every item; later ones carry only row ids.
        ``single``: one part, whatever its size.
        """
        session = self._session
        items = push.items
        head = (session.worker_id, session.incarnation, push.sequence, push.shard_index, session.num_shards,
                push.kind)
        base_versions = push.base_versions
        id_bytes = sum(len(item.row_ids) for item in items)
        room = chunk_bytes // 8 * 8
        if single or id_bytes <= room:
            declared = [encode_push_item(item.name, item.values.size, wire, base_versions.get(item.name, 0),
                                         item.row_ids)
                        for item, wire in zip(items, wires)]
            return [(encode_push_begin(*head, declared, push.step, push.pull_after), id_bytes)]
        lengths = [len(item.row_ids) for item in items]
        parts = split_spans(lengths, room)
        encoded = []
        for i, spans in enumerate(parts):
            declared = []
            for index, start, stop in spans:
                item = items[index]
                if i == 0:  # declares the item: its elements, or those of the rows it carries
                    elements = item.values.size if stop == lengths[index] else stop // 8 * item.row_elements
                    base_version = base_versions.get(item.name, 0)
                else:
                    elements, base_version = (stop - start) // 8 * item.row_elements, 0
                declared.append(encode_push_item(item.name, elements, wires[index], base_version,
                                                 item.row_ids[start:stop]))
            encoded.append((encode_push_begin(*head, declared, push.step, push.pull_after if i == 0 else None,
                                              continued=i < len(parts) - 1),
                            sum(stop - start for _, start, stop in spans)))
        return encoded
