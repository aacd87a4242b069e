"""Catch-up snapshots: a checkpoint of the primary, sent to a backup file by file.

A backup that starts (or restarts) is sent the primary's state as of one
sequence of its log, in the checkpoint format (``ps_server.durability``),
then every record after that sequence. The snapshot is taken in the same
hold of the order lock as the backup's attachment to the log, so nothing
falls between them; it is written to a private directory with the lock
released and removed once sent.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ps_server.core.consistency import ConsistencyController
from ps_server.core.ledger import PushLedger
from ps_server.core.store import VariableStore
from ps_server.durability.restore import RestoredState, load_restore
from ps_server.durability.writer import ShardSnapshot, write_checkpoint
from wehub_ps.v1 import ps_pb2

__all__ = ["SNAPSHOT_PIECE_BYTES", "SnapshotReceiver", "SnapshotSender", "take_snapshot"]

#: Bytes of a file per message (1 MiB: the chunk size gRPC Python streams fastest, see docs/benchmarks.md).
SNAPSHOT_PIECE_BYTES = 1 << 20


def take_snapshot(store: VariableStore, ledger: PushLedger, consistency: ConsistencyController,
                  server_id: str) -> ShardSnapshot:
    """The shard's state in one instant (the caller holds the log's order lock).

    Sync mode leaves unfinished pushes out of the ledger, as a checkpoint
    does: their gradients are staged in the primary's memory only, so the
    backup must take a retry of one whole, not as the rest of its claims.
    """
    with store.gate.exclusive():
        return ShardSnapshot(store.shard_index, store.num_shards, server_id, store.snapshot(stream_disk=True),
                             {"entries": ledger.snapshot(consistency.mode != "sync")},
                             consistency=consistency.snapshot())


def _private_directory(prefix: str, parent: str | None) -> Path:
    if parent is not None:
        os.makedirs(parent, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


class SnapshotSender:
    """Writes a snapshot to a private directory and yields it as SnapshotFile pieces."""

    def __init__(self, snapshot: ShardSnapshot, parent: str | None = None) -> None:
        self._root = _private_directory(".replica-snapshot-", parent)
        try:
            write_checkpoint(self._root, snapshot, keep=1)
        except BaseException:
            shutil.rmtree(self._root, ignore_errors=True)
            raise

    def pieces(self, piece_bytes: int = SNAPSHOT_PIECE_BYTES) -> Iterator[ps_pb2.SnapshotFile]:
        for path in sorted(p for p in self._root.rglob("*") if p.is_file()):
            relative = path.relative_to(self._root).as_posix()
            offset = 0
            with open(path, "rb") as f:
                while True:
                    data = f.read(piece_bytes)
                    last = len(data) < piece_bytes
                    yield ps_pb2.SnapshotFile(path=relative, offset=offset, last=last, data=data)
                    offset += len(data)
                    if last:
                        break

    def close(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)


class SnapshotReceiver:
    """A backup's end: writes the pieces under a private directory, then loads it as a restore."""

    def __init__(self, shard_index: int, num_shards: int, parent: str | None = None) -> None:
        self._shard_index = shard_index
        self._num_shards = num_shards
        self._root = _private_directory(".replica-catch-up-", parent)
        self.bytes_received = 0

    def add(self, piece: ps_pb2.SnapshotFile) -> None:
        relative = Path(piece.path)
        if relative.is_absolute() or ".." in relative.parts or not relative.parts:
            raise ValueError(f"snapshot file path {piece.path!r} is not a plain relative path")
        path = self._root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if piece.offset == 0:
            path.write_bytes(b"")
        elif not path.exists() or path.stat().st_size != piece.offset:
            raise ValueError(f"snapshot file {piece.path!r}: piece at offset {piece.offset} out of order")
        with open(path, "ab") as f:
            f.write(piece.data)
        self.bytes_received += len(piece.data)

    def load(self) -> RestoredState:
        """The snapshot as a restore of this shard (checksums verified by the checkpoint reader)."""
        state = load_restore(self._root, self._shard_index, self._num_shards)
        if state is None:
            raise ValueError("the primary's snapshot holds no checkpoint of this shard")
        return state

    def close(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)
