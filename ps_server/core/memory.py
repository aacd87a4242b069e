"""A shard's memory booking: every byte it allocates is booked against --max-memory-bytes first.

Two kinds of bytes share the limit: those of variables (``reserved``:
values, slots, staged uploads, hash tables' rows and id indexes,
synchronous steps' sums) and those held for requests (``held``: rows
gathered for pulls in flight, the ledger's records of unfinished pushes,
validated creates' :class:`Booking`). A refusal (MEMORY_LIMIT) always comes
before anything is allocated.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from ps_server.core.errors import RequestError
from wehub_ps.errors import Reason
from wehub_ps.specs import VariableSpec

__all__ = ["BOOKING_SECONDS", "Booking", "MemoryBook", "MemoryHold"]

#: How long a validated create keeps its booking (see VariableStore.validate): longer than a
#: client takes from validating on every shard to creating, also when it retries a shard that
#: is briefly unavailable; the client validates again (renews) when it took longer.
BOOKING_SECONDS = 60.0


@dataclass
class Booking:
    """A validated create's hold on a variable's bytes and its place under --max-variables."""
    spec: VariableSpec
    owner: str  # the id the validating client chose
    nbytes: int
    expires: float  # time.monotonic()


class MemoryBook:
    """The bytes one shard has booked, and its limit; thread-safe.

    ``lock`` is the store's lock (see VariableStore): it guards the fields
    here and the store's registry, so a part is booked and registered in
    one hold. Reentrant: a staged upload gives its bytes back when it is
    garbage (InitialUpload), which may happen in a thread that holds it.
    """

    def __init__(self, shard_index: int, limit: int) -> None:
        self.shard_index = shard_index
        self.limit = limit
        self.lock = threading.RLock()
        #: Bytes of variables.
        self.reserved = 0
        #: Bytes held for requests rather than variables, and by bookings.
        self.held = 0
        #: Validated creates not yet made, by variable name; their bytes are in ``held``.
        self.bookings: dict[str, Booking] = {}
        # Bytes given back by finalizers (any thread, any moment, so they take no lock; a deque's
        # append is atomic): subtracted from held under the lock the next time it is read.
        self._given_back: deque[int] = deque()

    @property
    def reserved_bytes(self) -> int:
        with self.lock:
            return self.reserved

    @property
    def held_bytes(self) -> int:
        with self.lock:
            self.collect()
            return self.held

    def give_back(self, cell: list[int]) -> None:
        """Give back ``cell[0]`` booked bytes; safe in a finalizer (takes no lock)."""
        self._given_back.append(cell[0])

    def collect(self) -> None:
        """(lock held) Take in the bytes given back; also gives back the bytes of bookings that expired."""
        while self._given_back:
            self.held -= self._given_back.popleft()
        if self.bookings:
            now = time.monotonic()
            for name in [n for n, b in self.bookings.items() if b.expires <= now]:
                self.held -= self.bookings.pop(name).nbytes

    def fits(self, nbytes: int) -> bool:
        """(lock held) Whether ``nbytes`` more fit beside the variables and the requests in flight."""
        return self.reserved + self.held + nbytes <= self.limit

    def in_use(self) -> int:
        """(lock held) Bytes booked of both kinds."""
        return self.reserved + self.held

    def book(self, nbytes: int, what: str) -> None:
        """Book ``nbytes`` a request is about to allocate (MEMORY_LIMIT when they do not fit); give
        them back with ``book(-nbytes, what)``."""
        if nbytes == 0:
            return
        with self.lock:
            self.collect()
            if nbytes > 0 and not self.fits(nbytes):
                raise RequestError(
                    Reason.MEMORY_LIMIT,
                    f"{what} needs {nbytes} bytes; shard {self.shard_index} holds {self.reserved} bytes of "
                    f"variables and {self.held} for requests in flight of its {self.limit}-byte "
                    "limit (--max-memory-bytes); ask for less at once")
            self.held += nbytes

    def hold(self, nbytes: int, what: str) -> MemoryHold:
        """:meth:`book` with a handle that gives the bytes back once."""
        self.book(nbytes, what)
        return MemoryHold(self, nbytes)

    def adopt_staged(self, staged: int, kept: int) -> None:
        """``staged`` bytes held for a request become ``kept`` bytes of variables (the rest is given
        back). Never refused: nothing grows."""
        with self.lock:
            self.collect()
            self.held -= staged
            self.reserved += kept

    def reserve(self, delta: int) -> None:
        """Book memory for a growing hash table, or give back a part's bytes (a negative delta:
        never refused); may be called with a part's lock held."""
        with self.lock:
            self.collect()
            if delta > 0 and not self.fits(delta):
                raise RequestError(
                    Reason.MEMORY_LIMIT,
                    f"growing a hash table by {delta} bytes would pass shard {self.shard_index}'s "
                    f"{self.limit}-byte limit ({self.reserved} in use by variables, {self.held} "
                    "by requests in flight; --max-memory-bytes); set max_rows with eviction='lru', "
                    "or add shards")
            self.reserved += delta


class MemoryHold:
    """Bytes booked with :meth:`MemoryBook.hold`, given back once (``release`` or leaving ``with``)."""

    def __init__(self, book: MemoryBook, nbytes: int) -> None:
        self._book = book
        self.nbytes = nbytes

    def release(self) -> None:
        nbytes, self.nbytes = self.nbytes, 0
        self._book.book(-nbytes, "")

    def __enter__(self) -> MemoryHold:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
