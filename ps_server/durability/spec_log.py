"""Variables made durable the moment they are created, before any checkpoint.

A checkpoint holds what a shard held at its instant; a variable created
after the last checkpoint would be lost with a crash, and every worker would
then find it missing. So each shard also keeps a spec log next to its
checkpoints::

    shard-0-of-3/
        spec-log.jsonl          one record per line: a spec, or an initial value
        initial-values/         this shard's rows of each uploaded initial value
            <name digest>-<id>.safetensors
        ckpt-0000000007/ ...

A create is acknowledged only after its spec record is appended and
fsynced; an ASSIGN push (an uploaded initial value) only after the value's
file is written and fsynced, renamed into place, and its record appended.
Values from an initializer are not stored: they are a pure function of the
spec's seed and regenerate bit for bit (wehub_ps.initializers).

Every record carries a SHA-256 of itself, every value file's record the
file's SHA-256: a torn last line (a crash during the append) or a damaged
file is skipped with a log line, never loaded.

After each checkpoint, the records of variables that the oldest kept
checkpoint holds (with their values) are dropped: every checkpoint a
restore could fall back to has them.

On restore the log is replayed after the checkpoint: a variable the
checkpoint does not hold is recreated with its initial value, and one the
checkpoint holds still waiting for its value gets the value if the log has
it. The records are layout-independent (global row ranges), so a server
started with another ``--num-shards`` assembles its rows from the old
shards' logs like it does from their checkpoints.

No gRPC here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from ps_server.core.optimizers import make_kernel
from ps_server.core.persistence import LoadedPart
from ps_server.durability.format import (
    SPEC_LOG_FILE,
    CheckpointError,
    fsync_path,
    oldest_checkpoint,
    read_manifest,
    sha256_file,
    shard_dir,
    spec_from_json,
    spec_to_json,
)
from wehub_ps.initializers import fill_initial_values
from wehub_ps.placement import rows_of
from wehub_ps.process.logs import event
from wehub_ps.specs import Explicit, VariableSpec

__all__ = ["SpecLog", "replay_spec_logs"]

log = logging.getLogger("ps_server.durability.spec_log")

VALUES_DIR = "initial-values"
_VALUE_TENSOR = "value"


def _sealed(record: dict[str, Any]) -> str:
    body = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return json.dumps({**record, "sha256": hashlib.sha256(body.encode()).hexdigest()},
                      sort_keys=True, separators=(",", ":"))


def _unsealed(line: str) -> dict[str, Any] | None:
    """The record of one line, or None when the line is torn or damaged."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    claimed = record.pop("sha256", None)
    body = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return record if hashlib.sha256(body.encode()).hexdigest() == claimed else None


class SpecLog:
    """This shard's spec log (appending side); thread-safe.

    Each method returns once what it recorded is on disk (file and
    directory fsynced). Errors (a full disk) propagate: the create or
    upload is then not acknowledged.
    """

    def __init__(self, root: str | os.PathLike, shard_index: int, num_shards: int) -> None:
        self._directory = shard_dir(root, shard_index, num_shards)
        self._path = self._directory / SPEC_LOG_FILE
        # Serialises appends, so records never interleave; guards nothing else.
        self._lock = threading.Lock()
        values_dir = self._directory / VALUES_DIR
        if values_dir.is_dir():  # value files half written when a server died
            for path in values_dir.glob(".tmp-*"):
                path.unlink(missing_ok=True)

    def record_spec(self, spec: VariableSpec) -> None:
        """Make ``spec`` durable (a variable this shard created)."""
        self._append({"kind": "spec", "spec": spec_to_json(spec), "created_unix": time.time()})

    def record_initial_value(self, spec: VariableSpec, row_start: int, row_end: int,
                             value: np.ndarray) -> None:
        """Make this shard's rows [row_start, row_end) of ``spec``'s uploaded initial value durable."""
        values_dir = self._directory / VALUES_DIR
        values_dir.mkdir(parents=True, exist_ok=True)
        name = f"{hashlib.sha256(spec.name.encode()).hexdigest()[:32]}-{uuid.uuid4().hex[:12]}.safetensors"
        tmp = values_dir / f".tmp-{name}"
        save_file({_VALUE_TENSOR: np.ascontiguousarray(value)}, str(tmp))
        fsync_path(tmp)
        os.rename(tmp, values_dir / name)
        fsync_path(values_dir, directory=True)
        self._append({"kind": "initial_value", "variable": spec.name, "row_start": row_start,
                      "row_end": row_end, "file": f"{VALUES_DIR}/{name}",
                      "file_sha256": sha256_file(values_dir / name), "created_unix": time.time()})

    def prune(self) -> None:
        """Drop the records (and value files) of variables the oldest kept checkpoint holds.

        Called after a checkpoint is written: any checkpoint a restore could
        fall back to then holds those variables (with their values), so the
        log only keeps what was created since and stays small.
        """
        oldest = oldest_checkpoint(self._directory)
        if oldest is None:
            return
        try:
            manifest = read_manifest(oldest)
        except CheckpointError:
            return  # damaged: keep everything; the next checkpoint tries again
        held = {entry["spec"]["name"] for entry in manifest["variables"] if entry["initialized"]}
        with self._lock:
            records = _read_records(self._directory)
            kept = [r for r in records if _variable(r) not in held]
            if len(kept) == len(records):
                return
            tmp = self._directory / f".tmp-{SPEC_LOG_FILE}"
            tmp.write_text("".join(_sealed({k: v for k, v in r.items() if k != "directory"}) + "\n"
                                   for r in kept))
            fsync_path(tmp)
            os.rename(tmp, self._path)
            fsync_path(self._directory, directory=True)
            still_used = {r["file"] for r in kept if r["kind"] == "initial_value"}
            for record in records:
                if record["kind"] == "initial_value" and record["file"] not in still_used:
                    (self._directory / record["file"]).unlink(missing_ok=True)

    def _append(self, record: dict[str, Any]) -> None:
        line = (_sealed(record) + "\n").encode()
        with self._lock:
            self._directory.mkdir(parents=True, exist_ok=True)
            new = not self._path.exists()
            fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)
            if new:
                fsync_path(self._directory, directory=True)


def _variable(record: dict[str, Any]) -> str:
    return record["spec"]["name"] if record["kind"] == "spec" else record["variable"]


def _read_records(directory: Path) -> list[dict[str, Any]]:
    path = directory / SPEC_LOG_FILE
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable: {exc}") from None
    records = []
    for number, line in enumerate(lines, 1):
        record = _unsealed(line)
        if record is None:
            # A crash during an append tears the last line; its create was never acknowledged.
            event(log, logging.ERROR if number < len(lines) else logging.WARNING,
                  "SPEC LOG RECORD SKIPPED: damaged", path=str(path), line=number)
            continue
        record["directory"] = directory
        records.append(record)
    return records


def replay_spec_logs(directories: Iterable[Path], loaded: list[LoadedPart], shard_index: int,
                     num_shards: int) -> list[LoadedPart]:
    """``loaded`` (from the checkpoints) plus every variable the spec logs in ``directories`` add.

    ``directories`` are the shard directories of the layout restored from
    (any shard count: the records hold global row ranges).

    A variable the checkpoints hold keeps their state; one still waiting for
    its explicit value there takes the logged value when there is one.
    """
    specs: dict[str, VariableSpec] = {}
    values: dict[str, list[dict[str, Any]]] = {}
    for directory in directories:
        for record in _read_records(directory):
            if record["kind"] == "spec":
                spec = spec_from_json(record["spec"])
                known = specs.setdefault(spec.name, spec)
                if known != spec:
                    raise CheckpointError(f"spec logs disagree about the spec of {spec.name!r}: "
                                          + "; ".join(known.differences(spec)))
            elif record["kind"] == "initial_value":
                values.setdefault(record["variable"], []).append(record)
    parts = {part.spec.name: part for part in loaded}
    for name, spec in specs.items():
        part = parts.get(name)
        if part is not None and part.spec != spec:
            raise CheckpointError(f"the spec log and the checkpoint disagree about {name!r}: "
                                  + "; ".join(part.spec.differences(spec)))
        if part is None:
            parts[name] = _fresh_part(spec, values.get(name, []), shard_index, num_shards)
        elif not part.initialized and part.holds_part and isinstance(spec.initializer, Explicit):
            value = _logged_value(spec, part.row_start, part.row_end, values.get(name, []))
            if value is not None:
                parts[name] = LoadedPart(spec, part.row_start, part.row_end, True, part.version,
                                         part.optimizer_steps, True, value, part.slots, part.row_steps)
    return list(parts.values())


def _fresh_part(spec: VariableSpec, logged: list[dict[str, Any]], shard_index: int,
                num_shards: int) -> LoadedPart:
    """A variable as ``create`` makes it: initial values regenerated, or uploaded ones from the log."""
    if spec.hash_table:  # rows are made on first touch, from the seed
        kernel = make_kernel(spec.optimizer)
        width = spec.row_elements
        compute = np.dtype(np.float32) if spec.dtype == np.float16 else spec.dtype
        rows = {"ids": np.empty(0, np.int64), "value": np.empty((0, width), spec.dtype),
                "row_steps": np.empty(0, np.int64), "last_access": np.empty(0, np.int64),
                **{f"slot:{n}": np.empty((0, width), compute) for n in kernel.slot_names}}
        return LoadedPart(spec, 0, 0, True, 0, 0, True, np.empty(0, spec.dtype), {}, rows=rows)
    placed = spec.placement(num_shards).part_on(shard_index)
    row_start, row_end = (placed.row_start, placed.row_end) if placed else (0, 0)
    width = rows_of(spec.shape)[1]
    initialized = True
    if isinstance(spec.initializer, Explicit):
        value = _logged_value(spec, row_start, row_end, logged) if placed else None
        initialized = value is not None or placed is None
        if value is None:
            value = np.zeros((row_end - row_start) * width, spec.dtype)
    else:
        value = np.empty((row_end - row_start) * width, spec.dtype)
        fill_initial_values(spec.initializer, spec.shape, value, row_start * width)
    return LoadedPart(spec, row_start, row_end, placed is not None, 0, 0, initialized, value, {})


def _logged_value(spec: VariableSpec, row_start: int, row_end: int,
                  logged: list[dict[str, Any]]) -> np.ndarray | None:
    """Rows [row_start, row_end) of the uploaded initial value, or None unless the log covers them all."""
    width = rows_of(spec.shape)[1]
    value = np.empty((row_end - row_start) * width, spec.dtype)
    covered = np.zeros(row_end - row_start, bool)
    for record in logged:
        lo, hi = max(row_start, record["row_start"]), min(row_end, record["row_end"])
        if lo >= hi or covered[lo - row_start:hi - row_start].all():
            continue
        path = record["directory"] / record["file"]
        try:
            if sha256_file(path) != record["file_sha256"]:
                raise OSError("checksum mismatch")
            with safe_open(str(path), framework="numpy") as f:
                rows = f.get_slice(_VALUE_TENSOR)[(lo - record["row_start"]) * width:
                                                  (hi - record["row_start"]) * width]
        except OSError as exc:
            event(log, logging.ERROR, "INITIAL VALUE SKIPPED: damaged", path=str(path), error=str(exc))
            continue
        value[(lo - row_start) * width:(hi - row_start) * width] = rows
        covered[lo - row_start:hi - row_start] = True
    return value if covered.all() else None
