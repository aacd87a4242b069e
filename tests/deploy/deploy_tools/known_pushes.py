"""A worker that pushes known integer gradients, run in a worker pod by the replicated
contract test (tests/deploy/test_contract_replicated.py) instead of ps-worker's training,
so that the final values say exactly which pushes were applied.

It connects as ps-worker does (``PSClient.from_env``: the rendered PS_ADDRESSES, PS_TLS_*,
PS_SERVER_NAME and PS_AUTH_TOKEN_FILE, default timeouts), creates the variables of
:data:`SHAPES` with SGD at learning rate 1 from zeros, and pushes ``-gradient(n) * (i + 1)``
to variable ``i`` for n = 0, 1, ... until SIGTERM. Standard output, one JSON object a line:

* ``{"type": "placed", "shards": {name: [shard, ...]}}`` once the variables exist;
* ``{"type": "ack", "n": n, "at": unix_seconds}`` when push n returned (every shard involved
  applied it; ``at`` places it among the servers' log lines);
* ``{"type": "failed", "n": n, "error": ...}`` when push n raised (it may or may not
  have been applied: the program stops there, exit code 1);
* ``{"type": "stopped", "pushes": count}`` after SIGTERM, once the push in flight returned.

Run as ``python known_pushes.py`` with the pod's environment.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time

import numpy as np

#: Variables and shapes: small ones go by the Exchange lane, the large one as a Push stream.
SHAPES: dict[str, tuple[int, ...]] = {
    "known-a": (8,), "known-b": (64,), "known-c": (4, 4), "known-large": (200_000,)}

#: Pause between pushes: leaves CPU to the servers' and etcd's lease keepalives on a small machine.
PAUSE_SECONDS = 0.01


def gradient(n: int) -> int:
    """The integer every element of push ``n`` carries (times the variable's position + 1)."""
    return n % 7 + 1


def expected_values(acknowledged: list[int]) -> dict[str, np.ndarray]:
    """What SGD(1) from zeros holds after exactly the pushes ``acknowledged``, each once."""
    total = sum(gradient(n) for n in acknowledged)
    return {name: np.full(shape, total * (i + 1), np.float32)
            for i, (name, shape) in enumerate(SHAPES.items())}


def _emit(kind: str, **fields: object) -> None:
    print(json.dumps({"type": kind, **fields}), flush=True)


def main() -> int:
    from worker_client import SGD, PSClient, Zeros

    # The client's failovers (which replica its calls go to, and why) on standard error, with unix times.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(created).4f %(name)s %(message)s")

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    worker_id = f"known-pushes-{os.environ.get('PS_WORKER_INDEX', '0')}"
    with PSClient.from_env(os.environ, worker_id=worker_id) as client:
        for name, shape in SHAPES.items():
            client.create_variable(name, shape, initializer=Zeros(), optimizer=SGD(1.0))
        shards: dict[str, list[int]] = {}
        for info in client.describe():
            for name in info.variables:
                shards.setdefault(name, []).append(info.shard_index)
        _emit("placed", shards=shards)
        n = 0
        while not stop.is_set():
            grads = {name: np.full(shape, -gradient(n) * (i + 1), np.float32)
                     for i, (name, shape) in enumerate(SHAPES.items())}
            try:
                client.push(grads)
            except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
                _emit("failed", n=n, error=f"{type(exc).__name__}: {exc}")
                return 1
            _emit("ack", n=n, at=round(time.time(), 4))
            n += 1
            time.sleep(PAUSE_SECONDS)
        _emit("stopped", pushes=n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
