"""JAX arrays in and out of a real 2-shard cluster (CPU JAX; skipped where JAX is not installed).

In: JAX arrays as ``create_variable`` initializers and as the gradients of
``push``, ``push_rows`` and ``step.push`` (read through DLPack, no copy).
Out: pulled numpy arrays into JAX through ``jnp.from_dlpack`` /
``jax.dlpack.from_dlpack``. Gradients are small integers and SGD's learning
rate is 0.5, so every expected value is exact in float32 and compared bit
for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from worker_client import SGD, PSClient
from worker_client.errors import DTypeMismatchError

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

BIG = (512, 256)  # 512 KiB of float32: split over both shards
LR = 0.5


def big_gradient(seed: int) -> np.ndarray:
    return ((np.arange(np.prod(BIG), dtype=np.int64) * (seed + 3) + seed) % 13 - 6).reshape(BIG).astype(np.float32)


def exact(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_initializer_push_and_pull_through_dlpack(cluster2):
    initial = (np.arange(np.prod(BIG), dtype=np.float32) % 97).reshape(BIG)
    with PSClient(cluster2.addresses, worker_id="jax-worker") as client:
        big = client.create_variable("big", BIG, initializer=jnp.asarray(initial), optimizer=SGD(LR))
        assert len({part.shard for part in big.placement.parts}) == 2
        # A transposed JAX array: its DLPack export is the transpose's own C-order values.
        source = jnp.arange(12, dtype=jnp.float32).reshape(4, 3)
        client.create_variable("transposed", (3, 4), initializer=source.T, optimizer=SGD(LR))

        assert exact(client.pull("big")["big"], initial)
        assert exact(client.pull("transposed")["transposed"], np.arange(12, dtype=np.float32).reshape(4, 3).T.copy())

        client.push({"big": jnp.asarray(big_gradient(1)), "transposed": jnp.ones((4, 3), jnp.float32).T})
        client.push({"big": jnp.asarray(big_gradient(2))})

        pulled = client.pull()
        expected = initial - LR * big_gradient(1) - LR * big_gradient(2)
        assert exact(pulled["big"], expected)
        for convert in (jnp.from_dlpack, jax.dlpack.from_dlpack):
            as_jax = convert(pulled["big"])
            assert isinstance(as_jax, jax.Array) and as_jax.dtype == jnp.float32
            assert exact(np.asarray(as_jax), expected)
        transposed = jnp.from_dlpack(pulled["transposed"])
        assert exact(np.asarray(transposed), np.arange(12, dtype=np.float32).reshape(4, 3).T - LR)


def test_push_rows_of_a_table_and_of_a_dense_variable(cluster2):
    with PSClient(cluster2.addresses, worker_id="jax-worker") as client:
        client.create_embedding("table", 4, initializer="zeros", optimizer=SGD(LR))
        client.create_variable("dense", BIG, optimizer=SGD(LR))
        ids = jnp.array([3, 9, 3, 1 << 20])  # int32 without jax_enable_x64: widened to int64 ids
        grads = jnp.arange(16, dtype=jnp.float32).reshape(4, 4)
        shards = client.push_rows("table", ids, grads)
        assert shards == {0, 1}  # the ids land on both shards: each gets its rows
        client.push_rows("dense", jnp.array([0, 511, 0]), jnp.full((3, 256), 2.0, jnp.float32))

        rows = jnp.from_dlpack(client.pull_rows("table", jnp.array([3, 9, 1 << 20, 77])))
        grads_np = np.arange(16, dtype=np.float32).reshape(4, 4)
        expected = np.zeros((4, 4), np.float32)  # id 77 was never pushed: the zeros initializer's row
        expected[:3] = -LR * np.stack([grads_np[0] + grads_np[2], grads_np[1], grads_np[3]])
        assert exact(np.asarray(rows), expected)

        dense = client.pull("dense")["dense"]
        assert (dense[0] == -2 * LR * 2).all() and (dense[511] == -LR * 2).all() and not dense[1:511].any()


def test_steps_take_jax_gradients_and_give_values_to_jax(cluster2):
    initial = np.arange(8, dtype=np.float32)
    with PSClient(cluster2.addresses, worker_id="jax-worker") as client:
        client.create_variable("w", (8,), initializer=jnp.asarray(initial), optimizer=SGD(LR))
        client.create_embedding("table", 2, initializer="zeros", optimizer=SGD(LR))
        expected = initial.copy()
        for step_index in range(3):  # steps after the first may start from prefetched values
            with client.step(["w"]) as step:
                w = jax.tree.map(jnp.from_dlpack, step.params)["w"]
                assert exact(np.asarray(w), expected)
                gradient = jnp.full((8,), step_index + 1, jnp.float32) + w * 0  # computed by JAX
                step.push({"w": gradient}, rows={"table": (jnp.array([5]), jnp.ones((1, 2), jnp.float32))})
            expected = expected - LR * (step_index + 1)
        assert exact(client.pull("w")["w"], expected)
        assert exact(client.pull_rows("table", [5]), np.full((1, 2), -3 * LR, np.float32))
        assert client.step_count == 3


def test_bfloat16_gradients_are_refused_and_float16_ones_applied(cluster2):
    with PSClient(cluster2.addresses, worker_id="jax-worker") as client:
        client.create_variable("w32", (8,), initializer="zeros", optimizer=SGD(LR))
        client.create_variable("w16", (8,), dtype="float16", initializer="zeros", optimizer=SGD(LR))
        with pytest.raises(DTypeMismatchError, match="bfloat16.*float32"):
            client.push({"w32": jnp.ones((8,), jnp.bfloat16)})
        assert not client.pull("w32")["w32"].any()  # nothing was applied
        with pytest.raises(DTypeMismatchError, match="initializer has dtype bfloat16, but dtype is float32"):
            client.create_variable("from_bf16", (8,), initializer=jnp.ones((8,), jnp.bfloat16))
        assert "from_bf16" not in client.variables(refresh=True)  # refused before anything was created
        client.push({"w32": jnp.ones((8,), jnp.bfloat16).astype(jnp.float32)})
        client.push({"w16": jnp.full((8,), 4.0, jnp.float16)})
        pulled = client.pull()
        assert exact(pulled["w32"], np.full(8, -LR, np.float32))
        assert exact(pulled["w16"], np.full(8, -2.0, np.float16))
        assert jnp.from_dlpack(pulled["w16"]).dtype == jnp.float16


def test_top_k_pushes_of_read_only_jax_gradients(cluster2):
    with PSClient(cluster2.addresses, worker_id="jax-worker", topk_ratio=0.5) as client:
        client.create_variable("w", (4, 2), initializer="zeros", optimizer=SGD(LR))
        gradient = jnp.array([[1, 1], [4, 4], [2, 2], [8, 8]], dtype=jnp.float32)
        client.push({"w": gradient})  # the rows with the two largest norms go: 1 and 3
        expected = np.array([[0, 0], [-2, -2], [0, 0], [-4, -4]], dtype=np.float32)
        assert exact(client.pull("w")["w"], expected)
        assert exact(client.gradient_residuals()["w"].reshape(4, 2),
                     np.array([[1, 1], [0, 0], [2, 2], [0, 0]], dtype=np.float32))
