"""pull(out=) and step(out=) into DLPack arrays (PyTorch tensors, CUDA arrays) against real ps-servers.

Host tensors are written in place through a shared numpy view; CUDA arrays
through a pinned buffer. Without a GPU the CUDA path runs on the logging
stand-in for CuPy (tests/fake_cupy.py); the test marked for a GPU runs it
on a real device.
"""

from __future__ import annotations

import numpy as np
import pytest

from worker_client import SGD, DTypeMismatchError, InvalidArgumentError, PSClient, ShapeMismatchError
from worker_client.gpu import gpu_available

torch = pytest.importorskip("torch")

SHAPES = {"big": (300, 1000), "small": (3, 4)}  # "big" has a part on each of two shards


def _create(client: PSClient) -> None:
    for name, shape in SHAPES.items():
        client.create_variable(name, shape=shape, initializer="uniform", optimizer=SGD(learning_rate=1.0))


def test_torch_tensors_as_out_receive_exactly_what_pull_returns(cluster2):
    with PSClient(cluster2.addresses) as client:
        _create(client)
        expected = client.pull()
        out = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
        pointers = {name: t.data_ptr() for name, t in out.items()}
        pulled = client.pull(out=out)
        for name in SHAPES:
            assert pulled[name] is out[name] and out[name].data_ptr() == pointers[name]
            assert out[name].numpy().tobytes() == expected[name].tobytes()


def test_step_out_fills_the_tensors_whether_pulled_or_brought_back_by_the_push(cluster2):
    with PSClient(cluster2.addresses) as client:
        client.create_variable("w", shape=(4, 5), initializer="uniform", optimizer=SGD(learning_rate=1.0))
        client.create_variable("b", shape=(5,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        out = {"w": torch.zeros(4, 5), "b": torch.zeros(5)}
        grads = {"w": np.full((4, 5), 0.25, np.float32), "b": np.ones(5, np.float32)}
        for _ in range(4):
            with client.step(["w", "b"], out=out) as step:
                assert step.params["w"] is out["w"]
                expected = client.pull(["w", "b"])
                for name in out:
                    assert out[name].numpy().tobytes() == expected[name].tobytes()
                step.push(grads)
        assert client.stats()["prefetched_steps"] >= 2  # the values the push brought back went to out too


@pytest.mark.parametrize("bad, error, words", [
    (lambda: torch.zeros(4, 3), ShapeMismatchError, "shape"),
    (lambda: torch.zeros(3, 4, dtype=torch.float64), DTypeMismatchError, "float64"),
    (lambda: torch.zeros(4, 3).T, InvalidArgumentError, "C-contiguous"),
    (lambda: torch.nn.Parameter(torch.zeros(3, 4)), InvalidArgumentError, "require"),
    (lambda: _read_only(), InvalidArgumentError, "read-only"),
    (lambda: "not an array", TypeError, "__dlpack__"),
])
def test_an_out_array_that_cannot_take_the_values_is_refused_and_nothing_is_written(cluster2, bad, error,
                                                                                     words):
    with PSClient(cluster2.addresses) as client:
        _create(client)
        good = torch.full(SHAPES["big"], 7.0)
        with pytest.raises(error, match=words):
            client.pull(out={"big": good, "small": bad()})
        assert bool((good == 7.0).all())
        with pytest.raises(error, match=words):
            with client.step(out={"big": good, "small": bad()}):
                pytest.fail("the step must not start")
        assert bool((good == 7.0).all())


def _read_only() -> np.ndarray:
    array = np.zeros((3, 4), np.float32)
    array.setflags(write=False)
    return array


def test_an_out_name_the_pull_does_not_read_is_refused(cluster2):
    with PSClient(cluster2.addresses) as client:
        _create(client)
        with pytest.raises(InvalidArgumentError, match="'nope'"):
            client.pull(["small"], out={"nope": torch.zeros(3, 4)})
        with pytest.raises(ValueError, match="device="):
            client.pull(["small"], out={"small": torch.zeros(3, 4)}, device="cuda")


def test_cuda_out_arrays_receive_through_a_pinned_buffer_with_one_wait(cluster2, fake_cupy):
    cuda, cupy = fake_cupy
    with PSClient(cluster2.addresses) as client:
        _create(client)
        expected = client.pull()
        out = {name: cupy.array_on(np.zeros(shape, np.float32)) for name, shape in SHAPES.items()}
        host = torch.zeros(SHAPES["small"])
        cuda.log.clear()
        pulled = client.pull(out={"big": out["big"], "small": host})
        assert pulled["big"] is out["big"] and pulled["small"] is host
        assert [entry[0] for entry in cuda.log] == ["record", "wait", "h2d", "sync"]
        assert out["big"].values().tobytes() == expected["big"].tobytes()
        assert host.numpy().tobytes() == expected["small"].tobytes()
        with pytest.raises(ShapeMismatchError):
            client.pull(out={"small": cupy.array_on(np.zeros((4, 3), np.float32))})


@pytest.mark.skipif(not (gpu_available() and torch.cuda.is_available()),
                    reason="needs CuPy, torch CUDA and a GPU")
def test_torch_cuda_tensors_as_out_receive_exactly_what_pull_returns(cluster2):
    with PSClient(cluster2.addresses) as client:
        _create(client)
        expected = client.pull()
        out = {name: torch.zeros(shape, device="cuda") for name, shape in SHAPES.items()}
        client.pull(out=out)
        for name in SHAPES:
            assert out[name].cpu().numpy().tobytes() == expected[name].tobytes()
