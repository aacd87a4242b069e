"""What a shard restores on start: which checkpoints, and this shard's parts from them.

:func:`find_restore_plan` chooses the checkpoints (and the spec logs to
replay after them); :func:`load_parts` assembles this shard's variable
parts from them under any shard count (see ps_server.durability.reshard).

No gRPC here.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from safetensors import safe_open

from ps_server.durability.format import (
    SPEC_LOG_FILE,
    TENSORS_FILE,
    CheckpointError,
    checkpoint_ids,
    checkpoint_path,
    read_manifest,
    shard_dir_layout,
    spec_from_json,
    verify,
)
from ps_server.core.persistence import LoadedPart
from ps_server.durability.reshard import Source, assemble_part, load_accumulator
from wehub_ps.process.logs import event
from wehub_ps.specs import VariableSpec

__all__ = ["RestorePlan", "find_restore_plan", "load_parts"]

log = logging.getLogger("ps_server.durability.restore")


@dataclass(frozen=True)
class RestorePlan:
    """Which checkpoints to load: one per old shard of the chosen layout."""

    num_shards: int  # of the checkpoints (the old layout)
    checkpoints: dict[int, Path]  # old shard index -> checkpoint directory (none before the first)
    manifests: dict[int, dict[str, Any]]
    #: old shard index -> shard directory whose spec log to replay (ps_server.durability.spec_log)
    spec_logs: dict[int, Path] = field(default_factory=dict)


# ---- choosing ------------------------------------------------------------------------------


def find_restore_plan(root: str | os.PathLike, shard_index: int, num_shards: int) -> RestorePlan | None:
    """What to restore on start; None when there is nothing to restore.

    Candidates are the layouts (shard counts) for which every shard has
    checkpointed, plus the server's own layout when its own shard has. The
    own layout is as recent as this shard's own newest checkpoint (that is
    what it would load); another layout is as recent as the oldest of its
    shards' newest checkpoints (it needs all of them). The most recent wins,
    so a stale checkpoint of an earlier run never beats a newer job. With the server's own shard
    count, its own newest intact checkpoint is used; with another, the
    newest intact checkpoint of every old shard. A damaged checkpoint is
    skipped with a loud log line for the previous one. Raises CheckpointError
    when the chosen checkpoints exist but none is usable: starting empty would
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
                  and len({bool(checkpoint_ids(d)) for d in dirs.values()}) == 1}
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
        if not checkpoint_ids(own):  # created variables, crashed before the first checkpoint
            return RestorePlan(chosen, {}, {}, {shard_index: own})
        found = _newest_intact(own)
        if found is None:
            raise CheckpointError(f"every checkpoint in {own} is damaged; move the directory away to "
                                  "start from scratch, or restore a backup")
        return RestorePlan(chosen, {shard_index: found[0]}, {shard_index: found[1]}, {shard_index: own})
    checkpoints, manifests = {}, {}
    for old_index, directory in sorted(directories.items()):
        if not checkpoint_ids(directory):
            continue  # spec logs only (see the candidates)
        found = _newest_intact(directory)
        if found is None:
            raise CheckpointError(f"every checkpoint of old shard {old_index} in {directory} is damaged")
        checkpoints[old_index], manifests[old_index] = found
    return RestorePlan(chosen, checkpoints, manifests, dict(directories))


def _newest_intact(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    for checkpoint_id in reversed(checkpoint_ids(directory)):
        path = checkpoint_path(directory, checkpoint_id)
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
            named = shard_dir_layout(path)
            if named and path.is_dir() and (checkpoint_ids(path) or (path / SPEC_LOG_FILE).exists()):
                index, count = named
                layouts.setdefault(count, {})[index] = path
    return layouts


def _newest_time(directory: Path) -> float:
    """When ``directory`` last changed: its newest valid checkpoint or spec log record (0 if none)."""
    newest = 0.0
    with contextlib.suppress(OSError):
        newest = (directory / SPEC_LOG_FILE).stat().st_mtime
    for checkpoint_id in reversed(checkpoint_ids(directory)):
        try:
            return max(newest, float(read_manifest(checkpoint_path(directory, checkpoint_id))["created_unix"]))
        except (CheckpointError, KeyError, TypeError, ValueError):
            continue
    return newest


# ---- loading -------------------------------------------------------------------------------


def load_parts(plan: RestorePlan, shard_index: int, num_shards: int) -> list[LoadedPart]:
    """This shard's parts under ``num_shards``, read from the plan's checkpoints.

    Synchronous mode's step sums come back only with the same shard count
    (like the ledger): assembled from other layouts, a part starts its step empty.
    """
    specs: dict[str, VariableSpec] = {}
    sources: dict[str, list[Source]] = {}
    for old_index, manifest in plan.manifests.items():
        for entry in manifest["variables"]:
            spec = spec_from_json(entry["spec"])
            known = specs.setdefault(spec.name, spec)
            if known != spec:
                raise CheckpointError(f"old shards disagree about the spec of {spec.name!r}: "
                                      + "; ".join(known.differences(spec)))
            sources.setdefault(spec.name, []).append((old_index, entry))
    with contextlib.ExitStack() as stack:
        handles = {i: stack.enter_context(safe_open(str(path / TENSORS_FILE), framework="numpy"))
                   for i, path in plan.checkpoints.items()}
        parts = [assemble_part(spec, sources[spec.name], handles, shard_index, num_shards)
                 for spec in specs.values()]
        if plan.num_shards == num_shards and parts:
            own = handles[shard_index]
            parts = [replace(p, accumulator=load_accumulator(p.spec.name, sources[p.spec.name][0][1], own))
                     for p in parts]
        return parts
