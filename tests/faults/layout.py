"""What a run is made of, shared by the controller, the workers and the oracle, which must agree.

The cluster's shape and limits, the modes, and for each push slot the elements it
writes and the gradient it carries. ``SLOTS``, ``PER_WORKER`` and ``DENSE``
change with ``configure`` (a soak run needs more slots): read them as
``layout.SLOTS``, never import the names.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from wehub_ps.placement import hash_shards

NUM_SHARDS = 2
WORKERS = 3
SLOTS = 6144  # S: pushes a run can hold; each worker owns SLOTS // WORKERS of them (see configure)
PER_WORKER = SLOTS // WORKERS
DENSE = 4 * SLOTS  # elements of "dense": 2 per slot in each shard's half
SOAK_SLOTS = 60_000  # --soak: "small" (S floats) stays under 256 KiB, so whole on one shard
TOPK_ROWS = 3  # rows of "dense" a top-k push sends: the ratio is TOPK_ROWS / DENSE
BALLAST = 8 << 20  # float32 elements (32 MiB) never pushed: restores and checkpoints take a while
LIMIT_ROWS = 4  # max_rows per shard of the tables the limit events push against
IDLE_CLIENTS = 24  # the "streams" event's idle clients, each holding (or asking for) an Exchange stream
STREAMS_LIMIT = 24  # --max-concurrent-rpcs of the servers when the "streams" kind is on
EXCHANGE_LIMIT = 10  # --max-exchange-streams then: the workers' and the admin's fit, most idle clients' not
# chunk_bytes per worker: 4096 or 8192 make every dense push a multi-chunk Push stream (cuts and drain
# deadlines land mid-push); 128 KiB sends a shard's part as one message over the long-lived Exchange
# stream. Top-k pushes are a few rows: always one message.
MODES = {
    "async": {"consistency": "async", "wire_dtype": None, "topk_rows": None,
              "chunk_bytes": (128 << 10, 8192, 8192)},
    "async-bf16": {"consistency": "async", "wire_dtype": "bfloat16", "topk_rows": None,
                   "chunk_bytes": (4096,) * WORKERS},
    "async-topk-bf16": {"consistency": "async", "wire_dtype": "bfloat16", "topk_rows": TOPK_ROWS,
                        "chunk_bytes": (4096,) * WORKERS},
    "ssp": {"consistency": "ssp", "wire_dtype": None, "topk_rows": None, "chunk_bytes": (4096,) * WORKERS},
    "sync": {"consistency": "sync", "wire_dtype": None, "topk_rows": None, "chunk_bytes": (4096,) * WORKERS},
}
VARIABLES = ("dense", "small", "emb", "emb_rows", "ballast", "limited", "lru")


def gradient_value(slot: int) -> float:
    """The integer each element of push ``slot`` carries: exact in float32 and bfloat16."""
    return float(1 + slot % 8)


def configure(slots: int) -> None:
    """Set the number of slots (a soak run needs more); controller and workers must agree."""
    global SLOTS, PER_WORKER, DENSE
    SLOTS, PER_WORKER, DENSE = slots, slots // WORKERS, 4 * slots


def topk_ratio(config: dict[str, Any]) -> float | None:
    """The PSClient topk_ratio of a mode: ``TOPK_ROWS`` rows of ``dense`` per push."""
    return None if config["topk_rows"] is None else config["topk_rows"] / DENSE


def dense_positions(slot: int) -> list[tuple[int, int]]:
    """``[(shard, element)]`` of ``dense`` that push ``slot`` writes: a fixed, non-empty subset of its 4.

    The subset varies (1 to 4 elements, 2.1 on average) so that top-k, which
    sends 3 rows of ``dense`` per push, sometimes has to carry some to a later push.
    """
    mask = 1 + (slot * 2654435761 >> 7) % 15
    own = [(0, 2 * slot), (0, 2 * slot + 1), (1, DENSE // 2 + 2 * slot), (1, DENSE // 2 + 2 * slot + 1)]
    return [position for bit, position in enumerate(own) if mask >> bit & 1]


def table_ids() -> tuple[np.ndarray, np.ndarray]:
    """``(A, B)``: ``emb`` row ids of each slot, ``A[s]`` on shard 0 and ``B[s]`` on shard 1."""
    candidates = np.arange(1, 8 * SLOTS, dtype=np.int64)
    shards = hash_shards(candidates, NUM_SHARDS)
    return candidates[shards == 0][:SLOTS], candidates[shards == 1][:SLOTS]


def serve_ids() -> np.ndarray:
    """One ``emb`` id per shard that workers only read with ``lookup_rows`` (read only): never a row."""
    return np.concatenate([fresh_ids(shard, 1, 1 << 40) for shard in range(NUM_SHARDS)])


def fresh_ids(shard: int, count: int, start: int) -> np.ndarray:
    """``count`` ids on ``shard`` from ``start`` up (limit events use ids no push uses)."""
    candidates = np.arange(start, start + 8 * count + 64, dtype=np.int64)
    return candidates[hash_shards(candidates, NUM_SHARDS) == shard][:count]
