"""Pushes in the background (``push(wait=False)``) and overlapped steps, against real ps-servers.

SGD with learning rate 1 on integer-valued float32 gradients is exact
arithmetic, so after any interleaving the values must equal the initial
values minus the sum of every gradient, bit for bit, as for blocking
pushes (tests/integration/test_no_lost_updates.py). A single worker that
pushes ones sees in each step's values how many of its own pushes landed,
which measures the staleness an overlapped step adds.
"""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest
from fault_proxy import FaultProxy
from ps_testing import run_in_threads

from worker_client import SGD, FixedShardsPartitioner, OverlapRefusedError, PSClient, PSUnavailableError

BIG = (300, 200)  # 240 KB, split over both shards
SMALL = (5,)
WAIT = 60.0
STEPS_CUT = 50  # per worker, through the proxies


def gradients(worker: int, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([worker, step, 21])
    return {"big": rng.integers(-3, 4, size=BIG).astype(np.float32),
            "small": rng.integers(-3, 4, size=SMALL).astype(np.float32)}


def create(client: PSClient) -> dict[str, np.ndarray]:
    client.create_variable("big", shape=BIG, optimizer=SGD(learning_rate=1.0),
                           partitioner=FixedShardsPartitioner(2))
    client.create_variable("small", shape=SMALL, initializer="constant", optimizer=SGD(learning_rate=1.0))
    return client.pull()


def expected_after(initial: dict[str, np.ndarray], workers: int, steps: int) -> dict[str, np.ndarray]:
    expected = {name: value.astype(np.float64) for name, value in initial.items()}
    for w in range(workers):
        for step in range(steps):
            for name, grad in gradients(w, step).items():
                expected[name] -= grad
    return {name: value.astype(np.float32) for name, value in expected.items()}


def run_workers(addresses: list[str], workers: int, steps: int, pull_ahead: bool,
                names: list[str] | None = None, **client_args) -> list[dict]:
    """Each worker thread runs ``steps`` overlapped steps pulling ``names``; the gradient arrays are
    overwritten right after each hand-off (the push must have copied them). Returns each worker's stats."""
    def worker(index: int) -> dict:
        with PSClient(addresses, worker_id=f"worker-{index}", **client_args) as client:
            reused = {name: np.empty_like(g) for name, g in gradients(index, 0).items()}
            for step in range(steps):
                with client.step(names, overlap=True, pull_ahead=pull_ahead) as s:
                    assert s.params["small"].shape == SMALL
                    for name, grad in gradients(index, step).items():
                        reused[name][...] = grad
                    s.push(reused)
                    for array in reused.values():
                        array.fill(1e6)  # the background push sends its own copy
            client.flush()
            return client.stats()

    return run_in_threads(worker, workers)


@pytest.mark.parametrize("pull_ahead", [False, True])
def test_overlapped_steps_of_several_workers_leave_the_exact_sum(cluster_factory, pull_ahead):
    cluster = cluster_factory(2)
    with PSClient(cluster.addresses, worker_id="chief", register=False) as chief:
        initial = create(chief)
        run_workers(cluster.addresses, workers=3, steps=60, pull_ahead=pull_ahead)
        final = chief.pull()
        expected = expected_after(initial, 3, 60)
        for name in expected:
            assert final[name].tobytes() == expected[name].tobytes(), name
        versions = {i: shard.variables["big"]["version"] for i, shard in enumerate(chief.describe())}
        assert versions == {0: 180, 1: 180}  # every push applied once on each shard


@pytest.mark.parametrize("pull_ahead", [False, True])
def test_overlapped_steps_through_cut_connections_lose_and_repeat_nothing(cluster_factory, pull_ahead):
    cluster = cluster_factory(2)
    proxies = [FaultProxy(server.port, seed=200 + i, mean_bytes_up=150_000, mean_bytes_down=3_000,
                          cut_at_start=0.05) for i, server in enumerate(cluster.servers)]
    try:
        with PSClient(cluster.addresses, worker_id="chief", register=False) as chief:
            initial = create(chief)
            # Pulls of "small" only: cuts every few KB downstream would starve pulls of "big".
            stats = run_workers([p.address for p in proxies], workers=2, steps=STEPS_CUT,
                                pull_ahead=pull_ahead, names=["small"], chunk_bytes=8192, retry_timeout=120,
                                heartbeat=False)
            final = chief.pull()
        expected = expected_after(initial, 2, STEPS_CUT)
        for name in expected:
            assert final[name].tobytes() == expected[name].tobytes(), name
        assert sum(s["retries"] for s in stats) > 0, "no connection was cut"
    finally:
        for proxy in proxies:
            proxy.stop()


@pytest.mark.parametrize("pull_ahead", [False, True])
def test_a_steps_values_miss_at_most_the_previous_steps_push(cluster2, pull_ahead):
    """One worker pushes ones: the values of step k show how many of its k pushes landed."""
    with PSClient(cluster2.addresses, worker_id="alone") as client:
        client.create_variable("w", shape=(64, 1024), optimizer=SGD(learning_rate=1.0))
        landed = []
        for _ in range(40):
            with client.step(["w"], overlap=True, pull_ahead=pull_ahead) as step:
                value = step.params["w"]
                assert (value == value.flat[0]).all()  # each pull is one push's result, never half of one
                landed.append(-int(value.flat[0]))
                step.push({"w": np.ones((64, 1024), dtype=np.float32)})
        client.flush()
        assert int(client.pull(["w"])["w"].flat[0]) == -40
    for k, seen in enumerate(landed):
        if pull_ahead:
            assert seen == max(0, k - 1), landed  # read while step k-1 computed: exactly one step behind
        else:
            assert seen in (k - 1, k) or (k == 0 and seen == 0), landed


def test_at_most_one_push_in_flight_and_memory_stays_flat(cluster2):
    with PSClient(cluster2.addresses, worker_id="bounded") as client:
        client.create_variable("w", shape=(1024, 1024), optimizer=SGD(learning_rate=1.0))
        grad = np.ones((1024, 1024), dtype=np.float32)  # 4 MiB
        previous = client.push({"w": grad}, wait=False)
        previous.wait()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            for _ in range(30):
                handle = client.push({"w": grad}, wait=False)
                assert previous.done(), "a second push was handed off while the first was in flight"
                previous = handle
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert previous.wait() == {0, 1}
        assert peak < 4 * grad.nbytes, f"{peak} bytes traced for 30 pushes of {grad.nbytes}"
        assert float(client.pull(["w"])["w"].flat[0]) == -31.0


def _variables_on_each_shard(client: PSClient) -> dict[int, str]:
    """Create small variables until one lives on each of the two shards; {shard: name}."""
    found: dict[int, str] = {}
    for i in range(32):
        name = f"v{i}"
        variable = client.create_variable(name, shape=(4,), optimizer=SGD(learning_rate=1.0))
        found.setdefault(variable.placement.parts[0].shard, name)
        if len(found) == 2:
            return found
    raise AssertionError("no variable landed on one of the shards")


def test_a_failed_background_push_raises_at_the_next_call_once(cluster2):
    with PSClient(cluster2.addresses, worker_id="failing", retry_timeout=1.0) as client:
        on = _variables_on_each_shard(client)
        cluster2.servers[1].stop()
        handle = client.push({on[1]: np.ones(4, dtype=np.float32)}, wait=False)
        deadline = time.monotonic() + WAIT
        while not handle.done() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert handle.done()
        # The next call raises the background push's error and does nothing else: nothing is pushed.
        with pytest.raises(PSUnavailableError) as raised:
            client.push({on[0]: np.ones(4, dtype=np.float32)}, wait=False)
        assert any("background" in note for note in getattr(raised.value, "__notes__", ["background"]))
        assert client.pull([on[0]])[on[0]].tolist() == [0.0] * 4  # raised once: this call works
        with pytest.raises(PSUnavailableError):
            handle.wait()  # the handle keeps its outcome

        # In an overlapped loop the failure surfaces at the next step's push at the latest.
        with pytest.raises(PSUnavailableError):
            for _ in range(3):
                with client.step([on[0]], overlap=True) as step:
                    step.push({on[0]: np.ones(4, dtype=np.float32), on[1]: np.ones(4, dtype=np.float32)})
        client.flush()  # the error was raised once; nothing left in flight
        assert client.pull([on[0]])[on[0]].tolist() == [-1.0] * 4  # only the first step's push went out


def test_a_failed_background_push_nobody_saw_is_logged_at_close(cluster2, caplog):
    client = PSClient(cluster2.addresses, worker_id="closing", retry_timeout=1.0)
    on = _variables_on_each_shard(client)
    cluster2.servers[1].stop()
    client.push({on[1]: np.ones(4, dtype=np.float32)}, wait=False)
    with caplog.at_level("WARNING", logger="worker_client"):
        client.close()
    assert any("background push failed" in r.getMessage() for r in caplog.records)


def test_a_wrong_gradient_raises_at_the_call_and_sends_nothing(cluster2):
    with PSClient(cluster2.addresses, worker_id="wrong") as client:
        client.create_variable("w", shape=(8,), optimizer=SGD(learning_rate=1.0))
        client.create_embedding("t", 4, initializer="zeros", optimizer=SGD(learning_rate=1.0))
        with pytest.raises(ValueError):
            client.push({"w": np.ones(7, dtype=np.float32)}, wait=False)
        with pytest.raises(ValueError):
            client.push({}, rows={"t": (np.array([1, 2]), np.ones((2, 3), dtype=np.float32))}, wait=False)
        with pytest.raises(ValueError):
            client.push({"t": np.ones(4, dtype=np.float32)}, wait=False)
        client.flush()
        assert client.pull(["w"])["w"].tolist() == [0.0] * 8
        assert client.pull_rows("t", [1, 2]).tolist() == [[0.0] * 4] * 2


def test_rows_pushed_in_the_background_are_copied_and_summed(cluster2):
    with PSClient(cluster2.addresses, worker_id="rows") as client:
        client.create_embedding("t", 4, initializer="zeros", optimizer=SGD(learning_rate=1.0))
        ids = np.array([5, 7, 5, 1 << 40], dtype=np.int64)
        grads = np.ones((4, 4), dtype=np.float32)
        for _ in range(3):
            client.push({}, rows={"t": (ids, grads)}, wait=False)
            ids[:] = 99  # the background push sends its own copy
            grads[:] = 1e6
            ids[:], grads[:] = [5, 7, 5, 1 << 40], 1.0
        client.flush()
        assert client.pull_rows("t", [5, 7, 1 << 40, 99]).tolist() == [[-6.0] * 4, [-3.0] * 4, [-3.0] * 4,
                                                                     [0.0] * 4]


@pytest.mark.parametrize("mode", [("ssp", "--staleness", "1"), ("sync",)])
def test_ssp_and_sync_refuse_overlap_before_sending_anything(cluster_factory, mode):
    cluster = cluster_factory(2, "--consistency", *mode)
    with PSClient(cluster.addresses, worker_id="refused") as client:
        client.create_variable("w", shape=(8,), optimizer=SGD(learning_rate=1.0))
        with pytest.raises(OverlapRefusedError, match="--consistency async"):
            client.push({"w": np.ones(8, dtype=np.float32)}, wait=False)
        with pytest.raises(OverlapRefusedError):
            with client.step(["w"], overlap=True) as step:
                step.push({"w": np.ones(8, dtype=np.float32)})
        with client.step(["w"]) as step:  # the blocking step keeps working
            step.push({"w": np.ones(8, dtype=np.float32)})
        assert client.pull(["w"])["w"].tolist() == [-1.0] * 8


def test_an_overlapped_step_pulls_into_out_and_pull_ahead_refuses_it(cluster2):
    with PSClient(cluster2.addresses, worker_id="out") as client:
        client.create_variable("w", shape=(8,), optimizer=SGD(learning_rate=1.0))
        out = {"w": np.full(8, 5.0, dtype=np.float32)}
        for _ in range(3):
            with client.step(["w"], out=out, overlap=True) as step:
                assert step.params["w"] is out["w"]
                step.push({"w": np.ones(8, dtype=np.float32)})
        client.flush()
        assert out["w"][0] in (-1.0, -2.0)  # the third step saw the first push, maybe the second
        with pytest.raises(ValueError, match="out="):
            with client.step(["w"], out=out, overlap=True, pull_ahead=True):
                pass
