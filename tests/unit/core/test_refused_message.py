"""A push message refused part way: the prefix it applied is what a replica applies, the rest comes once.

The primary applies a message with ``ActivePush.apply_many``; when a later
chunk is refused (a hash table at its row limit, its growth past the memory
limit) the chunks before it stay applied and ``applied_chunks`` counts them.
A backup applies what the primary logs of the message (the servicer's
``chunks_message`` of that prefix) with the same code, and must then hold
the same bits; a retry of the push on either applies the rest exactly once.
"""

from __future__ import annotations

import numpy as np
import pytest

from ps_server.core.errors import RequestError
from ps_server.core.ledger import PushLedger
from ps_server.core.pushes import begin_push
from ps_server.core.store import VariableStore
from ps_server.service.push_messages import chunks_message, push_chunks, push_start
from wehub_ps.errors import Reason
from wehub_ps.specs import Adam, Constant, VariableSpec
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.arrays import byte_view
from wehub_ps.wire.codec import DecodedChunk, decode_push_request

LIMIT = 1 << 30
DIM = 4
NEW_IDS = np.array([5000, 5001], np.int64)  # rows the push adds: past max_rows, or its growth past memory


def _store(max_rows: int, held: int) -> VariableStore:
    """``a`` (dense) and the table ``t`` holding ``held`` rows (1,024 fill its first capacity)."""
    store = VariableStore(0, 1, LIMIT)
    store.create(VariableSpec("a", (8, DIM), "float32", initializer=Constant(0.5), optimizer=Adam(0.1)))
    store.create(VariableSpec("t", (DIM,), "float32", initializer=Constant(0.25), optimizer=Adam(0.1),
                              hash_table=True, max_rows=max_rows))
    store.read_rows([(store.get("t"), np.arange(1, held + 1, dtype=np.int64))])
    return store


def _begin() -> ps_pb2.PushBegin:
    return ps_pb2.PushBegin(
        worker_id="w0", incarnation="i0", sequence=1, shard_index=0, num_shards=1, kind=ps_pb2.GRADIENT,
        items=[ps_pb2.PushItem(variable="a", elements=8 * DIM, wire_dtype=ps_pb2.FLOAT32),
               ps_pb2.PushItem(variable="t", elements=len(NEW_IDS) * DIM, wire_dtype=ps_pb2.FLOAT32,
                               row_ids=NEW_IDS.astype("<i8").tobytes())])


def _chunk(name: str, offset: int, values: np.ndarray) -> DecodedChunk:
    header = ps_pb2.ChunkHeader(variable=name, offset=offset, count=values.size, dtype=ps_pb2.FLOAT32)
    return DecodedChunk(header, byte_view(values))


def _message() -> list[DecodedChunk]:
    """Two chunks of ``a``, then the table's rows: the last one is refused."""
    grad = np.linspace(-1.0, 1.0, 8 * DIM, dtype=np.float32)
    rows = np.arange(len(NEW_IDS) * DIM, dtype=np.float32) - 3.0
    return [_chunk("a", 0, grad[:16]), _chunk("a", 16, grad[16:]), _chunk("t", 0, rows)]


def _state(store: VariableStore, ledger: PushLedger) -> tuple:
    """Everything a replica must hold alike: values, slots, versions, rows and their LRU clock, ledger."""
    parts = []
    for snap in sorted(store.snapshot(), key=lambda s: s.spec.name):
        arrays = {"value": snap.value, **{f"slot:{k}": v for k, v in snap.slots.items()},
                  **(snap.rows or {})}
        bits = {name: (arr.dtype.str, arr.shape, arr.tobytes()) for name, arr in sorted(arrays.items())}
        parts.append((snap.spec.name, snap.version, snap.optimizer_steps, snap.access_clock, bits))
    return parts, ledger.snapshot()


def _apply(store: VariableStore, ledger: PushLedger, chunks: list[DecodedChunk]):
    push = begin_push(store, ledger, push_start(_begin()))
    push.apply_many(push_chunks(chunks))
    return push


@pytest.mark.parametrize("limit", ["max_rows", "memory"])
def test_a_refused_chunk_leaves_the_prefix_a_replica_applies_and_a_retry_applies_the_rest_once(limit):
    # At the row limit: 3 rows of 4. At the memory limit: a full capacity, so new rows grow the table.
    rows_limit, held = (4, 3) if limit == "max_rows" else (0, 1024)
    primary, primary_ledger = _store(rows_limit, held), PushLedger()
    backup, backup_ledger = _store(rows_limit, held), PushLedger()
    whole, whole_ledger = _store(0, held), PushLedger()  # the same push applied in one go, nothing refused
    untouched_a = primary.get("a").value.copy()
    hold = None
    if limit == "memory":
        # Bytes only the primary holds (a pull's answer, say): the table cannot grow there.
        free = primary.memory_limit - primary._memory.reserved_bytes - primary._memory.held_bytes
        hold = primary.hold(free - 64 * 1024, "a request in flight on the primary")
    message = _message()

    push = begin_push(primary, primary_ledger, push_start(_begin()))
    with pytest.raises(RequestError) as refused:
        push.apply_many(push_chunks(message))
    assert refused.value.reason is Reason.MEMORY_LIMIT
    assert push.applied_chunks == 2
    assert not np.array_equal(primary.get("a").value, untouched_a), "the chunks before the refusal stay"
    assert primary.get("t").num_rows == held, "the refused chunk changed nothing"
    (entry,) = primary_ledger.snapshot()
    assert entry["open"]["1"]["chunks"] == {"a": [[0, 16], [16, 16]]}

    # What the servicer logs of the message, applied by a backup with the same code.
    _, logged = decode_push_request(chunks_message(message[:push.applied_chunks]))
    assert [(c.header.variable, c.header.offset) for c in logged] == [("a", 0), ("a", 16)]
    replayed = _apply(backup, backup_ledger, logged)
    assert replayed.applied_chunks == 2
    assert _state(backup, backup_ledger) == _state(primary, primary_ledger)

    # Room again (the limit raised, the hold let go): a retry applies the table's rows, and "a" not again.
    if hold is not None:
        hold.release()
    for store in (primary, backup):
        store.get("t").max_rows = 0
    for store, ledger in ((primary, primary_ledger), (backup, backup_ledger)):
        retry = _apply(store, ledger, message)
        result = retry.finish()
        assert not result.duplicate and result.elements_applied == len(NEW_IDS) * DIM
        assert ledger.is_done("w0", "i0", 1)
    _apply(whole, whole_ledger, message).finish()
    assert _state(primary, primary_ledger) == _state(backup, backup_ledger)
    primary_parts, _ = _state(primary, primary_ledger)
    whole_parts, _ = _state(whole, whole_ledger)
    assert primary_parts == whole_parts


def test_the_logged_prefix_keeps_the_chunks_in_their_order():
    """Small chunks after a large one stay after it: a ChunkBatch would move them first."""
    large = np.ones(40_000, np.float32)  # 160 KB: a TensorChunk of its own in a client's message
    chunks = [_chunk("x", 0, np.ones(3, np.float32)), _chunk("y", 0, large), _chunk("z", 0, large[:5])]
    _, decoded = decode_push_request(chunks_message(chunks))
    assert [c.header.variable for c in decoded] == ["x", "y", "z"]
    assert [bytes(c.data) for c in decoded] == [bytes(c.data) for c in chunks]
