"""Applying one push stream: validation, exactly-once chunks, completion.

The push protocol (see ``protos/wehub_ps/v1/ps.proto``): the first message
carries a ``PushBegin`` that declares every variable the push covers on
this shard, and chunks follow. Everything that can be checked up front is
checked at the begin (cluster identity, variables, sizes, dtypes), before
anything is applied; each chunk is checked again before it is applied.
A stream that breaks midway leaves the chunks before the break applied and
recorded in the ledger, and a retry of the same push completes it, exactly
once. A message whose chunk is refused while it is applied (a hash table
at its row or memory limit) breaks the same way, at that chunk: the chunks
before it stay applied (:attr:`ActivePush.applied_chunks`), which is what a
replicated shard logs of the message (see :meth:`ActivePush.apply_many`).

No gRPC and no protobuf here: the service layer decodes the messages into
a :class:`PushStart` and :class:`PushChunk` values and feeds them in.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ps_server.core.accumulator import PushStaging, staged_rows_bytes
from ps_server.core.consistency import ConsistencyController, PushDecision
from ps_server.core.errors import RequestError
from ps_server.core.ledger import ClaimResult, PushLedger, PushSession
from ps_server.core.parts import VariablePart, check_dtype_allowed
from ps_server.core.rows import parse_row_ids
from ps_server.core.store import VariableStore
from ps_server.core.tables import HashTablePart
from wehub_ps.dtypes import dtype_name
from wehub_ps.errors import Reason

__all__ = ["PushKind", "DeclaredItem", "PushStart", "PushChunk", "PushObserver", "PushResult", "ActivePush",
           "Decided", "begin_push", "check_cluster", "max_chunk_records", "max_chunks_per_message"]

MAX_WORKER_ID_LENGTH = 256


class PushKind(enum.Enum):
    GRADIENT = "gradient"  # applied by the variable's optimizer
    ASSIGN = "assign"  # the variable's explicit initial value


#: One variable a push covers on this shard, as its begin declares it: its name, its elements, the
#: dtype of its chunks (or the code the service found no dtype for, refused as unknown), its row ids
#: as little-endian int64 bytes (empty: the whole part) and the version the gradient was computed
#: from (0: not said). A plain tuple, as :data:`PushChunk`.
DeclaredItem = tuple[str, int, "np.dtype | int", bytes, int]


@dataclass(frozen=True)
class PushStart:
    """A push's begin: who pushes, which sequence and step, and the variables it covers here."""

    shard_index: int
    num_shards: int
    worker_id: str
    incarnation: str
    sequence: int
    step: int
    #: The kind, or the code the service found no kind for (refused).
    kind: PushKind | int
    items: Sequence[DeclaredItem]


#: One received chunk: the variable, its dtype (or the code the service found no dtype for, refused
#: as unknown), the offset and count of its elements and its bytes (a view of the message). A plain
#: tuple: one is built per chunk of every push, and a named tuple's constructor costs several times
#: as much.
PushChunk = tuple[str, "np.dtype | int", int, int, memoryview]


class Decided(Protocol):
    """Where a replicated primary logs a sync push's decision (the servicer's stream)."""

    def __call__(self, step: int, decision: str, pins: list[tuple[HashTablePart, np.ndarray]]) -> None:
        """Under the shard's order and the gate: ``decision`` (ACCUMULATE or DROP) was taken for a push of
        ``step``, and (ACCUMULATE) ``pins`` were pinned for it, in this order."""


class PushObserver(Protocol):
    """Where pushes report what the server's metrics count."""

    def push_applied(self, seconds: float) -> None:
        """One message's chunks took ``seconds`` to apply."""

    def push_staleness(self, staleness: list[int]) -> None:
        """A push began, its gradients this many versions behind each variable's."""


@dataclass(frozen=True)
class PushResult:
    versions: dict[str, int]
    duplicate: bool
    elements_applied: int
    dropped: bool = False
    cluster_step: int = 0


@dataclass(frozen=True)
class _Item:
    part: VariablePart | HashTablePart
    wire_dtype: np.dtype
    #: Row pushes: the rows updated, in the order of the pushed block.
    row_ids: np.ndarray | None = None
    elements: int = 0
    #: Elements per row (the part's spec.row_elements, looked up once per push).
    width: int = 1
    #: A dense part's row pushes: the same rows as indices into the part (checked at the begin).
    local_rows: np.ndarray | None = None


def check_cluster(store: VariableStore, shard_index: int, num_shards: int) -> None:
    """Refuse a caller whose address list disagrees with this server."""
    if (shard_index, num_shards) != (store.shard_index, store.num_shards):
        raise RequestError(
            Reason.CLUSTER_MISMATCH,
            f"this server is shard {store.shard_index} of {store.num_shards}, but the request "
            f"was meant for shard {shard_index} of {num_shards}; check the order and length of "
            "the client's address list",
        )


class ActivePush:
    """One push stream in progress on this shard."""

    def __init__(self, store: VariableStore, ledger: PushLedger, begin: PushStart,
                 items: dict[str, _Item], session: PushSession | None,
                 consistency: ConsistencyController | None, decision: str,
                 observer: PushObserver | None = None) -> None:
        self._store = store
        self._ledger = ledger
        self._assign = begin.kind is PushKind.ASSIGN
        self._items = items
        self._session = session
        self._consistency = consistency
        self._decision = decision
        self._worker_id = begin.worker_id
        self._step = begin.step
        self._applied_here = 0
        self._versions: dict[str, int] = {}
        self._dropped = decision == PushDecision.DROP
        self._observer = observer
        #: An ASSIGN push: whether its upload became a variable's initial value.
        self._installed = False
        #: Chunks of the newest message, from its first, that :meth:`apply_many` applied (or found
        #: applied before): all of them once it returns, those before the refused one when it raises.
        self.applied_chunks = 0
        #: Whether completing the push applies a sync step it finished at once; else :meth:`settle` does,
        #: which a replicated primary calls once the push is logged (the step's record comes after it).
        self.applies_steps = True

    def apply(self, chunk: PushChunk) -> None:
        """Check one chunk and apply it unless this push applied it before."""
        self.apply_many([chunk])

    def apply_many(self, chunks: list[PushChunk]) -> None:
        """Check every chunk of one message, then apply them under one hold of the gate.

        A message of a small model carries a chunk per variable; taking the
        gate and timing once per message instead of once per chunk saves
        that work for every variable (yappi showed the gate's condition and
        the histogram among the server's largest costs in such a step). A
        chunk that fails its checks refuses the whole message before any of
        it is applied.

        A chunk refused while it is applied (a hash table's rows past its
        limit, its growth past the memory limit, a chunk overlapping one the
        push recorded with other bounds) raises there: the chunks before it
        stay applied and recorded, the refused chunk and those after it
        change nothing, and :attr:`applied_chunks` says how many came before
        it. Refusals are not booked for the whole message first because
        they depend on more than the message (the memory that concurrent
        pulls and requests hold, rows other requests create or evict, other
        streams of the push), which no check taken before applying can hold
        still. So a replicated shard logs exactly that prefix of the message
        (``_LoggedStream.refused`` in the servicer), and a backup applies it
        whole with this same code: its values, optimizer slots and ledger
        are the primary's, and a retry of the push applies the rest exactly
        once on whichever replica leads.
        """
        self.applied_chunks = 0
        checked = [self._check(chunk) for chunk in chunks]
        if self._session is None or not checked:
            self.applied_chunks = len(checked)
            return  # the whole push is a duplicate, or nothing came
        self._session.make_room(len(checked))  # a message past the push's bound is refused whole
        started = time.perf_counter()
        completed = False
        # Claim, apply and record under the shared gate, so that a checkpoint
        # sees each chunk either applied and recorded, or neither.
        with self._store.gate.shared():
            for name, item, offset, values in checked:
                whole = bool(values.size) and self._apply_one(name, item, offset, values)
                self.applied_chunks += 1
                if whole:
                    completed = True
                    self._finalize()
        if self._observer is not None:
            self._observer.push_applied(time.perf_counter() - started)
        if completed and self.applies_steps:
            self._after_complete()

    def settle(self) -> None:
        """Apply a sync step this push finished, if it has not been (with ``applies_steps`` False)."""
        self._after_complete()

    def _check(self, chunk: PushChunk) -> tuple[str, _Item, int, np.ndarray]:
        """Everything that can be wrong with a chunk, before anything is applied."""
        variable, wire, offset, count, data = chunk
        item = self._items.get(variable)
        if item is None:
            raise RequestError(Reason.INVALID_CHUNK,
                               f"chunk for {variable!r}, which this push's begin did not declare")
        if type(wire) is int:
            raise RequestError(Reason.INVALID_CHUNK, f"chunk for {variable!r} has unknown dtype {wire}")
        if wire != item.wire_dtype:
            raise RequestError(
                Reason.INVALID_CHUNK,
                f"chunk for {variable!r} is {dtype_name(wire)}, but the push declared "
                f"{dtype_name(item.wire_dtype)}",
            )
        if offset + count > item.elements:
            raise RequestError(
                Reason.INVALID_CHUNK,
                f"chunk [{offset}, {offset + count}) of {variable!r} is outside the "
                f"{item.elements} elements this push declared",
            )
        width = item.width
        if item.row_ids is not None and (offset % width or count % width):
            raise RequestError(Reason.INVALID_CHUNK,
                               f"chunk [{offset}, {offset + count}) of {variable!r} does not hold "
                               f"whole rows of {width} elements")
        if data.nbytes != count * wire.itemsize:
            raise RequestError(Reason.INVALID_CHUNK,
                               f"chunk for {variable!r}: chunk carries {data.nbytes} bytes, but {count} "
                               f"elements of {wire.name} need {count * wire.itemsize}")
        return variable, item, offset, np.frombuffer(data, dtype=wire, count=count)

    def _apply_one(self, name: str, item: _Item, offset: int, values: np.ndarray) -> bool:
        """Apply one checked chunk (the caller holds the gate); True when it completed the push."""
        session = self._session
        count = values.size
        part = item.part
        # The common case, a dense gradient, takes its ledger work in one hold of the session's lock.
        dense_gradient = self._decision == PushDecision.APPLY and item.row_ids is None and not self._assign
        step = 0
        if dense_gradient:
            step = session.claim_with_step(name, offset, count, part.reserve_step)
            if step is None:
                return False
        elif session.claim(name, offset, count) == ClaimResult.ALREADY_APPLIED:
            return False
        try:
            if dense_gradient:
                part.apply_gradient(offset, values, step)
            elif self._decision == PushDecision.DROP:
                pass  # recorded (so a retry is recognised), never applied
            elif self._decision == PushDecision.ACCUMULATE:
                self._stage(item, offset, values)
            elif item.row_ids is not None:
                width = item.width
                first, end = offset // width, (offset + count) // width
                grads = values.reshape(end - first, width)
                if item.local_rows is not None:  # a dense part's rows, checked at the begin
                    part.apply_local_rows(item.local_rows[first:end], grads)
                else:
                    part.apply_rows(item.row_ids[first:end], grads)
            else:
                upload = session.uploads.get(name)
                if upload is not None:  # staged; installed whole when the push completes
                    upload.write(offset, values)
        except BaseException:
            session.release(name, offset)
            raise
        self._applied_here += count
        self._store.generation += 1
        return session.done(name, offset)

    def _stage(self, item: _Item, offset: int, values: np.ndarray) -> None:
        """Synchronous mode: keep the chunk in the push's own staging until the push is whole."""
        staging = self._session.staging.setdefault(item.part.spec.name, PushStaging())
        dtype = item.part.compute_dtype
        # Staged bytes are booked first (an abandoned push keeps them until the ledger drops it; a
        # whole push hands them to the step's sum, which keeps them until the step is applied).
        if item.row_ids is not None:
            width = item.part.spec.row_elements
            rows = item.row_ids[offset // width:(offset + values.size) // width]
            self._session.book_bytes(staged_rows_bytes(rows, values.size, dtype))
            staging.add_rows(rows, values.reshape(len(rows), width), dtype)
        else:
            if staging.dense is None:
                self._session.book_bytes(item.elements * dtype.itemsize)
            staging.add_dense(item.elements, dtype, offset, values)

    def _after_complete(self) -> None:
        """Outside the apply gate: this push may have finished a sync step; apply it."""
        if self._consistency is not None and not self._assign:
            self._consistency.apply_ready_steps()

    def finish(self) -> PushResult:
        """The stream ended: the push must be complete by now."""
        session = self._session
        if session is not None and not session.complete:
            raise RequestError(
                Reason.PUSH_INCOMPLETE,
                f"push stream ended after {session.applied_elements} of {session.total_elements} "
                "elements; the applied chunks are recorded, retry the same push to complete it",
            )
        if self._assign and session is not None:
            self._install(session)
        versions = self._versions or {
            name: item.part.info().version for name, item in self._items.items()
        }
        applied = self._applied_here
        if self._assign:  # an upload that did not become the value changed nothing
            duplicate = not self._installed
            applied = applied if self._installed else 0
        else:
            duplicate = session is None or (applied == 0 and session.total_elements > 0)
        cluster_step = self._consistency.cluster_step() if self._consistency is not None else 0
        return PushResult(versions, duplicate, applied, self._dropped, cluster_step)

    def _install(self, session: PushSession) -> None:
        """A complete ASSIGN push: install each staged value unless its part has one already.

        Runs at the end of every stream of the push (also a retry's, should
        the first stream have broken after the last chunk), so it is never
        left half done; installing is idempotent.
        """
        for upload in list(session.uploads.values()):
            if self._store.install_upload(upload):
                self._installed = True
        self._ledger.finish(session)

    def _finalize(self) -> None:
        """The push is whole (the caller holds the gate shared): count it, merge it, record it.

        A sync push joins every part's sum of its step, or none when the
        step was applied while it streamed (dropped whole); the ledger and
        the worker's clock record it in the same hold of the gate, so a
        checkpoint holds the push in all of them or in none. The memory
        booked for its staging moves to the sums (what they took over) or is
        given back: the sums grow only by bytes booked before they were
        allocated.
        """
        if self._assign:
            return  # recorded as finished once installed (finish)
        if self._decision == PushDecision.APPLY:
            for name, item in self._items.items():
                self._versions[name] = item.part.finish_push()
        staged, staged_bytes = self._session.take_staging()
        kept = 0
        if self._consistency is not None:
            def merge() -> None:
                nonlocal kept
                for name, item in self._items.items():
                    kept += item.part.merge_staged(self._step, staged.get(name, PushStaging()))

            if not self._consistency.complete_push(self._worker_id, self._step, self._decision, merge):
                self._dropped = True
        if staged_bytes or kept:
            self._store.adopt_staged(staged_bytes, kept)
        if self._decision != PushDecision.APPLY:
            for name, item in self._items.items():
                self._versions[name] = item.part.info().version
        self._ledger.finish(self._session, dropped=self._dropped)


def max_chunks_per_message(store: VariableStore) -> int:
    """Chunks one push message may carry: PSClient packs at most one per variable and a few of one
    large variable (each near chunk_bytes) into a message; decoding a chunk costs about 1 KiB."""
    return store.max_variables + 1024


def max_chunk_records(variables: int, elements: int) -> int:
    """Chunks one push may record: a chunk per variable, one per 256 elements (PSClient's chunks of a
    float64 row just over half of the smallest chunk_bytes), and some slack for tiny pushes."""
    return 1024 + variables + elements // 256


def begin_push(store: VariableStore, ledger: PushLedger, begin: PushStart,
               consistency: ConsistencyController | None = None, observer: PushObserver | None = None,
               wait_seconds: float | None = None, decided: Decided | None = None,
               decision: str | None = None) -> ActivePush:
    """Validate a PushBegin and open (or rejoin) its session; changes nothing on error.

    A sync push for a step this shard has not reached waits for it, at most
    ``wait_seconds`` (None: a worker lease), before anything is recorded.
    ``decided``: a replicated primary's log of the sync decision; such a
    primary applies a step the push finishes only at
    :meth:`ActivePush.settle`, once it logged the push. A backup passes the
    ``decision`` its primary took for the stream instead of taking one
    (see :meth:`ConsistencyController.follow_decision`).
    """
    check_cluster(store, begin.shard_index, begin.num_shards)
    if not begin.worker_id or len(begin.worker_id) > MAX_WORKER_ID_LENGTH:
        raise RequestError(Reason.INVALID_REQUEST,
                           f"worker_id must be 1 to {MAX_WORKER_ID_LENGTH} characters, got {begin.worker_id!r}")
    if not begin.incarnation or len(begin.incarnation) > MAX_WORKER_ID_LENGTH:
        raise RequestError(Reason.INVALID_REQUEST, "incarnation must be a non-empty id of the worker process")
    if begin.sequence < 1:
        raise RequestError(Reason.INVALID_REQUEST, f"sequence must start at 1, got {begin.sequence}")
    if type(begin.kind) is not PushKind:
        raise RequestError(Reason.INVALID_REQUEST, f"push kind must be GRADIENT or ASSIGN, got {begin.kind}")
    if not begin.items:
        raise RequestError(Reason.INVALID_REQUEST, "a push must declare at least one variable")
    assign = begin.kind is PushKind.ASSIGN
    # A retry of a push that completed before is answered as a duplicate,
    # even when its effect (an initial value) now makes it look invalid; one
    # the ledger wrote off is refused (PUSH_WRITTEN_OFF) before anything else.
    already_done = ledger.check(begin.worker_id, begin.incarnation, begin.sequence)
    items: dict[str, _Item] = {}
    staleness: list[int] = []
    for variable, declared_elements, wire, declared_rows, base_version in begin.items:
        if variable in items:
            raise RequestError(Reason.INVALID_REQUEST, f"variable {variable!r} is declared twice")
        part = store.get(variable)
        row_ids = local_rows = None
        if declared_rows or part.spec.hash_table:
            if assign:
                raise RequestError(Reason.INVALID_REQUEST, "an ASSIGN push cannot address rows")
            if not declared_rows and declared_elements:
                raise RequestError(Reason.INVALID_REQUEST,
                                   f"{variable!r} is a hash table: push it by rows (push_rows)")
            row_ids, local_rows = parse_row_ids(part, declared_rows, store.shard_index, store.num_shards,
                                                unique=True)
            if part.spec.hash_table and part.max_rows and len(row_ids) > part.max_rows:
                raise RequestError(Reason.MEMORY_LIMIT,
                                   f"push of {len(row_ids)} rows of {variable!r} on one shard; the "
                                   f"table keeps at most {part.max_rows} there (max_rows / --max-rows)")
            expected = len(row_ids) * part.spec.row_elements
        elif not part.holds_part:
            raise RequestError(
                Reason.INVALID_REQUEST,
                f"variable {variable!r} has no part on shard {store.shard_index}",
            )
        else:
            expected = part.elements
        if declared_elements != expected:
            if row_ids is not None:
                raise RequestError(
                    Reason.SHAPE_MISMATCH,
                    f"push covers {declared_elements} elements of {variable!r}, but "
                    f"{len(row_ids)} rows of {part.spec.row_elements} elements are {expected}")
            raise RequestError(
                Reason.SHAPE_MISMATCH,
                f"push covers {declared_elements} elements of {variable!r}, but this "
                f"shard's part (rows {part.row_start}:{part.row_end} of shape "
                f"{part.spec.shape}) has {part.elements}",
            )
        if type(wire) is int:
            raise RequestError(Reason.DTYPE_MISMATCH, f"unknown wire dtype {wire} for {variable!r}")
        check_dtype_allowed(part, wire, assign)
        initialized = part.initialized  # a bool read: no lock needed
        if not assign and not initialized:
            raise RequestError(
                Reason.NOT_INITIALIZED,
                f"variable {variable!r} is waiting for its explicit initial value",
            )
        items[variable] = _Item(part, wire, row_ids, expected, part.spec.row_elements, local_rows)
        if base_version and not assign:
            staleness.append(max(0, part.version - base_version))
    if observer is not None and staleness:
        observer.push_staleness(staleness)  # a refused push observes nothing
    total = sum(item.elements for item in items.values())
    followed, decision = decision, PushDecision.APPLY
    if consistency is not None and not assign and not already_done:
        decision = followed or _decide(store, consistency, begin, items, wait_seconds, decided)
    elif already_done and not assign and ledger.was_dropped(begin.worker_id, begin.incarnation, begin.sequence):
        decision = PushDecision.DROP  # a retry of a push sync mode dropped: answered dropped again
    if assign:
        session = _begin_upload(store, ledger, begin, items, total, wait_seconds)
    else:
        session = ledger.begin(begin.worker_id, begin.incarnation, begin.sequence, total)
    if session is not None:
        session.bound(max_chunk_records(len(items), total),
                      lambda nbytes: store.book(nbytes, f"the ledger's record of push {begin.sequence} of "
                                                        f"{begin.worker_id}/{begin.incarnation}"),
                      store.give_back)
    push = ActivePush(store, ledger, begin, items, session, consistency, decision, observer)
    push.applies_steps = decided is None
    if session is not None and session.finalize_empty():
        with store.gate.shared():
            push._finalize()
            store.generation += 1
        if push.applies_steps:
            push._after_complete()
    return push


def _begin_upload(store: VariableStore, ledger: PushLedger, begin: PushStart,
                  items: dict[str, _Item], total: int,
                  wait_seconds: float | None = None) -> PushSession | None:
    """The session of an ASSIGN push, with a staging buffer for each part still waiting for its value.

    None (the push is a duplicate) when every part has its value already
    (also after waiting for another upload of it, see
    VariableStore.stage_upload): creating from an array is idempotent, the first complete upload wins.
    Buffers are booked before the ledger is touched, so a refusal
    (MEMORY_LIMIT) changes nothing.
    """
    waiting = [name for name, item in items.items() if not item.part.initialized]
    if not waiting:
        return None
    staged = {}
    try:
        for name in waiting:
            upload = store.stage_upload(items[name].part, wait_seconds)
            if upload is not None:
                staged[name] = upload
        if not staged:
            return None
        session = ledger.begin(begin.worker_id, begin.incarnation, begin.sequence, total)
    except BaseException:
        for upload in staged.values():
            upload.drop()
        raise
    if session is not None:
        with session.cond:  # two streams of one push (an impatient retry) must share one buffer
            if not session.uploads:
                session.uploads.update(staged)
                staged = {}
    for upload in staged.values():  # done before, or a retry: the first buffers stay
        upload.drop()
    return session


def _decide(store: VariableStore, consistency: ConsistencyController, begin: PushStart,
            items: dict[str, _Item], wait_seconds: float | None, decided: Decided | None) -> str:
    """The push's consistency decision; a sync push's table rows are pinned for its step.

    Deciding and pinning share one hold of the gate, so the step cannot be
    applied in between (see HashTablePart.pin_rows). A pin that does not
    fit refuses the push here, before the ledger records any of it. A
    replicated primary takes the decision under the shard's order and logs
    it there (``decided``), so its backups take it at the same place.
    """
    deadline = None if wait_seconds is None else time.monotonic() + wait_seconds
    while True:
        with consistency.ordered(), store.gate.shared():
            pins = [(item.part, item.row_ids) for item in items.values()
                    if isinstance(item.part, HashTablePart) and item.row_ids is not None]
            # Every table is checked and its growth booked before any row is created or pinned.
            decision = consistency.push_decision(begin.step, lambda: store.pin_rows(pins))
            # Sync only: outside it every push is applied (APPLY) and ordered() holds nothing, so
            # there is no decision to log, and logging one would append outside the shard's order.
            if decided is not None and decision in (PushDecision.ACCUMULATE, PushDecision.DROP):
                decided(begin.step, decision, pins if decision == PushDecision.ACCUMULATE else [])
        if decision != PushDecision.WAIT:
            return decision
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        consistency.wait_for_step(begin.worker_id, begin.step, remaining)
