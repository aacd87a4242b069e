"""IdIndex: the same answers as a dict, over any sequence of batched inserts, removals and lookups."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_server.core import id_index
from ps_server.core.id_index import IdIndex
from wehub_ps.kernels.compiled import compiled

INT64 = st.integers(-2**63, 2**63 - 1)
# Small ranges make repeats, removals of live ids and full probe chains likely.
IDS = st.one_of(st.integers(-50, 50), INT64, st.sampled_from([-2**63, 2**63 - 1, 0, -1, 1]))


@contextlib.contextmanager
def _probing(path: str) -> Iterator[None]:
    """Lookups by NumPy rounds only, or by the compiled loop for every batch."""
    saved = id_index.compiled_soon, id_index._COMPILED_FROM
    if path == "rounds":
        id_index.compiled_soon = lambda fn, signatures=None: None
    else:
        if compiled(id_index._probe, id_index._probe_signatures) is None:
            pytest.skip("numba is not installed")
        id_index._COMPILED_FROM = 0
    try:
        yield
    finally:
        id_index.compiled_soon, id_index._COMPILED_FROM = saved


@pytest.mark.parametrize("path", ["rounds", "compiled"])
def test_matches_a_dict(path):
    with _probing(path):
        _matches_a_dict()


@given(st.lists(st.tuples(st.sampled_from(["insert", "remove", "lookup"]), st.lists(IDS, max_size=300)),
                max_size=40))
@settings(max_examples=150, deadline=None)
def _matches_a_dict(operations):
    index, model, next_slot = IdIndex(), {}, 0
    for op, raw in operations:
        batch = list(dict.fromkeys(raw))  # unique, in order
        if op == "insert":
            new = [i for i in batch if i not in model]
            slots = np.arange(next_slot, next_slot + len(new), dtype=np.int64)
            index.insert(np.array(new, np.int64), slots)
            model.update(zip(new, slots.tolist()))
            next_slot += len(new)
        elif op == "remove":
            gone = [i for i in batch if i in model]
            index.remove(np.array(gone, np.int64))
            for i in gone:
                del model[i]
        query = np.array(raw, np.int64)
        assert index.lookup(query).tolist() == [model.get(i, -1) for i in raw]
        assert len(index) == len(model)
    ids, slots = index.items()
    assert dict(zip(ids.tolist(), slots.tolist())) == model
    assert sorted(index.live_slots().tolist()) == sorted(model.values())


@pytest.mark.parametrize("path", ["rounds", "compiled"])
def test_ids_with_the_same_home_bucket_all_stay_reachable(path):
    with _probing(path):
        _same_home_bucket()


def _same_home_bucket() -> None:
    # id * FIBONACCI = (7 << 54) + j mod 2^64: the top 10 bits, the home bucket
    # in a 1,024-bucket table, are 7 for every j: one long probe chain.
    fibonacci = 0x9E3779B97F4A7C15
    inverse = pow(fibonacci, -1, 2**64)
    unsigned = [((7 << 54) + j) * inverse % 2**64 for j in range(200)]
    ids = np.array(unsigned, np.uint64).view(np.int64)
    index = IdIndex()
    assert len(index._ids) == 1024 and set(index._home(ids).tolist()) == {7}
    index.insert(ids, np.arange(len(ids)))
    assert index.lookup(ids).tolist() == list(range(len(ids)))
    index.remove(ids[::2])
    assert index.lookup(ids).tolist() == [-1 if k % 2 == 0 else k for k in range(len(ids))]


def test_many_removals_and_inserts_rebuild_instead_of_filling_with_deleted_buckets():
    index, rng = IdIndex(), np.random.default_rng(0)
    live = np.empty(0, np.int64)
    for round_ in range(60):
        new = rng.integers(-2**62, 2**62, 400) * 2 + round_ % 2  # fresh each round (parity differs)
        new = np.setdiff1d(np.unique(new), live)
        index.insert(new, new % 1000)
        live = np.concatenate([live, new])
        gone, live = live[:300], live[300:]
        index.remove(gone)
        assert len(index) == len(live)
    assert (index.lookup(live) == live % 1000).all()
    assert index._used <= len(index._ids) // 2  # deleted buckets were dropped by rebuilds


def test_removing_an_absent_id_raises_and_changes_nothing():
    index = IdIndex()
    index.insert(np.array([5, 6]), np.array([0, 1]))
    with pytest.raises(KeyError, match="7"):
        index.remove(np.array([6, 7]))
    assert index.lookup(np.array([5, 6])).tolist() == [0, 1] and len(index) == 2
