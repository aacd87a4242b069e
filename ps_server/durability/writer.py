"""Writing one shard's checkpoint atomically, and keeping the newest few.

A checkpoint is written into a temporary directory, every file and the
directory are fsynced, and only then is it renamed into place: a crash
leaves either the whole checkpoint or a ``.tmp-`` directory that restore
never reads and :func:`clean_temporaries` removes. The format is described
in ps_server.durability.format.

No gRPC here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from ps_server.core.persistence import AccumulatorSnapshot, DiskRows, PartSnapshot
from ps_server.durability.chains import REMOVED_IDS, chain_ids, read_link_manifest
from ps_server.durability.format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_FILE,
    TENSORS_FILE,
    checkpoint_ids,
    checkpoint_path,
    checksummed,
    fsync_path,
    sha256_file,
    shard_dir,
    spec_to_json,
    tensor_name,
)

__all__ = ["ShardSnapshot", "WrittenCheckpoint", "write_checkpoint", "clean_temporaries"]


@dataclass(frozen=True)
class ShardSnapshot:
    """Everything one checkpoint holds, copied out of the shard in one instant."""

    shard_index: int
    num_shards: int
    server_id: str
    parts: list[PartSnapshot]
    ledger: dict[str, Any]
    created_unix: float = field(default_factory=time.time)
    #: ssp / sync: step, clocks and workers of the consistency controller (see consistency.py).
    consistency: dict[str, Any] | None = None
    #: A delta (checkpoints by change, ps_server.durability.chains): the ids of the checkpoints it
    #: builds on, its full one first, the previous one last. None: a full checkpoint.
    chain: list[int] | None = None

    @property
    def nbytes(self) -> int:
        return sum(p.value.nbytes + sum(s.nbytes for s in p.slots.values())
                   + sum(r.nbytes for r in (p.rows or {}).values()) for p in self.parts)


@dataclass(frozen=True)
class WrittenCheckpoint:
    checkpoint_id: str
    path: Path
    created_unix: float
    bytes: int
    write_seconds: float
    num_shards: int


def clean_temporaries(directory: Path) -> None:
    """Remove half-written checkpoints left by a crash (call before writing)."""
    if directory.is_dir():
        for path in directory.iterdir():
            if path.name.startswith(".tmp-"):
                shutil.rmtree(path, ignore_errors=True)


def write_checkpoint(root: str | os.PathLike, snapshot: ShardSnapshot, keep: int) -> WrittenCheckpoint:
    """Write ``snapshot`` atomically and keep only the newest ``keep`` checkpoints.

    The tables' rows left on disk by the snapshot (``disk_rows``) are
    released when this returns or raises.
    """
    try:
        return _write_checkpoint(root, snapshot, keep)
    finally:
        for part in snapshot.parts:
            if part.disk_rows is not None:
                part.disk_rows.release()


def _write_checkpoint(root: str | os.PathLike, snapshot: ShardSnapshot, keep: int) -> WrittenCheckpoint:
    started = time.perf_counter()
    directory = shard_dir(root, snapshot.shard_index, snapshot.num_shards)
    directory.mkdir(parents=True, exist_ok=True)
    ids = checkpoint_ids(directory)
    checkpoint_id = f"{(ids[-1] + 1) if ids else 1:010d}"
    if snapshot.chain is not None and (not snapshot.chain or snapshot.chain[-1] != (ids[-1] if ids else None)):
        raise ValueError(f"a delta must build on the newest checkpoint ({ids[-1] if ids else None}), "
                         f"not on {snapshot.chain[-1:] or 'nothing'}")
    tmp = directory / f".tmp-{checkpoint_id}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    tensors: dict[str, np.ndarray] = {}
    files: dict[str, dict[str, Any]] = {}
    variables = [_save_part(part, tensors, tmp, files) for part in snapshot.parts]
    tensors_path = tmp / TENSORS_FILE
    save_file(tensors, str(tensors_path), metadata={"format": FORMAT, "checkpoint_id": checkpoint_id})
    fsync_path(tensors_path)
    manifest = checksummed({
        "format": FORMAT, "format_version": FORMAT_VERSION, "checkpoint_id": checkpoint_id,
        "shard_index": snapshot.shard_index, "num_shards": snapshot.num_shards,
        "server_id": snapshot.server_id, "created_unix": snapshot.created_unix,
        "kind": "full" if snapshot.chain is None else "delta",
        **({"chain": [f"{i:010d}" for i in snapshot.chain]} if snapshot.chain is not None else {}),
        "variables": variables, "ledger": snapshot.ledger,
        **({"consistency": snapshot.consistency} if snapshot.consistency is not None else {}),
        "files": {TENSORS_FILE: {"sha256": sha256_file(tensors_path),
                                 "bytes": tensors_path.stat().st_size}, **files},
    })
    manifest_path = tmp / MANIFEST_FILE
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    fsync_path(manifest_path)
    fsync_path(tmp, directory=True)
    final = directory / f"ckpt-{checkpoint_id}"
    os.rename(tmp, final)
    fsync_path(directory, directory=True)
    _keep_newest(directory, keep)
    return WrittenCheckpoint(checkpoint_id, final, snapshot.created_unix,
                             manifest["files"][TENSORS_FILE]["bytes"],
                             time.perf_counter() - started, snapshot.num_shards)


def _keep_newest(directory: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` checkpoints and the ones they build on."""
    ids = checkpoint_ids(directory)
    needed = set(ids[-keep:])
    for checkpoint_id in ids[-keep:]:
        manifest = read_link_manifest(directory, checkpoint_id)
        if manifest is not None:
            needed.update(chain_ids(manifest))
    for old in ids:
        if old not in needed:
            shutil.rmtree(checkpoint_path(directory, old), ignore_errors=True)


def _save_part(part: PartSnapshot, tensors: dict[str, np.ndarray], directory: Path,
               files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Add a part's arrays to ``tensors`` (and a table's rows on disk to a file of their own in
    ``directory``, listed in ``files``); its manifest entry."""
    name = part.spec.name
    entry = {"spec": spec_to_json(part.spec), "row_start": part.row_start, "row_end": part.row_end,
             "holds_part": part.holds_part, "version": part.version,
             "optimizer_steps": part.optimizer_steps, "initialized": part.initialized,
             "slots": sorted(part.slots), "row_steps": part.row_steps is not None,
             "rows": sorted(part.rows) if part.rows is not None else None,
             "evicted_rows": part.evicted_rows, "access_clock": part.access_clock}
    if part.rows is not None:
        for key, values in part.rows.items():
            tensors[tensor_name(name, f"rows:{key}")] = values
        if part.policy_counts is not None:
            entry["policy_counts"] = part.policy_counts
        if part.removed_ids is not None:
            entry["removed"] = True
            tensors[tensor_name(name, REMOVED_IDS)] = part.removed_ids
        if part.disk_rows is not None:
            entry["disk"] = _save_disk_rows(name, part.disk_rows, tensors, directory, files)
        if part.admission_counts is not None:
            tensors[tensor_name(name, "admission:counts")] = part.admission_counts
            entry["admission_sightings"] = part.admission_sightings
    elif part.holds_part:
        tensors[tensor_name(name)] = part.value
        for slot, values in part.slots.items():
            tensors[tensor_name(name, slot)] = values
        if part.row_steps is not None:
            tensors[tensor_name(name, "row_steps")] = part.row_steps
    if part.accumulator is not None:
        entry["accumulator"] = _save_accumulator(name, part.accumulator, tensors)
    return entry


#: Disk rows streamed per piece: records read from the row file and appended to the checkpoint's file.
_DISK_PIECE_ROWS = 65536


def _save_disk_rows(name: str, rows: DiskRows, tensors: dict[str, np.ndarray], directory: Path,
                    files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A table's rows on disk: their ids and stamps as tensors, their records (value, optimizer slots,
    row step, as the row file holds them) copied piece by piece into a file of their own."""
    file_name = f"disk-rows-{len(files)}.bin"
    path = directory / file_name
    digest, size = hashlib.sha256(), 0
    with open(path, "wb") as out:
        for start in range(0, len(rows.slots), _DISK_PIECE_ROWS):
            piece = memoryview(rows.read(rows.slots[start:start + _DISK_PIECE_ROWS]).view(np.uint8))
            out.write(piece)
            digest.update(piece)  # hashed as written: the file is not read back
            size += piece.nbytes
        out.flush()
        os.fsync(out.fileno())
    for key in ("ids", "last_access", "updated_version", "updated_before"):
        tensors[tensor_name(name, f"disk:{key}")] = getattr(rows, key)
    files[file_name] = {"sha256": digest.hexdigest(), "bytes": size}
    return {"file": file_name, "rows": len(rows.slots)}


def _save_accumulator(name: str, acc: AccumulatorSnapshot, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    """Add a part's step sum to ``tensors``; its manifest entry."""
    if acc.dense is not None:
        tensors[tensor_name(name, "acc:dense")] = acc.dense
    if acc.row_ids is not None:
        tensors[tensor_name(name, "acc:row_ids")] = acc.row_ids
        tensors[tensor_name(name, "acc:row_grads")] = acc.row_grads
    return {"step": acc.step, "dense_count": acc.dense_count, "row_count": acc.row_count}
