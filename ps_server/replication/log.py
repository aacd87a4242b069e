"""The primary's log: one order for every change, and what each backup has of it.

The primary applies a change and appends its record in one hold of the
order lock (:meth:`UpdateLog.ordered`), so the sequence numbers are the
order the changes were applied in; every attached backup gets the records
in that order, each carrying the term's epoch. An answer counts as an
acknowledgement only when it names this term (``positions.acknowledges``):
a backup names it once it installed this term's snapshot on the stream.
Records are held only until each backup acknowledged them,
up to a byte bound per backup: a backup that falls further behind is cut
off (it catches up again from a snapshot) instead of growing the primary.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from ps_server.coordination.positions import acknowledges
from wehub_ps.wire.replication import record_pieces

__all__ = ["BackupLink", "UpdateLog"]


class BackupLink:
    """One backup as its primary sees it: records queued for it, what it acknowledged, when it was alive.

    Every message the primary sends (a snapshot piece, a record, a ping) is
    acknowledged by exactly one answer, in order, so the n-th answer says
    the backup was alive after the n-th message was sent: ``proof`` is the
    send time of the newest message answered.
    """

    def __init__(self, replica_index: int, incarnation: int, address: str, max_bytes: int,
                 on_change: Callable[[], None], epoch: int) -> None:
        #: The primary's term: only answers naming it acknowledge changes.
        self.epoch = epoch
        self.replica_index = replica_index
        self.incarnation = incarnation
        self.address = address
        self._max_bytes = max_bytes
        self._on_change = on_change
        self._cond = threading.Condition()
        #: (sequence, the record as pieces, its bytes)
        self._queue: deque[tuple[int, list, int]] = deque()
        self.queued_bytes = 0
        #: The newest sequence of this term's log the backup applied (and acknowledged).
        self.acknowledged = 0
        #: Answers that proved the backup alive but acknowledged nothing (another term, no snapshot yet).
        self.ignored_answers = 0
        #: When the backup first answered in this term, i.e. had installed its snapshot (monotonic; 0: not yet).
        self.installed_at = 0.0
        #: The log's sequence when it had (set by the primary's monitor): once the backup acknowledged it,
        #: it joins the in-sync set, and acknowledgements after it wait for the backup.
        self.join_at: int | None = None
        #: When it acknowledged ``join_at`` (monotonic): acknowledgements wait for it from then on.
        self.joined_at = 0.0
        #: Set once the take-over message (a planned switchover, see ``hand_over``) was written.
        self.handed_over = threading.Event()
        #: The sequence the backup's snapshot holds: records after it are queued from the start.
        self.start_sequence = 0
        #: The newest sequence sent (or in the snapshot).
        self.sent_sequence = 0
        self._unanswered: deque[float] = deque()
        #: monotonic send time of the newest message the backup answered (0: none yet).
        self.proof = 0.0
        #: When the oldest message still unanswered was sent (0: none outstanding).
        self.waiting_since = 0.0
        #: Why the link is closed (None while open).
        self.closed: str | None = None
        #: Whether the backup's host acknowledged the stream's bytes within the given seconds at the TCP
        #: level (None: not known); set by the stream (FramedConnection.peer_acknowledged_within).
        self.transport_alive: Callable[[float], bool | None] = lambda seconds: None

    @property
    def key(self) -> tuple[int, int]:
        return self.replica_index, self.incarnation

    def enqueue(self, sequence: int, record: list, nbytes: int) -> None:
        """Called in the log's order; a backup past its byte bound is cut off."""
        with self._cond:
            if self.closed is not None:
                return
            if self.queued_bytes + nbytes > self._max_bytes and self._queue:
                self._close_locked(f"more than {self._max_bytes} bytes of changes not yet sent to it")
                return
            self._queue.append((sequence, record, nbytes))
            self.queued_bytes += nbytes
            self._cond.notify_all()

    def hand_over(self) -> None:
        """Queue the take-over message after every record queued so far (the stream's thread sends it,
        then sets ``handed_over``); the caller holds the log's order, so no record can follow it."""
        with self._cond:
            if self.closed is None:
                self._queue.append((TAKE_OVER, [], 0))
                self._cond.notify_all()

    def wait_closed(self, timeout: float) -> bool:
        """Wait until the link is closed, at most ``timeout`` seconds; whether it is."""
        with self._cond:
            return self._cond.wait_for(lambda: self.closed is not None, timeout)

    def take(self, timeout: float) -> list[tuple[int, list]]:
        """The queued (sequence, record) (waiting up to ``timeout`` for one); [] on timeout or once closed."""
        with self._cond:
            if not self._queue and self.closed is None:
                self._cond.wait(timeout)
            records = [(sequence, record) for sequence, record, _ in self._queue]
            self._queue.clear()
            self.queued_bytes = 0
            return records

    def sending(self, sequence: int) -> None:
        """A message is handed to the stream; it brings the backup to ``sequence``."""
        now = time.monotonic()
        with self._cond:
            if not self._unanswered:
                self.waiting_since = now
            self._unanswered.append(now)
            self.sent_sequence = max(self.sent_sequence, sequence)

    def answered(self, epoch: int, applied: int) -> None:
        """The backup answered the oldest unanswered message: it has applied up to ``applied`` of term
        ``epoch``'s log. Any answer proves it alive; only one naming this term acknowledges changes."""
        with self._cond:
            if self._unanswered:
                self.proof = self._unanswered.popleft()
            self.waiting_since = self._unanswered[0] if self._unanswered else 0.0
            if acknowledges(self.epoch, epoch):
                self.acknowledged = max(self.acknowledged, applied)
                if not self.installed_at:
                    self.installed_at = time.monotonic()
            else:
                self.ignored_answers += 1
        self._on_change()

    def close(self, why: str) -> None:
        with self._cond:
            self._close_locked(why)
        self._on_change()

    def _close_locked(self, why: str) -> None:
        if self.closed is None:
            self.closed = why
            self._queue.clear()
            self.queued_bytes = 0
            self._cond.notify_all()


#: In a backup's queue: not a record but the take-over message of a planned switchover.
TAKE_OVER = -1


class UpdateLog:
    """Numbers the primary's changes in the order they were applied and queues them for its backups."""

    def __init__(self, sequence: int = 0) -> None:
        #: Held while a change is applied and appended (never while waiting for anything else).
        self._order = threading.Lock()
        self.sequence = sequence
        self._links: list[BackupLink] = []

    def ordered(self) -> threading.Lock:
        return self._order

    def append(self, op: list, nbytes: int) -> int:
        """The caller holds ``ordered()``: give the change ``op`` (a record's op as pieces, see
        wehub_ps.wire.replication) the next sequence and queue it for every backup."""
        if not self._order.locked():  # two unordered appends could queue their sequences swapped
            raise RuntimeError("a change was logged outside the shard's order")
        self.sequence += 1
        record = record_pieces(self.sequence, op)
        for link in self._links:
            link.enqueue(self.sequence, record, nbytes)
        return self.sequence

    def attach(self, link: BackupLink) -> int:
        """The caller holds ``ordered()`` (with the snapshot taken in the same hold): records from now on
        go to ``link``; returns the sequence the snapshot holds."""
        link.start_sequence = link.sent_sequence = self.sequence
        self._links = [*self._links, link]
        return self.sequence

    def detach(self, link: BackupLink) -> None:
        with self._order:
            self._links = [other for other in self._links if other is not link]
