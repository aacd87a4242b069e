"""Replication stream messages, framed and read without copying a push's bytes.

A backup receives every push message its primary applied; on a 100 MB
push that is 100 MB more to move through one process's GIL, so the record
of a push is framed around the client's own message (a view of it) and
joined once, as the pull stream's chunks are, and the backup reads it back
as views (``decode_push_request`` then takes the chunks as views too).
The bytes are the protobuf encoding of ``ReplicationMessage`` (ps.proto).
"""

from __future__ import annotations

from dataclasses import dataclass

from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.protowire import (
    WIRE_LEN,
    WIRE_VARINT,
    CodecError,
    field_number,
    field_tag,
    iter_fields,
    read_varint,
    varint,
)

__all__ = ["RecordView", "PushView", "push_op", "other_op", "record_pieces", "record_message",
           "decode_record_message", "answer", "decode_answer"]

_SEQUENCE = field_tag(ps_pb2.ReplicationRecord, "sequence", WIRE_VARINT)
_PUSH = field_tag(ps_pb2.ReplicationRecord, "push", WIRE_LEN)
_STREAM = field_tag(ps_pb2.PushApplied, "stream", WIRE_VARINT)
_BEGIN = field_tag(ps_pb2.PushApplied, "begin", WIRE_LEN)
_MESSAGE = field_tag(ps_pb2.PushApplied, "message", WIRE_LEN)
_COMPLETED = field_tag(ps_pb2.PushApplied, "completed", WIRE_VARINT)
_EPOCH = field_tag(ps_pb2.ReplicationMessage, "epoch", WIRE_VARINT)
_RECORD = field_tag(ps_pb2.ReplicationMessage, "record", WIRE_LEN)
_APPLIED = field_tag(ps_pb2.FollowRequest, "applied", WIRE_VARINT)
_ANSWER_EPOCH = field_tag(ps_pb2.FollowRequest, "epoch", WIRE_VARINT)

_RECORD_FIELD = field_number(ps_pb2.ReplicationMessage, "record")
_EPOCH_FIELD = field_number(ps_pb2.ReplicationMessage, "epoch")
_SEQUENCE_FIELD = field_number(ps_pb2.ReplicationRecord, "sequence")
_PUSH_FIELD = field_number(ps_pb2.ReplicationRecord, "push")
_PUSH_FIELDS = {field_number(ps_pb2.PushApplied, name): name
                for name in ("stream", "begin", "message", "completed")}


def push_op(stream: int, begin: bytes | None, message: bytes | memoryview, completed: bool) -> list:
    """A ReplicationRecord's ``push`` field as pieces (``message`` kept as it is, not copied)."""
    body = [_STREAM + varint(stream)] if stream else []
    if begin:
        body.append(_BEGIN + varint(len(begin)) + begin)
    size = len(message) if isinstance(message, bytes) else message.nbytes
    body.append(_MESSAGE + varint(size))
    body.append(message)
    if completed:
        body.append(_COMPLETED + b"\x01")
    length = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in body)
    return [_PUSH + varint(length), *body]


def other_op(record: ps_pb2.ReplicationRecord) -> list:
    """A record's op other than a push (small): protobuf's own encoding, without the sequence."""
    return [record.SerializeToString()]


def record_pieces(sequence: int, op: list) -> list:
    """The ReplicationRecord: its sequence, then its op (fields may come in any order)."""
    return [_SEQUENCE + varint(sequence), *op]


def record_message(epoch: int, record: list) -> list:
    """One ReplicationMessage carrying ``record``, as pieces (write them with a scatter-gather send)."""
    length = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in record)
    return [_EPOCH + varint(epoch) + _RECORD + varint(length), *record]


@dataclass(frozen=True, slots=True)
class PushView:
    stream: int
    begin: memoryview | None
    message: memoryview
    completed: bool


@dataclass(frozen=True, slots=True)
class RecordView:
    """A ReplicationMessage's record: a push as views, any other op parsed."""

    epoch: int
    sequence: int
    push: PushView | None
    other: ps_pb2.ReplicationRecord | None


def decode_record_message(data: bytes | bytearray) -> RecordView | None:
    """The record a ReplicationMessage carries, or None when it carries something else (parse it whole)."""
    buf = memoryview(data)
    epoch = 0
    record = None
    for field, wire_type, start, stop in iter_fields(buf, 0, len(buf)):
        if field == _EPOCH_FIELD and wire_type == WIRE_VARINT:
            epoch = read_varint(buf, start, stop)[0]
        elif field == _RECORD_FIELD and wire_type == WIRE_LEN:
            record = (start, stop)
        elif wire_type == WIRE_LEN:
            return None  # a snapshot piece
    if record is None:
        return None
    sequence, push = 0, None
    for field, wire_type, start, stop in iter_fields(buf, *record):
        if field == _SEQUENCE_FIELD and wire_type == WIRE_VARINT:
            sequence = read_varint(buf, start, stop)[0]
        elif field == _PUSH_FIELD and wire_type == WIRE_LEN:
            push = _decode_push(buf, start, stop)
    other = None
    if push is None:
        other = ps_pb2.ReplicationRecord.FromString(bytes(buf[record[0]:record[1]]))
    return RecordView(epoch, sequence, push, other)


def _decode_push(buf: memoryview, start: int, stop: int) -> PushView:
    stream, begin, message, completed = 0, None, None, False
    for field, wire_type, begin_at, end_at in iter_fields(buf, start, stop):
        name = _PUSH_FIELDS.get(field)
        if name == "stream" and wire_type == WIRE_VARINT:
            stream = read_varint(buf, begin_at, end_at)[0]
        elif name == "begin" and wire_type == WIRE_LEN:
            begin = buf[begin_at:end_at]
        elif name == "message" and wire_type == WIRE_LEN:
            message = buf[begin_at:end_at]
        elif name == "completed" and wire_type == WIRE_VARINT:
            completed = bool(read_varint(buf, begin_at, end_at)[0])
    if message is None:
        raise CodecError("a replicated push carries no message")
    return PushView(stream, begin, message, completed)


def answer(epoch: int, applied: int) -> bytes:
    """A backup's FollowRequest: it applied every change up to ``applied`` of term ``epoch``'s log
    (``epoch`` 0: it has not installed this stream's snapshot yet)."""
    return _APPLIED + varint(applied) + (_ANSWER_EPOCH + varint(epoch) if epoch else b"")


def decode_answer(data: bytes | bytearray) -> ps_pb2.FollowRequest:
    return ps_pb2.FollowRequest.FromString(bytes(data))
