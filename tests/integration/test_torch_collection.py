"""PSEmbeddingBagCollection: TorchRec's layout in and out, torch's pooling and gradients, a DLRM that trains.

The comparisons hold without TorchRec (KeyedJaggedBatch, TableConfig); the last test also runs against
TorchRec's own EmbeddingBagCollection where TorchRec is installed (its wheels pair with particular torch
builds, so it is not a dependency).
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from worker_client import SGD, PSClient  # noqa: E402
from worker_client.torch import (  # noqa: E402
    KeyedJaggedBatch,
    PSEmbeddingBag,
    PSEmbeddingBagCollection,
    TableConfig,
    attach,
)
from worker_client.torch.embedding import begin_step, take_row_gradients  # noqa: E402

DIM = 4


@pytest.fixture
def client(module_cluster2):
    with PSClient(module_cluster2.addresses) as client:
        yield client


def _tables() -> list[TableConfig]:
    return [TableConfig("users", DIM, 30, ["user", "friend"], pooling="mean"),
            TableConfig("items", DIM, 20, ["item"], pooling="sum")]


def _batch(weighted: bool = False) -> KeyedJaggedBatch:
    # 3 samples; keys in another order than the tables'; repeats and an empty bag (friend of sample 1).
    keys = ["item", "user", "friend"]
    values = {"item": [[1, 1, 7], [2], [7, 7]], "user": [[3], [4, 4], [5]], "friend": [[3, 9], [], [29, 3, 3]]}
    flat = [i for k in keys for bag in values[k] for i in bag]
    lengths = [len(bag) for k in keys for bag in values[k]]
    weights = torch.linspace(0.5, 2.0, len(flat)) if weighted else None
    return KeyedJaggedBatch(keys, torch.tensor(flat), torch.tensor(lengths), weights)


def _initial(client: PSClient, prefix: str) -> dict[str, torch.Tensor]:
    return {t.name: torch.tensor(client.pull([prefix + t.name])[prefix + t.name], requires_grad=True)
            for t in _tables()}


def _reference(batch: KeyedJaggedBatch, weights: dict[str, torch.Tensor], weighted: bool) -> dict[str, torch.Tensor]:
    """Each feature pooled by torch's embedding_bag on its table's weight."""
    keys, values, lengths = batch.keys(), batch.values(), batch.lengths().reshape(len(batch.keys()), -1)
    ends = torch.cumsum(lengths.sum(1), 0).tolist()
    out = {}
    for table in _tables():
        for feature in table.feature_names:
            k = keys.index(feature)
            start = ends[k - 1] if k else 0
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths[k], 0)])
            psw = batch.weights_or_none()[start:ends[k]] if weighted else None
            out[feature] = torch.nn.functional.embedding_bag(
                values[start:ends[k]], weights[table.name], offsets, mode="sum" if weighted else table.pooling,
                include_last_offset=True, per_sample_weights=psw)
    return out


@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_features_and_gradients_are_torchs(client, weighted):
    prefix = f"c{uuid.uuid4().hex[:6]}/"
    tables = _tables() if not weighted else [TableConfig(t.name, DIM, t.num_embeddings, t.feature_names)
                                              for t in _tables()]
    collection = PSEmbeddingBagCollection(client, tables, prefix=prefix, optimizer=SGD(0.1), is_weighted=weighted)
    batch = _batch(weighted)
    weights = _initial(client, prefix)
    begin_step(collection)
    pooled = collection(batch)
    assert pooled.keys() == ["user", "friend", "item"] and pooled.length_per_key() == [DIM] * 3
    assert pooled.values().shape == (3, 3 * DIM)
    expected = _reference(batch, weights, weighted)
    out_grad = torch.from_numpy(np.random.default_rng(1).normal(size=(3, 3 * DIM)).astype(np.float32))
    (pooled.values() * out_grad).sum().backward()
    reference = torch.cat([expected[k] for k in pooled.keys()], dim=1)
    (reference * out_grad).sum().backward()
    torch.testing.assert_close(pooled.values(), reference, rtol=0, atol=0)
    taken = take_row_gradients(collection)
    assert sorted(taken) == [prefix + "items", prefix + "users"]
    for table in _tables():
        ids, grads = taken[prefix + table.name]
        full = weights[table.name].grad
        torch.testing.assert_close(torch.as_tensor(grads), full[torch.from_numpy(ids)], rtol=1e-6, atol=1e-6)
        assert not np.delete(full.numpy(), ids, axis=0).any()  # no other row has a gradient


class _DLRM(torch.nn.Module):
    """A DLRM's shape: dense features through an MLP, sparse ones pooled, their dot products, a top MLP."""

    def __init__(self, collection: torch.nn.Module) -> None:
        super().__init__()
        self.sparse = collection
        self.bottom = torch.nn.Sequential(torch.nn.Linear(2, DIM), torch.nn.ReLU())
        self.top = torch.nn.Linear(4 * 4, 1)

    def forward(self, dense: torch.Tensor, features) -> torch.Tensor:
        pooled = self.sparse(features).to_dict()
        vectors = torch.stack([self.bottom(dense), *(pooled[k] for k in ("user", "friend", "item"))], dim=1)
        interactions = torch.bmm(vectors, vectors.transpose(1, 2)).flatten(1)
        return self.top(interactions).squeeze(-1)


def test_a_dlrm_with_the_collection_swapped_in_trains(client):
    prefix = f"d{uuid.uuid4().hex[:6]}/"
    torch.manual_seed(0)
    model = _DLRM(PSEmbeddingBagCollection(client, _tables(), prefix=prefix))  # attach() gives the optimizer
    ps_model = attach(client, model, prefix=prefix + "dlrm", optimizer=torch.optim.Adagrad(model.parameters(), lr=0.1))
    rng = np.random.default_rng(3)
    users, items = rng.integers(0, 30, 64), rng.integers(0, 20, 64)
    labels = torch.tensor(((users % 3) == (items % 3)).astype(np.float32))
    dense = torch.from_numpy(rng.normal(size=(64, 2)).astype(np.float32))
    batch = KeyedJaggedBatch(["user", "friend", "item"],
                             torch.from_numpy(np.concatenate([users, (users + 1) % 30, items])),
                             torch.ones(3 * 64, dtype=torch.long))
    losses = []
    for _ in range(40):
        with ps_model.step():
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, batch), labels)
            loss.backward()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses
    # Exported: the same predictions from plain torch modules (the collection's tables swapped).
    ps_model.pull()
    model.eval()
    plain = ps_model.plain_model().eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(dense, batch), model(dense, batch), rtol=0, atol=0)
    assert not any(isinstance(m, PSEmbeddingBag) for m in plain.modules())


def test_against_torchrecs_own_collection(client):
    torchrec = pytest.importorskip("torchrec", reason="TorchRec is not installed (an optional pairing with torch)")
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    prefix = f"r{uuid.uuid4().hex[:6]}/"
    # (Table names other than "items": TorchRec keeps its tables in a ModuleDict, whose .items() it would hide.)
    configs = [torchrec.EmbeddingBagConfig(name=f"{t.name}_table", embedding_dim=DIM, num_embeddings=t.num_embeddings,
                                           feature_names=list(t.feature_names),
                                           pooling=torchrec.PoolingType[t.pooling.upper()]) for t in _tables()]
    ours = PSEmbeddingBagCollection(client, configs, prefix=prefix, optimizer=SGD(0.1))
    theirs = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
    with torch.no_grad():
        for t in _tables():
            name = prefix + t.name + "_table"
            theirs.embedding_bags[t.name + "_table"].weight.copy_(torch.from_numpy(client.pull([name])[name]))
    mine = _batch()
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=mine.keys(), values=mine.values(), lengths=mine.lengths())
    begin_step(ours)
    got, expected = ours(kjt), theirs(kjt)
    assert got.keys() == expected.keys()
    torch.testing.assert_close(got.values(), expected.values(), rtol=1e-6, atol=1e-6)
    got.values().sum().backward()
    expected.values().sum().backward()
    taken = take_row_gradients(ours)
    for t in _tables():
        ids, grads = taken[prefix + t.name + "_table"]
        reference = theirs.embedding_bags[t.name + "_table"].weight.grad
        torch.testing.assert_close(torch.as_tensor(grads), reference[torch.from_numpy(ids)], rtol=1e-6, atol=1e-6)
