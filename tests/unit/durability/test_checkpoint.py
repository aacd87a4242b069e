"""Checkpoints on disk (ps_server.durability.format, writer, restore, reshard) and when they are
taken (ps_server.durability.checkpointer).

Round trips are checked bit for bit (values, optimizer slots, versions,
optimizer steps, specs), also across a change of the shard count; damaged
checkpoints must be skipped for the previous intact one; the layout (shard
count) to restore from must be the one holding the newest state.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time

import numpy as np
import pytest

from ps_server.core.errors import RequestError
from ps_server.core.ledger import ClaimResult, PushLedger
from ps_server.core.pushes import begin_push
from ps_server.core.store import VariableStore
from ps_server.durability.checkpointer import Checkpointer
from ps_server.durability.format import MANIFEST_FILE, TENSORS_FILE, CheckpointError, shard_dir
from ps_server.durability.restore import RestoredFrom, find_restore_plan, load_parts, load_restore
from ps_server.durability.writer import ShardSnapshot, clean_temporaries, write_checkpoint
from ps_server.service.push_messages import push_chunk, push_start
from wehub_ps.errors import Reason
from wehub_ps.placement import FixedShardsPartitioner, MinSizePartitioner, rows_of, stable_hash64
from wehub_ps.specs import (
    SGD,
    Adagrad,
    Adam,
    Constant,
    Explicit,
    GlorotUniform,
    Momentum,
    Normal,
    Uniform,
    VariableSpec,
)
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.arrays import as_wire_array, byte_view, chunk_ranges
from wehub_ps.wire.codec import DecodedChunk
from wehub_ps.wire.dtypes import to_wire_dtype

LIMIT = 1 << 30

EXPLICIT_VALUE = (np.arange(10, dtype=np.float32) / 7).reshape(5, 2)
SPECS = [
    VariableSpec("scalar", (), "float64", initializer=Constant(1.5), optimizer=Adam()),
    VariableSpec("empty", (0, 3), "float32", optimizer=Momentum()),
    VariableSpec("half", (7, 2), "float16", initializer=Uniform(-1.0, 1.0),
                 optimizer=Adam(learning_rate=0.01)),
    VariableSpec("split", (11, 3), "float32", initializer=Normal(stddev=0.5),
                 optimizer=Momentum(nesterov=True), partitioner=FixedShardsPartitioner(3)),
    VariableSpec("expl", (5, 2), "float32",
                 initializer=Explicit(hashlib.sha256(EXPLICIT_VALUE.tobytes()).digest()),
                 optimizer=Adagrad(), partitioner=FixedShardsPartitioner(2)),
    # 400-byte rows, at least 10 rows a part: split over every shard of up to 12.
    VariableSpec("big", (120, 50), "float64", initializer=GlorotUniform(), optimizer=SGD(0.1),
                 partitioner=MinSizePartitioner(min_shard_bytes=4000)),
]


# ---- helpers ---------------------------------------------------------------------------------


def _grad(spec: VariableSpec, k: int) -> np.ndarray:
    """The global gradient of push ``k``, as (rows, row elements)."""
    rows, row_elements = rows_of(spec.shape)
    rng = np.random.default_rng([k, stable_hash64(spec.name) % 2**32])
    return rng.standard_normal(rows * row_elements).astype(spec.dtype).reshape(rows, row_elements)


def _build(shard: int, num_shards: int, specs=SPECS) -> VariableStore:
    """A shard with every variable created and the explicit value uploaded."""
    store = VariableStore(shard, num_shards, LIMIT)
    for spec in specs:
        store.create(spec)
        part = store.get(spec.name)
        if isinstance(spec.initializer, Explicit) and part.holds_part:
            upload = store.stage_upload(part)
            upload.write(0, EXPLICIT_VALUE[part.row_start:part.row_end].ravel())
            assert store.install_upload(upload)
    return store


def _train(store: VariableStore, k: int) -> None:
    """Apply global gradient ``k`` to this shard's rows, in two chunks (like one push)."""
    for part in store.parts():
        if not part.holds_part:
            continue
        grad = _grad(part.spec, k)[part.row_start:part.row_end].ravel()
        if part.elements:
            step = part.reserve_step()
            half = part.elements // 2
            if half:
                part.apply_gradient(0, grad[:half], step)
            part.apply_gradient(half, grad[half:], step)
        part.finish_push()
    store.generation += 1


def _snap(store: VariableStore, created_unix: float | None = None, ledger: PushLedger | None = None):
    extra = {} if created_unix is None else {"created_unix": created_unix}
    return ShardSnapshot(store.shard_index, store.num_shards, f"server-{store.shard_index}",
                         store.snapshot(), {"entries": ledger.snapshot() if ledger else []}, **extra)


def _restore(root, shard: int, num_shards: int):
    plan = find_restore_plan(root, shard, num_shards)
    assert plan is not None
    store = VariableStore(shard, num_shards, LIMIT)
    store.restore(load_parts(plan, shard, num_shards))
    return store, plan


def _bits(array: np.ndarray) -> tuple[str, tuple[int, ...], bytes]:
    return array.dtype.str, array.shape, array.tobytes()


def _state(store: VariableStore) -> dict:
    """Everything a checkpoint must preserve, comparable bit for bit."""
    out = {}
    for part in store.parts():
        out[part.spec.name] = {
            "spec": part.spec, "rows": (part.row_start, part.row_end), "holds": part.holds_part,
            "version": part.version, "optimizer_steps": part.optimizer_steps,
            # A shard without rows has nothing to initialize (see the report).
            "initialized": part.initialized if part.holds_part else None,
            "value": _bits(part.value),
            "slots": {name: _bits(slot) for name, slot in sorted(part.slots.items())},
        }
    return out


def _global(stores: list[VariableStore], name: str, slot: str | None = None) -> np.ndarray:
    """Assemble the global flat value (or slot) of ``name`` from the parts of ``stores``."""
    spec = stores[0].get(name).spec
    rows, row_elements = rows_of(spec.shape)
    covered = np.zeros(rows, dtype=bool)
    out = None
    for store in stores:
        part = store.get(name)
        if not part.holds_part:
            continue
        data = part.value if slot is None else part.slots[slot]
        if out is None:
            out = np.zeros(rows * row_elements, dtype=data.dtype)
        assert data.dtype == out.dtype
        assert not covered[part.row_start:part.row_end].any(), "two shards hold the same rows"
        covered[part.row_start:part.row_end] = True
        out[part.row_start * row_elements:part.row_end * row_elements] = data
    assert covered.all(), f"rows of {name!r} missing"
    assert out is not None
    return out


def _push_begin(items, sequence, worker_id="w", incarnation="inc"):
    return ps_pb2.PushBegin(
        worker_id=worker_id, incarnation=incarnation, sequence=sequence, shard_index=0, num_shards=1,
        kind=ps_pb2.GRADIENT,
        items=[ps_pb2.PushItem(variable=name, elements=values.size, wire_dtype=to_wire_dtype(values.dtype))
               for name, values in items.items()])


def _push(store, ledger, items: dict[str, np.ndarray], sequence: int, chunk_elements: int = 4):
    """A complete push through the real push path (which also moves the store's generation)."""
    push = begin_push(store, ledger, push_start(_push_begin(items, sequence)))
    for name, values in items.items():
        wire = as_wire_array(values)
        for offset, count in chunk_ranges(wire.size, chunk_elements):
            header = ps_pb2.ChunkHeader(variable=name, offset=offset, count=count,
                                        dtype=to_wire_dtype(wire.dtype), part_elements=wire.size)
            push.apply(push_chunk(DecodedChunk(header, byte_view(wire[offset:offset + count]))))
    return push.finish()


def _ckpt_names(root, shard: int, num_shards: int) -> list[str]:
    return sorted(p.name for p in shard_dir(root, shard, num_shards).iterdir())


# ---- round trip ---------------------------------------------------------------------------------


def test_the_test_specs_cover_what_they_claim():
    placements = {s.name: s.placement(3) for s in SPECS}
    assert len(placements["split"].parts) == 3 and len(placements["big"].parts) == 3
    assert placements["empty"].parts[0].rows == 0
    lacking = [s for s in range(3) if any(p.part_on(s) is None for p in placements.values())]
    assert lacking, "some shard of 3 must lack a part of some variable"


@pytest.mark.parametrize("shard, num_shards, via_checkpointer", [(0, 1, True), (1, 3, False), (2, 3, True)])
def test_round_trip_is_bit_for_bit(tmp_path, shard, num_shards, via_checkpointer):
    store = _build(shard, num_shards)
    for k in range(3):
        _train(store, k)
    before = _state(store)
    # Real training moved something: the round trip is not comparing initial values.
    assert any(v["optimizer_steps"] == 3 for v in before.values())
    if via_checkpointer:
        checkpointer = Checkpointer(store, PushLedger(), str(tmp_path), "srv", keep=2, interval=0)
        record = checkpointer.checkpoint("test")
        assert record is not None and record.written.num_shards == num_shards
        path = record.written.path
    else:
        path = write_checkpoint(tmp_path, _snap(store), keep=2).path
    assert path.parent == shard_dir(tmp_path, shard, num_shards)

    restored, plan = _restore(tmp_path, shard, num_shards)
    assert plan.num_shards == num_shards and plan.checkpoints == {shard: path}
    assert _state(restored) == before
    assert restored.reserved_bytes == store.reserved_bytes
    # The restored copy is independent of the checkpoint files and trains on identically.
    _train(store, 3)
    _train(restored, 3)
    assert _state(restored) == _state(store)


def test_snapshot_is_a_copy_taken_at_the_instant(tmp_path):
    store = _build(0, 1)
    snapshot = _snap(store)
    before = {p.spec.name: p.value.copy() for p in snapshot.parts}
    _train(store, 0)
    for part in snapshot.parts:
        np.testing.assert_array_equal(part.value, before[part.spec.name])
    write_checkpoint(tmp_path, snapshot, keep=1)
    restored, _ = _restore(tmp_path, 0, 1)
    for name, value in before.items():
        assert restored.get(name).value.tobytes() == value.tobytes()
    assert all(p.version == 0 for p in restored.parts())


def test_restore_beyond_the_memory_limit_is_refused(tmp_path):
    store = _build(0, 1)
    write_checkpoint(tmp_path, _snap(store), keep=1)
    plan = find_restore_plan(tmp_path, 0, 1)
    small = VariableStore(0, 1, store.reserved_bytes - 1)
    with pytest.raises(RequestError) as info:
        small.restore(load_parts(plan, 0, 1))
    assert info.value.reason == Reason.MEMORY_LIMIT
    assert small.parts() == [] and small.reserved_bytes == 0
    exact = VariableStore(0, 1, store.reserved_bytes)
    exact.restore(load_parts(plan, 0, 1))
    assert exact.reserved_bytes == store.reserved_bytes


# ---- resharding ------------------------------------------------------------------------------------


@pytest.fixture
def three_shard_job(tmp_path):
    """A 3-shard job after three pushes, checkpointed into tmp_path."""
    stores = [_build(i, 3) for i in range(3)]
    for k in range(3):
        for store in stores:
            _train(store, k)
    for store in stores:
        write_checkpoint(tmp_path, _snap(store), keep=3)
    return tmp_path, stores


@pytest.mark.parametrize("new_count", [1, 2, 3, 4])
def test_restore_onto_another_shard_count(three_shard_job, new_count):
    root, old = three_shard_job
    new = []
    for i in range(new_count):
        store, plan = _restore(root, i, new_count)
        assert plan.num_shards == 3
        assert sorted(plan.checkpoints) == ([0, 1, 2] if new_count != 3 else [i])
        new.append(store)

    def check_equal_globally():
        for spec in SPECS:
            assert (_global(new, spec.name).tobytes() == _global(old, spec.name).tobytes()), spec.name
            slot_names = sorted(old[0].get(spec.name).slots)
            for slot in slot_names:
                a, b = _global(new, spec.name, slot), _global(old, spec.name, slot)
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (spec.name, slot)

    check_equal_globally()
    for store in new:
        for part in store.parts():
            spec = part.spec
            assert spec == next(s for s in SPECS if s.name == spec.name)
            expected = spec.placement(new_count).part_on(store.shard_index)
            assert part.holds_part == (expected is not None)
            if expected is None:
                assert part.elements == 0 and part.version == 0
                continue
            assert (part.row_start, part.row_end) == (expected.row_start, expected.row_end)
            assert part.version == 3, spec.name
            assert part.optimizer_steps == (3 if part.elements else 0), spec.name
            assert part.initialized, spec.name
            assert part.value.dtype == spec.dtype
            assert sorted(part.slots) == sorted(part.kernel.slot_names)
    # Training continues identically (Adam's bias correction needs the optimizer steps).
    for k in (3, 4):
        for store in old + new:
            _train(store, k)
    check_equal_globally()


def test_reshard_merges_parts_with_different_counters(tmp_path):
    """Parts that saw different numbers of pushes merge to the largest version and step."""
    spec = SPECS[3]  # "split": three parts under 3 shards, one under 1
    stores = [_build(i, 3, [spec]) for i in range(3)]
    for k in range(2):
        for store in stores:
            _train(store, k)
    _train(stores[1], 2)  # one more push reached shard 1 only
    counters = {s.shard_index: (s.get("split").version, s.get("split").optimizer_steps) for s in stores}
    assert counters == {0: (2, 2), 1: (3, 3), 2: (2, 2)}
    for store in stores:
        write_checkpoint(tmp_path, _snap(store), keep=1)
    merged, _ = _restore(tmp_path, 0, 1)
    part = merged.get("split")
    assert (part.version, part.optimizer_steps) == (3, 3)
    assert part.value.tobytes() == _global(stores, "split").tobytes()


def test_reshard_refuses_when_an_old_shard_is_all_damaged(three_shard_job):
    root, _ = three_shard_job
    (shard_dir(root, 1, 3) / "ckpt-0000000001" / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointError, match="old shard 1"):
        find_restore_plan(root, 0, 2)


# ---- damaged checkpoints --------------------------------------------------------------------------


def _truncate(path):
    data = (path / TENSORS_FILE).read_bytes()
    (path / TENSORS_FILE).write_bytes(data[: len(data) // 2])


def _flip_tensor_byte(path):
    data = bytearray((path / TENSORS_FILE).read_bytes())
    data[len(data) - 17] ^= 0x10  # inside the tensor data, the size stays the same
    (path / TENSORS_FILE).write_bytes(bytes(data))


def _flip_header_byte(path):
    data = bytearray((path / TENSORS_FILE).read_bytes())
    data[20] ^= 0x01
    (path / TENSORS_FILE).write_bytes(bytes(data))


def _edit_manifest(path):
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    manifest["variables"][0]["version"] += 1
    (path / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def _edit_recorded_tensor_checksum(path):
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    manifest["files"][TENSORS_FILE]["sha256"] = "0" * 64
    (path / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def _truncate_manifest(path):
    text = (path / MANIFEST_FILE).read_text()
    (path / MANIFEST_FILE).write_text(text[: len(text) // 2])


def _delete_manifest(path):
    (path / MANIFEST_FILE).unlink()


def _delete_tensors(path):
    (path / TENSORS_FILE).unlink()


def _append_to_tensors(path):
    with open(path / TENSORS_FILE, "ab") as f:
        f.write(b"\0")


DAMAGES = [_truncate, _flip_tensor_byte, _flip_header_byte, _edit_manifest, _edit_recorded_tensor_checksum,
           _truncate_manifest, _delete_manifest, _delete_tensors, _append_to_tensors]


@pytest.fixture
def two_checkpoints(tmp_path):
    store = _build(0, 1)
    _train(store, 0)
    first = write_checkpoint(tmp_path, _snap(store), keep=5)
    older = _state(store)
    _train(store, 1)
    second = write_checkpoint(tmp_path, _snap(store), keep=5)
    newer = _state(store)
    assert older != newer
    return tmp_path, first, second, older, newer


def test_intact_newest_checkpoint_is_used(two_checkpoints):
    root, first, second, older, newer = two_checkpoints
    assert (first.checkpoint_id, second.checkpoint_id) == ("0000000001", "0000000002")
    restored, plan = _restore(root, 0, 1)
    assert plan.checkpoints == {0: second.path}
    assert _state(restored) == newer


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__.strip("_"))
def test_damaged_newest_checkpoint_falls_back_to_the_previous(two_checkpoints, damage, caplog):
    root, first, second, older, _ = two_checkpoints
    damage(second.path)
    with caplog.at_level(logging.ERROR, logger="ps_server.durability.restore"):
        restored, plan = _restore(root, 0, 1)
    assert plan.checkpoints == {0: first.path}
    assert plan.manifests[0]["checkpoint_id"] == first.checkpoint_id
    assert _state(restored) == older
    skipped = [r for r in caplog.records if "CHECKPOINT SKIPPED" in r.getMessage()]
    assert len(skipped) == 1 and skipped[0].levelno == logging.ERROR
    assert skipped[0].fields["path"] == str(second.path)


@pytest.mark.parametrize("damage", [_truncate, _flip_tensor_byte, _edit_manifest, _delete_manifest],
                         ids=lambda f: f.__name__.strip("_"))
def test_every_checkpoint_damaged_is_an_error_not_an_empty_start(two_checkpoints, damage):
    root, first, second, _, _ = two_checkpoints
    damage(first.path)
    damage(second.path)
    with pytest.raises(CheckpointError) as info:
        find_restore_plan(root, 0, 1)
    assert str(shard_dir(root, 0, 1)) in str(info.value)


def test_half_written_temporary_is_ignored_and_cleaned(two_checkpoints):
    root, _, second, _, newer = two_checkpoints
    directory = shard_dir(root, 0, 1)

    def leave_temporary():
        tmp = directory / ".tmp-0000000003-deadbeef"
        tmp.mkdir()
        (tmp / TENSORS_FILE).write_bytes(b"half a file")
        (tmp / MANIFEST_FILE).write_text("{")
        return tmp

    tmp = leave_temporary()
    restored, plan = _restore(root, 0, 1)
    assert plan.checkpoints == {0: second.path}
    assert _state(restored) == newer
    clean_temporaries(directory)
    assert not tmp.exists()
    assert _ckpt_names(root, 0, 1) == ["ckpt-0000000001", "ckpt-0000000002"]

    tmp = leave_temporary()
    Checkpointer(restored, PushLedger(), str(root), "srv", keep=5, interval=0)
    assert not tmp.exists()
    assert _ckpt_names(root, 0, 1) == ["ckpt-0000000001", "ckpt-0000000002"]
    # Cleaning a directory that does not exist is harmless.
    clean_temporaries(shard_dir(root, 7, 9))


def test_only_a_temporary_means_nothing_to_restore(tmp_path):
    tmp = shard_dir(tmp_path, 0, 1) / ".tmp-0000000001-abcdef12"
    tmp.mkdir(parents=True)
    assert find_restore_plan(tmp_path, 0, 1) is None


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_only_the_newest_k_checkpoints_are_kept(tmp_path, keep):
    store = _build(0, 1, SPECS[:2])
    for k in range(keep + 3):
        _train(store, k)
        written = write_checkpoint(tmp_path, _snap(store), keep=keep)
        assert written.checkpoint_id == f"{k + 1:010d}"
        assert written.bytes == (written.path / TENSORS_FILE).stat().st_size
    assert _ckpt_names(tmp_path, 0, 1) == [f"ckpt-{i:010d}" for i in range(4, keep + 4)]
    restored, plan = _restore(tmp_path, 0, 1)
    assert plan.checkpoints == {0: written.path}
    assert _state(restored) == _state(store)


# ---- which layout to restore from -------------------------------------------------------------------

LAYOUT_SPEC = VariableSpec("w", (12,), "float32", partitioner=FixedShardsPartitioner(4))


def _write_layout(root, num_shards: int, marker: float, created_unix: float, shards=None) -> None:
    """Checkpoint shards of a job whose global value of "w" is marker + arange(12)."""
    for i in range(num_shards) if shards is None else shards:
        store = _build(i, num_shards, [LAYOUT_SPEC])
        part = store.get("w")
        part.value[:] = marker + np.arange(part.row_start, part.row_end, dtype=np.float32)
        write_checkpoint(root, _snap(store, created_unix=created_unix), keep=3)


def _expected_rows(marker: float, shard: int, num_shards: int) -> np.ndarray:
    part = LAYOUT_SPEC.placement(num_shards).part_on(shard)
    return marker + np.arange(part.row_start, part.row_end, dtype=np.float32)


def test_the_restored_state_holds_ledger_and_steps_only_for_the_same_layout(tmp_path):
    entries = [{"worker_id": "w", "incarnation": "i", "done_below": 4, "done_above": [], "open": {}}]
    consistency = {"mode": "ssp", "step": 3}
    for i, created_unix in enumerate([100.0, 200.0]):
        store = _build(i, 2, [LAYOUT_SPEC])
        write_checkpoint(tmp_path, ShardSnapshot(i, 2, f"server-{i}", store.snapshot(), {"entries": entries},
                                                 created_unix=created_unix, consistency=consistency), keep=3)
    assert load_restore(tmp_path / "missing", 0, 2) is None

    own = load_restore(tmp_path, 1, 2)
    assert not own.resharded and own.from_num_shards == 2
    assert own.ledger_entries == entries and own.consistency == consistency
    assert own.checkpoints == {1: shard_dir(tmp_path, 1, 2) / "ckpt-0000000001"}
    assert own.origin == RestoredFrom({1: "0000000001"}, str(own.checkpoints[1]), 200.0, 2)
    assert [p.spec.name for p in own.parts] == ["w"]

    other = load_restore(tmp_path, 0, 3)
    assert other.resharded and other.from_num_shards == 2
    assert other.ledger_entries == [] and other.consistency is None, "another layout starts afresh"
    assert other.origin == RestoredFrom({0: "0000000001", 1: "0000000001"},
                                        ",".join(str(p) for p in other.checkpoints.values()), 200.0, 2)


def test_a_server_restores_its_own_newer_layout(tmp_path):
    _write_layout(tmp_path, 3, 100.0, 1000.0)
    _write_layout(tmp_path, 2, 200.0, 2000.0)
    for i in range(2):
        store, plan = _restore(tmp_path, i, 2)
        assert plan.num_shards == 2 and list(plan.checkpoints) == [i]
        np.testing.assert_array_equal(store.get("w").value, _expected_rows(200.0, i, 2))
    # A server of 3 reshards from the newer 2-layout rather than restore its own older one.
    for i in range(3):
        store, plan = _restore(tmp_path, i, 3)
        assert plan.num_shards == 2 and sorted(plan.checkpoints) == [0, 1]
        np.testing.assert_array_equal(store.get("w").value, _expected_rows(200.0, i, 3))


def test_an_older_own_layout_loses_to_a_newer_complete_one(tmp_path):
    _write_layout(tmp_path, 2, 100.0, 1000.0)
    _write_layout(tmp_path, 3, 200.0, 2000.0)
    for i in range(2):
        store, plan = _restore(tmp_path, i, 2)
        assert plan.num_shards == 3
        np.testing.assert_array_equal(store.get("w").value, _expected_rows(200.0, i, 2))


def test_an_incomplete_newer_layout_is_ignored_by_the_shards_missing_from_it(tmp_path):
    _write_layout(tmp_path, 3, 100.0, 1000.0)
    _write_layout(tmp_path, 2, 200.0, 2000.0, shards=[0])  # shard 1 of 2 never wrote
    store, plan = _restore(tmp_path, 1, 2)
    assert plan.num_shards == 3 and sorted(plan.checkpoints) == [0, 1, 2]
    np.testing.assert_array_equal(store.get("w").value, _expected_rows(100.0, 1, 2))
    # Shard 0 of 2 has a checkpoint of its own, newer: it uses it.
    store, plan = _restore(tmp_path, 0, 2)
    assert plan.num_shards == 2 and list(plan.checkpoints) == [0]
    np.testing.assert_array_equal(store.get("w").value, _expected_rows(200.0, 0, 2))
    # A server of 4 only considers complete layouts.
    _, plan = _restore(tmp_path, 3, 4)
    assert plan.num_shards == 3


def test_no_checkpoints_means_nothing_to_restore(tmp_path):
    assert find_restore_plan(tmp_path / "missing", 0, 2) is None
    assert find_restore_plan(tmp_path, 0, 2) is None
    (tmp_path / "shard-0-of-2").mkdir()  # a directory without checkpoints
    (tmp_path / "unrelated").mkdir()
    assert find_restore_plan(tmp_path, 0, 2) is None
    # Only an incomplete other layout: nothing usable for a server of 2 ...
    _write_layout(tmp_path, 3, 100.0, 1000.0, shards=[0])
    assert find_restore_plan(tmp_path, 0, 2) is None
    assert find_restore_plan(tmp_path, 1, 3) is None
    # ... but shard 0 of 3 has its own checkpoint.
    _, plan = _restore(tmp_path, 0, 3)
    assert plan.num_shards == 3


def test_a_stale_checkpoint_of_an_earlier_run_is_not_restored(tmp_path):
    """BUG (ps_server/durability/restore.py, find_restore_plan / _newest_time): a layout
    is ranked by the newest checkpoint of *any* of its shards, but each shard
    then loads *its own* newest checkpoint. Sequence: a job ran with 2 shards
    (t=1000), then with 3 (t=2000), then restarts with 2; shard 0 of 2 starts
    first, reshards from the 3-layout and writes its "resharded" checkpoint
    (t=3000). When shard 1 of 2 then starts, the 2-layout looks complete and
    newest (3000), so shard 1 loads its own checkpoint from t=1000 and silently
    rolls its rows back over the whole 3-shard run.
    """
    _write_layout(tmp_path, 2, 100.0, 1000.0)
    _write_layout(tmp_path, 3, 200.0, 2000.0)
    _write_layout(tmp_path, 2, 200.0, 3000.0, shards=[0])  # shard 0 of 2 resharded and wrote
    store, plan = _restore(tmp_path, 1, 2)
    np.testing.assert_array_equal(
        store.get("w").value, _expected_rows(200.0, 1, 2),
        err_msg=f"restored the stale t=1000 checkpoint {plan.checkpoints} instead of the 3-shard state")


# ---- the exactly-once ledger -------------------------------------------------------------------------


def _complete(ledger, worker, incarnation, sequence):
    session = ledger.begin(worker, incarnation, sequence, 4)
    assert session.claim("v", 0, 4) == ClaimResult.APPLY
    assert session.done("v", 0)
    ledger.finish(session)


def _busy_ledger(**limits) -> PushLedger:
    ledger = PushLedger(**limits)
    for seq in (1, 2, 3, 5, 7):  # 4 and 6 missing: out of order
        _complete(ledger, "w0", "inc-a", seq)
    partial = ledger.begin("w0", "inc-a", 6, 20)
    for var, offset, count, step in (("v", 0, 5, 11), ("u", 0, 4, 4), ("v", 10, 5, 11)):
        assert partial.claim_with_step(var, offset, count, lambda s=step: s) == step
        assert not partial.done(var, offset)
    assert ledger.begin("w0", "inc-a", 8, 3) is not None  # open, nothing applied yet
    _complete(ledger, "w1", "inc-b", 1)
    return ledger


def _done_table(ledger):
    return {(w, i, s): ledger.is_done(w, i, s)
            for w, i in (("w0", "inc-a"), ("w1", "inc-b"), ("w0", "other")) for s in range(0, 11)}


def test_ledger_round_trip_through_json():
    ledger = _busy_ledger()
    table = _done_table(ledger)
    assert [s for (w, i, s), done in table.items() if done and w == "w0" and i == "inc-a"] == [0, 1, 2, 3, 5, 7]
    entries = json.loads(json.dumps(ledger.snapshot()))
    restored = PushLedger()
    restored.restore(entries)
    assert _done_table(restored) == table
    assert restored.snapshot() == ledger.snapshot()

    assert restored.begin("w0", "inc-a", 5, 4) is None, "a done push stays a duplicate"
    session = restored.begin("w0", "inc-a", 6, 20)
    assert session is not None and session.key == ("w0", "inc-a", 6)
    assert session.steps == {"v": 11, "u": 4}
    assert session.applied_elements == 14 and not session.complete
    assert session.claim("v", 0, 5) == ClaimResult.ALREADY_APPLIED
    assert session.claim("v", 10, 5) == ClaimResult.ALREADY_APPLIED
    assert session.claim("u", 0, 4) == ClaimResult.ALREADY_APPLIED
    with pytest.raises(RequestError) as info:
        session.claim("v", 3, 5)
    assert info.value.reason == Reason.INVALID_CHUNK
    step = session.claim_with_step("v", 5, 5, lambda: pytest.fail("the reserved step must be reused"))
    assert step == 11
    assert not session.done("v", 5)
    with pytest.raises(RequestError):
        restored.begin("w0", "inc-a", 6, 21)
    assert session.claim("u", 4, 1) == ClaimResult.APPLY
    assert session.done("u", 4) is True, "the restored push completes with its last chunk"
    restored.finish(session)
    assert restored.is_done("w0", "inc-a", 6) and not ledger.is_done("w0", "inc-a", 6)
    # 8 is still open with nothing applied; 4 was never pushed.
    fresh = restored.begin("w0", "inc-a", 8, 3)
    assert fresh.applied_elements == 0 and fresh.steps == {}
    assert [s for s in range(1, 10) if restored.is_done("w0", "inc-a", s)] == [1, 2, 3, 5, 6, 7]


def test_ledger_restore_keeps_the_least_recently_used_order():
    ledger = PushLedger()
    for incarnation in ("a", "b", "c"):
        _complete(ledger, "w", incarnation, 1)
    _complete(ledger, "w", "a", 2)  # order now b, c, a
    restored = PushLedger(max_incarnations=3)
    restored.restore(json.loads(json.dumps(ledger.snapshot())))
    _complete(restored, "w", "d", 1)  # evicts the least recently used: b
    assert [restored.is_done("w", i, 1) for i in ("a", "b", "c", "d")] == [True, False, True, True]


def test_ledger_travels_in_the_checkpoint(tmp_path):
    store = _build(0, 1, SPECS[:1])
    ledger = _busy_ledger()
    checkpointer = Checkpointer(store, ledger, str(tmp_path), "srv", keep=1, interval=0)
    checkpointer.checkpoint("test")
    plan = find_restore_plan(tmp_path, 0, 1)
    manifest = plan.manifests[0]
    assert manifest["server_id"] == "srv"
    restored = PushLedger()
    restored.restore(manifest["ledger"]["entries"])
    assert _done_table(restored) == _done_table(ledger)
    assert restored.begin("w0", "inc-a", 6, 20).claim("v", 0, 5) == ClaimResult.ALREADY_APPLIED


# ---- the checkpointer -------------------------------------------------------------------------------


def _push_store():
    store = VariableStore(0, 1, LIMIT)
    store.create(VariableSpec("a", (6, 2), "float32", initializer=Constant(1.0), optimizer=Adam()))
    store.create(VariableSpec("z", (0, 3), "float32"))
    return store, PushLedger()


def test_checkpoint_only_if_changed(tmp_path):
    store, ledger = _push_store()
    checkpointer = Checkpointer(store, ledger, str(tmp_path), "srv", keep=10, interval=0)
    assert checkpointer.last is None
    first = checkpointer.checkpoint("periodic", only_if_changed=True)
    assert first is not None, "the first checkpoint is always written"
    assert checkpointer.last is first
    assert 0 <= first.pause_seconds <= first.written.write_seconds
    assert checkpointer.checkpoint("periodic", only_if_changed=True) is None
    assert checkpointer.last is first
    assert _ckpt_names(tmp_path, 0, 1) == ["ckpt-0000000001"]

    _push(store, ledger, {"a": np.ones(12, np.float32)}, sequence=1)
    second = checkpointer.checkpoint("periodic", only_if_changed=True)
    assert second is not None and second.written.checkpoint_id == "0000000002"
    assert 0 <= second.pause_seconds <= second.written.write_seconds
    assert checkpointer.checkpoint("periodic", only_if_changed=True) is None
    # An explicit request always writes.
    third = checkpointer.checkpoint("request")
    assert third is not None and third.written.checkpoint_id == "0000000003"

    restored, plan = _restore(tmp_path, 0, 1)
    assert plan.manifests[0]["ledger"]["entries"] == ledger.snapshot()
    assert _state(restored) == _state(store)
    again = Checkpointer(restored, PushLedger(), str(tmp_path), "srv", keep=10, interval=0)
    again.mark_restored()
    assert again.checkpoint("periodic", only_if_changed=True) is None
    _push(restored, ledger, {"a": np.ones(12, np.float32)}, sequence=2)
    assert again.checkpoint("periodic", only_if_changed=True).written.checkpoint_id == "0000000004"


def test_push_of_an_empty_variable_is_checkpointed(tmp_path):
    """BUG (ps_server/core/pushes.py, begin_push, the ``total == 0`` branch): a push
    covering only empty variables finalises at once (version + 1, push done in
    the ledger) but never moves ``store.generation``, so the periodic
    checkpoint (only_if_changed) skips it and a crash forgets both.
    """
    store, ledger = _push_store()
    checkpointer = Checkpointer(store, ledger, str(tmp_path), "srv", keep=10, interval=0)
    checkpointer.checkpoint("periodic", only_if_changed=True)
    result = _push(store, ledger, {"z": np.zeros(0, np.float32)}, sequence=1)
    assert result.versions == {"z": 1} and ledger.is_done("w", "inc", 1)
    assert checkpointer.checkpoint("periodic", only_if_changed=True) is not None, \
        "the version and ledger change of the push is never checkpointed"


def test_checkpoint_waits_for_applies_in_progress(tmp_path):
    store, ledger = _push_store()
    checkpointer = Checkpointer(store, ledger, str(tmp_path), "srv", keep=10, interval=0)
    inside, release = threading.Event(), threading.Event()
    records = []

    def apply_in_progress():
        with store.gate.shared():
            inside.set()
            assert release.wait(10)
            store.get("a").value[:] = 42.0  # a half-applied push the snapshot must not see
            store.generation += 1
            store.get("a").version = 7

    applier = threading.Thread(target=apply_in_progress, daemon=True)
    applier.start()
    assert inside.wait(5)
    writer = threading.Thread(target=lambda: records.append(checkpointer.checkpoint("request")), daemon=True)
    writer.start()
    writer.join(0.2)
    assert writer.is_alive() and not records, "the snapshot must wait for the apply to leave the gate"
    release.set()
    applier.join(5)
    writer.join(5)
    assert not writer.is_alive() and records[0] is not None
    # The pause includes the wait for the gate: at least part of the 0.2 s.
    assert records[0].pause_seconds > 0.1
    restored, _ = _restore(tmp_path, 0, 1)
    assert restored.get("a").version == 7
    np.testing.assert_array_equal(restored.get("a").value, np.full(12, 42.0, np.float32))


def test_last_checkpoint_answers_while_a_write_is_in_progress(tmp_path, monkeypatch):
    """BUG (ps_server/durability/checkpointer.py, Checkpointer.last / checkpoint): one lock
    both serialises checkpoints and guards ``_last``, and checkpoint() holds it
    for the whole disk write; so ``last`` (read by every Describe RPC,
    ps_server/service/builders.py, describe_response) blocks until the write is durable, which for a
    large shard is seconds to minutes: clients connecting meanwhile stall or
    hit their control timeout.
    """
    import ps_server.durability.checkpointer as checkpointer_module

    store, ledger = _push_store()
    checkpointer = Checkpointer(store, ledger, str(tmp_path), "srv", keep=10, interval=0)
    first = checkpointer.checkpoint("request")
    writing, finish = threading.Event(), threading.Event()
    real_write = checkpointer_module.write_checkpoint

    def slow_write(*args, **kwargs):
        writing.set()
        assert finish.wait(10)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(checkpointer_module, "write_checkpoint", slow_write)
    writer = threading.Thread(target=checkpointer.checkpoint, args=("request",), daemon=True)
    writer.start()
    try:
        assert writing.wait(5)
        answers = []
        reader = threading.Thread(target=lambda: answers.append(checkpointer.last), daemon=True)
        reader.start()
        reader.join(1.0)
        assert answers == [first], "checkpointer.last blocked for the duration of a checkpoint write"
    finally:
        finish.set()
        writer.join(5)


def test_periodic_checkpoints_run_when_changed(tmp_path):
    store, ledger = _push_store()
    checkpointer = Checkpointer(store, ledger, str(tmp_path), "srv", keep=10, interval=0.02)
    checkpointer.start_periodic()
    try:
        deadline = time.monotonic() + 5
        while checkpointer.last is None and time.monotonic() < deadline:
            time.sleep(0.01)
        first = checkpointer.last
        assert first is not None
        time.sleep(0.1)  # several intervals without changes
        assert checkpointer.last is first
        _push(store, ledger, {"a": np.ones(12, np.float32)}, sequence=1)
        while checkpointer.last is first and time.monotonic() < deadline:
            time.sleep(0.01)
        assert checkpointer.last is not first
    finally:
        checkpointer.stop_periodic()
    assert _ckpt_names(tmp_path, 0, 1) == ["ckpt-0000000001", "ckpt-0000000002"]


def test_interval_zero_means_no_periodic_thread(tmp_path):
    store, ledger = _push_store()
    checkpointer = Checkpointer(store, ledger, str(tmp_path), "srv", keep=1, interval=0)
    checkpointer.start_periodic()
    assert checkpointer._thread is None
    checkpointer.stop_periodic()
