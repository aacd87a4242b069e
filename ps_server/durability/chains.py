"""Checkpoints by change: a delta and the checkpoints it builds on, read as one.

A delta checkpoint (manifest ``"kind": "delta"``) holds every dense
variable whole, each table's scalars, admission filter and step sum whole,
and of each table's rows only those changed since the previous checkpoint
(created, updated, read for LRU, stamped by expiry) plus the ids removed
since (``rows:removed_ids``). Its manifest names its ``chain``: the ids of
the full checkpoint it starts from and of the deltas between, oldest first.

:func:`find_chain` verifies every link (a damaged or missing one makes the
whole chain unusable, so a restore falls back to an older checkpoint, loudly,
and never half-restores); :class:`CheckpointChain` reads a chain as if it
were one full checkpoint: tensors from the newest link, a table's rows
merged along the chain.

No gRPC here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from ps_server.core.optimizers import make_kernel
from ps_server.core.row_file import record_dtype
from ps_server.durability.format import (
    TENSORS_FILE,
    CheckpointError,
    checkpoint_path,
    read_manifest,
    tensor_name,
    verify,
)
from wehub_ps.specs import VariableSpec

__all__ = ["CheckpointChain", "DiskRowsFile", "chain_ids", "find_chain", "merge_rows"]

#: The tensor of a delta's table holding the ids removed since the previous checkpoint.
REMOVED_IDS = "rows:removed_ids"


def chain_ids(manifest: dict[str, Any]) -> list[int]:
    """The checkpoint ids a checkpoint needs, oldest first, itself last."""
    return [int(i) for i in manifest.get("chain", [])] + [int(manifest["checkpoint_id"])]


def find_chain(directory: Path, checkpoint_id: int) -> list[tuple[Path, dict[str, Any]]]:
    """Checkpoint ``checkpoint_id`` of ``directory`` and the links it needs, oldest first, each verified.

    CheckpointError names the first link that is missing or damaged.
    """
    newest_path = checkpoint_path(directory, checkpoint_id)
    newest = verify(newest_path)
    links = []
    for link in chain_ids(newest)[:-1]:
        path = checkpoint_path(directory, link)
        try:
            manifest = verify(path)
        except CheckpointError as exc:
            raise CheckpointError(f"{newest_path} builds on {path.name}, which is unusable: {exc}") from None
        links.append((path, manifest))
    if links and links[0][1].get("kind", "full") != "full":
        raise CheckpointError(f"{newest_path}: its chain does not start with a full checkpoint")
    return [*links, (newest_path, newest)]


def merge_rows(rows: dict[str, np.ndarray], changed: dict[str, np.ndarray],
               removed: np.ndarray) -> dict[str, np.ndarray]:
    """A table's rows after a delta: ``removed`` ids dropped, ``changed`` rows put in (by id), sorted by id."""
    if set(rows) != set(changed):
        raise CheckpointError(f"a delta holds the row arrays {sorted(changed)}, its base {sorted(rows)}")
    stale = np.isin(rows["ids"], np.concatenate([removed.astype(np.int64), changed["ids"]]))
    merged = {key: np.concatenate([rows[key][~stale], changed[key]]) for key in rows}
    order = np.argsort(merged["ids"], kind="stable")
    return {key: values[order] for key, values in merged.items()}


class CheckpointChain:
    """One shard's checkpoint (full or a delta with its chain), its files open while the context lasts."""

    def __init__(self, links: list[tuple[Path, dict[str, Any]]]) -> None:
        self.links = links
        self._stack = contextlib.ExitStack()
        self._handles: list[Any] = []

    @property
    def manifest(self) -> dict[str, Any]:
        """The newest link's manifest: what the shard held at that checkpoint."""
        return self.links[-1][1]

    def __enter__(self) -> CheckpointChain:
        for path, _ in self.links:
            self._handles.append(self._stack.enter_context(safe_open(str(path / TENSORS_FILE), framework="numpy")))
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()

    def get_tensor(self, name: str) -> np.ndarray:
        """A tensor of the newest link (dense values and slots, a table's filter, step sums)."""
        return self._handles[-1].get_tensor(name)

    def get_slice(self, name: str):
        """A lazily read tensor of the newest link (a dense part's rows, read range by range)."""
        return self._handles[-1].get_slice(name)

    def table_rows(self, spec: VariableSpec) -> tuple[dict[str, np.ndarray], list[DiskRowsFile]]:
        """Every row of a table at the newest link: the full link's rows with each delta applied, as the
        rows in memory and the files of rows a tiered table had on disk (streamed by the restore)."""
        variable = spec.name
        rows: dict[str, np.ndarray] | None = None
        files: list[DiskRowsFile] = []
        for handle, (path, manifest) in zip(self._handles, self.links):
            entry = next((e for e in manifest["variables"] if e["spec"]["name"] == variable), None)
            if entry is None or not entry.get("rows"):
                continue  # created after this link
            arrays = {key: handle.get_tensor(tensor_name(variable, f"rows:{key}")) for key in entry["rows"]}
            if rows is None or not entry.get("removed"):
                rows = arrays  # the table's first link (or a full one) holds every row it had
                files = [DiskRowsFile(path / entry["disk"]["file"], spec, handle, int(entry["disk"]["rows"]))
                         ] if entry.get("disk") else []
            else:
                removed = handle.get_tensor(tensor_name(variable, REMOVED_IDS))
                rows = merge_rows(rows, arrays, removed)
                for file in files:  # a row the delta changed or removed is no longer the file's
                    file.drop(np.concatenate([removed.astype(np.int64), arrays["ids"]]))
        return rows or {}, files


class DiskRowsFile:
    """A checkpoint's file of the rows a tiered table held on disk, read back piece by piece.

    The records are the row file's (ps_server.core.row_file.record_dtype);
    their ids and stamps are tensors of the checkpoint. A restore narrows
    what it takes (``drop``: rows a later delta replaced; ``restrict``: rows
    of another shard) and streams the rest into the restored table.
    """

    def __init__(self, path: Path, spec: VariableSpec, handle: Any, rows: int) -> None:
        self.path = path
        kernel_slots = make_kernel(spec.optimizer).slot_names
        compute = np.dtype(np.float32) if spec.dtype == np.float16 else spec.dtype
        self.record = record_dtype(spec.row_elements, spec.dtype, compute, kernel_slots)
        self.slot_names = kernel_slots
        name = spec.name
        self.ids = handle.get_tensor(tensor_name(name, "disk:ids"))
        self.stamps = {key: handle.get_tensor(tensor_name(name, f"disk:{key}"))
                       for key in ("last_access", "updated_version", "updated_before")}
        if len(self.ids) != rows or path.stat().st_size != rows * self.record.itemsize:
            raise CheckpointError(f"{path}: {path.stat().st_size} bytes for {rows} rows of "
                                  f"{self.record.itemsize} bytes ({len(self.ids)} ids)")
        self.keep = np.ones(rows, bool)
        #: Added to the rows' update versions (a restore onto another shard count rebases them).
        self.version_shift = 0

    @property
    def count(self) -> int:
        return int(np.count_nonzero(self.keep))

    def drop(self, ids: np.ndarray) -> None:
        self.keep &= ~np.isin(self.ids, ids)

    def restrict(self, mask: np.ndarray) -> None:
        self.keep &= mask

    def kept_ids(self) -> np.ndarray:
        return self.ids[self.keep]

    def chunks(self, rows: int) -> Iterator[dict[str, np.ndarray]]:
        with open(self.path, "rb") as f:
            for start in range(0, len(self.ids), rows):
                records = np.fromfile(f, self.record, count=min(rows, len(self.ids) - start))
                keep = self.keep[start:start + len(records)]
                if not keep.any():
                    continue
                records = records[keep]
                at = np.flatnonzero(keep) + start
                out = {"ids": self.ids[at], "value": records["value"], "row_steps": records["row_steps"],
                       **{f"slot:{n}": records[f"slot:{n}"] for n in self.slot_names},
                       **{key: values[at] for key, values in self.stamps.items()}}
                out["updated_version"] = out["updated_version"] + self.version_shift
                yield out


def read_link_manifest(directory: Path, checkpoint_id: int) -> dict[str, Any] | None:
    """A checkpoint's manifest, or None when it is unreadable (for retention only)."""
    try:
        return read_manifest(checkpoint_path(directory, checkpoint_id))
    except CheckpointError:
        return None
