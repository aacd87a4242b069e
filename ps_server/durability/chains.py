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
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from ps_server.durability.format import (
    TENSORS_FILE,
    CheckpointError,
    checkpoint_path,
    read_manifest,
    tensor_name,
    verify,
)

__all__ = ["CheckpointChain", "chain_ids", "find_chain", "merge_rows"]

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

    def table_rows(self, variable: str) -> dict[str, np.ndarray]:
        """Every row of a table at the newest link: the full link's rows with each delta applied."""
        rows: dict[str, np.ndarray] | None = None
        for handle, (_, manifest) in zip(self._handles, self.links):
            entry = next((e for e in manifest["variables"] if e["spec"]["name"] == variable), None)
            if entry is None or not entry.get("rows"):
                continue  # created after this link
            arrays = {key: handle.get_tensor(tensor_name(variable, f"rows:{key}")) for key in entry["rows"]}
            if rows is None or not entry.get("removed"):
                rows = arrays  # the table's first link (or a full one) holds every row it had
            else:
                rows = merge_rows(rows, arrays, handle.get_tensor(tensor_name(variable, REMOVED_IDS)))
        return rows or {}


def read_link_manifest(directory: Path, checkpoint_id: int) -> dict[str, Any] | None:
    """A checkpoint's manifest, or None when it is unreadable (for retention only)."""
    try:
        return read_manifest(checkpoint_path(directory, checkpoint_id))
    except CheckpointError:
        return None
