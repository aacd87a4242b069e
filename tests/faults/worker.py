"""The worker process of the randomized fault test: pushes its slots in order and logs each answer.

In async mode half the pushes go out in the background (``push(wait=False)``,
``step(overlap=True)``) and are waited for before the next one: the same
rules hold for them.

Run by the controller as ``python tests/faults/worker.py <config json>``
(see ``Cluster.start_worker``). The log it appends to is what the oracle
reads: a ``start`` line per client, ``begin`` before each push, then
``ack`` (with the top-k residual still owed) or ``raise``, and ``end``
when its client closes. Every line but ``begin`` is fsynced before the next
push, so a SIGKILL loses none of the record.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import sys
import time
from typing import Any

_TESTS = pathlib.Path(__file__).resolve().parents[1]
for _path in (str(_TESTS.parent), str(_TESTS)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import numpy as np  # noqa: E402

from faults import layout  # noqa: E402
from faults.layout import dense_positions, gradient_value, table_ids, topk_ratio  # noqa: E402


def worker_main(config: dict[str, Any]) -> int:
    """One worker: pushes its slots in order, logging every acknowledged push durably."""
    from worker_client import AuthenticationError, PSClient, PSError

    index = config["index"]
    layout.configure(config["slots"])
    go_file = pathlib.Path(config["go_file"])
    parent = os.getppid()
    while not go_file.exists():  # started before the cluster, so that imports overlap its start-up
        if os.getppid() != parent:
            return 1  # the controller is gone
        time.sleep(0.02)
    addresses = json.loads(go_file.read_text())["addresses"]
    log_path = pathlib.Path(config["log"])
    stop_file = pathlib.Path(config["stop_file"])
    token_file = pathlib.Path(config["token_file"])
    topk = config["topk_rows"] is not None
    begun = []
    for line in log_path.read_text().splitlines() if log_path.exists() else []:
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut by SIGKILL
        if entry["ev"] == "begin":
            begun.append(entry["k"])
    k = max(begun) + 1 if begun else 0  # a slot a killed incarnation began is never reused
    ids_a, ids_b = table_ids()
    rng = random.Random(f"{config['seed']}-{index}-{k}")
    log = open(log_path, "a")

    def write(entry: dict[str, Any], durable: bool) -> None:
        log.write(json.dumps(entry) + "\n")
        log.flush()
        if durable:
            os.fsync(log.fileno())

    def connect() -> PSClient:
        deadline = time.monotonic() + 60
        while True:
            try:  # the client reads the token file, and again when a server refuses the token
                return PSClient(addresses, worker_id=f"worker-{index}", chunk_bytes=config["chunk_bytes"],
                                wire_dtype=config["wire_dtype"], topk_ratio=topk_ratio(config),
                                retry_timeout=60, auth_token_file=str(token_file))
            except AuthenticationError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)  # the servers have not re-read the rotated file yet

    def owed(client: PSClient) -> dict[str, list[int]]:
        if not topk:
            return {}
        return {name: np.flatnonzero(r).tolist() for name, r in client.gradient_residuals().items()}

    client = connect()
    write({"ev": "start", "inc": client.incarnation, "k": k, "t": time.time()}, durable=True)
    dense = np.zeros(layout.DENSE, np.float32)
    small = np.zeros(layout.SLOTS, np.float32)
    serving = layout.serve_ids()
    while k < layout.PER_WORKER and not stop_file.exists() and os.getppid() == parent:
        slot = index * layout.PER_WORKER + k
        g = gradient_value(slot)
        positions = [element for _, element in dense_positions(slot)]
        dense[positions] = small[slot] = g
        emb_rows = (np.array([ids_a[slot], ids_b[slot]]), np.full((2, 2), g, np.float32))
        rows = {"emb": emb_rows, "emb_rows": emb_rows}
        write({"ev": "begin", "k": k, "inc": client.incarnation, "t": time.time()}, durable=False)
        pushed_at = None
        dropped_before = client.stats()["dropped_pushes"]
        try:
            # In async mode worker 0 only pushes (as a trainer that keeps its own copy may), the others
            # pull half the time: a push that fits the Exchange stream opens no new RPC. Half of the
            # async pushes and steps go out in the background, their arrays cleared before the wait.
            background = config["consistency"] == "async" and rng.random() < 0.5
            # A serving read beside training: it must create no row, on any replica (checked at the end).
            client.lookup_rows("emb", serving)
            if config["consistency"] == "async" and k >= 8:
                # A training read of this worker's rows of 8 slots ago: by now on disk (emb keeps 8 rows per
                # shard in memory), so it reads them back; the oracle's sums see any bit it got wrong.
                client.pull_rows("emb", np.array([ids_a[slot - 8], ids_b[slot - 8]]))
            handle = None
            if config["consistency"] == "async" and (index == 0 or rng.random() < 0.5):
                pushed_at = time.time()
                if background:
                    handle = client.push({"dense": dense, "small": small}, rows=rows, wait=False)
                else:
                    client.push({"dense": dense, "small": small}, rows=rows)
            else:
                with client.step(["dense", "small"], overlap=background) as step:
                    pushed_at = time.time()
                    step.push({"dense": dense, "small": small}, rows=rows)
                handle = step.handle if background else None
            if handle is not None:
                dense[positions] = small[slot] = 0  # the background push sent a copy
                emb_rows[1][...] = 0
                handle.wait()
            write({"ev": "ack", "k": k, "inc": client.incarnation, "t0": pushed_at, "t1": time.time(),
                   "drop": client.stats()["dropped_pushes"] - dropped_before,
                   "owed": owed(client)}, durable=True)
        except PSError as error:
            write({"ev": "raise", "k": k, "inc": client.incarnation, "pushed": pushed_at is not None,
                   "t0": pushed_at, "t1": time.time(), "error": type(error).__name__,
                   "message": str(error)[:300]}, durable=True)
            if isinstance(error, AuthenticationError):
                client.close()
                client = connect()
                write({"ev": "start", "inc": client.incarnation, "k": k + 1, "t": time.time()}, durable=True)
        dense[positions] = small[slot] = 0
        k += 1
        time.sleep(rng.uniform(0, config["pace"]))
    write({"ev": "end", "inc": client.incarnation, "t": time.time(), "owed": owed(client)}, durable=True)
    client.close()  # leaves the live set: ssp and sync steps stop waiting for this worker
    while not stop_file.exists() and os.getppid() == parent:  # every slot used: wait for the end
        time.sleep(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(json.loads(sys.argv[1])))
