"""One shard's part of a pull: the request, and the answer written straight into place.

Used by a plain pull and by a push that brings the next step's values
back with it (``PushBegin.pull_after``), so both check the answer the same
way: every chunk inside its destination, every element received once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from wehub_ps.kernels.convert import cast_into
from wehub_ps.kernels.rowops import put_rows
from wehub_ps.wire.codec import DecodedChunk, decode_pull_response
from wehub_ps.wire.protowire import CodecError
from wehub_ps.wire.small_messages import encode_pull_item, encode_pull_request
from worker_client.errors import PSInternalError

__all__ = ["PullItem", "PullReceiver", "pull_request"]


@dataclass
class PullItem:
    """One variable (or a block of its rows) pulled from one shard into ``dest`` (flat).

    With ``rows_at``, ``dest`` is a 2-D array and the answer's row i goes to
    ``dest[rows_at[i]]``: rows pulled in sorted order land in the caller's
    order with one scatter from the message, no copy in between.
    """

    name: str
    dest: np.ndarray
    row_ids: np.ndarray | None = None
    rows_at: np.ndarray | None = None

    @property
    def size(self) -> int:
        """Elements the answer carries."""
        return self.dest.size if self.rows_at is None else len(self.rows_at) * self.dest.shape[1]


def pull_request(items: Iterable[PullItem], shard_index: int, num_shards: int, **fields) -> bytes:
    """The serialised PullRequest for ``items``; ``fields`` are the request's other fields.

    Written as bytes (codec.encode_pull_request): a step asks for the same
    variables every time, and building a protobuf item per variable cost
    about a microsecond each.
    """
    encoded = [encode_pull_item(item.name, _id_bytes(item.row_ids)) for item in items]
    return encode_pull_request(shard_index, num_shards, encoded, **fields)


def _id_bytes(ids: np.ndarray | None) -> bytes:
    """Row ids as the wire's little-endian int64 (one copy)."""
    return b"" if ids is None else ids.astype("<i8", copy=False).tobytes()


class PullReceiver:
    """Copies each received chunk into its item's destination and checks that all came."""

    def __init__(self, address: str, items: list[PullItem]) -> None:
        self.address = address
        self._expected = {item.name: item for item in items}
        self.received: dict[str, int] = {}
        #: The version of each variable as its last chunk was read.
        self.versions: dict[str, int] = {}
        self.reset()

    def reset(self) -> None:
        """Forget a partial answer (before a retry)."""
        self.received = dict.fromkeys(self._expected, 0)
        self.versions = {}

    def take_message(self, message: bytes | memoryview) -> None:
        try:
            chunks = decode_pull_response(message)
        except CodecError as exc:
            raise self._malformed(exc) from exc
        self.take_chunks(chunks)

    def take_chunks(self, chunks: list[DecodedChunk]) -> None:
        try:
            for chunk in chunks:
                h = chunk.header
                # Each field read once: a protobuf field read is an attribute lookup and a conversion.
                name, offset, count = h.variable, h.offset, h.count
                item = self._expected[name]
                if offset + count > item.size:
                    raise CodecError(f"chunk [{offset}, {offset + count}) is outside {item.size} elements")
                if item.rows_at is None:
                    cast_into(item.dest[offset:offset + count], chunk.array())
                else:
                    width = item.dest.shape[1]
                    if width and (offset % width or count % width):
                        raise CodecError(f"chunk [{offset}, {offset + count}) of {name!r} "
                                         f"is not whole rows of {width}")
                    if count:  # (rows of no elements: nothing to put)
                        first = offset // width
                        put_rows(item.dest, item.rows_at[first:first + count // width],
                                 chunk.array().reshape(-1, width))
                self.received[name] += count
                self.versions[name] = h.version
        except (CodecError, KeyError) as exc:
            raise self._malformed(exc) from exc

    def check_complete(self) -> None:
        short = {name: (self.received[name], item.size) for name, item in self._expected.items()
                 if self.received[name] != item.size}
        if short:
            raise PSInternalError(f"pull from {self.address} ended early: received/expected "
                                  f"elements {short}", address=self.address)

    def _malformed(self, exc: Exception) -> PSInternalError:
        return PSInternalError(f"pull from {self.address}: malformed response: {exc}", address=self.address)
