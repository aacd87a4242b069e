"""The etcd keys of one shard's replica set and the JSON records stored under them.

Under ``/wehub-ps/<job>/shard/<index>/``:

- ``members/<replica_index>``: ``{"address", "incarnation", "state",
  "holds_state", "epoch", "sequence"}`` on the member process's lease, so it
  vanishes when the process does; ``epoch``/``sequence`` are the position of
  the state it holds (``ps_server.coordination.positions``), published when
  its role changes;
- ``leader``: ``{"replica_index", "address", "incarnation"}`` on the leader's
  lease. The EPOCH of a term is this key's create_revision: etcd revisions
  are unique and grow, so a later term always has a larger epoch;
- ``isr``: ``{"epoch", "members": [[replica_index, incarnation], ...],
  "addresses": {replica_index: address}}``, the
  in-sync replicas, without a lease (it outlives every process). Only the
  leader of ``epoch`` writes it, in a transaction fenced on the leader key's
  create_revision. The isr written by a winning campaign has no ``epoch``
  field: the same transaction created the leader key, so the epoch is the
  isr key's own mod_revision.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ps_server.coordination.etcd_ops import KeyValue
from ps_server.coordination.positions import NO_STATE, Position

__all__ = ["InSync", "Leader", "Member", "ReplicaId", "ShardKeys"]

#: (replica_index, incarnation): one process of one replica slot.
ReplicaId = tuple[int, int]


@dataclass(frozen=True)
class ShardKeys:
    job: str
    shard_index: int

    def __post_init__(self) -> None:
        if not self.job or "/" in self.job:
            raise ValueError(f"job name {self.job!r} must be non-empty and contain no '/'")

    @property
    def prefix(self) -> str:
        return f"/wehub-ps/{self.job}/shard/{self.shard_index}/"

    @property
    def members_prefix(self) -> str:
        return self.prefix + "members/"

    def member(self, replica_index: int) -> str:
        return f"{self.members_prefix}{replica_index}"

    @property
    def leader(self) -> str:
        return self.prefix + "leader"

    @property
    def isr(self) -> str:
        return self.prefix + "isr"


def _load(kv: KeyValue) -> dict:
    try:
        data = json.loads(kv.value)
    except ValueError as error:
        raise ValueError(f"etcd key {kv.key.decode(errors='replace')} holds no JSON: {error}") from error
    if not isinstance(data, dict):
        key = kv.key.decode(errors="replace")
        message = f"etcd key {key} holds a JSON {type(data).__name__}, not an object"
        raise ValueError(message)  # noqa: TRY004 - bad content of the right type, as for bad JSON
    return data


def _dump(data: dict) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Leader:
    """The current term: who leads, and its epoch. ``lease``: the etcd lease the leader key is on."""

    replica_index: int
    address: str
    incarnation: int
    epoch: int
    lease: int = 0
    #: Where its backups connect for the replication stream ('host:port'; empty: not announced).
    replication_address: str = ""

    @classmethod
    def from_kv(cls, kv: KeyValue) -> Leader:
        data = _load(kv)
        return cls(int(data["replica_index"]), str(data["address"]), int(data["incarnation"]),
                   kv.create_revision, kv.lease, str(data.get("replication_address", "")))

    @staticmethod
    def encode(replica_index: int, address: str, incarnation: int, replication_address: str = "") -> bytes:
        data = {"replica_index": replica_index, "address": address, "incarnation": incarnation}
        if replication_address:
            data["replication_address"] = replication_address
        return _dump(data)


@dataclass(frozen=True)
class Member:
    """A live replica process as it announced itself."""

    replica_index: int
    address: str
    incarnation: int
    state: str
    #: Whether it holds state it followed from a primary or led (not only its checkpoint).
    holds_state: bool = False
    #: Where that state stands (NO_STATE when it holds none).
    position: Position = NO_STATE

    @classmethod
    def from_kv(cls, kv: KeyValue) -> Member:
        data = _load(kv)
        replica_index = int(kv.key.rsplit(b"/", 1)[1])
        holds_state = bool(data.get("holds_state", False))
        position = Position(int(data.get("epoch", 0)), int(data.get("sequence", 0))) if holds_state else NO_STATE
        return cls(replica_index, str(data["address"]), int(data["incarnation"]), str(data["state"]),
                   holds_state, position)

    def encode(self) -> bytes:
        return _dump({"address": self.address, "incarnation": self.incarnation, "state": self.state,
                      "holds_state": self.holds_state, "epoch": self.position.epoch,
                      "sequence": self.position.sequence})

    @property
    def id(self) -> ReplicaId:
        return (self.replica_index, self.incarnation)


@dataclass(frozen=True)
class InSync:
    """The in-sync replicas as of term ``epoch``; ``mod_revision`` identifies this version of the key."""

    epoch: int
    members: tuple[ReplicaId, ...]
    mod_revision: int = 0
    #: Where each member was reached, by replica index (to probe a member whose key is gone).
    addresses: tuple[tuple[int, str], ...] = ()

    @classmethod
    def from_kv(cls, kv: KeyValue) -> InSync:
        data = _load(kv)
        members = tuple((int(r), int(i)) for r, i in data["members"])
        addresses = tuple(sorted((int(r), str(a)) for r, a in data.get("addresses", {}).items()))
        return cls(int(data.get("epoch", kv.mod_revision)), members, kv.mod_revision, addresses)

    @staticmethod
    def encode(members: tuple[ReplicaId, ...] | list[ReplicaId], epoch: int | None,
               addresses: dict[int, str] | None = None) -> bytes:
        data: dict = {"members": [[int(r), int(i)] for r, i in members]}
        if epoch is not None:
            data["epoch"] = int(epoch)
        if addresses:
            data["addresses"] = {str(r): a for r, a in sorted(addresses.items())}
        return _dump(data)
