"""A planned pull framed as PullResponse messages, each tensor byte copied once.

Small chunks are copied out under their part's lock and packed several to
a message; a small model's pull is then one message, not one per variable
(a message costs far more than copying a few KiB). A large dense chunk is
copied straight into a message of its own. Rows read when planned are
framed from those copies; a dense part's rows are gathered from the table
as the message is joined.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from ps_server.core.pulls import PullPlan, RowsRead
from ps_server.core.store import VariablePart
from ps_server.core.tables import HashTablePart
from wehub_ps.kernels.rowops import RowGather
from wehub_ps.wire.arrays import byte_view, chunk_ranges
from wehub_ps.wire.chunking import ChunkPacker
from wehub_ps.wire.codec import (
    OutgoingChunk,
    encode_pull_response,
    piece_size,
    pull_response_pieces,
)
from wehub_ps.wire.dtypes import to_wire_dtype
from wehub_ps.wire.small_messages import encode_chunk_header

__all__ = ["pull_messages"]

# Chunks smaller than this are packed several to a message (see the module docstring).
_PACK_BELOW_BYTES = 64 * 1024


def pull_messages(plan: PullPlan) -> Iterator[list]:
    """The response messages, each as pieces (codec.pull_response_pieces) to be joined once."""
    chunk_bytes = plan.chunk_bytes
    packer: ChunkPacker[OutgoingChunk, list] = ChunkPacker(_frame, chunk_bytes)
    for read in plan.reads:
        if type(read) is RowsRead:
            part, values, version, wire = read
            for chunk in _row_chunks(part, values, version, wire, chunk_bytes):
                message = packer.add(chunk, chunk.data.nbytes)
                if message is not None:
                    yield message
            continue
        part, start, count, wire = read
        wire_enum = to_wire_dtype(wire)
        per_chunk = max(1, chunk_bytes // wire.itemsize)
        name, elements = part.spec.name, part.elements
        for offset, n in chunk_ranges(count, per_chunk):
            first = start + offset
            if n * wire.itemsize >= _PACK_BELOW_BYTES:
                message = packer.flush()
                if message is not None:
                    yield message
                yield part.read(first, n, wire, _chunk_sink(name, first, wire_enum, elements, alone=True))
                continue
            # Read first (under the part's lock), then packed: a small chunk may end a message past
            # chunk_bytes by less than _PACK_BELOW_BYTES, and the message goes once it is full.
            packer.append(part.read(first, n, wire, _chunk_sink(name, first, wire_enum, elements)),
                          n * wire.itemsize)
            if packer.full:
                yield packer.flush()
    message = packer.flush()
    if message is not None:
        yield message


def _frame(head: None, chunks: list[OutgoingChunk]) -> list:
    return pull_response_pieces(chunks)


def _row_chunks(part: VariablePart | HashTablePart, values: np.ndarray | RowGather, version: int,
                wire: np.dtype, chunk_bytes: int) -> Iterator[OutgoingChunk]:
    """Rows already read (or to be gathered into the message), in whole-row chunks of the wire dtype."""
    width = part.spec.row_elements
    rows = len(values.rows) if isinstance(values, RowGather) else len(values)
    per_chunk = max(1, chunk_bytes // max(1, width * wire.itemsize))
    wire_enum = to_wire_dtype(wire)
    for first in range(0, max(rows, 1), per_chunk):
        if isinstance(values, RowGather):
            data: memoryview | RowGather = values.select(slice(first, first + per_chunk))
        else:
            data = byte_view(np.ascontiguousarray(values[first:first + per_chunk], dtype=wire))
        header = encode_chunk_header(part.spec.name, first * width, piece_size(data) // wire.itemsize,
                                     wire_enum, version, rows * width)
        yield OutgoingChunk(header, data)


def _chunk_sink(variable: str, offset: int, wire_enum: int, part_elements: int,
                alone: bool = False) -> Callable[[np.ndarray, int], object]:
    """What a pull does with a chunk read under its part's lock: copy it out, with the version it was read at.

    ``alone``: a large chunk becomes its own message, copied straight into
    it (one copy); a small one is copied out to be packed with others.
    """
    def sink(values: np.ndarray, version: int) -> object:
        header = encode_chunk_header(variable, offset, values.size, wire_enum, version, part_elements)
        if alone:
            return [encode_pull_response([OutgoingChunk(header, byte_view(values))])]
        return OutgoingChunk(header, memoryview(bytes(byte_view(values))))
    return sink
