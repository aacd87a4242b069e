"""etcd's values as plain Python, and the parts of a transaction (compares and operations).

Callers build transactions from these helpers instead of protobuf messages,
so the etcd stubs stay an implementation detail of this package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ps_server.coordination.etcdpb import etcd_pb2

__all__ = [
    "KeyValue",
    "Lease",
    "TxnResult",
    "WatchEvent",
    "create_revision_is",
    "delete_op",
    "get_op",
    "key_bytes",
    "mod_revision_is",
    "prefix_end",
    "put_op",
]


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd stores it; revisions are etcd's global, monotonic counters."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_proto(cls, kv: etcd_pb2.KeyValue) -> KeyValue:
        return cls(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease)


@dataclass(frozen=True)
class WatchEvent:
    """A put or a delete seen by a watch. A delete's ``kv`` holds the key and the deletion revision."""

    kind: Literal["put", "delete"]
    kv: KeyValue


@dataclass(frozen=True)
class TxnResult:
    """Whether the compares held, the store revision after the transaction, and the branch's range results."""

    succeeded: bool
    revision: int
    ranges: tuple[tuple[KeyValue, ...], ...]


@dataclass(frozen=True)
class Lease:
    """A granted lease: its id (attach keys with ``put(..., lease=id)``) and etcd's TTL in seconds."""

    id: int
    ttl: int


def key_bytes(key: str | bytes) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key)


def prefix_end(prefix: str | bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix`` (etcd's rule)."""
    end = bytearray(key_bytes(prefix))
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every byte was 0xff: the range runs to the end of the keyspace


def create_revision_is(key: str | bytes, revision: int) -> etcd_pb2.Compare:
    """Holds when ``key``'s create_revision equals ``revision``; 0 means "the key does not exist"."""
    return etcd_pb2.Compare(result=etcd_pb2.Compare.EQUAL, target=etcd_pb2.Compare.CREATE, key=key_bytes(key),
                            create_revision=revision)


def mod_revision_is(key: str | bytes, revision: int) -> etcd_pb2.Compare:
    """Holds when ``key`` was last modified at ``revision`` (0: the key does not exist), i.e. is unchanged."""
    return etcd_pb2.Compare(result=etcd_pb2.Compare.EQUAL, target=etcd_pb2.Compare.MOD, key=key_bytes(key),
                            mod_revision=revision)


def put_op(key: str | bytes, value: bytes, lease: int = 0) -> etcd_pb2.RequestOp:
    return etcd_pb2.RequestOp(request_put=etcd_pb2.PutRequest(key=key_bytes(key), value=value, lease=lease))


def delete_op(key: str | bytes) -> etcd_pb2.RequestOp:
    return etcd_pb2.RequestOp(request_delete_range=etcd_pb2.DeleteRangeRequest(key=key_bytes(key)))


def get_op(key: str | bytes, *, prefix: bool = False) -> etcd_pb2.RequestOp:
    request = etcd_pb2.RangeRequest(key=key_bytes(key), range_end=prefix_end(key) if prefix else b"")
    return etcd_pb2.RequestOp(request_range=request)
