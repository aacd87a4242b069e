"""The spec log (ps_server.durability.spec_log): variables durable before the first checkpoint.

Replayed alone, after a checkpoint, onto another shard count; damaged records
and value files are skipped, never loaded; the restore plan picks the spec
logs of the layout it restores.
"""

from __future__ import annotations

import hashlib
import logging
import threading

import numpy as np

from ps_server.core.ledger import PushLedger
from ps_server.core.store import VariableStore
from ps_server.durability.checkpointer import Checkpointer
from ps_server.durability.format import SPEC_LOG_FILE, shard_dir
from ps_server.durability.restore import find_restore_plan, load_restore
from ps_server.durability.spec_log import VALUES_DIR, SpecLog
from ps_server.durability.writer import ShardSnapshot, write_checkpoint
from wehub_ps.placement import FixedShardsPartitioner
from wehub_ps.specs import SGD, Explicit, Normal, VariableSpec

LIMIT = 1 << 30
WAIT = 10.0  # generous bound for things that must happen
VALUE = np.arange(40, dtype=np.float32).reshape(20, 2)
DIGEST = hashlib.sha256(VALUE.tobytes()).digest()
SPECS = [
    VariableSpec("normal", (30, 3), "float32", initializer=Normal(seed=5), optimizer=SGD(),
                 partitioner=FixedShardsPartitioner(2)),
    VariableSpec("uploaded", (20, 2), "float32", initializer=Explicit(DIGEST),
                 partitioner=FixedShardsPartitioner(2)),
    VariableSpec("table", (4,), "float32", initializer=Normal(seed=2), hash_table=True),
]


def _created(root, shard: int, num_shards: int, upload: bool = True) -> VariableStore:
    """A shard whose variables were created (and the explicit value uploaded) with a spec log."""
    store = VariableStore(shard, num_shards, LIMIT)
    store.spec_log = SpecLog(root, shard, num_shards)
    for spec in SPECS:
        store.create(spec)
    part = store.get("uploaded")
    if upload and part.holds_part:
        staged = store.stage_upload(part)
        staged.write(0, VALUE[part.row_start:part.row_end].ravel())
        assert store.install_upload(staged)
    return store


def _restored(root, shard: int, num_shards: int) -> VariableStore:
    restored = load_restore(root, shard, num_shards)
    assert restored is not None
    store = VariableStore(shard, num_shards, LIMIT)
    store.restore(restored.parts)
    return store


def _values(stores: list[VariableStore], name: str) -> np.ndarray:
    parts = sorted((s.get(name) for s in stores if s.get(name).holds_part), key=lambda p: p.row_start)
    return np.concatenate([p.value for p in parts])


def test_replay_alone_restores_every_variable_as_created(tmp_path):
    created = [_created(tmp_path, i, 2) for i in range(2)]
    restored = [_restored(tmp_path, i, 2) for i in range(2)]
    for name in ("normal", "uploaded"):
        np.testing.assert_array_equal(_values(restored, name), _values(created, name))
        assert all(s.get(name).initialized and s.get(name).version == 0 for s in restored)
    assert all(s.get("table").spec == SPECS[2] and s.get("table").num_rows == 0 for s in restored)


def test_replay_onto_another_shard_count_assembles_the_uploaded_rows(tmp_path):
    [_created(tmp_path, i, 2) for i in range(2)]
    restored = [_restored(tmp_path, i, 1) for i in range(1)]
    np.testing.assert_array_equal(_values(restored, "uploaded").reshape(20, 2), VALUE)
    assert restored[0].get("uploaded").initialized


def test_a_checkpoint_keeps_its_state_and_the_log_adds_what_came_after(tmp_path):
    store = VariableStore(0, 1, LIMIT)
    store.spec_log = SpecLog(tmp_path, 0, 1)
    store.create(SPECS[0])
    part = store.get("normal")
    part.apply_gradient(0, np.ones(part.elements, np.float32), part.reserve_step())
    trained = part.value.copy()
    write_checkpoint(tmp_path, ShardSnapshot(0, 1, "s", store.snapshot(), {"entries": []}), keep=3)
    store.create(SPECS[1])  # after the checkpoint: only in the log (waiting for its value)
    restored = _restored(tmp_path, 0, 1)
    np.testing.assert_array_equal(restored.get("normal").value, trained)
    assert not restored.get("uploaded").initialized


def test_a_torn_last_record_and_a_damaged_value_file_are_skipped(tmp_path, caplog):
    _created(tmp_path, 0, 1)
    directory = shard_dir(tmp_path, 0, 1)
    with open(directory / SPEC_LOG_FILE, "a") as log:
        log.write('{"kind": "spec", "spec": {"name": "torn"')  # a crash in the middle of an append
    [value_file] = (directory / VALUES_DIR).iterdir()
    data = bytearray(value_file.read_bytes())
    data[-1] ^= 0xFF
    value_file.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        restored = _restored(tmp_path, 0, 1)
    assert sorted(p.spec.name for p in restored.parts()) == ["normal", "table", "uploaded"]
    assert not restored.get("uploaded").initialized, "a damaged value is never loaded"
    assert "SPEC LOG RECORD SKIPPED" in caplog.text and "INITIAL VALUE SKIPPED" in caplog.text


def test_a_layout_with_checkpoints_on_some_shards_and_only_logs_on_others_is_not_mixed(tmp_path):
    for i in range(2):
        _created(tmp_path, i, 2, upload=False)
    store = VariableStore(0, 2, LIMIT)
    write_checkpoint(tmp_path, ShardSnapshot(0, 2, "s", store.snapshot(), {"entries": []}), keep=3)
    assert find_restore_plan(tmp_path, 0, 3) is None
    own = find_restore_plan(tmp_path, 1, 2)
    assert own is not None and own.checkpoints == {} and list(own.spec_logs) == [1]


def test_records_of_what_every_kept_checkpoint_holds_are_pruned(tmp_path):
    store = _created(tmp_path, 0, 1)
    directory = shard_dir(tmp_path, 0, 1)
    checkpointer = Checkpointer(store, PushLedger(), str(tmp_path), "s", keep=2, interval=0)
    checkpointer.checkpoint("test")  # the oldest kept checkpoint holds all three: no record left
    assert (directory / SPEC_LOG_FILE).read_text() == ""
    assert list((directory / VALUES_DIR).iterdir()) == []
    later = VariableSpec("later", (3,), "float32", initializer=Normal(seed=1))
    store.create(later)
    part = store.get("normal")
    part.apply_gradient(0, np.ones(part.elements, np.float32), part.reserve_step())
    store.generation += 1
    checkpointer.checkpoint("test")  # the oldest kept one (the first) lacks "later": it stays
    assert "later" in (directory / SPEC_LOG_FILE).read_text()
    restored = _restored(tmp_path, 0, 1)
    assert sorted(p.spec.name for p in restored.parts()) == ["later", "normal", "table", "uploaded"]
    np.testing.assert_array_equal(restored.get("normal").value, part.value)
    np.testing.assert_array_equal(restored.get("uploaded").value.reshape(20, 2), VALUE)


def test_racing_uploads_install_the_value_the_log_replays(tmp_path, monkeypatch):
    """Two uploads of one initial value complete at once (different arrays): the one served is the
    one a restart replays from the spec log. Upload A is written to the log first and paused there;
    upload B completes meanwhile; whichever is installed, the log must name it first."""
    store = VariableStore(0, 1, LIMIT)
    store.spec_log = SpecLog(tmp_path, 0, 1)
    store.create(SPECS[1])
    part = store.get("uploaded")
    uploads = {}
    for name, value in (("a", VALUE), ("b", VALUE + 100)):
        uploads[name] = store.stage_upload(part)
        uploads[name].write(0, value.ravel())
    a_buffer = uploads["a"].buffer
    a_recording, a_go_on = threading.Event(), threading.Event()
    record = store.spec_log.record_initial_value

    def paused_for_a(spec, row_start, row_end, value):
        record(spec, row_start, row_end, value)
        if value is a_buffer:
            a_recording.set()
            a_go_on.wait(WAIT)

    monkeypatch.setattr(store.spec_log, "record_initial_value", paused_for_a)
    threads = {name: threading.Thread(target=store.install_upload, args=(uploads[name],),
                                      name=f"test-install-{name}") for name in uploads}
    threads["a"].start()
    assert a_recording.wait(WAIT)
    threads["b"].start()
    threads["b"].join(1.0)  # B completes here unless it waits for A's install
    a_go_on.set()
    for thread in threads.values():
        thread.join(WAIT)
        assert not thread.is_alive()
    assert part.initialized
    np.testing.assert_array_equal(_restored(tmp_path, 0, 1).get("uploaded").value, part.value)
