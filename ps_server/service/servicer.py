"""The gRPC methods of the ParameterServer service: parse the request, call the core, frame the answer.

Requests are parsed and errors answered as :mod:`ps_server.service.calls`
says; data-path messages are framed by :mod:`wehub_ps.wire.codec` (pulls
through :mod:`ps_server.service.pull_stream`) to copy each tensor byte once.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Iterator

import grpc

from ps_server.core.consistency import PushDecision
from ps_server.core.errors import RequestError
from ps_server.core.memory import MemoryHold
from ps_server.core.pulls import MIN_CHUNK_BYTES, PullPlan, PullQuery, UnknownDtype
from ps_server.core.pushes import begin_push, check_cluster, max_chunks_per_message
from ps_server.core.tables import HashTablePart
from ps_server.core.workers import check_worker
from ps_server.service.builders import checkpoint_info, describe_response, variable_info
from ps_server.service.calls import STATUS_BY_REASON, CallSlots, abort, parse, unary
from ps_server.service.context import ShardContext
from ps_server.service.pull_stream import pull_messages
from ps_server.service.push_messages import BeginParts, chunks_message, push_chunks, push_start
from ps_server.service.roles import ShardRole
from wehub_ps.errors import Reason
from wehub_ps.specs import SpecError
from wehub_ps.specs_proto import spec_from_proto
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.codec import (
    EXCHANGE_ERROR,
    EXCHANGE_PULL,
    EXCHANGE_PUSH,
    DecodedChunk,
    TooManyChunks,
    decode_envelope,
    decode_push_request,
    encode_envelope,
    envelope_pieces,
    join_pieces,
    piece_size,
    push_response_pieces,
)
from wehub_ps.wire.dtypes import to_numpy_dtype, to_wire_dtype
from wehub_ps.wire.protowire import CodecError
from wehub_ps.wire.rpc import PRIMARY_METADATA_KEY, SERVICE_NAME
from wehub_ps.wire.small_messages import encode_push_response

__all__ = ["ParameterServerService", "exchange_error"]

log = logging.getLogger("ps_server.service.servicer")


class ParameterServerService:
    """RPC methods only: parse, call the core, frame the answer."""

    def __init__(self, context: ShardContext) -> None:
        self._context = context
        self._store = context.store
        self._ledger = context.ledger
        self._lifecycle = context.lifecycle
        self._membership = context.membership
        self._consistency = context.consistency
        self._workers = context.workers
        self._pulls = context.pulls
        self._metrics = context.metrics
        self._server_id = context.server_id
        self._role = context.role
        self._slots = CallSlots(context.admission)

    def generic_handler(self) -> grpc.GenericRpcHandler:
        """Handlers with raw-bytes (de)serialisation, named as in the proto.

        Each holds a slot of its bound while it runs (ps_server.core.admission):
        Exchange streams one of theirs, every other call an ordinary one.
        """
        bounded, streaming = self._slots.unary, self._slots.streaming
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Describe": grpc.unary_unary_rpc_method_handler(bounded(self.describe)),
            "CreateVariable": grpc.unary_unary_rpc_method_handler(bounded(self.create_variable)),
            "Pull": grpc.unary_stream_rpc_method_handler(streaming(self.pull)),
            "Push": grpc.stream_unary_rpc_method_handler(bounded(self.push)),
            "Checkpoint": grpc.unary_unary_rpc_method_handler(bounded(self.checkpoint)),
            "Heartbeat": grpc.unary_unary_rpc_method_handler(bounded(self.heartbeat)),
            "Exchange": grpc.stream_stream_rpc_method_handler(self._slots.exchange(self.exchange)),
            "Finish": grpc.unary_unary_rpc_method_handler(bounded(self.finish)),
            "Switchover": grpc.unary_unary_rpc_method_handler(bounded(self.switchover)),
            "ExportRows": grpc.unary_stream_rpc_method_handler(streaming(self.export_rows)),
        })

    def end_exchange_streams(self) -> int:
        """Cancel every open Exchange stream (CANCELLED: clients retry); returns how many.

        Called once the final checkpoint has sealed the store: an idle stream
        would otherwise hold gRPC's stop grace period open for nothing.
        """
        return self._slots.end_exchange_streams()

    # ---- control ----

    @unary
    def describe(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        msg = parse(ps_pb2.DescribeRequest, request)
        if not msg.any_replica:
            self._role.check_primary()
        self._lifecycle.check_ready()  # never report a store that is still being restored
        return describe_response(self._context).SerializeToString()

    @unary
    def checkpoint(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        parse(ps_pb2.CheckpointRequest, request)
        self._role.check_primary()
        checkpointer = self._context.checkpointer
        if checkpointer is None:
            raise RequestError(Reason.CHECKPOINTS_DISABLED,
                               "this ps-server has no --checkpoint-dir; start it with one to take checkpoints")
        # Restoring: a checkpoint now would be of a store not yet restored, the
        # newest on disk, and would push real ones out. Draining: the final
        # checkpoint is the server's own.
        self._lifecycle.check_accepting()
        record = checkpointer.checkpoint("request")
        assert record is not None
        if self._role.replicated:
            with self._role.ordered():
                sequence = self._role.checkpointed()
            self._role.acknowledge(sequence, context.time_remaining())
        return ps_pb2.CheckpointResponse(checkpoint=checkpoint_info(record)).SerializeToString()

    @unary
    def finish(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        msg = parse(ps_pb2.FinishRequest, request)
        self._role.check_primary()
        if not self._context.allow_finish:
            raise RequestError(Reason.FINISH_NOT_ALLOWED,
                               "this ps-server is a long-lived service; start it with --allow-finish "
                               "for run-to-completion jobs")
        if not self._context.finish_requested.is_set():
            # Restoring, or draining after SIGTERM: the retry reaches the server
            # that comes next. A repeated finish while finishing is acknowledged.
            self._lifecycle.check_accepting()
        log.info("finish requested", extra={"fields": {"worker_id": msg.worker_id}})
        if self._role.replicated:
            with self._role.ordered():
                sequence = self._role.finishing()
            self._role.acknowledge(sequence, context.time_remaining())
        self._context.finish_requested.set()
        return ps_pb2.FinishResponse().SerializeToString()

    @unary
    def switchover(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """An operator's planned switchover (ps-admin switchover): answered once the role is handed over."""
        msg = parse(ps_pb2.SwitchoverRequest, request)
        if not math.isfinite(msg.timeout_seconds) or msg.timeout_seconds < 0:
            raise RequestError(Reason.INVALID_REQUEST,
                               f"timeout_seconds must be seconds >= 0, got {msg.timeout_seconds}")
        self._role.check_primary()
        self._lifecycle.check_accepting()
        started = time.monotonic()
        index, address = self._role.switch_over(msg.to_replica if msg.HasField("to_replica") else None,
                                                msg.timeout_seconds or 5.0)
        log.info("switchover", extra={"fields": {"to_replica": index, "address": address}})
        return ps_pb2.SwitchoverResponse(replica_index=index, address=address,
                                         seconds=time.monotonic() - started).SerializeToString()

    @unary
    def heartbeat(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        msg = parse(ps_pb2.HeartbeatRequest, request)
        check_worker(msg.worker_id, msg.incarnation)
        self._role.check_primary()
        # No lease or step clock before the restore or after the drain began.
        self._lifecycle.check_accepting()
        if msg.leaving:
            self._membership.leave(msg.worker_id, msg.incarnation)
            return ps_pb2.HeartbeatResponse(lease_seconds=self._membership.lease_seconds,
                                            server_id=self._server_id).SerializeToString()
        self._workers.seen(msg.worker_id, msg.incarnation, msg.step)
        cluster_step = self._consistency.on_heartbeat(msg.worker_id, msg.step)
        return ps_pb2.HeartbeatResponse(lease_seconds=self._membership.lease_seconds, server_id=self._server_id,
                                        cluster_step=cluster_step,
                                        consistency=self._consistency.mode).SerializeToString()

    @unary
    def create_variable(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        msg = parse(ps_pb2.CreateVariableRequest, request)
        self._role.check_primary()
        self._lifecycle.check_accepting()
        check_cluster(self._store, msg.shard_index, msg.num_shards)
        try:
            spec = spec_from_proto(msg.spec)
        except SpecError as exc:
            raise RequestError(Reason.INVALID_SPEC, str(exc)) from None
        if msg.validate_only and msg.cancel_booking:
            self._store.cancel_booking(spec.name, msg.booking)
            return ps_pb2.CreateVariableResponse(created=False).SerializeToString()
        if msg.validate_only:
            existing = self._store.validate(spec, msg.booking)
            response = ps_pb2.CreateVariableResponse(created=False)
            if existing is not None:
                response.variable.CopyFrom(variable_info(existing))
            return response.SerializeToString()
        role = self._role
        with role.ordered():
            info, created = self._store.create(spec)
            # A variable another call created may still be on its way to the backups: wait for it too.
            sequence = role.variable_created(msg.spec) if created else role.last_sequence()
        role.acknowledge(sequence, context.time_remaining())
        if created:
            log.debug("variable created", extra={"fields": {"variable": spec.name,
                                                             "shape": list(spec.shape)}})
        return ps_pb2.CreateVariableResponse(variable=variable_info(info), created=created).SerializeToString()

    # ---- data path ----

    def pull(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        names: list[str] = []
        try:
            msg = parse(ps_pb2.PullRequest, request)
            names = [item.variable for item in msg.items]
            self._role.check_primary()
            plan = self._pulls.plan(_pull_query(msg))
            with plan.hold:
                # ssp / sync: wait (at most the call's deadline) until this step may read.
                self._consistency.before_pull(msg.worker_id, msg.step, context.time_remaining())
                sent = 0
                try:
                    for pieces in pull_messages(plan):
                        message = join_pieces(pieces)
                        sent += len(message)
                        yield message
                finally:
                    # Counted once per call, not per message: the counter takes a lock each time.
                    self._metrics.bytes_sent.inc(sent)
        except RequestError as error:
            self._count_pulls(names, error.reason.value)
            abort(context, error)
            return
        self._count_pulls(names, "ok")

    def export_rows(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Every row of a hash table on this shard, with its ids, in pieces (read only)."""
        try:
            msg = parse(ps_pb2.ExportRowsRequest, request)
            self._role.check_primary()
            self._lifecycle.check_accepting()
            check_cluster(self._store, msg.shard_index, msg.num_shards)
            part = self._store.get(msg.variable)
            if not isinstance(part, HashTablePart):
                raise RequestError(Reason.INVALID_REQUEST, f"{msg.variable!r} is a dense variable: pull it "
                                                           "(its row ids are its row numbers)")
            chunk_bytes = max(MIN_CHUNK_BYTES, min(msg.chunk_bytes or self._context.max_chunk_bytes,
                                                   self._context.max_chunk_bytes))
            row_bytes = part.row_elements * part.spec.dtype.itemsize
            rows_per_piece = max(1, chunk_bytes // (row_bytes + 8))
            # The listing of ids and slots, and one piece at a time: its rows read, their bytes, the message.
            hold = self._store.hold(16 * part.num_rows + 3 * rows_per_piece * (row_bytes + 8),
                                    f"an export of {msg.variable!r}")
            with hold:
                dtype, width = to_wire_dtype(part.spec.dtype), part.row_elements
                for ids, rows in part.export_rows(rows_per_piece):
                    yield ps_pb2.ExportRowsResponse(
                        ids=ids.astype("<i8", copy=False).tobytes(), rows=rows.tobytes(), dtype=dtype,
                        row_elements=width, version=part.version).SerializeToString()
        except RequestError as error:
            abort(context, error)

    def _count_pulls(self, names: list[str], outcome: str) -> None:
        # A refused request may name anything: only this shard's variables become label values.
        self._metrics.pulls.add(names if outcome == "ok" else self._store.known_names(names), outcome)

    def push(self, request_iterator: Iterable[bytes], context: grpc.ServicerContext) -> bytes:
        try:
            return join_pieces(self._run_push(request_iterator, context.time_remaining()))
        except RequestError as error:
            abort(context, error)
            return b""

    def _run_push(self, messages: Iterable[bytes | memoryview], wait_seconds: float | None = None) -> list:
        """Apply one push from its messages; the PushResponse as pieces (metrics counted here).

        ``wait_seconds``: how long a sync push may wait for its step (the call's deadline).
        """
        names: list[str] = []
        holds: list[MemoryHold] = []
        try:
            result, received, pull_plan = self._apply_push(messages, names, holds, wait_seconds)
        except BaseException as error:
            for hold in holds:
                hold.release()
            if isinstance(error, RequestError):
                self._metrics.pushes.add(self._store.known_names(names), error.reason.value)
            raise
        outcome = "dropped" if result.dropped else "duplicate" if result.duplicate else "ok"
        self._metrics.pushes.add(names, outcome)
        self._metrics.bytes_received.inc(received)
        pulled = None
        try:
            if pull_plan is not None:
                plan, pull_names = pull_plan
                with plan.hold:
                    pulled = [piece for pieces in pull_messages(plan) for piece in pieces]
                self._count_pulls(pull_names, "ok")
                self._metrics.bytes_sent.inc(sum(piece_size(p) for p in pulled))
        finally:
            for hold in holds:  # (releasing twice gives back nothing the second time)
                hold.release()
        response = encode_push_response(result.versions, result.duplicate, result.elements_applied,
                                        result.dropped, result.cluster_step)
        return push_response_pieces(response, pulled)

    def _plan_pull_after(self, msg: ps_pb2.PullRequest) -> tuple[PullPlan, list[str]]:
        """Plan PushBegin.pull_after before the push changes anything; the plan and the variables it names."""
        names = [item.variable for item in msg.items]
        try:
            plan = self._pulls.plan_after_push(_pull_query(msg))
        except RequestError as error:
            self._count_pulls(names, error.reason.value)
            raise
        return plan, names

    def _apply_push(self, messages: Iterable[bytes | memoryview], names: list[str],
                    holds: list[MemoryHold], wait_seconds: float | None = None):
        """Apply the push; ``names`` and ``holds`` (of its pull_after answer) are filled as it goes."""
        self._role.check_primary()
        received = 0
        pull_plan = None
        result = None
        # A push of one message (Exchange) is applied and finished in the same hold of the order.
        whole = isinstance(messages, list) and len(messages) == 1
        with self._lifecycle.push_in_flight(), _LoggedStream(self._role) as logged:
            active = None
            parts: BeginParts | None = None  # a begin spread over several messages, until it is whole
            for raw in messages:
                received += len(raw) if isinstance(raw, bytes) else raw.nbytes
                try:
                    begin, chunks = decode_push_request(raw, max_chunks_per_message(self._store))
                except TooManyChunks as exc:
                    raise RequestError(Reason.MEMORY_LIMIT,
                                       f"push message refused: {exc} (one per variable of the push, "
                                       f"at most {max_chunks_per_message(self._store)}); send larger chunks"
                                       ) from None
                except CodecError as exc:
                    raise RequestError(Reason.MALFORMED_MESSAGE,
                                       f"request is not a valid wehub_ps.v1.PushRequest: {exc}") from None
                if begin is not None:
                    if active is not None:
                        raise RequestError(Reason.INVALID_REQUEST,
                                           "PushBegin may only appear in the first message (and the parts "
                                           "that continue it)")
                    if parts is not None:
                        parts.add(begin)
                    elif begin.continued:
                        parts = BeginParts(begin, lambda nbytes: holds.append(
                            self._store.hold(nbytes, "the row ids of a push's begin")))
                    if parts is not None:
                        if parts.continued:
                            if chunks:
                                raise RequestError(Reason.INVALID_REQUEST,
                                                   "chunks may only follow the last part of a PushBegin")
                            continue
                        begin = parts.whole()
                    self._workers.seen(begin.worker_id, begin.incarnation, begin.step, pushed=True)
                    names.extend(item.variable for item in begin.items)
                    if begin.HasField("pull_after"):
                        pull_plan = self._plan_pull_after(begin.pull_after)
                        holds.append(pull_plan[0].hold)
                    active = begin_push(self._store, self._ledger, push_start(begin), self._consistency,
                                        self._metrics, wait_seconds,
                                        logged.decided if logged.replicated else None)
                    logged.begin = begin
                elif active is None:
                    raise RequestError(Reason.INVALID_REQUEST,
                                       "the first message of a push must carry PushBegin" if parts is None
                                       else "a continued PushBegin must be continued by the next message")
                if logged.replicated:
                    with logged.ordered():
                        if chunks:
                            try:
                                active.apply_many(push_chunks(chunks))
                            except BaseException:
                                logged.refused(raw, chunks, active.applied_chunks)
                                raise
                        if whole:  # the push's only message (Exchange): applied and finished in one record
                            try:
                                result = active.finish()
                            except RequestError:
                                if chunks:
                                    logged.applied(raw)
                                raise
                            logged.applied(raw, completed=True)
                        elif chunks:
                            logged.applied(raw)
                    active.settle()  # a sync step the push finished: its record after the push's
                else:
                    active.apply_many(push_chunks(chunks))
            if active is None:
                raise RequestError(Reason.INVALID_REQUEST, "empty push stream" if parts is None
                                   else "push stream ended before the last part of its PushBegin")
            if logged.replicated:
                if result is None:
                    with logged.ordered():
                        result = active.finish()
                        logged.ended()
                    active.settle()
                self._role.acknowledge(logged.sequence, wait_seconds)
            else:
                result = active.finish()
        return result, received, pull_plan

    def exchange(self, request_iterator: Iterable[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        """Small pulls and pushes over one long-lived stream, answered in order.

        A failed request answers an ExchangeError (the status code and reason
        the unary call would have had) and the stream carries on.
        """
        for raw in request_iterator:
            yield join_pieces(self.answer_exchange(raw, context.time_remaining()))

    def answer_exchange(self, raw: bytes | bytearray, wait_seconds: float | None) -> list:
        """The ExchangeResponse to one ExchangeRequest (an Exchange stream's or a TCP lane's), as pieces.

        Pieces (codec.envelope_pieces): a socket writes them unjoined, so a
        pull's tensor bytes are copied once, into the answer. ``wait_seconds``:
        how long an ssp/sync pull or a sync push may wait for the other
        workers. Never raises: a RequestError is the answer, and so is an
        unexpected error (UNKNOWN, logged with its traceback).
        """
        request_id = 0
        try:
            try:
                request_id, field, payload = decode_envelope(raw)
            except CodecError as exc:
                raise RequestError(Reason.MALFORMED_MESSAGE,
                                   f"request is not a valid wehub_ps.v1.ExchangeRequest: {exc}") from None
            self._role.check_primary()
            if field == EXCHANGE_PULL:
                msg = parse(ps_pb2.PullRequest, payload)
                names = [item.variable for item in msg.items]
                try:
                    plan = self._pulls.plan(_pull_query(msg), whole_reply=True)
                    with plan.hold:
                        self._consistency.before_pull(msg.worker_id, msg.step, wait_seconds)
                        # Concatenated PullResponses are one PullResponse (repeated field).
                        messages = pull_messages(plan)
                        reply = envelope_pieces(request_id, EXCHANGE_PULL,
                                                [p for pieces in messages for p in pieces])
                except RequestError as error:
                    self._count_pulls(names, error.reason.value)
                    raise
                self._count_pulls(names, "ok")
                self._metrics.bytes_sent.inc(sum(piece_size(p) for p in reply))
                return reply
            if field == EXCHANGE_PUSH:
                return envelope_pieces(request_id, EXCHANGE_PUSH, self._run_push([payload], wait_seconds))
            raise RequestError(Reason.INVALID_REQUEST, "an ExchangeRequest carries a pull or a push")
        except RequestError as error:
            return [exchange_error(request_id, STATUS_BY_REASON[error.reason], error.reason.value,
                                   error.message, dict(error.trailers).get(PRIMARY_METADATA_KEY, ""))]
        except Exception as error:  # noqa: BLE001 - a bug: answered, as gRPC answers a handler's exception
            # UNKNOWN, which clients do not retry: on a TCP lane the connection would otherwise
            # break, and the client retry the request for its whole retry_timeout.
            log.error("exchange request failed with an unexpected error", exc_info=True,
                      extra={"fields": {"request_id": request_id, "error": repr(error)}})
            return [exchange_error(request_id, grpc.StatusCode.UNKNOWN, "",
                                   f"ps-server failed to answer: {type(error).__name__}: {error}")]


def exchange_error(request_id: int, status: grpc.StatusCode, reason: str, message: str,
                   primary: str = "") -> bytes:
    """An ExchangeResponse that fails request ``request_id`` (0: the whole lane) with ``status``.

    ``primary``: a NOT_PRIMARY refusal's primary, which the ordinary calls
    send in the trailing metadata; here it is a field, so a client on an
    Exchange stream or a TCP lane follows it as it follows the metadata.
    """
    return encode_envelope(request_id, EXCHANGE_ERROR, ps_pb2.ExchangeError(
        code=status.value[0], reason=reason, message=message, primary=primary).SerializeToString())


class _LoggedStream:
    """One push stream's records in a replicated shard's log (nothing when unreplicated).

    Each applied message is logged in the same hold of the shard's order as
    its apply; the stream's begin goes with its first record. Of a message
    refused part way, the chunks applied before the refusal are logged
    (``refused``). A stream that breaks after its begin was applied logs its
    end too, with the begin when no record carried it yet, so the backups
    open the push in their ledgers and let go of the stream as the primary
    did.
    """

    def __init__(self, role: ShardRole) -> None:
        self._role = role
        self.replicated = role.replicated
        self._stream = role.next_stream() if self.replicated else 0
        #: The push's whole begin, once decoded.
        self.begin: ps_pb2.PushBegin | None = None
        self._begin_logged = False
        self._ended = False
        #: The sequence of the stream's newest record.
        self.sequence = 0

    def __enter__(self) -> _LoggedStream:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if self.replicated and not self._ended and (self._begin_logged or self.begin is not None):
            try:
                with self._role.ordered():
                    self._role.push_ended(self._stream, self._first_begin(), False)
            except RequestError:
                pass  # no longer the primary: its backups follow another one

    def ordered(self):
        return self._role.ordered()

    def applied(self, message: bytes | memoryview, completed: bool = False) -> None:
        """Under ``ordered``: one message's chunks were applied (``completed``: and the push finished)."""
        self._ended = completed
        self.sequence = self._role.push_applied(self._stream, self._first_begin(), message, completed)

    def decided(self, step: int, decision: str, pins: list) -> None:
        """Under ``ordered``: the push's sync decision (core.pushes.Decided), logged where it was taken."""
        self.sequence = self._role.push_decided(self._stream, step, decision == PushDecision.ACCUMULATE,
                                                [(part.spec.name, ids) for part, ids in pins])

    def refused(self, message: bytes | memoryview, chunks: list[DecodedChunk], applied: int) -> None:
        """Under ``ordered``: ``message`` (of ``chunks``) was refused after its first ``applied``
        chunks were applied; those are logged, as a message of their own when they are not all."""
        if applied:
            self.applied(message if applied == len(chunks) else chunks_message(chunks[:applied]))

    def ended(self) -> None:
        """Under ``ordered``: the push finished."""
        self._ended = True
        self.sequence = self._role.push_ended(self._stream, self._first_begin(), True)

    def _first_begin(self) -> ps_pb2.PushBegin | None:
        if self._begin_logged:
            return None
        self._begin_logged = True
        return self.begin


def _pull_query(msg: ps_pb2.PullRequest) -> PullQuery:
    """A PullRequest's values for :class:`ps_server.core.pulls.PullPlanner`."""
    wire_dtype = None
    if msg.wire_dtype != ps_pb2.DATA_TYPE_UNSPECIFIED:
        try:
            wire_dtype = to_numpy_dtype(msg.wire_dtype)
        except ValueError:
            wire_dtype = UnknownDtype(msg.wire_dtype)
    return PullQuery(msg.shard_index, msg.num_shards, msg.worker_id, msg.incarnation, msg.step, msg.items,
                     msg.chunk_bytes, wire_dtype, msg.lookup)
