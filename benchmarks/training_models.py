"""The models of the training-loop benchmark: each step as users write it, and its parts alone.

Each model offers four loops of one step each, run by a worker process of
``bench_training``:

* ``compute``: forward and backward on parameters held locally, no
  parameter server: the loop's compute;
* ``comm``: the loop's pulls and pushes of the same variables (zero
  gradients), no compute: its communication;
* ``plain``: the loop as README teaches it (``pull(out=params)``, compute,
  ``push(grads)``); for the recommender, the ``ps-local`` example's loop
  (``client.step`` with ``pull_rows`` of the batch's ids);
* ``step``: the same with ``with client.step(names) as s`` (MLPs only).

The MLPs are numpy (float32): ReLU layers, a linear output, squared error
against random targets, SGD on the servers. The recommender is
``ps_local.examples.recommender`` (its variables, gradients and data).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Params = dict[str, np.ndarray]


@dataclass(frozen=True)
class MLPShape:
    """An MLP's layer widths (input first) and batch size."""

    name: str
    widths: tuple[int, ...]
    batch: int

    @property
    def names(self) -> list[str]:
        return [f"{self.name}/{kind}{i}" for i in range(len(self.widths) - 1) for kind in ("w", "b")]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {}
        for i, (fan_in, fan_out) in enumerate(zip(self.widths, self.widths[1:])):
            shapes[f"{self.name}/w{i}"] = (fan_in, fan_out)
            shapes[f"{self.name}/b{i}"] = (fan_out,)
        return shapes

    @property
    def parameters(self) -> int:
        return sum(int(np.prod(shape)) for shape in self.shapes().values())


#: Ten 1024x1024 ReLU layers and a 1024x16 output, with biases: 10.5 M parameters, 22 variables, 42 MB.
MLP_10M = MLPShape("mlp10m", (1024,) * 11 + (16,), 16)
#: 256 -> 256 -> 128 -> 16: 100 K parameters, 6 variables.
MLP_100K = MLPShape("mlp100k", (256, 256, 128, 16), 16)


def mlp_gradients(shape: MLPShape, params: Params, x: np.ndarray, y: np.ndarray) -> Params:
    """Gradients of the mean squared error of ``params`` on (x, y), by hand in numpy."""
    layers = len(shape.widths) - 1
    activations = [x]
    h = x
    for i in range(layers):
        h = h @ params[f"{shape.name}/w{i}"] + params[f"{shape.name}/b{i}"]
        if i < layers - 1:
            np.maximum(h, 0, out=h)
        activations.append(h)
    d = (h - y) * np.float32(2 / len(x))
    grads: Params = {}
    for i in reversed(range(layers)):
        grads[f"{shape.name}/w{i}"] = activations[i].T @ d
        grads[f"{shape.name}/b{i}"] = d.sum(axis=0)
        if i:
            d = (d @ params[f"{shape.name}/w{i}"].T) * (activations[i] > 0)
    return grads


class MLPLoops:
    """One step of each loop of an MLP; the variables live on the servers (``setup`` creates them)."""

    def __init__(self, shape: MLPShape, seed: int) -> None:
        self.shape = shape
        rng = np.random.default_rng(seed)
        self.x = rng.standard_normal((shape.batch, shape.widths[0]), np.float32)
        self.y = rng.standard_normal((shape.batch, shape.widths[-1]), np.float32)
        self.local = {name: (rng.standard_normal(s, np.float32) / np.float32(np.sqrt(s[0]))) if len(s) == 2
                      else np.zeros(s, np.float32) for name, s in shape.shapes().items()}
        self.zeros = {name: np.zeros(s, np.float32) for name, s in shape.shapes().items()}
        self.params = {name: np.empty(s, np.float32) for name, s in shape.shapes().items()}

    @staticmethod
    def setup(client, shape: MLPShape) -> None:
        from worker_client import SGD

        for name, s in shape.shapes().items():
            client.create_variable(name, s, initializer="glorot_uniform" if len(s) == 2 else "zeros",
                                   optimizer=SGD(learning_rate=1e-3))
        # One push of zeros: the servers' first apply (and any kernel compiled on first use) happens here.
        client.push({name: np.zeros(s, np.float32) for name, s in shape.shapes().items()})

    def loops(self, client) -> dict[str, Callable[[], None]]:
        names = self.shape.names

        def compute() -> None:
            mlp_gradients(self.shape, self.local, self.x, self.y)

        def comm() -> None:
            client.pull(names, out=self.params)
            client.push(self.zeros)

        def plain() -> None:
            client.pull(names, out=self.params)
            client.push(mlp_gradients(self.shape, self.params, self.x, self.y))

        def step() -> None:
            with client.step(names) as s:
                s.push(mlp_gradients(self.shape, s.params, self.x, self.y))

        return {"compute": compute, "comm": comm, "plain": plain, "step": step}

    @staticmethod
    def bytes_per_step(shape: MLPShape) -> int:
        """Bytes a pull plus a push of every variable moves."""
        return 2 * 4 * shape.parameters


class RecommenderLoops:
    """The ``ps-local`` recommender example's step, and its compute and communication alone."""

    #: Examples of synthetic data generated per worker (the example's batches are drawn from them).
    EXAMPLES = 20_000

    def __init__(self, seed: int) -> None:
        from ps_local.examples import recommender

        self.example = recommender
        self.config = recommender.Config(num_examples=self.EXAMPLES, seed=0)
        self.data, _ = recommender.make_data(self.config)
        self.rng = np.random.default_rng(seed)
        dim = self.config.embedding_dim
        self.dense_shapes = self.dense_shapes_of(self.config)
        self.local = {name: self.rng.standard_normal(s, np.float32) * np.float32(0.1)
                      for name, s in self.dense_shapes.items()}
        # Local embedding rows for the compute-only loop, indexed like the ids.
        _, self.user_rows = np.unique(self.data.users, return_inverse=True)
        _, self.item_rows = np.unique(self.data.items, return_inverse=True)
        self.user_table = self.rng.standard_normal((self.user_rows.max() + 1, dim), np.float32)
        self.item_table = self.rng.standard_normal((self.item_rows.max() + 1, dim), np.float32)
        self.zero_dense = {name: np.zeros(s, np.float32) for name, s in self.dense_shapes.items()}
        self.zero_rows = np.zeros((self.config.batch_size, dim), np.float32)

    @staticmethod
    def dense_shapes_of(config) -> dict[str, tuple[int, ...]]:
        """Shapes of the example's MLP variables (its ``setup``)."""
        dim, hidden = config.embedding_dim, config.hidden
        return {"rec/w1": (3 * dim, hidden), "rec/b1": (hidden,), "rec/w2": (hidden, 1), "rec/b2": (1,)}

    @classmethod
    def setup(cls, client) -> None:
        """The example's variables, every row of the benchmark's ids created (a table creates rows on first touch)."""
        from ps_local.examples import recommender

        recommender.setup(client, recommender.Config())
        data, _ = recommender.make_data(recommender.Config(num_examples=cls.EXAMPLES, seed=0))
        users, items = np.unique(data.users), np.unique(data.items)
        client.pull_rows(recommender.USERS, users)
        client.pull_rows(recommender.ITEMS, items)
        # One push of zeros: the servers compile their Adam and Adagrad kernels on first use (about 0.4 s),
        # which would otherwise fall into the first loop's timed steps.
        dim = recommender.Config().embedding_dim
        dense = {name: np.zeros(shape, np.float32) for name, shape in cls.dense_shapes_of(recommender.Config()).items()}
        client.push(dense, rows={recommender.USERS: (users[:8], np.zeros((8, dim), np.float32)),
                                 recommender.ITEMS: (items[:8], np.zeros((8, dim), np.float32))})

    def _batch(self) -> np.ndarray:
        return self.rng.integers(0, len(self.data.clicks), self.config.batch_size)

    def loops(self, client) -> dict[str, Callable[[], None]]:
        rec = self.example

        def compute() -> None:
            idx = self._batch()
            rec.gradients(self.local, self.user_table[self.user_rows[idx]], self.item_table[self.item_rows[idx]],
                          self.data.clicks[idx])

        def comm() -> None:
            idx = self._batch()
            users, items = self.data.users[idx], self.data.items[idx]
            with client.step(rec.DENSE) as s:
                client.pull_rows(rec.USERS, users)
                client.pull_rows(rec.ITEMS, items)
                s.push(self.zero_dense, rows={rec.USERS: (users, self.zero_rows), rec.ITEMS: (items, self.zero_rows)})

        def plain() -> None:
            idx = self._batch()
            users, items = self.data.users[idx], self.data.items[idx]
            with client.step(rec.DENSE) as s:
                ue = client.pull_rows(rec.USERS, users)
                ie = client.pull_rows(rec.ITEMS, items)
                _, dense, d_ue, d_ie = rec.gradients(s.params, ue, ie, self.data.clicks[idx])
                s.push(dense, rows={rec.USERS: (users, d_ue), rec.ITEMS: (items, d_ie)})

        loops = {"compute": compute, "comm": comm, "plain": plain}
        if client is not None and torch_installed():
            loops["torch"] = self._torch_loop(client)
        return loops

    def _torch_loop(self, client) -> Callable[[], None]:
        """The same model written with worker_client.torch: PSEmbedding over the example's two tables,
        its MLP as torch layers attached (variables of their own), one ``ps_model.step()`` per batch."""
        import torch

        from worker_client import Adagrad, Adam
        from worker_client.torch import PSEmbedding, attach

        rec, config = self.example, self.config
        torch.set_num_threads(1)

        class Recommender(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                sparse = Adagrad(learning_rate=config.embedding_learning_rate)
                self.users = PSEmbedding(client, rec.USERS, config.embedding_dim, initializer="normal",
                                         optimizer=sparse)
                self.items = PSEmbedding(client, rec.ITEMS, config.embedding_dim, initializer="normal",
                                         optimizer=sparse)
                self.hidden = torch.nn.Linear(3 * config.embedding_dim, config.hidden)
                self.out = torch.nn.Linear(config.hidden, 1)

            def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
                ue, ie = self.users(users), self.items(items)
                hidden = torch.relu(self.hidden(torch.cat([ue, ie, ue * ie], dim=1)))
                return self.out(hidden).squeeze(-1)

        model = Recommender()
        ps_model = attach(client, model, prefix="rec-torch", optimizer=Adam(learning_rate=config.learning_rate))
        clicks = torch.from_numpy(self.data.clicks.astype(np.float32))
        users, items = torch.from_numpy(self.data.users), torch.from_numpy(self.data.items)

        def step() -> None:
            idx = torch.from_numpy(self._batch())
            with ps_model.step():
                logits = model(users[idx], items[idx])
                torch.nn.functional.binary_cross_entropy_with_logits(logits, clicks[idx]).backward()
        return step

    @staticmethod
    def bytes_per_step() -> int:
        """Bytes of one step's pulls and pushes: the dense variables both ways, two batches of rows both ways."""
        from ps_local.examples import recommender

        config = recommender.Config()
        dense = sum(int(np.prod(shape)) for shape in RecommenderLoops.dense_shapes_of(config).values()) * 4
        rows = 2 * config.batch_size * config.embedding_dim * 4
        return 2 * (dense + rows)


def torch_installed() -> bool:
    """Whether the torch extra is here (the recommender's torch loop needs it)."""
    import importlib.util

    return importlib.util.find_spec("torch") is not None
