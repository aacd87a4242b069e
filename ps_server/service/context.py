"""Everything one shard's RPC methods work with, in one place."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ps_server.core.admission import Admission
from ps_server.durability.checkpointer import Checkpointer
from ps_server.durability.restore import RestoredFrom
from ps_server.core.consistency import ConsistencyController
from ps_server.core.lifecycle import Lifecycle
from ps_server.core.membership import Membership
from ps_server.ops.metrics import Metrics
from ps_server.core.ledger import PushLedger
from ps_server.core.store import VariableStore

__all__ = ["ShardContext"]


@dataclass
class ShardContext:
    store: VariableStore
    ledger: PushLedger
    lifecycle: Lifecycle
    membership: Membership
    consistency: ConsistencyController
    server_id: str
    default_chunk_bytes: int
    max_chunk_bytes: int
    checkpointer: Checkpointer | None = None
    restored_from: RestoredFrom | None = field(default=None)
    metrics: Metrics | None = None
    finish_requested: threading.Event | None = None
    allow_finish: bool = False
    #: Bounds on ordinary calls and Exchange streams in progress (ps_server.core.admission).
    admission: Admission = field(default_factory=lambda: Admission(256, 512))
