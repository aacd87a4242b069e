"""Planned switchovers: a primary hands its role to an in-sync backup, on SIGTERM or on an operator's request.

Real ps-server replicas on a real etcd (tests/etcd_server.py skips where
etcd is not installed). Workers push one-row gradients whose every
application is counted (tests/replica_faults.py), so nothing acknowledged
may be lost or applied twice. The leases are 5 s here: a primary that
stopped without handing over would leave its shard without a primary
until its lease ran out, so the workers' longest wait tells a handover
from a failover. Each worker's longest wait between two acknowledged
pushes is printed (the target for a rolling restart is <= 250 ms; on a
loaded 2-core runner the tail is the scheduler's, so only a sanity bound
below the lease is asserted).
"""

from __future__ import annotations

import signal
import time

import pytest
from replica_faults import SlotPusher, check_slots, create_slots
from replica_testing import ReplicatedCluster, log_events, wait_for

from worker_client import PSClient
from worker_client.admin import main as ps_admin
from worker_client.errors import FailedPreconditionError

LEASE_SECONDS = 5
SLOTS = 200_000


def _in_sync(cluster: ReplicatedCluster, shard: int):
    def check() -> bool:
        try:
            backups = cluster.primary(shard, timeout=30).status(timeout=2).backups
        except Exception:  # noqa: BLE001 - a replica between roles: asked again
            return False
        running = sum(r.running() for r in cluster.shards[shard]) - 1
        return len(backups) >= running and sum(b.in_sync for b in backups) >= running
    return check


def _longest_waits(pushers: list[SlotPusher], since: float) -> list[float]:
    """Each worker's longest time between two acknowledged pushes after ``since``."""
    waits = []
    for pusher in pushers:
        times = sorted(at for at in pusher.acknowledged.values() if at >= since)
        waits.append(max((b - a for a, b in zip(times, times[1:])), default=float("inf")))
    return waits


class _Training:
    """Workers pushing counted one-row gradients to ``cluster`` until ``finish``."""

    def __init__(self, cluster: ReplicatedCluster, workers: int = 3) -> None:
        self.clients = [PSClient(cluster.addresses, worker_id=f"w{i}", retry_timeout=60) for i in range(workers)]
        create_slots(self.clients[0], "slots", workers, SLOTS)
        self.pushers = [SlotPusher(client, "slots", i, SLOTS, pause=0.005) for i, client in enumerate(self.clients)]
        for pusher in self.pushers:
            pusher.start()

    def finish(self, cluster: ReplicatedCluster) -> None:
        for pusher in self.pushers:
            pusher.stop.set()
        for pusher in self.pushers:
            pusher.join(90)
        with PSClient(cluster.addresses, worker_id="checker") as checker:
            check = check_slots(checker.pull(["slots"])["slots"], self.pushers)
        for client in self.clients:
            client.close()
        raised = {p.worker: list(p.raised.values())[:3] for p in self.pushers if p.raised}
        assert not raised, f"pushes raised (a switchover is ridden out): {raised}"
        assert not check.violations, check.violations[:10]
        assert check.acknowledged > 20, "the workers hardly pushed: the test saw no switchover under load"


@pytest.fixture
def two_replicas(tmp_path, etcd_server):
    cluster = ReplicatedCluster(tmp_path / "replicated", etcd_server.endpoint, 1, 2,
                                lease_seconds=LEASE_SECONDS).start()
    yield cluster
    cluster.stop()


def test_sigterm_on_a_primary_hands_its_role_over_and_loses_nothing(two_replicas):
    cluster = two_replicas
    training = _Training(cluster)
    waits = []
    try:
        for _ in range(2):  # each replica is the one stopped once
            wait_for(_in_sync(cluster, 0), 30, "the backup in sync", cluster)
            primary = cluster.primary(0)
            backup = next(r for r in cluster.shards[0] if r is not primary)
            time.sleep(0.5)
            stopped = time.monotonic()
            primary.process.signal(signal.SIGTERM)
            wait_for(backup.is_primary, LEASE_SECONDS, "the backup leads before the old lease ran out", cluster)
            primary.process.wait(30)
            time.sleep(0.5)
            waits.append(max(_longest_waits(training.pushers, stopped - 0.2)))
            handed = log_events(primary.process.log_text(), "handed over the primary role")
            assert handed and handed[-1]["take_over_sent"] is True, primary.process.log_text()[-3000:]
            # Refusals named the backup only once it took the term (it holds calls from then on, rather
            # than refusing them back to the old primary), and it stayed in the in-sync set meanwhile.
            assert handed[-1]["take_over_taken"] is True, primary.process.log_text()[-3000:]
            assert log_events(backup.process.log_text(), "taking over the primary role")
            won = log_events(backup.process.log_text(), "won the election")
            assert won and won[-1]["from_isr"] is True, backup.process.log_text()[-3000:]
            primary.start()
    finally:
        training.finish(cluster)
    print(f"\nSIGTERM handovers: each one's longest wait for a push, over 3 workers: "
          f"{', '.join(f'{w * 1000:.0f} ms' for w in waits)}")
    assert max(waits) < LEASE_SECONDS


def test_a_rolling_restart_of_every_replica_during_training_loses_nothing(tmp_path, etcd_server):
    """Every pod of a 2-shard, 2-replica job restarted in turn, as a StatefulSet's rolling update does:
    each replica gets SIGTERM (a primary hands its role over first), comes back on its port and is
    waited for until its primary counts it in sync again."""
    cluster = ReplicatedCluster(tmp_path / "replicated", etcd_server.endpoint, 2, 2,
                                lease_seconds=LEASE_SECONDS).start()
    try:
        training = _Training(cluster, workers=4)
        try:
            for shard in range(2):
                wait_for(_in_sync(cluster, shard), 30, f"shard {shard} in sync", cluster)
            time.sleep(0.5)
            started = time.monotonic()
            for shard in range(2):
                for replica in reversed(cluster.shards[shard]):  # a StatefulSet updates the highest ordinal first
                    replica.process.signal(signal.SIGTERM)
                    replica.process.wait(30)
                    replica.start()
                    wait_for(_in_sync(cluster, shard), 30, f"shard {shard} in sync after a restart", cluster)
            time.sleep(0.5)
            waits = _longest_waits(training.pushers, started)
        finally:
            training.finish(cluster)
        handovers = sum(len(log_events(r.process.log_text(), "handed over the primary role")) for r in cluster.all())
        assert handovers >= 2, "a primary stopped without handing its role over"
        print(f"\nrolling restart of 2 shards x 2 replicas: each worker's longest wait for a push: "
              f"{', '.join(f'{w * 1000:.0f} ms' for w in waits)}")
        assert max(waits) < LEASE_SECONDS
    finally:
        cluster.stop()


def test_switchover_on_request_to_a_named_replica_and_refusals(tmp_path, etcd_server, capsys):
    cluster = ReplicatedCluster(tmp_path / "replicated", etcd_server.endpoint, 1, 3,
                                lease_seconds=LEASE_SECONDS).start()
    try:
        training = _Training(cluster, workers=2)
        try:
            wait_for(_in_sync(cluster, 0), 30, "the backups in sync", cluster)
            time.sleep(1.0)  # pushes in flight
            primary = cluster.primary(0)
            target = [r for r in cluster.shards[0] if r is not primary][-1]
            assert ps_admin(["switchover", "--shard", "0", "--to", str(target.replica_index),
                             "--addresses", cluster.addresses]) == 0
            out = capsys.readouterr().out
            assert f"replica {target.replica_index} ({target.address})" in out and "leads (term" in out, out
            assert target.is_primary() and not primary.is_primary()
            wait_for(_in_sync(cluster, 0), 30, "the old primary back in sync as a backup", cluster)

            # The replica that leads, named: answered at once, nothing changes (a client cut off by the
            # handover it asked for asks again and is answered). An unknown replica: refused.
            with PSClient(cluster.addresses, worker_id="operator", register=False) as client:
                again = client.switchover(0, target.replica_index)
                assert (again["replica_index"], again["address"]) == (target.replica_index, target.address)
                with pytest.raises(FailedPreconditionError, match="not in the in-sync set") as refused:
                    client.switchover(0, 7)
                assert refused.value.reason == "SWITCHOVER_REFUSED"
                assert target.is_primary()
                time.sleep(1.0)
                done = client.switchover(0)  # the backup furthest along
            assert done["from"] == target.address and done["replica_index"] != target.replica_index
            wait_for(lambda: any(r.is_primary() for r in cluster.shards[0] if r is not target), LEASE_SECONDS,
                     "a backup leads", cluster)
        finally:
            training.finish(cluster)
    finally:
        cluster.stop()


def test_an_unreplicated_server_refuses_a_switchover(cluster_factory):
    cluster = cluster_factory(1)
    with PSClient(",".join(cluster.addresses), worker_id="operator", register=False) as client:
        with pytest.raises(FailedPreconditionError, match="unreplicated"):
            client.switchover(0)
        assert client.describe()  # still serving
