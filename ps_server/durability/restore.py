"""What a shard restores on start: which checkpoints, and the state they hold for it.

Restore reads, it never changes anything: :func:`load_restore` chooses the
checkpoints (:func:`find_restore_plan`), assembles this shard's variable
parts from them (:func:`load_parts`, under any shard count, see
ps_server.durability.reshard), replays the spec logs, and returns a
:class:`RestoredState` for the server to hand to its store, push ledger and
consistency controller.

What comes back depends on the layout. With the server's own shard count,
the checkpoint is this shard's own: the values, the exactly-once ledger,
the consistency controller's step and clocks and, in synchronous mode, the
step's sums, all of one instant. From another shard count only the values
carry over: the ledger and the steps start afresh (pushes in flight were
addressed to the old layout), and the server writes a checkpoint of its own
layout at once.

No gRPC here.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ps_server.core.persistence import LoadedPart
from ps_server.durability.chains import CheckpointChain, chain_ids, find_chain
from ps_server.durability.format import (
    SPEC_LOG_FILE,
    CheckpointError,
    checkpoint_ids,
    checkpoint_path,
    read_manifest,
    shard_dir_layout,
    spec_from_json,
)
from ps_server.durability.reshard import Source, assemble_part, load_accumulator
from ps_server.durability.spec_log import replay_spec_logs
from wehub_ps.process.logs import event
from wehub_ps.specs import VariableSpec

__all__ = ["RestorePlan", "RestoredFrom", "RestoredState", "find_restore_plan", "load_parts", "load_restore"]

log = logging.getLogger("ps_server.durability.restore")


@dataclass(frozen=True)
class RestorePlan:
    """Which checkpoints to load: one per old shard of the chosen layout."""

    num_shards: int  # of the checkpoints (the old layout)
    checkpoints: dict[int, Path]  # old shard index -> checkpoint directory (none before the first)
    manifests: dict[int, dict[str, Any]]
    #: old shard index -> shard directory whose spec log to replay (ps_server.durability.spec_log)
    spec_logs: dict[int, Path] = field(default_factory=dict)
    #: old shard index -> the checkpoint's chain (ps_server.durability.chains): the full checkpoint a
    #: delta builds on and the deltas up to it, oldest first, each verified; just itself when full.
    chains: dict[int, list[tuple[Path, dict[str, Any]]]] = field(default_factory=dict)


@dataclass(frozen=True)
class RestoredFrom:
    """The checkpoints a server restored from, as Describe reports them."""

    checkpoint_ids: dict[int, str]  # old shard index -> checkpoint id
    path: str  # the checkpoint directories, comma-separated
    created_unix: float  # of the newest of them
    num_shards: int  # of the checkpoints (the old layout)


@dataclass(frozen=True)
class RestoredState:
    """This shard's state from the chosen checkpoints and spec logs, ready to hand to its parts."""

    #: Every variable this shard holds a part of, checkpointed or only logged.
    parts: list[LoadedPart]
    #: Shard count of the checkpoints (or spec logs) restored from.
    from_num_shards: int
    #: True when that differs from this server's: ledger and steps start afresh.
    resharded: bool
    #: Old shard index -> checkpoint directory (empty when only spec logs were found).
    checkpoints: dict[int, Path]
    #: The push ledger's entries (PushLedger.restore); empty (a fresh ledger) unless this
    #: shard's own checkpoint was found.
    ledger_entries: list[dict[str, Any]]
    #: The consistency controller's snapshot (ConsistencyController.restore); None starts the steps afresh.
    consistency: dict[str, Any] | None
    #: None when only spec logs were found (variables created before the first checkpoint).
    origin: RestoredFrom | None
    #: This shard's own checkpoint's chain ids (its full one first, itself last), which the next
    #: delta may build on; None after a restore from another layout or from spec logs only.
    chain: list[int] | None = None


def load_restore(root: str | os.PathLike, shard_index: int, num_shards: int) -> RestoredState | None:
    """What shard ``shard_index`` of ``num_shards`` restores from ``root``; None when there is nothing.

    CheckpointError when the chosen checkpoints exist but none is usable.
    """
    plan = find_restore_plan(root, shard_index, num_shards)
    if plan is None:
        return None
    parts = replay_spec_logs(plan.spec_logs.values(), load_parts(plan, shard_index, num_shards),
                             shard_index, num_shards)
    resharded = plan.num_shards != num_shards
    own = plan.manifests.get(shard_index) if not resharded else None
    origin = None
    if plan.manifests:
        newest = max(plan.manifests.values(), key=lambda m: m["created_unix"])
        origin = RestoredFrom({i: m["checkpoint_id"] for i, m in plan.manifests.items()},
                              ",".join(str(p) for p in plan.checkpoints.values()), newest["created_unix"],
                              plan.num_shards)
    return RestoredState(parts, plan.num_shards, resharded, dict(plan.checkpoints),
                         ledger_entries=own["ledger"]["entries"] if own is not None else [],
                         consistency=own.get("consistency") if own is not None else None, origin=origin,
                         chain=chain_ids(own) if own is not None else None)


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
        return RestorePlan(chosen, {shard_index: found[-1][0]}, {shard_index: found[-1][1]}, {shard_index: own},
                           {shard_index: found})
    checkpoints, manifests, chains = {}, {}, {}
    for old_index, directory in sorted(directories.items()):
        if not checkpoint_ids(directory):
            continue  # spec logs only (see the candidates)
        found = _newest_intact(directory)
        if found is None:
            raise CheckpointError(f"every checkpoint of old shard {old_index} in {directory} is damaged")
        checkpoints[old_index], manifests[old_index] = found[-1]
        chains[old_index] = found
    return RestorePlan(chosen, checkpoints, manifests, dict(directories), chains)


def _newest_intact(directory: Path) -> list[tuple[Path, dict[str, Any]]] | None:
    """The newest checkpoint whose every link is intact, as its chain (oldest first); None if none is."""
    for checkpoint_id in reversed(checkpoint_ids(directory)):
        try:
            return find_chain(directory, checkpoint_id)
        except CheckpointError as exc:
            event(log, logging.ERROR, "CHECKPOINT SKIPPED: damaged, falling back to the previous one",
                  path=str(checkpoint_path(directory, checkpoint_id)), error=str(exc))
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
            manifest = read_manifest(checkpoint_path(directory, checkpoint_id))
            return max(newest, float(manifest["created_unix"]))
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
        handles = {i: stack.enter_context(CheckpointChain(chain)) for i, chain in plan.chains.items()}
        parts = [assemble_part(spec, sources[spec.name], handles, shard_index, num_shards)
                 for spec in specs.values()]
        if plan.num_shards == num_shards and parts:
            own = handles[shard_index]
            parts = [replace(p, accumulator=load_accumulator(p.spec.name, sources[p.spec.name][0][1], own))
                     for p in parts]
        return parts
