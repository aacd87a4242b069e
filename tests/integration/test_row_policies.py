"""Admission and expiry of hash-table rows on real servers: answers, counts, metrics, ps-admin,
replicas holding the same bits, and a restore onto another shard count."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
from ps_testing import free_port, metric_value, scrape
from replica_testing import assert_same_bits

from wehub_ps.initializers import fill_rows
from wehub_ps.placement import hash_shards
from worker_client import SGD, Admission, DiskTier, Expiry, PSClient, Uniform


def _initial(spec, ids) -> np.ndarray:
    out = np.empty((len(ids), spec.row_elements), np.float64)
    fill_rows(spec.initializer, spec.shape, np.asarray(ids, np.int64), out)
    return out.astype(np.float32)


def _table_counts(client: PSClient, name: str) -> dict[str, int]:
    """The table's counts summed over the shards (Describe)."""
    total: dict[str, int] = {}
    for info in client.describe():
        for key, value in info.variables[name].items():
            if isinstance(value, int) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
    return total


def test_admission_answers_initial_values_then_makes_rows_and_counts_everything(cluster_factory):
    cluster = cluster_factory(2)
    with PSClient(cluster.addresses) as client:
        table = client.create_embedding("users", 4, initializer=Uniform(seed=3), optimizer=SGD(1.0),
                                        admission=Admission(min_count=3))
        ids = np.array([11, 12, 2**40 + 5, -7], np.int64)
        for sighting in (1, 2):
            np.testing.assert_array_equal(client.pull_rows("users", ids), _initial(table.spec, ids))
            client.push_rows("users", ids, np.ones((4, 4), np.float32))  # dropped: no rows yet
        counts = _table_counts(client, "users")
        assert counts["num_rows"] == 0 and counts["unadmitted_reads"] == 8
        assert counts["dropped_gradient_rows"] == 8 and counts["admitted_rows"] == 0
        # The third pull admits them: the rows start from the initializer, untouched by the dropped pushes.
        np.testing.assert_array_equal(client.pull_rows("users", ids), _initial(table.spec, ids))
        client.push_rows("users", ids, np.ones((4, 4), np.float32))
        np.testing.assert_array_equal(client.pull_rows("users", ids), _initial(table.spec, ids) - 1.0)
        counts = _table_counts(client, "users")
        assert counts["num_rows"] == 4 and counts["admitted_rows"] == 4
        exported_ids, _ = client.export_rows("users")
        assert sorted(exported_ids.tolist()) == sorted(ids.tolist())
        on_shard0 = int(np.count_nonzero(hash_shards(ids, 2) == 0))
        assert client.describe()[0].variables["users"]["admitted_rows"] == on_shard0

    status = subprocess.run([sys.executable, "-m", "worker_client.admin", "status", "--addresses",
                             ",".join(cluster.addresses)], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    lines = [line for line in status.stdout.splitlines() if line.startswith("users")]
    assert len(lines) == 2, status.stdout
    assert "reads not admitted" in status.stdout and "gradient rows dropped" in status.stdout


def test_metrics_show_each_tables_rows_and_policy_counts(cluster_factory, tmp_path):
    port = free_port()
    cluster = cluster_factory(1, "--metrics-port", str(port), "--expiry-interval", "0.05",
                              "--disk-tier-dir", str(tmp_path / "tables"))
    with PSClient(cluster.addresses) as client:
        client.create_embedding("d", 4, tier=DiskTier(memory_rows=2))
        for i in range(5):
            client.pull_rows("d", np.array([i], np.int64))  # 3 rows go to disk
        client.pull_rows("d", np.array([0], np.int64))  # read back
        client.create_embedding("m", 4, optimizer=SGD(1.0), admission=Admission(min_count=2),
                                expiry=Expiry(steps=1))
        ids = np.arange(6, dtype=np.int64)
        client.pull_rows("m", ids)
        client.push_rows("m", ids, np.ones((6, 4), np.float32))
        client.pull_rows("m", ids[:4])  # 4 admitted
        client.push_rows("m", ids[:2], np.ones((2, 4), np.float32))  # version 1: rows 2, 3 a version old
        deadline = time.monotonic() + 30
        while _table_counts(client, "m")["num_rows"] != 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        text = scrape(port)
    assert metric_value(text, 'wehub_ps_table_rows{variable="m"}') == 2
    assert metric_value(text, 'wehub_ps_table_admitted_rows_total{variable="m"}') == 4
    assert metric_value(text, 'wehub_ps_table_unadmitted_reads_total{variable="m"}') == 6
    assert metric_value(text, 'wehub_ps_table_dropped_gradient_rows_total{variable="m"}') == 6
    assert metric_value(text, 'wehub_ps_table_expired_rows_total{variable="m"}') == 2
    assert metric_value(text, 'wehub_ps_table_evicted_rows_total{variable="m"}') == 0
    assert metric_value(text, 'wehub_ps_table_rows{variable="d"}') == 5
    assert metric_value(text, 'wehub_ps_table_rows_on_disk{variable="d"}') == 3
    assert metric_value(text, 'wehub_ps_table_disk_bytes{variable="d"}') >= 3 * (4 * 4 + 8)
    assert metric_value(text, 'wehub_ps_table_cold_reads_total{variable="d"}') == 1
    assert metric_value(text, 'wehub_ps_table_memory_hits_total{variable="d"}') == 0


def test_rows_not_updated_expire_on_their_own(cluster_factory):
    cluster = cluster_factory(2, "--expiry-interval", "0.1")
    with PSClient(cluster.addresses) as client:
        client.create_embedding("sessions", 4, optimizer=SGD(1.0), expiry=Expiry(seconds=0.5))
        client.create_embedding("kept", 4, optimizer=SGD(1.0))
        ids = np.arange(40, dtype=np.int64)
        client.pull_rows("sessions", ids)
        client.pull_rows("kept", ids)
        hot = ids[:5]
        deadline = time.monotonic() + 30
        while _table_counts(client, "sessions")["num_rows"] > len(hot):
            client.push_rows("sessions", hot, np.zeros((5, 4), np.float32))  # keeps these fresh
            assert time.monotonic() < deadline, _table_counts(client, "sessions")
            time.sleep(0.05)
        client.push_rows("sessions", hot, np.zeros((5, 4), np.float32))
        counts = _table_counts(client, "sessions")
        assert counts["num_rows"] == 5 and counts["expired_rows"] == 35
        assert sorted(client.export_rows("sessions")[0].tolist()) == hot.tolist()
        assert _table_counts(client, "kept")["num_rows"] == 40  # no expiry: nothing removed
        deadline = time.monotonic() + 30
        while _table_counts(client, "sessions")["num_rows"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def _train(address: str, worker: str, steps: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with PSClient([address], worker_id=worker) as client:
        client.create_embedding("table", 4, optimizer=SGD(0.5), max_rows=60, eviction="lru",
                                admission=Admission(min_count=2, probability=0.8, counters=1024),
                                expiry=Expiry(steps=30, seconds=0.4), tier=DiskTier(memory_rows=25))
        for _ in range(steps):
            ids = np.unique(rng.zipf(1.3, 24) % 500).astype(np.int64)
            client.pull_rows("table", ids)
            client.push_rows("table", ids, rng.integers(-3, 4, (len(ids), 4)).astype(np.float32))
            time.sleep(0.005)


def test_replicas_admit_evict_and_expire_the_same_rows(replicated, tmp_path):
    """Admission draws, LRU evictions and swept expiries by steps and seconds, on a table keeping most
    rows on disk: the backup's rows, filter and counts are the primary's, bit for bit."""
    cluster = replicated(1, 2, "--expiry-interval", "0.05", "--disk-tier-dir", str(tmp_path / "tables"))
    primary = cluster.primary(0)
    threads = [threading.Thread(target=_train, args=(primary.address, f"w{i}", 120, i)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    time.sleep(0.6)  # sweeps with nothing updated: the rest expires by seconds
    with PSClient([primary.address]) as client:
        counts = _table_counts(client, "table")
    assert counts["admitted_rows"] > 60 and counts["unadmitted_reads"] > 0
    assert counts["evicted_rows"] > 0 and counts["expired_rows"] > 0 and counts["cold_reads"] > 0
    deadline = time.monotonic() + 30
    while True:
        status = primary.status()
        backup = next(r for r in cluster.shards[0] if r is not primary)
        if backup.status().applied_sequence == status.applied_sequence:
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    backup.process.stop()  # SIGTERM: each writes its final checkpoint
    primary.process.stop()
    assert_same_bits(primary.newest_checkpoint(), backup.newest_checkpoint())


def test_a_restore_onto_another_shard_count_keeps_rows_counts_and_pending_sightings(cluster_factory, tmp_path):
    root = tmp_path / "ckpt"
    args = ("--checkpoint-dir", str(root), "--checkpoint-interval", "0")
    two = cluster_factory(2, *args)
    admission = Admission(min_count=3, counters=4096)
    ids = np.arange(100, 140, dtype=np.int64)
    with PSClient(two.addresses) as client:
        client.create_embedding("t", 4, optimizer=SGD(1.0), admission=admission, expiry=Expiry(steps=1000))
        for _ in range(3):
            client.pull_rows("t", ids[:20])  # admitted at the third pull
        client.pull_rows("t", ids[20:])
        client.pull_rows("t", ids[20:])  # two sightings: one short
        client.push_rows("t", ids[:20], np.full((20, 4), 2.0, np.float32))
        before = client.pull_rows("t", ids[:20])
        counts_before = _table_counts(client, "t")
    two.stop()
    three = cluster_factory(3, *args)
    with PSClient(three.addresses) as client:
        assert all(info.restored_from is not None for info in client.describe())
        np.testing.assert_array_equal(client.pull_rows("t", ids[:20]), before)
        counts = _table_counts(client, "t")
        for key in ("admitted_rows", "unadmitted_reads", "dropped_gradient_rows"):
            assert counts[key] == counts_before[key], key
        assert counts["num_rows"] == 20
        client.pull_rows("t", ids[20:])  # the merged filters remember two sightings: the third admits
        assert _table_counts(client, "t")["num_rows"] == 40
