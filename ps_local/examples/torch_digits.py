"""Handwritten digits with a PyTorch MLP whose parameters live on the ps-servers.

The digits example's model (64-128-10, asynchronous SGD at 0.1, the same
data split) written as a plain ``torch.nn.Module``; ``worker_client.torch``
does the rest: the parameters become variables, each step pulls into them
in place and pushes their gradients. A template for a PyTorch job:

1. every worker builds the model and attaches it (the first worker's
   initial values become the variables', every worker pulls them);
2. each step runs forward and backward inside ``with ps_model.step():``;
3. anyone can pull the final parameters into a model and evaluate it.

Needs the ``torch`` and ``examples`` extras. Runs on the CPU, or on a GPU
with ``--set device=cuda`` (CUDA parameters also need CuPy, the ``gpu`` extra).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable

# The digits example's settings: the same model, data and training; device 'cuda' computes in torch.
from ps_local.examples.digits_mlp import Config, load_data
from worker_client import PSClient

NAME = "torch-digits"
DESCRIPTION = "PyTorch MLP 64-128-10 on scikit-learn's digits, asynchronous SGD on the servers"
METRIC = "held-out accuracy"
TARGET = 0.90
HIGHER_IS_BETTER = True

PREFIX = "torch-mlp"


def _torch():
    try:
        import torch
    except ImportError:
        raise RuntimeError("the torch-digits example needs PyTorch: "
                           "pip install 'wehub-ps[torch,examples]'") from None
    return torch


def build_model(config: Config):
    """The MLP, with torch's own initial values (seeded: every worker offers the same ones)."""
    torch = _torch()
    torch.manual_seed(config.seed)
    return torch.nn.Sequential(torch.nn.Linear(64, config.hidden), torch.nn.ReLU(),
                               torch.nn.Linear(config.hidden, 10)).to(config.device)


def _attach(client: PSClient, config: Config):
    from worker_client.torch import attach

    torch = _torch()
    model = build_model(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate)
    return model, attach(client, model, prefix=PREFIX, optimizer=optimizer)


def setup(client: PSClient, config: Config) -> None:
    """Create the model's variables on the parameter servers (idempotent)."""
    _attach(client, config)


def train(client: PSClient, worker_index: int, num_workers: int, config: Config,
          report: Callable[[dict[str, Any]], None]) -> None:
    """Train on this worker's slice of the training set; ``report`` gets progress dicts."""
    torch = _torch()
    torch.set_num_threads(1)  # workers share the machine's cores; one thread each is fastest for this size
    functional = torch.nn.functional
    model, ps_model = _attach(client, config)
    x_train, y_train, _, _ = load_data(config.seed)
    x_mine = torch.from_numpy(x_train[worker_index::num_workers]).to(config.device)
    y_mine = torch.from_numpy(y_train[worker_index::num_workers]).to(config.device)
    generator = torch.Generator().manual_seed(config.seed + 1 + worker_index)
    batches_per_epoch = max(1, len(x_mine) // config.batch_size)
    total_steps = config.epochs * batches_per_epoch
    step = 0
    started = time.perf_counter()
    for epoch in range(config.epochs):
        order = torch.randperm(len(x_mine), generator=generator).to(config.device)
        for b in range(batches_per_epoch):
            idx = order[b * config.batch_size:(b + 1) * config.batch_size]
            with ps_model.step():
                loss = functional.cross_entropy(model(x_mine[idx]), y_mine[idx])
                loss.backward()
            step += 1
            if step % 10 == 0 or step == total_steps:
                elapsed = time.perf_counter() - started
                report({"step": step, "total_steps": total_steps, "epoch": epoch + 1, "loss": float(loss),
                        "examples_per_s": step * config.batch_size / elapsed})


def evaluate(client: PSClient, config: Config) -> float:
    """Accuracy of the current parameters on the held-out 20%."""
    torch = _torch()
    model = build_model(replace(config, device="cpu"))
    client.pull([f"{PREFIX}/{name}" for name, _ in model.named_parameters()],
                out={f"{PREFIX}/{name}": p.detach() for name, p in model.named_parameters()})
    _, _, x_test, y_test = load_data(config.seed)
    with torch.no_grad():
        predicted = model(torch.from_numpy(x_test)).argmax(dim=1).numpy()
    return float((predicted == y_test).mean())
