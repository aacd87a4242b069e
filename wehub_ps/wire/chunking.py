"""Where a message of chunks ends: the one packing rule for pushes and pull answers.

A variable's values travel as chunks (each at most ``limit`` bytes, cut by
codec.chunk_ranges); a message carries as many whole chunks as fit in
``limit`` bytes of chunk data. :class:`ChunkPacker` decides where each
message ends and hands the chunks to ``frame`` (codec.push_request_pieces,
codec.pull_response_pieces) to build it. A chunk's size is known before the
chunk is made, so a caller can send the finished message before it makes
the next chunk (:meth:`ChunkPacker.before`): memory a converted chunk lives
in is then free to be reused.

Row ids of a push travel in its begin; :func:`split_spans` cuts them into
parts of at most ``limit`` bytes each.

Pure framing: it imports neither side, nor protobuf.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

__all__ = ["ChunkPacker", "split_spans"]

C = TypeVar("C")
M = TypeVar("M")


class ChunkPacker(Generic[C, M]):
    """Collects chunks and closes a message when the next chunk would take it past ``limit`` bytes.

    ``frame(head, chunks)`` builds a message; ``head`` (a push's begin) goes
    with the first message only, and ``used`` bytes of it count towards that
    message's limit. A chunk larger than ``limit`` goes alone in its message.
    Per chunk the work is one method call: the packer is on the hot path.
    """

    __slots__ = ("limit", "_frame", "_head", "_pending", "_bytes")

    def __init__(self, frame: Callable[[Any, list[C]], M], limit: int, head: Any = None,
                 used: int = 0) -> None:
        self.limit = limit
        self._frame = frame
        self._head = head
        self._pending: list[C] = []
        self._bytes = used

    def add(self, chunk: C, nbytes: int) -> M | None:
        """Add a chunk of ``nbytes``; the message to send first when it does not fit beside those pending.

        For a chunk whose making must wait until the previous message is
        sent, use :meth:`before` and :meth:`append` instead.
        """
        pending = self._pending
        if pending and self._bytes + nbytes > self.limit:
            message = self._frame(self._head, pending)
            self._head, self._pending, self._bytes = None, [chunk], nbytes
            return message
        pending.append(chunk)
        self._bytes += nbytes
        return None

    def before(self, nbytes: int) -> M | None:
        """The message to send before a chunk of ``nbytes`` is made (it would not fit), or None."""
        if self._pending and self._bytes + nbytes > self.limit:
            return self._take()
        return None

    def append(self, chunk: C, nbytes: int) -> None:
        """Add a chunk :meth:`before` made room for."""
        self._pending.append(chunk)
        self._bytes += nbytes

    @property
    def full(self) -> bool:
        """Whether the pending chunks fill ``limit`` (for a caller that sends a message once it is full)."""
        return self._bytes >= self.limit

    def flush(self) -> M | None:
        """The message of what is pending (chunks, or a head not sent yet); None when nothing is."""
        if not self._pending and self._head is None:
            return None
        return self._take()

    def _take(self) -> M:
        message = self._frame(self._head, self._pending)
        self._head, self._pending, self._bytes = None, [], 0
        return message


def split_spans(lengths: Sequence[int], limit: int) -> list[list[tuple[int, int, int]]]:
    """Cut items of ``lengths`` bytes, in order, into parts of at most ``limit`` bytes.

    Each part is a list of spans ``(item, start, stop)``. The first part
    has a span for every item (empty for items it has no room for), so a
    receiver learns every item from the first message; later parts hold
    only what is left. Items are cut where a part fills: when ``limit`` and
    every length are multiples of a unit (8 for int64 ids), so is every cut.
    """
    room = max(0, limit)
    first: list[tuple[int, int, int]] = []
    rest: list[tuple[int, int]] = []  # (item, its first byte still to place)
    for index, length in enumerate(lengths):
        take = min(length, room)
        room -= take
        first.append((index, 0, take))
        if take < length:
            rest.append((index, take))
    if rest and limit <= 0:
        raise ValueError(f"limit must be positive to split items, got {limit}")
    parts = [first]
    position = 0
    while position < len(rest):
        part: list[tuple[int, int, int]] = []
        room = limit
        while position < len(rest) and room:
            index, start = rest[position]
            take = min(lengths[index] - start, room)
            part.append((index, start, start + take))
            room -= take
            if start + take < lengths[index]:
                rest[position] = (index, start + take)
            else:
                position += 1
        parts.append(part)
    return parts
