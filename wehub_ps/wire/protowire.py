"""The protobuf wire format, written and read by hand: varints, tags, fields.

The data-path framing (:mod:`wehub_ps.wire.codec`) writes some messages as
bytes rather than through protobuf objects. Its tags come from
:func:`field_tag`, which reads each field's number from the generated
descriptors once, at import, and checks that the field's type is written
with the wire type the framing uses: a renumbered or retyped proto field
changes the tags or stops the import, never silently breaks the bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache

from google.protobuf.descriptor import FieldDescriptor

__all__ = [
    "CodecError",
    "WIRE_VARINT",
    "WIRE_FIXED64",
    "WIRE_LEN",
    "WIRE_FIXED32",
    "field_number",
    "field_tag",
    "varint",
    "tag",
    "string_field",
    "varint_field",
    "read_varint",
    "iter_fields",
    "merge",
]

WIRE_VARINT = 0
WIRE_FIXED64 = 1
WIRE_LEN = 2
WIRE_FIXED32 = 5


class CodecError(ValueError):
    """The bytes are not a valid message of the expected type."""


# Field types whose values the hand-written encoders write with each wire type.
# Varints are written unsigned (no zigzag), so signed sint types are not among them.
_TYPES_OF_WIRE_TYPE = {
    WIRE_VARINT: frozenset({FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64,
                            FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64,
                            FieldDescriptor.TYPE_BOOL, FieldDescriptor.TYPE_ENUM}),
    WIRE_LEN: frozenset({FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES,
                         FieldDescriptor.TYPE_MESSAGE}),
}


def field_number(message: type, name: str) -> int:
    """The number of field ``name`` of the generated ``message`` class."""
    return message.DESCRIPTOR.fields_by_name[name].number


def field_tag(message: type, name: str, wire_type: int) -> bytes:
    """The tag of field ``name`` of ``message`` as written with ``wire_type``.

    Raises TypeError when the field's declared type is not written with
    ``wire_type`` (or is a repeated scalar, which protobuf packs), so that
    the hand-written encoding stays byte-identical to protobuf's.
    """
    field = message.DESCRIPTOR.fields_by_name[name]
    declared = _TYPES_OF_WIRE_TYPE.get(wire_type, frozenset())
    packed_scalar = field.is_repeated and wire_type == WIRE_VARINT
    if field.type not in declared or packed_scalar:
        raise TypeError(f"{field.full_name} (type {field.type}) is not written with wire type {wire_type}")
    return tag(field.number, wire_type)


_SMALL_VARINTS = [bytes([i]) for i in range(128)]


def varint(value: int) -> bytes:
    """``value`` (non-negative) as a base-128 varint."""
    if value < 128:
        return _SMALL_VARINTS[value]
    if value < 16384:  # sizes of small variables, versions: two bytes, written at once
        return bytes((value & 0x7F | 0x80, value >> 7))
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def tag(field: int, wire_type: int) -> bytes:
    """The key that starts a field: its number and wire type."""
    return varint((field << 3) | wire_type)


@lru_cache(maxsize=1 << 16)
def string_field(key: bytes, text: str) -> bytes:
    """A string field as written (empty when ``text`` is, as proto3 omits it); cached: names repeat every step."""
    encoded = text.encode()
    return key + varint(len(encoded)) + encoded if encoded else b""


def varint_field(key: bytes, value: int) -> bytes:
    """A uint64 / uint32 / bool / enum field; proto3 omits zero."""
    return key + varint(value) if value else b""


def read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    """(value, position after it) of the varint at ``pos``."""
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise CodecError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 64:
            raise CodecError("varint longer than 64 bits")


def iter_fields(buf: memoryview, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """Yield (field, wire_type, start, stop) of each field; stop is exclusive.

    For varints start/stop delimit the encoded value. Unknown fields are
    yielded too, so callers can skip them (forward compatibility).
    """
    while pos < end:
        key, pos = read_varint(buf, pos, end)
        field, wire_type = key >> 3, key & 7
        if field == 0:
            raise CodecError("field number 0")
        if wire_type == WIRE_VARINT:
            start = pos
            _, pos = read_varint(buf, pos, end)
        elif wire_type == WIRE_LEN:
            length, start = read_varint(buf, pos, end)
            pos = start + length
        elif wire_type == WIRE_FIXED64:
            start, pos = pos, pos + 8
        elif wire_type == WIRE_FIXED32:
            start, pos = pos, pos + 4
        else:
            raise CodecError(f"unsupported wire type {wire_type}")
        if pos > end:
            raise CodecError("field runs past the end of the message")
        yield field, wire_type, start, pos


def merge(message, buf: memoryview):
    """Merge one occurrence of a message field into ``message``, as protobuf does for repeats."""
    try:
        message.MergeFromString(buf)
    except Exception as exc:  # protobuf raises DecodeError, upb sometimes others
        raise CodecError(f"invalid {message.DESCRIPTOR.name}: {exc}") from exc
    return message
