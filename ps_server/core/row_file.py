"""A hash table's disk tier: fixed-size row records in one file, indexed in memory.

Each record is a row's value, its optimizer slots and its row step count,
at ``slot * record_bytes``. The file is a log: rows are appended, a row
read back or removed leaves a dead record, and once the dead records are as
many as the live ones (and at least 65,536) the live ones are copied, in
order, into a new file that replaces it. The copy runs on a compactor
thread off the owner's lock once the records fill three quarters of the
slots booked (records below the high water are never written again, so the
copy holds whatever the table does meanwhile); the lock is taken only to
install it. One compactor thread serves every table of the process and
never waits long for a table's lock (a request may hold several tables'
locks while a write waits for a copy queued behind): a copy done while its
lock is busy is installed by the next write. A batch that finds no slot
left waits for that copy, or, with none running, compacts in line.
Writing in place was measured at 39 us a random 520-byte record on this
machine's disk, appending at 0.07: rows go out in batches, so the log
writes each batch in one call. What decides about a row without reading it stays in memory,
per slot: its id, last access (LRU), the version and time stamp of its last
update (expiry), whether it changed since the last checkpoint and room for
its id among those removed since: 41 bytes, and the id index's 64 (booked
twice, for its rebuild), per slot; dead records hold slots too until a
compaction and slots double as the file grows, so up to four times that per
live row. The table
books them against the server's memory limit; a disk tier pays where rows
are much larger than that (64 float32 with Adam's two slots: 768 bytes).

Reads and writes are ``pread`` / ``pwrite`` of runs of consecutive slots
(a batch written is one run), issued by one compiled loop per batch (numba calling libc: a system call
per run and nothing else; the Python loop it replaces cost 6 us a record), a
large batch's runs split with a helper thread, as the loop holds no GIL:
the kernel's page cache holds what was written until it writes it back in
the background, and (unlike a memory map) none of it counts in the
process's resident memory. Chosen over LMDB and RocksDB by the benchmark in
benchmarks/bench_tables.py (``disk store``): rows are fixed-size and the
index is already in memory, so a record costs one system call and no
serialisation, where an engine's per-key calls, encoding and its own index
come on top.

Not thread-safe: the owning table's lock guards it. No gRPC here.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ps_server.core.id_index import IdIndex, index_bytes_for
from wehub_ps.kernels.compiled import compiled_soon

__all__ = ["RowFile", "RowRecords", "record_dtype"]


def record_dtype(row_elements: int, dtype: np.dtype, compute_dtype: np.dtype,
                 slot_names: tuple[str, ...]) -> np.dtype:
    """A disk record: the row's value, each optimizer slot, its row step count."""
    fields = [("value", dtype, (row_elements,))]
    fields += [(f"slot:{name}", compute_dtype, (row_elements,)) for name in slot_names]
    fields += [("row_steps", np.int64)]
    return np.dtype(fields)

_LIBC = ctypes.CDLL(None, use_errno=True)
_libc_pread, _libc_pwrite = _LIBC.pread, _LIBC.pwrite
for _call in (_libc_pread, _libc_pwrite):
    _call.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long)
    _call.restype = ctypes.c_ssize_t


def _pread_runs(fd, base, starts, ends, slots, size):  # pragma: no cover - runs compiled
    """Read each run [starts[r], ends[r]) of records at ``slots[starts[r]]`` into ``base``; the first
    run that came back short, or -1."""
    for r in range(starts.size):
        count = (ends[r] - starts[r]) * size
        if _libc_pread(fd, base + starts[r] * size, count, slots[starts[r]] * size) != count:
            return r
    return -1


def _pwrite_runs(fd, base, starts, ends, slots, size):  # pragma: no cover - runs compiled
    """As :func:`_pread_runs`, writing."""
    for r in range(starts.size):
        count = (ends[r] - starts[r]) * size
        if _libc_pwrite(fd, base + starts[r] * size, count, slots[starts[r]] * size) != count:
            return r
    return -1

_libc_pwritev = _LIBC.pwritev
_libc_pwritev.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_long)
_libc_pwritev.restype = ctypes.c_ssize_t
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024


def _write_kept(fd: int, piece: np.ndarray, keep: np.ndarray, at_record: int, path: Path) -> int:
    """Write the records of ``piece`` (rows of bytes) that ``keep`` marks, in order, from record
    ``at_record`` of ``fd`` on: one ``pwritev`` per up to IOV_MAX runs, straight from ``piece`` (no
    copy of the kept records is made first). The number of records written."""
    edges = np.diff(np.concatenate(([0], keep.view(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    size = piece.shape[1]
    vectors = np.empty((len(starts), 2), np.uint64)  # struct iovec: base, length
    vectors[:, 0] = piece.ctypes.data + starts * size
    vectors[:, 1] = (ends - starts) * size
    offset = at_record * size
    for first in range(0, len(vectors), _IOV_MAX):
        batch = vectors[first:first + _IOV_MAX]
        nbytes = int(batch[:, 1].sum())
        if _libc_pwritev(fd, batch.ctypes.data, len(batch), offset) != nbytes:
            error = ctypes.get_errno()
            raise OSError(error, f"{path}: a write while compacting came back short "
                                 f"({os.strerror(error) if error else 'no room?'})")
        offset += nbytes
    return int((ends - starts).sum())


#: From this many runs on, a helper thread issues half of a batch's system calls.
_SHARED_RUNS = 256
_THREADS: dict[str, ThreadPoolExecutor] = {}
_THREADS_LOCK = threading.Lock()


def _thread(name: str) -> ThreadPoolExecutor:
    """One thread per process for each job: "io" shares large batches of reads and writes with the
    caller; "compact" copies row files being compacted in the background (a copy must not hold up
    the reads of a request)."""
    with _THREADS_LOCK:
        if name not in _THREADS:
            _THREADS[name] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ps-row-file-{name}")
        return _THREADS[name]


def _marked(slots: np.ndarray, first: int, end: int) -> np.ndarray:
    """A mask over slots ``first`` to ``end`` with ``slots`` (all within them) set."""
    mask = np.zeros(end - first, bool)
    mask[slots - first] = True
    return mask


def _replace(new: Path, old: Path) -> None:
    """``new`` takes ``old``'s name. Not a rename over it: ext4 then starts writing ``new`` out at once
    (its guard for files replaced by a rename), 0.2 s for a GB with the table's lock held. The row
    file needs no atomic swap: it is never read after a restart."""
    old.unlink(missing_ok=True)
    os.rename(new, old)


def _close_later(fd: int) -> None:
    """Close the descriptor of a replaced row file on the compactor thread: the last close of a
    removed file frees its pages in the page cache (a quarter of a second for 1.6 GB)."""
    _thread("compact").submit(os.close, fd)


#: A compaction starts in the background once the records fill this share of the slots booked (and half
#: of them are dead): it copies while the table serves, before a batch finds no room.
_BACKGROUND_FROM = 0.75
#: The longest the compactor thread waits for a table's lock before leaving the work to the next write.
_LOCK_PATIENCE = 0.05


class _Compaction:
    """A compaction copying the live records below ``high_water`` into a new file, off the owner's lock:
    records below ``high_water`` are never written again (the file only appends), so the copy is
    consistent however the table goes on meanwhile; rows removed meanwhile are copied dead."""

    def __init__(self, path: Path, source: int, keep: np.ndarray) -> None:
        self.path = path
        self.source = source
        self.keep = keep
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        #: Set once the copy is done (or failed: ``error``); ``written`` records are in the new file.
        self.copied = threading.Event()
        self.written = 0
        self.error: BaseException | None = None
        #: Records copied: those live when it started, then those appended meanwhile (``appended``,
        #: the slots of a second round); the live ones below slot ``high_water``.
        self.kept = int(np.count_nonzero(keep))
        self.high_water = len(keep)
        self.appended: list[np.ndarray] = []
        #: A write holds the owner's lock waiting for the copy.
        self.waited = False
        #: Decides who closes the files: the row file was closed (``abandoned``) before the copy was
        #: done (``copied``), and the compactor thread closes both files, or after, and its closer does.
        self.handoff = threading.Lock()
        self.abandoned = False

    def discard(self) -> None:
        os.close(self.fd)
        self.path.unlink(missing_ok=True)

#: Memory per slot of the disk tier's bookkeeping: id, last access, updated version and stamp, changed flag,
#: a removed id (checkpoints by change keep up to one per slot).
SLOT_BYTES = 8 + 8 + 8 + 8 + 1 + 8


class RowRecords:
    """Rows read from or written to the disk tier: ids, values, slots, row steps, each in id order given."""

    def __init__(self, ids: np.ndarray, value: np.ndarray, slots: dict[str, np.ndarray],
                 row_steps: np.ndarray) -> None:
        self.ids, self.value, self.slots, self.row_steps = ids, value, slots, row_steps


#: Slots the bookkeeping starts with.
_MIN_SLOTS = 1024
#: Compaction waits until the dead records are at least this many (and as many as the live ones).
_COMPACT_AT_LEAST = 65536
#: Records copied per piece while compacting: a piece of a few MB stays in the CPU's cache between its
#: read and its write (about half the time of 34 MB pieces on the benchmark's machine).
_COMPACT_PIECE = 8192


class RowFile:
    """The disk tier of one table on one shard (see the module docstring)."""

    def __init__(self, path: Path, row_elements: int, dtype: np.dtype, compute_dtype: np.dtype,
                 slot_names: tuple[str, ...], lock: threading.Lock | None = None) -> None:
        """``lock``: the owner's lock, which guards this file; with it, compactions copy in the
        background and take it only to install the copy (without, every compaction is in line)."""
        self.path = path
        self._lock = lock
        self._background: _Compaction | None = None
        self.slot_names = slot_names
        self.record = record_dtype(row_elements, dtype, compute_dtype, slot_names)
        self.record_bytes = self.record.itemsize
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._index = IdIndex()
        #: Snapshots being written (:meth:`freeze`): no compaction moves a record meanwhile.
        self._frozen = 0
        self.capacity = 0
        #: Records in the file, live or dead: the next write appends here.
        self.high_water = 0
        self.ids = np.empty(0, np.int64)
        self.last_access = np.empty(0, np.int64)
        self.updated_version = np.empty(0, np.int64)
        self.updated_before = np.empty(0, np.float64)
        self.changed = np.empty(0, bool)
        #: Counts for operators and benchmarks: records read and written, seconds spent reading,
        #: compactions and the records they copied.
        self.reads = 0
        self.writes = 0
        self.read_seconds = 0.0
        self.compactions = 0
        self.compacted = 0
        #: Compactions copied off the owner's lock.
        self.background_compactions = 0

    # ---- sizes ----

    def __len__(self) -> int:
        return len(self._index)

    @staticmethod
    def nbytes_for(capacity: int) -> int:
        """Memory for ``capacity`` slots: bookkeeping and the id index (counted twice, as the tables
        count theirs: a rebuild holds the old and new buckets at once)."""
        return capacity * SLOT_BYTES + 2 * index_bytes_for(capacity)

    @property
    def nbytes(self) -> int:
        return self.nbytes_for(self.capacity)

    def capacity_for_more(self, count: int) -> int:
        """The capacity after appending ``count`` records (dead ones count until compacted away)."""
        background = self._background
        if background is not None and self.high_water + count > self.capacity and not self._frozen:
            rows = self._high_water_after(background)  # the write waits for the copy and installs it
        elif self._compacts_for(count):
            rows = len(self)
        else:
            rows = self.high_water
        return self.capacity_for(rows + count)

    def _high_water_after(self, background: _Compaction) -> int:
        """The records the file holds once ``background`` is installed: those it copied and the live
        ones appended since it started."""
        return background.kept + len(self._live_tail(background))

    def _live_tail(self, background: _Compaction) -> np.ndarray:
        """The live slots appended since ``background`` started (ascending)."""
        tail = np.arange(background.high_water, self.high_water, dtype=np.int64)
        return tail[self._index.lookup(self.ids[tail]) == tail]

    def _compacts_for(self, count: int) -> bool:
        """Whether appending ``count`` records compacts the file first: when they do not fit in the
        slots it has (a compaction, not a growth, makes room) and the dead records are as many as the
        live ones. Until then the slots already booked fill up, so each compaction frees as many as
        it can."""
        live = len(self)
        return (not self._frozen and self._background is None and self.high_water + count > self.capacity
                and self.high_water - live >= max(live, _COMPACT_AT_LEAST))

    def capacity_for(self, rows: int) -> int:
        """The capacity holding ``rows`` slots would have (doubling, at least 1,024)."""
        if rows <= self.capacity:
            return self.capacity
        return max(_MIN_SLOTS, 2 * self.capacity, rows)

    @property
    def disk_bytes(self) -> int:
        return self.high_water * self.record_bytes

    # ---- lookups (no I/O) ----

    def slots_of(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id, -1 where it is not on disk."""
        return self._index.lookup(ids)

    def live_slots(self) -> np.ndarray:
        return self._index.live_slots()

    # ---- I/O ----

    def write(self, ids: np.ndarray, records: RowRecords, last_access: np.ndarray, updated_version: np.ndarray,
              updated_before: np.ndarray, changed: np.ndarray) -> None:
        """Append rows of unique ``ids``, none on disk yet, in one run; the caller booked
        :meth:`capacity_for_more` growth. Compacts first when they do not fit and half the file is dead."""
        count = len(ids)
        if not count:
            return
        background = self._background
        if background is not None and not self._frozen:
            if self.high_water + count > self.capacity:
                background.waited = True
                background.copied.wait()  # the copy takes no lock: it finishes while this one is held
            if background.copied.is_set():
                self._install(background)
        if self._compacts_for(count):
            self._compact()
        if self.high_water + count > self.capacity:
            self._grow(self.capacity_for_more(count))
        slots = np.arange(self.high_water, self.high_water + count, dtype=np.int64)
        packed = np.empty(count, self.record)
        packed["value"] = records.value.reshape(count, -1)
        for name in self.slot_names:
            packed[f"slot:{name}"] = records.slots[name].reshape(count, -1)
        packed["row_steps"] = records.row_steps
        self._runs(_pwrite_runs, os.pwritev, packed.view(np.uint8).reshape(-1), slots)
        self.ids[slots] = ids
        self.last_access[slots] = last_access
        self.updated_version[slots] = updated_version
        self.updated_before[slots] = updated_before
        self.changed[slots] = changed
        self._index.insert(ids, slots)
        self.high_water += count
        self.writes += count
        self._maybe_compact_in_background()

    def read(self, slots: np.ndarray) -> np.ndarray:
        """The records at ``slots`` (any order), as a structured array in that order."""
        started = time.perf_counter()
        out = self._read(slots)
        self.reads += len(slots)
        self.read_seconds += time.perf_counter() - started
        return out

    def _read(self, slots: np.ndarray) -> np.ndarray:
        out = np.empty(len(slots), self.record)
        if not len(slots):
            return out
        order = np.argsort(slots, kind="stable")
        raw = self._read_sorted(slots[order])
        placed = np.empty_like(raw)
        placed[order] = raw  # rows of bytes: a structured array's scatter copies field by field
        return placed.view(self.record).reshape(-1)

    def _read_sorted(self, sorted_slots: np.ndarray) -> np.ndarray:
        """The records at ascending ``sorted_slots``, as rows of bytes, read straight into place."""
        raw = np.empty((len(sorted_slots), self.record_bytes), np.uint8)
        self._runs(_pread_runs, os.preadv, raw.reshape(-1), sorted_slots)
        return raw

    def remove(self, slots: np.ndarray) -> None:
        """Forget the rows at ``slots``: their records are dead until a compaction drops them."""
        if len(slots):
            self._index.remove(self.ids[slots])

    def freeze(self) -> None:
        """A snapshot holds the live slots: no compaction moves them until :meth:`thaw` (the owner's
        lock held). Writes append, so nothing a snapshot holds is ever overwritten."""
        self._frozen += 1

    def thaw(self) -> None:
        """The snapshot is written: compaction may move records again."""
        self._frozen -= 1

    def read_records(self, slots: np.ndarray) -> np.ndarray:
        """:meth:`read` without touching the counters: for a snapshot's writer, beside the table."""
        return self._read(slots)

    def _compact(self) -> None:
        """Copy the live records, in slot order, into a new file and drop the dead ones (as many as
        the live ones at least), in line: each record is copied at most once per time the file
        doubles, so a write costs O(1) amortized, appended and copied sequentially rather than written
        in place."""
        copy = self._new_compaction()
        self._take_copy(copy, copy.keep, 0, np.flatnonzero(copy.keep))

    def _new_compaction(self) -> _Compaction:
        """A compaction of the records live now, its new file opened beside this one."""
        live = _marked(self._index.live_slots(), 0, self.high_water)
        return _Compaction(self.path.with_name(self.path.name + ".compacting"), self._fd, live)

    def _maybe_compact_in_background(self) -> None:
        """Start a compaction on the compactor thread once the records fill ``_BACKGROUND_FROM`` of the
        slots and half of them are dead (lock held); it takes the owner's lock only to install."""
        live = len(self)
        if (self._lock is None or self._background is not None or self._frozen
                or self.high_water < _BACKGROUND_FROM * self.capacity
                or self.high_water - live < max(live, _COMPACT_AT_LEAST)):
            return
        background = self._background = self._new_compaction()
        _thread("compact").submit(self._copy_in_background, background)

    def _copy_in_background(self, background: _Compaction) -> None:
        try:
            background.written = self._copy_kept(background.source, background.fd, background.keep, 0, 0,
                                                 background.path)
            self._copy_appended(background)
        except BaseException as error:  # kept for the installer: it discards the copy
            background.error = error
        with background.handoff:
            background.copied.set()
            abandoned = background.abandoned
        if abandoned:  # the row file was closed meanwhile
            background.discard()
            os.close(background.source)
            return
        # Installed here when the lock comes free soon, otherwise by the next write.
        if self._lock_briefly(background):
            try:
                if self._background is background and not self._frozen:
                    self._install(background)
            finally:
                self._lock.release()

    def _lock_briefly(self, background: _Compaction) -> bool:
        """Take the owner's lock on the compactor thread, or give up after ``_LOCK_PATIENCE`` s (at once
        when a write holds it waiting for ``background``). The thread never waits longer: the lock's
        holder may wait for a copy queued behind this one (another table's, when a request locks
        several tables, or this table's next one)."""
        assert self._lock is not None
        deadline = time.monotonic() + _LOCK_PATIENCE
        while not self._lock.acquire(timeout=0.005):
            if background.waited or time.monotonic() > deadline:
                return False
        return True

    def _copy_appended(self, background: _Compaction) -> None:
        """A second round off the lock: the live records appended while the first copied, so that
        installing copies only those appended since. Skipped when the lock is not free at once (a
        write may hold it, waiting for this copy)."""
        assert self._lock is not None
        if not self._lock.acquire(timeout=0.01):
            return
        try:
            if background.abandoned or self._background is not background:
                return
            tail = self._live_tail(background)
            first, end = background.high_water, self.high_water
        finally:
            self._lock.release()
        written = self._copy_kept(background.source, background.fd, _marked(tail, first, end), first,
                                  background.written, background.path)
        # Published under the lock (installing and the capacity forecast go by it); when the lock is
        # not had soon, installing copies these records again, over these.
        if not self._lock_briefly(background):
            return
        try:
            background.appended.append(tail)
            background.high_water = end
            background.kept += written
            background.written += written
        finally:
            self._lock.release()

    def _install(self, background: _Compaction) -> None:
        """The copied file replaces this one (lock held): the live records appended since the copy
        started are copied after it, and every slot is renumbered."""
        self._background = None
        if background.error is not None:
            background.discard()
            return
        tail = self._live_tail(background)
        appended = _marked(tail, background.high_water, self.high_water)
        self._take_copy(background, appended, background.high_water,
                        np.concatenate([np.flatnonzero(background.keep), *background.appended, tail]))
        self.background_compactions += 1

    def _take_copy(self, copy: _Compaction, keep: np.ndarray, first: int, kept: np.ndarray) -> None:
        """Copy the records ``keep`` marks from slot ``first`` on after those ``copy`` holds, and make
        it this file (lock held); ``kept``: every slot copied, ascending, for the renumbering."""
        try:
            self._copy_kept(self._fd, copy.fd, keep, first, copy.written, copy.path)
            _replace(copy.path, self.path)
        except BaseException:
            copy.discard()
            raise
        _close_later(self._fd)
        self._fd = copy.fd
        self._moved(kept)

    def _moved(self, kept: np.ndarray) -> None:
        """The records at ascending ``kept`` slots now lie at 0, 1, ...: renumber the bookkeeping."""
        count = len(kept)
        for name in ("ids", "last_access", "updated_version", "updated_before", "changed"):
            arr = getattr(self, name)
            arr[:count] = arr[kept]  # kept is ascending and kept[i] >= i: a forward move
        renumbered = np.full(self.high_water, -1, np.int64)
        renumbered[kept] = np.arange(count, dtype=np.int64)
        self._index.renumber(renumbered)
        self.high_water = count
        self.compactions += 1
        self.compacted += count

    @property
    def compacting(self) -> bool:
        """A compaction is copying in the background, or waits to be installed."""
        return self._background is not None

    def _copy_kept(self, source: int, target: int, keep: np.ndarray, first: int, at: int,
                   target_path: Path) -> int:
        """Copy the records of ``source`` from slot ``first`` on that ``keep`` marks, in order, to
        ``target`` from record ``at`` on; the records copied. The file is read in sequential pieces and
        the kept records written from them (dead ones are interleaved: reading live runs one by one
        was a system call per two records). Uses nothing of this object's state but its record size."""
        size = self.record_bytes
        buffer = np.empty((min(_COMPACT_PIECE, max(1, len(keep))), size), np.uint8)
        written = 0
        for offset in range(0, len(keep), _COMPACT_PIECE):
            piece = buffer[:min(_COMPACT_PIECE, len(keep) - offset)]
            if os.preadv(source, [piece], (first + offset) * size) != piece.nbytes:
                raise OSError(f"{self.path}: records {first + offset}.. came back short while compacting")
            written += _write_kept(target, piece, keep[offset:offset + len(piece)], at + written, target_path)
        return written

    def _runs(self, loop, fallback, raw: np.ndarray, sorted_slots: np.ndarray) -> None:
        """Read or write ``raw`` (records in slot order) at ``sorted_slots``, one call per run of
        consecutive slots: in the compiled loop once it is ready, else one Python call per run."""
        breaks = np.flatnonzero(np.diff(sorted_slots) != 1) + 1
        starts = np.concatenate([[0], breaks]).astype(np.int64)
        ends = np.concatenate([breaks, [len(sorted_slots)]]).astype(np.int64)
        size = self.record_bytes
        fast = compiled_soon(loop, cache=False)  # it calls libc through ctypes: nothing to cache
        if fast is None:
            self._python_runs(fallback, raw, sorted_slots, starts, ends)
            return
        # Many runs (a batch of cold rows): a helper thread issues the second half meanwhile, as the
        # loop holds no GIL; the system calls, not the copies, are the cost.
        split = len(starts) // 2 if len(starts) >= _SHARED_RUNS else len(starts)
        helper = (_thread("io").submit(fast, self._fd, raw.ctypes.data, starts[split:], ends[split:],
                                       sorted_slots, size) if split < len(starts) else None)
        pieces = [(fast(self._fd, raw.ctypes.data, starts[:split], ends[:split], sorted_slots, size), 0, split)]
        if helper is not None:
            pieces.append((helper.result(), split, len(starts)))
        for short, first, end in pieces:
            if short >= 0:  # again in Python from the run that failed: its OSError names the cause
                self._python_runs(fallback, raw, sorted_slots, starts[first + short:end], ends[first + short:end])

    def _python_runs(self, call, raw: np.ndarray, sorted_slots: np.ndarray, starts: np.ndarray,
                     ends: np.ndarray) -> None:
        """:meth:`_runs` one ``os.preadv`` / ``os.pwritev`` per run (before the compiled loop is ready)."""
        size = self.record_bytes
        view = memoryview(raw)
        for start, end in zip(starts.tolist(), ends.tolist()):
            count = (end - start) * size
            if call(self._fd, [view[start * size:end * size]], int(sorted_slots[start]) * size) != count:
                raise OSError(f"{self.path}: a {call.__name__} of {end - start} records at record "
                              f"{sorted_slots[start]} came back short (end of file)")

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        """Close and delete the file (the rows live on in checkpoints, not here). The owner's lock is
        held: a compaction copying in the background closes the files it reads and writes itself."""
        if self._fd >= 0:
            background, self._background = self._background, None
            copying = False
            if background is not None:
                with background.handoff:
                    copying = background.abandoned = not background.copied.is_set()
                if not copying:
                    background.discard()
            if not copying:  # else the compactor thread still reads self._fd: it closes it
                os.close(self._fd)
            self._fd = -1
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def _grow(self, capacity: int) -> None:
        old = self.capacity

        def grown(arr: np.ndarray) -> np.ndarray:
            out = np.zeros(capacity, arr.dtype)
            out[:old] = arr[:old]
            return out

        self.ids, self.last_access = grown(self.ids), grown(self.last_access)
        self.updated_version, self.updated_before = grown(self.updated_version), grown(self.updated_before)
        self.changed = grown(self.changed)
        self.capacity = capacity
        self._index.reserve(capacity)
