"""The worker API against real multi-process clusters."""

from __future__ import annotations

import json
import signal
import threading

import numpy as np
import pytest
from ps_testing import Cluster, ServerProcess

from worker_client import (
    SGD,
    Adam,
    ClusterMismatchError,
    DTypeMismatchError,
    InvalidArgumentError,
    Momentum,
    PSClient,
    ShapeMismatchError,
    VariableConflictError,
    VariableNotFoundError,
)


def test_initial_values_do_not_depend_on_the_number_of_shards(cluster_factory):
    one, three = cluster_factory(1), cluster_factory(3)
    pulled = []
    for cluster in (one, three):
        with PSClient(cluster.addresses) as client:
            client.create_variable("emb", shape=(3000, 64), initializer="glorot_uniform")
            client.create_variable("bias", shape=(64,), initializer="normal")
            pulled.append(client.pull())
    for name in ("emb", "bias"):
        assert pulled[0][name].tobytes() == pulled[1][name].tobytes(), name
    limit = np.sqrt(6 / (3000 + 64))
    assert np.abs(pulled[0]["emb"]).max() <= limit and pulled[0]["emb"].std() > limit / 3


def test_push_applies_sgd_on_every_shard(cluster2):
    with PSClient(cluster2.addresses, chunk_bytes=64 * 1024) as client:
        var = client.create_variable("w", shape=(1000, 200), initializer="uniform",
                                     optimizer=SGD(learning_rate=0.5))
        assert len(var.placement.parts) == 2  # 800 KB: split over both shards
        before = client.pull(["w"])["w"]
        grad = np.random.default_rng(1).standard_normal((1000, 200)).astype(np.float32)
        client.push({"w": grad})
        after = client.pull(["w"])["w"]
        expected = before - (grad * np.float32(0.5))
        np.testing.assert_array_equal(after, expected)
        assert client.versions("w") == {0: 1, 1: 1}


def test_momentum_on_two_shards_equals_one_shard(cluster_factory):
    results = []
    for n in (1, 2):
        with PSClient(cluster_factory(n).addresses) as client:
            client.create_variable("m", shape=(300, 300), initializer="normal",
                                   optimizer=Momentum(learning_rate=0.1, momentum=0.9, nesterov=True))
            rng = np.random.default_rng(7)
            for _ in range(3):
                client.push({"m": rng.standard_normal((300, 300)).astype(np.float32)})
            results.append(client.pull(["m"])["m"])
    assert results[0].tobytes() == results[1].tobytes()


def test_create_is_idempotent_and_conflicts_name_the_difference(cluster2):
    with PSClient(cluster2.addresses, worker_id="a") as a, PSClient(cluster2.addresses, worker_id="b") as b:
        first = a.create_variable("x", shape=(10, 4), optimizer=Adam(learning_rate=0.01))
        second = b.create_variable("x", shape=(10, 4), optimizer=Adam(learning_rate=0.01))
        assert first.created and not second.created
        a.push({"x": np.ones((10, 4), np.float32)})
        snapshot = a.pull(["x"])["x"]
        with pytest.raises(VariableConflictError, match="shape"):
            b.create_variable("x", shape=(10, 5), optimizer=Adam(learning_rate=0.01))
        with pytest.raises(VariableConflictError, match="optimizer"):
            b.create_variable("x", shape=(10, 4), optimizer=SGD(learning_rate=0.01))
        np.testing.assert_array_equal(a.pull(["x"])["x"], snapshot)


def test_explicit_initial_value_is_uploaded_once(cluster2):
    value = np.arange(200_000, dtype=np.float64).reshape(400, 500)
    with PSClient(cluster2.addresses, chunk_bytes=256 * 1024) as client:
        client.create_variable("table", shape=value.shape, dtype="float64", initializer=value)
        np.testing.assert_array_equal(client.pull(["table"])["table"], value)
    with PSClient(cluster2.addresses) as other:
        again = other.create_variable("table", shape=value.shape, dtype="float64", initializer=value.copy())
        assert not again.created
        with pytest.raises(VariableConflictError, match="initializer"):
            other.create_variable("table", shape=value.shape, dtype="float64", initializer=value + 1)
        np.testing.assert_array_equal(other.pull(["table"])["table"], value)


def test_mis_ordered_or_short_address_list_is_refused(cluster_factory):
    cluster = cluster_factory(3)
    with pytest.raises(ClusterMismatchError, match="shard 2 of 3"):
        PSClient(list(reversed(cluster.addresses)))
    with pytest.raises(ClusterMismatchError, match="of 3"):
        PSClient(cluster.addresses[:2])


def test_servers_swapped_behind_the_addresses_are_refused_by_every_call(cluster_factory):
    """Every request repeats the caller's view: servers restarted on each other's port are caught."""
    cluster = cluster_factory(2)
    first, second = cluster.servers
    with PSClient(cluster.addresses, retry_timeout=20) as client:
        client.create_variable("w", shape=(100,), initializer="zeros")
        client.create_variable("big", shape=(200_000,), initializer="zeros")  # a part on each shard
        ports = first.port, second.port
        for server in cluster.servers:
            server.signal(signal.SIGKILL)
            server.wait(30)
        first.launch(ports[1])  # shard 0 now answers at shard 1's address, and the reverse
        second.launch(ports[0])
        first.wait_ready()
        second.wait_ready()
        calls = {"pull": lambda: client.pull(["big"]),
                 "push": lambda: client.push({"big": np.ones(200_000, np.float32)}),
                 "create_variable": lambda: client.create_variable("x", shape=(3,)),
                 "pull_rows": lambda: client.pull_rows("big", [0, 199_999]),
                 "step": lambda: client.step(["w"]).__enter__()}
        for what, call in calls.items():
            with pytest.raises(ClusterMismatchError, match="this server is shard"):
                call()
    # Nothing was created or applied on the swapped servers.
    with PSClient([first.address, second.address]) as fresh:  # the servers in their new places
        assert fresh.variables() == {}


@pytest.mark.parametrize("flags, words", [
    ((("--consistency", "sync"), ("--consistency", "async")), "different consistency modes"),
    ((("--consistency", "ssp", "--staleness", "1"), ("--consistency", "ssp", "--staleness", "3")),
     "different --staleness"),
    ((("--consistency", "sync", "--backup-workers", "1"), ("--consistency", "sync")),
     "different --backup-workers"),
])
def test_servers_with_different_consistency_settings_are_refused(cluster_factory, tmp_path, flags, words):
    """All servers of a cluster run the same mode with the same bound; the client checks on connect."""
    servers = [ServerProcess(i, 2, tmp_path, args) for i, args in enumerate(flags)]
    cluster_factory.clusters.append(Cluster(servers))  # stopped at teardown
    for server in servers:
        server.start()
    with pytest.raises(ClusterMismatchError, match=words):
        PSClient([s.address for s in servers])


def test_pull_into_the_callers_arrays(cluster2):
    """pull(out=params) fills and returns the given arrays; arrays that do not fit are refused."""
    with PSClient(cluster2.addresses) as client:
        client.create_variable("big", shape=(300_000,), initializer="uniform")  # a part on each shard
        client.create_variable("small", shape=(3, 4), initializer="uniform")
        expected = client.pull()
        params = {name: np.zeros_like(value) for name, value in expected.items()}
        pulled = client.pull(out=params)
        assert all(pulled[name] is params[name] for name in expected)
        assert all(params[name].tobytes() == expected[name].tobytes() for name in expected)
        for bad, error in [(np.zeros((4, 3), np.float32), ShapeMismatchError),
                           (np.zeros((3, 4), np.float64), DTypeMismatchError),
                           (np.zeros((3, 8), np.float32)[:, ::2], InvalidArgumentError)]:
            with pytest.raises(error, match="out\\['small'\\]"):
                client.pull(["small"], out={"small": bad})


def test_client_side_checks_raise_typed_errors(cluster2):
    with PSClient(cluster2.addresses) as client:
        client.create_variable("v", shape=(5, 3))
        with pytest.raises(ShapeMismatchError, match=r"\(5, 4\)"):
            client.push({"v": np.zeros((5, 4), np.float32)})
        with pytest.raises(DTypeMismatchError, match="float64"):
            client.push({"v": np.zeros((5, 3), np.float64)})
        with pytest.raises(VariableNotFoundError, match="nope"):
            client.pull(["nope"])
        with pytest.raises(VariableNotFoundError):
            client.push({"nope": np.zeros(3, np.float32)})
        np.testing.assert_array_equal(client.pull(["v"])["v"], np.zeros((5, 3), np.float32))
        assert client.versions("v") in ({0: 0}, {1: 0})


def test_other_workers_find_variables_created_elsewhere(cluster2):
    with PSClient(cluster2.addresses) as creator:
        creator.create_variable("shared", shape=(4,), initializer="constant")
    with PSClient(cluster2.addresses) as reader:
        assert set(reader.pull()) == {"shared"}
        assert reader.variables()["shared"].shape == (4,)


def test_step_pulls_at_start_and_pushes_once(cluster2):
    with PSClient(cluster2.addresses) as client:
        client.create_variable("s", shape=(3,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        with client.step() as step:
            assert np.array_equal(step.params["s"], np.zeros(3, np.float32))
            step.push({"s": np.ones(3, np.float32)})
            with pytest.raises(RuntimeError, match="already pushed"):
                step.push({"s": np.ones(3, np.float32)})
        with pytest.raises(ZeroDivisionError):
            with client.step() as step:
                1 / 0
        np.testing.assert_array_equal(client.pull(["s"])["s"], -np.ones(3, np.float32))


def test_from_env_reads_ps_addresses_and_tf_config(cluster2):
    with PSClient.from_env({"PS_ADDRESSES": ",".join(cluster2.addresses)}) as client:
        assert client.addresses == tuple(cluster2.addresses)
    tf_config = json.dumps({"cluster": {"ps": cluster2.addresses, "worker": ["w0:1", "w1:1"]},
                            "task": {"type": "worker", "index": 1}})
    with PSClient.from_env({"TF_CONFIG": tf_config}) as client:
        assert client.worker_id == "worker-1"
        assert client.addresses == tuple(cluster2.addresses)


def test_small_chunks_and_packed_small_variables_round_trip(cluster2):
    rng = np.random.default_rng(3)
    values = {f"v{i}": rng.standard_normal(shape).astype(np.float32)
              for i, shape in enumerate([(), (0, 3), (1,), (17, 5), (70_000,), (300, 301)])}
    with PSClient(cluster2.addresses, chunk_bytes=4096) as client:
        for name, value in values.items():
            client.create_variable(name, shape=value.shape, initializer=value)
        pulled = client.pull()
        for name, value in values.items():
            assert pulled[name].shape == value.shape
            np.testing.assert_array_equal(pulled[name], value)


def test_bfloat16_on_the_wire(cluster2):
    with PSClient(cluster2.addresses, wire_dtype="bfloat16") as client:
        client.create_variable("w", shape=(256, 256), initializer="uniform", optimizer=SGD(learning_rate=1.0))
        before = client.pull(["w"])["w"]
        assert before.dtype == np.float32
        grad = np.full((256, 256), 0.5, np.float32)  # exact in bfloat16
        client.push({"w": grad})
        after = client.pull(["w"])["w"]
        # values travel rounded to bfloat16 (8 bits of mantissa): relative error < 2**-8
        np.testing.assert_allclose(after, before - 0.5, rtol=2**-7, atol=2**-8)


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 4096])
def test_bfloat16_pushes_of_many_small_variables_keep_each_gradient(cluster2, chunk_bytes):
    """Several converted chunks share one message (and one arena): each keeps its own values.

    A regression test: converted chunks used to share one buffer, so every
    variable in a message was sent the last one's gradient. With 4 KiB
    chunks the 3,000-element variable is split over several messages.
    """
    shapes = {f"s{i}": (i + 1,) for i in range(6)} | {"big": (3000,)}
    with PSClient(cluster2.addresses, wire_dtype="bfloat16", chunk_bytes=chunk_bytes) as client:
        for name, shape in shapes.items():
            client.create_variable(name, shape=shape, initializer="zeros", optimizer=SGD(learning_rate=1.0))
        # Distinct values, all exact in bfloat16.
        grads = {name: np.arange(np.prod(shape), dtype=np.float32) % 64 + 2.0 * k
                 for k, (name, shape) in enumerate(shapes.items())}
        for _ in range(2):
            client.push(grads)
        pulled = client.pull(list(shapes))
        for name, grad in grads.items():
            np.testing.assert_array_equal(pulled[name], -2 * grad.reshape(shapes[name]), err_msg=name)


def test_float16_on_the_wire_refuses_gradients_it_cannot_hold(cluster2):
    """A finite gradient beyond float16's 65504 is refused before sending (it would arrive as inf);
    NaN and inf given by the caller travel as they are."""
    with PSClient(cluster2.addresses, wire_dtype="float16") as client:
        client.create_variable("w", shape=(4, 3), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        client.create_embedding("e", dim=3, initializer="zeros", optimizer=SGD(learning_rate=1.0))
        client.create_variable("t", shape=(4,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        too_big = np.ones((4, 3), np.float32)
        too_big[2, 1] = -1e5
        with pytest.raises(ValueError, match=r"gradient for 'w' holds -100000, beyond 65504"):
            client.push({"w": too_big, "t": np.ones(4, np.float32)})
        with pytest.raises(ValueError, match=r"rows of 'e' holds 70000, beyond 65504"):
            client.push_rows("e", np.array([1, 2]), np.array([[1, 2, 3], [70000, 0, 0]], np.float32))
        with pytest.raises(ValueError, match=r"rows of 'e' \(repeats summed\) holds 80000"):
            client.push_rows("e", np.array([5, 5]), np.full((2, 3), 40000, np.float32))
        inf_and_big = np.zeros((4, 3), np.float32)
        inf_and_big[0, 0], inf_and_big[3, 2] = np.inf, 65600
        with pytest.raises(ValueError, match=r"'w' holds 65600"):
            client.push({"w": inf_and_big})
        # Nothing of the refused pushes was sent: every variable is unchanged.
        pulled = client.pull(["w", "t"])
        np.testing.assert_array_equal(pulled["w"], np.zeros((4, 3), np.float32))
        np.testing.assert_array_equal(pulled["t"], np.zeros(4, np.float32))
        np.testing.assert_array_equal(client.pull_rows("e", [1, 2, 5]), np.zeros((3, 3), np.float32))
        edge = np.full((4, 3), 65504, np.float32)  # the largest float16 is sent as it is
        client.push({"w": edge})
        np.testing.assert_array_equal(client.pull(["w"])["w"], -edge)
        client.push({"t": np.array([np.nan, np.inf, 1, 2], np.float32)})
        expected_t = np.array([np.nan, -np.inf, -1, -2], np.float32)
        np.testing.assert_array_equal(client.pull(["t"])["t"], expected_t)


def test_concurrent_pushes_from_threads_lose_nothing(cluster2):
    with PSClient(cluster2.addresses) as client:
        client.create_variable("c", shape=(200, 400), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        errors = []

        def worker(seed: int) -> None:
            try:
                for step in range(20):
                    client.push({"c": np.full((200, 400), seed * 100 + step, np.float32)})
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        expected = -sum(seed * 100 + step for seed in range(4) for step in range(20))
        np.testing.assert_array_equal(client.pull(["c"])["c"], np.full((200, 400), expected, np.float32))


@pytest.mark.parametrize("window", ["0", str(64 << 10)])
def test_large_pushes_and_pulls_with_other_stream_windows(cluster_factory, window):
    """--stream-window-bytes: gRPC's automatic window (0) or the smallest fixed one still carry 1 MiB chunks."""
    cluster = cluster_factory(1, "--stream-window-bytes", window)
    with PSClient(cluster.addresses) as client:
        client.create_variable("w", shape=(1000, 1000), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        grad = np.random.default_rng(3).standard_normal((1000, 1000)).astype(np.float32)
        client.push({"w": grad})
        np.testing.assert_array_equal(client.pull(["w"])["w"], -grad)


def test_answers_out_of_order_are_not_taken_for_a_rollback(cluster2, caplog):
    """Threads sharing a client get their answers in any order; the older versions they carry mean nothing."""
    with PSClient(cluster2.addresses) as client:
        client.create_variable("w", shape=(4, 1000), optimizer=SGD(learning_rate=1.0))
        client.create_embedding("e", 8, initializer="zeros", optimizer=SGD(learning_rate=1.0))
        ids = np.arange(64)
        errors: list[BaseException] = []

        def work() -> None:
            try:
                for _ in range(150):
                    client.push({"w": np.ones((4, 1000), np.float32)})
                    client.push_rows("e", ids, np.ones((64, 8), np.float32))
                    client.pull(["w"])
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(exc)

        threads = [threading.Thread(target=work) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors
        assert client.stats()["rollbacks"] == 0
        assert "rolled back" not in caplog.text
        # What the client keeps is the newest version, which every push made: 450 pushes of "w".
        assert set(client.versions("w").values()) == {450}
        np.testing.assert_array_equal(client.pull(["w"])["w"], np.full((4, 1000), -450, np.float32))
