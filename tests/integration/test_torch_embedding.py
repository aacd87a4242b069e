"""PSEmbedding (worker_client.torch.embedding) against real ps-servers.

The reference is ``torch.nn.Embedding`` with the same initial rows trained
by ``torch.optim.SGD``; the server runs SGD with the same rate. The rate is
a power of two so that ``lr * g`` is exact and both sides round ``w - lr * g``
alike: the values must be equal, not close. CUDA variants need a GPU and CuPy.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from worker_client import SGD, InvalidArgumentError, PSClient, ReplicaGroup, VariableConflictError
from worker_client.gpu import gpu_available
from worker_client.torch.embedding import PSEmbedding, begin_step, take_row_gradients

LEARNING_RATE = 0.5
DIM = 4
#: Hash-table ids over the whole int64 range; dense-table ids are their positions.
HASH_VOCABULARY = np.array([2**40 + 3, -7, 11, 123_456_789, 0, 2**62, -(2**63)], dtype=np.int64)
#: Batches of positions in the vocabulary, with repeats inside each batch.
BATCHES = [[[0, 1, 0], [2, 1, 0]], [[3, 3, 3], [4, 5, 6]], [[6, 0, 2], [2, 6, 1]], [[5, 5, 1], [0, 4, 4]]]

needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and gpu_available()),
                                reason="needs a CUDA build of torch, a GPU and CuPy")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


@pytest.fixture
def client(module_cluster2):
    with PSClient(module_cluster2.addresses) as client:
        yield client


def _name() -> str:
    return f"emb-{uuid.uuid4().hex[:8]}"


def _table(client: PSClient, kind: str, name: str | None = None) -> tuple[PSEmbedding, np.ndarray, np.ndarray]:
    """(module, the ids it is fed, their initial rows): a hash table, or a dense one from random rows."""
    name = name or _name()
    if kind == "hash":
        module = PSEmbedding(client, name, DIM, optimizer=SGD(LEARNING_RATE))
        vocabulary = HASH_VOCABULARY
        initial = client.pull_rows(name, vocabulary)
    else:
        vocabulary = np.arange(len(HASH_VOCABULARY), dtype=np.int64)
        initial = np.random.default_rng(3).normal(size=(len(vocabulary), DIM)).astype(np.float32)
        module = PSEmbedding(client, name, DIM, num_embeddings=len(vocabulary), initializer=initial,
                             optimizer=SGD(LEARNING_RATE))
    return module, vocabulary, initial


def _reference(initial: np.ndarray, device: str) -> tuple[torch.nn.Embedding, torch.optim.SGD]:
    embedding = torch.nn.Embedding(*initial.shape).to(device)
    with torch.no_grad():
        embedding.weight.copy_(torch.from_numpy(initial))
    return embedding, torch.optim.SGD(embedding.parameters(), lr=LEARNING_RATE)


def _loss(rows: torch.Tensor) -> torch.Tensor:
    """Not linear in the rows, so each step's gradients depend on the values the step read."""
    head = torch.linspace(-1.0, 1.0, DIM, device=rows.device)
    return (((rows * head).sum(-1) - 0.25) ** 2).sum()


def _server_rows(client: PSClient, name: str, vocabulary: np.ndarray) -> np.ndarray:
    return client.pull_rows(name, vocabulary)


def _versions(client: PSClient, name: str) -> list[int]:
    return [shard.variables[name]["version"] for shard in client.describe()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["hash", "dense"])
def test_training_matches_torch_embedding_with_sgd(client, kind, device):
    module, vocabulary, initial = _table(client, kind)
    reference, optimizer = _reference(initial, device)
    for batch in BATCHES:
        positions = torch.tensor(batch, device=device)
        rows = module(torch.from_numpy(vocabulary[np.array(batch)]).to(device))
        assert rows.shape == (*positions.shape, DIM) and rows.device == positions.device and rows.requires_grad
        torch.testing.assert_close(rows, reference(positions), rtol=0, atol=0)
        _loss(rows).backward()  # pushes this batch's row gradients
        optimizer.zero_grad()
        _loss(reference(positions)).backward()
        optimizer.step()
    np.testing.assert_array_equal(_server_rows(client, module.name, vocabulary),
                                  reference.weight.detach().cpu().numpy())


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_holds_row_gradients_until_taken_and_pushes_them_once(client, device):
    module, vocabulary, initial = _table(client, "hash")
    reference, optimizer = _reference(initial, device)
    before = _versions(client, module.name)
    optimizer.zero_grad()
    begin_step(module)
    for batch in (BATCHES[0], BATCHES[2]):  # two passes in one step, sharing ids: their gradients add up
        _loss(module(torch.from_numpy(vocabulary[np.array(batch)]).to(device))).backward()
        _loss(reference(torch.tensor(batch, device=device))).backward()
    assert _versions(client, module.name) == before, "a step's row gradients were pushed before its end"
    np.testing.assert_array_equal(_server_rows(client, module.name, vocabulary), initial)

    taken = module.take_row_gradients()
    ids, grads = taken[module.name]
    assert ids.dtype == np.int64 and np.array_equal(ids, np.unique(ids))
    touched = np.flatnonzero(reference.weight.grad.abs().sum(1).cpu().numpy())
    np.testing.assert_array_equal(np.sort(ids), np.sort(vocabulary[touched]))
    order = {int(v): i for i, v in enumerate(vocabulary)}
    expected = reference.weight.grad.cpu()[[order[int(i)] for i in ids]]
    torch.testing.assert_close(grads.cpu(), expected, rtol=0, atol=0)
    assert module.take_row_gradients() == {}, "take_row_gradients must clear what it returned"

    with client.step([]) as step:
        step.push({}, rows=taken)
    optimizer.step()
    np.testing.assert_array_equal(_server_rows(client, module.name, vocabulary),
                                  reference.weight.detach().cpu().numpy())

    # Holding ended with the take: the next backward pushes by itself.
    optimizer.zero_grad()
    _loss(module(torch.from_numpy(vocabulary[np.array(BATCHES[1])]).to(device))).backward()
    _loss(reference(torch.tensor(BATCHES[1], device=device))).backward()
    optimizer.step()
    np.testing.assert_array_equal(_server_rows(client, module.name, vocabulary),
                                  reference.weight.detach().cpu().numpy())


def _spy(client: PSClient, method: str, calls: list, monkeypatch) -> None:
    """Record ``method``'s arguments as numpy arrays; the real call still runs."""
    real = getattr(client, method)

    def recorded(name, *arrays, **options):
        calls.append((method, *(a.cpu().numpy() if isinstance(a, torch.Tensor) else np.array(a) for a in arrays)))
        return real(name, *arrays, **options)

    monkeypatch.setattr(client, method, recorded)


def test_repeated_ids_are_pulled_once_and_their_gradients_pushed_once_summed(client, monkeypatch):
    module, _, _ = _table(client, "dense")
    calls: list[tuple] = []
    _spy(client, "pull_rows", calls, monkeypatch)
    _spy(client, "push_rows", calls, monkeypatch)
    module(torch.tensor([[3, 1, 3], [3, 1, 0]])).sum().backward()
    assert [call[0] for call in calls] == ["pull_rows", "push_rows"]
    (_, pulled_ids), (_, pushed_ids, pushed_grads) = calls
    np.testing.assert_array_equal(pulled_ids, [0, 1, 3])
    np.testing.assert_array_equal(pushed_ids, [0, 1, 3])
    np.testing.assert_array_equal(pushed_grads, np.repeat([[1.0], [2.0], [3.0]], DIM, axis=1))


def test_a_models_tables_are_taken_together_and_a_shared_table_is_summed(client):
    name = _name()
    shared_a, vocabulary, _ = _table(client, "hash", name)
    shared_b = PSEmbedding(client, name, DIM, optimizer=SGD(LEARNING_RATE))  # the same table again
    other, _, _ = _table(client, "dense")
    model = torch.nn.ModuleDict({"a": shared_a, "b": shared_b, "other": other})
    begin_step(model)
    ids = torch.from_numpy(vocabulary[[0, 1, 1]])
    (shared_a(ids).sum() + 2 * shared_b(ids).sum() + other(torch.tensor([0, 6])).sum()).backward()
    taken = take_row_gradients(model)
    assert sorted(taken) == sorted([name, other.name])
    table_ids, grads = taken[name]
    assert sorted(table_ids.tolist()) == sorted(vocabulary[[0, 1]].tolist())
    counts = {int(vocabulary[0]): 1, int(vocabulary[1]): 2}
    for row, table_id in zip(grads, table_ids):
        torch.testing.assert_close(row, torch.full((DIM,), 3.0 * counts[int(table_id)]), rtol=0, atol=0)
    assert take_row_gradients(model) == {}


def test_replica_group_merges_two_cpu_replicas_into_one_push(client):
    name = _name()
    replicas = [PSEmbedding(client, name, DIM, optimizer=SGD(LEARNING_RATE)) for _ in range(2)]
    vocabulary = HASH_VOCABULARY
    reference, optimizer = _reference(client.pull_rows(name, vocabulary), "cpu")
    group = ReplicaGroup(client, devices=["cpu", "cpu"], reduce="sum")
    for batch in BATCHES:
        versions = _versions(client, name)
        with group.step([]) as step:
            for model in replicas:
                begin_step(model)
            for model, half in zip(replicas, batch):  # each replica gets one row of the batch
                _loss(model(torch.from_numpy(vocabulary[np.array(half)]))).backward()
            assert _versions(client, name) == versions
            step.push([{}, {}], rows=[take_row_gradients(model) for model in replicas])
        optimizer.zero_grad()
        _loss(reference(torch.tensor(batch))).backward()
        optimizer.step()
        np.testing.assert_array_equal(_server_rows(client, name, vocabulary),
                                      reference.weight.detach().numpy())


def test_bad_input_is_refused_with_a_typed_error_and_nothing_is_pushed(client):
    hashed, vocabulary, _ = _table(client, "hash")
    dense, _, initial = _table(client, "dense")
    hashed(torch.from_numpy(vocabulary))  # every row exists, so versions can only move by a push
    versions = {m.name: _versions(client, m.name) for m in (hashed, dense)}
    with pytest.raises(InvalidArgumentError, match="integer tensor"):
        hashed(torch.tensor([1.0, 2.0], requires_grad=True))
    with pytest.raises(InvalidArgumentError, match="outside"):
        dense(torch.tensor([[0, len(initial)]]))
    with pytest.raises(InvalidArgumentError, match="outside"):
        dense(torch.tensor([-1]))
    with pytest.raises(TypeError, match="torch tensor"):
        dense(np.array([0, 1]))
    with pytest.raises(VariableConflictError):
        PSEmbedding(client, dense.name, DIM + 1, num_embeddings=len(initial), optimizer=SGD(LEARNING_RATE))
    with pytest.raises(ValueError, match="hash table"):
        PSEmbedding(client, _name(), DIM, initializer=initial)
    empty = dense(torch.zeros((0, 3), dtype=torch.long))
    assert empty.shape == (0, 3, DIM)
    empty.sum().backward()  # no rows: nothing to push
    assert {m.name: _versions(client, m.name) for m in (hashed, dense)} == versions
    np.testing.assert_array_equal(client.pull([dense.name])[dense.name], initial)


def test_the_core_package_loads_without_torch():
    """torch is an optional extra: only worker_client.torch may import it."""
    import subprocess
    import sys

    from ps_testing import ROOT, child_env

    script = "import sys, worker_client, worker_client.admin; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                            env=child_env(), timeout=120, check=True)
    assert result.stdout.strip() == "False", result.stdout + result.stderr


class _Recommender(torch.nn.Module):
    """A dense layer beside a hash table and a dense table built without optimizers of their own."""

    def __init__(self, client: PSClient, names: tuple[str, str], optimizer=None) -> None:
        super().__init__()
        self.users = PSEmbedding(client, names[0], DIM, optimizer=optimizer)
        self.items = PSEmbedding(client, names[1], DIM, num_embeddings=50)
        self.out = torch.nn.Linear(DIM, 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return self.out(self.users(users) * self.items(items)).squeeze(-1)


def test_a_table_without_an_optimizer_refuses_to_train_and_makes_nothing(client):
    names = (_name(), _name())
    model = _Recommender(client, names)
    from worker_client.torch import EmbeddingOptimizerError

    with pytest.raises(EmbeddingOptimizerError, match="no optimizer.*attach"):
        model(torch.tensor([1, 2]), torch.tensor([3, 4]))
    assert not set(names) & set(client.variables(refresh=True))  # no table with a silent default
    with pytest.raises(TypeError, match="wehub optimizer"):
        PSEmbedding(client, _name(), DIM, optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0))


@pytest.mark.parametrize("given", ["torch", "wehub"])
def test_attach_gives_tables_without_an_optimizer_its_own_and_they_train_with_it(client, given):
    from worker_client import Adagrad
    from worker_client.torch import attach

    names = (_name(), _name())
    model = _Recommender(client, names, optimizer=SGD(0.5))  # the hash table keeps the one it was given
    optimizer = (torch.optim.Adagrad(model.parameters(), lr=0.05) if given == "torch"
                 else Adagrad(learning_rate=0.05, initial_accumulator_value=0.0, epsilon=1e-10))
    ps_model = attach(client, model, prefix=f"rec-{uuid.uuid4().hex[:6]}", optimizer=optimizer)
    known = client.variables(refresh=True)
    assert known[names[0]].spec.optimizer == SGD(0.5)
    assert known[names[1]].spec.optimizer == Adagrad(learning_rate=0.05, initial_accumulator_value=0.0,
                                                      epsilon=1e-10)
    items = torch.tensor([3, 3, 7])
    before = client.pull_rows(names[1], items.numpy())
    with ps_model.step():
        model(torch.tensor([1, 2, 1]), items).sum().backward()
    after = client.pull_rows(names[1], items.numpy())
    # Adagrad's first step moves every touched element by lr * g / (|g| + eps): 0.05, whatever g.
    moved = np.abs(after - before)
    np.testing.assert_allclose(moved[moved > 0], 0.05, rtol=1e-4)
    assert (moved > 0).any()


def test_eval_mode_reads_rows_without_creating_them(client):
    module = PSEmbedding(client, _name(), DIM, optimizer=SGD(LEARNING_RATE))
    module(torch.tensor([1, 2]))  # training: rows 1 and 2 exist now
    rows_before = [info.variables[module.name]["num_rows"] for info in client.describe()]
    module.eval()
    with torch.no_grad():
        served = module(torch.tensor([1, 2, 2**40, 77]))
    assert [info.variables[module.name]["num_rows"] for info in client.describe()] == rows_before
    np.testing.assert_array_equal(served.numpy(), client.lookup_rows(module.name, [1, 2, 2**40, 77]))
    module.train()
    np.testing.assert_array_equal(module(torch.tensor([2**40])).detach().numpy(), served[2:3].numpy())
    assert sum(info.variables[module.name]["num_rows"] for info in client.describe()) == sum(rows_before) + 1


@pytest.mark.parametrize("missing", ["initializer", "zeros"])
def test_an_exported_hash_table_answers_unseen_ids_as_the_cluster_does(client, missing):
    from worker_client.torch import ExportedEmbedding

    module = PSEmbedding(client, _name(), DIM, optimizer=SGD(LEARNING_RATE), padding_idx=-1)
    module(torch.tensor([5, 6, 7])).sum().backward()  # rows 5..7 trained
    ids, rows = client.export_rows(module.name)
    initializer = client.variables()[module.name].spec.initializer
    exported = ExportedEmbedding(torch.from_numpy(ids), torch.from_numpy(rows).reshape(len(ids), DIM),
                                 initializer=initializer, missing=missing, padding_idx=-1)
    query = torch.tensor([[5, 2**50, -1], [7, 7, 3]])
    expected = client.lookup_rows(module.name, query.reshape(-1).numpy(), missing=missing).reshape(2, 3, DIM)
    expected[0, 2] = 0  # the padding id
    np.testing.assert_array_equal(exported(query).numpy(), expected)
    with pytest.raises(ValueError, match="needs the table's initializer"):
        ExportedEmbedding(torch.from_numpy(ids), torch.from_numpy(rows), missing="initializer")


def test_a_hash_table_module_takes_admission_and_expiry(client):
    from worker_client import Admission, Expiry

    name = _name()
    module = PSEmbedding(client, name, DIM, optimizer=SGD(LEARNING_RATE), admission=Admission(min_count=2),
                         expiry=Expiry(steps=1000))
    spec = client.variables()[name].spec
    assert (spec.admission, spec.expiry) == (Admission(min_count=2), Expiry(steps=1000))
    ids = torch.tensor([5, 9, 5])
    first = module(ids)  # the first sighting: initial values, no row yet
    assert sum(info.variables[name]["num_rows"] for info in client.describe()) == 0
    second = module(ids)  # the second admits both ids: rows made from the same initial values
    assert torch.equal(first, second)
    assert sum(info.variables[name]["num_rows"] for info in client.describe()) == 2
    with pytest.raises(ValueError, match="hash tables"):
        PSEmbedding(client, _name(), DIM, num_embeddings=10, expiry=Expiry(steps=3))
