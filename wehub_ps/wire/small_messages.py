"""The small messages of every step, written as bytes without protobuf objects.

``ChunkHeader``, ``PushItem``, ``PushBegin``, ``PullRequest`` and
``PushResponse`` are written for every variable of every step: a step of a
model in many variables spent more time building and serialising these
objects than in the rest of its framing. Each encoder here returns exactly
what ``SerializeToString`` of the same message returns (a test compares
them); the parts that repeat from step to step are cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.protowire import WIRE_LEN, WIRE_VARINT, field_tag, string_field, varint, varint_field

__all__ = [
    "encode_chunk_header",
    "encode_push_item",
    "encode_push_begin",
    "encode_pull_item",
    "encode_pull_request",
    "encode_push_response",
]

_TAG_CHUNK_HEADER_VARIABLE = field_tag(ps_pb2.ChunkHeader, "variable", WIRE_LEN)
_TAG_CHUNK_HEADER_OFFSET = field_tag(ps_pb2.ChunkHeader, "offset", WIRE_VARINT)
_TAG_CHUNK_HEADER_COUNT = field_tag(ps_pb2.ChunkHeader, "count", WIRE_VARINT)
_TAG_CHUNK_HEADER_DTYPE = field_tag(ps_pb2.ChunkHeader, "dtype", WIRE_VARINT)
_TAG_CHUNK_HEADER_VERSION = field_tag(ps_pb2.ChunkHeader, "version", WIRE_VARINT)
_TAG_CHUNK_HEADER_PART_ELEMENTS = field_tag(ps_pb2.ChunkHeader, "part_elements", WIRE_VARINT)

_TAG_PUSH_ITEM_VARIABLE = field_tag(ps_pb2.PushItem, "variable", WIRE_LEN)
_TAG_PUSH_ITEM_ELEMENTS = field_tag(ps_pb2.PushItem, "elements", WIRE_VARINT)
_TAG_PUSH_ITEM_WIRE_DTYPE = field_tag(ps_pb2.PushItem, "wire_dtype", WIRE_VARINT)
_TAG_PUSH_ITEM_BASE_VERSION = field_tag(ps_pb2.PushItem, "base_version", WIRE_VARINT)
_TAG_PUSH_ITEM_ROW_IDS = field_tag(ps_pb2.PushItem, "row_ids", WIRE_LEN)

_TAG_PUSH_BEGIN_WORKER_ID = field_tag(ps_pb2.PushBegin, "worker_id", WIRE_LEN)
_TAG_PUSH_BEGIN_INCARNATION = field_tag(ps_pb2.PushBegin, "incarnation", WIRE_LEN)
_TAG_PUSH_BEGIN_SEQUENCE = field_tag(ps_pb2.PushBegin, "sequence", WIRE_VARINT)
_TAG_PUSH_BEGIN_SHARD_INDEX = field_tag(ps_pb2.PushBegin, "shard_index", WIRE_VARINT)
_TAG_PUSH_BEGIN_NUM_SHARDS = field_tag(ps_pb2.PushBegin, "num_shards", WIRE_VARINT)
_TAG_PUSH_BEGIN_KIND = field_tag(ps_pb2.PushBegin, "kind", WIRE_VARINT)
_TAG_PUSH_BEGIN_ITEMS = field_tag(ps_pb2.PushBegin, "items", WIRE_LEN)
_TAG_PUSH_BEGIN_STEP = field_tag(ps_pb2.PushBegin, "step", WIRE_VARINT)
_TAG_PUSH_BEGIN_PULL_AFTER = field_tag(ps_pb2.PushBegin, "pull_after", WIRE_LEN)
_TAG_PUSH_BEGIN_CONTINUED = field_tag(ps_pb2.PushBegin, "continued", WIRE_VARINT)

_TAG_PULL_ITEM_VARIABLE = field_tag(ps_pb2.PullItem, "variable", WIRE_LEN)
_TAG_PULL_ITEM_ROW_IDS = field_tag(ps_pb2.PullItem, "row_ids", WIRE_LEN)

_TAG_PULL_REQUEST_SHARD_INDEX = field_tag(ps_pb2.PullRequest, "shard_index", WIRE_VARINT)
_TAG_PULL_REQUEST_NUM_SHARDS = field_tag(ps_pb2.PullRequest, "num_shards", WIRE_VARINT)
_TAG_PULL_REQUEST_ITEMS = field_tag(ps_pb2.PullRequest, "items", WIRE_LEN)
_TAG_PULL_REQUEST_WIRE_DTYPE = field_tag(ps_pb2.PullRequest, "wire_dtype", WIRE_VARINT)
_TAG_PULL_REQUEST_CHUNK_BYTES = field_tag(ps_pb2.PullRequest, "chunk_bytes", WIRE_VARINT)
_TAG_PULL_REQUEST_WORKER_ID = field_tag(ps_pb2.PullRequest, "worker_id", WIRE_LEN)
_TAG_PULL_REQUEST_INCARNATION = field_tag(ps_pb2.PullRequest, "incarnation", WIRE_LEN)
_TAG_PULL_REQUEST_STEP = field_tag(ps_pb2.PullRequest, "step", WIRE_VARINT)
_TAG_PULL_REQUEST_LOOKUP = field_tag(ps_pb2.PullRequest, "lookup", WIRE_VARINT)

_TAG_PUSH_RESPONSE_VERSIONS = field_tag(ps_pb2.PushResponse, "versions", WIRE_LEN)
_TAG_PUSH_RESPONSE_DUPLICATE = field_tag(ps_pb2.PushResponse, "duplicate", WIRE_VARINT)
_TAG_PUSH_RESPONSE_ELEMENTS_APPLIED = field_tag(ps_pb2.PushResponse, "elements_applied", WIRE_VARINT)
_TAG_PUSH_RESPONSE_DROPPED = field_tag(ps_pb2.PushResponse, "dropped", WIRE_VARINT)
_TAG_PUSH_RESPONSE_CLUSTER_STEP = field_tag(ps_pb2.PushResponse, "cluster_step", WIRE_VARINT)

_TAG_VARIABLE_VERSION_VARIABLE = field_tag(ps_pb2.VariableVersion, "variable", WIRE_LEN)
_TAG_VARIABLE_VERSION_VERSION = field_tag(ps_pb2.VariableVersion, "version", WIRE_VARINT)


@lru_cache(maxsize=1 << 14)
def _chunk_header_head(variable: str, offset: int, count: int, dtype: int) -> bytes:
    """variable, offset, count and dtype of a ChunkHeader; cached: every step sends them alike."""
    out = string_field(_TAG_CHUNK_HEADER_VARIABLE, variable)
    if offset:
        out += _TAG_CHUNK_HEADER_OFFSET + varint(offset)
    if count:
        out += _TAG_CHUNK_HEADER_COUNT + varint(count)
    if dtype:
        out += _TAG_CHUNK_HEADER_DTYPE + varint(dtype)
    return out


@lru_cache(maxsize=1 << 14)
def _unversioned_chunk_header(variable: str, offset: int, count: int, dtype: int, part_elements: int) -> bytes:
    """A whole ChunkHeader without a version (a worker's pushed chunks); cached like the head."""
    out = _chunk_header_head(variable, offset, count, dtype)
    return out + _TAG_CHUNK_HEADER_PART_ELEMENTS + varint(part_elements) if part_elements else out


def encode_chunk_header(variable: str, offset: int, count: int, dtype: int, version: int = 0,
                        part_elements: int = 0) -> bytes:
    """``ChunkHeader(...).SerializeToString()``, without building the message."""
    if not version:
        return _unversioned_chunk_header(variable, offset, count, dtype, part_elements)
    out = _chunk_header_head(variable, offset, count, dtype) + _TAG_CHUNK_HEADER_VERSION + varint(version)
    if part_elements:
        out += _TAG_CHUNK_HEADER_PART_ELEMENTS + varint(part_elements)
    return out


@lru_cache(maxsize=1 << 16)
def _push_item_head(variable: str, elements: int, wire_dtype: int) -> bytes:
    return (string_field(_TAG_PUSH_ITEM_VARIABLE, variable) + varint_field(_TAG_PUSH_ITEM_ELEMENTS, elements)
            + varint_field(_TAG_PUSH_ITEM_WIRE_DTYPE, wire_dtype))


def encode_push_item(variable: str, elements: int, wire_dtype: int, base_version: int = 0,
                     row_ids: bytes = b"") -> bytes:
    """``PushItem(...).SerializeToString()``; the fields that repeat every step are cached."""
    out = _push_item_head(variable, elements, wire_dtype)
    if base_version:
        out += _TAG_PUSH_ITEM_BASE_VERSION + varint(base_version)
    if row_ids:
        out += b"".join((_TAG_PUSH_ITEM_ROW_IDS, varint(len(row_ids)), row_ids))
    return out


def encode_push_begin(worker_id: str, incarnation: str, sequence: int, shard_index: int, num_shards: int,
                      kind: int, items: Sequence[bytes], step: int = 0, pull_after: bytes | None = None,
                      continued: bool = False) -> bytes:
    """``PushBegin(...).SerializeToString()`` with ``items`` already serialised (:func:`encode_push_item`).

    ``pull_after``: a serialised PullRequest, written even when empty (the
    server tells "no values asked for" from "asked for nothing" by its presence).
    ``continued``: the next message's begin continues this one (PushBegin.continued).
    """
    pieces = [string_field(_TAG_PUSH_BEGIN_WORKER_ID, worker_id),
              string_field(_TAG_PUSH_BEGIN_INCARNATION, incarnation),
              varint_field(_TAG_PUSH_BEGIN_SEQUENCE, sequence),
              varint_field(_TAG_PUSH_BEGIN_SHARD_INDEX, shard_index),
              varint_field(_TAG_PUSH_BEGIN_NUM_SHARDS, num_shards),
              varint_field(_TAG_PUSH_BEGIN_KIND, kind)]
    for item in items:
        pieces += (_TAG_PUSH_BEGIN_ITEMS, varint(len(item)), item)
    pieces.append(varint_field(_TAG_PUSH_BEGIN_STEP, step))
    if pull_after is not None:
        pieces += (_TAG_PUSH_BEGIN_PULL_AFTER, varint(len(pull_after)), pull_after)
    if continued:
        pieces.append(varint_field(_TAG_PUSH_BEGIN_CONTINUED, 1))
    return b"".join(pieces)


@lru_cache(maxsize=1 << 16)
def _pull_item_of_whole(variable: str) -> bytes:
    """A PullRequest.items entry for a whole part, framed; cached: a step pulls the same names each time."""
    item = string_field(_TAG_PULL_ITEM_VARIABLE, variable)
    return _TAG_PULL_REQUEST_ITEMS + varint(len(item)) + item


def encode_pull_item(variable: str, row_ids: bytes = b"") -> bytes:
    """A ``PullItem`` (a whole part, or ``row_ids``) as it is framed in :func:`encode_pull_request`."""
    if not row_ids:
        return _pull_item_of_whole(variable)
    item = b"".join((string_field(_TAG_PULL_ITEM_VARIABLE, variable), _TAG_PULL_ITEM_ROW_IDS,
                     varint(len(row_ids)), row_ids))
    return b"".join((_TAG_PULL_REQUEST_ITEMS, varint(len(item)), item))


def encode_pull_request(shard_index: int, num_shards: int, items: Sequence[bytes], wire_dtype: int = 0,
                        chunk_bytes: int = 0, worker_id: str = "", incarnation: str = "",
                        step: int = 0, lookup: int = 0) -> bytes:
    """``PullRequest(...).SerializeToString()`` with ``items`` from :func:`encode_pull_item`."""
    return b"".join((varint_field(_TAG_PULL_REQUEST_SHARD_INDEX, shard_index),
                     varint_field(_TAG_PULL_REQUEST_NUM_SHARDS, num_shards), *items,
                     varint_field(_TAG_PULL_REQUEST_WIRE_DTYPE, wire_dtype),
                     varint_field(_TAG_PULL_REQUEST_CHUNK_BYTES, chunk_bytes),
                     string_field(_TAG_PULL_REQUEST_WORKER_ID, worker_id),
                     string_field(_TAG_PULL_REQUEST_INCARNATION, incarnation),
                     varint_field(_TAG_PULL_REQUEST_STEP, step),
                     varint_field(_TAG_PULL_REQUEST_LOOKUP, lookup)))


def encode_push_response(versions: dict[str, int], duplicate: bool = False, elements_applied: int = 0,
                         dropped: bool = False, cluster_step: int = 0) -> bytes:
    """``PushResponse(...).SerializeToString()`` (without ``pulled``: see codec.push_response_pieces)."""
    pieces = []
    for variable, version in versions.items():
        entry = (string_field(_TAG_VARIABLE_VERSION_VARIABLE, variable)
                 + varint_field(_TAG_VARIABLE_VERSION_VERSION, version))
        pieces += (_TAG_PUSH_RESPONSE_VERSIONS, varint(len(entry)), entry)
    pieces += (varint_field(_TAG_PUSH_RESPONSE_DUPLICATE, int(duplicate)),
               varint_field(_TAG_PUSH_RESPONSE_ELEMENTS_APPLIED, elements_applied),
               varint_field(_TAG_PUSH_RESPONSE_DROPPED, int(dropped)),
               varint_field(_TAG_PUSH_RESPONSE_CLUSTER_STEP, cluster_step))
    return b"".join(pieces)
