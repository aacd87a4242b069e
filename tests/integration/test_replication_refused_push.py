"""A replicated shard refuses a push message part way: the backup holds what the primary applied.

Real ps-server processes (--replicas 2) on a real etcd (tests/etcd_server.py
skips where etcd is not installed). One push message carries a dense
chunk and then a hash table's new rows; the table's growth does not fit
--max-memory-bytes on the primary, which holds the push's own ``pull_after``
answer meanwhile (bytes only the primary books), so the rows are refused
after the dense chunk was applied. The backup must hold the same bits, the
ledger included; after the primary is SIGKILLed, a retry of the push on
the new primary applies the rows, and the dense chunk not again.
"""

from __future__ import annotations

import signal
import time

import grpc
import numpy as np
import pytest
from replica_testing import ReplicatedCluster, assert_same_bits, checkpoint_contents

from wehub_ps.errors import REASON_METADATA_KEY
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.arrays import byte_view
from wehub_ps.wire.codec import OutgoingChunk, encode_push_request
from wehub_ps.wire.rpc import method_path
from worker_client import SGD, Adam, PSClient, Zeros

LIMIT = 24 << 20  # --max-memory-bytes
BALLAST = 3 << 20  # float32 elements (12 MiB): what a pull_after of part of it holds is chosen freely
DIM = 128  # a table row of 128 float32 with Adam: its first growth books over 1.5 MB
TABLE_IDS = np.array([7, 70, 700, 7000], np.int64)
#: Bytes left free beside the pull_after hold: enough for the push's ledger record, not the table's growth.
SPARE = 512 << 10


@pytest.fixture
def cluster(tmp_path, etcd_server):
    cluster = ReplicatedCluster(tmp_path / "replicated", etcd_server.endpoint, 1, 2,
                                ("--max-memory-bytes", str(LIMIT)))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def _wait_caught_up(cluster: ReplicatedCluster, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        primary = cluster.primary(0)
        status = primary.status()
        backups = [r for r in cluster.shards[0] if r is not primary and r.running()]
        if all(b.status().applied_sequence == status.applied_sequence for b in backups) and all(
                b.in_sync for b in status.backups):
            return
        assert time.monotonic() < deadline, f"backups did not catch up:\n{cluster.logs()}"
        time.sleep(0.05)


def _begin(pull_after: int) -> ps_pb2.PushBegin:
    """Push 1 of one worker: all of ``a``, new rows of ``t``; ``pull_after`` ballast elements after it."""
    begin = ps_pb2.PushBegin(
        worker_id="w-refused", incarnation="i-refused", sequence=1, shard_index=0, num_shards=1,
        kind=ps_pb2.GRADIENT,
        items=[ps_pb2.PushItem(variable="a", elements=64 * 8, wire_dtype=ps_pb2.FLOAT32),
               ps_pb2.PushItem(variable="t", elements=len(TABLE_IDS) * DIM, wire_dtype=ps_pb2.FLOAT32,
                               row_ids=TABLE_IDS.astype("<i8").tobytes())])
    if pull_after:
        begin.pull_after.CopyFrom(ps_pb2.PullRequest(
            shard_index=0, num_shards=1, items=[ps_pb2.PullItem(variable="ballast", count=pull_after)]))
    return begin


def _message(begin: ps_pb2.PushBegin, grad_a: np.ndarray, grad_t: np.ndarray) -> bytes:
    """One message: the begin, the dense chunk, then the table's rows (in this order, one ChunkBatch)."""
    chunks = [OutgoingChunk(ps_pb2.ChunkHeader(variable=name, offset=0, count=values.size,
                                               dtype=ps_pb2.FLOAT32), byte_view(values))
              for name, values in (("a", grad_a), ("t", grad_t))]
    return encode_push_request(begin, chunks)


def _push(address: str, message: bytes) -> ps_pb2.PushResponse:
    with grpc.insecure_channel(address) as channel:
        raw = channel.stream_unary(method_path("Push"))(iter([message]), timeout=30)
    return ps_pb2.PushResponse.FromString(raw)


def _open_push(state: dict) -> dict:
    (entry,) = [e for e in state["ledger"]["entries"] if e["worker_id"] == "w-refused"]
    return entry["open"]["1"]


def test_a_message_refused_part_way_leaves_the_same_bits_on_the_backup_and_a_retry_completes_it_once(cluster):
    primary = cluster.primary(0)
    backup = next(r for r in cluster.shards[0] if r is not primary)
    with PSClient(cluster.addresses, worker_id="setup", register=False) as client:
        client.create_variable("a", (64, 8), initializer=Zeros(), optimizer=Adam(0.01))
        client.create_embedding("t", DIM, initializer="zeros", optimizer=SGD(1.0))
        client.create_variable("ballast", (BALLAST,), initializer=Zeros(), optimizer=SGD(1.0))
    _wait_caught_up(cluster)
    with grpc.insecure_channel(primary.address) as channel:
        described = ps_pb2.DescribeResponse.FromString(channel.unary_unary(method_path("Describe"))(
            ps_pb2.DescribeRequest().SerializeToString(), timeout=10))
    free = described.memory_limit_bytes - described.stored_bytes
    assert 4 * BALLAST > free - SPARE > 0, (free, BALLAST)
    rng = np.random.default_rng(5)
    grad_a = rng.integers(-3, 4, (64, 8)).astype(np.float32)
    grad_t = rng.integers(-3, 4, (len(TABLE_IDS), DIM)).astype(np.float32)

    with pytest.raises(grpc.RpcError) as refused:
        _push(primary.address, _message(_begin((free - SPARE) // 4), grad_a, grad_t))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
    assert dict(refused.value.trailing_metadata())[REASON_METADATA_KEY] == "MEMORY_LIMIT"
    assert "hash table" in refused.value.details() or "'t'" in refused.value.details(), \
        refused.value.details()

    # Both replicas write a checkpoint at the same point of the shard's order: compare them bit for bit.
    _wait_caught_up(cluster)
    with PSClient([primary.address], worker_id="observer", register=False) as client:
        client.checkpoint()
        applied_a = client.pull(["a"])["a"]
    _wait_caught_up(cluster)
    primary_checkpoint, backup_checkpoint = primary.newest_checkpoint(), backup.newest_checkpoint()
    _, primary_state = checkpoint_contents(primary_checkpoint)
    assert _open_push(primary_state)["chunks"]["a"] == [[0, 64 * 8]], "the dense chunk was not applied"
    assert not np.array_equal(applied_a, np.zeros((64, 8), np.float32))
    assert_same_bits(primary_checkpoint, backup_checkpoint)

    primary.process.signal(signal.SIGKILL)
    survivor = cluster.primary(0, timeout=15)
    assert survivor is backup
    with PSClient([survivor.address], worker_id="observer-2", register=False) as client:
        assert client.pull(["a"])["a"].tobytes() == applied_a.tobytes()
        client.checkpoint()
    assert_same_bits(primary_checkpoint, survivor.newest_checkpoint())

    # The retry (same worker, incarnation and sequence; no values asked after it, so nothing is held).
    response = _push(survivor.address, _message(_begin(0), grad_a, grad_t))
    assert not response.duplicate
    assert response.elements_applied == len(TABLE_IDS) * DIM
    with PSClient([survivor.address], worker_id="observer-3", register=False) as client:
        assert client.pull(["a"])["a"].tobytes() == applied_a.tobytes(), "the dense chunk applied twice"
        rows = client.pull_rows("t", TABLE_IDS)
        again = client.describe()[0].variables
    np.testing.assert_array_equal(rows, -grad_t)
    assert (again["a"]["version"], again["t"]["version"]) == (1, 1)
    assert again["a"]["optimizer_steps"] == 1
    duplicate = _push(survivor.address, _message(_begin(0), grad_a, grad_t))
    assert duplicate.duplicate and duplicate.elements_applied == 0
