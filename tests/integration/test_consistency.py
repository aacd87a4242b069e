"""Consistency modes (--consistency async | ssp | sync) against real ps-server processes.

Workers are threads of this process, each with its own PSClient (own worker
id, own lease); observers (the chief creating variables, describe) use
``register=False`` so they never count as workers. Gradients are small
integers times 6 and SGD's learning rate is 0.5, so the mean of any 1, 2 or 3
of them and every partial sum are exact in float32: the servers' results are
compared bit for bit with the arithmetic.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Callable

import numpy as np

from worker_client import SGD, Constant, PSClient

BIG = (512, 256)  # 512 KiB of float32: split over both shards
SMALL = (8,)  # whole on one shard
NAMES = ["big", "small"]
PARTS = {"big": [slice(0, 256), slice(256, 512)], "small": [slice(None)]}  # one per shard holding it
LR = 0.5
WAIT = 60.0  # generous bound for things that must happen


def gradients(worker: int, step: int) -> dict[str, np.ndarray]:
    """Deterministic integer gradients, all multiples of 6 (so means of 1-3 are exact)."""
    big = (np.arange(np.prod(BIG), dtype=np.int64) * (worker + 2) + 7 * step + worker) % 11 - 5
    small = (np.arange(SMALL[0], dtype=np.int64) * (worker + 3) + 5 * step) % 9 - 4
    return {"big": (6 * big).reshape(BIG).astype(np.float32), "small": (6 * small).astype(np.float32)}


def mean_of(workers: list[int], step: int) -> dict[str, np.ndarray]:
    grads = [gradients(w, step) for w in workers]
    return {n: sum(g[n].astype(np.float64) for g in grads) / len(grads) for n in NAMES}


def sgd_trajectory(initial: dict[str, np.ndarray],
                   updates: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """states[t] = the values after the first t updates (exact, in float64, then float32)."""
    state = {n: initial[n].astype(np.float64) for n in NAMES}
    states = [{n: v.astype(np.float32) for n, v in state.items()}]
    for update in updates:
        state = {n: state[n] - LR * update[n] for n in NAMES}
        states.append({n: v.astype(np.float32) for n, v in state.items()})
    return states


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return all(a[n].tobytes() == b[n].tobytes() for n in NAMES)


def observer(cluster) -> PSClient:
    return PSClient(cluster.addresses, worker_id="observer", register=False)


def create_variables(client: PSClient) -> dict[str, np.ndarray]:
    big = client.create_variable("big", shape=BIG, initializer=Constant(1.5), optimizer=SGD(learning_rate=LR))
    client.create_variable("small", shape=SMALL, initializer="zeros", optimizer=SGD(learning_rate=LR))
    assert len(big.placement.parts) == 2
    assert [(p.row_start, p.row_end) for p in big.placement.parts] == [(0, 256), (256, 512)]
    return client.pull(NAMES)


def consistency(client: PSClient) -> list[dict]:
    return [shard.consistency for shard in client.describe()]


def report(label: str, infos: list[dict]) -> None:
    """Printed (pytest -s) for the record: time pulls spent blocked."""
    for i, c in enumerate(infos):
        per_pull = c["blocked_seconds"] / c["pulls"] if c["pulls"] else 0.0
        print(f"\n[{label}] shard {i}: pulls={c['pulls']} pulls_blocked={c['pulls_blocked']} "
              f"blocked_seconds={c['blocked_seconds']:.4f} per_pull={per_pull * 1000:.2f} ms "
              f"max_staleness_admitted={c['max_staleness_admitted']} steps_applied={c['steps_applied']} "
              f"dropped={c['dropped_gradients']}")


class Workers:
    """Worker threads; the first exception of any of them is re-raised by join()."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def start(self, target: Callable[..., None], *args) -> None:
        def run():
            try:
                target(*args)
            except BaseException as exc:  # re-raised in the test's thread
                self.errors.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)

    def join(self, timeout: float = WAIT) -> None:
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if self.errors:
            raise self.errors[0]
        assert not any(t.is_alive() for t in self.threads), "a worker thread did not finish in time"


class Progress:
    """Steps completed per worker (after the step's push returned), to wait on."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._done: dict[int, int] = {}

    def finished(self, worker: int, steps: int) -> None:
        with self._cond:
            self._done[worker] = steps
            self._cond.notify_all()

    def wait(self, workers: list[int], steps: int, timeout: float = WAIT) -> None:
        with self._cond:
            reached = self._cond.wait_for(
                lambda: all(self._done.get(w, 0) >= steps for w in workers), timeout)
            assert reached, f"workers {workers} did not reach {steps} steps"


# ---- sync ------------------------------------------------------------------------------------------


def test_sync_applies_the_exact_mean_of_every_step(cluster_factory):
    steps, workers = 12, [0, 1, 2]
    cluster = cluster_factory(2, "--consistency", "sync", "--expected-workers", "3")
    with observer(cluster) as chief:
        initial = create_variables(chief)
    seen: dict[tuple[int, int], dict[str, np.ndarray]] = {}
    counts: dict[int, tuple[int, dict]] = {}
    all_pushed = threading.Barrier(len(workers), timeout=WAIT)

    def work(w: int) -> None:
        with PSClient(cluster.addresses, worker_id=f"w{w}") as client:
            assert client.consistency == "sync"
            for t in range(steps):
                assert client.step_count == t
                with client.step(NAMES) as s:
                    seen[(w, t)] = {n: s.params[n].copy() for n in NAMES}
                    s.push(gradients(w, t))
            counts[w] = (client.step_count, client.stats())
            # Leaving early is test_sync_last_step_waits_for_a_live_worker_after_others_left's subject.
            all_pushed.wait()

    threads = Workers()
    for w in workers:
        threads.start(work, w)
    threads.join()

    states = sgd_trajectory(initial, [mean_of(workers, t) for t in range(steps)])
    for (w, t), params in sorted(seen.items()):
        # The pull of step t sees exactly steps 0..t-1 applied, each with the mean of all three.
        assert same(params, states[t]), f"worker {w} step {t}"
    with observer(cluster) as obs:
        assert same(obs.pull(NAMES), states[steps])
        infos = consistency(obs)
    report("sync 3 workers", infos)
    for c in infos:
        assert c["mode"] == "sync" and c["step"] == steps
        assert c["steps_applied"] == steps and c["dropped_gradients"] == 0
    for w in workers:
        assert counts[w][0] == steps and counts[w][1]["dropped_pushes"] == 0


def test_sync_last_step_waits_for_a_live_worker_after_others_left(cluster_factory):
    """Two workers push the last step and close (goodbye) before the third pushes it.

    The third is live and has not finished the step (K = 0), so the step must wait for it
    and apply the mean of all three; it must not be applied with the two that left, nor
    the third's gradient dropped. (A training job's end: the fast workers exit first.)
    """
    steps, workers = 3, [0, 1, 2]
    cluster = cluster_factory(2, "--consistency", "sync", "--expected-workers", "3")
    with observer(cluster) as chief:
        initial = create_variables(chief)
    closed = threading.Barrier(3, timeout=WAIT)
    stats: dict[int, dict] = {}

    def work(w: int) -> None:
        client = PSClient(cluster.addresses, worker_id=f"w{w}")
        try:
            for t in range(steps):
                with client.step(NAMES) as s:
                    if w == 2 and t == steps - 1:
                        closed.wait()  # w0 and w1 have pushed this step and left
                    s.push(gradients(w, t))
            stats[w] = client.stats()
        finally:
            client.close()
            if w != 2:
                closed.wait()

    threads = Workers()
    for w in workers:
        threads.start(work, w)
    threads.join()
    states = sgd_trajectory(initial, [mean_of(workers, t) for t in range(steps)])
    with observer(cluster) as obs:
        final, infos = obs.pull(NAMES), consistency(obs)
    assert [c["dropped_gradients"] for c in infos] == [0, 0], (
        f"the last live worker's gradient of step {steps - 1} was dropped: the step was applied "
        "with the two workers that had finished it and left")
    assert stats[2]["dropped_pushes"] == 0
    assert same(final, states[steps])


def test_sync_sum_aggregation(cluster_factory):
    cluster = cluster_factory(2, "--consistency", "sync", "--expected-workers", "2")
    with observer(cluster) as chief:
        chief.create_variable("s", shape=SMALL, initializer="zeros", optimizer=SGD(learning_rate=LR),
                              aggregation="sum")
    workers = Workers()
    all_pushed = threading.Barrier(2, timeout=WAIT)

    def work(w: int) -> None:
        with PSClient(cluster.addresses, worker_id=f"w{w}") as client:
            for t in range(3):
                with client.step(["s"]) as s:
                    s.push({"s": gradients(w, t)["small"]})
            all_pushed.wait()

    for w in (0, 1):
        workers.start(work, w)
    workers.join()
    expected = 0.0 - LR * sum(gradients(w, t)["small"].astype(np.float64) for w in (0, 1) for t in range(3))
    with observer(cluster) as obs:
        assert obs.pull(["s"])["s"].tobytes() == expected.astype(np.float32).tobytes()


def test_sync_backup_worker_drops_the_slow_workers_gradients(cluster_factory):
    steps, fast, slow = 8, [0, 1], 2
    cluster = cluster_factory(2, "--consistency", "sync", "--backup-workers", "1", "--expected-workers", "3")
    with observer(cluster) as chief:
        initial = create_variables(chief)
    states = sgd_trajectory(initial, [mean_of(fast, t) for t in range(steps)])
    progress = Progress()
    slow_done = threading.Event()
    seen: dict[tuple[int, int], dict[str, np.ndarray]] = {}
    result: dict[int, tuple[int, dict]] = {}
    slow_pushes: list[int] = []

    def fast_worker(w: int) -> None:
        with PSClient(cluster.addresses, worker_id=f"w{w}") as client:
            for t in range(steps):
                with client.step(NAMES) as s:
                    seen[(w, t)] = {n: s.params[n].copy() for n in NAMES}
                    s.push(gradients(w, t))
                progress.finished(w, t + 1)
            result[w] = (client.step_count, client.stats())
            # Stay live until the slow worker is done: with only it left, its steps would count.
            assert slow_done.wait(WAIT)

    def slow_worker() -> None:
        with PSClient(cluster.addresses, worker_id="slow") as client:
            while client.step_count < steps:
                t = client.step_count
                with client.step(NAMES) as s:
                    seen[(slow, t)] = {n: s.params[n].copy() for n in NAMES}
                    time.sleep(0.05)
                    progress.wait(fast, t + 1)  # both fast workers finished step t: it is applied
                    s.push(gradients(slow, t))
                    slow_pushes.append(t)
            result[slow] = (client.step_count, client.stats())
        slow_done.set()

    threads = Workers()
    for w in fast:
        threads.start(fast_worker, w)
    threads.start(slow_worker)
    threads.join()

    for (w, t), params in sorted(seen.items()):
        if w in fast:  # every step applied with the mean of the two fast workers, exactly
            assert same(params, states[t]), f"fast worker {w} step {t}"
        else:  # the slow worker reads step t or later (the fast ones do not wait for it), each
            # part as one step: the shards may be at different steps while the fast ones push.
            for name, part_rows in PARTS.items():
                for rows in part_rows:
                    assert any(params[name][rows].tobytes() == states[u][name][rows].tobytes()
                               for u in range(t, steps + 1)), f"slow worker step {t}: {name}[{rows}]"
    with observer(cluster) as obs:
        assert same(obs.pull(NAMES), states[steps])
        infos = consistency(obs)
    report("sync backup=1", infos)
    assert slow_pushes and slow_pushes[0] == 0
    for c in infos:
        assert c["steps_applied"] == steps
        assert c["dropped_gradients"] == len(slow_pushes)  # every slow push reached both shards, late
    for w in fast:
        assert result[w][0] == steps and result[w][1]["dropped_pushes"] == 0
    slow_steps, slow_stats = result[slow]
    assert slow_steps == steps  # caught up with the others
    assert slow_stats["dropped_pushes"] == 2 * len(slow_pushes)  # counted per shard pushed to


def test_sync_slow_workers_gradient_is_not_relabelled_by_its_heartbeat(cluster_factory):
    """A gradient computed from step 0's parameters, pushed after step 0 was applied, is a late
    gradient of step 0 and must be dropped (consistency.py: "A gradient of step t that arrives
    later is dropped and counted") - even if the worker's heartbeats ran while it computed.
    """
    fast, slow = [0, 1], 2
    cluster = cluster_factory(2, "--consistency", "sync", "--backup-workers", "1", "--expected-workers", "3",
                              "--worker-lease", "1")  # heartbeats every ~0.33 s
    with observer(cluster) as chief:
        initial = create_variables(chief)
    progress = Progress()
    go, slow_pushed = threading.Event(), threading.Event()
    steps = 4
    labels: list[tuple[int, int]] = []
    slow_stats: dict[str, int] = {}

    def fast_worker(w: int) -> None:
        with PSClient(cluster.addresses, worker_id=f"w{w}") as client:
            for t in range(steps):
                if t == 2:
                    assert go.wait(WAIT)
                with client.step(NAMES) as s:
                    s.push(gradients(w, t))
                progress.finished(w, t + 1)
            progress.wait(fast, steps)  # nobody leaves before the last step is applied

    def slow_worker() -> None:
        with PSClient(cluster.addresses, worker_id="slow") as client:
            with client.step(NAMES) as s:  # pulls step 0
                progress.wait(fast, 2)  # steps 0 and 1 are applied meanwhile
                time.sleep(1.2)  # a few heartbeats while "computing"
                labels.append((0, client.step_count))
                s.push(gradients(slow, 0))
            slow_pushed.set()
            slow_stats.update(client.stats(), step_count=client.step_count)
            # Stay live (heartbeats only) while the fast ones finish: with K = 1 and only
            # two live workers, each step would be applied with one fast worker alone.
            progress.wait(fast, steps)

    threads = Workers()
    for w in fast:
        threads.start(fast_worker, w)
    threads.start(slow_worker)
    assert slow_pushed.wait(WAIT)
    with observer(cluster) as obs:
        dropped = [c["dropped_gradients"] for c in consistency(obs)]
    go.set()
    threads.join()
    assert dropped == [1, 1], (
        f"the slow worker's step-0 gradient was not dropped (its step counter read {labels} while it "
        "was still inside step 0: a heartbeat answer moved it, and the push was labelled with the new step)")
    assert labels == [(0, 0)]
    assert slow_stats["dropped_pushes"] == 2 and slow_stats["step_count"] == 2  # continues at step 2
    states = sgd_trajectory(initial, [mean_of(fast, t) for t in range(steps)])
    with observer(cluster) as obs:
        assert same(obs.pull(NAMES), states[steps])


KILLED_WORKER = """
import sys, time
import numpy as np
from worker_client import PSClient
client = PSClient(sys.argv[1].split(","), worker_id="victim")
zeros = {"big": np.zeros((512, 256), np.float32), "small": np.zeros(8, np.float32)}
for t in range(2):
    with client.step(["big", "small"]) as s:
        s.push(zeros)
s = client.step(["big", "small"]).__enter__()  # pulls step 2, never pushes it
print("pulled", flush=True)
time.sleep(600)
"""


def test_sync_killed_worker_blocks_the_others_no_longer_than_its_lease(cluster_factory):
    steps, lease = 8, 1.0
    cluster = cluster_factory(2, "--consistency", "sync", "--expected-workers", "3",
                              "--worker-lease", str(lease))
    with observer(cluster) as chief:
        create_variables(chief)
    victim = cluster_factory.python(KILLED_WORKER, ",".join(cluster.addresses))
    returned: dict[tuple[int, int], float] = {}

    def work(w: int) -> None:
        with PSClient(cluster.addresses, worker_id=f"w{w}") as client:
            for t in range(steps):
                with client.step(NAMES) as s:
                    returned[(w, t)] = time.monotonic()
                    s.push(gradients(w, t))
            assert client.step_count == steps

    threads = Workers()
    for w in (0, 1):
        threads.start(work, w)
    line = victim.stdout.readline()
    assert line.strip() == "pulled", victim.stderr.read()
    time.sleep(0.3)  # the survivors are now waiting for the victim's step 2
    assert not any(t >= 3 for (_, t) in returned), "step 3 began before the victim pushed step 2"
    killed = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    threads.join()
    waited = max(returned[(w, 3)] for w in (0, 1)) - killed
    print(f"\n[sync kill] survivors resumed {waited:.3f} s after SIGKILL (lease {lease} s)")
    # Last heartbeat <= ~lease/3 before the kill; the reaper runs every lease/4; plus slack.
    assert waited < lease + 2.0
    with observer(cluster) as obs:
        shards = obs.describe()
    for shard in shards:
        assert shard.consistency["steps_applied"] == steps
        assert not shard.workers["victim"]["live"]


# ---- ssp -------------------------------------------------------------------------------------------


def test_ssp_bounds_staleness_on_the_server_and_as_the_workers_see_it(cluster_factory):
    steps, staleness, workers = 15, 2, [0, 1, 2]
    cluster = cluster_factory(2, "--consistency", "ssp", "--staleness", str(staleness),
                              "--expected-workers", "3")
    with observer(cluster) as chief:
        create_variables(chief)
    lock = threading.Lock()
    pull_returned: dict[tuple[int, int], float] = {}
    push_started: dict[tuple[int, int], float] = {}

    def work(w: int) -> None:
        rng = random.Random(1000 + w)
        with PSClient(cluster.addresses, worker_id=f"w{w}") as client:
            assert client.consistency == "ssp"
            for t in range(steps):
                assert client.step_count == t
                with client.step(NAMES) as s:
                    with lock:
                        pull_returned[(w, t)] = time.monotonic()
                    time.sleep(rng.uniform(0, 0.03) + (0.03 if w == 2 else 0.0))  # w2: always slower
                    with lock:
                        push_started[(w, t)] = time.monotonic()
                    s.push(gradients(w, t))

    threads = Workers()
    for w in workers:
        threads.start(work, w)
    threads.join()

    with observer(cluster) as obs:
        infos = consistency(obs)
    report("ssp S=2 3 workers", infos)
    for c in infos:
        assert c["mode"] == "ssp" and c["staleness"] == staleness
        assert c["max_staleness_admitted"] <= staleness
    assert sum(c["pulls_blocked"] for c in infos) > 0

    # A worker at step c may pull only when every live worker's clock (steps completed) is
    # at least c - S. A clock of w >= c - S at the pull's admission means w's push of step
    # c - S - 1 completed before it, so that push *started* before the pull returned.
    # (Finished workers have clock = steps >= c - S for every c < steps, so "live" adds nothing.)
    for (p, c), returned in pull_returned.items():
        behind = c - staleness - 1
        if behind < 0:
            continue
        for w in workers:
            if w != p:
                assert push_started[(w, behind)] < returned, (
                    f"worker {p}'s pull of step {c} returned while worker {w} had not begun "
                    f"pushing step {behind} (clock <= {behind} < {c} - {staleness})")


def test_ssp_a_client_that_only_pushes_is_no_worker(cluster_factory):
    """A push of ``PSClient(register=False)`` is applied but holds no lease and no clock.

    With a lease far beyond the hang bound, such a pusher counted as a worker
    would hold every pull past step S + 1 (its clock stays at 1) until the
    lease ran out. It stays out of the live set and the workers' steps go on.
    """
    staleness = 0
    cluster = cluster_factory(2, "--consistency", "ssp", "--staleness", str(staleness),
                              "--worker-lease", "600")
    with observer(cluster) as admin, \
            PSClient(cluster.addresses, worker_id="w0", data_timeout=20, retry_timeout=20) as worker:
        create_variables(admin)
        admin.push({"big": np.full(BIG, 6, np.float32), "small": np.full(SMALL, 6, np.float32)})
        assert [set(shard.workers) for shard in admin.describe()] == [{"w0"}, {"w0"}], \
            "the pusher became a worker"
        for t in range(3):
            with worker.step(NAMES) as s:
                s.push(gradients(0, t))
        for shard in admin.describe():
            assert set(shard.workers) == {"w0"}
            assert shard.workers["w0"]["live"]
            assert (shard.consistency["step"], shard.consistency["pulls_blocked"]) == (3, 0)
        expected = sgd_trajectory({"big": np.full(BIG, 1.5, np.float32), "small": np.zeros(SMALL, np.float32)},
                                  [{n: 6.0 * np.ones_like(v) for n, v in gradients(0, 0).items()}]
                                  + [gradients(0, t) for t in range(3)])[-1]
        assert same(admin.pull(NAMES), expected)


# ---- async -----------------------------------------------------------------------------------------


def test_async_pulls_never_block_and_every_gradient_is_applied(cluster_factory):
    steps, workers = 10, [0, 1, 2]
    cluster = cluster_factory(2)
    with observer(cluster) as chief:
        initial = create_variables(chief)

    def work(w: int) -> None:
        rng = random.Random(w)
        with PSClient(cluster.addresses, worker_id=f"w{w}") as client:
            assert client.consistency == "async"
            for t in range(steps):
                with client.step(NAMES) as s:
                    time.sleep(rng.uniform(0, 0.02) + (0.03 if w == 2 else 0.0))
                    s.push(gradients(w, t))

    threads = Workers()
    for w in workers:
        threads.start(work, w)
    threads.join()
    total = [{n: sum(gradients(w, t)[n].astype(np.float64) for w in workers) for n in NAMES}
             for t in range(steps)]
    with observer(cluster) as obs:
        assert same(obs.pull(NAMES), sgd_trajectory(initial, total)[steps])
        infos = consistency(obs)
    report("async", infos)
    for c in infos:
        assert c["mode"] == "async"
        assert c["pulls_blocked"] == 0 and c["blocked_seconds"] == 0.0
        assert c["steps_applied"] == 0 and c["dropped_gradients"] == 0
