"""Protobuf messages built from core objects: what the servicer answers with."""

from __future__ import annotations

from ps_server.core.consistency import ConsistencyStats
from ps_server.core.info import VariableInfo
from ps_server.core.membership import Membership
from ps_server.durability.checkpointer import CheckpointRecord
from ps_server.durability.restore import RestoredFrom
from ps_server.service.context import ShardContext
from wehub_ps import __version__
from wehub_ps.specs_proto import spec_to_proto
from wehub_ps.v1 import ps_pb2

__all__ = ["variable_info", "checkpoint_info", "restored_info", "worker_infos", "consistency_info",
           "describe_response"]


def variable_info(info: VariableInfo) -> ps_pb2.VariableInfo:
    return ps_pb2.VariableInfo(spec=spec_to_proto(info.spec), row_start=info.row_start,
                               row_end=info.row_end, version=info.version,
                               initialized=info.initialized, optimizer_steps=info.optimizer_steps,
                               num_rows=info.num_rows, evicted_rows=info.evicted_rows,
                               expired_rows=info.expired_rows, admitted_rows=info.admitted_rows,
                               unadmitted_reads=info.unadmitted_reads,
                               dropped_gradient_rows=info.dropped_gradient_rows,
                               rows_on_disk=info.rows_on_disk, disk_bytes=info.disk_bytes,
                               memory_hits=info.memory_hits, cold_reads=info.cold_reads)


def checkpoint_info(record: CheckpointRecord) -> ps_pb2.CheckpointInfo:
    w = record.written
    return ps_pb2.CheckpointInfo(checkpoint_id=w.checkpoint_id, path=str(w.path), created_unix=w.created_unix,
                                 write_seconds=w.write_seconds, pause_seconds=record.pause_seconds,
                                 bytes=w.bytes, num_shards=w.num_shards)


def restored_info(restored: RestoredFrom) -> ps_pb2.CheckpointInfo:
    """The checkpoint(s) restored from; the id names each old shard's checkpoint ("0:id,1:id")."""
    return ps_pb2.CheckpointInfo(
        checkpoint_id=",".join(f"{k}:{v}" for k, v in sorted(restored.checkpoint_ids.items())),
        path=restored.path, created_unix=restored.created_unix, num_shards=restored.num_shards)


def worker_infos(membership: Membership) -> list[ps_pb2.WorkerInfo]:
    return [ps_pb2.WorkerInfo(worker_id=r.worker_id, incarnation=r.incarnation, live=r.live,
                              seconds_since_seen=membership.seconds_since_seen(r), step=r.step,
                              registered_unix=r.registered_unix, pushes=r.pushes)
            for r in membership.workers()]


def consistency_info(c: ConsistencyStats) -> ps_pb2.ConsistencyInfo:
    return ps_pb2.ConsistencyInfo(
        mode=c.mode, staleness=c.staleness, backup_workers=c.backup_workers, step=c.step, pulls=c.pulls,
        pulls_blocked=c.pulls_blocked, blocked_seconds=c.blocked_seconds,
        max_staleness_admitted=c.max_staleness_admitted, dropped_gradients=c.dropped_gradients,
        steps_applied=c.steps_applied)


def describe_response(context: ShardContext) -> ps_pb2.DescribeResponse:
    """This shard as Describe reports it: variables, memory, workers, steps, checkpoints."""
    store = context.store
    response = ps_pb2.DescribeResponse(
        shard_index=store.shard_index, num_shards=store.num_shards,
        server_id=context.server_id, server_version=__version__,
        variables=[variable_info(info) for info in store.describe()],
        chunk_bytes_limit=context.max_chunk_bytes, lane_port=context.lane_port,
        stored_bytes=store.reserved_bytes, memory_limit_bytes=store.memory_limit,
        worker_lease_seconds=context.membership.lease_seconds,
        workers=worker_infos(context.membership))
    response.consistency.CopyFrom(consistency_info(context.consistency.stats()))
    checkpointer = context.checkpointer
    if checkpointer is not None and checkpointer.last is not None:
        response.last_checkpoint.CopyFrom(checkpoint_info(checkpointer.last))
    restored = context.restored_from()
    if restored is not None:
        response.restored_from.CopyFrom(restored_info(restored))
    replication = context.role.status()
    if replication is not None:
        response.replication.CopyFrom(replication)
    return response
