"""The network nemesis of the replicated randomized fault test: the fault kinds between parties.

Every party is a host of its own (``networked.NetworkedCluster``: each
replica, each worker, each etcd member in its own network namespace), so
faults pick pairs of parties. Every fault drops packets (never a reset):
open connections stall instead of failing. ``NETWORK_KINDS``:

- ``worker-partition`` / ``worker-oneway``: a worker and one replica of the
  shard (the primary three times in four), both ways or one direction;
- ``replica-partition`` / ``replica-oneway``: the shard's primary and its
  backup (the replication stream), both ways or one direction;
- ``etcd-partition`` / ``etcd-oneway``: one replica (the primary two times in
  three) and every etcd member, both ways or one direction;
- ``host-lost``: one replica's host drops every packet it sends or receives
  (the controller's excepted, so it still observes); a lost primary stays
  lost until the other replica leads (a failover the workers measure);
- ``link-down``: one replica's or worker's link down on the bridge;
- ``etcd-member-kill``: an etcd member (the leader half the time) SIGKILLed,
  restarted on its data;
- ``etcd-leader-partition``: the etcd leader cut off from the other members.

Every fault is healed after 1 to 6 s (``HOLD``) and the event returns once
every replica of every shard is in sync again, so one in-sync replica of
each shard always survives and the oracle allows no loss at all.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

from faults.layout import NUM_SHARDS, WORKERS

if TYPE_CHECKING:
    from faults.networked import NetworkedCluster

#: kind -> weight in the schedule after the first round (which runs every kind once).
NETWORK_KINDS = {
    "worker-partition": 2, "worker-oneway": 2, "replica-partition": 2, "replica-oneway": 2,
    "etcd-partition": 2, "etcd-oneway": 2, "host-lost": 2, "link-down": 1, "etcd-member-kill": 1,
    "etcd-leader-partition": 1,
}
#: Seconds a fault holds before it is healed.
HOLD = (1.0, 6.0)
#: Longest a lost primary's shard may go without a new primary.
FAILOVER_TIMEOUT = 30.0


class Nemesis:
    """Injects ``NETWORK_KINDS`` into a ``NetworkedCluster``; one event at a time, from the schedule's."""

    def __init__(self, cluster: NetworkedCluster) -> None:
        self.cluster = cluster

    def event(self, kind: str, shard: int, rng: random.Random) -> str:
        """Inject one fault of ``kind`` near ``shard``, hold it, heal it; what it did, for events.log."""
        cluster = self.cluster
        net = cluster.net
        primary = cluster.wait_in_sync(shard)
        backup = next(r for r in cluster.replicas[shard] if r is not primary)
        hold = rng.uniform(*HOLD)
        rules: list = []  # host_network.Rule, or the host key of a link set down
        started = time.monotonic()
        try:
            if kind in ("worker-partition", "worker-oneway"):
                worker = rng.randrange(WORKERS)
                replica = primary if rng.random() < 0.75 else backup
                worker_key, replica_key = cluster.worker_host(worker), cluster.replica_host(replica)
                if kind == "worker-partition":
                    what = f"worker {worker} <-> {_name(replica, primary)}"
                    rules = net.drop(worker_key, [net.ip(replica_key)], "both")
                elif rng.random() < 0.5:
                    what = f"worker {worker} -> {_name(replica, primary)} dropped"
                    rules = net.drop(replica_key, [net.ip(worker_key)], "in")
                else:
                    what = f"{_name(replica, primary)} -> worker {worker} dropped"
                    rules = net.drop(worker_key, [net.ip(replica_key)], "in")
            elif kind in ("replica-partition", "replica-oneway"):
                if kind == "replica-partition":
                    what = "primary <-> backup"
                    rules = net.drop(cluster.replica_host(primary), [net.ip(cluster.replica_host(backup))],
                                     "both")
                else:
                    source, target = (primary, backup) if rng.random() < 0.5 else (backup, primary)
                    what = f"{_name(source, primary)} -> {_name(target, primary)} dropped"
                    rules = net.drop(cluster.replica_host(target), [net.ip(cluster.replica_host(source))],
                                     "in")
            elif kind in ("etcd-partition", "etcd-oneway"):
                replica = primary if rng.random() < 2 / 3 else backup
                members = [m.address for m in cluster.etcd_cluster.members]
                direction = "both" if kind == "etcd-partition" else rng.choice(("in", "out"))
                arrow = {"both": "<-> etcd", "out": "-> etcd dropped", "in": "<- etcd dropped"}[direction]
                what = f"{_name(replica, primary)} {arrow}"
                if replica is primary:
                    def cut_from_etcd(p):
                        return net.drop(cluster.replica_host(p), members, direction)

                    self._on_primary(shard, rules, cut_from_etcd)
                else:
                    rules = net.drop(cluster.replica_host(replica), members, direction)
            elif kind == "host-lost":
                on_primary = rng.random() < 0.75
                what = f"{'primary' if on_primary else 'backup'}'s host lost"
                if on_primary:
                    primary = self._on_primary(shard, rules, lambda p: net.isolate(cluster.replica_host(p)))
                    cluster.timeline.failovers.append(("lost host", time.time()))
                    self._until_other_leads(shard, primary)
                else:
                    rules = net.isolate(cluster.replica_host(backup))
            elif kind == "link-down":
                def link_down(key: str) -> list:
                    net.cut(key)
                    return [key]

                if rng.random() < 0.5:
                    replica = rng.choice([primary, backup])
                    what = f"{_name(replica, primary)}'s link down"
                    if replica is primary:
                        self._on_primary(shard, rules, lambda p: link_down(cluster.replica_host(p)))
                    else:
                        rules = link_down(cluster.replica_host(replica))
                else:
                    worker = rng.randrange(WORKERS)
                    what = f"worker {worker}'s link down"
                    rules = link_down(cluster.worker_host(worker))
            elif kind == "etcd-member-kill":
                leader = cluster.etcd_cluster.leader()
                member = leader if leader is not None and rng.random() < 0.5 else \
                    rng.choice(cluster.etcd_cluster.members)
                what = f"etcd member {member.name}{' (leader)' if member is leader else ''} killed"
                cluster.etcd_cluster.kill(member)
                time.sleep(hold)
                cluster.etcd_cluster.restart(member)
            elif kind == "etcd-leader-partition":
                leader = self._etcd_leader()
                others = [m.address for m in cluster.etcd_cluster.members if m is not leader]
                what = f"etcd leader {leader.name} cut off from the other members"
                rules = net.drop(cluster.etcd_host(leader), others, "both")
            else:
                raise ValueError(f"unknown network fault kind {kind!r}")
            time.sleep(max(0.0, started + hold - time.monotonic()))  # a lost primary's failover may be longer
        finally:
            held = time.monotonic() - started
            for rule in rules:
                if isinstance(rule, str):
                    net.reconnect(rule)
            net.heal([rule for rule in rules if not isinstance(rule, str)])
        if kind.startswith("etcd-"):
            cluster.etcd_cluster.wait_ready()
        for each in range(NUM_SHARDS):
            cluster.wait_in_sync(each)
        return f"{what}, {held:.1f}s"

    def _on_primary(self, shard: int, rules: list, drop) -> object:
        """``rules`` += ``drop(primary)`` while the backup is in sync (``fault_on_primary``); the primary."""

        def inject(primary) -> None:
            rules.extend(drop(primary))

        def undo(primary) -> None:
            for rule in rules:
                if isinstance(rule, str):  # a link set down
                    self.cluster.net.reconnect(rule)
            self.cluster.net.heal([rule for rule in rules if not isinstance(rule, str)])
            rules.clear()

        return self.cluster.fault_on_primary(shard, inject, undo)

    def _until_other_leads(self, shard: int, primary) -> None:
        """Until a replica of ``shard`` other than ``primary`` leads (a failure past the bound)."""
        deadline = time.monotonic() + FAILOVER_TIMEOUT
        others = [r for r in self.cluster.replicas[shard] if r is not primary]
        while not any(r.running() and r.is_primary() for r in others):
            if time.monotonic() > deadline:
                self.cluster.report.fail("failover", f"shard {shard}: no replica took over from a primary "
                                                     f"whose host was lost for {FAILOVER_TIMEOUT:.0f}s")
                break
            time.sleep(0.05)

    def _etcd_leader(self):
        deadline = time.monotonic() + 30
        while (leader := self.cluster.etcd_cluster.leader()) is None:
            if time.monotonic() > deadline:
                raise RuntimeError("the etcd cluster has no leader")
            time.sleep(0.1)
        return leader


def _name(replica, primary) -> str:
    return "primary" if replica is primary else "backup"
