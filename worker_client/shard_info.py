"""What a ps-server reports about itself (Describe), as plain Python values.

:class:`ShardInfo` is a shard's state as its primary reports it;
:class:`ReplicaInfo` is one replica's part in its shard's replication
(asked of every replica, backups included, for ``ps-admin status``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wehub_ps.specs import VariableSpec
from wehub_ps.specs_proto import spec_from_proto
from wehub_ps.v1 import ps_pb2

__all__ = ["BackupInfo", "ReplicaInfo", "ShardInfo", "read_describe", "read_replica_status"]


@dataclass(frozen=True)
class ShardInfo:
    """What one ps-server reports about itself."""

    address: str
    shard_index: int
    num_shards: int
    server_id: str
    server_version: str
    variables: dict[str, dict[str, Any]]
    chunk_bytes_limit: int = 0
    worker_lease_seconds: float = 0.0
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    last_checkpoint: dict[str, Any] | None = None
    restored_from: dict[str, Any] | None = None
    consistency: dict[str, Any] = field(default_factory=dict)
    stored_bytes: int = 0
    memory_limit_bytes: int = 0


def read_describe(address: str, raw: bytes) -> tuple[ShardInfo, list[VariableSpec]]:
    """A serialised DescribeResponse from ``address``: the shard's state and the specs of its variables."""
    msg = ps_pb2.DescribeResponse.FromString(raw)
    variables = {}
    specs = []
    for info in msg.variables:
        spec = spec_from_proto(info.spec)
        specs.append(spec)
        variables[spec.name] = {"row_start": info.row_start, "row_end": info.row_end,
                                "version": info.version, "initialized": info.initialized,
                                "optimizer_steps": info.optimizer_steps, "num_rows": info.num_rows,
                                "evicted_rows": info.evicted_rows, "hash_table": spec.hash_table,
                                "expired_rows": info.expired_rows, "admitted_rows": info.admitted_rows,
                                "unadmitted_reads": info.unadmitted_reads,
                                "dropped_gradient_rows": info.dropped_gradient_rows,
                                "rows_on_disk": info.rows_on_disk, "disk_bytes": info.disk_bytes,
                                "memory_hits": info.memory_hits, "cold_reads": info.cold_reads}
    workers = {w.worker_id: {"incarnation": w.incarnation, "live": w.live, "step": w.step,
                             "seconds_since_seen": w.seconds_since_seen, "pushes": w.pushes}
               for w in msg.workers}
    checkpoint = None
    if msg.HasField("last_checkpoint"):
        c = msg.last_checkpoint
        checkpoint = {"checkpoint_id": c.checkpoint_id, "path": c.path, "created_unix": c.created_unix,
                      "bytes": c.bytes, "write_seconds": c.write_seconds, "pause_seconds": c.pause_seconds}
    restored = None
    if msg.HasField("restored_from"):
        r = msg.restored_from
        restored = {"checkpoint_id": r.checkpoint_id, "path": r.path, "created_unix": r.created_unix,
                    "num_shards": r.num_shards}
    c = msg.consistency
    consistency = {"mode": c.mode or "async", "staleness": c.staleness, "backup_workers": c.backup_workers,
                   "step": c.step, "pulls": c.pulls, "pulls_blocked": c.pulls_blocked,
                   "blocked_seconds": c.blocked_seconds, "max_staleness_admitted": c.max_staleness_admitted,
                   "dropped_gradients": c.dropped_gradients, "steps_applied": c.steps_applied}
    info = ShardInfo(address, msg.shard_index, msg.num_shards, msg.server_id, msg.server_version, variables,
                     msg.chunk_bytes_limit, msg.worker_lease_seconds, workers, checkpoint, restored,
                     consistency, msg.stored_bytes, msg.memory_limit_bytes)
    return info, specs


@dataclass(frozen=True)
class BackupInfo:
    """One backup as its primary sees it: whether it is in the in-sync set, and how far behind it is."""

    replica_index: int
    address: str
    in_sync: bool
    acknowledged_sequence: int
    lag_records: int
    lag_bytes: int
    lag_seconds: float


@dataclass(frozen=True)
class ReplicaInfo:
    """One replica's own account of its shard's replication (Describe with ``any_replica``).

    ``role`` is "primary", "backup" (in sync), "catching-up", "candidate",
    "starting" or "deposed"; ``epoch`` the primary's term this replica knows
    (0: none known); ``applied_sequence`` the last change it applied (the
    primary: the last it ordered); ``lease_proven`` whether etcd confirmed
    its lease within the lease's time; ``backups``, on the primary only,
    each backup's in-sync state and lag.
    """

    address: str
    replica_index: int
    replicas: int
    role: str
    epoch: int
    primary_address: str
    applied_sequence: int
    lease_proven: bool
    backups: tuple[BackupInfo, ...] = ()


def read_replica_status(address: str, raw: bytes) -> ReplicaInfo | None:
    """A serialised DescribeResponse from the replica at ``address``: its replication status, or None
    when the server runs unreplicated (--replicas 1 sends none)."""
    msg = ps_pb2.DescribeResponse.FromString(raw)
    if not msg.HasField("replication"):
        return None
    r = msg.replication
    backups = tuple(BackupInfo(b.replica_index, b.address, b.in_sync, b.acknowledged_sequence, b.lag_records,
                               b.lag_bytes, b.lag_seconds) for b in r.backups)
    return ReplicaInfo(address, r.replica_index, r.replicas, r.role, r.epoch, r.primary_address,
                       r.applied_sequence, r.etcd_reachable, backups)
