"""Handwritten digits with a multi-layer perceptron, trained by asynchronous SGD.

A template for your own job. The shape of a data-parallel worker:

1. every worker creates the variables (idempotent: the first creates them,
   the others get the same ones back);
2. each worker trains on its own slice of the data: pull the parameters,
   compute gradients on a batch, push them; the ps-servers apply SGD the
   moment a push arrives (asynchronous training, no barrier between workers);
3. anyone can pull the final parameters and evaluate them.

Data: scikit-learn's bundled copy of the UCI optical digits (1,797 8x8
images, no download). Runs on numpy, or on CuPy when a GPU is there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from worker_client import SGD, PSClient

NAME = "digits"
DESCRIPTION = "MLP 64-128-10 on scikit-learn's digits, asynchronous SGD"
METRIC = "held-out accuracy"
TARGET = 0.90
HIGHER_IS_BETTER = True

_CLASSES = 10
_FEATURES = 64
VARIABLES = ("mlp/w1", "mlp/b1", "mlp/w2", "mlp/b2")


@dataclass
class Config:
    epochs: int = 30
    batch_size: int = 32
    learning_rate: float = 0.1
    hidden: int = 128
    seed: int = 0
    device: str = "cpu"  # "cpu", or "cuda" to compute on the GPU with CuPy


def _xp(config: Config):
    """numpy, or cupy when the example runs on a GPU."""
    if config.device == "cpu":
        return np
    import cupy

    return cupy


def load_data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test): a fixed 80/20 split, features in [0, 1]."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise RuntimeError("the digits example needs scikit-learn: pip install 'wehub-ps[examples]'") from None
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return x[:split], y[:split], x[split:], y[split:]


def setup(client: PSClient, config: Config) -> None:
    """Create the model's variables on the parameter servers."""
    sgd = SGD(learning_rate=config.learning_rate)
    client.create_variable("mlp/w1", shape=(_FEATURES, config.hidden), initializer="glorot_uniform", optimizer=sgd)
    client.create_variable("mlp/b1", shape=(config.hidden,), initializer="zeros", optimizer=sgd)
    client.create_variable("mlp/w2", shape=(config.hidden, _CLASSES), initializer="glorot_uniform", optimizer=sgd)
    client.create_variable("mlp/b2", shape=(_CLASSES,), initializer="zeros", optimizer=sgd)


def forward(params: dict[str, Any], x, xp) -> tuple[Any, Any]:
    """(hidden activations, class probabilities)."""
    hidden = xp.maximum(x @ params["mlp/w1"] + params["mlp/b1"], 0)
    logits = hidden @ params["mlp/w2"] + params["mlp/b2"]
    logits = logits - logits.max(axis=1, keepdims=True)
    exp = xp.exp(logits)
    return hidden, exp / exp.sum(axis=1, keepdims=True)


def loss_and_gradients(params: dict[str, Any], x, y, xp) -> tuple[float, dict[str, Any]]:
    """Mean softmax cross-entropy over the batch and its gradients."""
    hidden, probs = forward(params, x, xp)
    n = x.shape[0]
    loss = float(-xp.log(probs[xp.arange(n), y] + 1e-12).mean())
    d_logits = probs.copy()
    d_logits[xp.arange(n), y] -= 1
    d_logits /= n
    d_hidden = (d_logits @ params["mlp/w2"].T) * (hidden > 0)
    grads = {
        "mlp/w2": hidden.T @ d_logits,
        "mlp/b2": d_logits.sum(axis=0),
        "mlp/w1": x.T @ d_hidden,
        "mlp/b1": d_hidden.sum(axis=0),
    }
    return loss, {name: g.astype(xp.float32) for name, g in grads.items()}


def train(client: PSClient, worker_index: int, num_workers: int, config: Config,
          report: Callable[[dict[str, Any]], None]) -> None:
    """Train on this worker's slice of the training set; ``report`` gets progress dicts."""
    xp = _xp(config)
    device = None if config.device == "cpu" else config.device
    x_train, y_train, _, _ = load_data(config.seed)
    x_mine = xp.asarray(x_train[worker_index::num_workers])
    y_mine = xp.asarray(y_train[worker_index::num_workers])
    rng = np.random.default_rng(config.seed + 1 + worker_index)
    batches_per_epoch = max(1, len(x_mine) // config.batch_size)
    total_steps = config.epochs * batches_per_epoch
    step = 0
    started = time.perf_counter()
    for epoch in range(config.epochs):
        order = xp.asarray(rng.permutation(len(x_mine)))
        for b in range(batches_per_epoch):
            idx = order[b * config.batch_size:(b + 1) * config.batch_size]
            with client.step(VARIABLES, device=device) as s:
                loss, grads = loss_and_gradients(s.params, x_mine[idx], y_mine[idx], xp)
                s.push(grads)
            step += 1
            if step % 10 == 0 or step == total_steps:
                elapsed = time.perf_counter() - started
                report({"step": step, "total_steps": total_steps, "epoch": epoch + 1, "loss": loss,
                        "examples_per_s": step * config.batch_size / elapsed})


def evaluate(client: PSClient, config: Config) -> float:
    """Accuracy of the current parameters on the held-out 20%."""
    _, _, x_test, y_test = load_data(config.seed)
    params = client.pull(VARIABLES)
    _, probs = forward(params, x_test, np)
    return float((probs.argmax(axis=1) == y_test).mean())
