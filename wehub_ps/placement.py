"""Where each variable lives: partitioners and the placement function.

Placement is a pure function of (variable name, shape, dtype, partitioner,
number of shards). Every worker and every server computes it independently
and gets the same answer, in every process and across restarts, because the
only hash involved is BLAKE2b of the name (never Python's ``hash()``).

Invariant of :func:`place` (property-tested):

* the parts cut axis 0 into consecutive, non-overlapping row ranges that
  cover ``[0, rows)`` exactly, in ascending order (a 0-d variable has one row,
  an empty one a single part with no rows);
* every part holds at least one row unless the variable has no rows;
* a ``MinSizePartitioner`` part holds at least ``min_shard_bytes`` and a
  ``MaxSizePartitioner`` part at most ``max_shard_bytes`` (whole rows; when the
  shard count caps the number of parts, parts grow beyond the maximum);
* no two parts share a shard, and every shard index is in ``[0, num_shards)``;
* rows are spread evenly: part sizes differ by at most one row, larger first;
* part ``i`` lives on shard ``(h + i) % num_shards`` where ``h`` is the stable
  hash of the name modulo ``num_shards``, so small variables spread over the
  cluster and a variable split over all shards uses each shard once.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "hash_shards",
    "splitmix64",
    "DEFAULT_MIN_SHARD_BYTES",
    "Partitioner",
    "MinSizePartitioner",
    "FixedShardsPartitioner",
    "MaxSizePartitioner",
    "Part",
    "Placement",
    "place",
    "stable_hash64",
]

# Like TensorFlow's MinSizePartitioner: below 256 KiB a slice is not worth a
# round trip of its own.
DEFAULT_MIN_SHARD_BYTES = 256 * 1024


def stable_hash64(text: str) -> int:
    """A 64-bit hash of ``text`` that is identical in every process."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def _check_positive(name: str, value: int, allow_zero: bool = False) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < (0 if allow_zero else 1):
        kind = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"{name} must be {kind} integer, got {value!r}")


@dataclass(frozen=True)
class MinSizePartitioner:
    """As many parts as possible while each holds at least ``min_shard_bytes``.

    The default: a variable over ``min_shard_bytes`` is split along axis 0
    (over all shards once it is large enough); a smaller one stays whole.
    ``max_shards`` = 0 means no cap beyond the number of shards.
    """

    min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES
    max_shards: int = 0

    def __post_init__(self) -> None:
        _check_positive("min_shard_bytes", self.min_shard_bytes)
        _check_positive("max_shards", self.max_shards, allow_zero=True)

    def num_parts(self, rows: int, row_bytes: int, num_shards: int) -> int:
        if row_bytes == 0:
            return 1  # rows of nothing: no bytes worth spreading
        cap = min(num_shards, self.max_shards or num_shards)
        # Whole rows: a part needs ceil(min_shard_bytes / row_bytes) of them.
        rows_per_part = -(-self.min_shard_bytes // row_bytes)
        return min(cap, max(1, rows // rows_per_part))


@dataclass(frozen=True)
class FixedShardsPartitioner:
    """Exactly ``num_shards`` parts (fewer when there are fewer rows or shards)."""

    num_shards: int

    def __post_init__(self) -> None:
        _check_positive("num_shards", self.num_shards)

    def num_parts(self, rows: int, row_bytes: int, num_shards: int) -> int:
        return min(self.num_shards, num_shards)


@dataclass(frozen=True)
class MaxSizePartitioner:
    """Enough parts that none exceeds ``max_shard_bytes``.

    Capped at the number of shards (each shard holds at most one part of a
    variable); when capped, parts are larger than ``max_shard_bytes``.
    """

    max_shard_bytes: int
    max_shards: int = 0

    def __post_init__(self) -> None:
        _check_positive("max_shard_bytes", self.max_shard_bytes)
        _check_positive("max_shards", self.max_shards, allow_zero=True)

    def num_parts(self, rows: int, row_bytes: int, num_shards: int) -> int:
        cap = min(num_shards, self.max_shards or num_shards)
        # Whole rows: a part may take floor(max_shard_bytes / row_bytes) of them.
        rows_per_part = max(1, self.max_shard_bytes // max(1, row_bytes))
        return min(cap, max(1, math.ceil(rows / rows_per_part)))


Partitioner = MinSizePartitioner | FixedShardsPartitioner | MaxSizePartitioner


@dataclass(frozen=True)
class Part:
    """Rows ``[row_start, row_end)`` of a variable, held by ``shard``."""

    shard: int
    row_start: int
    row_end: int

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start


@dataclass(frozen=True)
class Placement:
    """All parts of one variable, in row order."""

    parts: tuple[Part, ...]

    def part_on(self, shard: int) -> Part | None:
        """The part that ``shard`` holds, or None."""
        for part in self.parts:
            if part.shard == shard:
                return part
        return None

    @property
    def shards(self) -> tuple[int, ...]:
        return tuple(p.shard for p in self.parts)


def rows_of(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows along axis 0, elements per row); a 0-d variable is one row of one."""
    if not shape:
        return 1, 1
    return shape[0], math.prod(shape[1:])


def place(
    name: str,
    shape: tuple[int, ...],
    itemsize: int,
    partitioner: Partitioner,
    num_shards: int,
) -> Placement:
    """The placement of one variable; see the module docstring for the invariant."""
    _check_positive("num_shards", num_shards)
    rows, row_elements = rows_of(shape)
    start_shard = stable_hash64(name) % num_shards
    if rows == 0:
        return Placement((Part(start_shard, 0, 0),))
    num_parts = partitioner.num_parts(rows, row_elements * itemsize, num_shards)
    num_parts = max(1, min(num_parts, rows, num_shards))
    base, extra = divmod(rows, num_parts)
    parts = []
    row = 0
    for i in range(num_parts):
        size = base + (1 if i < extra else 0)
        parts.append(Part((start_shard + i) % num_shards, row, row + size))
        row += size
    return Placement(tuple(parts))


def splitmix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer of each uint64 (a new array): well-mixed bits, identical everywhere."""
    z = np.asarray(values).astype(np.uint64)  # int64 wraps around: the bits are kept
    with np.errstate(over="ignore"):
        z += np.uint64(0x9E3779B97F4A7C15)
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return z


def hash_shards(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard of each hash-table row id: SplitMix64(id) mod num_shards.

    A pure function of the id and the shard count (invariant: identical in
    every process); the mixing spreads consecutive ids evenly.
    """
    _check_positive("num_shards", num_shards)
    z = splitmix64(np.asarray(ids, dtype=np.int64))
    return (z % np.uint64(num_shards)).astype(np.int64)
