"""Embedding tables against real ps-servers: hash tables, row pulls and pushes, limits, checkpoints.

Most tests share two module-wide clusters (1 and 3 shards) and use their own
table names; tests that need special server flags or kill servers start
their own through ``cluster_factory``.
"""

from __future__ import annotations

import math
import signal
import threading
import uuid

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from wehub_ps.dtypes import BFLOAT16
from wehub_ps.errors import REASON_METADATA_KEY
from wehub_ps.initializers import fill_rows
from wehub_ps.placement import hash_shards
from wehub_ps.specs import Explicit, VariableSpec
from wehub_ps.specs_proto import spec_to_proto
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.arrays import byte_view
from wehub_ps.wire.codec import OutgoingChunk, decode_pull_response, encode_push_request
from wehub_ps.wire.rpc import method_path
from worker_client import (
    SGD,
    Adagrad,
    Adam,
    FixedShardsPartitioner,
    Normal,
    PSClient,
    PSError,
    ResourceExhaustedError,
    Uniform,
)

StatusCode = grpc.StatusCode


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    from ps_testing import ClusterFactory

    factory = ClusterFactory(tmp_path_factory.mktemp("embeddings"))
    try:
        yield factory(1), factory(3)
    finally:
        factory.stop_all()


@pytest.fixture(scope="module")
def one(clusters):
    return clusters[0]


@pytest.fixture(scope="module")
def three(clusters):
    return clusters[1]


def _ckpt_args(root) -> tuple[str, ...]:
    return ("--checkpoint-dir", str(root), "--checkpoint-interval", "0")


def _kill_and_restart(server, signum=signal.SIGKILL) -> None:
    server.signal(signum)
    server.wait(30)
    server.start(port=server.port)


def _table_info(client: PSClient, name: str) -> list[dict]:
    return [shard.variables[name] for shard in client.describe()]


def _num_rows(client: PSClient, name: str) -> list[int]:
    return [info["num_rows"] for info in _table_info(client, name)]


def _refused(call) -> PSError:
    """Run ``call``, which must fail; the error is returned so the test can check state first."""
    with pytest.raises(PSError) as info:
        call()
    return info.value


def _assert_exhausted(error: PSError) -> None:
    assert isinstance(error, ResourceExhaustedError), (
        f"expected ResourceExhaustedError, got {type(error).__name__}: {error}")
    assert error.reason == "MEMORY_LIMIT"


def _counters(client: PSClient) -> list[dict]:
    """Per shard: {variable: (num_rows, evicted_rows, version)}."""
    return [{name: (v["num_rows"], v["evicted_rows"], v["version"]) for name, v in shard.variables.items()}
            for shard in client.describe()]


def _ids_on(shard: int, num_shards: int, count: int, start: int = 0) -> np.ndarray:
    candidates = np.arange(start, start + 50 * count + 100, dtype=np.int64)
    mine = candidates[hash_shards(candidates, num_shards) == shard]
    assert len(mine) >= count
    return mine[:count]


# ---- pull_rows -----------------------------------------------------------------------------------


EDGE_IDS = np.array([2**62, -1, 0, -(2**63), 2**63 - 1, 7, -1, 123_456_789, 7, 2**62, -(2**40), 2**33],
                    dtype=np.int64)


def test_pull_rows_order_repeats_and_the_whole_int64_range(one, three):
    pulled = []
    for cluster in (one, three):
        with PSClient(cluster.addresses) as client:
            client.create_embedding("range", 8, initializer="uniform")
            rows = client.pull_rows("range", EDGE_IDS)
            assert rows.shape == (len(EDGE_IDS), 8) and rows.dtype == np.float32
            for i, j in ((1, 6), (5, 8), (0, 9)):  # repeated ids give equal rows
                assert EDGE_IDS[i] == EDGE_IDS[j]
                assert rows[i].tobytes() == rows[j].tobytes()
            # In the order given: reversed ids give reversed rows, one id at a time the same.
            assert client.pull_rows("range", EDGE_IDS[::-1]).tobytes() == rows[::-1].tobytes()
            for i, row_id in enumerate(EDGE_IDS):
                assert client.pull_rows("range", [row_id])[0].tobytes() == rows[i].tobytes()
            # ids are 64-bit patterns: uint64 2**64-1 is id -1.
            as_uint = client.pull_rows("range", np.array([2**64 - 1], np.uint64))
            assert as_uint[0].tobytes() == rows[1].tobytes()
            assert client.pull_rows("range", np.array([], np.int64)).shape == (0, 8)
            unique = np.unique(EDGE_IDS)
            assert len({r.tobytes() for r in rows}) == len(unique)
            # Each row lives on the shard its id hashes to, and was created once.
            n = len(cluster.addresses)
            assert _num_rows(client, "range") == [int((hash_shards(unique, n) == s).sum()) for s in range(n)]
            spec = client.variables()["range"].spec
            pulled.append(rows)
    # The initializer is keyed by id, not by shard: 1 and 3 shards give the same rows.
    assert pulled[0][:, 0].tobytes() == pulled[1][:, 0].tobytes()
    assert pulled[0].tobytes() == pulled[1].tobytes()
    expected = np.empty((len(EDGE_IDS), 8), np.float64)
    fill_rows(spec.initializer, spec.shape, EDGE_IDS, expected)
    np.testing.assert_array_equal(pulled[0], expected.astype(np.float32))
    assert np.abs(pulled[0]).max() <= 0.05


def test_rows_of_several_dimensions(three):
    with PSClient(three.addresses) as client:
        client.create_embedding("cube", (2, 3), initializer=Normal(stddev=1.0))
        rows = client.pull_rows("cube", [5, -5, 5])
        assert rows.shape == (3, 2, 3)
        assert rows[0].tobytes() == rows[2].tobytes() and rows[0].tobytes() != rows[1].tobytes()
        client.push_rows("cube", [5], np.ones((1, 2, 3), np.float32))
        np.testing.assert_array_equal(client.pull_rows("cube", [5])[0], rows[0] - np.float32(0.01))


# ---- push_rows -----------------------------------------------------------------------------------


def test_push_rows_sums_repeated_ids_and_touches_nothing_else(three):
    with PSClient(three.addresses) as client:
        client.create_embedding("summed", 4, initializer="uniform", optimizer=SGD(learning_rate=1.0))
        ids = np.arange(-5, 15, dtype=np.int64)
        before = client.pull_rows("summed", ids)
        client.push_rows("summed", [5, 5, 9], np.ones((3, 4), np.float32))
        after = client.pull_rows("summed", ids)
        expected = before.copy()
        expected[ids == 5] -= np.float32(2)
        expected[ids == 9] -= np.float32(1)
        assert after.tobytes() == expected.tobytes()
        # push(gradients, rows=...) sends dense gradients and rows together.
        client.create_variable("summed_bias", shape=(3,), initializer="zeros",
                               optimizer=SGD(learning_rate=1.0))
        client.push({"summed_bias": np.ones(3, np.float32)},
                    rows={"summed": (np.array([9, -5, 9]), np.full((3, 4), 0.5, np.float32))})
        again = client.pull_rows("summed", ids)
        expected[ids == 9] -= np.float32(1)
        expected[ids == -5] -= np.float32(0.5)
        assert again.tobytes() == expected.tobytes()
        np.testing.assert_array_equal(client.pull(["summed_bias"])["summed_bias"], -np.ones(3, np.float32))
        assert sum(_num_rows(client, "summed")) == len(ids)


def test_pull_rows_of_a_dense_variable_matches_pull(three):
    with PSClient(three.addresses) as client:
        client.create_variable("dense_rows", shape=(30, 5), initializer="normal",
                               partitioner=FixedShardsPartitioner(3))
        full = client.pull(["dense_rows"])["dense_rows"]
        ids = np.array([29, 0, 13, 13, 7, 22])
        assert client.pull_rows("dense_rows", ids).tobytes() == full[ids].tobytes()
        # No repeats (each shard's rows land in place), and rows of one shard only.
        for ids in (np.random.default_rng(0).permutation(30), np.array([3, 1, 2]), np.array([25])):
            assert client.pull_rows("dense_rows", ids).tobytes() == full[ids].tobytes()
    # Answers of many messages (rows gathered into each as it is joined), and a converting wire dtype.
    ids = np.random.default_rng(1).permutation(30)
    with PSClient(three.addresses, chunk_bytes=4096) as small, \
            PSClient(three.addresses, wire_dtype="float16") as half:
        wide = "dense_rows_wide"
        small.create_variable(wide, shape=(30, 300), initializer="normal",
                              partitioner=FixedShardsPartitioner(3))
        wide_full = small.pull([wide])[wide]
        assert small.pull_rows(wide, ids).tobytes() == wide_full[ids].tobytes()
        rounded = full[ids].astype(np.float16).astype(np.float32)
        assert half.pull_rows("dense_rows", ids).tobytes() == rounded.tobytes()


def test_pulled_rows_are_never_torn_by_concurrent_pushes(three):
    """A dense part's rows are read under its lock: each pulled row is one push's result, not half of two."""
    name, rows, dim, pushes = "untorn", 48, 4096, 100
    with PSClient(three.addresses) as pusher, PSClient(three.addresses) as puller:
        pusher.create_variable(name, shape=(rows, dim), initializer="zeros", optimizer=SGD(learning_rate=1.0),
                               partitioner=FixedShardsPartitioner(3))
        done = threading.Event()

        def push_loop() -> None:
            try:
                for _ in range(pushes):  # each push lowers every element of every row by exactly 1
                    pusher.push_rows(name, np.arange(rows), np.ones((rows, dim), np.float32))
            finally:
                done.set()

        thread = threading.Thread(target=push_loop, name="untorn-pusher")
        thread.start()
        seen = set()
        try:
            while not done.is_set():
                pulled = puller.pull_rows(name, np.arange(rows)[::-1])
                assert (pulled == pulled[:, :1]).all(), "a row mixes the values of two pushes"
                seen.update(np.unique(pulled[:, 0]).tolist())
        finally:
            thread.join(60)
        final = np.full((rows, dim), -pushes, np.float32)
        assert puller.pull_rows(name, np.arange(rows)).tobytes() == final.tobytes()
        assert len(seen) > 1  # the pulls did overlap the pushes


# ---- sparse updates equal dense ones -------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("optimizer", [SGD(learning_rate=0.3),
                                       Adagrad(learning_rate=0.2, initial_accumulator_value=0.05)],
                         ids=["sgd", "adagrad"])
def test_push_rows_equals_a_dense_push_with_zeros_elsewhere(three, optimizer, dtype):
    n, dim = 30, 5
    tag = f"{type(optimizer).__name__}_{dtype}"
    sparse, dense = f"sparse_{tag}", f"dense_{tag}"
    with PSClient(three.addresses) as client:
        for name in (sparse, dense):  # same seed: the same initial values
            client.create_variable(name, shape=(n, dim), dtype=dtype, initializer=Uniform(-1, 1, seed=11),
                                   optimizer=optimizer, partitioner=FixedShardsPartitioner(3))
        initial = client.pull([sparse, dense])
        assert initial[sparse].tobytes() == initial[dense].tobytes()
        rng = np.random.default_rng(4)
        touched = np.zeros(n, bool)
        for _ in range(4):
            ids = rng.integers(0, n - 5, size=12)  # repeats; rows n-5.. never touched
            grads = rng.standard_normal((12, dim)).astype(dtype)
            full = np.zeros((n, dim), dtype)
            np.add.at(full, ids, grads)
            client.push_rows(sparse, ids, grads)
            client.push({dense: full})
            touched[ids] = True
            now = client.pull([sparse, dense])
            assert now[sparse].tobytes() == now[dense].tobytes()
        assert now[sparse][~touched].tobytes() == initial[sparse][~touched].tobytes()
        assert not np.array_equal(now[sparse][touched], initial[sparse][touched])


@pytest.mark.parametrize("framing", ["lane", "several_messages", "bfloat16_wire", "big_endian"])
def test_unique_row_pushes_equal_dense_pushes_in_every_framing(three, framing):
    """Rows without repeats are gathered straight into each message (rowops.RowGather): the
    one-message lane push, a push split over many messages, a wire dtype conversion and
    big-endian gradients must all apply exactly what the dense push of the same values does."""
    n, dim = 64, 8
    options = {"several_messages": {"chunk_bytes": 4096}, "bfloat16_wire": {"wire_dtype": "bfloat16"}}
    sparse, dense, table = f"unique_sparse_{framing}", f"unique_dense_{framing}", f"unique_table_{framing}"
    # Values are read back by a float32-wire client: a bfloat16 wire would round them too.
    with PSClient(three.addresses, **options.get(framing, {})) as client, PSClient(three.addresses) as reader:
        for name in (sparse, dense):
            client.create_variable(name, shape=(n, dim), initializer=Uniform(-1, 1, seed=3),
                                   optimizer=SGD(learning_rate=0.5), partitioner=FixedShardsPartitioner(3))
        client.create_embedding(table, dim, initializer=Uniform(-1, 1, seed=3),
                                optimizer=SGD(learning_rate=0.5))
        rng = np.random.default_rng(8)
        table_ids = rng.permutation(np.arange(-(2**40), -(2**40) + 200, dtype=np.int64))[:60]
        table_before = reader.pull_rows(table, table_ids)
        initial = reader.pull([sparse])[sparse]
        ids = rng.permutation(n)[:40]  # unique, unsorted, on every shard
        grads = rng.standard_normal((40, dim)).astype(np.float32)
        full = np.zeros((n, dim), np.float32)
        full[ids] = grads
        sent = grads.astype(">f4") if framing == "big_endian" else grads
        client.push_rows(sparse, ids, sent)
        client.push({dense: full})
        client.push_rows(table, table_ids, np.resize(sent, (60, dim)))
        now = reader.pull([sparse, dense])
        assert now[sparse].tobytes() == now[dense].tobytes()
        assert not np.array_equal(now[sparse][ids], initial[ids])
        # The hash table's rows moved by exactly one SGD step of the (wire-rounded) gradient.
        wire_grads = np.resize(grads, (60, dim))
        if framing == "bfloat16_wire":
            wire_grads = wire_grads.astype(BFLOAT16).astype(np.float32)
        expected = table_before - np.float32(0.5) * wire_grads
        assert reader.pull_rows(table, table_ids).tobytes() == expected.tobytes()


def _adam_reference_step(w, m, v, t, rows, grads, lr, b1=0.9, b2=0.999, eps=1e-7):
    """Lazy Adam on the unique ``rows`` (grads already summed): each row's own step count."""
    t[rows] += 1
    steps = t[rows].astype(np.float64)[:, None]
    lr_t = lr * np.sqrt(1.0 - b2**steps) / (1.0 - b1**steps)
    m[rows] = b1 * m[rows] + (1.0 - b1) * grads
    v[rows] = b2 * v[rows] + (1.0 - b2) * (grads * grads)
    w[rows] -= lr_t * m[rows] / (np.sqrt(v[rows]) + eps)


@pytest.mark.parametrize("kind", ["dense", "hash"])
def test_lazy_adam_rows_match_a_reference(three, kind):
    n, dim, lr = 24, 4, 0.02
    b1, b2, eps = 0.9, 0.999, 1e-7
    name = f"lazy_adam_{kind}"
    with PSClient(three.addresses) as client:
        if kind == "dense":
            client.create_variable(name, shape=(n, dim), dtype="float64", initializer=Uniform(-1, 1, seed=3),
                                   optimizer=Adam(learning_rate=lr), partitioner=FixedShardsPartitioner(3))
            keys = np.arange(n, dtype=np.int64)
        else:
            client.create_embedding(name, dim, dtype="float64", initializer=Uniform(-1, 1, seed=3),
                                    optimizer=Adam(learning_rate=lr))
            keys = np.arange(n, dtype=np.int64) * 7919 - 10**6  # negative ids too

        def pull() -> np.ndarray:
            return client.pull_rows(name, keys)

        w = pull()
        initial = w.copy()
        m, v, t = np.zeros_like(w), np.zeros_like(w), np.zeros(n, np.int64)
        rng = np.random.default_rng(8)
        fresh = n - 1  # never touched until the end
        for _ in range(6):
            positions = rng.integers(0, n - 4, size=7)  # repeats; some rows skip steps
            grads = rng.standard_normal((7, dim))
            client.push_rows(name, keys[positions], grads)
            unique, inverse = np.unique(positions, return_inverse=True)
            summed = np.zeros((len(unique), dim))
            np.add.at(summed, inverse.reshape(-1), grads)
            _adam_reference_step(w, m, v, t, unique, summed, lr)
            now = pull()
            np.testing.assert_allclose(now, w, rtol=1e-12, atol=1e-15)
            assert now[t == 0].tobytes() == initial[t == 0].tobytes()  # untouched rows: bit-exact
        assert len(set(t[t > 0].tolist())) > 1  # rows really have different step counts
        # A row touched for the first time now gets a first-step update: its m, v and step
        # count were untouched by all the steps before.
        g = rng.standard_normal(dim)
        client.push_rows(name, keys[[fresh]], g[None, :])
        step_size = lr * math.sqrt(1 - b2) / (1 - b1)
        first = initial[fresh] - step_size * ((1 - b1) * g) / (np.sqrt((1 - b2) * g * g) + eps)
        np.testing.assert_allclose(pull()[fresh], first, rtol=1e-12)


# ---- limits ----------------------------------------------------------------------------------------


def test_max_rows_refuses_new_rows_beyond_the_limit_and_changes_nothing(three):
    limit = 6
    with PSClient(three.addresses) as client:
        client.create_embedding("capped", 4, max_rows=limit, optimizer=SGD(learning_rate=1.0))
        on1 = _ids_on(1, 3, 10)
        existing = on1[:4]
        client.push_rows("capped", existing, np.ones((4, 4), np.float32))  # a push creates rows too
        values = client.pull_rows("capped", existing)
        info = _table_info(client, "capped")
        assert [i["num_rows"] for i in info] == [0, 4, 0]
        # 4 + 3 new rows on shard 1 > 6: refused, by pull and by push.
        pulled = _refused(lambda: client.pull_rows("capped", on1[4:7]))
        pushed = _refused(lambda: client.push_rows("capped", on1[4:7], np.ones((3, 4), np.float32)))
        assert _table_info(client, "capped") == info
        assert client.pull_rows("capped", existing).tobytes() == values.tobytes()
        # Up to the limit is fine; the bound is per shard.
        client.pull_rows("capped", np.concatenate([existing, on1[4:6]]))
        assert _num_rows(client, "capped") == [0, limit, 0]
        one_more = _refused(lambda: client.pull_rows("capped", on1[6:7]))
        client.pull_rows("capped", _ids_on(0, 3, limit, start=10_000))
        assert _num_rows(client, "capped") == [limit, limit, 0]
        assert client.pull_rows("capped", existing).tobytes() == values.tobytes()
        # The refusals are typed (checked last, so that the state checks above run either way).
        _assert_exhausted(pushed)
        _assert_exhausted(pulled)
        _assert_exhausted(one_more)


def test_a_refused_pull_spanning_several_chunks_creates_no_rows(one):
    """A pull is refused as a whole: rows of its first chunks must not stay behind.

    Bug: the service creates rows chunk by chunk while streaming
    (ps_server.service.pull_stream._row_chunks), so a pull whose later chunk passes
    max_rows leaves the rows of the earlier chunks created.
    """
    with PSClient(one.addresses, chunk_bytes=4096) as client:  # 4 rows of 256 floats per chunk
        client.create_embedding("capped_wide", 256, max_rows=8)
        error = _refused(lambda: client.pull_rows("capped_wide", np.arange(12)))
        assert _num_rows(client, "capped_wide") == [0]
        _assert_exhausted(error)


def test_lru_never_evicts_rows_of_the_same_request_across_chunks(one):
    """More new rows than max_rows in one request is refused, however the request is chunked.

    In one chunk, HashTablePart._evict refuses ("a single request touches more
    rows than max_rows allows"). Bug: split into several chunks, a push
    succeeds and its last chunk evicts the rows its first chunk just trained
    (the update is acknowledged, then silently gone), and a pull returns
    rows it has already evicted again. The service creates rows per chunk
    (pushes.ActivePush.apply, pull_stream._row_chunks) and protects only the
    rows of the current chunk.
    """
    with PSClient(one.addresses, chunk_bytes=4096) as client:  # 4 rows of 256 floats per chunk
        client.create_embedding("lru_wide", 256, max_rows=8, eviction="lru", optimizer=SGD(learning_rate=1.0))
        pushed = _refused(lambda: client.push_rows("lru_wide", np.arange(12), np.ones((12, 256), np.float32)))
        pulled = _refused(lambda: client.pull_rows("lru_wide", np.arange(100, 112)))
        info = _table_info(client, "lru_wide")[0]
        assert (info["num_rows"], info["evicted_rows"], info["version"]) == (0, 0, 0)
        _assert_exhausted(pushed)
        _assert_exhausted(pulled)


def test_lru_keeps_recent_rows_and_evicts_the_rest(one):
    limit = 16
    with PSClient(one.addresses) as client:
        client.create_embedding("lru", 4, max_rows=limit, eviction="lru", optimizer=SGD(learning_rate=1.0))
        first = client.pull_rows("lru", np.arange(16))
        ones = np.ones((4, 4), np.float32)
        client.push_rows("lru", np.arange(4, 8), ones)  # trained, but used before the hot rows
        client.push_rows("lru", np.arange(0, 4), ones)  # hot: most recently used
        client.pull_rows("lru", np.arange(100, 112))  # 12 new rows: 8..15 and 4..7 go
        info = _table_info(client, "lru")[0]
        assert (info["num_rows"], info["evicted_rows"]) == (limit, 12)
        np.testing.assert_array_equal(client.pull_rows("lru", np.arange(4)), first[:4] - np.float32(1))
        # An evicted row comes back from its initializer (its training is gone).
        assert client.pull_rows("lru", [5]).tobytes() == first[5:6].tobytes()
        info = _table_info(client, "lru")[0]
        assert (info["num_rows"], info["evicted_rows"]) == (limit, 13)
        # A request needing more new rows than max_rows is refused; nothing changes.
        error = _refused(lambda: client.pull_rows("lru", np.arange(1000, 1000 + limit + 1)))
        assert _table_info(client, "lru")[0] == info
        np.testing.assert_array_equal(client.pull_rows("lru", np.arange(4)), first[:4] - np.float32(1))
        _assert_exhausted(error)


def test_lru_bounds_rows_per_shard_under_many_ids(three):
    limit = 5
    with PSClient(three.addresses) as client:
        client.create_embedding("lru_many", 2, max_rows=limit, eviction="lru",
                                optimizer=SGD(learning_rate=1.0))
        ids = np.random.default_rng(2).permutation(np.arange(10_000, 10_150))
        for batch in np.split(ids, 50):  # 3 ids a request: never more than the limit on one shard
            client.push_rows("lru_many", batch, np.ones((3, 2), np.float32))
            assert max(_num_rows(client, "lru_many")) <= limit
        infos = _table_info(client, "lru_many")
        assert all(i["num_rows"] == limit for i in infos)
        assert sum(i["evicted_rows"] for i in infos) == len(ids) - 3 * limit
        # The last batch is certainly live and trained once.
        last = ids[-3:]
        initial = np.empty((3, 2))
        fill_rows(client.variables()["lru_many"].spec.initializer, (2,), last, initial)
        np.testing.assert_array_equal(client.pull_rows("lru_many", last), initial.astype(np.float32) - 1)


def test_server_max_rows_flag_bounds_tables(cluster_factory):
    cluster = cluster_factory(1, "--max-rows", "8")
    with PSClient(cluster.addresses) as client:
        client.create_embedding("unset", 2)
        client.create_embedding("smaller", 2, max_rows=4)
        client.create_embedding("larger", 2, max_rows=20)
        client.create_embedding("lru", 2, max_rows=20, eviction="lru")
        errors = []
        for name, limit in (("unset", 8), ("smaller", 4), ("larger", 8)):
            client.pull_rows(name, np.arange(limit))
            errors.append(_refused(lambda: client.pull_rows(name, [limit])))
            assert _num_rows(client, name) == [limit], name
        for start in range(0, 30, 3):
            client.pull_rows("lru", np.arange(start, start + 3))
            assert _num_rows(client, "lru")[0] <= 8
        info = _table_info(client, "lru")[0]
        assert (info["num_rows"], info["evicted_rows"]) == (8, 22)
        # Dense variables are not hash tables: no row limit.
        client.create_variable("dense", shape=(100, 2))
        assert client.pull_rows("dense", np.arange(100)).shape == (100, 2)
        for error in errors:
            _assert_exhausted(error)


def test_repeated_new_ids_in_a_raw_pull_count_once(one):
    """The Pull RPC accepts repeated row ids (only pushes must be unique).

    Bug: HashTablePart._slots_for creates a row per occurrence of a new id
    (leaking slots), so [42, 42] counts as two new rows and max_rows=1 refuses it.
    """
    with PSClient(one.addresses) as client:
        client.create_embedding("repeat", 4, max_rows=1)
        chunks = _raw_pull(one.addresses[0], 0, 1, "repeat", np.array([42, 42], np.int64).tobytes())
        rows = np.concatenate([c.array() for c in chunks]).reshape(-1, 4)
        assert rows.shape == (2, 4) and rows[0].tobytes() == rows[1].tobytes()
        assert _num_rows(client, "repeat") == [1]
        assert client.pull_rows("repeat", [42]).tobytes() == rows[:1].tobytes()


def _raw_pull_items(address: str, items: list[tuple[str, np.ndarray]]):
    """One Pull of several row items (variable, ids) on a one-shard cluster; the decoded chunks."""
    request = ps_pb2.PullRequest(shard_index=0, num_shards=1, items=[
        ps_pb2.PullItem(variable=name, row_ids=np.asarray(ids, "<i8").tobytes()) for name, ids in items])
    with grpc.insecure_channel(address) as channel:
        messages = list(channel.unary_stream(method_path("Pull"))(request.SerializeToString(), timeout=10))
    return [chunk for message in messages for chunk in decode_pull_response(message)]


@pytest.mark.parametrize("refused_by", ["a second table over its bound", "an unknown variable"])
def test_a_refused_pull_of_several_tables_changes_no_table(one, refused_by):
    """A Pull is checked as a whole before any table changes: new rows of its first item are not
    created, and an LRU table's trained rows are not evicted for them."""
    suffix = uuid.uuid4().hex[:8]
    trained, capped = f"trained_{suffix}", f"capped_{suffix}"
    with PSClient(one.addresses) as client:
        client.create_embedding(trained, 4, initializer="zeros", max_rows=4, eviction="lru",
                                optimizer=SGD(learning_rate=1.0))
        client.create_embedding(capped, 4, max_rows=2)
        client.push_rows(trained, np.arange(4), -np.ones((4, 4), np.float32))
        before = _counters(client)
        second = (capped, np.arange(10, 13)) if refused_by.startswith("a second") else (f"nope_{suffix}", [1])
        with pytest.raises(grpc.RpcError) as info:
            _raw_pull_items(one.addresses[0], [(trained, np.arange(100, 104)), second])
        expected = (StatusCode.RESOURCE_EXHAUSTED if refused_by.startswith("a second")
                    else StatusCode.NOT_FOUND)
        assert info.value.code() == expected, info.value.details()
        assert _counters(client) == before
        assert client.pull_rows(trained, np.arange(4)).tolist() == [[1.0] * 4] * 4
        assert _counters(client) == before  # (that pull created nothing either)


def test_pull_rows_of_a_variable_waiting_for_its_initial_value_is_refused(one):
    """Like a whole-variable pull: NOT_INITIALIZED, never the zeros the part was allocated with."""
    name = f"waiting_{uuid.uuid4().hex[:8]}"
    spec = VariableSpec(name, (6, 4), "float32", initializer=Explicit(sha256=bytes(32)))
    request = ps_pb2.CreateVariableRequest(spec=spec_to_proto(spec), shard_index=0, num_shards=1)
    with grpc.insecure_channel(one.addresses[0]) as channel:
        channel.unary_unary(method_path("CreateVariable"))(request.SerializeToString(), timeout=10)
    for pull in (lambda: _raw_pull(one.addresses[0], 0, 1, name, np.arange(2, dtype="<i8").tobytes()),
                 lambda: _raw_pull_items(one.addresses[0], [(name, [3, 3, 1])])):
        with pytest.raises(grpc.RpcError) as info:
            pull()
        assert info.value.code() == StatusCode.FAILED_PRECONDITION, info.value.details()
        assert dict(info.value.trailing_metadata()).get(REASON_METADATA_KEY) == "NOT_INITIALIZED"
        assert "waiting for its explicit initial value" in info.value.details()


def test_repeated_ids_in_a_pull_are_read_once_and_answered_in_order(one):
    """A Pull naming rows many times reads each once; the answer still repeats them in order."""
    name = f"repeats_{uuid.uuid4().hex[:8]}"
    with PSClient(one.addresses) as client:
        client.create_embedding(name, 3, initializer=Uniform(seed=5), max_rows=3)
        ids = np.array([9, 4, 9, 9, 2, 4] * 50, np.int64)
        for wire in (ps_pb2.DATA_TYPE_UNSPECIFIED, ps_pb2.BFLOAT16):
            request = ps_pb2.PullRequest(shard_index=0, num_shards=1, wire_dtype=wire, chunk_bytes=4096,
                                         items=[ps_pb2.PullItem(variable=name, row_ids=ids.tobytes())])
            with grpc.insecure_channel(one.addresses[0]) as channel:
                pull = channel.unary_stream(method_path("Pull"))
                messages = list(pull(request.SerializeToString(), timeout=10))
            chunks = [chunk for message in messages for chunk in decode_pull_response(message)]
            rows = np.concatenate([c.array().astype(np.float32) for c in chunks]).reshape(-1, 3)
            expected = client.pull_rows(name, ids)
            if wire == ps_pb2.BFLOAT16:
                expected = expected.astype(BFLOAT16).astype(np.float32)
            assert rows.tobytes() == expected.tobytes()
        assert _num_rows(client, name) == [3]


# ---- checkpoints -----------------------------------------------------------------------------------


def _train_adam(clients: list[tuple[PSClient, str]], seed: int, steps: int, pool: np.ndarray) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = rng.choice(pool, size=10)
        grads = rng.standard_normal((10, 6)).astype(np.float32)
        for client, name in clients:
            client.push_rows(name, ids, grads)


def _embedding_spec_kwargs() -> dict:
    return dict(dim=6, initializer=Normal(stddev=0.5, seed=21), optimizer=Adam(learning_rate=0.05))


def test_tables_survive_sigkill_and_restart(cluster_factory, one, tmp_path):
    cluster = cluster_factory(2, *_ckpt_args(tmp_path / "ckpt"))
    ref_name = f"kill_ref_{uuid.uuid4().hex[:8]}"
    pool = np.concatenate([np.arange(-20, 20), [2**63 - 1, -(2**63), 2**50]]).astype(np.int64)
    lru_ids = np.arange(500, 560, dtype=np.int64)
    with PSClient(cluster.addresses) as client, PSClient(one.addresses) as ref:
        client.create_embedding("emb", **_embedding_spec_kwargs())
        ref.create_embedding(ref_name, **_embedding_spec_kwargs())
        client.create_embedding("lru", 3, max_rows=10, eviction="lru", optimizer=SGD(learning_rate=1.0))
        client.create_embedding("never_touched", 3)
        client.create_variable("dense", shape=(20, 3), initializer="uniform",
                               optimizer=Adam(learning_rate=0.1), partitioner=FixedShardsPartitioner(2))
        _train_adam([(client, "emb"), (ref, ref_name)], seed=1, steps=5, pool=pool)
        for batch in np.split(lru_ids, 15):
            client.push_rows("lru", batch, np.ones((4, 3), np.float32))
        client.push_rows("dense", [3, 3, 17], np.ones((3, 3), np.float32))
        emb = client.pull_rows("emb", pool)
        assert emb.tobytes() == ref.pull_rows(ref_name, pool).tobytes()  # 2 shards = 1 shard
        lru_live = client.pull_rows("lru", lru_ids[-4:])  # the last batch: live on every shard
        dense = client.pull(["dense"])["dense"]
        infos = _counters(client)
        assert sum(i["lru"][1] for i in infos) > 0  # something was evicted
        client.checkpoint()
    for server in cluster.servers:
        _kill_and_restart(server)
    with PSClient(cluster.addresses) as client, PSClient(one.addresses) as ref:
        shards = client.describe()
        assert all(shard.restored_from is not None for shard in shards)
        assert _counters(client) == infos
        # The LRU order came back: the rows used last survive the next eviction (at most
        # 6 new rows per shard of 10 evict the older ones).
        client.pull_rows("lru", np.arange(900, 906))
        assert client.pull_rows("lru", lru_ids[-4:]).tobytes() == lru_live.tobytes()
        assert client.pull_rows("emb", pool).tobytes() == emb.tobytes()
        assert client.pull(["dense"])["dense"].tobytes() == dense.tobytes()
        assert _num_rows(client, "never_touched") == [0, 0]
        assert client.pull_rows("never_touched", [1]).shape == (1, 3)
        # Optimizer slots and per-row step counts came back too: further updates match.
        _train_adam([(client, "emb"), (ref, ref_name)], seed=2, steps=2, pool=pool)
        assert client.pull_rows("emb", pool).tobytes() == ref.pull_rows(ref_name, pool).tobytes()


def test_tables_restore_onto_a_different_number_of_shards(cluster_factory, one, tmp_path):
    root = tmp_path / "ckpt"
    ref_name = f"reshard_ref_{uuid.uuid4().hex[:8]}"
    pool = np.arange(-40, 40, dtype=np.int64) * 1_000_003
    two = cluster_factory(2, *_ckpt_args(root))
    with PSClient(two.addresses) as client, PSClient(one.addresses) as ref:
        client.create_embedding("emb", **_embedding_spec_kwargs())
        ref.create_embedding(ref_name, **_embedding_spec_kwargs())
        client.create_embedding("lru", 2, max_rows=6, eviction="lru", optimizer=SGD(learning_rate=1.0))
        _train_adam([(client, "emb"), (ref, ref_name)], seed=3, steps=4, pool=pool)
        client.pull_rows("emb", pool)  # every id of the pool exists now
        trained = client.pull_rows("emb", pool)
        lru_ids = np.arange(700, 730, dtype=np.int64)
        for batch in np.split(lru_ids, 10):
            client.push_rows("lru", batch, np.ones((3, 2), np.float32))
        lru_live = client.pull_rows("lru", lru_ids[-3:])
        before = _table_info(client, "emb"), _table_info(client, "lru")
    assert sum(i["num_rows"] for i in before[0]) == len(pool)
    two.stop()  # SIGTERM: final checkpoints
    three = cluster_factory(3, *_ckpt_args(root))
    with PSClient(three.addresses) as client, PSClient(one.addresses) as ref:
        assert all(shard.restored_from is not None for shard in client.describe())
        emb_info = _table_info(client, "emb")
        # Every row moved to the shard its id hashes to under 3 shards.
        assert [i["num_rows"] for i in emb_info] == [int((hash_shards(pool, 3) == s).sum()) for s in range(3)]
        assert client.pull_rows("emb", pool).tobytes() == trained.tobytes()
        assert sum(_num_rows(client, "emb")) == len(pool)  # the pull created nothing
        _train_adam([(client, "emb"), (ref, ref_name)], seed=4, steps=2, pool=pool)
        assert client.pull_rows("emb", pool).tobytes() == ref.pull_rows(ref_name, pool).tobytes()
        lru_info = _table_info(client, "lru")
        assert sum(i["num_rows"] for i in lru_info) == sum(i["num_rows"] for i in before[1])
        assert client.pull_rows("lru", lru_ids[-3:]).tobytes() == lru_live.tobytes()
        # Each eviction happened once: the total count must not multiply with the new shards.
        # Bug: checkpoint._load_table gives every new shard the sum of all old shards' evicted_rows.
        assert sum(i["evicted_rows"] for i in lru_info) == sum(i["evicted_rows"] for i in before[1])


# ---- bad input through raw gRPC ---------------------------------------------------------------------


def _raw_pull(address: str, shard: int, num_shards: int, variable: str, row_ids: bytes):
    request = ps_pb2.PullRequest(shard_index=shard, num_shards=num_shards,
                                 items=[ps_pb2.PullItem(variable=variable, row_ids=row_ids)])
    with grpc.insecure_channel(address) as channel:
        messages = list(channel.unary_stream(method_path("Pull"))(request.SerializeToString(), timeout=10))
    return [chunk for message in messages for chunk in decode_pull_response(message)]


def _raw_push(address: str, shard: int, num_shards: int, variable: str, row_ids: bytes, values: np.ndarray,
              elements: int | None = None, pieces: list[tuple[int, int]] | None = None,
              kind: int = ps_pb2.GRADIENT) -> ps_pb2.PushResponse:
    """One push message; ``pieces`` are (offset, count) chunks of ``values`` (default: all of it)."""
    values = np.ascontiguousarray(values, np.float32).reshape(-1)
    begin = ps_pb2.PushBegin(
        worker_id="raw-tester", incarnation=uuid.uuid4().hex, sequence=1, shard_index=shard,
        num_shards=num_shards, kind=kind,
        items=[ps_pb2.PushItem(variable=variable, elements=values.size if elements is None else elements,
                               wire_dtype=ps_pb2.FLOAT32, row_ids=row_ids)])
    chunks = [OutgoingChunk(ps_pb2.ChunkHeader(variable=variable, offset=offset, count=count,
                                               dtype=ps_pb2.FLOAT32),
                            byte_view(values[offset:offset + count]))
              for offset, count in (pieces or [(0, values.size)])]
    with grpc.insecure_channel(address) as channel:
        push = channel.stream_unary(method_path("Push"))
        raw = push(iter([encode_push_request(begin, chunks)]), timeout=10)
    return ps_pb2.PushResponse.FromString(raw)


def _expect(call, code: StatusCode, reason: str, fragment: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    error = info.value
    assert error.code() == code, error.details()
    assert dict(error.trailing_metadata() or ()).get(REASON_METADATA_KEY) == reason, error.details()
    assert fragment in error.details(), error.details()


def test_bad_row_input_is_refused_precisely_and_changes_nothing(three):
    address = three.addresses[0]
    with PSClient(three.addresses) as client:
        client.create_embedding("bad_rows", 4, optimizer=SGD(learning_rate=1.0))
        client.create_variable("bad_dense", shape=(12, 4), optimizer=SGD(learning_rate=1.0),
                               partitioner=FixedShardsPartitioner(3))
        mine = _ids_on(0, 3, 3)
        other = _ids_on(1, 3, 1)
        client.pull_rows("bad_rows", mine)
        part = client.variables()["bad_dense"].placement.part_on(0)

        def state():
            shards = client.describe()
            return ([s.variables[n] for s in shards for n in ("bad_rows", "bad_dense")],
                    client.pull_rows("bad_rows", mine).tobytes(),
                    client.pull(["bad_dense"])["bad_dense"].tobytes())

        before = state()
        ids = lambda *values: np.array(values, "<i8").tobytes()  # noqa: E731
        two_rows = np.ones(8, np.float32)
        cases = [
            # row_ids that are not whole int64s
            (lambda: _raw_push(address, 0, 3, "bad_rows", ids(*mine[:1]) + b"\0\0\0\0", np.ones(4)),
             StatusCode.INVALID_ARGUMENT, "INVALID_CHUNK", "multiple of 8 bytes"),
            (lambda: _raw_pull(address, 0, 3, "bad_rows", ids(*mine[:1])[:7]),
             StatusCode.INVALID_ARGUMENT, "INVALID_CHUNK", "multiple of 8 bytes"),
            # a push naming one row twice (the client sums them first)
            (lambda: _raw_push(address, 0, 3, "bad_rows", ids(mine[0], mine[0]), two_rows),
             StatusCode.INVALID_ARGUMENT, "INVALID_CHUNK", "repeat an id"),
            # an id that hashes to another shard
            (lambda: _raw_push(address, 0, 3, "bad_rows", ids(mine[0], other[0]), two_rows),
             StatusCode.FAILED_PRECONDITION, "CLUSTER_MISMATCH", "belongs to shard 1"),
            (lambda: _raw_pull(address, 0, 3, "bad_rows", ids(other[0], mine[0])),
             StatusCode.FAILED_PRECONDITION, "CLUSTER_MISMATCH", f"row id {other[0]}"),
            # chunks that cut rows
            (lambda: _raw_push(address, 0, 3, "bad_rows", ids(*mine[:2]), two_rows, pieces=[(0, 6)]),
             StatusCode.INVALID_ARGUMENT, "INVALID_CHUNK", "whole rows"),
            (lambda: _raw_push(address, 0, 3, "bad_rows", ids(*mine[:2]), two_rows, pieces=[(2, 4)]),
             StatusCode.INVALID_ARGUMENT, "INVALID_CHUNK", "whole rows"),
            # declared elements that are not rows x row width
            (lambda: _raw_push(address, 0, 3, "bad_rows", ids(*mine[:2]), two_rows, elements=7),
             StatusCode.INVALID_ARGUMENT, "SHAPE_MISMATCH", "2 rows of 4 elements"),
            # a hash table addressed without ids
            (lambda: _raw_push(address, 0, 3, "bad_rows", b"", two_rows),
             StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", "push it by rows"),
            (lambda: _raw_pull(address, 0, 3, "bad_rows", b""),
             StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", "pull it by rows"),
            # rows cannot be assigned
            (lambda: _raw_push(address, 0, 3, "bad_rows", ids(mine[0]), np.ones(4), kind=ps_pb2.ASSIGN),
             StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST", "cannot address rows"),
            # rows of a dense variable that another shard holds
            (lambda: _raw_push(address, 0, 3, "bad_dense", ids(part.row_end), np.ones(4)),
             StatusCode.INVALID_ARGUMENT, "INVALID_CHUNK", "not on this shard"),
            (lambda: _raw_pull(address, 0, 3, "bad_dense", ids(part.row_start, 12)),
             StatusCode.INVALID_ARGUMENT, "INVALID_CHUNK", "not on this shard"),
            # ids for a layout this server is not part of
            (lambda: _raw_pull(address, 0, 2, "bad_rows", ids(mine[0])),
             StatusCode.FAILED_PRECONDITION, "CLUSTER_MISMATCH", "shard 0 of 3"),
        ]
        for call, code, reason, fragment in cases:
            _expect(call, code, reason, fragment)
            assert state() == before, fragment
        assert three.servers[0].health() == health_pb2.HealthCheckResponse.SERVING
        # A valid raw row push still applies, exactly.
        response = _raw_push(address, 0, 3, "bad_rows", ids(*mine[:2]), two_rows, pieces=[(0, 4), (4, 4)])
        assert response.elements_applied == 8 and not response.duplicate
        rows = client.pull_rows("bad_rows", mine)
        expected = np.frombuffer(before[1], np.float32).reshape(3, 4).copy()
        expected[:2] -= np.float32(1)
        assert rows.tobytes() == expected.tobytes()


@pytest.mark.parametrize("kind", ["hash", "dense"])
def test_read_only_lookups_create_nothing_and_answer_missing_rows_by_option(three, kind):
    """lookup_rows, for evaluation and serving: existing rows as pull_rows gives them; a hash table's missing
    row answered with its initializer's value (what it would be created with) or zeros, and not created; no
    version, row count or counter moves on any shard."""
    name = f"serve-{kind}-{uuid.uuid4().hex[:6]}"
    with PSClient(three.addresses) as client:
        if kind == "hash":
            client.create_embedding(name, 3, initializer=Normal(0.0, 1.0, seed=5), optimizer=SGD(learning_rate=1.0))
        else:
            client.create_variable(name, (50, 3), initializer=Normal(0.0, 1.0, seed=5),
                                   optimizer=SGD(learning_rate=1.0))
        seen = np.array([3, 7, 11], np.int64)
        client.pull_rows(name, seen)
        client.push_rows(name, seen, np.ones((3, 3), np.float32))  # trained: not the initializer's any more
        trained = client.pull_rows(name, seen)
        unseen = np.array([2**40 + 9, -4, 13], np.int64) if kind == "hash" else np.array([20, 21, 13])
        before = _table_info(client, name), _counters(client)  # each shard's version, rows, evictions
        ids = np.concatenate([seen, unseen, seen[:1]])  # repeats too
        looked_up = client.lookup_rows(name, ids)
        zeros = client.lookup_rows(name, ids, missing="zeros")
        assert (_table_info(client, name), _counters(client)) == before
        np.testing.assert_array_equal(looked_up[:3], trained)
        np.testing.assert_array_equal(looked_up[6], trained[0])
        np.testing.assert_array_equal(zeros[:3], trained)
        if kind == "hash":
            assert not zeros[3:6].any()
            # The initializer's values: exactly the rows the table creates for those ids later.
            np.testing.assert_array_equal(looked_up[3:6], client.pull_rows(name, unseen))
            assert [i["num_rows"] for i in _table_info(client, name)] != [i["num_rows"] for i in before[0]]
        else:  # a dense table has every row: read as pull_rows, whatever the option
            np.testing.assert_array_equal(zeros[3:6], looked_up[3:6])
            np.testing.assert_array_equal(looked_up[3:6], client.pull_rows(name, unseen))
        with pytest.raises(ValueError, match="'initializer' or 'zeros'"):
            client.lookup_rows(name, ids, missing="random")


def test_a_read_only_lookup_is_no_access_for_lru(one):
    """An evaluation reading a table must not keep its rows from eviction: the LRU order is training's."""
    with PSClient(one.addresses) as client:
        client.create_embedding("lru-serve", 2, max_rows=4, eviction="lru", optimizer=SGD(learning_rate=1.0))
        initial = client.pull_rows("lru-serve", np.arange(4))  # row 0 the least recently used
        client.push_rows("lru-serve", np.arange(4), np.ones((4, 2), np.float32))
        for _ in range(3):
            client.lookup_rows("lru-serve", [0])  # read, read, read: still the least recently used
        client.pull_rows("lru-serve", [10])  # one new row: row 0 goes
        info = _table_info(client, "lru-serve")[0]
        assert (info["num_rows"], info["evicted_rows"]) == (4, 1)
        # Row 0's training is gone: it is its initializer's value again, and rows 1..3 kept theirs.
        assert client.lookup_rows("lru-serve", [0]).tobytes() == initial[:1].tobytes()
        np.testing.assert_array_equal(client.lookup_rows("lru-serve", [1, 2, 3]), initial[1:] - np.float32(1))


def test_export_rows_gives_every_row_with_its_id_and_changes_nothing(three):
    name = f"export-{uuid.uuid4().hex[:6]}"
    with PSClient(three.addresses) as client:
        client.create_embedding(name, 3, initializer=Normal(0.0, 1.0, seed=2), optimizer=SGD(learning_rate=1.0))
        ids = np.concatenate([np.arange(-50, 2_000, 7), [2**62, -(2**63)]]).astype(np.int64)
        client.pull_rows(name, ids)
        client.push_rows(name, ids[::3], np.ones((len(ids[::3]), 3), np.float32))
        expected = client.lookup_rows(name, ids)
        before = _table_info(client, name), _counters(client)
        exported_ids, rows = client.export_rows(name)
        assert (_table_info(client, name), _counters(client)) == before
        assert exported_ids.tolist() == sorted(ids.tolist())
        np.testing.assert_array_equal(rows, expected[np.argsort(ids)])
        # In pieces: a small chunk size makes many messages per shard, the same answer.
    with PSClient(three.addresses, chunk_bytes=4096) as client:
        again_ids, again_rows = client.export_rows(name)
        assert again_ids.tolist() == exported_ids.tolist() and again_rows.tobytes() == rows.tobytes()
        dense = f"export-dense-{uuid.uuid4().hex[:6]}"
        client.create_variable(dense, (10, 2), initializer=np.ones((10, 2), np.float32), optimizer=SGD(learning_rate=1.0))
        dense_ids, dense_rows = client.export_rows(dense)
        assert dense_ids.tolist() == list(range(10)) and (dense_rows == 1).all()
