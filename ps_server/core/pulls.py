"""Planning one pull: what to send, checked before the first byte is sent.

The counterpart of :mod:`ps_server.core.pushes`. A plan is made from plain
request values (:class:`PullQuery`); every check raises a
:class:`~ps_server.core.errors.RequestError`, and the bytes the answer will
hold are booked with the store before anything is read. Rows are read while
planning, all requests' rows at once under the store's gate (a hash table
creates missing rows then, all or nothing); a dense range is read under its
part's lock as each chunk is framed (:mod:`ps_server.service.pull_stream`).

No gRPC here: the service layer turns a PullRequest into a query.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeAlias

import numpy as np

from ps_server.core.consistency import ConsistencyController
from ps_server.core.errors import RequestError
from ps_server.core.lifecycle import Lifecycle
from ps_server.core.ordering import UNLOGGED, ChangeLog
from ps_server.core.pushes import check_cluster
from ps_server.core.rows import RowGather, gathered_bytes, parse_row_ids, rows_in_order, unique_ids
from ps_server.core.store import MemoryHold, VariablePart, VariableStore
from ps_server.core.tables import HashTablePart
from ps_server.core.workers import WorkerPresence, check_worker
from wehub_ps.dtypes import VARIABLE_DTYPES, dtype_name, is_bfloat16
from wehub_ps.errors import Reason

__all__ = ["PullItemFields", "UnknownDtype", "PullQuery", "LOOKUP_CREATE", "LOOKUP_READ_ONLY",
           "LOOKUP_READ_ONLY_ZEROS", "RangeRead", "RowsRead", "PullRead", "PullPlan",
           "PullPlanner", "MIN_CHUNK_BYTES"]

#: The smallest chunk a pull is answered in, whatever the request asks for.
MIN_CHUNK_BYTES = 4096


class PullItemFields(Protocol):
    """One variable of a pull, as the request names it (a PullRequest.Item fits)."""

    variable: str
    #: Dense range: first element and element count (0: to the end of the part).
    offset: int
    count: int
    #: Rows: little-endian int64 ids; empty for a range.
    row_ids: bytes


@dataclass(frozen=True)
class UnknownDtype:
    """A wire dtype code that names no dtype; refused (DTYPE_MISMATCH) where dtypes are checked."""

    code: int


class PullQuery(NamedTuple):
    """A pull request's values (built for every pull: a NamedTuple is the cheapest to build)."""

    shard_index: int
    num_shards: int
    #: Empty id or incarnation: an anonymous reader (no lease, no step clock).
    worker_id: str
    incarnation: str
    step: int
    items: Sequence[PullItemFields]
    #: 0: the server's default; clamped to [MIN_CHUNK_BYTES, the server's maximum].
    chunk_bytes: int
    #: None: each variable in its own dtype.
    wire_dtype: np.dtype | UnknownDtype | None
    #: Hash-table rows: LOOKUP_CREATE (a training pull), or read without any change (LOOKUP_READ_ONLY,
    #: missing rows answered with their initializer's values; LOOKUP_READ_ONLY_ZEROS, with zeros).
    lookup: int = 0


#: PullQuery.lookup values (wehub_ps.v1.RowLookup).
LOOKUP_CREATE, LOOKUP_READ_ONLY, LOOKUP_READ_ONLY_ZEROS = 0, 1, 2


#: ``(part, start, count, wire)``: ``count`` elements of a dense part from ``start``, read as
#: they are framed. A plain tuple: one is built per variable of every pull, and a NamedTuple's
#: constructor costs that hot path about half a microsecond per variable more.
RangeRead: TypeAlias = tuple[VariablePart, int, int, np.dtype]


class RowsRead(NamedTuple):
    """Rows read when planned (or, a dense part's, gathered from it as the message is joined)."""

    part: VariablePart | HashTablePart
    values: np.ndarray | RowGather
    #: The version the rows were read at (or, gathered later, a version no newer than theirs).
    version: int
    wire: np.dtype


#: A read of a plan: a :class:`RowsRead`, else a :data:`RangeRead`.
PullRead: TypeAlias = RangeRead | RowsRead


@dataclass(frozen=True)
class PullPlan:
    """A checked pull: its reads in request order, sent in chunks of ``chunk_bytes``.

    ``hold`` books the bytes the answer keeps until it is sent; release it
    (or leave it as a context manager) when the answer is gone.
    """

    reads: list[PullRead]
    chunk_bytes: int
    hold: MemoryHold


class _Gather(NamedTuple):
    """Rows of one item to read with every other item's, each id once."""

    index: int
    part: VariablePart | HashTablePart
    unique: np.ndarray
    inverse: np.ndarray | None
    wire: np.dtype


class PullPlanner:
    """Checks pulls and plans their reads on one shard."""

    def __init__(self, store: VariableStore, lifecycle: Lifecycle, consistency: ConsistencyController,
                 workers: WorkerPresence, default_chunk_bytes: int, max_chunk_bytes: int,
                 changes: ChangeLog = UNLOGGED) -> None:
        self._store = store
        #: A replicated shard's order of changes: reading hash-table rows changes the tables.
        self._changes = changes
        self._lifecycle = lifecycle
        self._consistency = consistency
        self._workers = workers
        self._default_chunk_bytes = default_chunk_bytes
        self._max_chunk_bytes = max_chunk_bytes

    def plan(self, query: PullQuery, whole_reply: bool = False) -> PullPlan:
        """Validate everything before the first byte is sent, and book the bytes the pull will hold.

        ``whole_reply``: the answer is built as one message (Exchange,
        pull_after), so its bytes are booked too; a Pull stream holds one
        message at a time.
        """
        store = self._store
        self._lifecycle.check_accepting()
        check_cluster(store, query.shard_index, query.num_shards)
        if query.worker_id and query.incarnation:
            check_worker(query.worker_id, query.incarnation)
            self._workers.seen(query.worker_id, query.incarnation, query.step)
        if not query.items:
            raise RequestError(Reason.INVALID_REQUEST, "a pull must name at least one variable")
        chunk_bytes = query.chunk_bytes or self._default_chunk_bytes
        chunk_bytes = max(MIN_CHUNK_BYTES, min(chunk_bytes, self._max_chunk_bytes))
        requested = _checked_wire_dtype(query.wire_dtype)
        if query.lookup not in (LOOKUP_CREATE, LOOKUP_READ_ONLY, LOOKUP_READ_ONLY_ZEROS):
            raise RequestError(Reason.INVALID_REQUEST, f"unknown row lookup {query.lookup} (0: create missing "
                                                       "rows, 1: read only, 2: read only, zeros for missing rows)")
        reads: list = []
        reply_bytes = 0
        gathers: list[_Gather] = []
        for item in query.items:
            part = store.get(item.variable)
            if item.row_ids or part.spec.hash_table:
                if not item.row_ids:
                    raise RequestError(Reason.INVALID_REQUEST,
                                       f"{item.variable!r} is a hash table: pull it by rows (pull_rows)")
                ids, local = parse_row_ids(part, item.row_ids, store.shard_index, store.num_shards,
                                           unique=False)
                if not part.initialized:  # a bool read: no lock needed
                    raise RequestError(Reason.NOT_INITIALIZED, f"variable {item.variable!r} is waiting "
                                                               "for its explicit initial value")
                wire = requested or part.spec.dtype
                reply_bytes += len(ids) * part.spec.row_elements * wire.itemsize
                if local is not None and wire == part.spec.dtype:
                    # Rows of a dense part stay where they are: each is copied once, from the
                    # table into the message as it is joined (under the part's lock). The
                    # version is read first: it is the rows' or, after a push in between, older.
                    version = part.version  # (one int read: no lock, no VariableInfo)
                    reads.append(RowsRead(part, part.rows_to_send(local), version, wire))
                    continue
                # Gathered below, each id once, with every other item's rows.
                unique, inverse = unique_ids(ids)
                gathers.append(_Gather(len(reads), part, unique, inverse, wire))
                reads.append(None)
                continue
            if not part.holds_part:
                raise RequestError(Reason.INVALID_REQUEST,
                                   f"variable {item.variable!r} has no part on shard {store.shard_index}")
            if not part.initialized:  # a bool read: no lock needed
                raise RequestError(Reason.NOT_INITIALIZED,
                                   f"variable {item.variable!r} is waiting for its explicit initial value")
            end = part.elements if item.count == 0 else item.offset + item.count
            if item.offset > part.elements or end > part.elements:
                raise RequestError(
                    Reason.INVALID_CHUNK,
                    f"pull range [{item.offset}, {end}) of {item.variable!r} is outside this "
                    f"shard's part of {part.elements} elements")
            wire = requested or part.spec.dtype
            reply_bytes += (end - item.offset) * wire.itemsize
            reads.append((part, item.offset, end - item.offset, wire))
        held = sum(gathered_bytes(g.part, len(g.unique), g.inverse, g.wire) for g in gathers)
        hold = store.hold(held + (reply_bytes if whole_reply else 0), "this pull's answer")
        if gathers:
            # Every request is checked above: read (and, in a hash table, create) all rows at once,
            # all or nothing, so a refusal leaves nothing behind and the rows are one instant.
            try:
                read = self._read_rows(gathers, query.lookup)
            except BaseException:
                hold.release()
                raise
            for g, (values, version) in zip(gathers, read):
                reads[g.index] = RowsRead(g.part, rows_in_order(values, g.inverse, g.wire), version, g.wire)
        return PullPlan(reads, chunk_bytes, hold)

    def _read_rows(self, gathers: list[_Gather], lookup: int) -> list[tuple[np.ndarray, int]]:
        """The rows of every gather; reads of hash tables are changes, logged in the shard's order,
        unless read only (nothing changes, nothing to log)."""
        reads = [(g.part, g.unique) for g in gathers]
        if lookup != LOOKUP_CREATE:
            return self._store.lookup_rows(reads, zeros=lookup == LOOKUP_READ_ONLY_ZEROS)
        tables = [(g.part.spec.name, g.unique) for g in gathers if isinstance(g.part, HashTablePart)]
        if not tables:
            return self._store.read_rows(reads)
        with self._changes.ordered():
            read = self._store.read_rows(reads)
            self._changes.table_rows_read(tables)
        return read

    def plan_after_push(self, query: PullQuery) -> PullPlan:
        """Plan a push's pull_after (whole dense variables, async mode only) before the push is applied."""
        if self._consistency.mode != "async":
            raise RequestError(Reason.INVALID_REQUEST,
                               f"pull_after needs --consistency async (this server runs "
                               f"{self._consistency.mode}): there the next step's pull waits for the "
                               "other workers, so pull it separately")
        if any(item.row_ids for item in query.items):
            raise RequestError(Reason.INVALID_REQUEST, "pull_after reads whole dense variables, not rows")
        return self.plan(query, whole_reply=True)


def _checked_wire_dtype(wire_dtype: np.dtype | UnknownDtype | None) -> np.dtype | None:
    """The dtype a pull asked for, refused unless variables can be sent in it."""
    if wire_dtype is None:
        return None
    if isinstance(wire_dtype, UnknownDtype):
        raise RequestError(Reason.DTYPE_MISMATCH, f"unknown wire dtype {wire_dtype.code}")
    if wire_dtype not in VARIABLE_DTYPES and not is_bfloat16(wire_dtype):
        raise RequestError(Reason.DTYPE_MISMATCH,
                           f"variables can be pulled as floating types only, not {dtype_name(wire_dtype)}")
    return wire_dtype
