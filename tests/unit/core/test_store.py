"""The shard's variable store (ps_server.core.store) and push validation (ps_server.core.pushes)."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest

from ps_server.core import memory as memory_module
from ps_server.core.errors import RequestError
from ps_server.core.ledger import PushLedger
from ps_server.core.parts import check_dtype_allowed
from ps_server.core.pushes import begin_push, check_cluster
from ps_server.core.store import VariableStore
from ps_server.service.push_messages import push_chunk, push_start
from wehub_ps.dtypes import BFLOAT16
from wehub_ps.errors import Reason
from wehub_ps.initializers import fill_initial_values
from wehub_ps.placement import FixedShardsPartitioner, rows_of
from wehub_ps.specs import (
    SGD,
    Adagrad,
    Adam,
    Constant,
    Explicit,
    Momentum,
    Normal,
    Uniform,
    VariableSpec,
    Zeros,
)
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.arrays import as_wire_array, byte_view, chunk_ranges
from wehub_ps.wire.codec import DecodedChunk, join_pieces
from wehub_ps.wire.dtypes import to_wire_dtype

LIMIT = 1 << 30


def _spec(name="v", shape=(10, 4), dtype="float32", **kwargs):
    return VariableSpec(name, shape, dtype, **kwargs)


# ---- create ----------------------------------------------------------------------------------


def test_create_is_idempotent():
    store = VariableStore(0, 1, LIMIT)
    spec = _spec(initializer=Uniform(), optimizer=Adam())
    info, created = store.create(spec)
    assert created
    assert (info.row_start, info.row_end, info.version, info.optimizer_steps) == (0, 10, 0, 0)
    assert info.initialized and info.elements == 40
    reserved = store.reserved_bytes
    assert reserved == 40 * 4 * 3  # values plus m and v
    values = store.get("v").value.copy()

    # The same spec again (the seed is filled from the name both times).
    info2, created2 = store.create(_spec(initializer=Uniform(), optimizer=Adam()))
    assert not created2
    assert info2 == info
    assert store.reserved_bytes == reserved
    assert len(store.parts()) == 1
    np.testing.assert_array_equal(store.get("v").value, values)


@pytest.mark.parametrize("other, field", [
    (_spec(shape=(10, 5)), "shape"),
    (_spec(dtype="float64"), "dtype"),
    (_spec(optimizer=SGD(learning_rate=0.5)), "optimizer"),
    (_spec(optimizer=Adam()), "optimizer"),
    (_spec(initializer=Constant(1.0)), "initializer"),
    (_spec(initializer=Uniform(seed=1)), "initializer"),
    (_spec(partitioner=FixedShardsPartitioner(2)), "partitioner"),
])
def test_create_with_a_different_spec_conflicts(other, field):
    store = VariableStore(0, 1, LIMIT)
    store.create(_spec())
    reserved = store.reserved_bytes
    with pytest.raises(RequestError) as info:
        store.create(other)
    assert info.value.reason == Reason.SPEC_CONFLICT
    assert "'v'" in info.value.message
    assert field in info.value.message
    # The difference itself is named, e.g. "shape (10, 4) != (10, 5)".
    assert any(d in info.value.message for d in _spec().differences(other))
    assert store.reserved_bytes == reserved
    assert store.get("v").spec == _spec()


def test_memory_limit_refuses_and_stores_nothing():
    spec = _spec(shape=(100, 10), optimizer=Adam())  # 1000 * 4 * 3 = 12000 bytes
    store = VariableStore(0, 1, 12000 + 399)
    store.create(_spec("small", (100,)))  # 400 bytes
    assert store.reserved_bytes == 400
    with pytest.raises(RequestError) as info:
        store.create(spec)
    assert info.value.reason == Reason.MEMORY_LIMIT
    assert "12000" in info.value.message and "'v'" in info.value.message
    assert store.reserved_bytes == 400
    assert [p.spec.name for p in store.parts()] == ["small"]
    with pytest.raises(RequestError) as missing:
        store.get("v")
    assert missing.value.reason == Reason.UNKNOWN_VARIABLE
    # Exactly at the limit is fine.
    store = VariableStore(0, 1, 12000)
    _, created = store.create(spec)
    assert created and store.reserved_bytes == 12000


def test_a_validated_create_books_its_bytes_and_place_until_used_cancelled_or_expired(monkeypatch):
    store = VariableStore(0, 1, 1000, max_variables=2)
    booked = _spec("a", (200,))  # 800 bytes
    assert store.validate(booked, booking="first") is None
    assert store.parts() == [] and store.reserved_bytes == 0 and store.held_bytes == 800
    for refused, reason in ((_spec("b", (100,)), Reason.MEMORY_LIMIT),  # 400 bytes: only 200 are free
                            (_spec("a", (201,)), Reason.SPEC_CONFLICT)):
        for attempt in (lambda: store.validate(refused, booking="second"), lambda: store.create(refused)):
            with pytest.raises(RequestError) as info:
                attempt()
            assert info.value.reason == reason
    assert store.validate(_spec("c", (10,)), booking="third") is None  # fits; the second of two places
    with pytest.raises(RequestError) as info:
        store.create(_spec("d", (1,)))
    assert info.value.reason == Reason.MEMORY_LIMIT and "--max-variables" in info.value.message
    # A create of the booked spec (whoever sends it) takes the booking's bytes: the limit is not hit.
    _, created = store.create(booked)
    assert created and store.reserved_bytes == 800 and store.held_bytes == 40
    assert store.validate(booked, booking="first").spec == booked  # now it exists
    store.cancel_booking("c", "someone else")  # not theirs: kept
    assert store.held_bytes == 40
    store.cancel_booking("c", "third")
    assert store.held_bytes == 0 and [p.spec.name for p in store.parts()] == ["a"]
    # A booking nobody uses expires: its bytes and place come back.
    clock = [0.0]
    monkeypatch.setattr("ps_server.core.memory.time.monotonic", lambda: clock[0])
    store.validate(_spec("e", (50,)), booking="fourth")
    assert store.held_bytes == 200
    clock[0] = memory_module.BOOKING_SECONDS + 1
    assert store.held_bytes == 0
    store.create(_spec("f", (50,)))
    assert sorted(p.spec.name for p in store.parts()) == ["a", "f"]


def test_memory_accounting_counts_only_this_shards_part():
    spec = _spec("big", (10, 100), partitioner=FixedShardsPartitioner(2), optimizer=Momentum())
    total = 0
    for shard in range(3):
        store = VariableStore(shard, 3, LIMIT)
        info, _ = store.create(spec)
        part = store.get("big")
        assert store.reserved_bytes == part.elements * 4 * 2
        total += part.elements
        if part.holds_part:
            assert info.row_end - info.row_start == 5
        else:
            assert (info.row_start, info.row_end, info.elements) == (0, 0, 0)
            assert store.reserved_bytes == 0
    assert total == 1000


@pytest.mark.parametrize("initializer", [Uniform(-1.0, 1.0), Normal(), Constant(2.0)])
def test_shards_hold_their_rows_of_the_global_initial_value(initializer):
    spec = _spec("w", (23, 3), initializer=initializer, partitioner=FixedShardsPartitioner(4))
    expected = np.empty(69, dtype=np.float32)
    fill_initial_values(spec.initializer, spec.shape, expected, 0)
    assembled = np.full(69, np.nan, dtype=np.float32)
    for shard in range(5):
        store = VariableStore(shard, 5, LIMIT)
        info, _ = store.create(spec)
        part = store.get("w")
        assembled[info.row_start * 3: info.row_end * 3] = part.value
    np.testing.assert_array_equal(assembled, expected)


def test_explicit_initializer_starts_uninitialized():
    store = VariableStore(0, 1, LIMIT)
    info, _ = store.create(_spec(initializer=Explicit(b"\x01" * 32)))
    assert not info.initialized


def test_store_rejects_a_bad_shard_index():
    with pytest.raises(ValueError, match="shard_index"):
        VariableStore(2, 2, LIMIT)
    with pytest.raises(ValueError, match="shard_index"):
        VariableStore(-1, 2, LIMIT)


def test_concurrent_creates_make_one_variable():
    store = VariableStore(0, 1, LIMIT)
    spec = _spec("c", (2000, 50), initializer=Normal())
    results = []
    barrier = threading.Barrier(6)

    def create():
        barrier.wait()
        results.append(store.create(spec))

    threads = [threading.Thread(target=create) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(created for _, created in results) == [False] * 5 + [True]
    assert all(info.initialized for info, _ in results)
    assert store.reserved_bytes == 2000 * 50 * 4


def test_check_dtype_allowed():
    store = VariableStore(0, 1, LIMIT)
    store.create(_spec())
    part = store.get("v")
    check_dtype_allowed(part, np.dtype("<f4"), assign=False)
    check_dtype_allowed(part, np.dtype("<f4"), assign=True)
    check_dtype_allowed(part, np.dtype("<f2"), assign=False)
    check_dtype_allowed(part, BFLOAT16, assign=False)
    for dtype, assign in [(np.dtype("<f2"), True), (BFLOAT16, True), (np.dtype("<f8"), False),
                          (np.dtype("<i4"), False)]:
        with pytest.raises(RequestError) as info:
            check_dtype_allowed(part, dtype, assign)
        assert info.value.reason == Reason.DTYPE_MISMATCH


# ---- begin_push validation --------------------------------------------------------------------


def _begin(items, *, sequence=1, kind=ps_pb2.GRADIENT, shard_index=0, num_shards=1,
           worker_id="worker-0", incarnation="inc-1", step=0):
    """A PushBegin message as the servicer hands it to the core."""
    return push_start(ps_pb2.PushBegin(
        worker_id=worker_id, incarnation=incarnation, sequence=sequence, step=step,
        shard_index=shard_index, num_shards=num_shards, kind=kind,
        items=[ps_pb2.PushItem(variable=name, elements=elements, wire_dtype=wire)
               for name, elements, wire in items]))


def _decoded_chunks(name: str, values: np.ndarray, chunk_elements: int) -> list[DecodedChunk]:
    wire = as_wire_array(values)
    out = []
    for offset, count in chunk_ranges(wire.size, chunk_elements):
        header = ps_pb2.ChunkHeader(variable=name, offset=offset, count=count,
                                    dtype=to_wire_dtype(wire.dtype), part_elements=wire.size)
        out.append(DecodedChunk(header, byte_view(wire[offset:offset + count])))
    return out


def _chunks(name: str, values: np.ndarray, chunk_elements: int):
    """Chunks of ``values`` as the servicer hands them to the core."""
    return [push_chunk(chunk) for chunk in _decoded_chunks(name, values, chunk_elements)]


@pytest.fixture
def setup():
    store = VariableStore(0, 1, LIMIT)
    store.create(_spec("a", (10, 4), initializer=Constant(1.0), optimizer=SGD(0.5)))
    store.create(_spec("b", (6,), initializer=Constant(2.0), optimizer=Adagrad()))
    return store, PushLedger()


def _snapshot(store):
    return [(p.info(), p.value.copy(), {k: v.copy() for k, v in p.slots.items()})
            for p in store.parts()]


def _assert_unchanged(store, ledger, before):
    after = _snapshot(store)
    assert len(after) == len(before)
    for (info_a, value_a, slots_a), (info_b, value_b, slots_b) in zip(before, after):
        assert info_a == info_b
        np.testing.assert_array_equal(value_a, value_b)
        assert slots_a.keys() == slots_b.keys()
        for k in slots_a:
            np.testing.assert_array_equal(slots_a[k], slots_b[k])
    assert not ledger.is_done("worker-0", "inc-1", 1)
    assert ledger._states.get(("worker-0", "inc-1")) is None or not ledger._states[
        ("worker-0", "inc-1")].open


@pytest.mark.parametrize("begin, reason, words", [
    (_begin([("nope", 40, ps_pb2.FLOAT32)]), Reason.UNKNOWN_VARIABLE, ["'nope'"]),
    (_begin([("a", 39, ps_pb2.FLOAT32)]), Reason.SHAPE_MISMATCH, ["39", "40", "'a'"]),
    (_begin([("a", 41, ps_pb2.FLOAT32)]), Reason.SHAPE_MISMATCH, ["41", "40"]),
    (_begin([("a", 40, ps_pb2.INT32)]), Reason.DTYPE_MISMATCH, ["int32", "float32"]),
    (_begin([("a", 40, ps_pb2.FLOAT64)]), Reason.DTYPE_MISMATCH, ["float64"]),
    (_begin([("a", 40, ps_pb2.DATA_TYPE_UNSPECIFIED)]), Reason.DTYPE_MISMATCH, ["'a'"]),
    (_begin([("a", 40, ps_pb2.FLOAT16)], kind=ps_pb2.ASSIGN), Reason.DTYPE_MISMATCH, ["float16"]),
    (_begin([("a", 40, ps_pb2.FLOAT32)], shard_index=1, num_shards=2), Reason.CLUSTER_MISMATCH,
     ["shard 0 of 1", "shard 1 of 2"]),
    (_begin([("a", 40, ps_pb2.FLOAT32)], num_shards=3), Reason.CLUSTER_MISMATCH, ["0 of 3"]),
    (_begin([("a", 40, ps_pb2.FLOAT32)], worker_id=""), Reason.INVALID_REQUEST, ["worker_id"]),
    (_begin([("a", 40, ps_pb2.FLOAT32)], worker_id="x" * 257), Reason.INVALID_REQUEST, ["worker_id"]),
    (_begin([("a", 40, ps_pb2.FLOAT32)], incarnation=""), Reason.INVALID_REQUEST, ["incarnation"]),
    (_begin([("a", 40, ps_pb2.FLOAT32)], sequence=0), Reason.INVALID_REQUEST, ["sequence"]),
    (_begin([("a", 40, ps_pb2.FLOAT32)], kind=ps_pb2.PUSH_KIND_UNSPECIFIED), Reason.INVALID_REQUEST,
     ["kind"]),
    (_begin([]), Reason.INVALID_REQUEST, ["at least one"]),
    (_begin([("a", 40, ps_pb2.FLOAT32), ("a", 40, ps_pb2.FLOAT32)]), Reason.INVALID_REQUEST,
     ["twice"]),
    # A valid first item does not get applied when the second is bad.
    (_begin([("a", 40, ps_pb2.FLOAT32), ("b", 7, ps_pb2.FLOAT32)]), Reason.SHAPE_MISMATCH, ["'b'"]),
    (_begin([("a", 40, ps_pb2.FLOAT32), ("zz", 6, ps_pb2.FLOAT32)]), Reason.UNKNOWN_VARIABLE,
     ["'zz'"]),
])
def test_begin_push_validation_changes_nothing(setup, begin, reason, words):
    store, ledger = setup
    before = _snapshot(store)
    with pytest.raises(RequestError) as info:
        begin_push(store, ledger, begin)
    assert info.value.reason == reason
    for word in words:
        assert word in info.value.message, f"{word!r} missing from {info.value.message}"
    _assert_unchanged(store, ledger, before)
    # A valid push afterwards still works as the very first push of this worker.
    push = begin_push(store, ledger, _begin([("a", 40, ps_pb2.FLOAT32)]))
    for chunk in _chunks("a", np.ones(40, np.float32), 40):
        push.apply(chunk)
    result = push.finish()
    assert result.versions == {"a": 1} and not result.duplicate
    np.testing.assert_array_equal(store.get("a").value, np.full(40, 0.5, np.float32))
    assert store.get("a").info().optimizer_steps == 1


def test_gradient_push_to_an_explicit_variable_waits_for_its_value():
    store, ledger = VariableStore(0, 1, LIMIT), PushLedger()
    store.create(_spec("e", (4,), initializer=Explicit(b"\x00" * 32)))
    with pytest.raises(RequestError) as info:
        begin_push(store, ledger, _begin([("e", 4, ps_pb2.FLOAT32)]))
    assert info.value.reason == Reason.NOT_INITIALIZED
    # Upload the value, then gradients are accepted.
    value = np.arange(4, dtype=np.float32)
    push = begin_push(store, ledger, _begin([("e", 4, ps_pb2.FLOAT32)], kind=ps_pb2.ASSIGN))
    for chunk in _chunks("e", value, 3):
        push.apply(chunk)
    result = push.finish()
    assert result.versions == {"e": 0}, "an assign is not a training step"
    info = store.get("e").info()
    assert info.initialized and info.optimizer_steps == 0
    np.testing.assert_array_equal(store.get("e").value, value)
    push = begin_push(store, ledger, _begin([("e", 4, ps_pb2.FLOAT32)], sequence=2))
    for chunk in _chunks("e", np.ones(4, np.float32), 4):
        push.apply(chunk)
    assert push.finish().versions == {"e": 1}


def test_variable_with_no_part_here_is_refused():
    store, ledger = VariableStore(1, 2, LIMIT), PushLedger()
    spec = _spec("solo", (3,))  # small: one part, on one of the two shards
    if spec.placement(2).part_on(1) is not None:
        store = VariableStore(0, 2, LIMIT)
        shard = 0
    else:
        shard = 1
    store.create(spec)
    with pytest.raises(RequestError) as info:
        begin_push(store, ledger, _begin([("solo", 0, ps_pb2.FLOAT32)], shard_index=shard,
                                         num_shards=2))
    assert info.value.reason == Reason.INVALID_REQUEST
    assert "no part" in info.value.message


def test_check_cluster():
    store = VariableStore(1, 3, LIMIT)
    check_cluster(store, 1, 3)
    for index, count in [(0, 3), (1, 2), (2, 4)]:
        with pytest.raises(RequestError) as info:
            check_cluster(store, index, count)
        assert info.value.reason == Reason.CLUSTER_MISMATCH


# ---- applying pushes ----------------------------------------------------------------------------


def test_push_exactly_once_across_a_cut_and_a_retry(setup):
    store, ledger = setup
    g_a = np.arange(40, dtype=np.float32) / 10
    g_b = np.linspace(-1, 1, 6).astype(np.float32)
    begin = _begin([("a", 40, ps_pb2.FLOAT32), ("b", 6, ps_pb2.FLOAT32)], sequence=1)
    chunks = _chunks("a", g_a, 7) + _chunks("b", g_b, 4)

    # First stream: cut off after three chunks.
    push = begin_push(store, ledger, begin)
    for chunk in chunks[:3]:
        push.apply(chunk)
    with pytest.raises(RequestError) as info:
        push.finish()
    assert info.value.reason == Reason.PUSH_INCOMPLETE
    assert store.get("a").info().version == 0

    # Retry: sends everything again; only the missing chunks are applied.
    retry = begin_push(store, ledger, begin)
    for chunk in chunks:
        retry.apply(chunk)
    result = retry.finish()
    assert not result.duplicate
    assert result.elements_applied == 46 - 21
    assert result.versions == {"a": 1, "b": 1}
    expected_a = np.float32(1.0) - np.float32(0.5) * g_a
    np.testing.assert_array_equal(store.get("a").value, expected_a)
    assert store.get("a").info().optimizer_steps == 1
    assert store.get("b").info().optimizer_steps == 1

    # A retry after completion (ack lost) is a duplicate and applies nothing.
    again = begin_push(store, ledger, begin)
    for chunk in chunks:
        again.apply(chunk)
    result = again.finish()
    assert result.duplicate and result.elements_applied == 0
    assert result.versions == {"a": 1, "b": 1}
    np.testing.assert_array_equal(store.get("a").value, expected_a)
    assert store.get("a").info().optimizer_steps == 1


def test_narrow_gradients_are_applied(setup):
    store, ledger = setup
    g = np.full(40, 0.25, dtype=np.float32)
    push = begin_push(store, ledger, _begin([("a", 40, ps_pb2.BFLOAT16)]))
    for chunk in _chunks("a", g.astype(BFLOAT16), 16):
        push.apply(chunk)
    push.finish()
    np.testing.assert_array_equal(store.get("a").value, np.full(40, 1.0 - 0.5 * 0.25, np.float32))


@pytest.mark.parametrize("mutate, words", [
    (lambda h, d: (h.__setattr__("variable", "b"), d), ["'b'"]),
    (lambda h, d: (h.__setattr__("dtype", ps_pb2.FLOAT16), d[: len(d) // 2]), ["float16"]),
    (lambda h, d: (h.__setattr__("dtype", 77), d), ["77"]),
    (lambda h, d: (h.__setattr__("offset", 38), d), ["outside", "40"]),
    (lambda h, d: (h.__setattr__("count", 3), d), ["'a'"]),
])
def test_invalid_chunks_are_refused_before_anything_is_applied(setup, mutate, words):
    store, ledger = setup
    push = begin_push(store, ledger, _begin([("a", 40, ps_pb2.FLOAT32)]))
    (chunk,) = _decoded_chunks("a", np.ones(4, np.float32), 4)
    header = ps_pb2.ChunkHeader()
    header.CopyFrom(chunk.header)
    _, data = mutate(header, chunk.data)
    before = store.get("a").value.copy()
    with pytest.raises(RequestError) as info:
        push.apply(push_chunk(DecodedChunk(header, data)))
    assert info.value.reason == Reason.INVALID_CHUNK
    for word in words:
        assert word in info.value.message
    np.testing.assert_array_equal(store.get("a").value, before)
    assert store.get("a").info().optimizer_steps == 0


def test_concurrent_pushes_to_one_variable_lose_nothing():
    store, ledger = VariableStore(0, 1, LIMIT), PushLedger()
    store.create(_spec("acc", (1000,), initializer=Constant(0.0), optimizer=SGD(1.0)))
    workers, pushes = 4, 10

    def worker(w):
        for seq in range(1, pushes + 1):
            push = begin_push(store, ledger, _begin([("acc", 1000, ps_pb2.FLOAT32)],
                                                    sequence=seq, worker_id=f"w{w}"))
            for chunk in _chunks("acc", np.full(1000, -1.0, np.float32), 128):
                push.apply(chunk)
            push.finish()

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    part = store.get("acc")
    np.testing.assert_array_equal(part.value, np.full(1000, workers * pushes, np.float32))
    assert part.info().version == workers * pushes
    assert part.info().optimizer_steps == workers * pushes


def test_retried_assign_push_is_a_duplicate():
    store, ledger = VariableStore(0, 1, LIMIT), PushLedger()
    value = np.arange(4, dtype=np.float32)
    store.create(_spec("e", (4,), initializer=Explicit(hashlib.sha256(value.tobytes()).digest())))
    begin = _begin([("e", 4, ps_pb2.FLOAT32)], kind=ps_pb2.ASSIGN)
    push = begin_push(store, ledger, begin)
    for chunk in _chunks("e", value, 4):
        push.apply(chunk)
    push.finish()
    retry = begin_push(store, ledger, begin)
    for chunk in _chunks("e", value, 4):
        retry.apply(chunk)
    assert retry.finish().duplicate


def _upload(store, ledger, name, value, incarnation, chunk_elements):
    """An ASSIGN push of ``value`` begun by ``incarnation``, and its chunks (not yet applied)."""
    begin = _begin([(name, value.size, ps_pb2.FLOAT32)], kind=ps_pb2.ASSIGN, incarnation=incarnation)
    return begin_push(store, ledger, begin), _chunks(name, value, chunk_elements)


def test_racing_uploads_of_an_initial_value_the_first_complete_one_wins():
    store, ledger = VariableStore(0, 1, LIMIT), PushLedger()
    value = np.arange(12, dtype=np.float32)
    store.create(_spec("e", (12,), initializer=Explicit(hashlib.sha256(value.tobytes()).digest())))
    part = store.get("e")
    slow, slow_chunks = _upload(store, ledger, "e", value, "slow", 4)
    fast, fast_chunks = _upload(store, ledger, "e", value, "fast", 6)
    assert store.reserved_bytes == 3 * 12 * 4, "each upload stages in its own buffer"
    slow.apply(slow_chunks[0])
    assert not part.initialized and not part.value.any(), "a staged chunk is not in the part"
    for chunk in fast_chunks:
        fast.apply(chunk)
    assert not fast.finish().duplicate
    np.testing.assert_array_equal(part.value, value)
    # Training starts; the slow upload's later chunks must never land.
    train = begin_push(store, ledger, _begin([("e", 12, ps_pb2.FLOAT32)], incarnation="trainer"))
    for chunk in _chunks("e", np.ones(12, np.float32), 12):
        train.apply(chunk)
    train.finish()
    trained = part.value.copy()
    for chunk in slow_chunks[1:]:
        slow.apply(chunk)
    assert slow.finish().duplicate
    np.testing.assert_array_equal(part.value, trained)
    # A late creator's upload that begins now is a duplicate at once.
    late, late_chunks = _upload(store, ledger, "e", value, "late", 12)
    for chunk in late_chunks:
        late.apply(chunk)
    assert late.finish().duplicate
    np.testing.assert_array_equal(part.value, trained)
    assert store.reserved_bytes == 12 * 4, "the staging buffers were given back"


def test_an_array_create_whose_upload_buffer_does_not_fit_is_refused_and_creates_nothing():
    store = VariableStore(0, 1, 12 * 4 + 10)
    value = np.arange(12, dtype=np.float32)
    spec = _spec("e", (12,), initializer=Explicit(hashlib.sha256(value.tobytes()).digest()))
    for refused in (lambda: store.validate(spec, "booking-1"), lambda: store.create(spec)):
        with pytest.raises(RequestError) as info:
            refused()
        assert info.value.reason == Reason.MEMORY_LIMIT and "initial value is uploaded" in info.value.message
    assert store.reserved_bytes == store.held_bytes == 0 and store.describe() == []


def _uploads_racing_for_one_buffer():
    """A store with room for an array variable, its upload share and less than one more buffer;
    the first upload holds the share."""
    value = np.arange(100_000, dtype=np.float32)  # (the ledger's records of two uploads fit beside it)
    store, ledger = VariableStore(0, 1, 3 * value.nbytes - 1), PushLedger()
    store.create(_spec("e", (100_000,), initializer=Explicit(hashlib.sha256(value.tobytes()).digest())))
    assert store.reserved_bytes == 2 * value.nbytes, "the part and the buffer of its upload"
    first, chunks = _upload(store, ledger, "e", value, "first", 25_000)
    assert store.reserved_bytes == 2 * value.nbytes, "the first upload stages in the booked buffer"
    return store, ledger, value, first, chunks


def test_an_upload_waiting_for_a_buffer_is_a_duplicate_once_another_upload_is_installed():
    store, ledger, value, first, chunks = _uploads_racing_for_one_buffer()
    answers = []
    second = threading.Thread(
        target=lambda: answers.append(_upload(store, ledger, "e", value, "second", 100_000)),
        name="second-upload")
    second.start()
    for chunk in chunks:
        first.apply(chunk)
    assert not first.finish().duplicate
    second.join(30)
    assert len(answers) == 1
    late, late_chunks = answers[0]
    for chunk in late_chunks:
        late.apply(chunk)
    assert late.finish().duplicate
    np.testing.assert_array_equal(store.get("e").value, value)
    assert store.reserved_bytes == value.nbytes, "the booked buffer was given back with the install"


def test_an_upload_that_does_not_fit_the_memory_limit_changes_nothing():
    """It waited for the upload that holds the booked buffer, which neither completed nor went."""
    store, ledger, value, first, chunks = _uploads_racing_for_one_buffer()
    begin = _begin([("e", value.size, ps_pb2.FLOAT32)], kind=ps_pb2.ASSIGN, incarnation="second")
    with pytest.raises(RequestError) as info:
        begin_push(store, ledger, begin, wait_seconds=0.05)
    assert info.value.reason == Reason.MEMORY_LIMIT and "'e'" in info.value.message
    assert store.reserved_bytes == 2 * value.nbytes and not store.get("e").initialized
    assert ledger._states.get(("worker-0", "second")) is None
    for chunk in chunks:
        first.apply(chunk)
    assert not first.finish().duplicate
    retry = begin_push(store, ledger, begin, wait_seconds=0.05)  # the variable has its value now
    for chunk in _chunks("e", value, 100_000):
        retry.apply(chunk)
    assert retry.finish().duplicate
    np.testing.assert_array_equal(store.get("e").value, value)
    assert store.reserved_bytes == value.nbytes


def test_an_abandoned_upload_gives_its_buffer_back_when_the_ledger_forgets_it():
    store, ledger = VariableStore(0, 1, LIMIT), PushLedger(max_open_pushes=1)
    value = np.arange(12, dtype=np.float32)
    store.create(_spec("e", (12,), initializer=Explicit(hashlib.sha256(value.tobytes()).digest())))
    abandoned, chunks = _upload(store, ledger, "e", value, "inc-1", 4)
    abandoned.apply(chunks[0])
    del abandoned, chunks
    assert store.reserved_bytes == 2 * 12 * 4
    # The next push of this incarnation writes the open one off (max_open_pushes=1).
    begin_push(store, ledger, _begin([("e", 12, ps_pb2.FLOAT32)], kind=ps_pb2.ASSIGN, sequence=2,
                                     incarnation="inc-1"))
    assert store.reserved_bytes == 2 * 12 * 4, "the written-off buffer went, the new one came"


def test_create_fills_outside_the_apply_gate(monkeypatch):
    """A checkpoint (the gate exclusive) completes while a create is still filling its values."""
    import ps_server.core.parts as parts_module

    store = VariableStore(0, 1, LIMIT)
    filling, release = threading.Event(), threading.Event()
    original = parts_module.fill_initial_values

    def slow_fill(*args):
        filling.set()
        assert release.wait(30)
        original(*args)

    monkeypatch.setattr(parts_module, "fill_initial_values", slow_fill)
    snapshotted: list[list[str]] = []

    def checkpoint() -> None:
        with store.gate.exclusive():  # waits for the create if the fill holds the gate
            snapshotted.append([p.spec.name for p in store.parts()])

    creator = threading.Thread(target=store.create, args=(_spec("big", (100, 4), initializer=Normal()),),
                               name="creator")
    checkpointer = threading.Thread(target=checkpoint, name="checkpointer")
    creator.start()
    try:
        assert filling.wait(30)
        checkpointer.start()
        checkpointer.join(30)  # a bound that only detects the wait
        assert snapshotted == [[]], "the checkpoint waited for the fill (or saw a part not yet filled)"
    finally:
        release.set()
        creator.join(30)
        checkpointer.join(30)
    assert store.get("big").initialized


def test_a_create_refused_by_a_sealed_gate_leaves_nothing_and_wakes_the_waiters():
    store = VariableStore(0, 1, LIMIT)
    store.gate.seal()  # the final checkpoint of a shutdown was taken
    for _ in range(2):  # the second attempt would hang if the first had left its placeholder
        with pytest.raises(RequestError) as info:
            store.create(_spec("late", (10, 4), initializer=Normal()))
        assert info.value.reason == Reason.SHUTTING_DOWN
    assert store.parts() == [] and store.reserved_bytes == 0


def test_empty_variable_push_completes_at_once():
    store, ledger = VariableStore(0, 1, LIMIT), PushLedger()
    store.create(_spec("z", (0, 3)))
    push = begin_push(store, ledger, _begin([("z", 0, ps_pb2.FLOAT32)]))
    result = push.finish()
    assert result.versions == {"z": 1}
    assert ledger.is_done("worker-0", "inc-1", 1)
    assert rows_of((0, 3)) == (0, 3)


def test_failed_chunk_application_does_not_block_the_retry(setup, monkeypatch):
    store, ledger = setup
    part = store.get("a")
    original = part.apply_gradient
    calls = []

    def flaky(offset, grad, step):
        calls.append(offset)
        if len(calls) == 1:
            raise MemoryError("simulated")
        original(offset, grad, step)

    monkeypatch.setattr(part, "apply_gradient", flaky)
    begin = _begin([("a", 40, ps_pb2.FLOAT32)])
    (chunk,) = _chunks("a", np.ones(40, np.float32), 40)
    push = begin_push(store, ledger, begin)
    with pytest.raises(MemoryError):
        push.apply(chunk)
    outcome = []

    def retry():
        again = begin_push(store, ledger, begin)
        again.apply(chunk)
        outcome.append(again.finish())

    thread = threading.Thread(target=retry, daemon=True)
    thread.start()
    thread.join(2)
    assert not thread.is_alive(), "the retry hangs on the unreleased claim"
    assert outcome and not outcome[0].duplicate


def test_rows_to_send_are_read_under_the_parts_lock_when_the_message_is_joined():
    """A pull's rows are gathered as its answer is joined: after the check, never under a push's lock."""
    store = VariableStore(0, 2, LIMIT)
    store.create(_spec("table", shape=(10, 3), partitioner=FixedShardsPartitioner(2)))
    part = store.get("table")
    start, end = part.row_start, part.row_end
    assert end - start == 5
    part.value[:] = np.arange(part.value.size)
    with pytest.raises(RequestError):
        part.local_rows(np.array([start, (end + 1) % 10]))  # another shard's row: refused when planned
    gather = part.rows_to_send(part.local_rows(np.array([start + 4, start, start + 2])))
    joined: list[bytes] = []
    with part.lock:
        thread = threading.Thread(target=lambda: joined.append(join_pieces([b"h", gather])), name="join")
        thread.start()
        thread.join(0.2)
        assert thread.is_alive() and not joined  # waits for the lock
        part.value[:3] = -1  # a change made under the lock is what the message carries
    thread.join(10)
    expected = np.arange(15, dtype=np.float32).reshape(5, 3)
    expected[0] = -1
    assert joined == [b"h" + expected[[4, 0, 2]].tobytes()]


@pytest.mark.parametrize("shard", [0, 1])
def test_local_rows_refuse_every_row_outside_the_part(shard):
    """One unsigned pass checks both ends, also for ids at the edges of int64."""
    store = VariableStore(shard, 2, LIMIT)
    store.create(_spec("table", shape=(10, 3), partitioner=FixedShardsPartitioner(2)))
    part = store.get("table")
    start, end = part.row_start, part.row_end
    inside = np.arange(start, end, dtype=np.int64)
    assert part.local_rows(inside).tolist() == list(range(end - start))
    assert part.local_rows(np.array([], np.int64)).size == 0
    info = np.iinfo(np.int64)
    for bad in (start - 1, end, -1, info.min, info.max, info.min + start, start - (1 << 63) + 5):
        ids = np.array([start, bad, end - 1], dtype=np.int64)
        with pytest.raises(RequestError, match=f"row {bad} of 'table' is not on this shard"):
            part.local_rows(ids)


# ---- bytes held for requests -------------------------------------------------------------------


def test_held_bytes_share_the_limit_with_variables_and_are_given_back():
    store = VariableStore(0, 1, memory_limit=10_000)
    store.create(VariableSpec("v", (1000,), "float32", initializer=Zeros(), optimizer=SGD(learning_rate=0.1)))
    with store.hold(6000, "a pull's rows"):
        assert store.held_bytes == 6000 and store.reserved_bytes == 4000
        with pytest.raises(RequestError) as info:
            store.hold(1, "another pull")
        assert info.value.reason == Reason.MEMORY_LIMIT and "another pull needs 1 bytes" in info.value.message
        with pytest.raises(RequestError):  # variables too
            store.create(VariableSpec("w", (1,), "float32", initializer=Zeros(),
                                      optimizer=SGD(learning_rate=0.1)))
    assert store.held_bytes == 0
    cell = [3000]
    store.book(3000, "a push's records")
    store.give_back(cell)  # (from a finalizer: counted at the next look)
    assert store.held_bytes == 0


def test_known_names_keeps_only_variables_of_the_shard():
    store = VariableStore(0, 1, memory_limit=1 << 20)
    store.create(VariableSpec("v", (4,), "float32", initializer=Zeros(), optimizer=SGD(learning_rate=0.1)))
    assert store.known_names(["x", "v", "y"]) == ["v"]
    assert store.known_names(["x"]) == store.known_names([]) == ["-"]


def test_a_staging_buffer_that_cannot_be_allocated_is_refused_and_books_nothing(monkeypatch):
    """Out of memory allocating an upload's buffer: MEMORY_LIMIT, and the bytes booked for it are
    given back (else every such failure shrinks the shard's limit for good)."""
    import ps_server.core.uploads as uploads_module

    store = VariableStore(0, 1, LIMIT)
    value = np.arange(8, dtype=np.float32)
    store.create(_spec("e", (8,), initializer=Explicit(hashlib.sha256(value.tobytes()).digest())))
    before = store.reserved_bytes

    class NoMemory:
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def empty(*args, **kwargs):
            raise MemoryError

    monkeypatch.setattr(uploads_module, "np", NoMemory())
    with pytest.raises(RequestError) as info:
        store.stage_upload(store.get("e"))
    assert info.value.reason == Reason.MEMORY_LIMIT
    assert store.reserved_bytes == before
