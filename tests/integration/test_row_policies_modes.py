"""Admission and the disk tier in sync and ssp mode: exact results from known gradients of two workers.

Each step both workers pull, then push (SGD, learning rate 1, aggregation
"sum"): worker w's gradient is w + 1 on every element, so a row both push in
a step moves by exactly -3. Table ``admitted`` (min_count 3) gets a fixed set
A each step and a fresh set F_s: A becomes a row at the first pull of step 2
(its third sighting), F_s never (two sightings). Table ``tiered`` (6 rows per
shard in memory) gets A, F_s and F_{s-3} (read back from disk) each step.
"""

from __future__ import annotations

import numpy as np
import pytest

from wehub_ps.placement import hash_shards
from worker_client import SGD, Admission, DiskTier, PSClient

STEPS = 6
WAIT = 60.0


def _balanced(start: int, per_shard: int) -> np.ndarray:
    """``per_shard`` ids on each of the 2 shards, from ``start`` up."""
    ids = np.arange(start, start + 64, dtype=np.int64)
    shards = hash_shards(ids, 2)
    return np.sort(np.concatenate([ids[shards == 0][:per_shard], ids[shards == 1][:per_shard]]))


A = _balanced(1, 2)
FRESH = [_balanced(1000 + 100 * s, 2) for s in range(STEPS)]


def _batches(step: int) -> dict[str, np.ndarray]:
    tiered = [A, FRESH[step]] + ([FRESH[step - 3]] if step >= 3 else [])
    return {"admitted": np.concatenate([A, FRESH[step]]), "tiered": np.concatenate(tiered)}


def _step(client: PSClient, worker: int, step: int) -> None:
    batches = _batches(step)
    with client.step([]) as handle:
        for name, ids in batches.items():
            client.pull_rows(name, ids)
        handle.push({}, rows={name: (ids, np.full((len(ids), 2), worker + 1.0, np.float32))
                              for name, ids in batches.items()})


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_admission_and_the_disk_tier_are_exact_in_sync_and_ssp(cluster_factory, tmp_path, mode):
    args = ["--consistency", mode, "--expected-workers", "2", "--disk-tier-dir", str(tmp_path / "tables")]
    if mode == "ssp":
        args += ["--staleness", "0"]
    cluster = cluster_factory(2, *args)
    observer = PSClient(cluster.addresses, worker_id="observer", register=False, retry_timeout=WAIT)
    workers = [PSClient(cluster.addresses, worker_id=f"w{i}", retry_timeout=WAIT) for i in range(2)]
    try:
        sgd = SGD(learning_rate=1.0)
        observer.create_embedding("admitted", 2, initializer="zeros", optimizer=sgd, aggregation="sum",
                                  admission=Admission(min_count=3))
        observer.create_embedding("tiered", 2, initializer="zeros", optimizer=sgd, aggregation="sum",
                                  tier=DiskTier(memory_rows=6))
        for step in range(STEPS):
            for worker, client in enumerate(workers):
                _step(client, worker, step)
        with workers[0].step([]):  # its pull waits until the last step is applied
            pass
        pushed = {}
        for step in range(STEPS):
            for i in _batches(step)["tiered"].tolist():
                pushed[i] = pushed.get(i, 0) + 1
        ids = np.array(sorted(pushed), np.int64)
        expected = -3.0 * np.array([pushed[i] for i in ids.tolist()], np.float32)[:, None] * np.ones((1, 2))
        np.testing.assert_array_equal(observer.lookup_rows("tiered", ids), expected.astype(np.float32))
        np.testing.assert_array_equal(observer.lookup_rows("admitted", A),
                                      np.full((len(A), 2), -3.0 * (STEPS - 1), np.float32))
        fresh = np.concatenate(FRESH)
        np.testing.assert_array_equal(observer.lookup_rows("admitted", fresh, missing="zeros"),
                                      np.zeros((len(fresh), 2), np.float32))
        exported, _ = observer.export_rows("admitted")
        assert exported.tolist() == A.tolist()
        counts = {key: sum(info.variables[name][key] for info in observer.describe())
                  for name, key in (("admitted", "dropped_gradient_rows"), ("tiered", "rows_on_disk"),
                                    ("tiered", "cold_reads"))}
        # sync sums a step's rows before it applies them: one drop per row and step; ssp applies each push.
        per_push = 1 if mode == "sync" else 2
        assert counts["dropped_gradient_rows"] == per_push * (len(A) + STEPS * len(FRESH[0]))
        assert counts["rows_on_disk"] > 0 and counts["cold_reads"] > 0
    finally:
        for client in (*workers, observer):
            client.close()
