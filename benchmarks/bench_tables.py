"""The ``tables`` section of run.py: embedding tables at recommender scale.

Disk tier: a table of 1,000,000 rows x 64 float32 under Adagrad (520 bytes
a row on disk) keeping 50,000 rows in memory (a 20th), against the same
table held in memory, each in a process of its own (the real
HashTablePart, in process: no network, so the table's own cost is all there
is). Batches of 4,096 ids drawn from a Zipf distribution of exponent 1.05
over the ids (hot ids spread by a fixed permutation), each pulled (rows read,
created at first touch) and pushed (Adagrad applied); 150 measured batches
after 30 warm ones. Figures: steps/s against the in-memory table (target
>= 0.5x); rows read back per second of time spent reading them, against
single-record random preads of the same row file with the same cache state,
once with the file in the page cache and once after it was dropped from it
(POSIX_FADV_DONTNEED: reads from the device, the physical limit; target >=
0.5x); the process's resident memory, sampled at every batch, against the
table's memory budget plus the disk tier's documented bookkeeping.

Disk store: the row file (ps_server/core/row_file.py) against LMDB (py-lmdb)
and RocksDB (rocksdict) where installed, on 200,000 records of 520 bytes:
batches of 4,096 random records read back (read and removed, as a tier reads
a cold row back) and written (as it writes rows out), rows/s.

Checkpoints by change: one shard in process (the real VariableStore,
PushLedger and Checkpointer, ``--full-checkpoint-every 10``) holding a hash
table of 1,000,000 rows x 64 float32 under Adagrad (about 560 MB with its
accumulator and bookkeeping). It writes a full checkpoint, then a training
step touches 1% of the rows (10,000 ids, pulled and pushed) and it writes a
delta, three times; two rounds, medians. The figure is a delta's time
(snapshot pause + write) against a full one's of the same run; target <=
0.05x. Retention keeps every checkpoint here: removing a superseded chain
(a full checkpoint's files) falls on the first checkpoint after the next
full one and is not in either figure.

Run alone::

    python benchmarks/run.py --only tables
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ps_server.core.ledger import PushLedger  # noqa: E402
from ps_server.core.row_file import RowFile, RowRecords  # noqa: E402
from ps_server.core.store import VariableStore  # noqa: E402
from ps_server.core.tables import read_tables_rows  # noqa: E402
from ps_server.durability.checkpointer import Checkpointer  # noqa: E402
from wehub_ps.specs import Adagrad, DiskTier, VariableSpec  # noqa: E402

ROWS = 1_000_000
DIM = 64
TOUCHED = ROWS // 100
DELTA_TARGET = 0.05


def _fill(store: VariableStore, name: str, rows: int) -> None:
    table = store.get(name)
    for start in range(0, rows, 100_000):
        ids = np.arange(start, min(rows, start + 100_000), dtype=np.int64)
        read_tables_rows([(table, ids)], table.reserve)
    store.generation += 1


def _step(store: VariableStore, name: str, ids: np.ndarray, rng: np.random.Generator) -> None:
    table = store.get(name)
    read_tables_rows([(table, ids)], table.reserve)
    table.apply_rows(ids, rng.standard_normal((len(ids), DIM)).astype(np.float32))
    table.finish_push()
    store.generation += 1


def delta_checkpoint_seconds(rounds: int = 2, deltas: int = 3) -> dict[str, float]:
    """Median seconds of a full checkpoint and of a delta after 1% of the rows changed."""
    root = Path(tempfile.mkdtemp(prefix="bench-delta-"))
    try:
        store = VariableStore(0, 1, memory_limit=1 << 40)
        store.create(VariableSpec("emb", (DIM,), "float32", optimizer=Adagrad(0.05), hash_table=True))
        _fill(store, "emb", ROWS)
        checkpointer = Checkpointer(store, PushLedger(), str(root), "bench", keep=100, interval=0,
                                    full_every=deltas + 1)
        rng = np.random.default_rng(0)
        full, delta, full_bytes, delta_bytes = [], [], 0, 0
        for _ in range(rounds):
            checkpointer.mark_restored(None)  # the next one is full
            started = time.perf_counter()
            record = checkpointer.checkpoint("bench full")
            full.append(time.perf_counter() - started)
            full_bytes = record.written.bytes
            for _ in range(deltas):
                _step(store, "emb", rng.choice(ROWS, TOUCHED, replace=False).astype(np.int64), rng)
                started = time.perf_counter()
                record = checkpointer.checkpoint("bench delta")
                delta.append(time.perf_counter() - started)
                delta_bytes = record.written.bytes
        return {"full_seconds": float(np.median(full)), "delta_seconds": float(np.median(delta)),
                "full_bytes": full_bytes, "delta_bytes": delta_bytes}
    finally:
        shutil.rmtree(root, ignore_errors=True)


TIER_ROWS = 1_000_000
TIER_MEMORY_ROWS = 50_000
BATCH = 4096
ZIPF = 1.05
WARM_BATCHES, MEASURED_BATCHES = 30, 150


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def _zipf_batches(count: int, seed: int) -> list[np.ndarray]:
    """Unique ids of ``count`` batches of BATCH draws, Zipf(ZIPF) over TIER_ROWS ids spread by a permutation."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(np.arange(1, TIER_ROWS + 1, dtype=np.float64) ** -ZIPF)
    cdf /= cdf[-1]
    spread = np.random.default_rng(1).permutation(TIER_ROWS).astype(np.int64)
    return [np.unique(spread[np.searchsorted(cdf, rng.random(BATCH))]) for _ in range(count)]


def tier_worker(kind: str) -> dict:
    """One process's run (``kind`` 'memory' or 'disk'): steps/s, RSS, cold-read rates."""
    from ps_server.core.tables import HashTablePart, read_tables_rows

    root = Path(tempfile.mkdtemp(prefix="bench-tier-", dir=os.environ.get("BENCH_TIER_DIR")))
    try:
        tier = DiskTier(TIER_MEMORY_ROWS) if kind == "disk" else None
        spec = VariableSpec("emb", (DIM,), "float32", optimizer=Adagrad(0.05), hash_table=True, tier=tier)
        table = HashTablePart(spec, 0, lambda delta: None, root / "emb.rows" if tier else None)
        batches = _zipf_batches(WARM_BATCHES + MEASURED_BATCHES + 20, seed=7)
        _load_loops()  # numba and the compiled loops (about 100 MB) before the baseline, as a server has them
        started_rss = _rss()
        for start in range(0, TIER_ROWS, 25_000):  # every row exists: a table 20x its budget
            read_tables_rows([(table, np.arange(start, start + 25_000, dtype=np.int64))], table.reserve)
        rng = np.random.default_rng(3)
        grads = rng.standard_normal((BATCH, DIM)).astype(np.float32)
        rss_samples = []

        def step(ids: np.ndarray) -> None:
            read_tables_rows([(table, ids)], table.reserve)
            table.apply_rows(ids, grads[:len(ids)])
            table.finish_push()

        for ids in batches[:WARM_BATCHES]:
            step(ids)
        reads_before = table.disk.reads if table.disk else 0
        seconds_before = table.disk.read_seconds if table.disk else 0.0
        started = time.perf_counter()
        for ids in batches[WARM_BATCHES:WARM_BATCHES + MEASURED_BATCHES]:
            step(ids)
            rss_samples.append(_rss())
        elapsed = time.perf_counter() - started
        out = {"steps_per_s": MEASURED_BATCHES / elapsed, "rss_start": started_rss, "rss_max": max(rss_samples),
               "nbytes": table.nbytes, "rows": table.num_rows}
        if table.disk is not None:
            disk = table.disk
            out.update(rows_on_disk=len(disk), disk_bytes=disk.disk_bytes, record_bytes=disk.record_bytes,
                       disk_nbytes=disk.nbytes, compactions=disk.compactions,
                       memory_rows=len(table._index), row_bytes=table.row_bytes,
                       cold_rows_per_s=(disk.reads - reads_before) / (disk.read_seconds - seconds_before),
                       cold_reads=disk.reads - reads_before,
                       preads_per_s=_random_preads(disk.fileno(), disk.high_water, disk.record_bytes, 20_000))
            # The same with the row file dropped from the page cache: reads from the device.
            os.posix_fadvise(disk.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            reads_before, seconds_before = disk.reads, disk.read_seconds
            for ids in batches[WARM_BATCHES + MEASURED_BATCHES:]:
                step(ids)
            out["device_cold_rows_per_s"] = (disk.reads - reads_before) / (disk.read_seconds - seconds_before)
            os.posix_fadvise(disk.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            out["device_preads_per_s"] = _random_preads(disk.fileno(), disk.high_water, disk.record_bytes, 2000)
        table.close()
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


#: Served run: batches after the fill before measuring (the hot rows are back in memory), then blocks
#: alternating between the two servers until the disk tier's row file was compacted, at most
#: SERVED_BLOCKS each. The fill leaves the file all live, as a compaction does: the blocks measured
#: span one whole cycle of the log (its appends, its growth to the slots it settles at, the
#: compaction), so the figure is the long-run rate, compactions included.
SERVED_SETTLE, SERVED_BLOCKS, SERVED_BLOCK_BATCHES = 150, 25, 160


def served_steps() -> dict[str, dict]:
    """The same Zipf batches through real ps-servers and PSClient (pull_rows, push_rows), one server
    holding the table in memory and one with the disk tier, both running at once: after the fill and a
    warm-up on each, blocks of batches go to one and then the other, so a slower minute of the machine
    weighs on both. Per kind: steps/s over all blocks (SERVED_SETTLE says what they include), each
    block's rate, the server's resident memory at every batch."""
    from contextlib import ExitStack

    from common import ps_cluster, rss_bytes

    from worker_client import PSClient

    kinds = ("memory", "disk")
    settled = WARM_BATCHES + SERVED_SETTLE
    batches = _zipf_batches(settled + SERVED_BLOCKS * SERVED_BLOCK_BATCHES, seed=7)
    grads = np.random.default_rng(3).standard_normal((BATCH, DIM)).astype(np.float32)
    with ExitStack() as stack:
        tables = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-tier-served-"))
        clients, pids, started_rss = {}, {}, {}
        for kind in kinds:
            tier = DiskTier(TIER_MEMORY_ROWS) if kind == "disk" else None
            addresses, procs = stack.enter_context(ps_cluster(1, *(("--disk-tier-dir", tables) if tier else ())))
            clients[kind], pids[kind] = stack.enter_context(PSClient(addresses)), procs[0].pid
            clients[kind].create_embedding("emb", DIM, optimizer=Adagrad(0.05), tier=tier)

        def step(kind: str, ids: np.ndarray) -> None:
            clients[kind].pull_rows("emb", ids)
            clients[kind].push_rows("emb", ids, grads[:len(ids)])

        for kind in kinds:
            for ids in batches[:WARM_BATCHES]:  # numba's loops compile meanwhile: measured after
                step(kind, ids)
            started_rss[kind] = rss_bytes(pids[kind])
            for start in range(0, TIER_ROWS, 25_000):  # every row exists: a table 20x its budget
                clients[kind].pull_rows("emb", np.arange(start, start + 25_000, dtype=np.int64))
            for ids in batches[WARM_BATCHES:settled]:  # memory holds the hot rows again
                step(kind, ids)
        seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
        disk_bytes = [clients["disk"].describe()[0].variables["emb"]["disk_bytes"]]
        rss: dict[str, list[int]] = {kind: [] for kind in kinds}
        for block in range(SERVED_BLOCKS):
            if disk_bytes[-1] < max(disk_bytes):
                break  # compacted
            first = settled + block * SERVED_BLOCK_BATCHES
            for kind in kinds if block % 2 == 0 else kinds[::-1]:
                started = time.perf_counter()
                for ids in batches[first:first + SERVED_BLOCK_BATCHES]:
                    step(kind, ids)
                    rss[kind].append(rss_bytes(pids[kind]))
                seconds[kind].append(time.perf_counter() - started)
                if kind == "disk":  # the row file only shrinks when it is compacted
                    disk_bytes.append(clients["disk"].describe()[0].variables["emb"]["disk_bytes"])
        out = {}
        for kind in kinds:
            info = clients[kind].describe()[0].variables["emb"]
            out[kind] = {"steps_per_s": len(seconds[kind]) * SERVED_BLOCK_BATCHES / sum(seconds[kind]),
                         "block_steps_per_s": [SERVED_BLOCK_BATCHES / t for t in seconds[kind]],
                         "rss_start": started_rss[kind], "rss_max": max(rss[kind]),
                         "rows_on_disk": info["rows_on_disk"], "cold_reads": info["cold_reads"],
                         "compactions": sum(after < before for before, after in pairwise(disk_bytes))}
    return out


def _load_loops() -> None:
    from ps_server.core import id_index, row_file
    from wehub_ps.kernels.compiled import compiled

    compiled(row_file._pread_runs, cache=False)
    compiled(row_file._pwrite_runs, cache=False)
    compiled(id_index._probe, id_index._probe_signatures)


def _random_preads(fd: int, records: int, record_bytes: int, count: int) -> float:
    """Single-record preads at random records of a file, per second: the random-read baseline."""
    slots = np.random.default_rng(11).integers(0, records, count)
    started = time.perf_counter()
    for slot in slots.tolist():
        os.pread(fd, record_bytes, slot * record_bytes)
    return count / (time.perf_counter() - started)


def _run_tier_worker(kind: str) -> dict:
    result = subprocess.run([sys.executable, __file__, "--tier-worker", kind], capture_output=True, text=True,
                            timeout=1200, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def disk_store_rates(records: int = 200_000, batches: int = 20) -> dict[str, dict[str, float]]:
    """Rows/s reading back and writing batches of BATCH random records: the row file, LMDB, RocksDB."""
    rng = np.random.default_rng(5)
    width = DIM
    value = rng.standard_normal((records, width)).astype(np.float32)
    slot = rng.standard_normal((records, width)).astype(np.float32)
    steps = np.zeros(records, np.int64)
    ids = np.arange(records, dtype=np.int64)
    picks = [rng.choice(records, BATCH, replace=False).astype(np.int64) for _ in range(batches)]
    out: dict[str, dict[str, float]] = {}
    root = Path(tempfile.mkdtemp(prefix="bench-store-"))
    try:
        row_file = RowFile(root / "rows", width, np.dtype(np.float32), np.dtype(np.float32), ("accumulator",))
        zeros = np.zeros(records, np.int64)
        row_file.write(ids, RowRecords(ids, value, {"accumulator": slot}, steps), zeros, zeros,
                       np.zeros(records), np.zeros(records, bool))
        read = write = 0.0
        for pick in picks:
            started = time.perf_counter()
            at = row_file.slots_of(pick)
            got = row_file.read(at)
            row_file.remove(at)
            read += time.perf_counter() - started
            started = time.perf_counter()
            row_file.write(pick, RowRecords(pick, got["value"], {"accumulator": got["slot:accumulator"]},
                                            got["row_steps"]), zeros[:BATCH], zeros[:BATCH], np.zeros(BATCH),
                           np.zeros(BATCH, bool))
            write += time.perf_counter() - started
        out["row file"] = {"read": batches * BATCH / read, "write": batches * BATCH / write}
        row_file.close()
        blobs = [np.concatenate([value[i], slot[i]]).tobytes() + steps[i].tobytes() for i in range(records)]
        keys = [int(i).to_bytes(8, "little") for i in range(records)]
        try:
            import lmdb

            env = lmdb.open(str(root / "lmdb"), map_size=4 << 30, sync=False, metasync=False)
            with env.begin(write=True) as txn:
                for key, blob in zip(keys, blobs):
                    txn.put(key, blob)
            read = write = 0.0
            for pick in picks:
                started = time.perf_counter()
                with env.begin(write=True) as txn:
                    got = [txn.pop(keys[i]) for i in pick.tolist()]
                    rows = np.frombuffer(b"".join(got), np.uint8)
                read += time.perf_counter() - started
                started = time.perf_counter()
                with env.begin(write=True) as txn:
                    for i, blob in zip(pick.tolist(), got):
                        txn.put(keys[i], blob)
                write += time.perf_counter() - started
            del rows
            env.close()
            out["LMDB"] = {"read": batches * BATCH / read, "write": batches * BATCH / write}
        except ImportError:
            pass
        try:
            from rocksdict import Rdict, WriteBatch

            db = Rdict(str(root / "rocks"))
            for start in range(0, records, BATCH):
                batch = WriteBatch()
                for i in range(start, min(records, start + BATCH)):
                    batch.put(keys[i], blobs[i])
                db.write(batch)
            read = write = 0.0
            for pick in picks:
                started = time.perf_counter()
                wanted = [keys[i] for i in pick.tolist()]
                got = db[wanted]
                batch = WriteBatch()
                for key in wanted:
                    batch.delete(key)
                db.write(batch)
                read += time.perf_counter() - started
                started = time.perf_counter()
                batch = WriteBatch()
                for key, blob in zip(wanted, got):
                    batch.put(key, blob)
                db.write(batch)
                write += time.perf_counter() - started
            db.close()
            out["RocksDB"] = {"read": batches * BATCH / read, "write": batches * BATCH / write}
        except ImportError:
            pass
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def section_tables(results: dict, make_row: Callable) -> list:
    figures = delta_checkpoint_seconds()
    memory, disk = _run_tier_worker("memory"), _run_tier_worker("disk")
    served = served_steps()
    stores = disk_store_rates()
    results["tables"] = {"checkpoints": figures, "tier_memory": memory, "tier_disk": disk, "served": served,
                         "stores": stores}
    budget = disk["memory_rows"] * disk["row_bytes"]
    bookkeeping = disk["disk_nbytes"]  # what the disk tier books (ps_server/core/row_file.py)
    rows = [
        make_row("tables", f"full checkpoint, {ROWS:,} x {DIM} Adagrad table ({figures['full_bytes'] / 1e6:.0f} MB)",
                 figures["full_seconds"], "s", figures["full_seconds"], "itself", None),
        make_row("tables", f"delta checkpoint after 1% of the rows changed ({figures['delta_bytes'] / 1e6:.1f} MB)",
                 figures["delta_seconds"], "s", figures["full_seconds"], "full checkpoint", DELTA_TARGET,
                 higher=False),
        make_row("tables", f"table 20x its memory budget, Zipf {ZIPF} batches of {BATCH}: pull_rows + push_rows, "
                           "1 server", served["disk"]["steps_per_s"], "step/s", served["memory"]["steps_per_s"],
                 "all in memory", 0.5),
        make_row("tables", "  row file compactions in the measured batches (one cycle of the log)",
                 served["disk"]["compactions"], "", 1, "one", None),
        make_row("tables", "  the same, in process (the table alone, no network)", disk["steps_per_s"], "step/s",
                 memory["steps_per_s"], "all in memory", None),
        make_row("tables", "  rows read back from disk, file in the page cache", disk["cold_rows_per_s"], "rows/s",
                 disk["preads_per_s"], "random preads, cached", 0.5),
        make_row("tables", "  rows read back from disk, file dropped from the cache",
                 disk["device_cold_rows_per_s"], "rows/s", disk["device_preads_per_s"], "random preads, device",
                 0.5),
        make_row("tables", "  process memory growth, max over the run", disk["rss_max"] - disk["rss_start"], "B",
                 budget + bookkeeping, "budget + bookkeeping", 1.0, higher=False),
        make_row("tables", "  the server's memory growth, max over the served run",
                 served["disk"]["rss_max"] - served["disk"]["rss_start"], "B", budget + bookkeeping,
                 "budget + bookkeeping", None),
        make_row("tables", "  the same table in memory: memory growth", memory["rss_max"] - memory["rss_start"], "B",
                 memory["nbytes"], "its booked bytes", None),
    ]
    for name, rates in stores.items():
        rows.append(make_row("tables", f"disk store {name}: read back 4,096 random records", rates["read"],
                             "rows/s", stores["row file"]["read"], "row file", None))
        rows.append(make_row("tables", f"disk store {name}: write 4,096 records", rates["write"], "rows/s",
                             stores["row file"]["write"], "row file", None))
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--tier-worker":
        print(json.dumps(tier_worker(sys.argv[2])))
    else:
        print(json.dumps({"checkpoints": delta_checkpoint_seconds(), "stores": disk_store_rates(),
                          "tier_memory": _run_tier_worker("memory"), "tier_disk": _run_tier_worker("disk")},
                         indent=1))
