"""Checkpoints by change (ps_server.durability.chains): deltas hold only changed rows, restores of a
chain equal the store bit for bit (also onto another shard count), damaged links fall back whole,
retention keeps what kept checkpoints build on."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from ps_server.core import row_file
from ps_server.core.ledger import PushLedger
from ps_server.core.store import VariableStore
from ps_server.core.tables import read_tables_rows
from ps_server.durability.checkpointer import Checkpointer
from ps_server.durability.format import (
    MANIFEST_FILE,
    TENSORS_FILE,
    CheckpointError,
    checkpoint_ids,
    shard_dir,
)
from ps_server.durability.restore import load_restore
from wehub_ps.placement import hash_shards
from wehub_ps.specs import SGD, Adam, Admission, DiskTier, Expiry, Uniform, VariableSpec

LIMIT = 1 << 30
TABLE = VariableSpec("emb", (8,), "float32", initializer=Uniform(seed=1), optimizer=Adam(0.01), hash_table=True,
                     max_rows=3000, eviction="lru", admission=Admission(min_count=2, counters=256),
                     expiry=Expiry(steps=50))
DENSE = VariableSpec("w", (16, 4), "float32", optimizer=SGD(0.5))


def _store(shard: int = 0, num_shards: int = 1) -> VariableStore:
    store = VariableStore(shard, num_shards, LIMIT)
    store.create(TABLE)
    store.create(DENSE)
    return store


def _touch(store: VariableStore, ids: np.ndarray, seed: int) -> None:
    """A training step on ``ids`` (pulled, pushed) and the dense variable."""
    table = store.get("emb")
    mine = ids[hash_shards(ids, store.num_shards) == store.shard_index]
    read_tables_rows([(table, mine)], table.reserve)
    grads = np.random.default_rng(seed).standard_normal((len(mine), 8)).astype(np.float32)
    table.apply_rows(mine, grads)
    table.finish_push()
    dense = store.get("w")
    if dense.holds_part:
        step = dense.reserve_step()
        dense.apply_gradient(0, np.full(dense.elements, 0.25, np.float32), step)
        dense.finish_push()
    store.generation += 1


def _checkpointer(store: VariableStore, root, full_every: int = 4, keep: int = 2) -> Checkpointer:
    return Checkpointer(store, PushLedger(), str(root), "server", keep=keep, interval=0, full_every=full_every)


def _state(store: VariableStore) -> dict:
    """Every table and dense array of the store, as bytes."""
    out = {}
    for part in store.snapshot():
        if part.rows is not None:
            out.update({f"{part.spec.name}:{k}": v.tobytes() for k, v in part.rows.items()})
            if part.admission_counts is not None:
                out[f"{part.spec.name}:filter"] = part.admission_counts.tobytes()
            out[f"{part.spec.name}:scalars"] = (part.version, part.optimizer_steps, part.evicted_rows,
                                               part.access_clock, json.dumps(part.policy_counts))
        else:
            out[part.spec.name] = part.value.tobytes()
    return out


def _restored(root, shard: int = 0, num_shards: int = 1) -> VariableStore:
    restored = load_restore(root, shard, num_shards)
    assert restored is not None
    store = VariableStore(shard, num_shards, LIMIT)
    store.restore(restored.parts)
    return store


def _manifest(root, checkpoint_id: int, shard: int = 0, num_shards: int = 1) -> dict:
    path = shard_dir(root, shard, num_shards) / f"ckpt-{checkpoint_id:010d}" / MANIFEST_FILE
    return json.loads(path.read_text())


def test_a_delta_holds_the_changed_rows_only_and_its_chain_restores_bit_for_bit(tmp_path):
    store = _store()
    checkpointer = _checkpointer(store, tmp_path, full_every=4, keep=10)
    everything = np.arange(2000, dtype=np.int64)
    for seed in range(2):
        _touch(store, everything, seed)  # twice: admitted at the second pull
    assert store.get("emb").num_rows == 2000
    checkpointer.checkpoint("test")
    kinds = []
    for k in range(6):
        _touch(store, np.arange(k * 20, k * 20 + 20, dtype=np.int64), 10 + k)  # 1% of the rows
        record = checkpointer.checkpoint("test")
        manifest = _manifest(tmp_path, int(record.written.checkpoint_id))
        kinds.append(manifest["kind"])
        entry = next(e for e in manifest["variables"] if e["spec"]["name"] == "emb")
        if manifest["kind"] == "delta":
            assert entry["removed"] and record.written.bytes < 40_000
        assert _state(_restored(tmp_path)) == _state(store), k
    assert kinds == ["delta", "delta", "delta", "full", "delta", "delta"]
    assert _manifest(tmp_path, 7)["chain"] == ["0000000005", "0000000006"]


def test_removed_rows_leave_the_restored_table(tmp_path):
    store = _store()
    checkpointer = _checkpointer(store, tmp_path, full_every=10)
    ids = np.arange(100, dtype=np.int64)
    _touch(store, ids, 0)
    _touch(store, ids, 1)
    checkpointer.checkpoint("base")
    table = store.get("emb")
    table.max_rows = 90  # the next 10 new rows evict 20 by LRU
    _touch(store, np.arange(100, 110, dtype=np.int64), 2)
    _touch(store, np.arange(100, 110, dtype=np.int64), 3)
    assert table.evicted_rows == 20
    for _ in range(60):  # 50 versions later the rows not updated since expire
        _touch(store, np.arange(100, 105, dtype=np.int64), 4)
    removed, _ = table.sweep(0.0)
    assert len(removed) == 85
    checkpointer.checkpoint("delta")
    assert _manifest(tmp_path, 2)["kind"] == "delta"
    restored = _restored(tmp_path)
    assert restored.get("emb").num_rows == 5
    assert _state(restored) == _state(store)


def test_a_damaged_delta_falls_back_whole_to_the_checkpoint_before_it(tmp_path, caplog):
    store = _store()
    checkpointer = _checkpointer(store, tmp_path, full_every=5, keep=10)
    _touch(store, np.arange(50, dtype=np.int64), 0)
    _touch(store, np.arange(50, dtype=np.int64), 1)
    checkpointer.checkpoint("full")
    _touch(store, np.arange(10, dtype=np.int64), 2)
    checkpointer.checkpoint("delta 1")
    expected = _state(store)
    _touch(store, np.arange(10, 20, dtype=np.int64), 3)
    checkpointer.checkpoint("delta 2")
    tensors = shard_dir(tmp_path, 0, 1) / "ckpt-0000000003" / TENSORS_FILE
    raw = bytearray(tensors.read_bytes())
    raw[-5] ^= 0xFF
    tensors.write_bytes(bytes(raw))
    with caplog.at_level(logging.ERROR):
        assert _state(_restored(tmp_path)) == expected
    assert "CHECKPOINT SKIPPED" in caplog.text
    # A damaged link damages every delta built on it: with the full one gone, nothing is usable.
    (shard_dir(tmp_path, 0, 1) / "ckpt-0000000001" / TENSORS_FILE).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="damaged"):
        load_restore(tmp_path, 0, 1)


def test_retention_keeps_what_the_kept_checkpoints_build_on(tmp_path):
    store = _store()
    checkpointer = _checkpointer(store, tmp_path, full_every=3, keep=1)
    for k in range(5):
        _touch(store, np.arange(k * 5, k * 5 + 30, dtype=np.int64), k)
        checkpointer.checkpoint(f"{k}")
    # 1 full, 2, 3 deltas, 4 full, 5 delta of 4: keeping the newest keeps 4 too.
    assert checkpoint_ids(shard_dir(tmp_path, 0, 1)) == [4, 5]
    assert _state(_restored(tmp_path)) == _state(store)


def test_a_delta_chain_restores_onto_another_shard_count(tmp_path):
    stores = [_store(i, 2) for i in range(2)]
    checkpointers = [_checkpointer(s, tmp_path, full_every=4) for s in stores]
    ids = np.arange(400, dtype=np.int64)
    for seed in range(3):
        for store in stores:
            _touch(store, ids[seed * 100:], seed)
    for checkpointer in checkpointers:
        checkpointer.checkpoint("full")
    for store in stores:
        _touch(store, ids[:30], 9)
        _touch(store, ids[:30], 10)
    for checkpointer in checkpointers:
        checkpointer.checkpoint("delta")
    rows = {}
    for store in stores:
        snap = store.get("emb").rows_snapshot()
        for i, row in zip(snap["ids"].tolist(), snap["value"]):
            rows[i] = row.tobytes()
    assert len(rows) > 300
    seen = {}
    for shard in range(3):
        restored = _restored(tmp_path, shard, 3)
        snap = restored.get("emb").rows_snapshot()
        assert (hash_shards(snap["ids"], 3) == shard).all()
        seen.update({i: row.tobytes() for i, row in zip(snap["ids"].tolist(), snap["value"])})
    assert seen == rows


def test_a_failed_write_makes_the_next_checkpoint_full(tmp_path, monkeypatch):
    store = _store()
    checkpointer = _checkpointer(store, tmp_path, full_every=10)
    _touch(store, np.arange(30, dtype=np.int64), 0)
    _touch(store, np.arange(30, dtype=np.int64), 1)
    checkpointer.checkpoint("full")
    _touch(store, np.arange(5, dtype=np.int64), 2)
    import ps_server.durability.checkpointer as module

    def failing(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(module, "write_checkpoint", failing)
    with pytest.raises(OSError):
        checkpointer.checkpoint("fails")  # its snapshot forgot the changes it held
    monkeypatch.undo()
    _touch(store, np.arange(5, 10, dtype=np.int64), 3)
    record = checkpointer.checkpoint("after")
    assert _manifest(tmp_path, int(record.written.checkpoint_id))["kind"] == "full"
    assert _state(_restored(tmp_path)) == _state(store)


def test_a_table_that_removed_more_ids_than_it_books_writes_a_full_checkpoint(tmp_path):
    store = _store()
    checkpointer = _checkpointer(store, tmp_path, full_every=10)
    _touch(store, np.arange(1500, dtype=np.int64), 0)
    _touch(store, np.arange(1500, dtype=np.int64), 1)
    checkpointer.checkpoint("full")
    table = store.get("emb")
    table.max_rows = 100  # evicts more rows than the table has capacity (the removed ids it books)
    for k in range(3):
        batch = np.arange(10_000 + k * 1000, 10_000 + k * 1000 + 100, dtype=np.int64)
        _touch(store, batch, k)
        _touch(store, batch, k)
    assert table.evicted_rows > table.capacity
    record = checkpointer.checkpoint("after")
    assert _manifest(tmp_path, int(record.written.checkpoint_id))["kind"] == "full"
    assert _state(_restored(tmp_path)) == _state(store)


# ---- tables with a disk tier ----

TIERED = VariableSpec("tiered", (8,), "float32", initializer=Uniform(seed=4), optimizer=Adam(0.01), hash_table=True,
                      tier=DiskTier(memory_rows=64), expiry=Expiry(steps=400))


def _tiered_store(tmp_path, shard: int = 0, num_shards: int = 1) -> VariableStore:
    files = iter(range(1_000_000))
    store = VariableStore(shard, num_shards, LIMIT,
                          disk_files=lambda name: tmp_path / "tables" / f"{shard}-{name}-{next(files)}.rows")
    store.create(TIERED)
    return store


def _touch_tiered(store: VariableStore, ids: np.ndarray, seed: int) -> None:
    table = store.get("tiered")
    mine = ids[hash_shards(ids, store.num_shards) == store.shard_index]
    for start in range(0, len(mine), 32):  # within the memory budget per request
        batch = mine[start:start + 32]
        read_tables_rows([(table, batch)], table.reserve)
        table.apply_rows(batch, np.random.default_rng(seed + start).standard_normal((len(batch), 8))
                         .astype(np.float32))
        table.finish_push()
    store.generation += 1


def test_a_tiered_tables_rows_on_disk_are_streamed_into_the_checkpoint_not_copied(tmp_path, monkeypatch):
    store = _tiered_store(tmp_path)
    _touch_tiered(store, np.arange(1000, dtype=np.int64), 0)
    table = store.get("tiered")
    assert len(table.disk) == 1000 - 64
    parts, is_delta = store.checkpoint_snapshot(delta=False)
    snap = next(p for p in parts if p.spec.name == "tiered")
    assert not is_delta and len(snap.rows["ids"]) == 64 and len(snap.disk_rows.slots) == 936
    expected = _state(store)  # the instant of the snapshot
    # Training goes on while the snapshot is written: rows come back from disk, others go out (appended:
    # nothing the snapshot holds is overwritten), and no compaction moves a record meanwhile.
    monkeypatch.setattr(row_file, "_COMPACT_AT_LEAST", 16)
    slots_before = table.disk.capacity
    for offset in range(6):
        _touch_tiered(store, np.arange(offset % 3, 2000, 3, dtype=np.int64), 1 + offset)
    assert table.disk._frozen == 1 and table.disk.compactions == 0
    # It would have compacted: half the file is dead, and the file grew instead.
    assert table.disk.high_water - len(table.disk) > max(len(table.disk), 16)
    assert table.disk.capacity > slots_before
    from ps_server.durability.writer import ShardSnapshot, write_checkpoint

    write_checkpoint(tmp_path / "ckpt", ShardSnapshot(0, 1, "s", parts, {"entries": []}), keep=3)
    assert table.disk._frozen == 0
    for start in range(0, 5 * 2000, 50):  # rows read back again: once a batch does not fit, after the snapshot
        _touch_tiered(store, np.arange(start % 2000, start % 2000 + 50, dtype=np.int64), 2)
        if table.disk.compactions:
            break
    assert table.disk.compactions == 1
    manifest = _manifest(tmp_path / "ckpt", 1)
    entry = next(e for e in manifest["variables"] if e["spec"]["name"] == "tiered")
    assert entry["disk"]["rows"] == 936 and entry["disk"]["file"] in manifest["files"]
    assert _state(_restored_tiered(tmp_path / "ckpt", tmp_path / "restored")) == expected


def _restored_tiered(root, table_dir, shard: int = 0, num_shards: int = 1) -> VariableStore:
    restored = load_restore(root, shard, num_shards)
    assert restored is not None
    files = iter(range(1_000_000))
    store = VariableStore(shard, num_shards, LIMIT,
                          disk_files=lambda name: table_dir / f"{shard}-{name}-{next(files)}.rows")
    store.restore(restored.parts)
    return store


def test_a_tiered_tables_chain_restores_bit_for_bit_also_onto_another_shard_count(tmp_path):
    stores = [_tiered_store(tmp_path / f"s{i}", i, 2) for i in range(2)]
    checkpointers = [_checkpointer(s, tmp_path / "ckpt", full_every=4, keep=10) for s in stores]
    for store in stores:
        _touch_tiered(store, np.arange(2000, dtype=np.int64), 0)
    for checkpointer in checkpointers:
        checkpointer.checkpoint("full")
    for k in range(2):
        for store in stores:
            _touch_tiered(store, np.arange(k * 500, k * 500 + 300, dtype=np.int64), 10 + k)  # on disk: back
            table = store.get("tiered")
            table.sweep(0.0)  # nothing is 400 versions old yet
        for shard, checkpointer in enumerate(checkpointers):
            record = checkpointer.checkpoint("delta")
            assert _manifest(tmp_path / "ckpt", int(record.written.checkpoint_id), shard, 2)["kind"] == "delta"
    for i, store in enumerate(stores):
        restored = _restored_tiered(tmp_path / "ckpt", tmp_path / f"r{i}", i, 2)
        assert _state(restored) == _state(store)
        assert len(restored.get("tiered").disk) > 0
    rows = {}
    for store in stores:
        snap = store.get("tiered").rows_snapshot()
        rows.update({i: v.tobytes() for i, v in zip(snap["ids"].tolist(), snap["value"])})
    seen = {}
    for shard in range(3):
        restored = _restored_tiered(tmp_path / "ckpt", tmp_path / f"three-{shard}", shard, 3)
        snap = restored.get("tiered").rows_snapshot()
        assert (hash_shards(snap["ids"], 3) == shard).all()
        seen.update({i: v.tobytes() for i, v in zip(snap["ids"].tolist(), snap["value"])})
    assert seen == rows
