"""A node lost for good: its replica comes back elsewhere with an empty volume and rejoins from a snapshot.

Real ps-server replicas (--replicas 2) on a real etcd (tests/etcd_server.py
skips where etcd is not installed); workers push counted one-row gradients
(tests/replica_faults.py) throughout. The backup's process is SIGKILLed
and its whole directory (the pod's volume: checkpoints, numba's cache) is
deleted, as when a StatefulSet pod is force-deleted from an unreachable
node and its PersistentVolumeClaim with it. While it is away, ps-admin
shows the shard led by its primary alone; the replica started again on
the empty volume (a new incarnation) follows the primary, is seeded by a
snapshot and rejoins the in-sync set, so a later loss of the primary loses
nothing acknowledged.
"""

from __future__ import annotations

import shutil
import signal
import time

import numpy as np

from replica_faults import SlotPusher, check_slots, create_slots
from replica_testing import ReplicatedCluster, wait_for

from worker_client import PSClient
from worker_client.admin import main as ps_admin

SLOTS = 200_000


def test_a_replica_on_an_empty_volume_rejoins_from_a_snapshot_and_can_then_lead(tmp_path, etcd_server, capsys):
    cluster = ReplicatedCluster(tmp_path / "replicated", etcd_server.endpoint, 1, 2).start()
    clients = [PSClient(cluster.addresses, worker_id=f"w{i}", retry_timeout=60) for i in range(2)]
    pushers: list[SlotPusher] = []
    try:
        create_slots(clients[0], "slots", len(clients), SLOTS)
        pushers = [SlotPusher(c, "slots", i, SLOTS, pause=0.005).start() for i, c in enumerate(clients)]
        primary = cluster.primary(0)
        lost = next(r for r in cluster.shards[0] if r is not primary)
        with PSClient(cluster.addresses, worker_id="setup", register=False) as client:
            client.checkpoint()  # the lost volume held a checkpoint too: nothing of it may be needed
        time.sleep(0.5)

        lost.process.signal(signal.SIGKILL)
        lost.process.wait(10)
        shutil.rmtree(lost.process.workdir)
        lost.process.workdir.mkdir(parents=True)
        wait_for(lambda: not any(b.in_sync for b in primary.status().backups), 30,
                 "the primary leads alone", cluster)
        time.sleep(0.5)
        assert ps_admin(["status", "--addresses", cluster.addresses]) == 0
        alone = capsys.readouterr().out
        assert "UNREACHABLE" in alone or "unreachable" in alone, alone
        assert primary.address in alone and "primary" in alone, alone

        lost.start()  # the same address (the StatefulSet pod's name), an empty volume
        wait_for(lambda: any(b.in_sync for b in primary.status().backups), 30,
                 "the re-seeded replica back in the in-sync set", cluster)
        assert ps_admin(["status", "--addresses", cluster.addresses]) == 0
        rejoined = capsys.readouterr().out
        assert "backup" in rejoined and "UNREACHABLE" not in rejoined, rejoined
        with capsys.disabled():
            print(f"\nps-admin status while the replica is away:\n{alone}\nonce it rejoined:\n{rejoined}")
        log = lost.process.log_text()
        assert '"event": "snapshot loaded"' in log and '"event": "restored"' not in log, log[-3000:]
        time.sleep(0.5)

        primary.process.signal(signal.SIGKILL)  # now the re-seeded replica must hold everything
        assert cluster.primary(0, timeout=15) is lost
        time.sleep(0.5)
    finally:
        for pusher in pushers:
            pusher.stop.set()
        for pusher in pushers:
            pusher.join(90)
        try:
            with PSClient(cluster.addresses, worker_id="checker") as checker:
                check = check_slots(checker.pull(["slots"])["slots"], pushers)
        finally:
            for client in clients:
                client.close()
            cluster.stop()
    raised = {p.worker: list(p.raised.values())[:3] for p in pushers if p.raised}
    assert not raised, raised
    assert not check.violations, check.violations[:10]
    assert check.acknowledged > 50


def test_a_replica_with_an_empty_volume_never_leads_a_shard_that_was_led_before(tmp_path, etcd_server):
    """Both replicas lost; the one that comes back first has an empty volume. It must not start the shard
    empty, not even past --unclean-election-after (1 s here): it waits, saying why, until the replica
    whose volume holds a checkpoint is back and restores it."""
    cluster = ReplicatedCluster(tmp_path / "replicated", etcd_server.endpoint, 1, 2,
                                ("--unclean-election-after", "1")).start()
    try:
        with PSClient(cluster.addresses, worker_id="setup") as client:
            create_slots(client, "slots", 1, 100)
            client.push_rows("slots", np.array([3]), np.array([[5.0]], np.float32))
            client.checkpoint()
        primary = cluster.primary(0)
        empty = next(r for r in cluster.shards[0] if r is not primary)
        for replica in cluster.shards[0]:
            replica.process.signal(signal.SIGKILL)
            replica.process.wait(10)
        shutil.rmtree(empty.process.workdir)
        empty.process.workdir.mkdir(parents=True)

        empty.start()
        wait_for(lambda: "holds no state and no checkpoint" in empty.process.log_text(), 30,
                 "the empty replica says why it does not lead", cluster)
        time.sleep(2.5)  # past --unclean-election-after, with the other replica's port refusing
        assert not empty.is_primary()

        primary.start()
        assert cluster.primary(0, timeout=30) is primary
        with PSClient(cluster.addresses, worker_id="checker") as client:
            assert client.pull_rows("slots", np.array([3]))[0, 0] == -5.0  # restored, not started empty
        wait_for(lambda: any(b.in_sync for b in primary.status().backups), 30,
                 "the empty replica seeded from the restored primary", cluster)
    finally:
        cluster.stop()
