"""Replica sets through etcd: a small etcd v3 client, lease renewal, and one shard's elections and isr.

A leaf of ps_server: it knows nothing of the shard's state, only of who
leads which term. The replication layer builds on ``ShardCoordinator``.
"""

from ps_server.coordination.errors import CoordinationError
from ps_server.coordination.etcd_client import EtcdClient
from ps_server.coordination.etcd_ops import KeyValue, Lease, TxnResult, WatchEvent
from ps_server.coordination.records import InSync, Leader, Member, ReplicaId, ShardKeys
from ps_server.coordination.shard import ShardCoordinator, ShardState, eligible
from ps_server.coordination.watch import Watcher

__all__ = [
           "CoordinationError",
           "EtcdClient",
           "InSync",
           "KeyValue",
           "Leader",
           "Lease",
           "Member",
           "ReplicaId",
           "ShardCoordinator",
           "ShardKeys",
           "ShardState",
           "TxnResult",
           "WatchEvent",
           "Watcher",
           "eligible",
]
