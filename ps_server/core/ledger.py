"""Exactly-once bookkeeping for pushes.

A push is identified by (worker_id, incarnation, sequence); the incarnation
is new on every worker process start, and the sequence counts the pushes a
worker incarnation sends to this shard. A push arrives as chunks, each
applied the moment it arrives; the ledger records which chunks of which push
were applied, so that:

* a retried push whose acknowledgement was lost is recognised and applied
  nothing (``duplicate``);
* a retried push that was cut off midway applies only the chunks that had
  not arrived (a retry must chunk the same way; a chunk that overlaps an
  applied one with different bounds is refused);
* two streams racing on the same push (an impatient retry while the
  original still runs) never apply a chunk twice.

Pushes of one worker may complete out of order (several threads pushing);
the ledger keeps "every sequence below N is done" plus the set of done
sequences above it. Bounds, so a misbehaving client cannot grow it forever:
``max_open_pushes`` unfinished pushes per incarnation (beyond it the oldest
is written off as abandoned),
``max_done_window`` sequences above the contiguous mark (beyond it the mark
jumps, writing off ancient gaps as abandoned pushes), ``max_written_off_ranges``
ranges of written-off sequences per incarnation (beyond it the oldest is
forgotten, and every sequence below it counts as written off), and
``max_incarnations`` remembered incarnations (least recently used forgotten
first). A written-off push may be partly applied: a retry of it is refused
with PUSH_WRITTEN_OFF, never answered as a duplicate.

Pure Python, no gRPC; thread-safe.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from ps_server.core.errors import RequestError
from wehub_ps.errors import Reason

__all__ = ["PushLedger", "PushSession", "ClaimResult", "SESSION_BYTES", "RECORD_BYTES"]

#: Memory booked for an open push and for each chunk it recorded: measured with tracemalloc
#: (about 2.6 KiB per session with its share of the incarnation's state, 150 bytes per
#: chunk record), rounded up; the checkpoint's copy of a record (about 40 bytes of JSON) fits too.
SESSION_BYTES = 4096
RECORD_BYTES = 256
# Records booked at once, so that a push of many chunks books memory once per block, not per chunk.
_RECORD_BLOCK = 64


class ClaimResult:
    APPLY = "apply"  # the caller must apply the chunk, then call done()
    ALREADY_APPLIED = "already"  # applied before (by this push's earlier stream)


@dataclass
class PushSession:
    """One push on this shard: what it covers and which chunks have landed.

    ``steps`` holds the optimizer step reserved for each variable when its
    first chunk was applied (not at the begin, so a push refused before any
    chunk landed leaves the optimizer untouched); retried chunks reuse it.
    """

    key: tuple[str, str, int]
    total_elements: int
    steps: dict[str, int] = field(default_factory=dict)
    applied_elements: int = 0
    finalized: bool = False
    #: Synchronous mode: this push's gradients per variable until the push is whole
    #: (never checkpointed; see PushLedger.snapshot).
    staging: dict = field(default_factory=dict)
    #: An ASSIGN push: its staged initial value per variable (store.InitialUpload) until it is
    #: installed. Such a push lives in memory only: checkpoints leave it out (see snapshot).
    uploads: dict = field(default_factory=dict)
    # Guards every field below and above. Taken directly (``with self._lock``),
    # not through the condition: a step of a small model takes it a few times
    # per variable, and Condition's own __enter__/__exit__ are Python calls.
    _lock: threading.RLock = field(default_factory=threading.RLock)
    # Waits for chunks applied by another stream of the same push (on _lock).
    cond: threading.Condition = field(init=False)
    # Streams waiting in cond: notify only when there are any.
    _waiting: int = 0
    # per variable: sorted chunk offsets, and offset -> (count, applied?)
    _offsets: dict[str, list[int]] = field(default_factory=dict)
    _chunks: dict[str, dict[int, tuple[int, bool]]] = field(default_factory=dict)
    # Chunk records held (claimed or applied), at most _max_records once bound() was called.
    _records: int = 0
    _max_records: int = 0
    # Books memory with the store (see bound()); None: unbounded (tests, tools).
    _book: Callable[[int], None] | None = None
    # Bytes booked, in a cell the finalizer reads when the session is freed.
    _booked: list[int] = field(default_factory=lambda: [0])
    # Of those, the bytes booked for ``staging`` (book_bytes).
    _staged_bytes: int = 0

    def __post_init__(self) -> None:
        self.cond = threading.Condition(self._lock)

    def bound(self, max_records: int, book: Callable[[int], None],
              give_back: Callable[[list[int]], None]) -> None:
        """Bound the chunks this push may record, and book the memory it holds with ``book``.

        ``book(nbytes)`` raises (MEMORY_LIMIT) when the bytes do not fit; the
        session books :data:`SESSION_BYTES` now and :data:`RECORD_BYTES` per
        chunk record as records are added, and ``give_back(cell)`` returns
        ``cell[0]`` bytes when the session is freed (from a finalizer: it must
        take no lock). A push past ``max_records`` records is refused before
        the chunk is recorded. Called at every (re)join of the push.
        """
        with self._lock:
            self._max_records = max_records
            if self._book is None:
                self._book_to(book, self._records)
                self._book = book
                weakref.finalize(self, give_back, self._booked)

    def book_bytes(self, nbytes: int) -> None:
        """Book ``nbytes`` more that this push holds until it is freed (synchronous mode's staged
        gradients); raises (MEMORY_LIMIT) before anything is held. Nothing to do when unbound."""
        with self._lock:
            if self._book is not None and nbytes:
                self._book(nbytes)
                self._booked[0] += nbytes
                self._staged_bytes += nbytes

    def take_staging(self) -> tuple[dict, int]:
        """(staging, the bytes booked for it): the caller takes both over (a synchronous push that
        is whole hands its gradients to the step's sums, see VariableStore.adopt_staged), so the
        session neither holds nor gives back either any more."""
        with self._lock:
            staging, self.staging = self.staging, {}
            nbytes, self._staged_bytes = self._staged_bytes, 0
            self._booked[0] -= nbytes
            return staging, nbytes

    def make_room(self, chunks: int) -> None:
        """Refuse a message of ``chunks`` chunks that would pass this push's bound, and book their
        records, before any of them is applied (a retried chunk counts too: conservative)."""
        with self._lock:
            if self._book is not None:
                if self._records + chunks > self._max_records:
                    self._refuse(chunks)
                self._book_to(self._book, self._records + chunks)

    def _refuse(self, chunks: int) -> None:
        worker_id, incarnation, sequence = self.key
        raise RequestError(
            Reason.MEMORY_LIMIT,
            f"push {sequence} of {worker_id}/{incarnation} has recorded {self._records} chunks; {chunks} "
            f"more would pass the {self._max_records} a push of {self.total_elements} elements may have; "
            "send larger chunks (PSClient sends at most one per chunk_bytes)")

    def _book_to(self, book: Callable[[int], None], records: int) -> None:
        """Book enough for ``records`` chunk records, a block at a time (lock held); raises before
        changing anything."""
        blocks = -(-records // _RECORD_BLOCK)
        needed = SESSION_BYTES + RECORD_BYTES * _RECORD_BLOCK * blocks
        if needed > self._booked[0]:
            book(needed - self._booked[0])
            self._booked[0] = needed

    def claim(self, variable: str, offset: int, count: int) -> str:
        """Reserve a chunk for applying; blocks while another stream applies it."""
        with self._lock:
            return self._claim(variable, offset, count)

    def claim_with_step(self, variable: str, offset: int, count: int,
                        reserve: Callable[[], int]) -> int | None:
        """:meth:`claim`, and the optimizer step of ``variable`` in this push, in one hold of the lock.

        The step is reserved (``reserve()``) with the variable's first chunk
        and reused by its other chunks and by retries. None when the chunk
        was applied before (nothing reserved then).
        """
        with self._lock:
            if self._claim(variable, offset, count) == ClaimResult.ALREADY_APPLIED:
                return None
            step = self.steps.get(variable)
            if step is None:
                step = self.steps[variable] = reserve()
            return step

    def _claim(self, variable: str, offset: int, count: int) -> str:
        while True:
            chunks = self._chunks.setdefault(variable, {})
            existing = chunks.get(offset)
            if existing is not None and existing[0] == count:
                if existing[1]:
                    return ClaimResult.ALREADY_APPLIED
                self._waiting += 1
                try:
                    self.cond.wait()
                finally:
                    self._waiting -= 1
                continue
            offsets = self._offsets.setdefault(variable, [])
            i = bisect.bisect_left(offsets, offset)
            overlaps = (existing is not None
                        or (i > 0 and offsets[i - 1] + chunks[offsets[i - 1]][0] > offset)
                        or (i < len(offsets) and offset + count > offsets[i]))
            if overlaps:
                raise RequestError(
                    Reason.INVALID_CHUNK,
                    f"chunk [{offset}, {offset + count}) of {variable!r} overlaps a chunk of "
                    "the same push with different bounds; a retried push must be chunked "
                    "exactly like the original",
                )
            if self._book is not None:
                if self._records >= self._max_records:
                    self._refuse(1)
                self._book_to(self._book, self._records + 1)
            offsets.insert(i, offset)
            chunks[offset] = (count, False)
            self._records += 1
            return ClaimResult.APPLY

    def release(self, variable: str, offset: int) -> None:
        """Give back a claimed chunk that could not be applied, so a retry can apply it."""
        with self._lock:
            if self._chunks[variable].pop(offset, None) is not None:
                self._records -= 1
            offsets = self._offsets[variable]
            offsets.pop(bisect.bisect_left(offsets, offset))
            if self._waiting:
                self.cond.notify_all()

    def done(self, variable: str, offset: int) -> bool:
        """Mark a claimed chunk applied; True when this completed the push."""
        with self._lock:
            count, _ = self._chunks[variable][offset]
            self._chunks[variable][offset] = (count, True)
            self.applied_elements += count
            if self._waiting:
                self.cond.notify_all()
            if self.applied_elements == self.total_elements and not self.finalized:
                self.finalized = True
                return True
            return False

    def finalize_empty(self) -> bool:
        """For a push of no elements: True for the one stream that completes it (streams race)."""
        with self._lock:
            if self.total_elements or self.finalized:
                return False
            self.finalized = True
            return True

    @property
    def complete(self) -> bool:
        with self._lock:
            return self.applied_elements == self.total_elements

    def to_json(self) -> dict:
        """The applied chunks (claimed-but-unapplied ones cannot exist under the apply gate).

        A variable none of whose chunks was applied is left out: a chunk
        claimed and released (refused) leaves the record of a chunk that
        never came, as on a replica that was sent only what was applied.
        """
        with self._lock:
            chunks = {var: [[off, n] for off, (n, applied) in sorted(claimed.items()) if applied]
                      for var, claimed in self._chunks.items()}
            return {"total": self.total_elements, "steps": dict(self.steps),
                    "chunks": {var: applied for var, applied in chunks.items() if applied}}

    @classmethod
    def from_json(cls, key: tuple[str, str, int], data: dict) -> "PushSession":
        session = cls(key, int(data["total"]), {k: int(v) for k, v in data["steps"].items()})
        for var, chunks in data["chunks"].items():
            session._offsets[var] = [int(off) for off, _ in chunks]
            session._chunks[var] = {int(off): (int(n), True) for off, n in chunks}
            session.applied_elements += sum(int(n) for _, n in chunks)
            session._records += len(chunks)
        return session


@dataclass
class _IncarnationState:
    """One worker incarnation's pushes.

    Invariant: every sequence below ``done_below`` is resolved: completed,
    or written off (in a range of ``written_off``, or below
    ``forgotten_below``, where the ledger no longer knows which). At and
    above ``done_below``: ``done_above`` holds the completed sequences,
    ``off_above`` the written-off ones, ``open`` the unfinished ones.
    A written-off push may be partly applied; it is never answered as a
    duplicate, only a completed one is.
    """

    done_below: int = 1
    done_above: set[int] = field(default_factory=set)
    open: dict[int, PushSession] = field(default_factory=dict)
    off_above: set[int] = field(default_factory=set)
    #: Sorted, disjoint [start, end) ranges of written-off sequences below done_below.
    written_off: list[list[int]] = field(default_factory=list)
    forgotten_below: int = 0
    #: The newest completed pushes that sync mode dropped whole (late for their step), at most
    #: _DROPPED_KEPT: a retry whose first answer was lost is answered dropped again, not as applied.
    dropped: set[int] = field(default_factory=set)

    def completed(self, sequence: int) -> bool:
        if sequence >= self.done_below:
            return sequence in self.done_above
        return not self.is_written_off(sequence)

    def is_written_off(self, sequence: int) -> bool:
        if sequence >= self.done_below:
            return sequence in self.off_above
        if sequence < self.forgotten_below:
            return True
        return self._range_index(sequence) is not None

    def _range_index(self, sequence: int) -> int | None:
        """The index of the written-off range below done_below that holds ``sequence``, if any."""
        i = bisect.bisect_right(self.written_off, [sequence, float("inf")]) - 1
        return i if i >= 0 and self.written_off[i][0] <= sequence < self.written_off[i][1] else None

    def mark_done(self, sequence: int) -> None:
        """A push completed (also one written off before, whose stream finished it after all)."""
        self.open.pop(sequence, None)
        if sequence >= self.done_below:
            self.off_above.discard(sequence)
            self.done_above.add(sequence)
            self._advance()
        elif sequence >= self.forgotten_below:
            self._unmark_off(sequence)

    def write_off(self, sequence: int) -> None:
        """Give up an unfinished push (at or above done_below)."""
        self.open.pop(sequence, None)
        self.off_above.add(sequence)
        self._advance()

    def write_off_below(self, mark: int) -> None:
        """Resolve every sequence below ``mark``: those not completed were abandoned."""
        if mark > self.done_below:
            self._add_off(self.done_below, mark)
            self.done_below = mark
            self.done_above = {s for s in self.done_above if s >= mark}
            self.off_above = {s for s in self.off_above if s >= mark}
            self.open = {s: p for s, p in self.open.items() if s >= mark}
        self._advance()

    def bound(self, max_window: int, max_ranges: int) -> None:
        """Keep the resolved sequences above the mark, and the written-off ranges, bounded."""
        if len(self.done_above) + len(self.off_above) > max_window:
            # A gap this old belongs to a push that was abandoned.
            self.write_off_below(min(self.done_above | self.off_above))
        while len(self.written_off) > max_ranges:
            # The oldest range is forgotten, and with it what completed below it:
            # a retry down there is answered as written off, never as a duplicate.
            self.forgotten_below = self.written_off.pop(0)[1]

    def _advance(self) -> None:
        while True:
            mark = self.done_below
            if mark in self.done_above:
                self.done_above.discard(mark)
            elif mark in self.off_above:
                self.off_above.discard(mark)
                self._add_off(mark, mark + 1)
            else:
                return
            self.done_below = mark + 1

    def _add_off(self, start: int, end: int) -> None:
        """Append [start, end) (at or above every range) to written_off."""
        if self.written_off and self.written_off[-1][1] >= start:
            self.written_off[-1][1] = max(self.written_off[-1][1], end)
        else:
            self.written_off.append([start, end])

    def _unmark_off(self, sequence: int) -> None:
        i = self._range_index(sequence)
        if i is None:
            return
        start, end = self.written_off[i]
        pieces = [r for r in ([start, sequence], [sequence + 1, end]) if r[1] > r[0]]
        self.written_off[i:i + 1] = pieces


#: Dropped sync pushes remembered per worker incarnation (a worker retries its newest pushes only).
_DROPPED_KEPT = 64


class PushLedger:
    """Which pushes were applied, per (worker, incarnation); thread-safe."""

    def __init__(self, max_open_pushes: int = 64, max_done_window: int = 4096,
                 max_incarnations: int = 100_000, max_written_off_ranges: int = 64) -> None:
        self._max_open = max_open_pushes
        self._max_window = max_done_window
        self._max_incarnations = max_incarnations
        self._max_ranges = max_written_off_ranges
        # Guards _states (and the _IncarnationState objects in it).
        self._lock = threading.Lock()
        self._states: OrderedDict[tuple[str, str], _IncarnationState] = OrderedDict()

    def begin(self, worker_id: str, incarnation: str, sequence: int,
              total_elements: int) -> PushSession | None:
        """The session for this push, or None when it was applied completely before.

        At most ``max_open_pushes`` pushes per incarnation stay open: beyond
        that the oldest is written off as abandoned. A push that was written
        off is refused (:meth:`check`), never answered as a duplicate: it
        may be partly applied, and only its sender can decide what to do.
        """
        with self._lock:
            state = self._state(worker_id, incarnation)
            self._check(state, worker_id, incarnation, sequence)
            if state.completed(sequence):
                return None
            session = state.open.get(sequence)
            if session is not None:
                if session.total_elements != total_elements:
                    raise RequestError(
                        Reason.INVALID_REQUEST,
                        f"push {sequence} of {worker_id}/{incarnation} was begun before with "
                        f"{session.total_elements} elements, now with {total_elements}",
                    )
                return session
            while len(state.open) >= self._max_open:
                state.write_off(min(state.open))
            state.bound(self._max_window, self._max_ranges)
            session = PushSession((worker_id, incarnation, sequence), total_elements)
            state.open[sequence] = session
            return session

    def finish(self, session: PushSession, dropped: bool = False) -> None:
        """Record a completed push (call once, after its last chunk was applied); ``dropped``: sync
        mode dropped it whole, which a retry of it is answered too."""
        worker_id, incarnation, sequence = session.key
        with self._lock:
            state = self._state(worker_id, incarnation)
            state.mark_done(sequence)
            if dropped:
                state.dropped.add(sequence)
                if len(state.dropped) > _DROPPED_KEPT:
                    state.dropped.discard(min(state.dropped))
            state.bound(self._max_window, self._max_ranges)

    def was_dropped(self, worker_id: str, incarnation: str, sequence: int) -> bool:
        """Whether this completed push was dropped whole by sync mode (among the newest remembered)."""
        with self._lock:
            state = self._states.get((worker_id, incarnation))
            return state is not None and sequence in state.dropped

    def check(self, worker_id: str, incarnation: str, sequence: int) -> bool:
        """True when this push was applied completely before; False when not (yet).

        Raises RequestError(PUSH_WRITTEN_OFF) for a push the ledger wrote
        off: its chunks that arrived may have been applied, the rest never
        will be.
        """
        with self._lock:
            state = self._states.get((worker_id, incarnation))
            if state is None:
                return False
            self._check(state, worker_id, incarnation, sequence)
            return state.completed(sequence)

    def _check(self, state: _IncarnationState, worker_id: str, incarnation: str, sequence: int) -> None:
        if state.is_written_off(sequence):
            raise RequestError(
                Reason.PUSH_WRITTEN_OFF,
                f"push {sequence} of worker {worker_id!r} (incarnation {incarnation}) was written off: "
                f"this ps-server keeps at most {self._max_open} unfinished pushes per worker process and "
                f"{self._max_window} finished ones past its oldest unfinished one. The push may be partly "
                "applied (chunks that arrived before stay applied, the rest never will be); do not send it "
                "again: pull the current values and go on with a fresh gradient",
            )

    def snapshot(self, include_open: bool = True) -> list[dict]:
        """A JSON-able copy of the whole ledger, least recently used first.

        ``include_open=False`` leaves out unfinished pushes: in synchronous
        mode their effect lives in memory only (staged, not applied), so after
        a restart they must be sent again in full. Unfinished uploads of
        initial values (``uploads``) are always left out, for the same reason.
        """
        with self._lock:
            return [{"worker_id": w, "incarnation": i, "done_below": st.done_below,
                     "done_above": sorted(st.done_above),
                     "open": {str(seq): session.to_json() for seq, session in st.open.items()
                              if not session.uploads}
                     if include_open else {},
                     "off_above": sorted(st.off_above),
                     "written_off": [list(r) for r in st.written_off],
                     "forgotten_below": st.forgotten_below,
                     "dropped": sorted(st.dropped)}
                    for (w, i), st in self._states.items()]

    def restore(self, entries: list[dict]) -> None:
        """Replace the ledger with a snapshot taken by :meth:`snapshot`."""
        states: OrderedDict[tuple[str, str], _IncarnationState] = OrderedDict()
        for entry in entries:
            key = (entry["worker_id"], entry["incarnation"])
            states[key] = _IncarnationState(
                int(entry["done_below"]), {int(s) for s in entry["done_above"]},
                {int(seq): PushSession.from_json((*key, int(seq)), data) for seq, data in entry["open"].items()},
                {int(s) for s in entry.get("off_above", ())},
                [[int(a), int(b)] for a, b in entry.get("written_off", ())],
                int(entry.get("forgotten_below", 0)),
                {int(s) for s in entry.get("dropped", ())[-_DROPPED_KEPT:]})
        with self._lock:
            self._states = states

    def is_done(self, worker_id: str, incarnation: str, sequence: int) -> bool:
        """True only for a push known to be applied completely (never for one written off)."""
        with self._lock:
            state = self._states.get((worker_id, incarnation))
            return state is not None and state.completed(sequence)

    def _state(self, worker_id: str, incarnation: str) -> _IncarnationState:
        key = (worker_id, incarnation)
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = _IncarnationState()
            while len(self._states) > self._max_incarnations:
                self._states.popitem(last=False)
        else:
            self._states.move_to_end(key)
        return state
