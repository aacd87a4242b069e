"""worker_client.torch against real ps-servers: parameters pulled in place, gradients pushed exactly.

The CUDA variant needs a GPU, torch's CUDA build and CuPy, and skips elsewhere.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from worker_client import SGD, PSClient
from worker_client.gpu import gpu_available

torch = pytest.importorskip("torch")

from worker_client.torch import PSEmbedding, attach  # noqa: E402


def _mlp(seed: int, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(seed)
    # 300 x 1000 floats: the first weight has a part on each of two shards.
    layers = (torch.nn.Linear(1000, 300), torch.nn.ReLU(), torch.nn.Linear(300, 3))
    return torch.nn.Sequential(*layers).to(device)


def _state(model: torch.nn.Module) -> dict[str, bytes]:
    return {name: p.detach().cpu().numpy().tobytes() for name, p in model.named_parameters()}


def _assert_holds_the_servers_values(client: PSClient, model: torch.nn.Module, prefix: str) -> None:
    pulled = client.pull([f"{prefix}/{name}" for name, _ in model.named_parameters()])
    assert _state(model) == {name: pulled[f"{prefix}/{name}"].tobytes()
                             for name, _ in model.named_parameters()}


def test_a_step_pulls_into_the_parameters_in_place_bit_exact(cluster2):
    model = _mlp(0)
    pointers = [p.data_ptr() for p in model.parameters()]
    with PSClient(cluster2.addresses) as client, PSClient(cluster2.addresses) as other:
        ps_model = attach(client, model, prefix="m", optimizer=torch.optim.SGD(model.parameters(), lr=0.5))
        assert sorted(ps_model.parameters) == ["m/0.bias", "m/0.weight", "m/2.bias", "m/2.weight"]
        _assert_holds_the_servers_values(client, model, "m")
        other.push({"m/0.weight": np.full((300, 1000), 0.125, np.float32),
                    "m/2.bias": np.ones(3, np.float32)})
        with ps_model.step():
            _assert_holds_the_servers_values(client, model, "m")
        assert [p.data_ptr() for p in model.parameters()] == pointers


def test_racing_workers_end_with_the_first_creators_values(cluster2):
    """Per variable, whichever worker created it first gave the values both workers end with."""
    models = [_mlp(seed) for seed in (1, 2)]
    initial = [_state(m) for m in models]
    assert initial[0] != initial[1]
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def worker(model: torch.nn.Module) -> None:
        try:
            with PSClient(cluster2.addresses) as client:
                client.describe()
                start.wait(timeout=60)
                attach(client, model, prefix="race", optimizer=torch.optim.Adam(model.parameters()))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(m,)) for m in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert _state(models[0]) == _state(models[1])
    for name, values in _state(models[0]).items():
        assert values in (initial[0][name], initial[1][name]), name
    with PSClient(cluster2.addresses) as client:
        _assert_holds_the_servers_values(client, models[0], "race")


def test_gradients_are_pushed_exactly_and_parameters_without_one_are_skipped(cluster2):
    model = torch.nn.Linear(4, 3)
    model.requires_grad_(True)
    with PSClient(cluster2.addresses) as client:
        ps_model = attach(client, model, prefix="lin", optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
        before = {name: p.detach().clone() for name, p in ps_model.parameters.items()}
        weight_grad = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 8
        with ps_model.step():
            (model.weight * weight_grad).sum().backward()  # d/dweight = weight_grad; bias gets no grad
            assert model.bias.grad is None
        assert model.weight.grad is None  # cleared after the push
        pulled = client.pull(["lin/weight", "lin/bias"])
        np.testing.assert_array_equal(pulled["lin/weight"], (before["lin/weight"] - weight_grad).numpy())
        np.testing.assert_array_equal(pulled["lin/bias"], before["lin/bias"].numpy())
        with pytest.raises(ZeroDivisionError), ps_model.step():
            (model.weight * weight_grad).sum().backward()
            1 / 0  # noqa: B018 - leaving by an exception
        assert model.weight.grad is None
        assert client.pull(["lin/weight"])["lin/weight"].tobytes() == pulled["lin/weight"].tobytes()


def test_server_side_adam_follows_torch_adam(cluster2):
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    reference = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    reference.load_state_dict(model.state_dict())
    local = torch.optim.Adam(reference.parameters(), lr=0.01)
    x, y = torch.randn(16, 6), torch.randn(16, 2)
    with PSClient(cluster2.addresses, prefetch=False) as client:
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        ps_model = attach(client, model, prefix="adam", optimizer=optimizer)
        for _ in range(5):
            with ps_model.step():
                (100 * ((model(x) - y) ** 2).mean()).backward()  # gradients near 1: far above ε
            local.zero_grad()
            (100 * ((reference(x) - y) ** 2).mean()).backward()
            local.step()
        ps_model.pull()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


class _RowModule(torch.nn.Module):
    """A stand-in for a table-backed embedding: speaks the row protocol, holds a parameter of its own."""

    def __init__(self, table: str) -> None:
        super().__init__()
        self.table = table
        self.scratch = torch.nn.Parameter(torch.zeros(2, 2))
        self.calls: list[str] = []

    def begin_step(self) -> None:
        self.calls.append("begin")

    def take_row_gradients(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        self.calls.append("take")
        return {self.table: (np.array([5, 9, 5]), np.ones((3, 4), np.float32))}


def test_row_modules_push_their_rows_in_the_step_and_keep_their_parameters(cluster2):
    rows = _RowModule("emb")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), rows)
    with PSClient(cluster2.addresses) as client:
        client.create_embedding("emb", dim=4, initializer="zeros")
        ps_model = attach(client, model, prefix="rec", optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
        assert sorted(ps_model.parameters) == ["rec/0.bias", "rec/0.weight"]
        with ps_model.step():
            assert rows.calls == ["begin"]
        assert rows.calls == ["begin", "take"]
        np.testing.assert_array_equal(client.pull_rows("emb", [5, 9]),
                                      -0.01 * np.array([[2] * 4, [1] * 4], np.float32))  # SGD() default


@pytest.mark.skipif(not (gpu_available() and torch.cuda.is_available()),
                    reason="needs CuPy, torch CUDA and a GPU")
def test_cuda_parameters_are_pulled_in_place_and_their_gradients_pushed(cluster2):
    model = _mlp(4, device="cuda")
    pointers = [p.data_ptr() for p in model.parameters()]
    with PSClient(cluster2.addresses) as client:
        ps_model = attach(client, model, prefix="gpu", optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
        before = {name: p.detach().cpu().clone() for name, p in ps_model.parameters.items()}
        with ps_model.step():
            model(torch.ones(2, 1000, device="cuda")).sum().backward()
            grads = {name: p.grad.detach().cpu().clone() for name, p in ps_model.parameters.items()}
        with ps_model.step():
            _assert_holds_the_servers_values(client, model, "gpu")
        for name, p in ps_model.parameters.items():
            torch.testing.assert_close(p.detach().cpu(), before[name] - grads[name], rtol=0, atol=0)
        assert [p.data_ptr() for p in model.parameters()] == pointers


class _Recommender(torch.nn.Module):
    def __init__(self, client: PSClient) -> None:
        super().__init__()
        self.emb = PSEmbedding(client, "items", 4, optimizer=SGD(learning_rate=1.0))
        self.head = torch.nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids)).sum()


def test_a_sync_step_pushes_dense_and_embedding_gradients_as_one_push(cluster_factory):
    """Synchronous mode with one expected worker applies a step only once its one push came whole."""
    cluster = cluster_factory(2, "--consistency", "sync", "--expected-workers", "1")
    with PSClient(cluster.addresses, worker_id="w0") as client:
        model = _Recommender(client)
        ps_model = attach(client, model, prefix="rec", optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
        assert sorted(ps_model.parameters) == ["rec/head.bias", "rec/head.weight"]
        ids = torch.tensor([3, 8, 3])
        rows_before = client.pull_rows("items", [3, 8])
        weight_before = model.head.weight.detach().clone()
        bias_before = float(model.head.bias.detach()[0])
        with ps_model.step():
            model(ids).backward()
        count = np.array([[2.0], [1.0]], np.float32)  # id 3 appears twice
        np.testing.assert_allclose(client.pull_rows("items", [3, 8]),
                                   rows_before - count * weight_before.numpy(), rtol=1e-6)
        assert client.pull(["rec/head.bias"])["rec/head.bias"][0] == np.float32(bias_before) - 3  # 3 outputs
        assert client.step_count == 1


def test_overlapped_steps_push_every_gradient_exactly_once(cluster2):
    """step(overlap=True): pushes go out in the background; after flush the values hold every one of them,
    dense and rows alike, whatever each step's pull saw."""
    with PSClient(cluster2.addresses, worker_id="overlap") as client:
        model = _Recommender(client)
        ps_model = attach(client, model, prefix="ovl", optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
        ids = torch.tensor([3, 8, 3])
        rows_before = client.pull_rows("items", [3, 8]).astype(np.float64)
        bias_before = float(model.head.bias.detach()[0])
        pushed_rows = np.zeros((2, 4))
        for _ in range(6):
            with ps_model.step(overlap=True):
                model(ids).backward()
                # The rows' gradient is the weight the step pulled (times each id's count): record it.
                pushed_rows += np.array([[2.0], [1.0]]) * model.head.weight.detach().numpy().astype(np.float64)
            assert all(p.grad is None for p in model.parameters())
        client.flush()
        assert client.pull(["ovl/head.bias"])["ovl/head.bias"][0] == np.float32(bias_before) - 18  # 6 steps x 3
        np.testing.assert_allclose(client.pull_rows("items", [3, 8]), rows_before - pushed_rows, rtol=1e-5)
        assert client.stats()["duplicate_acks"] == 0
