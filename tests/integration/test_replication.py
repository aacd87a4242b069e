"""Replicated shards (--replicas 2) on a real etcd: same bits on every replica, failover without loss.

Every test starts real ps-server processes and a real etcd on loopback
(tests/etcd_server.py skips them where etcd is not installed, and fails
them in CI, which installs it).
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import numpy as np
import pytest
from replica_testing import ReplicatedCluster, checkpoint_contents

from wehub_ps.errors import REASON_METADATA_KEY
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.rpc import PRIMARY_METADATA_KEY, method_path
from worker_client import SGD, Adam, PSClient, Zeros


def _wait_caught_up(cluster: ReplicatedCluster, shard: int = 0, timeout: float = 30.0) -> int:
    """Every backup of ``shard`` applied all the primary ordered; returns that sequence."""
    deadline = time.monotonic() + timeout
    while True:
        primary = cluster.primary(shard)
        status = primary.status()
        backups = [r for r in cluster.shards[shard] if r is not primary and r.running()]
        if all(b.status().applied_sequence == status.applied_sequence for b in backups) and all(
                b.in_sync for b in status.backups):
            return status.applied_sequence
        assert time.monotonic() < deadline, f"backups did not catch up:\n{cluster.logs(shard)}"
        time.sleep(0.05)


def test_a_backup_refuses_workers_and_names_the_primary(replicated):
    cluster = replicated()
    primary = cluster.primary(0)
    backup = next(r for r in cluster.shards[0] if r is not primary)
    with grpc.insecure_channel(backup.address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            describe = channel.unary_unary(method_path("Describe"))
            describe(ps_pb2.DescribeRequest().SerializeToString(), timeout=5)
    trailers = dict(refused.value.trailing_metadata())
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert trailers[REASON_METADATA_KEY] == "NOT_PRIMARY"
    assert trailers[PRIMARY_METADATA_KEY] == primary.address
    assert primary.address in refused.value.details()
    status = backup.status()
    assert (status.role, status.primary_address, status.replicas) == ("backup", primary.address, 2)
    assert primary.status().backups[0].in_sync


def _train(address: str, worker: str, steps: int, seed: int, stop: threading.Event | None = None) -> None:
    """Known integer gradients into dense (Adam: slots), dense rows and an LRU hash table (until ``stop``)."""
    rng = np.random.default_rng(seed)
    with PSClient([address], worker_id=worker) as client:
        client.create_variable("dense", (64, 8), initializer=Zeros(), optimizer=Adam(0.01))
        client.create_variable("rows", (256, 4), initializer=Zeros(), optimizer=SGD(1.0))
        client.create_embedding("table", 4, optimizer=Adam(0.01), max_rows=40, eviction="lru")
        for _ in range(steps):
            if stop is not None and stop.is_set():
                return
            client.pull(["dense"])
            client.push({"dense": rng.integers(-3, 4, (64, 8)).astype(np.float32)})
            ids = rng.choice(256, 16, replace=False)
            client.push_rows("rows", ids, rng.integers(-3, 4, (16, 4)).astype(np.float32))
            table_ids = rng.integers(0, 120, 12)
            client.pull_rows("table", table_ids)
            unique = np.unique(table_ids)
            client.push_rows("table", unique, rng.integers(-3, 4, (len(unique), 4)).astype(np.float32))


def test_primary_and_backup_hold_the_same_bits(replicated):
    """Values, optimizer slots, versions and the ledger, after concurrent workers, compared bit for bit."""
    cluster = replicated()
    primary = cluster.primary(0)
    threads = [threading.Thread(target=_train, args=(primary.address, f"w{i}", 40, i)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    sequence = _wait_caught_up(cluster)
    assert sequence > 200
    backup = next(r for r in cluster.shards[0] if r is not primary)
    backup.process.stop()  # SIGTERM: each writes its final checkpoint
    primary.process.stop()
    primary_tensors, primary_state = checkpoint_contents(primary.newest_checkpoint())
    backup_tensors, backup_state = checkpoint_contents(backup.newest_checkpoint())
    assert sorted(primary_tensors) == sorted(backup_tensors)
    assert any("table" in name for name in primary_tensors)
    for name, values in primary_tensors.items():
        assert values.tobytes() == backup_tensors[name].tobytes(), name
    assert primary_state == backup_state
    assert primary_state["ledger"]["entries"]


def test_sigkill_of_the_primary_loses_no_acknowledged_push(replicated):
    """The backup takes over; every push acknowledged before or after is in the value exactly once."""
    cluster = replicated()
    primary = cluster.primary(0)
    client = PSClient([primary.address], worker_id="w0")
    client.create_variable("v", (1000,), initializer=Zeros(), optimizer=SGD(1.0))
    acknowledged = 0
    for _ in range(50):
        client.push({"v": np.ones(1000, np.float32)})
        acknowledged += 1
    client.close()
    primary.process.signal(signal.SIGKILL)
    killed = time.monotonic()
    survivor = cluster.primary(0, timeout=10)
    took = time.monotonic() - killed
    assert survivor is not primary
    with PSClient([survivor.address], worker_id="w1") as client:
        np.testing.assert_array_equal(client.pull(["v"])["v"], np.full(1000, -acknowledged, np.float32))
        client.push({"v": np.ones(1000, np.float32)})
        np.testing.assert_array_equal(client.pull(["v"])["v"], np.full(1000, -acknowledged - 1, np.float32))
    assert took < 5, f"failover took {took:.2f}s"


def test_replicas_over_mutual_tls_with_a_token(tmp_path, etcd_server):
    """The replication port speaks mutual TLS with the servers' certificates and checks the bearer token."""
    from tls_material import issue, make_ca

    ca, ca_cert, ca_key = make_ca(tmp_path, "ca")
    server = issue(tmp_path, "server", ca_cert, ca_key, True, client_too=True)
    client = issue(tmp_path, "client", ca_cert, ca_key, False)
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    cluster = ReplicatedCluster(tmp_path / "tls", etcd_server.endpoint, 1, 2, (
        "--tls-cert", str(server.cert), "--tls-key", str(server.key), "--tls-client-ca", str(ca.cert),
        "--auth-token-file", str(token)), health_tls=(ca, client), health_token="s3cret")
    try:
        cluster.start()
        with PSClient(cluster.addresses, worker_id="w0", tls_ca=str(ca.cert), tls_cert=str(client.cert),
                      tls_key=str(client.key), auth_token_file=str(token)) as worker:
            worker.create_variable("v", (100,), initializer=Zeros(), optimizer=SGD(1.0))
            for _ in range(5):
                worker.push({"v": np.ones(100, np.float32)})
            primary = cluster.primary(0)
            assert primary.status().backups[0].in_sync
            primary.process.signal(signal.SIGKILL)
            worker.push({"v": np.ones(100, np.float32)})
            np.testing.assert_array_equal(worker.pull(["v"])["v"], np.full(100, -6, np.float32))
    finally:
        cluster.stop()


def test_finish_ends_every_replica(replicated):
    cluster = replicated(1, 2, "--allow-finish")
    with PSClient(cluster.addresses, worker_id="w0") as client:
        client.create_variable("v", (10,), initializer=Zeros(), optimizer=SGD(1.0))
        client.push({"v": np.ones(10, np.float32)})
        client.finish()
    for replica in cluster.all():
        assert replica.process.wait(30) == 0, replica.process.log_text()[-3000:]


def test_sigterm_of_the_primary_hands_over_without_losing_pushes(replicated):
    """A rolling update: the primary drains, its backup is elected, the worker pushes on, nothing twice."""
    cluster = replicated()
    old = cluster.primary(0)
    acknowledged = 0
    with PSClient(cluster.addresses, worker_id="w0") as client:
        client.create_variable("v", (1000,), initializer=Zeros(), optimizer=SGD(1.0))
        stopper = threading.Thread(target=old.process.stop)
        for step in range(150):
            if step == 30:
                stopper.start()
            client.push({"v": np.ones(1000, np.float32)})
            acknowledged += 1
        stopper.join(30)
        assert old.process.popen.returncode == 0, old.process.log_text()[-3000:]
        assert cluster.primary(0) is not old
        np.testing.assert_array_equal(client.pull(["v"])["v"], np.full(1000, -acknowledged, np.float32))


def test_a_backup_killed_under_load_catches_up_and_holds_the_same_bits(replicated):
    """SIGKILL the backup while workers train, restart it on its port: snapshot, stream, in sync, bits."""
    cluster = replicated()
    primary = cluster.primary(0)
    backup = next(r for r in cluster.shards[0] if r is not primary)
    stop = threading.Event()
    threads = [threading.Thread(target=_train, args=(primary.address, f"w{i}", 100_000, i, stop))
               for i in range(2)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 30
        while primary.status().applied_sequence < 100:
            assert time.monotonic() < deadline, cluster.logs()
            time.sleep(0.05)
        backup.process.signal(signal.SIGKILL)
        backup.process.wait(10)
        killed_at = primary.status().applied_sequence
        backup.start()  # the same port and checkpoint directory: a new incarnation
        deadline = time.monotonic() + 30
        while not (backups := primary.status().backups) or not all(b.in_sync for b in backups):
            assert time.monotonic() < deadline, f"the restarted backup is not in sync:\n{cluster.logs()}"
            time.sleep(0.05)
        in_sync_at = primary.status().applied_sequence
        assert all(thread.is_alive() for thread in threads), "the load ended before the backup was in sync"
        time.sleep(1.0)  # more load with the restarted backup in the in-sync set
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    sequence = _wait_caught_up(cluster)
    assert in_sync_at > killed_at and sequence > in_sync_at
    assert backup.status().role == "backup"
    backup.process.stop()  # SIGTERM: each writes its final checkpoint
    primary.process.stop()
    primary_tensors, primary_state = checkpoint_contents(primary.newest_checkpoint())
    backup_tensors, backup_state = checkpoint_contents(backup.newest_checkpoint())
    assert sorted(primary_tensors) == sorted(backup_tensors)
    for name, values in primary_tensors.items():
        assert values.tobytes() == backup_tensors[name].tobytes(), name
    assert primary_state == backup_state
    assert "snapshot loaded" in backup.process.log_text()
