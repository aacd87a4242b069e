"""The on-disk checkpoint format: writing, verifying, choosing, restoring.

Layout under ``--checkpoint-dir`` (one root shared by every shard of a job)::

    shard-0-of-3/
        ckpt-0000000007/
            tensors.safetensors   values and optimizer slots of this shard
            manifest.json         specs, row ranges, versions, optimizer steps,
                                  the exactly-once ledger, file checksums
        ckpt-0000000008/ ...
        spec-log.jsonl            variables created since (see ps_server.durability.spec_log)

A checkpoint is written into a temporary directory, every file and the
directory are fsynced, and only then is it renamed into place; the manifest
carries the SHA-256 of each file and of itself. A checkpoint that fails any
check (half written, truncated, bytes flipped) is skipped with a loud log
line and the previous one is used: nothing unverified is ever loaded.

Each manifest records the global row range each variable part covers, so a
server started with a different ``--num-shards`` assembles its new parts
from the newest intact checkpoints of the old shards (rows are read with
safetensors slices, never whole files).

No gRPC here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import json_format
from safetensors import safe_open
from safetensors.numpy import save_file

from ps_server.core.persistence import AccumulatorSnapshot, LoadedPart, PartSnapshot
from wehub_ps.process.logs import event
from wehub_ps.placement import hash_shards, rows_of
from wehub_ps.specs import Explicit, VariableSpec
from wehub_ps.specs_proto import spec_from_proto, spec_to_proto
from wehub_ps.v1 import ps_pb2

__all__ = [
    "CheckpointError",
    "ShardSnapshot",
    "WrittenCheckpoint",
    "RestorePlan",
    "write_checkpoint",
    "find_restore_plan",
    "load_parts",
    "shard_dir",
    "clean_temporaries",
]

log = logging.getLogger("ps_server.durability.format")

FORMAT = "wehub-ps-checkpoint"
FORMAT_VERSION = 1
TENSORS_FILE = "tensors.safetensors"
MANIFEST_FILE = "manifest.json"
SPEC_LOG_FILE = "spec-log.jsonl"
_CKPT = re.compile(r"ckpt-(\d{10})")
_SHARD_DIR = re.compile(r"shard-(\d+)-of-(\d+)")
_SLOT_SEPARATOR = "@"  # variable names never contain it (see wehub_ps.specs)


class CheckpointError(Exception):
    """A checkpoint is missing, damaged, or cannot be used; the message says which and why."""


@dataclass(frozen=True)
class ShardSnapshot:
    shard_index: int
    num_shards: int
    server_id: str
    parts: list[PartSnapshot]
    ledger: dict[str, Any]
    created_unix: float = field(default_factory=time.time)
    #: ssp / sync: step, clocks and workers of the consistency controller (see consistency.py).
    consistency: dict[str, Any] | None = None

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


@dataclass(frozen=True)
class RestorePlan:
    """Which checkpoints to load: one per old shard of the chosen layout."""

    num_shards: int  # of the checkpoints (the old layout)
    checkpoints: dict[int, Path]  # old shard index -> checkpoint directory (none before the first)
    manifests: dict[int, dict[str, Any]]
    #: old shard index -> shard directory whose spec log to replay (ps_server.durability.spec_log)
    spec_logs: dict[int, Path] = field(default_factory=dict)


def shard_dir(root: str | os.PathLike, shard_index: int, num_shards: int) -> Path:
    return Path(root) / f"shard-{shard_index}-of-{num_shards}"


# ---- writing -------------------------------------------------------------------------


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def _checksummed(manifest: dict[str, Any]) -> dict[str, Any]:
    body = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    return {**manifest, "manifest_sha256": hashlib.sha256(body.encode()).hexdigest()}


def _spec_to_json(spec: VariableSpec) -> dict[str, Any]:
    return json_format.MessageToDict(spec_to_proto(spec), preserving_proto_field_name=True)


def _spec_from_json(data: dict[str, Any]) -> VariableSpec:
    return spec_from_proto(json_format.ParseDict(data, ps_pb2.VariableSpec()))


# Shared with ps_server.durability.spec_log, which keeps its records next to the checkpoints.
fsync_path = _fsync_path
sha256_file = _sha256_file
spec_to_json = _spec_to_json
spec_from_json = _spec_from_json


def _existing_ids(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := _CKPT.fullmatch(p.name)))


def oldest_checkpoint(directory: Path) -> Path | None:
    """The oldest checkpoint kept in a shard directory (None if there is none)."""
    ids = _existing_ids(directory)
    return directory / f"ckpt-{ids[0]:010d}" if ids else None


def clean_temporaries(directory: Path) -> None:
    """Remove half-written checkpoints left by a crash (call before writing)."""
    if directory.is_dir():
        for path in directory.iterdir():
            if path.name.startswith(".tmp-"):
                shutil.rmtree(path, ignore_errors=True)


def write_checkpoint(root: str | os.PathLike, snapshot: ShardSnapshot, keep: int) -> WrittenCheckpoint:
    """Write ``snapshot`` atomically and keep only the newest ``keep`` checkpoints."""
    started = time.perf_counter()
    directory = shard_dir(root, snapshot.shard_index, snapshot.num_shards)
    directory.mkdir(parents=True, exist_ok=True)
    ids = _existing_ids(directory)
    checkpoint_id = f"{(ids[-1] + 1) if ids else 1:010d}"
    tmp = directory / f".tmp-{checkpoint_id}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    tensors: dict[str, np.ndarray] = {}
    variables = []
    for part in snapshot.parts:
        entry = {"spec": _spec_to_json(part.spec), "row_start": part.row_start, "row_end": part.row_end,
                 "holds_part": part.holds_part, "version": part.version,
                 "optimizer_steps": part.optimizer_steps, "initialized": part.initialized,
                 "slots": sorted(part.slots), "row_steps": part.row_steps is not None,
                 "rows": sorted(part.rows) if part.rows is not None else None,
                 "evicted_rows": part.evicted_rows}
        if part.rows is not None:
            for key, values in part.rows.items():
                tensors[f"{part.spec.name}{_SLOT_SEPARATOR}rows:{key}"] = values
        elif part.holds_part:
            tensors[part.spec.name] = part.value
            for slot, values in part.slots.items():
                tensors[f"{part.spec.name}{_SLOT_SEPARATOR}{slot}"] = values
            if part.row_steps is not None:
                tensors[f"{part.spec.name}{_SLOT_SEPARATOR}row_steps"] = part.row_steps
        if part.accumulator is not None:
            entry["accumulator"] = _save_accumulator(part.spec.name, part.accumulator, tensors)
        variables.append(entry)
    tensors_path = tmp / TENSORS_FILE
    save_file(tensors, str(tensors_path), metadata={"format": FORMAT, "checkpoint_id": checkpoint_id})
    _fsync_path(tensors_path)
    manifest = _checksummed({
        "format": FORMAT, "format_version": FORMAT_VERSION, "checkpoint_id": checkpoint_id,
        "shard_index": snapshot.shard_index, "num_shards": snapshot.num_shards,
        "server_id": snapshot.server_id, "created_unix": snapshot.created_unix,
        "variables": variables, "ledger": snapshot.ledger,
        **({"consistency": snapshot.consistency} if snapshot.consistency is not None else {}),
        "files": {TENSORS_FILE: {"sha256": _sha256_file(tensors_path),
                                 "bytes": tensors_path.stat().st_size}},
    })
    manifest_path = tmp / MANIFEST_FILE
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    _fsync_path(manifest_path)
    _fsync_path(tmp, directory=True)
    final = directory / f"ckpt-{checkpoint_id}"
    os.rename(tmp, final)
    _fsync_path(directory, directory=True)
    for old in _existing_ids(directory)[:-keep]:
        shutil.rmtree(directory / f"ckpt-{old:010d}", ignore_errors=True)
    return WrittenCheckpoint(checkpoint_id, final, snapshot.created_unix,
                             manifest["files"][TENSORS_FILE]["bytes"],
                             time.perf_counter() - started, snapshot.num_shards)


def _save_accumulator(name: str, acc: AccumulatorSnapshot, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    """Add a part's step sum to ``tensors``; its manifest entry."""
    prefix = f"{name}{_SLOT_SEPARATOR}acc:"
    if acc.dense is not None:
        tensors[prefix + "dense"] = acc.dense
    if acc.row_ids is not None:
        tensors[prefix + "row_ids"] = acc.row_ids
        tensors[prefix + "row_grads"] = acc.row_grads
    return {"step": acc.step, "dense_count": acc.dense_count, "row_count": acc.row_count}


def _load_accumulator(name: str, entry: dict[str, Any], handle) -> AccumulatorSnapshot | None:
    saved = entry.get("accumulator")
    if saved is None:
        return None
    prefix = f"{name}{_SLOT_SEPARATOR}acc:"
    rows = saved["row_count"] > 0
    return AccumulatorSnapshot(
        int(saved["step"]), handle.get_tensor(prefix + "dense") if saved["dense_count"] else None,
        int(saved["dense_count"]), handle.get_tensor(prefix + "row_ids") if rows else None,
        handle.get_tensor(prefix + "row_grads") if rows else None, int(saved["row_count"]))


# ---- verifying and choosing ------------------------------------------------------------


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of a checkpoint directory, its own checksum verified."""
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: manifest unreadable: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {manifest.get('format_version')} is not supported")
    claimed = manifest.pop("manifest_sha256", None)
    if _checksummed(manifest)["manifest_sha256"] != claimed:
        raise CheckpointError(f"{path}: manifest checksum mismatch (file damaged or edited)")
    return manifest


def verify(path: Path) -> dict[str, Any]:
    """The manifest, after checking every file's size and SHA-256; CheckpointError if any differs."""
    manifest = read_manifest(path)
    for name, expected in manifest["files"].items():
        file = path / name
        try:
            size = file.stat().st_size
        except OSError:
            raise CheckpointError(f"{path}: {name} is missing") from None
        if size != expected["bytes"]:
            raise CheckpointError(f"{path}: {name} has {size} bytes, the manifest says {expected['bytes']}")
        if _sha256_file(file) != expected["sha256"]:
            raise CheckpointError(f"{path}: {name} checksum mismatch (corrupted)")
    return manifest


def _newest_intact(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    for checkpoint_id in reversed(_existing_ids(directory)):
        path = directory / f"ckpt-{checkpoint_id:010d}"
        try:
            return path, verify(path)
        except CheckpointError as exc:
            event(log, logging.ERROR, "CHECKPOINT SKIPPED: damaged, falling back to the previous one",
                  path=str(path), error=str(exc))
    return None


def _layouts(root: Path) -> dict[int, dict[int, Path]]:
    """Shard directories holding state (checkpoints or a spec log), by shard count and index."""
    layouts: dict[int, dict[int, Path]] = {}
    if root.is_dir():
        for path in root.iterdir():
            m = _SHARD_DIR.fullmatch(path.name)
            if m and path.is_dir() and (_existing_ids(path) or (path / SPEC_LOG_FILE).exists()):
                layouts.setdefault(int(m.group(2)), {})[int(m.group(1))] = path
    return layouts


def _newest_time(directory: Path) -> float:
    """When ``directory`` last changed: its newest valid checkpoint or spec log record (0 if none)."""
    newest = 0.0
    with contextlib.suppress(OSError):
        newest = (directory / SPEC_LOG_FILE).stat().st_mtime
    for checkpoint_id in reversed(_existing_ids(directory)):
        try:
            return max(newest, float(read_manifest(directory / f"ckpt-{checkpoint_id:010d}")["created_unix"]))
        except (CheckpointError, KeyError, TypeError, ValueError):
            continue
    return newest


def find_restore_plan(root: str | os.PathLike, shard_index: int, num_shards: int) -> RestorePlan | None:
    """What to restore on start; None when there is nothing to restore.

    Candidates are the layouts (shard counts) for which every shard has
    checkpointed, plus the server's own layout when its own shard has. The
    own layout is as recent as this shard's own newest checkpoint (that is
    what it would load); another layout is as recent as the oldest of its
    shards' newest checkpoints (it needs all of them). The most recent wins,
    so a stale checkpoint of an earlier run never beats a newer job. With the server's own shard
    count, its own newest intact checkpoint is used; with another, the
    newest intact checkpoint of every old shard. Raises CheckpointError when
    the chosen checkpoints exist but none is usable: starting empty would
    silently throw the job's state away.

    A shard directory holding only a spec log (variables created before its
    first checkpoint; ps_server.durability.spec_log) counts as state too, as recent as
    the log's last record; the plan names the spec logs of the chosen layout
    (``spec_logs``), replayed after its checkpoints.
    """
    root = Path(root)
    layouts = _layouts(root)
    # Another layout is used whole: every old shard checkpointed, or none did yet (spec logs only).
    candidates = {m for m, dirs in layouts.items() if set(dirs) == set(range(m))
                  and len({bool(_existing_ids(d)) for d in dirs.values()}) == 1}
    if shard_index in layouts.get(num_shards, {}):
        candidates.add(num_shards)
    if not candidates:
        if layouts:
            event(log, logging.WARNING, "incomplete checkpoints ignored; starting empty", root=str(root),
                  layouts={m: sorted(d) for m, d in layouts.items()})
        return None
    def recency(m: int) -> float:
        if m == num_shards:
            return _newest_time(layouts[m][shard_index])
        return min(_newest_time(d) for d in layouts[m].values())

    chosen = max(candidates, key=lambda m: (recency(m), m == num_shards))
    directories = layouts[chosen]
    if chosen == num_shards:
        own = directories[shard_index]
        if not _existing_ids(own):  # created variables, crashed before the first checkpoint
            return RestorePlan(chosen, {}, {}, {shard_index: own})
        found = _newest_intact(own)
        if found is None:
            raise CheckpointError(f"every checkpoint in {own} is damaged; move the directory away to "
                                  "start from scratch, or restore a backup")
        return RestorePlan(chosen, {shard_index: found[0]}, {shard_index: found[1]}, {shard_index: own})
    checkpoints, manifests = {}, {}
    for old_index, directory in sorted(directories.items()):
        if not _existing_ids(directory):
            continue  # spec logs only (see the candidates)
        found = _newest_intact(directory)
        if found is None:
            raise CheckpointError(f"every checkpoint of old shard {old_index} in {directory} is damaged")
        checkpoints[old_index], manifests[old_index] = found
    return RestorePlan(chosen, checkpoints, manifests, dict(directories))


# ---- loading -----------------------------------------------------------------------------


def load_parts(plan: RestorePlan, shard_index: int, num_shards: int) -> list[LoadedPart]:
    """This shard's parts under ``num_shards``, read from the plan's checkpoints.

    Synchronous mode's step sums come back only with the same shard count
    (like the ledger): assembled from other layouts, a part starts its step empty.
    """
    specs: dict[str, VariableSpec] = {}
    entries: dict[str, list[tuple[int, dict[str, Any]]]] = {}  # name -> (old shard, manifest entry)
    for old_index, manifest in plan.manifests.items():
        for entry in manifest["variables"]:
            spec = _spec_from_json(entry["spec"])
            known = specs.setdefault(spec.name, spec)
            if known != spec:
                raise CheckpointError(f"old shards disagree about the spec of {spec.name!r}: "
                                      + "; ".join(known.differences(spec)))
            entries.setdefault(spec.name, []).append((old_index, entry))
    with contextlib.ExitStack() as stack:
        handles = {i: stack.enter_context(safe_open(str(path / TENSORS_FILE), framework="numpy"))
                   for i, path in plan.checkpoints.items()}
        parts = [_load_variable(spec, entries[spec.name], handles, shard_index, num_shards)
                 for spec in specs.values()]
        if plan.num_shards == num_shards and parts:
            own = handles[shard_index]
            parts = [replace(p, accumulator=_load_accumulator(p.spec.name, entries[p.spec.name][0][1], own))
                     for p in parts]
        return parts


def _load_variable(spec: VariableSpec, sources, handles, shard_index: int, num_shards: int) -> LoadedPart:
    """One variable's part under ``num_shards``, from the old parts in ``sources``."""
    name = spec.name
    if spec.hash_table:
        return _load_table(spec, sources, handles, shard_index, num_shards)
    part = spec.placement(num_shards).part_on(shard_index)
    row_start, row_end = (part.row_start, part.row_end) if part else (0, 0)
    row_elements = rows_of(spec.shape)[1]
    slot_names = sorted(sources[0][1]["slots"])
    with_steps = any(e.get("row_steps") for _, e in sources if e["holds_part"])
    value, slots = _assemble(name, spec, row_start, row_end, row_elements,
                             slot_names + (["row_steps"] if with_steps else []), sources, handles,
                             part is not None)
    row_steps = slots.pop("row_steps", None)
    if with_steps and row_steps is None:
        row_steps = np.zeros(row_end - row_start, np.int64)
    holders = [e for _, e in sources if e["holds_part"]] if part else []
    return LoadedPart(
        spec, row_start, row_end, part is not None,
        version=max((e["version"] for e in holders), default=0),
        optimizer_steps=max((e["optimizer_steps"] for e in holders), default=0),
        # A shard without rows never receives the explicit value itself.
        initialized=(all(e["initialized"] for e in holders) if holders
                     else not isinstance(spec.initializer, Explicit)),
        value=value, slots=slots, row_steps=row_steps)


def _load_table(spec: VariableSpec, sources, handles, shard_index: int, num_shards: int) -> LoadedPart:
    """This shard's rows of a hash table: the old shards' rows whose id now maps here."""
    gathered: dict[str, list[np.ndarray]] = {}
    for old_index, entry in sources:
        keys = entry["rows"] or []
        arrays = {key: handles[old_index].get_tensor(f"{spec.name}{_SLOT_SEPARATOR}rows:{key}") for key in keys}
        if not arrays:
            continue
        mine = hash_shards(arrays["ids"], num_shards) == shard_index
        for key, values in arrays.items():
            gathered.setdefault(key, []).append(values[mine])
    rows = {key: np.concatenate(parts) for key, parts in gathered.items()}
    if "ids" in rows and len(np.unique(rows["ids"])) != len(rows["ids"]):
        raise CheckpointError(f"old shards hold the same row id of {spec.name!r} twice")
    holders = [e for _, e in sources]
    # Each old shard's eviction count goes to exactly one new shard, so the total is kept.
    evicted = sum(e.get("evicted_rows", 0) for old, e in sources if old % num_shards == shard_index)
    return LoadedPart(spec, 0, 0, True,
                      version=max(e["version"] for e in holders),
                      optimizer_steps=max(e["optimizer_steps"] for e in holders),
                      initialized=True, value=np.empty(0, spec.dtype), slots={}, rows=rows,
                      evicted_rows=evicted)


def _assemble(name, spec, row_start, row_end, row_elements, slot_names, sources, handles, holds):
    """Copy rows [row_start, row_end) of the value and each slot from the old parts."""
    dtype = spec.dtype
    count = (row_end - row_start) * row_elements
    value = np.empty(count, dtype=dtype)
    slots: dict[str, np.ndarray] = {}
    covered = 0
    for old_index, entry in sources:
        if not holds or not entry["holds_part"]:
            continue
        lo, hi = max(row_start, entry["row_start"]), min(row_end, entry["row_end"])
        if lo >= hi:
            continue
        keys = [(None, name)] + [(slot, f"{name}{_SLOT_SEPARATOR}{slot}") for slot in slot_names]
        for slot, key in keys:
            width = 1 if slot == "row_steps" else row_elements  # per-row arrays have one entry per row
            if slot == "row_steps" and not entry.get("row_steps"):
                slots.setdefault(slot, np.zeros(row_end - row_start, np.int64))
                continue
            flat = handles[old_index].get_slice(key)[(lo - entry["row_start"]) * width:
                                                      (hi - entry["row_start"]) * width]
            size = (row_end - row_start) * width
            target = value if slot is None else slots.setdefault(slot, np.empty(size, dtype=flat.dtype))
            target[(lo - row_start) * width:(hi - row_start) * width] = flat
        covered += hi - lo
    if holds and covered != row_end - row_start:
        raise CheckpointError(f"the checkpoints cover {covered} of rows [{row_start}, {row_end}) of {name!r}")
    return value, slots
