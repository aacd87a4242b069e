"""Hash tables with a disk tier: the same bits as a table held in memory, memory bounded by the budget."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ps_server.core import row_file
from ps_server.core.errors import RequestError
from ps_server.core.tables import HashTablePart, read_tables_rows
from ps_server.ops.disk_tier import DiskTierDirectory
from wehub_ps.errors import Reason
from wehub_ps.specs import Adam, Admission, DiskTier, Expiry, Uniform, VariableSpec


class Reserve:
    def __init__(self) -> None:
        self.total = 0
        self.peak = 0

    def __call__(self, delta: int) -> None:
        self.total += delta
        self.peak = max(self.peak, self.total)


def _pair(tmp_path, memory_rows=64, **spec_kwargs) -> tuple[HashTablePart, HashTablePart]:
    """A table held in memory and the same table with a disk tier."""
    base = {"initializer": Uniform(seed=2), "optimizer": Adam(0.01), "hash_table": True}
    base.update(spec_kwargs)
    plain = HashTablePart(VariableSpec("t", (8,), "float32", **base), base.get("max_rows", 0), Reserve())
    tiered_spec = VariableSpec("t", (8,), "float32", tier=DiskTier(memory_rows), **base)
    tiered = HashTablePart(tiered_spec, base.get("max_rows", 0), Reserve(), tmp_path / "t.rows")
    return plain, tiered


def _same(a: HashTablePart, b: HashTablePart) -> None:
    sa, sb = a.rows_snapshot(), b.rows_snapshot()
    assert sorted(sa) == sorted(sb)
    for key in sa:
        assert sa[key].tobytes() == sb[key].tobytes(), key
    assert (a.num_rows, a.evicted_rows, a.version, a.policy_counts.expired_rows) == \
        (b.num_rows, b.evicted_rows, b.version, b.policy_counts.expired_rows)


def _step(tables, ids: np.ndarray, grads: np.ndarray) -> list[np.ndarray]:
    pulled = []
    for table in tables:
        pulled.append(read_tables_rows([(table, ids)], table.reserve)[0])
        table.apply_rows(ids, grads)
        table.finish_push()
    return pulled


@pytest.fixture
def small_compactions(monkeypatch):
    """Compact the row file once 64 records are dead (65,536 otherwise) and a batch does not fit in 16
    slots or more (1,024): compaction runs in these tests, reading the file in several pieces and
    writing each piece's records in several calls."""
    monkeypatch.setattr(row_file, "_COMPACT_AT_LEAST", 64)
    monkeypatch.setattr(row_file, "_MIN_SLOTS", 16)
    monkeypatch.setattr(row_file, "_COMPACT_PIECE", 50)
    monkeypatch.setattr(row_file, "_IOV_MAX", 3)


@pytest.mark.parametrize("compactions", ["in the background", "in line"])
def test_a_tiered_table_holds_the_same_bits_as_one_in_memory(tmp_path, small_compactions, monkeypatch,
                                                              compactions):
    if compactions == "in line":
        monkeypatch.setattr(row_file, "_BACKGROUND_FROM", 10.0)  # never
    plain, tiered = _pair(tmp_path, memory_rows=64, max_rows=600, eviction="lru",
                          admission=Admission(min_count=2, probability=0.9, counters=512),
                          expiry=Expiry(steps=20))
    rng = np.random.default_rng(5)
    for step in range(300):
        ids = np.unique(rng.zipf(1.05, 40) % 5000).astype(np.int64)
        grads = rng.standard_normal((len(ids), 8)).astype(np.float32)
        pulled = _step((plain, tiered), ids, grads)
        assert pulled[0].tobytes() == pulled[1].tobytes(), step
        assert len(tiered._index) <= 64 and tiered.capacity <= 64
        if step % 25 == 24:
            removed = plain.sweep(float(step))[0]
            assert removed.tolist() == tiered.sweep(float(step))[0].tolist()
            _same(plain, tiered)
    assert len(tiered.disk) > 300 and tiered.policy_counts.cold_reads > 0
    disk = tiered.disk
    assert disk.compactions > 0 and disk.high_water <= disk.capacity
    assert (disk.background_compactions > 0) == (compactions == "in the background")
    assert os.path.getsize(disk.path) >= disk.high_water * disk.record_bytes
    assert plain.evicted_rows > 0 and plain.policy_counts.expired_rows > 0
    _same(plain, tiered)
    every_id = np.arange(5000, dtype=np.int64)
    assert tiered.lookup_rows(every_id, zeros=False).tobytes() == plain.lookup_rows(every_id, zeros=False).tobytes()
    assert _exported(tiered) == _exported(plain)


def _exported(table: HashTablePart) -> dict[int, bytes]:
    out = {}
    for ids, rows in table.export_rows(100):
        out.update({i: row.tobytes() for i, row in zip(ids.tolist(), rows)})
    return out


def test_memory_stays_at_the_budget_while_the_table_grows_on_disk(tmp_path):
    _, tiered = _pair(tmp_path, memory_rows=256)
    created = tiered.nbytes  # what the store books when it creates the table
    rng = np.random.default_rng(0)
    for start in range(0, 256 * 20, 128):
        ids = np.arange(start, start + 128, dtype=np.int64)
        _step((tiered,), ids, rng.standard_normal((128, 8)).astype(np.float32))
    assert tiered.num_rows == 256 * 20 and len(tiered._index) == 256
    memory = tiered.capacity * tiered.row_bytes
    disk_bookkeeping = tiered.disk.nbytes
    assert created + tiered.reserve.total == tiered.nbytes  # every growth booked, on disk too
    # Per slot on disk: 41 bytes of bookkeeping and the id index (64, booked twice for its rebuild).
    assert disk_bookkeeping == tiered.disk.capacity * (41 + 128) and memory == 256 * (8 * 12 + 59)
    assert os.path.getsize(tiered.disk.path) == tiered.disk.disk_bytes >= (256 * 19) * tiered.disk.record_bytes
    assert tiered.disk.high_water == len(tiered.disk)  # rows only ever went out: no dead record


def test_a_request_larger_than_the_memory_budget_is_refused_and_changes_nothing(tmp_path):
    _, tiered = _pair(tmp_path, memory_rows=16)
    _step((tiered,), np.arange(16, dtype=np.int64), np.ones((16, 8), np.float32))
    before = {k: v.tobytes() for k, v in tiered.rows_snapshot().items()}
    with pytest.raises(RequestError) as refused:
        read_tables_rows([(tiered, np.arange(100, 120, dtype=np.int64))], tiered.reserve)
    assert refused.value.reason == Reason.MEMORY_LIMIT and "memory_rows (16)" in refused.value.message
    assert {k: v.tobytes() for k, v in tiered.rows_snapshot().items()} == before


def test_read_only_lookups_do_not_bring_rows_back(tmp_path):
    _, tiered = _pair(tmp_path, memory_rows=8)
    _step((tiered,), np.arange(8, dtype=np.int64), np.ones((8, 8), np.float32))
    _step((tiered,), np.arange(8, 16, dtype=np.int64), np.ones((8, 8), np.float32))
    assert len(tiered.disk) == 8
    values = tiered.lookup_rows(np.arange(8, dtype=np.int64), zeros=True)
    assert len(tiered.disk) == 8 and tiered.disk.reads == 8
    assert not (values == 0).all(axis=1).any()  # rows, not the zeros of missing ones


def test_a_restore_puts_the_rows_beyond_the_budget_on_disk(tmp_path):
    plain, tiered = _pair(tmp_path, memory_rows=32)
    rng = np.random.default_rng(1)
    for start in range(0, 200, 20):
        ids = np.arange(start, start + 20, dtype=np.int64)
        _step((plain, tiered), ids, rng.standard_normal((20, 8)).astype(np.float32))
    snap = plain.snapshot()
    _, restored = _pair(tmp_path / "r", memory_rows=32)
    restored.load_rows(snap.rows, snap.version, snap.optimizer_steps, snap.evicted_rows, snap.access_clock,
                       snap.policy_counts)
    assert len(restored._index) == 32 and len(restored.disk) == 168
    # The most recently used rows are the ones kept in memory.
    assert set(restored._index.items()[0].tolist()) == set(range(168, 200))
    _same(plain, restored)
    ids = np.arange(0, 50, dtype=np.int64)[::3]
    grads = rng.standard_normal((len(ids), 8)).astype(np.float32)
    pulled = _step((plain, restored), ids, grads)
    assert pulled[0].tobytes() == pulled[1].tobytes()
    _same(plain, restored)


def test_a_disk_tier_without_a_directory_is_refused():
    with pytest.raises(RequestError) as refused:
        HashTablePart(VariableSpec("t", (4,), "float32", hash_table=True, tier=DiskTier(10)), 0, Reserve())
    assert refused.value.reason == Reason.DISK_TIER_DISABLED and "--disk-tier-dir" in refused.value.message


def test_a_server_removes_the_row_files_of_servers_that_stopped(tmp_path):
    running = DiskTierDirectory(tmp_path, "a")
    crashed = DiskTierDirectory(tmp_path, "b")
    crashed.file_for("t/x:y").write_bytes(b"rows")
    os.close(crashed._lock_fd)  # its process died: the lock is gone, the files stayed
    assert (tmp_path / "b").exists()
    starting = DiskTierDirectory(tmp_path, "c")
    assert starting.removed_stale == 1
    assert not (tmp_path / "b").exists() and (tmp_path / "a").exists()
    assert running.file_for("t/x:y") != running.file_for("t/x:y")  # a new file per table instance
    running.close()
    starting.close()
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


def test_an_export_finds_rows_that_moved_between_its_pieces(tmp_path, small_compactions):
    _, tiered = _pair(tmp_path, memory_rows=8)
    for start in range(0, 200, 8):
        _step((tiered,), np.arange(start, start + 8, dtype=np.int64), np.ones((8, 8), np.float32))
    expected = {i: row.tobytes() for i, row in zip(range(200), tiered.lookup_rows(np.arange(200, dtype=np.int64),
                                                                                   zeros=True))}
    pieces = tiered.export_rows(3)
    exported = {}
    compactions = tiered.disk.compactions
    for n, (ids, rows) in enumerate(pieces):
        exported.update({i: row.tobytes() for i, row in zip(ids.tolist(), rows)})
        # Reads move rows between memory and disk (and compact the file) while the export goes on.
        read_tables_rows([(tiered, np.arange(n * 8 % 200, n * 8 % 200 + 8, dtype=np.int64))], tiered.reserve)
    assert exported == expected
    assert tiered.disk.compactions > compactions


@pytest.mark.parametrize("loops", ["python", "compiled, shared with the helper thread"])
def test_the_row_file_reads_back_what_it_wrote_in_any_order(tmp_path, monkeypatch, loops):
    from wehub_ps.kernels.compiled import compiled

    if loops == "python":
        monkeypatch.setattr(row_file, "compiled_soon", lambda *args, **kwargs: None)
    else:
        pytest.importorskip("numba")
        for loop in (row_file._pread_runs, row_file._pwrite_runs):
            assert compiled(loop, cache=False) is not None
        monkeypatch.setattr(row_file, "_SHARED_RUNS", 4)  # every batch here has more runs
    disk = row_file.RowFile(tmp_path / "t.rows", 8, np.dtype(np.float32), np.dtype(np.float32), ("m",))
    rng = np.random.default_rng(3)
    values = {}
    for batch in range(4):
        ids = np.arange(batch * 500, batch * 500 + 500, dtype=np.int64)
        value = rng.standard_normal((500, 8)).astype(np.float32)
        slot = rng.standard_normal((500, 8)).astype(np.float32)
        steps = rng.integers(0, 99, 500)
        disk.write(ids, row_file.RowRecords(ids, value, {"m": slot}, steps), steps, steps,
                   steps.astype(np.float64), np.zeros(500, bool))
        values.update({int(i): (value[k], slot[k], steps[k]) for k, i in enumerate(ids)})
    wanted = rng.permutation(2000)[:700].astype(np.int64)  # scattered: hundreds of runs
    records = disk.read(disk.slots_of(wanted))
    for k, i in enumerate(wanted.tolist()):
        value, slot, steps = values[i]
        assert records["value"][k].tobytes() == value.tobytes()
        assert records["slot:m"][k].tobytes() == slot.tobytes() and records["row_steps"][k] == steps

    os.truncate(tmp_path / "t.rows", 1000 * disk.record_bytes)  # the file lost its end
    with pytest.raises(OSError, match="came back short"):
        disk.read(disk.slots_of(wanted))
    disk.close()


def test_rows_asked_for_again_stay_in_memory_while_one_off_rows_go_to_disk(tmp_path):
    _, tiered = _pair(tmp_path, memory_rows=64)
    again = np.arange(24, dtype=np.int64)
    for _ in range(2):  # pulled and pushed twice: asked for again
        _step((tiered,), again, np.ones((24, 8), np.float32))
    for k in range(10):  # 80 rows pulled and pushed once: memory overflows
        one_off = np.arange(1000 + 8 * k, 1008 + 8 * k, dtype=np.int64)
        _step((tiered,), one_off, np.ones((8, 8), np.float32))
    in_memory = tiered._index.lookup(again) >= 0
    assert in_memory.all(), np.flatnonzero(~in_memory)  # least recently used, but kept
    assert len(tiered._index) <= 64 and len(tiered.disk) == 24 + 80 - len(tiered._index)
    newest = np.arange(1072, 1080, dtype=np.int64)
    assert (tiered._index.lookup(newest) >= 0).all()  # the most recent rows stay too


@pytest.fixture
def held_copies(monkeypatch):
    """Background compactions copy nothing until the event this returns is set (10 s at most)."""
    import threading

    release = threading.Event()
    copy = row_file.RowFile._copy_kept

    def held_copy(self, source, *args):
        if threading.current_thread().name.startswith("ps-row-file-compact"):
            assert release.wait(10)
        return copy(self, source, *args)

    monkeypatch.setattr(row_file.RowFile, "_copy_kept", held_copy)
    return release


def _row_file_with_dead_records(tmp_path, lock) -> tuple[row_file.RowFile, dict[int, bytes]]:
    """A row file of 96 records, 64 of them dead: the next write compacts it (small_compactions)."""
    disk = row_file.RowFile(tmp_path / "t.rows", 8, np.dtype(np.float32), np.dtype(np.float32), ("m",), lock)
    rng = np.random.default_rng(1)
    values = {}
    for start in range(0, 96, 32):
        ids = np.arange(start, start + 32, dtype=np.int64)
        value = rng.standard_normal((32, 8)).astype(np.float32)
        zeros = np.zeros(32, np.int64)
        with lock:
            disk.write(ids, row_file.RowRecords(ids, value, {"m": value}, zeros), zeros, zeros,
                       zeros.astype(np.float64), np.zeros(32, bool))
        values.update({int(i): value[k].tobytes() for k, i in enumerate(ids)})
    with lock:
        disk.remove(disk.slots_of(np.arange(0, 64, dtype=np.int64)))
    return disk, {i: v for i, v in values.items() if i >= 64}


def _held(disk: row_file.RowFile, lock) -> dict[int, bytes]:
    with lock:
        ids = disk.ids[disk.live_slots()]
        records = disk.read(disk.slots_of(ids))
    return {int(i): records["value"][k].tobytes() for k, i in enumerate(ids)}


def _write_rows(disk: row_file.RowFile, lock, ids: np.ndarray, values: dict[int, bytes]) -> None:
    value = np.full((len(ids), 8), 7.0, np.float32)
    zeros = np.zeros(len(ids), np.int64)
    with lock:
        disk.write(ids, row_file.RowRecords(ids, value, {"m": value}, zeros), zeros, zeros,
                   zeros.astype(np.float64), np.zeros(len(ids), bool))
    values.update({int(i): value[0].tobytes() for i in ids})


def test_a_compaction_copied_in_the_background_keeps_rows_written_and_removed_meanwhile(
        tmp_path, small_compactions, held_copies):
    import threading

    lock = threading.Lock()
    release = held_copies
    disk, expected = _row_file_with_dead_records(tmp_path, lock)
    _write_rows(disk, lock, np.arange(200, 204, dtype=np.int64), expected)  # starts the copy
    assert disk.compacting and disk.compactions == 0
    _write_rows(disk, lock, np.arange(300, 306, dtype=np.int64), expected)  # appended meanwhile
    with lock:
        disk.remove(disk.slots_of(np.array([70, 301], np.int64)))  # removed meanwhile: one copied, one not
    del expected[70], expected[301]
    assert _held(disk, lock) == expected
    release.set()
    for _ in range(200):
        if not disk.compacting:
            break
        threading.Event().wait(0.05)
    assert disk.background_compactions == 1 and disk.high_water < 96 + 10
    assert _held(disk, lock) == expected
    assert not (tmp_path / "t.rows.compacting").exists()
    with lock:
        disk.close()


def test_a_copy_done_under_a_lock_held_elsewhere_does_not_hold_up_the_next_copy(
        tmp_path, small_compactions, monkeypatch):
    """A request locks several tables at once; one compactor thread serves them all. A copy finished
    while its table's lock is held must not make the thread wait for that lock: the holder may be
    waiting, in a write to another table, for that table's copy queued behind it."""
    import threading

    first_lock, second_lock = threading.Lock(), threading.Lock()
    release = threading.Event()
    copy = row_file.RowFile._copy_kept

    def held_copy(self, source, *args):
        if self._lock is first_lock and threading.current_thread().name.startswith("ps-row-file-compact"):
            assert release.wait(10)
        return copy(self, source, *args)

    monkeypatch.setattr(row_file.RowFile, "_copy_kept", held_copy)
    first, first_rows = _row_file_with_dead_records(tmp_path / "a", first_lock)
    second, second_rows = _row_file_with_dead_records(tmp_path / "b", second_lock)
    _write_rows(first, first_lock, np.arange(200, 204, dtype=np.int64), first_rows)  # starts the first copy
    assert first.compacting
    with first_lock:  # a request holding both tables
        copied = first._background.copied
        release.set()
        assert copied.wait(10)  # done: installing it needs the lock held here
        _write_rows(second, second_lock, np.arange(200, 204, dtype=np.int64), second_rows)  # the second copy
        room = second.capacity - second.high_water + 1  # the next write waits for that copy
        writer = threading.Thread(target=_write_rows, daemon=True, args=(
            second, second_lock, np.arange(300, 300 + room, dtype=np.int64), second_rows))
        writer.start()
        writer.join(10)
        assert not writer.is_alive(), "the write to the second table waits for ever"
        assert first.compactions == 0 and first.compacting  # left for the next write
    assert second.background_compactions == 1 and _held(second, second_lock) == second_rows
    _write_rows(first, first_lock, np.arange(210, 212, dtype=np.int64), first_rows)  # installs the first
    assert first.background_compactions == 1 and not first.compacting
    assert _held(first, first_lock) == first_rows
    for disk, lock in ((first, first_lock), (second, second_lock)):
        with lock:
            disk.close()
    assert not list(tmp_path.rglob("*.rows*"))


def test_a_row_file_closed_while_compacting_in_the_background_leaves_no_file_or_descriptor(
        tmp_path, small_compactions, held_copies):
    import threading

    lock = threading.Lock()
    release = held_copies
    row_file._thread("compact").submit(lambda: None).result()  # earlier tests' files are closed
    descriptors = len(os.listdir("/proc/self/fd"))
    disk, expected = _row_file_with_dead_records(tmp_path, lock)
    _write_rows(disk, lock, np.arange(200, 204, dtype=np.int64), expected)
    assert disk.compacting
    with lock:
        disk.close()  # the table is dropped while the copy goes on
    release.set()
    for _ in range(200):
        if not (tmp_path / "t.rows.compacting").exists() and len(os.listdir("/proc/self/fd")) == descriptors:
            break
        threading.Event().wait(0.05)
    assert not (tmp_path / "t.rows.compacting").exists() and not (tmp_path / "t.rows").exists()
    assert len(os.listdir("/proc/self/fd")) == descriptors


def test_a_background_compaction_waits_for_a_snapshot_being_written(tmp_path, small_compactions, held_copies):
    import threading

    lock = threading.Lock()
    release = held_copies
    disk, expected = _row_file_with_dead_records(tmp_path, lock)
    with lock:
        disk.freeze()  # a checkpoint streams the records by slot
        slots = disk.slots_of(np.array(sorted(expected), np.int64))
    _write_rows(disk, lock, np.arange(200, 204, dtype=np.int64), expected)
    assert not disk.compacting  # none starts while frozen
    with lock:
        assert disk.read_records(slots)["value"].tobytes() == b"".join(
            expected[i] for i in sorted(expected) if i < 200)
        disk.thaw()
    _write_rows(disk, lock, np.arange(210, 214, dtype=np.int64), expected)  # starts one now
    with lock:
        assert disk.compacting
        disk.freeze()  # frozen while it copies: it is installed only after the thaw
        copied = disk._background.copied
    release.set()
    assert copied.wait(10)
    threading.Event().wait(0.2)  # the compactor thread had its chance to install
    assert disk.compactions == 0 and disk.compacting and _held(disk, lock) == expected
    with lock:
        disk.thaw()
    _write_rows(disk, lock, np.arange(220, 224, dtype=np.int64), expected)  # installs it
    assert disk.compactions == 1 and not disk.compacting and _held(disk, lock) == expected
    with lock:
        disk.close()
