"""No lost updates: W worker processes x S pushes of known integer gradients.

SGD with learning rate 1 on integer-valued float32 gradients is exact
arithmetic (every partial sum stays far below 2**24), so the final values
must equal the initial values minus the sum of every gradient, bit for bit,
whatever the interleaving of the pushes on the servers.
"""

from __future__ import annotations

import numpy as np

from worker_client import SGD, PSClient

WORKERS = 4
PUSHES = 150
BIG = (512, 300)  # 600 KB: split over both shards
SMALL = (7,)  # whole on one shard

WORKER_CODE = """
import sys
import numpy as np
from worker_client import PSClient
from test_no_lost_updates import gradients
addresses, worker = sys.argv[1].split(","), int(sys.argv[2])
with PSClient(addresses, worker_id=f"w{worker}") as client:
    for step in range(int(sys.argv[3])):
        client.push(gradients(worker, step))
print("ok")
"""


def gradients(worker: int, step: int) -> dict[str, np.ndarray]:
    """Deterministic integer-valued gradients of one push."""
    rng = np.random.default_rng([worker, step])
    return {"big": rng.integers(-4, 5, size=BIG).astype(np.float32),
            "small": rng.integers(-4, 5, size=SMALL).astype(np.float32)}


def test_concurrent_worker_processes_leave_the_exact_sum(cluster_factory):
    cluster = cluster_factory(2)
    with PSClient(cluster.addresses, worker_id="chief") as client:
        big = client.create_variable("big", shape=BIG, initializer="zeros", optimizer=SGD(learning_rate=1.0))
        client.create_variable("small", shape=SMALL, initializer="constant", optimizer=SGD(learning_rate=1.0))
        assert len(big.placement.parts) == 2
        initial = client.pull()

        env = {"PYTHONPATH": str(__import__("pathlib").Path(__file__).parent)}
        workers = [cluster_factory.python(WORKER_CODE, ",".join(cluster.addresses), str(w), str(PUSHES), env=env)
                   for w in range(WORKERS)]
        for w in workers:
            out, err = w.communicate(timeout=240)
            assert w.returncode == 0, err
            assert out.strip() == "ok"

        expected = {name: value.astype(np.float64) for name, value in initial.items()}
        for worker in range(WORKERS):
            for step in range(PUSHES):
                for name, grad in gradients(worker, step).items():
                    expected[name] -= grad
        final = client.pull()
        for name in expected:
            assert final[name].tobytes() == expected[name].astype(np.float32).tobytes(), name
        info = {i: shard.variables for i, shard in enumerate(client.describe())}
        for part in big.placement.parts:
            assert info[part.shard]["big"]["version"] == WORKERS * PUSHES
