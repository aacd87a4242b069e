"""worker_client.torch.optimizers: torch.optim groups to the servers' optimizers, with torch's values."""

from __future__ import annotations

import pytest

from worker_client import SGD, Adagrad, Adam, Momentum

torch = pytest.importorskip("torch")

from worker_client.torch import UnsupportedOptimizerError, optimizers_by_parameter  # noqa: E402


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def _map(optimizer, model) -> dict:
    return optimizers_by_parameter(optimizer, model.named_parameters())


def test_torch_defaults_carry_over():
    model = _model()
    assert set(_map(torch.optim.Adam(model.parameters()), model).values()) == {
        Adam(learning_rate=1e-3, beta_1=0.9, beta_2=0.999, epsilon=1e-8)}
    assert set(_map(torch.optim.Adagrad(model.parameters()), model).values()) == {
        Adagrad(learning_rate=0.01, initial_accumulator_value=0.0, epsilon=1e-10)}
    assert set(_map(torch.optim.SGD(model.parameters(), lr=0.5), model).values()) == {SGD(learning_rate=0.5)}
    nesterov = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.8, nesterov=True)
    assert set(_map(nesterov, model).values()) == {Momentum(learning_rate=0.5, momentum=0.8, nesterov=True)}


def test_each_parameter_group_gets_its_own_optimizer():
    model = _model()
    optimizer = torch.optim.Adam([{"params": model[0].parameters(), "lr": 0.1},
                                  {"params": model[1].parameters(), "betas": (0.5, 0.9)}], lr=0.01, eps=1e-6)
    mapped = _map(optimizer, model)
    assert mapped["0.weight"] == mapped["0.bias"] == Adam(learning_rate=0.1, epsilon=1e-6)
    assert mapped["1.weight"] == Adam(learning_rate=0.01, beta_1=0.5, beta_2=0.9, epsilon=1e-6)


def test_a_wehub_optimizer_applies_to_every_parameter():
    model = _model()
    assert set(_map(Momentum(learning_rate=0.1), model).values()) == {Momentum(learning_rate=0.1)}


@pytest.mark.parametrize("make, words", [
    (lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=1e-4), "weight_decay=0.0001"),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1), "dampening=0.1"),
    (lambda p: torch.optim.Adam(p, amsgrad=True, maximize=True), "amsgrad=True, maximize=True"),
    (lambda p: torch.optim.Adagrad(p, lr_decay=0.01), "lr_decay=0.01"),
    (lambda p: torch.optim.AdamW(p), "AdamW has no server-side counterpart"),
    (lambda p: torch.optim.RMSprop(p), "RMSprop has no server-side counterpart"),
])
def test_options_the_servers_lack_are_refused_by_name(make, words):
    model = _model()
    with pytest.raises(UnsupportedOptimizerError, match=words):
        _map(make(model.parameters()), model)


def test_a_parameter_outside_the_optimizers_groups_is_refused():
    model = _model()
    with pytest.raises(UnsupportedOptimizerError, match="1.weight, 1.bias"):
        _map(torch.optim.SGD(model[0].parameters(), lr=0.1), model)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        _map("adam", model)
