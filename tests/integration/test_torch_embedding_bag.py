"""PSEmbeddingBag and PSEmbedding's padding_idx against torch's own modules: same outputs, same gradients.

Each case runs the server-side module inside a step (gradients held, not pushed) and torch's module on a
weight holding the table's values, on the same ids (repeated ids, empty bags, padding) and the same loss;
the outputs and the gradient of every touched row must agree. LARGEST records the largest difference.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from worker_client import SGD, PSClient  # noqa: E402
from worker_client.torch import PSEmbedding, PSEmbeddingBag  # noqa: E402

DIM, ROWS = 8, 40
#: Hash-table ids for reference rows 0..ROWS-1: any int64.
HASH_IDS = np.concatenate([np.array([2**40 + 1, -(2**63), 2**62, -5], np.int64), np.arange(100, 100 + ROWS - 4)])
LARGEST: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def report_largest():
    """After the module: the largest difference per case (run with -s to see it)."""
    yield
    if LARGEST:
        print("largest |ours - torch| per case:", {k: f"{v:.2e}" for k, v in sorted(LARGEST.items())})


@pytest.fixture
def client(module_cluster2):
    with PSClient(module_cluster2.addresses) as client:
        yield client


def _module(client: PSClient, kind: str, cls=PSEmbeddingBag, **options):
    """The module under test and the reference weight (its table's values, row i = reference id i)."""
    name = f"bag-{uuid.uuid4().hex[:8]}"
    if kind == "dense":
        initial = np.random.default_rng(5).normal(size=(ROWS, DIM)).astype(np.float32)
        module = cls(client, name, DIM, num_embeddings=ROWS, initializer=initial, optimizer=SGD(0.1), **options)
    else:
        module = cls(client, name, DIM, optimizer=SGD(0.1), **options)
        initial = client.pull_rows(name, HASH_IDS)  # rows made now, with the initializer's values
    return module, torch.tensor(initial, requires_grad=True)


def _ids(kind: str, positions: torch.Tensor) -> torch.Tensor:
    return positions if kind == "dense" else torch.from_numpy(HASH_IDS[positions.numpy()])


def _compare(case: str, kind: str, module, reference_out: torch.Tensor, ours_out: torch.Tensor,
             weight: torch.Tensor) -> None:
    """Same outputs; the held row gradients are the reference weight's gradient, row for row."""
    torch.testing.assert_close(ours_out, reference_out, rtol=1e-6, atol=1e-6)
    (ids, grads), = module.take_row_gradients().values()
    positions = ids if kind == "dense" else np.searchsorted(HASH_IDS, ids, sorter=np.argsort(HASH_IDS))
    positions = positions if kind == "dense" else np.argsort(HASH_IDS)[positions]
    expected = weight.grad.numpy()
    difference = float(np.abs(grads.numpy() - expected[positions]).max(initial=0.0))
    LARGEST[f"{case}/{kind}"] = max(LARGEST.get(f"{case}/{kind}", 0.0), difference)
    assert difference <= 1e-5, f"{case}: gradients differ by {difference}"
    untouched = np.setdiff1d(np.arange(ROWS), positions)
    assert not expected[untouched].any(), f"{case}: torch has gradient on rows the module did not push"


def _run(module, weight, reference, kind, case, ids, offsets=None, psw=None):
    module.begin_step()
    ours = module(_ids(kind, ids), *(() if offsets is None else (offsets,)),
                  **({} if psw is None else {"per_sample_weights": psw}))
    out_grad = torch.from_numpy(np.random.default_rng(9).normal(size=tuple(ours.shape)).astype(np.float32))
    (ours * out_grad).sum().backward()
    theirs = reference(ids, offsets, per_sample_weights=None if psw is None else psw.detach())
    (theirs * out_grad).sum().backward()
    _compare(case, kind, module, theirs, ours, weight)


@pytest.mark.parametrize("kind", ["dense", "hash"])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_bags_of_a_2d_input_with_repeated_ids(client, kind, mode):
    module, weight = _module(client, kind, mode=mode)
    reference = lambda ids, offsets, per_sample_weights: torch.nn.functional.embedding_bag(  # noqa: E731
        ids, weight, offsets, mode=mode, per_sample_weights=per_sample_weights)
    ids = torch.tensor([[0, 3, 3, 7], [7, 7, 7, 7], [1, 2, 0, 3]])  # repeats within and across bags
    _run(module, weight, reference, kind, f"2d-{mode}", ids)


@pytest.mark.parametrize("kind", ["dense", "hash"])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_bags_by_offsets_with_an_empty_bag_and_padding(client, kind, mode, include_last_offset):
    module, weight = _module(client, kind, mode=mode, include_last_offset=include_last_offset, padding_idx=None)
    ids = torch.tensor([5, 5, 9, 1, 5, 2, 2, 2, 30])
    offsets = torch.tensor([0, 3, 3, 6] + ([9] if include_last_offset else []))  # bag 1 is empty
    bag = torch.nn.EmbeddingBag.from_pretrained(weight.detach().clone(), freeze=False, mode=mode,
                                                include_last_offset=include_last_offset)
    reference_weight = bag.weight
    module.begin_step()
    ours = module(_ids(kind, ids), offsets)
    out_grad = torch.from_numpy(np.random.default_rng(4).normal(size=tuple(ours.shape)).astype(np.float32))
    (ours * out_grad).sum().backward()
    (bag(ids, offsets) * out_grad).sum().backward()
    _compare(f"offsets-{mode}-{include_last_offset}", kind, module, bag(ids, offsets), ours, reference_weight)
    assert not ours[1].any()  # the empty bag


@pytest.mark.parametrize("kind", ["dense", "hash"])
def test_per_sample_weights_and_their_gradient(client, kind):
    module, weight = _module(client, kind, mode="sum")
    ids = torch.tensor([4, 4, 11, 0, 4, 6])
    offsets = torch.tensor([0, 2, 5])
    psw = torch.tensor([0.5, -1.0, 2.0, 0.25, 1.5, 3.0], requires_grad=True)
    reference_psw = psw.detach().clone().requires_grad_()
    module.begin_step()
    ours = module(_ids(kind, ids), offsets, per_sample_weights=psw)
    out_grad = torch.from_numpy(np.random.default_rng(2).normal(size=tuple(ours.shape)).astype(np.float32))
    (ours * out_grad).sum().backward()
    theirs = torch.nn.functional.embedding_bag(ids, weight, offsets, mode="sum", per_sample_weights=reference_psw)
    (theirs * out_grad).sum().backward()
    _compare("per-sample-weights", kind, module, theirs, ours, weight)
    torch.testing.assert_close(psw.grad, reference_psw.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["dense", "hash"])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_padding_entries_leave_the_bag_and_are_never_pushed(client, kind, mode):
    pad = 3
    module, weight = _module(client, kind, mode=mode,
                             padding_idx=pad if kind == "dense" else int(HASH_IDS[pad]))
    ids = torch.tensor([[3, 1, 3, 1], [3, 3, 3, 3], [0, 3, 2, 2]])  # bag 1 is all padding
    reference = torch.nn.EmbeddingBag.from_pretrained(weight.detach().clone(), freeze=False, mode=mode,
                                                      padding_idx=pad)
    module.begin_step()
    ours = module(_ids(kind, ids))
    out_grad = torch.from_numpy(np.random.default_rng(6).normal(size=tuple(ours.shape)).astype(np.float32))
    (ours * out_grad).sum().backward()
    theirs = reference(ids)
    (theirs * out_grad).sum().backward()
    _compare(f"padding-{mode}", kind, module, theirs, ours, reference.weight)
    assert not ours[1].any()


@pytest.mark.parametrize("kind", ["dense", "hash"])
def test_an_embeddings_padding_gives_zeros_and_no_gradient(client, kind):
    pad = 2
    module, weight = _module(client, kind, cls=PSEmbedding, padding_idx=pad if kind == "dense" else int(HASH_IDS[pad]))
    reference_weight = weight.detach().clone()
    reference_weight[pad] = 0  # torch's padding row, as nn.Embedding initialises it
    reference = torch.nn.Embedding.from_pretrained(reference_weight, freeze=False, padding_idx=pad)
    ids = torch.tensor([[2, 0, 2], [5, 5, 2]])
    module.begin_step()
    ours = module(_ids(kind, ids))
    out_grad = torch.from_numpy(np.random.default_rng(8).normal(size=tuple(ours.shape)).astype(np.float32))
    (ours * out_grad).sum().backward()
    theirs = reference(ids)
    (theirs * out_grad).sum().backward()
    _compare("embedding-padding", kind, module, theirs, ours, reference.weight)


def test_a_trained_bag_moves_the_table_by_its_gradient(client):
    """Outside a step, backward pushes at once and the servers apply SGD to the touched rows only."""
    module, weight = _module(client, "dense", mode="mean")
    ids, offsets = torch.tensor([1, 1, 4, 6]), torch.tensor([0, 3])
    module(ids, offsets).sum().backward()
    bag = torch.nn.EmbeddingBag.from_pretrained(weight.detach().clone(), freeze=False, mode="mean")
    bag(ids, offsets).sum().backward()
    expected = weight.detach().numpy() - 0.1 * bag.weight.grad.numpy()
    np.testing.assert_allclose(client.pull([module.name])[module.name], expected, rtol=1e-6, atol=1e-7)


def test_arguments_torch_refuses_are_refused(client):
    module, _ = _module(client, "dense", mode="max")
    with pytest.raises(ValueError, match="per_sample_weights need mode='sum'"):
        module(torch.tensor([[1, 2]]), per_sample_weights=torch.ones(1, 2))
    with pytest.raises(ValueError, match="needs offsets"):
        module(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="give no offsets"):
        module(torch.tensor([[1, 2]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="mode must be"):
        PSEmbeddingBag(client, "x", DIM, num_embeddings=4, mode="median", optimizer=SGD(0.1))
    with pytest.raises(ValueError, match="padding_idx must be within"):
        PSEmbeddingBag(client, "x", DIM, num_embeddings=4, padding_idx=4, optimizer=SGD(0.1))
