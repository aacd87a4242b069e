"""The on-disk checkpoint format: where things lie, and how to tell a checkpoint is intact.

Layout under ``--checkpoint-dir`` (one root shared by every shard of a job)::

    shard-0-of-3/
        ckpt-0000000007/
            tensors.safetensors   values and optimizer slots of this shard
            manifest.json         specs, row ranges, versions, optimizer steps,
                                  the exactly-once ledger, file checksums
        ckpt-0000000008/ ...
        spec-log.jsonl            variables created since (see ps_server.durability.spec_log)

The manifest carries the SHA-256 of each file and of itself: a checkpoint
that fails any check (half written, truncated, bytes flipped) is never
loaded. Writing lives in ps_server.durability.writer, choosing and loading
in ps_server.durability.restore and ps_server.durability.reshard; both go
through the names and checks defined here.

No gRPC here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from wehub_ps.specs import VariableSpec
from wehub_ps.specs_proto import spec_from_proto, spec_to_proto
from wehub_ps.v1 import ps_pb2

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "TENSORS_FILE",
    "MANIFEST_FILE",
    "SPEC_LOG_FILE",
    "CheckpointError",
    "shard_dir",
    "shard_dir_layout",
    "checkpoint_ids",
    "checkpoint_path",
    "oldest_checkpoint",
    "tensor_name",
    "fsync_path",
    "sha256_file",
    "checksummed",
    "spec_to_json",
    "spec_from_json",
    "read_manifest",
    "verify",
]

FORMAT = "wehub-ps-checkpoint"
FORMAT_VERSION = 1
TENSORS_FILE = "tensors.safetensors"
MANIFEST_FILE = "manifest.json"
SPEC_LOG_FILE = "spec-log.jsonl"
_CKPT = re.compile(r"ckpt-(\d{10})")
_SHARD_DIR = re.compile(r"shard-(\d+)-of-(\d+)")
_ROLE_SEPARATOR = "@"  # variable names never contain it (see wehub_ps.specs)


class CheckpointError(Exception):
    """A checkpoint is missing, damaged, or cannot be used; the message says which and why."""


# ---- where things lie ------------------------------------------------------------------


def shard_dir(root: str | os.PathLike, shard_index: int, num_shards: int) -> Path:
    """The directory holding one shard's checkpoints and spec log."""
    return Path(root) / f"shard-{shard_index}-of-{num_shards}"


def shard_dir_layout(path: Path) -> tuple[int, int] | None:
    """(shard index, shard count) named by a shard directory; None for any other name."""
    m = _SHARD_DIR.fullmatch(path.name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def checkpoint_ids(directory: Path) -> list[int]:
    """The ids of the checkpoints in a shard directory, oldest first (temporaries excluded)."""
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := _CKPT.fullmatch(p.name)))


def checkpoint_path(directory: Path, checkpoint_id: int) -> Path:
    return directory / f"ckpt-{checkpoint_id:010d}"


def oldest_checkpoint(directory: Path) -> Path | None:
    """The oldest checkpoint kept in a shard directory (None if there is none)."""
    ids = checkpoint_ids(directory)
    return checkpoint_path(directory, ids[0]) if ids else None


def tensor_name(variable: str, role: str = "") -> str:
    """The safetensors key of a variable's value (no role) or of one of its other arrays."""
    return f"{variable}{_ROLE_SEPARATOR}{role}" if role else variable


# ---- integrity ---------------------------------------------------------------------------


def fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def checksummed(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` with the SHA-256 of its canonical JSON added as ``manifest_sha256``."""
    body = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    return {**manifest, "manifest_sha256": hashlib.sha256(body.encode()).hexdigest()}


def spec_to_json(spec: VariableSpec) -> dict[str, Any]:
    from google.protobuf import json_format  # here: 15-20 ms of a start that needs it only for checkpoints

    return json_format.MessageToDict(spec_to_proto(spec), preserving_proto_field_name=True)


def spec_from_json(data: dict[str, Any]) -> VariableSpec:
    from google.protobuf import json_format

    return spec_from_proto(json_format.ParseDict(data, ps_pb2.VariableSpec()))


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
    if checksummed(manifest)["manifest_sha256"] != claimed:
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
        if sha256_file(file) != expected["sha256"]:
            raise CheckpointError(f"{path}: {name} checksum mismatch (corrupted)")
    return manifest
