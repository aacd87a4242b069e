"""Replication's Prometheus metrics, read from the replica's role at each scrape.

Per backup (on the primary): in sync or not, and how far behind it is in
records, bytes and seconds; per replica: role, epoch, the last sequence,
failovers won and how long the last election and failover took.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ps_server.replication.role import PRIMARY, ReplicaRole

__all__ = ["ReplicationCollector"]


class ReplicationCollector(Collector):
    def __init__(self, role: ReplicaRole) -> None:
        self._role = role

    def collect(self) -> Iterator:
        role = self._role
        yield _gauge("wehub_ps_replica_primary", "1 on the shard's primary, 0 on a backup",
                     float(role.state == PRIMARY))
        yield _gauge("wehub_ps_replica_epoch", "The primary's term this replica knows (an etcd revision)",
                     role.epoch)
        yield _gauge("wehub_ps_replica_sequence", "The newest change ordered (primary) or applied (backup)",
                     role.last_sequence())
        yield _gauge("wehub_ps_etcd_lease_valid", "1 while this replica's etcd lease is proven valid",
                     float(role.lease_proven()))
        failovers = CounterMetricFamily("wehub_ps_failovers", "Elections this replica won after its primary "
                                        "was lost")
        failovers.add_metric([], role.failovers)
        yield failovers
        yield _gauge("wehub_ps_election_seconds", "Duration of this replica's last won campaign (etcd "
                     "transaction and taking over)", role.last_election_seconds)
        yield _gauge("wehub_ps_failover_seconds", "From losing the primary's stream to serving as the new "
                     "primary, for the last failover this replica won", role.last_failover_seconds)
        in_sync = GaugeMetricFamily("wehub_ps_backup_in_sync", "1 for a backup in the in-sync set",
                                    labels=["replica"])
        records = GaugeMetricFamily("wehub_ps_backup_lag_records", "Changes ordered but not yet applied by "
                                    "the backup", labels=["replica"])
        nbytes = GaugeMetricFamily("wehub_ps_backup_lag_bytes", "Bytes of changes queued for the backup",
                                   labels=["replica"])
        seconds = GaugeMetricFamily("wehub_ps_backup_lag_seconds", "Age of the oldest message the backup has "
                                    "not answered", labels=["replica"])
        if role.state == PRIMARY:
            for backup in role.status().backups:
                label = [str(backup.replica_index)]
                in_sync.add_metric(label, float(backup.in_sync))
                records.add_metric(label, backup.lag_records)
                nbytes.add_metric(label, backup.lag_bytes)
                seconds.add_metric(label, backup.lag_seconds)
        yield from (in_sync, records, nbytes, seconds)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation)
    family.add_metric([], value)
    return family
