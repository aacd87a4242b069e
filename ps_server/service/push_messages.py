"""PushRequest messages as the core's push values (:mod:`ps_server.core.pushes`).

The core knows no protobuf: a ``PushBegin`` (put together from its parts
when it spans several messages) becomes a :class:`PushStart`, each decoded
chunk a :class:`PushChunk`. Codes this server does not know are passed on
as they came, so the core refuses them in its order of checks, with the
code in its message.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ps_server.core.errors import RequestError
from ps_server.core.pushes import PushChunk, PushKind, PushStart
from wehub_ps.errors import Reason
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.codec import DecodedChunk, OutgoingChunk, join_pieces, push_request_pieces
from wehub_ps.wire.dtypes import numpy_dtype_or_code

__all__ = ["BeginParts", "push_start", "push_chunk", "push_chunks", "chunks_message"]

_KINDS = {ps_pb2.GRADIENT: PushKind.GRADIENT, ps_pb2.ASSIGN: PushKind.ASSIGN}


class BeginParts:
    """A PushBegin spread over several messages (``PushBegin.continued``), put together before it is checked.

    A push of more row ids than fit one message keeps one sequence this
    way, so the ledger claims its chunks as one push. Each part's row ids
    are booked through ``book`` before they are kept: three times their
    size, for the ids collected here, the joined begin and the arrays
    begin_push parses from it, held while the push streams.
    """

    def __init__(self, first: ps_pb2.PushBegin, book: Callable[[int], None]) -> None:
        self._book = book
        self._first = first
        #: Per variable declared by the first part: its row ids, part by part.
        self._ids: dict[str, list[bytes]] = {}
        self._elements: dict[str, int] = {}
        self._continued = first.continued
        for item in first.items:
            self._take(item)

    @property
    def continued(self) -> bool:
        """Whether more parts must follow."""
        return self._continued

    def _take(self, item: ps_pb2.PushItem) -> None:
        if item.row_ids:
            self._book(3 * len(item.row_ids))
        self._ids.setdefault(item.variable, []).append(item.row_ids)
        self._elements[item.variable] = self._elements.get(item.variable, 0) + item.elements

    def add(self, part: ps_pb2.PushBegin) -> None:
        """The next part: its items' row ids extend those of the variables the first part declared."""
        if not part.items or not all(item.row_ids for item in part.items):
            raise RequestError(Reason.INVALID_REQUEST, "a continuing PushBegin part must carry row ids of "
                                                       "the variables the first part declared")
        for item in part.items:
            if item.variable not in self._ids:
                raise RequestError(Reason.INVALID_REQUEST,
                                   f"a continuing PushBegin part names {item.variable!r}, which the first "
                                   "part did not declare")
        for item in part.items:
            self._take(item)
        self._continued = part.continued

    def whole(self) -> ps_pb2.PushBegin:
        """The begin as one message (call once the last part came)."""
        begin = ps_pb2.PushBegin()
        begin.CopyFrom(self._first)
        begin.continued = False
        for item in begin.items:
            parts = self._ids[item.variable]
            if len(parts) > 1:
                item.row_ids = b"".join(parts)
                item.elements = self._elements[item.variable]
        return begin


def push_start(begin: ps_pb2.PushBegin) -> PushStart:
    """The core's view of a whole ``PushBegin``."""
    return PushStart(begin.shard_index, begin.num_shards, begin.worker_id, begin.incarnation, begin.sequence,
                     begin.step, _KINDS.get(begin.kind, begin.kind),
                     [(item.variable, item.elements, _dtype(item.wire_dtype), item.row_ids, item.base_version)
                      for item in begin.items])


def push_chunk(chunk: DecodedChunk) -> PushChunk:
    """The core's view of one decoded chunk (its data stays a view of the message)."""
    header = chunk.header
    return header.variable, numpy_dtype_or_code(header.dtype), header.offset, header.count, chunk.data


def push_chunks(chunks: list[DecodedChunk]) -> list[PushChunk]:
    """:func:`push_chunk` of every chunk of one message."""
    return [push_chunk(chunk) for chunk in chunks]


def _dtype(code: int) -> np.dtype | int:
    """The numpy dtype of a wire dtype code, or the code itself when it names none."""
    return numpy_dtype_or_code(code)


def chunks_message(chunks: list[DecodedChunk]) -> bytes:
    """A PushRequest of ``chunks`` that decodes to them in this order (a message's applied prefix).

    Each chunk is its own TensorChunk: a ChunkBatch would put the small
    chunks after the large ones, and a replica applies chunks in the order
    it decodes them (an LRU table's access order, a sync step's sum).
    """
    return b"".join(join_pieces(push_request_pieces(None, [OutgoingChunk(chunk.header, chunk.data)]))
                    for chunk in chunks)
