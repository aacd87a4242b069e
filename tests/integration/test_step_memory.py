"""A training step's memory is given back when the step ends, against real ps-servers.

A push that kept a reference to the arrays it was given (a reference
cycle, say, that only Python's cyclic collector breaks) would hold a whole
step's gradients for several steps: the heap grows by a step's bytes at a
time, and glibc later hands the freed block back to the kernel at once, to
be faulted in again page by page. With the cyclic collector off, every
array handed to a push must be freed as soon as the caller drops it.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from worker_client import SGD, FixedShardsPartitioner, PSClient

BIG = (1024, 1024)  # 4 MiB, over both shards: the streaming path
SMALL = (64,)  # the exchange lane


@pytest.fixture
def client(cluster2) -> Iterator[PSClient]:
    with PSClient(cluster2.addresses, worker_id="step-memory") as c:
        c.create_variable("big", shape=BIG, optimizer=SGD(learning_rate=1e-3),
                          partitioner=FixedShardsPartitioner(2))
        c.create_variable("small", shape=SMALL, optimizer=SGD(learning_rate=1e-3))
        c.create_embedding("table", dim=8, optimizer=SGD(learning_rate=1e-3))
        yield c


def _push_plain(c: PSClient, grads: dict[str, np.ndarray]) -> None:
    c.push(grads)


def _push_rows(c: PSClient, grads: dict[str, np.ndarray]) -> None:
    c.push(grads, rows={"table": (np.arange(4, dtype=np.int64), np.ones((4, 8), np.float32))})


def _push_in_step(c: PSClient, grads: dict[str, np.ndarray]) -> None:
    with c.step(["big", "small"]) as s:
        s.push(grads)


def _push_in_background(c: PSClient, grads: dict[str, np.ndarray]) -> None:
    c.push(grads, wait=False).wait(60)


@pytest.mark.parametrize("push", [_push_plain, _push_rows, _push_in_step, _push_in_background],
                         ids=["push", "push-rows", "step", "background"])
def test_a_push_holds_no_reference_to_its_gradients_once_it_returns(
        client: PSClient, push: Callable[[PSClient, dict[str, np.ndarray]], None]) -> None:
    push(client, {"big": np.ones(BIG, np.float32), "small": np.ones(SMALL, np.float32)})  # warm the paths
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            grads = {"big": np.ones(BIG, np.float32), "small": np.ones(SMALL, np.float32)}
            alive = [weakref.ref(array) for array in grads.values()]
            push(client, grads)
            del grads
            held = [ref() for ref in alive if ref() is not None]
            assert not held, f"{len(held)} gradient arrays still referenced after the push returned"
    finally:
        gc.enable()
