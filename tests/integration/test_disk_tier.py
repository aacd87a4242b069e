"""Hash tables bigger than their memory budget on real servers: exact sums from concurrent workers
across a SIGKILL and a restore, the server's memory bounded while a client fills the table, a clear
refusal without --disk-tier-dir."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from ps_testing import memory_status

from wehub_ps.placement import hash_shards
from worker_client import SGD, Adagrad, DiskTier, FailedPreconditionError, PSClient

ROWS = 6000  # 20x the memory budget of the two shards together
MEMORY_ROWS = 150


def _ckpt_args(root) -> tuple[str, ...]:
    return ("--checkpoint-dir", str(root), "--checkpoint-interval", "0.3", "--full-checkpoint-every", "3")


def _train(addresses: list[str], worker: int, passes: int) -> None:
    """Every id of this worker's half, in batches of 100, pushed ``passes`` times with gradient worker+1."""
    ids = np.arange(ROWS, dtype=np.int64)
    mine = ids[ids % 2 == worker]
    with PSClient(addresses, worker_id=f"w{worker}") as client:
        for _ in range(passes):
            for start in range(0, len(mine), 100):
                batch = mine[start:start + 100]
                client.pull_rows("big", batch)
                client.push_rows("big", batch, np.full((len(batch), 4), worker + 1.0, np.float32))


def test_a_table_twenty_times_its_memory_budget_keeps_exact_sums_across_a_kill(cluster_factory, tmp_path):
    args = ("--disk-tier-dir", str(tmp_path / "tables"), *_ckpt_args(tmp_path / "ckpt"))
    cluster = cluster_factory(2, *args)
    with PSClient(cluster.addresses) as client:
        client.create_embedding("big", 4, initializer="zeros", optimizer=SGD(1.0),
                                tier=DiskTier(memory_rows=MEMORY_ROWS))
    threads = [threading.Thread(target=_train, args=(cluster.addresses, w, 2)) for w in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    ids = np.arange(ROWS, dtype=np.int64)
    expected = -np.where(ids % 2 == 0, 2.0, 4.0)[:, None] * np.ones((1, 4), np.float32)
    with PSClient(cluster.addresses) as client:
        infos = client.describe()
        for info in infos:
            table = info.variables["big"]
            assert table["rows_on_disk"] >= ROWS // 2 - MEMORY_ROWS - 200  # about half the ids each
            assert table["num_rows"] - table["rows_on_disk"] <= MEMORY_ROWS
            assert table["cold_reads"] > 0 and table["disk_bytes"] > 0
        np.testing.assert_array_equal(client.lookup_rows("big", ids), expected)  # read only: nothing moves
        assert [i.variables["big"]["rows_on_disk"] for i in client.describe()] == \
            [i.variables["big"]["rows_on_disk"] for i in infos]
        client.checkpoint()
    for server in cluster.servers:
        server.signal(signal.SIGKILL)
        server.wait()
    restarted = cluster_factory(2, *args)
    with PSClient(restarted.addresses) as client:
        assert all(info.restored_from is not None for info in client.describe())
        for info in client.describe():
            table = info.variables["big"]
            assert table["num_rows"] - table["rows_on_disk"] <= MEMORY_ROWS and table["rows_on_disk"] > 0
        for start in range(0, 1000, 100):  # a pull at most fits the memory budget
            batch = ids[start:start + 100]
            np.testing.assert_array_equal(client.pull_rows("big", batch), expected[start:start + 100])
        for start in range(0, ROWS, 700):
            batch = ids[start:start + 700:7]
            client.push_rows("big", batch, np.ones((len(batch), 4), np.float32))
        after = expected.copy()
        after[::7] -= 1.0
        np.testing.assert_array_equal(client.lookup_rows("big", ids), after)
    status = subprocess.run([sys.executable, "-m", "worker_client.admin", "status", "--addresses",
                             ",".join(restarted.addresses)], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    header = next(line for line in status.stdout.splitlines() if line.startswith("table"))
    assert "on disk" in header and "hit rate" in header
    lines = [line.split() for line in status.stdout.splitlines() if line.startswith("big ")]
    assert len(lines) == 2 and all(int(cells[3]) > 0 and 0 < float(cells[5]) < 1 for cells in lines), lines
    # The files of the killed servers are gone; the running ones hold one directory each.
    assert len([p for p in (tmp_path / "tables").iterdir() if p.is_dir()]) == 2


def test_the_servers_memory_stays_bounded_while_a_client_fills_a_table_on_disk(cluster_factory, tmp_path):
    """200,000 rows of 64 float32 with Adagrad (139 MB booked held in memory) on one server whose table keeps
    8,192 rows in memory: its resident memory grows by the budget and the disk tier's bookkeeping."""
    cluster = cluster_factory(1, "--disk-tier-dir", str(tmp_path / "tables"))
    pid = cluster.servers[0].popen.pid
    rows, batch = 200_000, 4096
    with PSClient(cluster.addresses) as client:
        client.create_embedding("wide", 64, optimizer=Adagrad(0.1), tier=DiskTier(memory_rows=8192))
        for start in range(0, 3 * batch, batch):  # warm: the server compiles its loops (numba) meanwhile
            warm = np.arange(start, start + batch, dtype=np.int64)
            client.pull_rows("wide", warm)
            client.push_rows("wide", warm, np.ones((batch, 64), np.float32))
        before = _settled_rss(pid)
        peak = before
        grads = np.ones((batch, 64), np.float32)
        for start in range(3 * batch, rows, batch):
            ids = np.arange(start, min(rows, start + batch), dtype=np.int64)
            client.pull_rows("wide", ids)
            client.push_rows("wide", ids, grads[:len(ids)])
            peak = max(peak, memory_status(pid)["VmRSS"])
        info = client.describe()[0].variables["wide"]
    assert info["num_rows"] == rows and info["rows_on_disk"] == rows - 8192
    in_memory_bytes = rows * (64 * 4 * 2 + 58 + 128)  # what the table books held in memory (tables.py)
    bookkeeping = 200 * rows  # the disk tier's, per row on disk (ps_server/core/row_file.py)
    grown = peak - before
    assert grown < bookkeeping + 30 * 2**20, (grown, in_memory_bytes)
    assert grown < in_memory_bytes / 2


def _settled_rss(pid: int, timeout: float = 60.0) -> int:
    """The resident bytes once they stopped moving (a background compile has finished)."""
    deadline = time.monotonic() + timeout
    last = memory_status(pid)["VmRSS"]
    while time.monotonic() < deadline:
        time.sleep(2.0)
        now = memory_status(pid)["VmRSS"]
        if abs(now - last) < 2 << 20:
            return now
        last = now
    return last


def test_the_row_file_is_compacted_in_the_background_while_training_goes_on(cluster_factory, tmp_path):
    """Rows read back leave dead records; once they are half the file the server's compactor thread
    copies the live ones while pushes go on, and every row keeps its exact sum."""
    rows, chunk = 100_000, 1000
    cluster = cluster_factory(1, "--disk-tier-dir", str(tmp_path / "tables"))
    ids = np.arange(rows, dtype=np.int64)
    with PSClient(cluster.addresses) as client:
        client.create_embedding("big", 2, initializer="zeros", optimizer=SGD(1.0),
                                tier=DiskTier(memory_rows=chunk))
        for start in range(0, rows, chunk):  # every row exists: 99% of them on disk
            client.pull_rows("big", ids[start:start + chunk])
        disk_bytes = [client.describe()[0].variables["big"]["disk_bytes"]]
        for step in range(3):  # each pass reads every row back and writes it out again
            for start in range(0, rows, chunk):
                batch = ids[start:start + chunk]
                client.pull_rows("big", batch)
                client.push_rows("big", batch, np.full((len(batch), 2), step + 1.0, np.float32))
                disk_bytes.append(client.describe()[0].variables["big"]["disk_bytes"])
        table = client.describe()[0].variables["big"]
        assert table["num_rows"] == rows and table["rows_on_disk"] >= rows - chunk
        assert any(after < before for before, after in zip(disk_bytes, disk_bytes[1:])), "never compacted"
        assert max(disk_bytes) < 4 * rows * (2 * 4 * 2 + 8)  # dead records are dropped, not kept
        np.testing.assert_array_equal(client.lookup_rows("big", ids), np.full((rows, 2), -6.0, np.float32))


def test_a_disk_tier_needs_a_directory(cluster_factory):
    cluster = cluster_factory(1)
    with PSClient(cluster.addresses) as client:
        with pytest.raises(FailedPreconditionError, match="--disk-tier-dir"):
            client.create_embedding("t", 4, tier=DiskTier(memory_rows=10))
        client.create_embedding("plain", 4)  # the server serves on
        assert "t" not in client.describe()[0].variables


def test_ids_spread_over_both_shards():
    """The exact-sum test above relies on its ids covering both shards about evenly."""
    shards = hash_shards(np.arange(ROWS, dtype=np.int64), 2)
    assert abs(int(np.count_nonzero(shards == 0)) - ROWS // 2) < 200
