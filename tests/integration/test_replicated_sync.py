"""Sync steps on replicated shards (--replicas 2, real etcd): a step in progress survives its primary.

Workers push known integer gradients with SGD(learning_rate=1), so every
value is exact in float32 and compared with the arithmetic: a step applies
the mean of the pushes it counted, each once. The primary is SIGKILLed in
the middle of a step (some pushes of it acknowledged, one not yet pushed);
the backup elected next holds the step's sums, its decisions and its
workers, waits for the missing push as the old primary would have, and
applies the step once with the same mean. A step that a worker's lease
running out applies on the primary is applied at the same point on the
backup. At the end every replica writes a checkpoint at the same point of
the shard's order and they hold the same bits.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from replica_testing import ReplicatedCluster, checkpoint_contents

from worker_client import SGD, PSClient

SIZE = 4
WAIT = 60.0
#: Step state both replicas must agree on (clocks follow heartbeats, which only the primary sees).
STEP_FIELDS = ("step", "steps_applied", "dropped", "accumulating")


@pytest.fixture
def replicated(tmp_path, etcd_server):
    clusters: list[ReplicatedCluster] = []

    def make(*extra_args: str) -> ReplicatedCluster:
        cluster = ReplicatedCluster(tmp_path / f"replicated-{len(clusters)}", etcd_server.endpoint, 1, 2,
                                    ("--consistency", "sync", *extra_args))
        clusters.append(cluster)
        return cluster.start()

    yield make
    for cluster in clusters:
        cluster.stop()


def _grad(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full(SIZE, value, np.float32)}


def _step(client: PSClient, value: float) -> None:
    with client.step(["w"]) as step:
        step.push(_grad(value))


def _value(observer: PSClient) -> np.ndarray:
    return observer.pull(["w"])["w"]


def _caught_up(cluster: ReplicatedCluster, timeout: float = 30.0) -> None:
    """Every running backup applied all the primary ordered, and is in its in-sync set."""
    deadline = time.monotonic() + timeout
    while True:
        primary = cluster.primary(0)
        status = primary.status()
        backups = [r for r in cluster.shards[0] if r is not primary and r.running()]
        if all(b.status().applied_sequence == status.applied_sequence for b in backups) and len(
                [b for b in status.backups if b.in_sync]) == len(backups):
            return
        assert time.monotonic() < deadline, f"backups did not catch up:\n{cluster.logs(0)}"
        time.sleep(0.05)


def _assert_same_bits(cluster: ReplicatedCluster, observer: PSClient) -> dict:
    """Every replica writes a checkpoint at one point of the order: values, ledger and step state agree."""
    _caught_up(cluster)
    observer.checkpoint()
    _caught_up(cluster)
    first, second = (checkpoint_contents(r.newest_checkpoint()) for r in cluster.shards[0])
    (tensors_a, state_a), (tensors_b, state_b) = first, second
    assert sorted(tensors_a) == sorted(tensors_b)
    for name, values in tensors_a.items():
        assert values.tobytes() == tensors_b[name].tobytes(), name
    assert (state_a["variables"], state_a["ledger"]) == (state_b["variables"], state_b["ledger"])
    steps = [{key: state["consistency"][key] for key in STEP_FIELDS} for state in (state_a, state_b)]
    assert steps[0] == steps[1]
    return steps[0]


def test_a_step_in_progress_survives_the_primarys_sigkill(replicated):
    """Three workers (gradients 1, 3 and 8: mean 4); a and b have pushed step 1, c has not, when the
    primary dies. The new primary waits for c, then applies (1 + 3 + 8) / 3 once."""
    cluster = replicated()
    observer = PSClient(cluster.addresses, worker_id="observer", register=False, retry_timeout=WAIT)
    grads = {"a": 1.0, "b": 3.0, "c": 8.0}
    workers = {name: PSClient(cluster.addresses, worker_id=name, retry_timeout=WAIT) for name in grads}
    try:
        observer.create_variable("w", shape=(SIZE,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        for name, client in workers.items():
            _step(client, grads[name])
        np.testing.assert_array_equal(_value(observer), np.full(SIZE, -4.0, np.float32))
        # Step 1: a and b push (acknowledged: on both replicas); c pulls and is held before its push.
        _step(workers["a"], grads["a"])
        _step(workers["b"], grads["b"])
        late = workers["c"].step(["w"])
        late.__enter__()
        _caught_up(cluster)
        primary = cluster.primary(0)
        assert observer.describe()[0].consistency["step"] == 1
        primary.process.signal(signal.SIGKILL)
        primary.process.wait(30)
        survivor = cluster.primary(0, timeout=WAIT)
        assert survivor is not primary
        # The new primary holds step 1 open with a's and b's gradients, and waits for c.
        time.sleep(1.5)  # more than the default worker lease of a heartbeat period: nothing applies early
        described = observer.describe()[0]
        state = described.consistency
        assert (state["step"], state["steps_applied"]) == (1, 1), \
            f"{state}\nworkers: {described.workers}\n{cluster.logs(0)}"
        np.testing.assert_array_equal(_value(observer), np.full(SIZE, -4.0, np.float32))
        late.push(_grad(grads["c"]))  # retried against the new primary: completes step 1
        late.__exit__(None, None, None)
        np.testing.assert_array_equal(_value(observer), np.full(SIZE, -8.0, np.float32))
        for name, client in workers.items():
            _step(client, grads[name])
        np.testing.assert_array_equal(_value(observer), np.full(SIZE, -12.0, np.float32))
        final = observer.describe()[0].consistency
        assert (final["step"], final["steps_applied"], final["dropped_gradients"]) == (3, 3, 0), final
        assert all(client.stats()["dropped_pushes"] == 0 for client in workers.values())
        # The killed replica comes back, catches up from a snapshot; both hold the same bits.
        primary.start()
        step_state = _assert_same_bits(cluster, observer)
        assert (step_state["step"], step_state["steps_applied"]) == (3, 3)
    finally:
        for client in (*workers.values(), observer):
            client.close()


_DYING_WORKER = textwrap.dedent("""
    import sys, time
    from worker_client import PSClient
    client = PSClient(sys.argv[1], worker_id="dying")
    print("registered", flush=True)
    time.sleep(600)
""")


def test_a_step_applied_by_a_lease_running_out_is_applied_on_the_backup(replicated):
    """a (1) and b (3) push step 0; worker 'dying' registered and is SIGKILLed before it pushes. Its lease
    runs out on the primary, whose lease reaper applies step 0 with the mean 2: the backup applies the
    same step at the same point, and after the primary's SIGKILL the new one carries on from it."""
    cluster = replicated("--worker-lease", "2")
    observer = PSClient(cluster.addresses, worker_id="observer", register=False, retry_timeout=WAIT)
    a = PSClient(cluster.addresses, worker_id="a", retry_timeout=WAIT)
    b = PSClient(cluster.addresses, worker_id="b", retry_timeout=WAIT)
    dying = subprocess.Popen([sys.executable, "-c", _DYING_WORKER, cluster.addresses],
                             stdout=subprocess.PIPE, text=True)
    try:
        observer.create_variable("w", shape=(SIZE,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        assert dying.stdout.readline().strip() == "registered"
        assert observer.describe()[0].workers["dying"]["live"]
        for client, value in ((a, 1.0), (b, 3.0)):
            with client.step(["w"]) as step:
                step.push(_grad(value))
        assert observer.describe()[0].consistency["steps_applied"] == 0  # waits for 'dying'
        dying.send_signal(signal.SIGKILL)
        dying.wait(30)
        deadline = time.monotonic() + WAIT
        while observer.describe()[0].consistency["steps_applied"] < 1:
            assert time.monotonic() < deadline, "the lease of the dead worker never ran out"
            time.sleep(0.1)
        np.testing.assert_array_equal(_value(observer), np.full(SIZE, -2.0, np.float32))
        step_state = _assert_same_bits(cluster, observer)
        assert (step_state["step"], step_state["steps_applied"]) == (1, 1)
        # The backup elected next applied that step: it goes on from it, without the dead worker.
        primary = cluster.primary(0)
        primary.process.signal(signal.SIGKILL)
        primary.process.wait(30)
        for client, value in ((a, 1.0), (b, 3.0)):
            with client.step(["w"]) as step:
                step.push(_grad(value))
        np.testing.assert_array_equal(_value(observer), np.full(SIZE, -4.0, np.float32))
        assert observer.describe()[0].consistency["steps_applied"] == 2
    finally:
        if dying.poll() is None:
            dying.kill()
        for client in (a, b, observer):
            client.close()
