"""PSEmbedding: a torch embedding layer whose table lives on the ps-servers.

The rows of a recommender's embedding table are too many for a worker, so
forward pulls only the rows of the batch's ids and backward sends only
their gradients; the server-side optimizer updates those rows.

    user = PSEmbedding(client, "user", embedding_dim=16, optimizer=Adagrad(0.05))  # a hash table
    item = PSEmbedding(client, "item", 16, num_embeddings=10_000)  # a dense table; attach() gives its optimizer
    scores = (user(user_ids) * item(item_ids)).sum(-1)

Outside a step, backward pushes the rows' gradients at once (``push_rows``).

Inside a step the gradients are held and pushed with the step's dense
gradients in one push (synchronous mode needs a step's gradients in one
push). The protocol, for whatever drives the step (the attach() step, or
code of one's own):

1. at the step's start, call ``begin_step()`` on every submodule that has it
   (or :func:`begin_step` on the model): backward then holds the row
   gradients, summed over repeated ids and over every forward/backward of
   the step;
2. at the step's end, call ``take_row_gradients()`` (or
   :func:`take_row_gradients` on the model): it returns
   ``{table: (ids, grads)}`` (int64 numpy ids, unique; grads a tensor on the
   ids' device), clears them and stops holding; push them as ``rows=``.
   A step that fails takes them too and drops them, as a failed step
   pushes nothing.

Several GPUs per worker (worker_client.replicas): one model replica per
device, each with its own PSEmbedding modules; each replica's row gradients
go to ``ReplicaStep.push`` as its entry of ``rows``, which merges them
(``ReplicaGroup.merge_rows``) into one push:

    with group.step(dense_names) as step:
        for model in replicas:
            begin_step(model)
        ...  # each replica's forward and backward on its device
        step.push(dense_grads, rows=[take_row_gradients(model) for model in replicas])

CUDA ids: rows are pulled onto the ids' device (``pull_rows(device=)``) and
gradients leave through DLPack; both need CuPy (the ``gpu`` extra).
"""

from __future__ import annotations

import threading
from typing import Any, get_args

import numpy as np
import torch
import torch.nn.functional as F

from wehub_ps.kernels.groups import group_ids
from wehub_ps.placement import Partitioner
from wehub_ps.specs import Admission, DiskTier, Expiry, Normal, Optimizer
from worker_client.client import PSClient
from worker_client.errors import InvalidArgumentError

__all__ = ["EmbeddingOptimizerError", "PSEmbedding", "batch_rows", "begin_step", "take_row_gradients"]

_TABLE_DTYPES = ("float16", "float32", "float64")  # those numpy and torch share
_ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


class EmbeddingOptimizerError(InvalidArgumentError):
    """A PSEmbedding was used before it had an optimizer (none given to it, and not attached)."""


class PSEmbedding(torch.nn.Module):
    """``nn.Embedding`` over a table on the ps-servers; it has no local parameters.

    ``num_embeddings=None`` makes a hash table (``create_embedding``: any int64
    id, rows created on first touch); an int makes a dense table
    ``(num_embeddings, embedding_dim)`` (``create_variable``, ids in
    ``[0, num_embeddings)``). Either is created idempotently: the first worker
    creates it, the others get the same table (a different spec raises
    VariableConflictError). ``initializer`` defaults to torch's N(0, 1);
    a dense table also takes an array (or tensor) of initial values.

    In eval mode (``module.eval()``) rows are read only: a hash table's
    missing row gives its initializer's value and is not created.

    ``padding_idx``, as torch's: that id's positions give zeros and no
    gradient; it is never pulled or pushed (a dense table's may be negative,
    counted from the end, as in torch).

    ``optimizer`` runs on the servers for this table. Without one, the table
    is made when ``attach()`` maps its optimizer (a torch optimizer's
    constructor settings, or the wehub optimizer given); a forward before
    that raises EmbeddingOptimizerError. There is no default optimizer.
    """

    def __init__(self, client: PSClient, name: str, embedding_dim: int, num_embeddings: int | None = None, *,
                 dtype: str = "float32", initializer: Any = None, optimizer: Optimizer | None = None,
                 aggregation: str = "mean", partitioner: Partitioner | None = None, max_rows: int = 0,
                 eviction: str = "none", padding_idx: int | None = None, admission: Admission | None = None,
                 expiry: Expiry | None = None, tier: DiskTier | None = None) -> None:
        super().__init__()
        if isinstance(embedding_dim, bool) or not isinstance(embedding_dim, int) or embedding_dim < 1:
            raise ValueError(f"embedding_dim must be a positive int, got {embedding_dim!r}")
        if str(dtype) not in _TABLE_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_TABLE_DTYPES)}, got {dtype!r}")
        if initializer is None:
            initializer = Normal(0.0, 1.0)
        elif isinstance(initializer, torch.Tensor):
            initializer = initializer.detach().cpu().numpy()
        if num_embeddings is None:
            if partitioner is not None or isinstance(initializer, np.ndarray):
                raise ValueError("a hash table (num_embeddings=None) takes no partitioner and no array of "
                                 "initial values: give num_embeddings for a dense table")
        elif max_rows or eviction != "none" or admission or expiry or tier:
            raise ValueError("max_rows, eviction, admission, expiry and tier apply to hash tables: pass "
                             "num_embeddings=None for one")
        if optimizer is not None and not isinstance(optimizer, get_args(Optimizer)):
            raise TypeError(f"optimizer must be a wehub optimizer (SGD, Momentum, Adagrad, Adam) or None, got "
                            f"{type(optimizer).__name__}; a torch.optim optimizer is mapped by attach()")
        # The table is made with its optimizer: now when given, else by attach()'s (use_optimizer).
        self._table_settings = {"dtype": dtype, "initializer": initializer, "aggregation": aggregation,
                                    "partitioner": partitioner, "max_rows": max_rows, "eviction": eviction,
                                    "admission": admission, "expiry": expiry, "tier": tier}
        self.optimizer: Optimizer | None = None
        self.client = client
        self.name = name
        self.embedding_dim = embedding_dim
        self.num_embeddings = num_embeddings
        self.dtype = str(dtype)
        self.padding_idx = _padding_index(padding_idx, num_embeddings)
        # Guards _held: backward of CUDA tensors runs on autograd's device threads.
        self._lock = threading.Lock()
        self._held: list[tuple[np.ndarray, torch.Tensor]] | None = None
        if optimizer is not None:
            self.use_optimizer(optimizer)

    @property
    def needs_optimizer(self) -> bool:
        """True until the table exists: made with the optimizer given here, or by attach()'s."""
        return self.optimizer is None

    def use_optimizer(self, optimizer: Optimizer) -> None:
        """Make the table (idempotently, as every worker does) with ``optimizer`` on the servers.

        attach() calls it for a module built without ``optimizer=``; a module
        whose table exists keeps the optimizer it was made with.
        """
        if self.optimizer is not None:
            return
        settings = self._table_settings
        if self.num_embeddings is None:
            self.client.create_embedding(self.name, self.embedding_dim, settings["dtype"], settings["initializer"],
                                         optimizer, settings["max_rows"], settings["eviction"],
                                         settings["aggregation"], settings["admission"], settings["expiry"],
                                         settings["tier"])
        else:
            self.client.create_variable(self.name, (self.num_embeddings, self.embedding_dim), settings["dtype"],
                                        settings["initializer"], optimizer, settings["partitioner"],
                                        settings["aggregation"])
        self.optimizer = optimizer

    def extra_repr(self) -> str:
        kind = "hash table" if self.num_embeddings is None else f"num_embeddings={self.num_embeddings}"
        return f"{self.name!r}, embedding_dim={self.embedding_dim}, {kind}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` (any shape), shape ``ids.shape + (embedding_dim,)``, on ids' device."""
        weight, positions, padding = self._lookup(ids)
        out = F.embedding(positions, weight, padding_idx=padding)
        return out.reshape(*ids.shape, self.embedding_dim)

    def _lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """(weight, positions, padding slot): the batch's unique rows, pulled once, as a leaf tensor whose
        gradient goes to the table; where each id's row is in it; the index of a zero row for padding ids.

        Forward runs torch's own embedding functions on ``weight``, so the gradients are what torch's
        modules compute, summed over repeated ids by torch; a hook on ``weight`` delivers them per unique id.
        """
        if self.optimizer is None:
            raise EmbeddingOptimizerError(
                f"{type(self).__name__} {self.name!r} has no optimizer, so its table was not made: pass "
                "optimizer= (worker_client.SGD, Momentum, Adagrad or Adam) to it, or attach(client, model, "
                "optimizer=...) the model that holds it before its first forward")
        unique, positions, padding = batch_rows(self._host_ids(ids), self.padding_idx)
        rows = self._pull(unique, ids.device)
        if padding is not None:
            rows = torch.cat([rows, rows.new_zeros((1, self.embedding_dim))])
        weight = rows.detach().requires_grad_()
        count = len(unique)
        weight.register_hook(lambda grad: self._deliver(unique, grad[:count].detach()))
        return weight, torch.from_numpy(positions).to(ids.device), padding

    def _host_ids(self, ids: Any) -> np.ndarray:
        """The ids as flat int64 on the host; InvalidArgumentError before anything is pulled or pushed."""
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"PSEmbedding {self.name!r}: ids must be a torch tensor, got {type(ids).__name__}")
        if ids.dtype not in _ID_DTYPES:
            raise InvalidArgumentError(f"PSEmbedding {self.name!r}: ids must be an integer tensor "
                                       f"(torch.long), got {ids.dtype}; cast them with .long()")
        return ids.detach().reshape(-1).to("cpu", torch.int64).numpy()

    def _pull(self, unique: np.ndarray, device: torch.device) -> torch.Tensor:
        """The rows of ``unique``: pulled in training; in eval mode read only (PSClient.lookup_rows), so
        evaluating or serving creates no rows and leaves the LRU order to training."""
        if unique.size == 0:
            return torch.empty((0, self.embedding_dim), dtype=getattr(torch, self.dtype), device=device)
        if self.training:
            rows = self.client.pull_rows(self.name, unique, device=str(device) if device.type == "cuda" else None)
        else:
            rows = self.client.lookup_rows(self.name, unique, device=str(device) if device.type == "cuda" else None)
        return torch.from_dlpack(rows) if device.type == "cuda" else torch.from_numpy(rows)

    def _deliver(self, unique: np.ndarray, grads: torch.Tensor) -> None:
        """Backward's end: hold the gradients inside a step, else push them now."""
        if unique.size == 0:
            return
        with self._lock:
            if self._held is not None:
                self._held.append((unique, grads))
                return
        self.client.push_rows(self.name, unique, grads)

    def begin_step(self) -> None:
        """Hold row gradients from here until :meth:`take_row_gradients` (step protocol, module docstring)."""
        with self._lock:
            self._held = []

    def take_row_gradients(self) -> dict[str, tuple[np.ndarray, torch.Tensor]]:
        """The held gradients as ``{table: (unique ids, summed grads)}``, cleared; holding ends."""
        with self._lock:
            held, self._held = self._held, None
        if not held:
            return {}
        ids = np.concatenate([unique for unique, _ in held])
        grads = torch.cat([g for _, g in held])
        if len(held) > 1:
            ids, grads = _sum_by_id(ids, grads)
        return {self.name: (ids, grads)}


def batch_rows(ids: np.ndarray, padding_idx: int | None) -> tuple[np.ndarray, np.ndarray, int | None]:
    """(unique ids, positions, padding slot) of a flat batch of int64 ``ids``: the rows to fetch once
    each, where each id's row is among them, and, when ``padding_idx`` occurs, the index (one past the
    fetched rows) of the zero row its positions point to (else None)."""
    padded = None if padding_idx is None else ids == padding_idx
    if padded is not None and padded.any():
        unique, inverse = group_ids(ids[~padded])  # one hash pass: linear in the ids, not a sort
        positions = np.full(len(ids), len(unique), np.int64)
        positions[~padded] = inverse
        return unique, positions, len(unique)
    unique, positions = group_ids(ids)
    return unique, positions, None


def _padding_index(padding_idx: int | None, num_embeddings: int | None) -> int | None:
    """torch's padding_idx rule for a dense table (negative counts from the end); any id for a hash table."""
    if padding_idx is None:
        return None
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, (int, np.integer)):
        raise TypeError(f"padding_idx must be an int or None, got {padding_idx!r}")
    padding_idx = int(padding_idx)
    if num_embeddings is None:
        return padding_idx
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(f"padding_idx must be within [-{num_embeddings}, {num_embeddings}) for "
                         f"num_embeddings={num_embeddings}, got {padding_idx}")
    return padding_idx % num_embeddings


def _sum_by_id(ids: np.ndarray, grads: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    unique, inverse = group_ids(ids)
    index = torch.from_numpy(inverse.reshape(-1)).to(grads.device)
    return unique, grads.new_zeros((len(unique), grads.shape[1])).index_add_(0, index, grads)


def begin_step(model: torch.nn.Module) -> None:
    """``begin_step()`` on every submodule of ``model`` that has it (PSEmbedding and the like)."""
    for module in model.modules():
        if callable(getattr(module, "begin_step", None)):
            module.begin_step()


def take_row_gradients(model: torch.nn.Module) -> dict[str, tuple[np.ndarray, torch.Tensor]]:
    """Every submodule's held row gradients, one entry per table (modules sharing a table summed)."""
    taken: dict[str, list[tuple[np.ndarray, torch.Tensor]]] = {}
    for module in model.modules():
        if callable(getattr(module, "take_row_gradients", None)):
            for table, pair in module.take_row_gradients().items():
                taken.setdefault(table, []).append(pair)
    return {table: pairs[0] if len(pairs) == 1 else
            _sum_by_id(np.concatenate([i for i, _ in pairs]), torch.cat([g for _, g in pairs]))
            for table, pairs in taken.items()}
