"""The ``tables`` section of run.py: embedding tables at recommender scale.

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

import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ps_server.core.ledger import PushLedger  # noqa: E402
from ps_server.core.store import VariableStore  # noqa: E402
from ps_server.core.tables import read_tables_rows  # noqa: E402
from ps_server.durability.checkpointer import Checkpointer  # noqa: E402
from wehub_ps.specs import Adagrad, VariableSpec  # noqa: E402

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


def section_tables(results: dict, make_row: Callable) -> list:
    figures = delta_checkpoint_seconds()
    results["tables"] = figures
    return [
        make_row("tables", f"full checkpoint, {ROWS:,} x {DIM} Adagrad table ({figures['full_bytes'] / 1e6:.0f} MB)",
                 figures["full_seconds"], "s", figures["full_seconds"], "itself", None),
        make_row("tables", f"delta checkpoint after 1% of the rows changed ({figures['delta_bytes'] / 1e6:.1f} MB)",
                 figures["delta_seconds"], "s", figures["full_seconds"], "full checkpoint", DELTA_TARGET,
                 higher=False),
    ]


if __name__ == "__main__":
    print(delta_checkpoint_seconds())
