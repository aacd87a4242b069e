"""A batch of row ids as its sorted unique ids and, per id, which of them it is: one hash pass, no sort of the batch.

A worker pulls the rows of a batch's unique ids and sums the gradients of
repeated ids before a push. Sorting the batch to find them cost 75-105 us
for 4,096 ids (NumPy 2.4, 2-core EPYC); a Zipf batch has about 1,350
unique ids, so one pass that hashes each id into an open-addressing table
and then sorts only the unique ids takes 27 us. The sums add each id's
rows in order of occurrence, so they are bit for bit those of
``np.add.at`` and of :func:`wehub_ps.kernels.segments.numpy_sum_sorted`.

Both loops are compiled by numba (``compiled_soon``); until they are
loaded, and without numba, the same results come from the sort in
:mod:`wehub_ps.kernels.segments`.
"""

from __future__ import annotations

import numpy as np

from wehub_ps.kernels.compiled import compiled_soon
from wehub_ps.kernels.segments import numpy_sum_sorted, sort_ids

__all__ = ["group_ids", "sum_groups"]

# Fibonacci hashing (Knuth): the id times 2^64 / golden ratio, its top bits pick the bucket.
_FIBONACCI = 0x9E3779B97F4A7C15
_MIN_BUCKETS = 64
#: Fewer ids than this are sorted: as fast, and a worker with only small batches never loads numba.
_COMPILED_FROM = 64


def group_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the sorted unique ids as int64, ``inverse``): ``unique[inverse[i]] == ids[i]``, inverse int64."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    n = len(ids)
    kernel = compiled_soon(_group, _group_signatures) if n >= _COMPILED_FROM else None
    if kernel is None:
        order, sorted_ids, first = sort_ids(ids, keep_order_of_repeats=False)
        inverse = np.empty(n, np.int64)
        inverse[order] = np.cumsum(first) - 1
        return sorted_ids[first].astype(np.int64, copy=False), inverse
    bits = max(_MIN_BUCKETS, 2 * n - 1).bit_length()  # at most half full
    bucket_ids = np.empty(1 << bits, np.int64)
    bucket_groups = np.full(1 << bits, -1, np.int64)
    inverse = np.empty(n, np.int64)
    unique = kernel(ids, bits, bucket_ids, bucket_groups, np.empty(n, np.int64), inverse)
    return unique, inverse


def sum_groups(values: np.ndarray, inverse: np.ndarray, groups: int) -> np.ndarray:
    """Row g of the result: the sum of the rows i of ``values`` with ``inverse[i] == g``, added in order of i.

    ``values`` has shape (len(inverse), ...); every group must have a row.
    """
    flat = values.reshape(len(values), int(np.prod(values.shape[1:])))
    if flat.dtype in (np.float32, np.float64) and flat.flags.c_contiguous and flat.flags.aligned:
        kernel = compiled_soon(_sum_in_groups, _sum_in_groups_signatures)
        if kernel is not None:
            sums = np.empty((groups, flat.shape[1]), flat.dtype)
            kernel(flat, np.ascontiguousarray(inverse, np.int64), np.zeros(groups, np.bool_), sums)
            return sums.reshape((groups, *values.shape[1:]))
    order = np.argsort(inverse, kind="stable")
    in_order = inverse[order]
    first = np.ones(len(order), dtype=bool)
    np.not_equal(in_order[1:], in_order[:-1], out=first[1:])
    return numpy_sum_sorted(values, order, in_order, first)[1]


def _group(ids, bits, bucket_ids, bucket_groups, first_seen, inverse):  # pragma: no cover - compiled by numba
    """Each id into the table (linear probing): a new one gets the next group; then groups renumbered in id order."""
    mask = (1 << bits) - 1
    shift = np.uint64(64 - bits)
    count = 0
    for i in range(ids.shape[0]):
        x = ids[i]
        h = np.int64((np.uint64(x) * np.uint64(_FIBONACCI)) >> shift)
        while True:
            g = bucket_groups[h]
            if g < 0:
                bucket_ids[h] = x
                bucket_groups[h] = count
                first_seen[count] = x
                inverse[i] = count
                count += 1
                break
            if bucket_ids[h] == x:
                inverse[i] = g
                break
            h = (h + 1) & mask
    order = np.argsort(first_seen[:count])
    rank = np.empty(count, np.int64)
    unique = np.empty(count, np.int64)
    for k in range(count):
        rank[order[k]] = k
        unique[k] = first_seen[order[k]]
    for i in range(ids.shape[0]):
        inverse[i] = rank[inverse[i]]
    return unique


def _group_signatures(types) -> list:
    ints = types.Array(types.int64, 1, "C")
    return [types.Array(types.int64, 1, "C")(types.Array(types.int64, 1, "C", readonly=True), types.int64,
                                             ints, ints, ints, ints)]


def _sum_in_groups(values, inverse, started, sums):  # pragma: no cover - compiled by numba
    """Row i of ``values`` starts or adds to row ``inverse[i]`` of ``sums``, in order of i."""
    width = values.shape[1]
    for i in range(values.shape[0]):
        g = inverse[i]
        if started[g]:
            for j in range(width):
                sums[g, j] += values[i, j]
        else:
            started[g] = True
            for j in range(width):
                sums[g, j] = values[i, j]


def _sum_in_groups_signatures(types) -> list:
    # values and inverse read only (a read-only array, such as JAX's, converts to that; a writable one too)
    return [types.void(types.Array(dtype, 2, "C", readonly=True), types.Array(types.int64, 1, "C", readonly=True),
                       types.Array(types.boolean, 1, "C"), types.Array(dtype, 2, "C"))
            for dtype in (types.float32, types.float64)]
