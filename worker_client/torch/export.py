"""Leaving for serving: a trained model's values, and a plain torch model that needs no ps-server.

:func:`state_dict` reads everything an attached model trained: each dense
parameter by its variable name, and for each table ``<table>.ids`` (int64)
and ``<table>.rows``, all tensors, as ``torch.save`` and
``safetensors.torch.save_file`` take them. It only reads (the tables'
ExportRows, PSClient.export_rows).

:func:`plain_model` builds a copy of the model with those values and no
client: a dense table's module becomes torch's own ``nn.Embedding`` /
``nn.EmbeddingBag`` holding its rows; a hash table's an
:class:`ExportedEmbedding` / :class:`ExportedEmbeddingBag`, which looks ids
up in the exported ids. An id the table never made a row for gets its
initializer's value (what the servers' read-only lookup answers, and what
the row would have started from) or, with ``missing="zeros"``, zeros. Its
outputs are the attached model's in eval mode, on any data, with no
ps-server running.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from wehub_ps.initializers import fill_rows
from wehub_ps.specs import Initializer
from worker_client.torch.embedding import PSEmbedding, batch_rows
from worker_client.torch.embedding_bag import PSEmbeddingBag

__all__ = ["ExportedEmbedding", "ExportedEmbeddingBag", "plain_model", "state_dict"]

_MISSING = ("initializer", "zeros")


def _tables(model: torch.nn.Module) -> list[PSEmbedding]:
    return [m for m in model.modules() if isinstance(m, PSEmbedding)]


def state_dict(ps_model: Any) -> dict[str, torch.Tensor]:
    """Every trained value of ``ps_model`` (an attached model, worker_client.torch.attach), read only."""
    client = ps_model.client
    out = {name: torch.from_numpy(np.ascontiguousarray(value))
           for name, value in client.pull(list(ps_model.parameters)).items()} if ps_model.parameters else {}
    for module in _tables(ps_model.model):
        if f"{module.name}.ids" in out:
            continue  # two modules over one table
        ids, rows = client.export_rows(module.name)
        out[f"{module.name}.ids"] = torch.from_numpy(np.ascontiguousarray(ids))
        out[f"{module.name}.rows"] = torch.from_numpy(np.ascontiguousarray(rows)).reshape(len(ids), -1)
    return out


class ExportedEmbedding(torch.nn.Module):
    """A hash table's exported rows as an embedding: ids found among the exported ones (any int64).

    ``ids`` sorted; ``initializer``: the table's, for ids without a row
    (``missing="initializer"``); ``padding_idx`` as PSEmbedding's.
    """

    def __init__(self, ids: torch.Tensor, rows: torch.Tensor, *, initializer: Initializer | None = None,
                 missing: str = "initializer", padding_idx: int | None = None) -> None:
        super().__init__()
        if missing not in _MISSING:
            raise ValueError(f"missing must be 'initializer' or 'zeros', got {missing!r}")
        if missing == "initializer" and initializer is None:
            raise ValueError("missing='initializer' needs the table's initializer")
        order = torch.argsort(ids)
        self.register_buffer("ids", ids[order].to(torch.int64).contiguous())
        self.register_buffer("rows", rows[order].contiguous())
        self.embedding_dim = rows.shape[1]
        self.initializer = initializer
        self.missing = missing
        self.padding_idx = padding_idx

    def _lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """(weight, positions, padding slot) as PSEmbedding's, from the exported rows."""
        host = ids.detach().reshape(-1).to("cpu", torch.int64).numpy()
        unique, positions, padding = batch_rows(host, self.padding_idx)
        wanted = torch.from_numpy(unique)
        at = torch.searchsorted(self.ids, wanted).clamp(max=max(len(self.ids) - 1, 0))
        found = (self.ids[at] == wanted) if len(self.ids) else torch.zeros(len(unique), dtype=torch.bool)
        weight = torch.zeros((len(unique) + (padding is not None), self.embedding_dim), dtype=self.rows.dtype)
        weight[:len(unique)][found] = self.rows[at[found]]
        unseen = np.flatnonzero(~found.numpy())
        if unseen.size and self.missing == "initializer":
            values = np.empty((unseen.size, self.embedding_dim), np.float64)
            fill_rows(self.initializer, (self.embedding_dim,), unique[unseen], values)
            weight[torch.from_numpy(unseen)] = torch.from_numpy(values).to(self.rows.dtype)
        return weight.to(ids.device), torch.from_numpy(positions).to(ids.device), padding

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        weight, positions, padding = self._lookup(ids)
        return F.embedding(positions, weight, padding_idx=padding).reshape(*ids.shape, self.embedding_dim)


class ExportedEmbeddingBag(ExportedEmbedding):
    """:class:`ExportedEmbedding` pooled as PSEmbeddingBag (``mode``, ``include_last_offset``)."""

    def __init__(self, ids: torch.Tensor, rows: torch.Tensor, *, mode: str = "mean",
                 include_last_offset: bool = False, **options: Any) -> None:
        super().__init__(ids, rows, **options)
        self.mode = mode
        self.include_last_offset = include_last_offset

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,  # noqa: A002 - torch's name
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        weight, positions, padding = self._lookup(input)
        if offsets is not None:
            offsets = offsets.to(device=positions.device, dtype=torch.long)
        return F.embedding_bag(positions.reshape(input.shape), weight, offsets, mode=self.mode,
                               per_sample_weights=per_sample_weights, include_last_offset=self.include_last_offset,
                               padding_idx=padding)


def _plain_table(module: PSEmbedding, state: dict[str, torch.Tensor], missing: str) -> torch.nn.Module:
    """The plain module standing in for ``module`` (see the module docstring)."""
    ids, rows = state[f"{module.name}.ids"], state[f"{module.name}.rows"].reshape(-1, module.embedding_dim)
    bag = isinstance(module, PSEmbeddingBag)
    if module.num_embeddings is not None:  # a dense table: torch's own module over all its rows
        weight = rows.clone()
        if module.padding_idx is not None:
            weight[module.padding_idx] = 0  # PSEmbedding's padding gives zeros, as torch's initial padding row
        if bag:
            return torch.nn.EmbeddingBag.from_pretrained(weight, freeze=True, mode=module.mode,
                                                         include_last_offset=module.include_last_offset,
                                                         padding_idx=module.padding_idx)
        return torch.nn.Embedding.from_pretrained(weight, freeze=True, padding_idx=module.padding_idx)
    options = {"initializer": module.client.variables()[module.name].spec.initializer, "missing": missing,
                   "padding_idx": module.padding_idx}
    if bag:
        return ExportedEmbeddingBag(ids, rows, mode=module.mode, include_last_offset=module.include_last_offset,
                                    **options)
    return ExportedEmbedding(ids, rows, **options)


def plain_model(ps_model: Any, state: dict[str, torch.Tensor] | None = None,
                missing: str = "initializer") -> torch.nn.Module:
    """A copy of ``ps_model.model`` with ``state`` (default: :func:`state_dict` now) and no client.

    Build it while the cluster is up (it reads the tables' specs); it then
    runs without one. Its dense parameters hold the state's values; each
    table module is replaced as the module docstring says.
    """
    if missing not in _MISSING:
        raise ValueError(f"missing must be 'initializer' or 'zeros', got {missing!r}")
    if state is None:
        state = state_dict(ps_model)
    model = ps_model.model
    # Shared, not copied: the clients and locks of the table modules (which the copy drops).
    memo: dict[int, Any] = {}
    for module in _tables(model):
        memo[id(module.client)] = module.client
        memo[id(module._lock)] = module._lock
    plain = copy.deepcopy(model, memo)
    prefix = ps_model.prefix + "/"
    with torch.no_grad():
        for variable in ps_model.parameters:
            parameter = plain.get_parameter(variable[len(prefix):])
            parameter.copy_(state[variable].reshape(parameter.shape))
    if isinstance(plain, PSEmbedding):  # the model is one table
        return _plain_table(plain, state, missing)
    replacements = [(name, _plain_table(module, state, missing)) for name, module in plain.named_modules()
                    if isinstance(module, PSEmbedding)]
    for name, replacement in replacements:
        parent_name, _, child = name.rpartition(".")
        parent = plain.get_submodule(parent_name) if parent_name else plain
        setattr(parent, child, replacement)
    return plain
