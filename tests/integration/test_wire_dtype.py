"""Pushes converted to a narrower wire dtype, sent in many chunks, land exactly.

A dense gradient pushed with ``wire_dtype`` is converted chunk by chunk
into memory the client reuses from one message to the next (see
worker_client.push_framing.ConversionArena). Each push here is several
messages per shard, so a chunk whose memory were reused before its message
was sent would carry a neighbour's values. The gradients are integers in
[-128, 128], exact in bfloat16, float16 and float32, and SGD(lr=1) from
zeros makes the final value minus the sum of the gradients, bit for bit.
Through a proxy that cuts connections mid-push, the retries must resend the
same bytes (the server keeps the chunks it already applied).
"""

from __future__ import annotations

import numpy as np
import pytest
from fault_proxy import FaultProxy

from worker_client import SGD, FixedShardsPartitioner, PSClient

# 16 MiB of float32 over two shards: 4 MiB of 2-byte wire values per shard,
# four messages of the default 1 MiB chunk size.
ELEMENTS = 4_194_304
PUSHES = 3


def _gradient(seed: int) -> np.ndarray:
    """A gradient exact in every wire dtype, different at every position (neighbouring chunks differ)."""
    return np.random.default_rng(seed).integers(-128, 129, size=ELEMENTS).astype(np.float32)


def _create(addresses: list[str]) -> None:
    with PSClient(addresses, register=False) as client:
        client.create_variable("w", shape=(ELEMENTS,), initializer="zeros", optimizer=SGD(learning_rate=1.0),
                               partitioner=FixedShardsPartitioner(2))


def _pulled(addresses: list[str]) -> np.ndarray:
    with PSClient(addresses, register=False) as client:
        return client.pull(["w"])["w"]


def _assert_applied(pulled: np.ndarray, gradients: list[np.ndarray]) -> None:
    expected = -np.sum(gradients, axis=0, dtype=np.float32)
    wrong = np.flatnonzero(pulled != expected)
    assert wrong.size == 0, (f"{wrong.size} of {ELEMENTS} elements differ, first at {wrong[:4].tolist()}: "
                             f"{pulled[wrong[:4]].tolist()} instead of {expected[wrong[:4]].tolist()}")


@pytest.mark.parametrize("wire_dtype", ["bfloat16", "float16"])
def test_a_push_of_many_converted_chunks_lands_exactly(cluster_factory, wire_dtype):
    cluster = cluster_factory(2)
    _create(cluster.addresses)
    # Non-zero in one position of each quarter only (each shard's first and
    # third message): a value seen anywhere else was sent in another chunk's place.
    first = np.zeros(ELEMENTS, np.float32)
    first[[0, ELEMENTS // 4 + 1, ELEMENTS // 2 + 2, ELEMENTS - 1]] = [5, 100, 250, 40]
    gradients = [first]
    with PSClient(cluster.addresses, worker_id="w0", wire_dtype=wire_dtype) as client:
        client.push({"w": first})
        _assert_applied(client.pull(["w"])["w"], gradients)
        for seed in range(1, PUSHES):  # these reuse the conversion memory of the pushes before them
            gradients.append(_gradient(seed))
            client.push({"w": gradients[-1]})
        _assert_applied(client.pull(["w"])["w"], gradients)


def test_a_converted_push_cut_mid_stream_is_resent_identically(cluster_factory):
    cluster = cluster_factory(2)
    _create(cluster.addresses)
    # About 3 MB may pass on each connection before it is cut: a 4 MiB push per
    # shard is cut in the middle of its chunks most times and retried whole.
    proxies = [FaultProxy(server.port, seed=1700 + i, mean_bytes_up=3_000_000, mean_bytes_down=1_000_000,
                          cut_at_start=0.0) for i, server in enumerate(cluster.servers)]
    gradients = [_gradient(10 + seed) for seed in range(PUSHES)]
    try:
        with PSClient([p.address for p in proxies], worker_id="w-cut", wire_dtype="bfloat16",
                      retry_timeout=120, heartbeat=False) as client:
            for gradient in gradients:
                client.push({"w": gradient})
            retries = client.stats()["retries"]
        cut_mid_push = sum(p.stats.cut_client_to_server for p in proxies)
    finally:
        for proxy in proxies:
            proxy.stop()
    print(f"{cut_mid_push} connections cut mid-push, {retries} retries")
    assert cut_mid_push > 0 and retries > 0, (cut_mid_push, retries)
    _assert_applied(_pulled(cluster.addresses), gradients)
