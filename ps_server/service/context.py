"""Everything one shard's RPC methods work with, built complete by the composition root."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ps_server.core.admission import Admission
from ps_server.core.consistency import ConsistencyController
from ps_server.core.ledger import PushLedger
from ps_server.core.lifecycle import Lifecycle
from ps_server.core.membership import Membership
from ps_server.core.pulls import PullPlanner
from ps_server.core.store import VariableStore
from ps_server.core.workers import WorkerPresence
from ps_server.durability.checkpointer import Checkpointer
from ps_server.durability.restore import RestoredFrom
from ps_server.ops.metrics import Metrics
from ps_server.service.roles import ShardRole, SingleReplica

__all__ = ["ShardContext"]


@dataclass(frozen=True)
class ShardContext:
    store: VariableStore
    ledger: PushLedger
    lifecycle: Lifecycle
    membership: Membership
    consistency: ConsistencyController
    workers: WorkerPresence
    pulls: PullPlanner
    metrics: Metrics
    #: Bounds on ordinary calls and Exchange streams in progress (ps_server.core.admission).
    admission: Admission
    server_id: str
    #: The largest chunk a pull is answered in (Describe reports it to clients).
    max_chunk_bytes: int
    #: None without --checkpoint-dir.
    checkpointer: Checkpointer | None
    #: The checkpoint the store was restored from; None before the restore or when there was none.
    restored_from: Callable[[], RestoredFrom | None]
    #: Set by a client's finish() when ``allow_finish`` (--allow-finish): the daemon then shuts down.
    finish_requested: threading.Event
    allow_finish: bool
    #: The TCP lane's port (--lane-port), 0 without one; Describe reports it.
    lane_port: int = 0
    #: This replica's role in its shard's replica set (SingleReplica: unreplicated).
    role: ShardRole = field(default_factory=SingleReplica)
