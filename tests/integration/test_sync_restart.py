"""ssp and sync state across restarts, and sync steps with bounded hash tables, on real ps-servers.

Two workers (PSClient each, own worker id and lease, threads of this
process) push known integer gradients to one shard: worker a pushes 1,
worker b pushes 3, with SGD(learning_rate=1). A sync step applies their
mean (2); ssp applies each push. Every value is exact in float32, so the
server's result is compared with the arithmetic exactly.

The server is stopped while b is in the middle of a step (it pulled, a
pushed, b has not), by SIGTERM (final checkpoint) or by SIGKILL right after
a checkpoint, and restarted with the same flags. The step, the clocks, the
live workers and the step's sum must come back from the checkpoint: b's
push then joins the step it belongs to, the cluster's step is the one of
the checkpoint (not 0), and nothing is refused.
"""

from __future__ import annotations

import signal
import threading

import numpy as np
import pytest

from worker_client import SGD, PSClient, ResourceExhaustedError

SIZE = 4
GRAD = {"a": 1.0, "b": 3.0}
WAIT = 120.0  # generous bound for things that must happen


def _flags(tmp_path, mode: str) -> tuple[str, ...]:
    consistency = ("--consistency", "ssp", "--staleness", "0") if mode == "ssp" else ("--consistency", "sync")
    # The default 30 s lease: clocks that had to climb back by heartbeat would show.
    return (*consistency, "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-interval", "0")


def _worker(cluster, name: str) -> PSClient:
    return PSClient(cluster.addresses, worker_id=name, retry_timeout=WAIT)


def _grad(name: str) -> dict[str, np.ndarray]:
    return {"w": np.full(SIZE, GRAD[name], np.float32)}


def _step(client: PSClient, name: str) -> None:
    with client.step(["w"]) as step:
        step.push(_grad(name))


def _consistency(observer: PSClient) -> dict:
    return observer.describe()[0].consistency


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_a_worker_mid_step_carries_on_across_a_restart(cluster_factory, tmp_path, mode, signum):
    cluster = cluster_factory(1, *_flags(tmp_path, mode))
    server = cluster.servers[0]
    observer = PSClient(cluster.addresses, worker_id="observer", register=False, retry_timeout=WAIT)
    a, b = _worker(cluster, "a"), _worker(cluster, "b")
    try:
        observer.create_variable("w", shape=(SIZE,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        # Step 0 in full: sync applies the mean 2, ssp both gradients (4).
        _step(a, "a")
        _step(b, "b")
        per_step = 2.0 if mode == "sync" else 4.0
        np.testing.assert_array_equal(observer.pull(["w"])["w"], np.full(SIZE, -per_step, np.float32))
        # Step 1: a completes it; b pulls and is stopped before its push.
        _step(a, "a")
        b_step = b.step(["w"])
        b_step.__enter__()
        before = _consistency(observer)
        assert before["step"] == 1
        if signum == signal.SIGKILL:
            observer.checkpoint()  # a SIGKILL keeps what the last checkpoint holds
        server.signal(signum)
        assert server.wait(60) == (0 if signum == signal.SIGTERM else -signal.SIGKILL)
        server.start(port=server.port)

        after = _consistency(observer)
        # The step (sync) or the slowest live worker's clock (ssp) is the checkpoint's,
        # not 0 climbing back one heartbeat at a time; nothing was applied or dropped since.
        assert after["step"] == 1, after
        assert (after["steps_applied"], after["dropped_gradients"]) == \
            (before["steps_applied"], before["dropped_gradients"])
        assert {w for w, info in observer.describe()[0].workers.items() if info["live"]} == {"a", "b"}
        # b, mid-step, pushes to the restarted server: its push joins step 1 (no error).
        b_step.push(_grad("b"))
        b_step.__exit__(None, None, None)
        expected = 2 * per_step
        np.testing.assert_array_equal(observer.pull(["w"])["w"], np.full(SIZE, -expected, np.float32))
        # One more whole step of both workers.
        _step(a, "a")
        _step(b, "b")
        expected += per_step
        np.testing.assert_array_equal(observer.pull(["w"])["w"], np.full(SIZE, -expected, np.float32))
        final = _consistency(observer)
        assert final["step"] == 3 and final["dropped_gradients"] == 0
        if mode == "sync":
            assert final["steps_applied"] == 3
        assert a.stats()["dropped_pushes"] == b.stats()["dropped_pushes"] == 0
        assert '"event": "restored"' in server.log_text()
    finally:
        for client in (a, b, observer):
            client.close()


def test_sync_step_whose_table_rows_would_not_fit_refuses_the_push_before_recording_it(cluster_factory):
    """Two pushes of one sync step with 80 new rows each, a table of at most 100 rows (LRU).

    The step's rows are created and pinned when each push begins: the
    second push is refused with RESOURCE_EXHAUSTED before anything of it is
    recorded, the first one's gradient is not lost, and once the second
    worker pushes rows that fit, the step is applied with both gradients.
    LRU eviction makes room from rows of earlier steps, never from the
    open step's.
    """
    cluster = cluster_factory(1, "--consistency", "sync")
    observer = PSClient(cluster.addresses, worker_id="observer", register=False, retry_timeout=WAIT)
    a, b = _worker(cluster, "a"), _worker(cluster, "b")
    try:
        observer.create_embedding("t", 2, initializer="zeros", optimizer=SGD(learning_rate=1.0),
                                  max_rows=100, eviction="lru")
        old = np.arange(1000, 1050, dtype=np.int64)  # step 0: 50 rows that LRU may evict later
        for client in (a, b):
            with client.step([]) as step:
                step.push({}, rows={"t": (old, np.ones((len(old), 2), np.float32))})
        rows_a = np.arange(0, 80, dtype=np.int64)
        rows_b = np.arange(80, 160, dtype=np.int64)
        with a.step([]) as step:
            step.push({}, rows={"t": (rows_a, np.full((80, 2), 2.0, np.float32))})
        table = observer.describe()[0].variables["t"]
        assert (table["num_rows"], table["evicted_rows"]) == (100, 30)  # a's rows pinned, 30 old ones gone
        with b.step([]) as step:
            with pytest.raises(ResourceExhaustedError, match="open synchronous step"):
                step.push({}, rows={"t": (rows_b, np.full((80, 2), 4.0, np.float32))})
            # Refused before anything was recorded: the step still waits for b, a's rows are kept.
            state = _consistency(observer)
            assert (state["step"], state["steps_applied"]) == (1, 1)
            table = observer.describe()[0].variables["t"]
            assert (table["num_rows"], table["evicted_rows"]) == (100, 30)
            fits = rows_b[:20]  # 80 + 20 rows: the whole table, nothing of the step evicted
            step.push({}, rows={"t": (fits, np.full((20, 2), 4.0, np.float32))})
        state = _consistency(observer)
        assert (state["step"], state["steps_applied"]) == (2, 2)
        values = observer.pull_rows("t", np.concatenate([rows_a, fits]))
        # Each row's mean is over the two pushes that sent rows: 2 / 2 and 4 / 2.
        np.testing.assert_array_equal(values[:80], np.full((80, 2), -1.0, np.float32))
        np.testing.assert_array_equal(values[80:], np.full((20, 2), -2.0, np.float32))
        table = observer.describe()[0].variables["t"]
        assert (table["num_rows"], table["evicted_rows"]) == (100, 50)
    finally:
        for client in (a, b, observer):
            client.close()


def test_sync_step_applies_while_a_checkpoint_runs(cluster_factory, tmp_path):
    """Checkpoints taken while steps are applied never deadlock with pushes, heartbeats or pulls."""
    cluster = cluster_factory(1, *_flags(tmp_path, "sync"))
    observer = PSClient(cluster.addresses, worker_id="observer", register=False, retry_timeout=WAIT)
    a, b = _worker(cluster, "a"), _worker(cluster, "b")
    stop = threading.Event()
    errors: list[BaseException] = []

    def checkpoints() -> None:
        try:
            while not stop.is_set():
                observer.checkpoint()
        except BaseException as exc:  # reported below
            errors.append(exc)

    try:
        observer.create_variable("w", shape=(SIZE,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        thread = threading.Thread(target=checkpoints, name="test-checkpoints")
        thread.start()
        steps = 20

        def run(client: PSClient, name: str) -> None:
            for _ in range(steps):
                _step(client, name)

        workers = [threading.Thread(target=run, args=(c, n), name=f"test-{n}")
                   for c, n in ((a, "a"), (b, "b"))]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(WAIT)
            assert not worker.is_alive()
        stop.set()
        thread.join(WAIT)
        assert not errors
        np.testing.assert_array_equal(observer.pull(["w"])["w"], np.full(SIZE, -2.0 * steps, np.float32))
    finally:
        stop.set()
        for client in (a, b, observer):
            client.close()
