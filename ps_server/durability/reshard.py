"""One variable's part on this shard, assembled from the parts old shards checkpointed.

Each manifest entry records the global row range its part covered, so the
old shard count need not match this server's: a dense variable's rows
``[row_start, row_end)`` under the new placement are copied from every old
part that overlaps them (read with safetensors slices, never whole files),
and a hash table's rows are those whose id now hashes to this shard. With
the same shard count this is a plain load of the shard's own part.

No gRPC here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ps_server.core.persistence import AccumulatorSnapshot, LoadedPart
from ps_server.core.row_policies import PolicyCounts, merge_admission_counts
from ps_server.durability.format import CheckpointError, tensor_name
from wehub_ps.placement import hash_shards, rows_of
from wehub_ps.specs import Explicit, VariableSpec

__all__ = ["Source", "assemble_part", "load_accumulator"]

#: One old part of a variable: (old shard index, its manifest entry).
Source = tuple[int, dict[str, Any]]


def assemble_part(spec: VariableSpec, sources: list[Source], handles: dict[int, Any], shard_index: int,
                  num_shards: int) -> LoadedPart:
    """``spec``'s part on ``shard_index`` of ``num_shards``.

    ``handles`` are the old shards' open tensor files, by old shard index.
    """
    if spec.hash_table:
        return _assemble_table(spec, sources, handles, shard_index, num_shards)
    part = spec.placement(num_shards).part_on(shard_index)
    row_start, row_end = (part.row_start, part.row_end) if part else (0, 0)
    row_elements = rows_of(spec.shape)[1]
    slot_names = sorted(sources[0][1]["slots"])
    with_steps = any(e.get("row_steps") for _, e in sources if e["holds_part"])
    value, slots = _copy_rows(spec, row_start, row_end, row_elements,
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


def load_accumulator(name: str, entry: dict[str, Any], handle: Any) -> AccumulatorSnapshot | None:
    """A part's checkpointed step sum (same shard count only: a step's sum does not reshard)."""
    saved = entry.get("accumulator")
    if saved is None:
        return None
    rows = saved["row_count"] > 0
    dense = handle.get_tensor(tensor_name(name, "acc:dense")) if saved["dense_count"] else None
    return AccumulatorSnapshot(
        int(saved["step"]), dense, int(saved["dense_count"]),
        handle.get_tensor(tensor_name(name, "acc:row_ids")) if rows else None,
        handle.get_tensor(tensor_name(name, "acc:row_grads")) if rows else None, int(saved["row_count"]))


def _assemble_table(spec: VariableSpec, sources: list[Source], handles: dict[int, Any], shard_index: int,
                    num_shards: int) -> LoadedPart:
    """This shard's rows of a hash table: the old shards' rows whose id now maps here."""
    gathered: dict[str, list[np.ndarray]] = {}
    version = max(e["version"] for _, e in sources)
    disk_sources = []
    for old_index, entry in sources:
        arrays, files = handles[old_index].table_rows(spec) if entry["rows"] else ({}, [])
        for file in files:  # rows on disk: streamed in by the restore, this shard's only
            file.restrict(hash_shards(file.ids, num_shards) == shard_index)
            file.version_shift = version - int(entry["version"])
            disk_sources.append(file)
        if not arrays:
            continue
        mine = hash_shards(arrays["ids"], num_shards) == shard_index
        if "updated_version" in arrays:  # rows keep how many versions ago they were updated
            arrays["updated_version"] = arrays["updated_version"] + (version - int(entry["version"]))
        for key, values in arrays.items():
            gathered.setdefault(key, []).append(values[mine])
    rows = {key: np.concatenate(parts) for key, parts in gathered.items()}
    every_id = np.concatenate([rows.get("ids", np.empty(0, np.int64)), *(f.kept_ids() for f in disk_sources)])
    if len(np.unique(every_id)) != len(every_id):
        raise CheckpointError(f"old shards hold the same row id of {spec.name!r} twice")
    holders = [e for _, e in sources]
    # Each old shard's eviction count goes to exactly one new shard, so the total is kept.
    evicted = sum(e.get("evicted_rows", 0) for old, e in sources if old % num_shards == shard_index)
    counts = [PolicyCounts.from_dict(e.get("policy_counts")) for old, e in sources
              if old % num_shards == shard_index]
    policy = {key: sum(c.as_dict()[key] for c in counts) for key in PolicyCounts().as_dict()}
    filters = {old: handles[old].get_tensor(tensor_name(spec.name, "admission:counts"))
               for old, e in sources if "admission_sightings" in e}
    same_layout = len(sources) == num_shards
    return LoadedPart(spec, 0, 0, True,
                      version=version,
                      optimizer_steps=max(e["optimizer_steps"] for e in holders),
                      initialized=True, value=np.empty(0, spec.dtype), slots={}, rows=rows,
                      evicted_rows=evicted,
                      access_clock=max(int(e.get("access_clock", 0)) for e in holders),
                      policy_counts=policy,
                      # The same shard count: this shard's own filter; else every old one's, summed.
                      admission_counts=(filters.get(shard_index) if same_layout
                                        else merge_admission_counts(list(filters.values()))),
                      admission_sightings=max((int(e.get("admission_sightings", 0)) for e in holders),
                                              default=0),
                      disk_sources=disk_sources or None)


def _copy_rows(spec: VariableSpec, row_start: int, row_end: int, row_elements: int, slot_names: list[str],
               sources: list[Source], handles: dict[int, Any],
               holds: bool) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Copy rows [row_start, row_end) of the value and each slot from the old parts."""
    name = spec.name
    count = (row_end - row_start) * row_elements
    value = np.empty(count, dtype=spec.dtype)
    slots: dict[str, np.ndarray] = {}
    covered = 0
    for old_index, entry in sources:
        if not holds or not entry["holds_part"]:
            continue
        lo, hi = max(row_start, entry["row_start"]), min(row_end, entry["row_end"])
        if lo >= hi:
            continue
        keys = [(None, tensor_name(name))] + [(slot, tensor_name(name, slot)) for slot in slot_names]
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
