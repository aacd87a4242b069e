"""What operators see of replicated shards: ``ps-admin status`` and the replication metrics.

One shard of two replicas on a real etcd (tests/etcd_server.py; skipped
where etcd is not installed, failed in CI, which installs it), real
ps-server processes; the primary is SIGKILLed and the survivor's view read.
"""

from __future__ import annotations

import re
import signal
import time

import numpy as np
import pytest
from ps_testing import metric_value, scrape
from replica_testing import Replica, ReplicatedCluster

from worker_client import SGD, PSClient, Zeros
from worker_client.admin import main as admin_main


@pytest.fixture
def replicated(tmp_path, etcd_server):
    """One shard of two replicas, each with its own --metrics-port; stopped (by PID) at teardown."""
    cluster = ReplicatedCluster(tmp_path / "replicated", etcd_server.endpoint, 1, 2, metrics=True)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def _push(cluster: ReplicatedCluster, times: int) -> None:
    with PSClient(cluster.addresses, worker_id="w0") as client:
        client.create_variable("v", (1000,), initializer=Zeros(), optimizer=SGD(1.0))
        for _ in range(times):
            client.push({"v": np.ones(1000, np.float32)})


def _wait_backup_in_sync(primary: Replica, timeout: float = 30.0) -> None:
    """The primary streams to its backup, which is in sync and has confirmed all it was sent."""
    deadline = time.monotonic() + timeout
    while True:
        status = primary.status()
        if status.backups and all(b.in_sync and b.lag_records == 0 for b in status.backups):
            return
        assert time.monotonic() < deadline, f"the backup did not catch up: {status}"
        time.sleep(0.05)


def _admin_status(capsys, cluster: ReplicatedCluster
                  ) -> tuple[int, dict[str, dict[str, str]], list[str], str]:
    """ps-admin status: its exit status, the replicas table's rows by address (cells by column), the
    per-shard primary lines, and what it wrote to stderr."""
    code = admin_main(["status", "--timeout", "5", "--addresses", cluster.addresses])
    captured = capsys.readouterr()
    tables = captured.out.split("\n\n")
    index = next(i for i, table in enumerate(tables) if table.startswith("shard  replica"))
    lines = tables[index].splitlines()
    columns = re.split(r"\s{2,}", lines[0])
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(columns, re.split(r"\s{2,}", line)))
        rows[cells["replica"]] = cells
    return code, rows, tables[index + 1].splitlines(), captured.err


def test_ps_admin_shows_primary_backup_epoch_and_lag_then_the_survivor(replicated, capsys):
    cluster = replicated
    primary = cluster.primary(0)
    backup = next(r for r in cluster.shards[0] if r is not primary)
    _push(cluster, 20)
    _wait_backup_in_sync(primary)
    epoch = primary.status().epoch
    assert epoch > 0

    code, rows, summary, _ = _admin_status(capsys, cluster)
    assert code == 0
    first, second = rows[primary.address], rows[backup.address]
    assert (first["role"], first["health"], first["in sync"]) == ("primary", "SERVING", "-")
    assert (second["role"], second["in sync"]) == ("backup", "yes")
    assert first["epoch"] == second["epoch"] == str(epoch)
    assert int(first["applied seq"]) >= 20 and int(second["applied seq"]) <= int(first["applied seq"])
    assert int(second["lag records"]) >= 0 and int(second["lag bytes"]) >= 0 and float(second["lag s"]) >= 0
    assert first["etcd lease"] == "proven"
    assert summary == [(f"shard 0/1: primary {primary.address} (replica {primary.replica_index}, "
                        f"epoch {epoch}), 1 of 1 backups in sync")]

    primary.process.signal(signal.SIGKILL)
    primary.process.wait(10)
    survivor = cluster.primary(0, timeout=10)
    assert survivor is backup
    code, rows, summary, err = _admin_status(capsys, cluster)
    assert code == 0  # the shard answers: its survivor serves
    alive, dead = rows[survivor.address], rows[primary.address]
    assert alive["role"] == "primary" and int(alive["epoch"]) > epoch and alive["etcd lease"] == "proven"
    assert (dead["role"], dead["health"], dead["epoch"]) == ("unreachable", "UNREACHABLE", "-")
    assert summary[0].startswith(f"shard 0/1: primary {survivor.address} (replica {survivor.replica_index}, ")
    assert summary[0].endswith("0 of 1 backups in sync")
    assert "replicas not answering" in err and primary.address in err


def _scrape(replica: Replica) -> str:
    return scrape(replica.metrics_port)


def test_replication_metrics_on_primary_and_backup_and_after_a_failover(replicated):
    cluster = replicated
    primary = cluster.primary(0)
    backup = next(r for r in cluster.shards[0] if r is not primary)
    _push(cluster, 20)
    _wait_backup_in_sync(primary)
    on_primary, on_backup = _scrape(primary), _scrape(backup)
    assert metric_value(on_primary, "wehub_ps_replica_primary") == 1
    assert metric_value(on_backup, "wehub_ps_replica_primary") == 0
    epoch = metric_value(on_primary, "wehub_ps_replica_epoch")
    assert epoch > 0 and metric_value(on_backup, "wehub_ps_replica_epoch") == epoch
    assert metric_value(on_primary, "wehub_ps_replica_sequence") >= 20
    assert metric_value(on_primary, "wehub_ps_etcd_lease_valid") == 1
    label = f'{{replica="{backup.replica_index}"}}'
    assert metric_value(on_primary, "wehub_ps_backup_in_sync" + label) == 1
    for lag in ("records", "bytes", "seconds"):
        assert metric_value(on_primary, f"wehub_ps_backup_lag_{lag}{label}") >= 0
    assert "wehub_ps_backup_in_sync{" not in on_backup  # only the primary reports its backups
    assert metric_value(on_backup, "wehub_ps_failovers_total") == 0

    primary.process.signal(signal.SIGKILL)
    survivor = cluster.primary(0, timeout=10)
    assert survivor is backup
    after = _scrape(survivor)
    assert metric_value(after, "wehub_ps_replica_primary") == 1
    assert metric_value(after, "wehub_ps_replica_epoch") > epoch
    assert metric_value(after, "wehub_ps_failovers_total") == 1
    assert metric_value(after, "wehub_ps_failover_seconds") > 0
    assert metric_value(after, "wehub_ps_election_seconds") > 0
    assert "wehub_ps_backup_in_sync{" not in after  # its former primary is gone: no backup streams
