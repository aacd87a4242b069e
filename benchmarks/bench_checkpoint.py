"""Checkpoint write time and the pause it imposes on pushes, for a large shard.

Run from the repository root::

    python benchmarks/bench_checkpoint.py [--gb 1.0] [--dir /tmp/ckpt-bench] [--json out.json]

Builds one shard in process (the real VariableStore, PushLedger and
Checkpointer) holding ``--gb`` GB of float32 under SGD, keeps a thread
applying 1 MiB gradient chunks the way pushes do, and takes a checkpoint.
Reports the write time (snapshot, safetensors file, fsync, checksum,
manifest, rename) and the pause: the time the apply gate was held exclusive
(the in-memory copy), the longest gap the pushing thread saw between two
applied chunks, and, as the baseline, a plain numpy copy of the same bytes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ps_server.core.ledger import PushLedger  # noqa: E402
from ps_server.core.store import VariableStore  # noqa: E402
from ps_server.durability.checkpointer import Checkpointer  # noqa: E402
from wehub_ps.placement import MinSizePartitioner  # noqa: E402
from wehub_ps.specs import SGD, VariableSpec  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="shard size in GB (10**9 bytes)")
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    elements = int(args.gb * 1e9 / 4)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    store = VariableStore(0, 1, memory_limit=1 << 40)
    spec = VariableSpec("big", (elements,), "float32", optimizer=SGD(learning_rate=1e-6),
                        partitioner=MinSizePartitioner())
    store.create(spec)
    part = store.get("big")
    checkpointer = Checkpointer(store, PushLedger(), str(root), "bench", keep=1, interval=0)

    baseline = part.value.copy()  # warm the page cache of the copy's size
    started = time.perf_counter()
    np.copyto(baseline, part.value)
    memcpy_seconds = time.perf_counter() - started
    del baseline

    gaps: list[float] = []
    stop = threading.Event()
    chunk = np.ones(1 << 18, np.float32)  # 1 MiB of gradient

    def pusher() -> None:
        offset, last = 0, time.perf_counter()
        while not stop.is_set():
            with store.gate.shared():
                part.apply_gradient(offset, chunk, 1)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            offset = (offset + chunk.size) % (elements - chunk.size)

    thread = threading.Thread(target=pusher, name="bench-pusher")
    thread.start()
    time.sleep(0.5)
    record = checkpointer.checkpoint("benchmark")
    stop.set()
    thread.join()
    assert record is not None
    figures = {
        "shard_bytes": part.value.nbytes,
        "write_seconds": record.written.write_seconds,
        "write_gb_per_s": part.value.nbytes / record.written.write_seconds / 1e9,
        "gate_pause_seconds": record.pause_seconds,
        "longest_push_gap_seconds": max(gaps),
        "median_push_gap_seconds": float(np.median(gaps)),
        "memcpy_seconds": memcpy_seconds,
        "pause_over_memcpy": record.pause_seconds / memcpy_seconds,
    }
    print(f"shard {figures['shard_bytes'] / 1e9:.2f} GB float32, checkpoint dir {root}")
    print(f"{'figure':34s} {'value':>10s}")
    for key in ("write_seconds", "write_gb_per_s", "gate_pause_seconds", "longest_push_gap_seconds",
                "median_push_gap_seconds", "memcpy_seconds", "pause_over_memcpy"):
        print(f"{key:34s} {figures[key]:10.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
