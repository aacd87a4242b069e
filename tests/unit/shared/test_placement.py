"""Property tests of wehub_ps.placement.place() and the partitioners."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wehub_ps.placement import (
    DEFAULT_MIN_SHARD_BYTES,
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Part,
    Placement,
    place,
    rows_of,
    stable_hash64,
)

ROOT = pathlib.Path(__file__).resolve().parents[3]

names = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)),
                min_size=1, max_size=30)
shapes = st.lists(st.integers(0, 2000), min_size=0, max_size=3).map(tuple)
itemsizes = st.sampled_from([1, 2, 4, 8])
partitioners = st.one_of(
    st.builds(MinSizePartitioner, st.integers(1, 1 << 20), st.integers(0, 70)),
    st.builds(FixedShardsPartitioner, st.integers(1, 70)),
    st.builds(MaxSizePartitioner, st.integers(1, 1 << 20), st.integers(0, 70)),
)


def _expected_start(name: str, num_shards: int) -> int:
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % num_shards


def check_invariant(name, shape, itemsize, partitioner, num_shards, placement: Placement):
    parts = placement.parts
    assert isinstance(parts, tuple) and parts, "a placement always has at least one part"
    rows = shape[0] if shape else 1
    h = _expected_start(name, num_shards)

    if rows == 0:
        assert len(parts) == 1
        assert (parts[0].row_start, parts[0].row_end) == (0, 0)
        assert parts[0].shard == h
        return

    # Consecutive, non-overlapping, ascending, covering [0, rows) exactly.
    assert parts[0].row_start == 0
    assert parts[-1].row_end == rows
    for before, after in zip(parts, parts[1:]):
        assert before.row_end == after.row_start
    # Non-empty parts.
    assert all(p.rows >= 1 for p in parts)
    assert sum(p.rows for p in parts) == rows
    # Distinct shards, all in range.
    shards = [p.shard for p in parts]
    assert len(set(shards)) == len(shards)
    assert all(0 <= s < num_shards for s in shards)
    assert len(parts) <= min(rows, num_shards)
    # Even spread, larger parts first.
    sizes = [p.rows for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    # Part i on (h + i) % n.
    for i, part in enumerate(parts):
        assert part.shard == (h + i) % num_shards
    assert placement.shards == tuple(shards)
    # part_on finds each part, and None elsewhere.
    for s in range(num_shards):
        found = placement.part_on(s)
        if s in shards:
            assert found == parts[shards.index(s)]
        else:
            assert found is None


@given(names, shapes, itemsizes, partitioners, st.integers(1, 64))
@settings(max_examples=400, deadline=None)
def test_place_invariant(name, shape, itemsize, partitioner, num_shards):
    placement = place(name, shape, itemsize, partitioner, num_shards)
    check_invariant(name, shape, itemsize, partitioner, num_shards, placement)


@given(names, shapes, itemsizes, partitioners, st.integers(1, 64))
@settings(max_examples=200, deadline=None)
def test_number_of_parts_follows_the_partitioner(name, shape, itemsize, partitioner, num_shards):
    rows, row_elements = rows_of(shape)
    placement = place(name, shape, itemsize, partitioner, num_shards)
    if rows == 0:
        assert len(placement.parts) == 1
        return
    if isinstance(partitioner, FixedShardsPartitioner):
        wanted = partitioner.num_shards
    elif isinstance(partitioner, MinSizePartitioner):
        # Whole rows: as many parts as fit ceil(min_shard_bytes / row_bytes) rows each.
        row_bytes = row_elements * itemsize
        wanted = max(1, rows // math.ceil(partitioner.min_shard_bytes / row_bytes)) if row_bytes else 1
        if partitioner.max_shards:
            wanted = min(wanted, partitioner.max_shards)
    else:
        row_bytes = max(1, row_elements * itemsize)
        wanted = max(1, math.ceil(rows / max(1, partitioner.max_shard_bytes // row_bytes)))
        if partitioner.max_shards:
            wanted = min(wanted, partitioner.max_shards)
    assert len(placement.parts) == max(1, min(wanted, rows, num_shards))
    if isinstance(partitioner, MinSizePartitioner) and len(placement.parts) > 1:
        row_bytes = row_elements * itemsize
        # Every part, the smallest included, holds at least min_shard_bytes.
        assert min(p.rows for p in placement.parts) * row_bytes >= partitioner.min_shard_bytes
    if (isinstance(partitioner, MaxSizePartitioner) and not partitioner.max_shards
            and wanted <= min(rows, num_shards)):
        row_bytes = row_elements * itemsize
        # Uncapped: no part exceeds the limit (unless a single row does).
        assert max(p.rows for p in placement.parts) * row_bytes <= max(
            partitioner.max_shard_bytes, row_bytes)


def test_zero_d_variable_is_one_row_on_one_shard():
    placement = place("scalar", (), 4, FixedShardsPartitioner(8), 8)
    assert placement.parts == (Part(_expected_start("scalar", 8), 0, 1),)
    assert rows_of(()) == (1, 1)


def test_rows_with_no_elements_still_split():
    # (10, 0): ten rows of nothing; a FixedShards split is still well formed.
    placement = place("e", (10, 0), 4, FixedShardsPartitioner(3), 4)
    assert [p.rows for p in placement.parts] == [4, 3, 3]


def test_one_shard_holds_everything():
    placement = place("big", (10**6, 100), 8, MinSizePartitioner(), 1)
    assert placement.parts == (Part(0, 0, 10**6),)


# ---- golden values: placement must never change between releases -----------------


_GOLDEN_HASHES = {
    "embedding/table": 16011537286562464807,
    "dense_1/kernel:0": 788740455291454128,
    "x": 5717441744405258058,
    "ünï": 10938549402560586072,
}


@pytest.mark.parametrize("name", sorted(_GOLDEN_HASHES))
def test_stable_hash_golden_values(name):
    assert stable_hash64(name) == _GOLDEN_HASHES[name]
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
    assert stable_hash64(name) == int.from_bytes(digest, "little")


_SUBPROCESS_CASES = [
    ("embedding/table", [100_000, 64], 4, ["min_size", 262144, 0], 7),
    ("dense_1/kernel:0", [512, 512], 4, ["fixed", 3], 5),
    ("bias", [10], 8, ["max_size", 16, 0], 4),
    ("w", [33, 2], 2, ["max_size", 10, 2], 9),
    ("ünï/kernel", [1000], 4, ["fixed", 64], 16),
]

_SUBPROCESS_SCRIPT = """
import json, sys
from wehub_ps.placement import place, MinSizePartitioner, FixedShardsPartitioner, MaxSizePartitioner
cases = json.loads(sys.argv[1])
out = []
for name, shape, itemsize, spec, n in cases:
    kind, *args = spec
    cls = {"min_size": MinSizePartitioner, "fixed": FixedShardsPartitioner,
           "max_size": MaxSizePartitioner}[kind]
    p = place(name, tuple(shape), itemsize, cls(*args), n)
    out.append([[q.shard, q.row_start, q.row_end] for q in p.parts])
print(json.dumps(out))
"""


def _local_placements():
    classes = {"min_size": MinSizePartitioner, "fixed": FixedShardsPartitioner,
               "max_size": MaxSizePartitioner}
    out = []
    for name, shape, itemsize, (kind, *args), n in _SUBPROCESS_CASES:
        p = place(name, tuple(shape), itemsize, classes[kind](*args), n)
        out.append([[q.shard, q.row_start, q.row_end] for q in p.parts])
    return out


@pytest.mark.parametrize("hash_seed", ["0", "1", "12345"])
def test_placement_is_identical_in_other_processes(hash_seed):
    env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS_SCRIPT, json.dumps(_SUBPROCESS_CASES)],
        env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=60, check=True,
    )
    assert json.loads(result.stdout) == _local_placements()


def test_python_hash_differs_between_those_processes():
    """Makes the test above meaningful: hash() would not have agreed."""
    hashes = set()
    for seed in ("1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", "print(hash('embedding/table'))"],
                             env=env, capture_output=True, text=True, timeout=60, check=True)
        hashes.add(int(out.stdout))
    assert len(hashes) == 2


# ---- MinSizePartitioner defaults ---------------------------------------------------


def test_min_size_keeps_a_small_variable_whole():
    partitioner = MinSizePartitioner()
    assert partitioner.min_shard_bytes == DEFAULT_MIN_SHARD_BYTES == 256 * 1024
    assert partitioner.max_shards == 0
    # 100 x 100 float32 = 40 KB: one part, on the hashed shard.
    placement = place("small", (100, 100), 4, partitioner, 8)
    assert placement.parts == (Part(_expected_start("small", 8), 0, 100),)
    # Just under two minimum shards: still one part.
    rows = (2 * DEFAULT_MIN_SHARD_BYTES - 4) // 4
    assert len(place("almost", (rows,), 4, partitioner, 8).parts) == 1


def test_min_size_splits_a_large_variable_over_all_shards():
    partitioner = MinSizePartitioner()
    # 1M x 64 float32 = 256 MiB over 8 shards: each shard holds one part.
    placement = place("embedding", (1_000_000, 64), 4, partitioner, 8)
    assert len(placement.parts) == 8
    assert sorted(placement.shards) == list(range(8))
    assert [p.rows for p in placement.parts] == [125_000] * 8


def test_min_size_medium_variable_uses_some_shards():
    # 3 minimum shards' worth of bytes over 8 shards: 3 parts.
    rows = 3 * DEFAULT_MIN_SHARD_BYTES // 4
    placement = place("medium", (rows,), 4, MinSizePartitioner(), 8)
    assert len(placement.parts) == 3
    assert min(p.rows for p in placement.parts) * 4 >= DEFAULT_MIN_SHARD_BYTES


def test_min_size_max_shards_caps_the_split():
    placement = place("embedding", (1_000_000, 64), 4, MinSizePartitioner(max_shards=3), 8)
    assert len(placement.parts) == 3


def test_max_size_partitioner_counts():
    # 100 rows x 40 bytes = 4000 bytes; at most 1000 bytes a part -> 4 parts.
    placement = place("m", (100, 10), 4, MaxSizePartitioner(1000), 16)
    assert [p.rows for p in placement.parts] == [25] * 4
    # 4001 bytes would need 5; with 3 shards it is capped (parts get bigger).
    placement = place("m", (100, 10), 4, MaxSizePartitioner(999), 3)
    assert [p.rows for p in placement.parts] == [34, 33, 33]


def test_fixed_shards_partitioner_counts():
    assert len(place("f", (10, 3), 4, FixedShardsPartitioner(4), 8).parts) == 4
    assert len(place("f", (10, 3), 4, FixedShardsPartitioner(12), 8).parts) == 8
    assert len(place("f", (3, 3), 4, FixedShardsPartitioner(12), 8).parts) == 3


# ---- argument validation ------------------------------------------------------------


@pytest.mark.parametrize("make, argument", [
    (lambda: MinSizePartitioner(min_shard_bytes=0), "min_shard_bytes"),
    (lambda: MinSizePartitioner(min_shard_bytes=-5), "min_shard_bytes"),
    (lambda: MinSizePartitioner(min_shard_bytes=1.5), "min_shard_bytes"),
    (lambda: MinSizePartitioner(min_shard_bytes=True), "min_shard_bytes"),
    (lambda: MinSizePartitioner(max_shards=-1), "max_shards"),
    (lambda: MinSizePartitioner(max_shards="2"), "max_shards"),
    (lambda: FixedShardsPartitioner(0), "num_shards"),
    (lambda: FixedShardsPartitioner(-3), "num_shards"),
    (lambda: FixedShardsPartitioner(2.0), "num_shards"),
    (lambda: MaxSizePartitioner(0), "max_shard_bytes"),
    (lambda: MaxSizePartitioner(None), "max_shard_bytes"),
    (lambda: MaxSizePartitioner(100, max_shards=-2), "max_shards"),
    (lambda: place("v", (3,), 4, MinSizePartitioner(), 0), "num_shards"),
    (lambda: place("v", (3,), 4, MinSizePartitioner(), -1), "num_shards"),
])
def test_partitioner_arguments_are_validated(make, argument):
    with pytest.raises(ValueError) as info:
        make()
    assert argument in str(info.value)


def test_zero_max_shards_is_allowed_and_means_no_cap():
    assert MinSizePartitioner(max_shards=0).max_shards == 0
    assert MaxSizePartitioner(10, max_shards=0).max_shards == 0
    assert len(place("v", (100,), 1, MaxSizePartitioner(10, max_shards=0), 50).parts) == 10


def test_min_size_parts_hold_at_least_min_shard_bytes():
    # 49 rows of 106 bytes = 5194 bytes -> 3 parts of 17/16/16 rows; 16 * 106 = 1696 < 1725.
    placement = place("0", (49, 53), 2, MinSizePartitioner(1725), 3)
    assert min(p.rows for p in placement.parts) * 106 >= 1725
