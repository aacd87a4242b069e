"""This shard's variables: the registry of its parts, their creation and their lifecycle.

No gRPC here: the store works on numpy arrays and raises
:class:`~ps_server.core.errors.RequestError` for requests it refuses, always
before changing anything. A dense part's data and updates are in
:mod:`.parts`, a hash table's in :mod:`.tables`; every byte is booked with
the shard's :class:`~ps_server.core.memory.MemoryBook` before it is
allocated; uploads of explicit initial values are in :mod:`.uploads`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ps_server.core.errors import RequestError
from ps_server.core.gate import ApplyGate
from ps_server.core.info import VariableInfo
from ps_server.core.memory import BOOKING_SECONDS, Booking, MemoryBook, MemoryHold
from ps_server.core.parts import VariablePart
from ps_server.core.persistence import LoadedPart, PartSnapshot, SpecRecorder
from ps_server.core.tables import HashTablePart, pin_tables_rows, read_tables_rows
from ps_server.core.uploads import InitialUpload, InitialValues
from wehub_ps.errors import Reason
from wehub_ps.specs import Explicit, VariableSpec

__all__ = ["VariableStore"]


class VariableStore:
    """All variables of one shard; thread-safe.

    ``memory_limit`` bounds the bytes of values plus optimizer slots: a
    create that would exceed it is refused with MEMORY_LIMIT, so a hostile
    or mistaken shape cannot take the server down.

    Longer than 300 lines because creating, validating, booking and
    restoring all change the registry (parts, creates in flight, bookings)
    under its one lock, whose invariants are kept in one class.
    """

    def __init__(self, shard_index: int, num_shards: int, memory_limit: int,
                 gate: ApplyGate | None = None, max_rows: int = 0, max_variables: int = 100_000,
                 spec_log: SpecRecorder | None = None, disk_files: Callable[[str], Path] | None = None) -> None:
        """``disk_files(table name)``: where a table with a disk tier keeps its rows beyond its memory
        budget (None: no --disk-tier-dir, and such tables are refused)."""
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index {shard_index} is outside [0, {num_shards})")
        self.shard_index = shard_index
        self.num_shards = num_shards
        #: Server-wide cap on rows per hash table and shard (0: none).
        self.max_rows = max_rows
        #: Variables this shard holds at most: bounds memory for metadata and metric labels.
        self.max_variables = max_variables
        #: Mutations hold it shared, checkpoint snapshots exclusive.
        self.gate = gate or ApplyGate()
        #: Bumped on every mutation; a checkpoint is skipped when it did not move.
        #: (Unlocked increments may collapse under races, but never to "unchanged".)
        self.generation = 0
        self._memory = MemoryBook(shard_index, memory_limit)
        # The memory book's lock guards _parts and _filling too (and the book's bookings, reserved
        # and held bytes), so a part is booked and registered in one hold. Lock order: this lock,
        # then a part's; it is also taken inside a part's lock (a table books its growth, a
        # synchronous step's sum gives its bytes back), and no part's lock is taken under it then.
        self._lock = self._memory.lock
        self._parts: dict[str, VariablePart | HashTablePart] = {}
        #: Variables being created (filled outside the gate): set when installed or given up.
        self._filling: dict[str, threading.Event] = {}
        self._uploads = InitialValues(self._memory, self.gate, self._changed)
        #: Where specs and uploaded initial values are made durable (None: no --checkpoint-dir).
        self.spec_log = spec_log
        self._disk_files = disk_files

    @property
    def memory_limit(self) -> int:
        """Bytes of variables and requests in flight the shard books at most (--max-memory-bytes)."""
        return self._memory.limit

    @memory_limit.setter
    def memory_limit(self, limit: int) -> None:
        self._memory.limit = limit

    @property
    def reserved_bytes(self) -> int:
        """Bytes of variables (what Describe reports as stored)."""
        return self._memory.reserved_bytes

    @property
    def held_bytes(self) -> int:
        """Bytes held for requests in flight and unfinished pushes (see :meth:`hold`)."""
        return self._memory.held_bytes

    def give_back(self, cell: list[int]) -> None:
        """Give back ``cell[0]`` booked bytes; safe in a finalizer (takes no lock)."""
        self._memory.give_back(cell)

    def hold(self, nbytes: int, what: str) -> MemoryHold:
        """Book ``nbytes`` a request is about to allocate; MEMORY_LIMIT when they do not fit.

        Stored bytes and held bytes together stay within ``memory_limit``.
        Call before allocating; release the hold (``with`` or
        :meth:`MemoryHold.release`) when the bytes are freed.
        """
        return self._memory.hold(nbytes, what)

    def book(self, nbytes: int, what: str) -> None:
        """:meth:`hold` without the handle: give the bytes back with ``book(-nbytes, what)``."""
        self._memory.book(nbytes, what)

    #: How many times :meth:`restore` replaced the content (a checkpoint chain breaks there).
    restores = 0

    def _changed(self) -> None:
        self.generation += 1

    def read_rows(self, reads: list[tuple[VariablePart | HashTablePart, np.ndarray]]
                  ) -> list[tuple[np.ndarray, int]]:
        """(values, version) of rows of several parts, all or nothing.

        Hash tables create missing rows: every table's new rows are checked
        and booked before any table changes, so a refusal (row limit, memory
        limit) creates nothing and evicts nothing. Dense parts' rows were
        checked by the caller (:func:`ps_server.core.rows.parse_row_ids`).
        """
        with self.gate.shared():
            tables = [(part, ids) for part, ids in reads if isinstance(part, HashTablePart)]
            table_values = iter(read_tables_rows(tables, self._memory.reserve) if tables else [])
            out = []
            for part, ids in reads:
                values = next(table_values) if isinstance(part, HashTablePart) else part.read_rows(ids)
                out.append((values, part.version))
            if tables:
                self.generation += 1
            return out

    def lookup_rows(self, reads: list[tuple[VariablePart | HashTablePart, np.ndarray]], zeros: bool
                    ) -> list[tuple[np.ndarray, int]]:
        """(values, version) of rows of several parts, changing nothing: a hash table's missing rows
        are answered with their initializer's values (``zeros``: with zeros) and are not created, and
        no access is recorded for LRU eviction."""
        with self.gate.shared():
            return [(part.lookup_rows(ids, zeros) if isinstance(part, HashTablePart) else part.read_rows(ids),
                     part.version) for part, ids in reads]

    def has_expiry(self) -> bool:
        """Whether any table here has expiry (the sweeper's thread idles otherwise)."""
        return any(isinstance(part, HashTablePart) and part.expiry is not None for part in self.parts())

    def sweep_expiry(self, now: float) -> list[tuple[str, np.ndarray]]:
        """An expiry sweep of every table with expiry (row_policies); the tables it changed, each with
        the ids it removed (sorted), for the backups (:meth:`apply_sweep`)."""
        with self.gate.shared():
            swept = []
            for part in self.parts():
                if isinstance(part, HashTablePart) and part.expiry is not None:
                    ids, stamped = part.sweep(now)
                    if len(ids) or stamped:
                        swept.append((part.spec.name, ids))
            if swept:
                self.generation += 1
            return swept

    def apply_sweep(self, tables: list[tuple[VariablePart | HashTablePart, np.ndarray]], now: float) -> None:
        """A backup: the primary's sweep at ``now`` of these tables, removing these ids."""
        with self.gate.shared():
            for table, ids in tables:
                if not isinstance(table, HashTablePart):
                    raise RequestError(Reason.INVALID_REQUEST, f"{table.spec.name!r} is not a hash table")
                table.apply_sweep(ids, now)
            self.generation += 1

    def pin_rows(self, pins: list[tuple[HashTablePart, np.ndarray]]) -> None:
        """Synchronous mode: create and pin rows of several tables for the open step, all or nothing.

        Every table's rows are checked (row limits) and their growth booked
        before any table changes, so a refusal creates, pins and evicts
        nothing (see :func:`ps_server.core.tables.pin_tables_rows`).
        """
        if pins:
            pin_tables_rows(pins, self._memory.reserve)
            self.generation += 1

    def adopt_staged(self, staged: int, kept: int) -> None:
        """A synchronous push's staging, ``staged`` bytes booked for the push, joined the step's sums
        (or was dropped), which grew by ``kept`` bytes: those stay booked, as the variables' (until
        the step is applied or discarded), the rest is given back. Never refused: nothing grows."""
        self._memory.adopt_staged(staged, kept)

    def create(self, spec: VariableSpec) -> tuple[VariableInfo, bool]:
        """Create the variable (this shard's part of it); idempotent for the same spec.

        Returns (info, created). The initial values are generated outside the
        apply gate, so pushes and checkpoints carry on while a big variable
        fills; the part is installed under the gate in one step. A second
        create of the same variable blocks until the first one is installed
        (and recorded in the spec log). With a spec log, the spec is durable
        when this returns.
        """
        while True:
            with self._lock:
                existing = self._parts.get(spec.name)
                filling = self._filling.get(spec.name) if existing is None else None
                if existing is None and filling is None:
                    new = self._reserve_new(spec)
                    filling = self._filling[spec.name] = threading.Event()
                    break
            if existing is not None:
                self._check_same(existing, spec)
                self._make_durable(existing)
                return existing.info(), False
            filling.wait()  # another create of this name: use its part (or retry if it failed)
        try:
            if isinstance(new, VariablePart):
                new.allocate_and_fill()
            with self.gate.shared():  # a checkpoint sees the variable either whole or not at all
                with self._lock:
                    self._parts[spec.name] = new
                    del self._filling[spec.name]
                self.generation += 1
        except BaseException as exc:  # out of memory, or the gate sealed by a shutdown: nothing stays
            with self._lock:
                if self._filling.get(spec.name) is filling:
                    del self._filling[spec.name]
                    self._memory.reserved -= _cost(new)
            if isinstance(exc, MemoryError):
                raise RequestError(Reason.MEMORY_LIMIT,
                                   f"out of memory allocating {new.nbytes} bytes for {spec.name!r}") from None
            raise
        finally:
            filling.set()  # waiting creates of this name go on: with the part, or to try again
        self._make_durable(new)
        return new.info(), True

    def validate(self, spec: VariableSpec, booking: str = "") -> VariableInfo | None:
        """Refuse ``spec`` exactly as :meth:`create` would now, without creating anything.

        Returns the existing variable's info (same spec), or None when the
        variable is new or being created by another call. A client validates
        on every shard before it creates on any, so that a create refused by
        one shard (a conflict, --max-memory-bytes, --max-variables) leaves no
        part behind on the others.

        With ``booking`` (an id the client chose), a new variable's bytes
        (from an array: also the buffer its value is uploaded into, see
        :meth:`stage_upload`) and its place under --max-variables are booked
        for :data:`BOOKING_SECONDS` (validating again with the same id renews
        them): a create of the same spec in that time uses them, so memory
        taken by others between the validation and the create cannot refuse
        it. Another spec under the
        same name is refused while a booking of it lasts. Nothing else sees a
        booking: it is not a variable, not in Describe, the spec log or a
        checkpoint.
        """
        with self._lock:
            existing = self._parts.get(spec.name)
            if existing is None and spec.name not in self._filling:
                self._memory.collect()
                held = self._memory.bookings.get(spec.name)
                if held is not None:
                    self._check_booked_same(held, spec)
                    if held.owner == booking:  # this client again (a renewal or a retry)
                        held.expires = time.monotonic() + BOOKING_SECONDS
                    return None  # another client's booking of the same spec: its create will do
                new = self._checked_new(spec)
                if booking:
                    self._memory.held += _cost(new)
                    self._memory.bookings[spec.name] = Booking(spec, booking, _cost(new),
                                                         time.monotonic() + BOOKING_SECONDS)
                return None
        if existing is None:
            return None
        self._check_same(existing, spec)
        return existing.info()

    def cancel_booking(self, name: str, booking: str) -> None:
        """Give back ``booking``'s hold on ``name`` (no-op when it was used, expired or is another's)."""
        with self._lock:
            held = self._memory.bookings.get(name)
            if held is not None and held.owner == booking:
                del self._memory.bookings[name]
                self._memory.held -= held.nbytes

    @staticmethod
    def _check_booked_same(held: Booking, spec: VariableSpec) -> None:
        differences = held.spec.differences(spec)
        if differences:
            raise RequestError(
                Reason.SPEC_CONFLICT,
                f"variable {spec.name!r} is being created with a different spec: " + "; ".join(differences))

    def _reserve_new(self, spec: VariableSpec) -> VariablePart | HashTablePart:
        """A new, empty part for ``spec`` with its memory booked (called with _lock held).

        A booking of the same spec (whoever validated it) gives its bytes to the part.
        """
        self._memory.collect()
        held = self._memory.bookings.get(spec.name)
        if held is not None:
            self._check_booked_same(held, spec)
            del self._memory.bookings[spec.name]
            self._memory.held -= held.nbytes
        new = self._checked_new(spec)
        self._memory.reserved += _cost(new)
        return new

    def _checked_new(self, spec: VariableSpec) -> VariablePart | HashTablePart:
        """A new, empty part for ``spec``, refused unless it fits the limits; books nothing (_lock held)."""
        self._check_count()
        if spec.hash_table:
            table = self._new_table(spec, self._memory.reserve)
            self._memory.collect()
            if not self._memory.fits(table.nbytes):
                table.close()
                raise RequestError(
                    Reason.MEMORY_LIMIT,
                    f"hash table {spec.name!r} needs {table.nbytes} bytes for its empty id index on "
                    f"shard {self.shard_index}; {self._memory.in_use()} of the "
                    f"{self.memory_limit}-byte limit are in use (--max-memory-bytes)")
            return table
        part = spec.placement(self.num_shards).part_on(self.shard_index)
        row_start, row_end = (part.row_start, part.row_end) if part else (0, 0)
        new = VariablePart(spec, row_start, row_end, part is not None)
        new.reserve = self._memory.reserve
        if isinstance(spec.initializer, Explicit) and new.elements:
            # The buffer its initial value is uploaded into, booked with it (see stage_upload).
            new.upload_share = new.elements * spec.dtype.itemsize
            new.share_free = True
        self._memory.collect()
        if not self._memory.fits(_cost(new)):
            what = ("values, optimizer slots and the buffer its initial value is uploaded into"
                    if new.upload_share else "values and optimizer slots")
            raise RequestError(
                Reason.MEMORY_LIMIT,
                f"variable {spec.name!r} needs {_cost(new)} bytes on shard "
                f"{self.shard_index} ({what}); {self._memory.in_use()} of "
                f"the {self.memory_limit}-byte limit are in use (--max-memory-bytes)",
            )
        return new

    def _make_durable(self, part: VariablePart | HashTablePart) -> None:
        """Record the part's spec in the spec log unless it is there already (or there is no log)."""
        if self.spec_log is None or part.durable:
            return
        self.spec_log.record_spec(part.spec)
        part.durable = True

    def _new_table(self, spec: VariableSpec, reserve: Callable[[int], None]) -> HashTablePart:
        disk_file = self._disk_files(spec.name) if spec.tier is not None and self._disk_files is not None else None
        return HashTablePart(spec, self._table_limit(spec), reserve, disk_file)

    def close(self) -> None:
        """The server stops: tables let go of their disk tiers' files."""
        for part in self.parts():
            if isinstance(part, HashTablePart):
                part.close()

    def _table_limit(self, spec: VariableSpec) -> int:
        limits = [n for n in (spec.max_rows, self.max_rows) if n]
        return min(limits) if limits else 0

    # ---- explicit initial values (see ps_server.core.uploads) ----

    def stage_upload(self, part: VariablePart, wait_seconds: float | None = None) -> InitialUpload | None:
        """A private buffer for one upload of ``part``'s initial value (:meth:`InitialValues.stage`)."""
        return self._uploads.stage(part, wait_seconds)

    def install_upload(self, upload: InitialUpload) -> bool:
        """Make a complete upload the part's initial value unless it has one; recorded in the spec log
        first (:meth:`InitialValues.install`). True when this upload became the value."""
        return self._uploads.install(upload, self.spec_log)

    def _check_count(self) -> None:
        """Called with _lock held, before adding a variable."""
        if len(self._parts) + len(self._filling) + len(self._memory.bookings) >= self.max_variables:
            raise RequestError(Reason.MEMORY_LIMIT,
                               f"shard {self.shard_index} already holds {len(self._parts)} variables and "
                               f"{len(self._filling) + len(self._memory.bookings)} being created, its limit "
                               "(--max-variables); merge small variables or raise the limit")

    @staticmethod
    def _check_same(existing, spec: VariableSpec) -> None:
        differences = existing.spec.differences(spec)
        if differences:
            raise RequestError(
                Reason.SPEC_CONFLICT,
                f"variable {spec.name!r} already exists with a different spec: " + "; ".join(differences),
            )

    def get(self, name: str) -> VariablePart:
        with self._lock:
            part = self._parts.get(name)
        if part is None:
            raise RequestError(Reason.UNKNOWN_VARIABLE,
                               f"variable {name!r} does not exist; create it with create_variable first")
        return part

    def known_names(self, names: list[str]) -> list[str]:
        """The names among ``names`` that are variables here, or ``["-"]`` when none is.

        Metric labels come from it: a request naming unknown variables must
        not create a label value (and a time series) per name it makes up.
        """
        with self._lock:
            known = [name for name in names if name in self._parts]
        return known or ["-"]

    def parts(self) -> list[VariablePart]:
        with self._lock:
            return list(self._parts.values())

    def describe(self) -> list[VariableInfo]:
        return [part.info() for part in self.parts()]

    def apply_accumulated(self, step: int) -> list[str]:
        """Synchronous mode: apply step ``step`` on every part; returns the variables updated.

        The caller holds the gate exclusive: no push merges into the step
        while it is applied part by part, so a push is in every part's sum
        of the step or in none.
        """
        applied = []
        for part in self.parts():
            if part.apply_accumulated(step):
                applied.append(part.spec.name)
        self.generation += 1
        return applied

    def start_step(self, step: int) -> None:
        """Synchronous mode: every part accumulates ``step`` from now on."""
        for part in self.parts():
            part.start_step(step)

    def snapshot(self, stream_disk: bool = False) -> list[PartSnapshot]:
        """Copies of every part; call with the gate held exclusive for a consistent instant.

        ``stream_disk``: tables leave their rows on disk in place for the
        snapshot's writer (``PartSnapshot.disk_rows``), who must release them.
        """
        return [part.snapshot(stream_disk) if isinstance(part, HashTablePart) else part.snapshot()
                for part in self.parts()]

    def checkpoint_snapshot(self, delta: bool) -> tuple[list[PartSnapshot], bool]:
        """A checkpoint's copies (the gate held exclusive), and whether they are a delta.

        ``delta``: the tables give only their rows changed since the last
        checkpoint snapshot, and the ids removed since; when a table did not
        keep all of those, every part is copied whole instead. Either way the
        tables count their changes afresh from this instant.
        """
        parts = self.parts()
        snapshots = None
        if delta:
            snapshots = [part.delta_snapshot() if isinstance(part, HashTablePart) else part.snapshot()
                         for part in parts]
            if any(s is None for s in snapshots):
                snapshots = None
        whole = snapshots is None
        if whole:
            snapshots = self.snapshot(stream_disk=True)
        for part in parts:
            if isinstance(part, HashTablePart):
                part.forget_changes()
        return snapshots, not whole

    def restore(self, loaded: list[LoadedPart]) -> None:
        """Replace the store's content with parts read from a checkpoint (before serving).

        All or nothing: when the parts would not fit the memory limit, the
        store is left as it was.
        """
        reserved = 0

        def reserve(delta: int) -> None:
            nonlocal reserved
            if reserved + delta > self.memory_limit:
                raise RequestError(Reason.MEMORY_LIMIT,
                                   f"the checkpoint needs more than shard {self.shard_index}'s "
                                   f"{self.memory_limit}-byte limit (--max-memory-bytes)")
            reserved += delta

        parts: dict[str, VariablePart | HashTablePart] = {}
        try:
            for item in loaded:
                if item.rows is not None:
                    table = self._new_table(item.spec, reserve)
                    parts[item.spec.name] = table  # closed with the others if anything below fails
                    reserve(table.nbytes)
                    table.load_rows(item.rows, item.version, item.optimizer_steps, item.evicted_rows,
                                    item.access_clock, item.policy_counts, item.admission_counts,
                                    item.admission_sightings, item.disk_sources)
                    table.restore_accumulator(item.accumulator)
                else:
                    part = VariablePart.from_checkpoint(item)
                    reserve(part.nbytes + part.accumulator_bytes)  # the step's sum, as its pushes booked it
                    parts[item.spec.name] = part
        except BaseException:
            for part in parts.values():  # all or nothing: the new tables' files go too
                if isinstance(part, HashTablePart):
                    part.close()
            raise
        for part in parts.values():
            part.durable = True  # from a checkpoint or the spec log: already on disk
            part.reserve = self._memory.reserve
        with self._lock:
            replaced, self._parts = self._parts, parts
            self._memory.reserved = reserved
            self.restores += 1
        for part in replaced.values():
            if isinstance(part, HashTablePart):
                part.close()


def _cost(part: VariablePart | HashTablePart) -> int:
    """Bytes a new part books: its own, and for a create from an array its upload share."""
    return part.nbytes + (part.upload_share if isinstance(part, VariablePart) else 0)
