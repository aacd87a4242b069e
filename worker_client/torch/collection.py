"""PSEmbeddingBagCollection: TorchRec's EmbeddingBagCollection over tables on the ps-servers.

A TorchRec model (a DLRM, say) reads its sparse features as a
``KeyedJaggedTensor`` and pools them with an ``EmbeddingBagCollection`` of
``EmbeddingBagConfig`` tables. This module takes the same: table configs
with ``name``, ``embedding_dim``, ``num_embeddings``, ``feature_names`` and
``pooling`` (TorchRec's ``EmbeddingBagConfig``, or :class:`TableConfig`),
and a batch with TorchRec's layout (``keys()``, ``values()``,
``lengths()``, ``weights_or_none()``, ``stride()``: TorchRec's
``KeyedJaggedTensor``, or :class:`KeyedJaggedBatch`), so the model swaps its
collection for this one and trains, with each table's rows on the servers.
TorchRec itself is not needed: its wheels pair with particular torch
builds (``fbgemm-gpu``), and nothing here imports it unless it is
installed, to return its ``KeyedTensor``.

Each table is a :class:`PSEmbeddingBag` named ``prefix + config.name``
(a dense table of ``num_embeddings`` rows; ``num_embeddings=None`` in a
TableConfig makes a hash table). All features of a table are pooled in one
call, so a batch pulls each table's rows once.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from wehub_ps.specs import Optimizer
from worker_client.client import PSClient
from worker_client.torch.embedding_bag import PSEmbeddingBag

__all__ = ["KeyedJaggedBatch", "PSEmbeddingBagCollection", "PooledFeatures", "TableConfig"]


@dataclass(frozen=True)
class TableConfig:
    """One table of a collection: TorchRec's ``EmbeddingBagConfig`` fields (``pooling``: 'sum' or 'mean')."""

    name: str
    embedding_dim: int
    num_embeddings: int | None
    feature_names: Sequence[str]
    pooling: str = "sum"


@dataclass(frozen=True)
class KeyedJaggedBatch:
    """Sparse features in TorchRec's ``KeyedJaggedTensor`` layout, without TorchRec.

    ``values``: every feature's ids, feature after feature (in ``keys``
    order), sample after sample; ``lengths``: ids per (feature, sample),
    ``len(keys) * batch`` of them; ``weights``: one per id, or None.
    """

    keys_: Sequence[str]
    values_: torch.Tensor
    lengths_: torch.Tensor
    weights_: torch.Tensor | None = None
    _stride: int = field(init=False)

    def __post_init__(self) -> None:
        keys = len(self.keys_)
        if keys == 0 or self.lengths_.dim() != 1 or len(self.lengths_) % keys:
            raise ValueError(f"lengths must be 1-D with a multiple of {keys} entries (one per feature and "
                             f"sample), got shape {tuple(self.lengths_.shape)}")
        if int(self.lengths_.sum()) != len(self.values_):
            raise ValueError(f"lengths add up to {int(self.lengths_.sum())}, but there are {len(self.values_)} "
                             "values")
        if self.weights_ is not None and self.weights_.shape != self.values_.shape:
            raise ValueError("weights must have one entry per value")
        object.__setattr__(self, "_stride", len(self.lengths_) // keys)

    def keys(self) -> list[str]:
        return list(self.keys_)

    def values(self) -> torch.Tensor:
        return self.values_

    def lengths(self) -> torch.Tensor:
        return self.lengths_

    def weights_or_none(self) -> torch.Tensor | None:
        return self.weights_

    def stride(self) -> int:
        return self._stride


@dataclass(frozen=True)
class PooledFeatures:
    """One pooled row per sample and feature, TorchRec's ``KeyedTensor`` layout: ``values()`` is
    (batch, sum of the features' dims), the features side by side in ``keys()`` order."""

    keys_: list[str]
    length_per_key_: list[int]
    values_: torch.Tensor

    def keys(self) -> list[str]:
        return list(self.keys_)

    def values(self) -> torch.Tensor:
        return self.values_

    def length_per_key(self) -> list[int]:
        return list(self.length_per_key_)

    def to_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.keys_, torch.split(self.values_, self.length_per_key_, dim=1), strict=True))


def _pooling(config: Any) -> str:
    pooling = getattr(config, "pooling", "sum")
    name = getattr(pooling, "name", pooling)  # TorchRec's PoolingType enum, or a string
    mode = str(name).lower()
    if mode not in ("sum", "mean"):
        raise ValueError(f"table {config.name!r}: pooling must be sum or mean, got {pooling!r}")
    return mode


class PSEmbeddingBagCollection(torch.nn.Module):
    """``EmbeddingBagCollection(tables)`` with each table on the ps-servers (see the module docstring).

    ``optimizer``: the tables' server-side optimizer, or None to take
    ``attach()``'s; ``is_weighted``: pool with the batch's weights (sum).
    ``table_options`` go to every :class:`PSEmbeddingBag` (``initializer``,
    ``max_rows``, ``eviction``, ...).
    """

    def __init__(self, client: PSClient, tables: Sequence[Any], *, prefix: str = "",
                 optimizer: Optimizer | None = None, is_weighted: bool = False, **table_options: Any) -> None:
        super().__init__()
        self.is_weighted = is_weighted
        self._features: dict[str, list[str]] = {}  # table -> its features, in config order
        owner: dict[str, str] = {}
        for config in tables:
            features = list(config.feature_names)
            for feature in features:
                if feature in owner:
                    raise ValueError(f"feature {feature!r} is in tables {owner[feature]!r} and {config.name!r}")
                owner[feature] = config.name
            mode = _pooling(config)
            if is_weighted and mode != "sum":
                raise ValueError(f"table {config.name!r}: weighted features pool by sum, not {mode!r}")
            if config.name in self._features:
                raise ValueError(f"two tables are named {config.name!r}")
            # A submodule each (bag_<name>): an export swaps it for a plain torch module.
            self.add_module(f"bag_{config.name}", PSEmbeddingBag(
                client, prefix + config.name, config.embedding_dim, getattr(config, "num_embeddings", None),
                mode=mode, include_last_offset=True, optimizer=optimizer, **table_options))
            self._features[config.name] = features
        self._owner = owner

    def bag(self, table: str) -> torch.nn.Module:
        """The module pooling ``table`` (a PSEmbeddingBag; in an exported model, a plain one)."""
        return getattr(self, f"bag_{table}")

    def forward(self, features: Any) -> Any:
        """Pooled features (TorchRec's ``KeyedTensor`` when TorchRec is installed, else
        :class:`PooledFeatures`), keys in the order of the tables' feature names."""
        keys = list(features.keys())
        unknown = [k for k in keys if k not in self._owner]
        if unknown:
            raise ValueError(f"features {unknown} belong to no table of this collection")
        batch = features.stride()
        values, lengths, weights = features.values(), features.lengths(), features.weights_or_none()
        if self.is_weighted and weights is None:
            raise ValueError("is_weighted=True needs a batch with weights")
        per_key = lengths.reshape(len(keys), batch)
        ends = torch.cumsum(per_key.sum(dim=1), 0).tolist()
        starts = [0, *ends[:-1]]
        pooled: dict[str, torch.Tensor] = {}
        for table, table_features in self._features.items():
            present = [f for f in table_features if f in keys]
            if not present:
                continue
            spans = [(starts[keys.index(f)], ends[keys.index(f)]) for f in present]
            ids = torch.cat([values[a:b] for a, b in spans])
            bag_lengths = torch.cat([per_key[keys.index(f)] for f in present])
            offsets = torch.cat([bag_lengths.new_zeros(1), torch.cumsum(bag_lengths, 0)])
            sample_weights = torch.cat([weights[a:b] for a, b in spans]) if self.is_weighted else None
            out = self.bag(table)(ids, offsets, per_sample_weights=sample_weights)
            for i, feature in enumerate(present):
                pooled[feature] = out[i * batch:(i + 1) * batch]
        order = [f for features_of in self._features.values() for f in features_of if f in pooled]
        dims = [pooled[f].shape[1] for f in order]
        stacked = torch.cat([pooled[f] for f in order], dim=1)
        keyed_tensor = _torchrec_keyed_tensor()
        if keyed_tensor is None:
            return PooledFeatures(order, dims, stacked)
        return keyed_tensor(keys=order, length_per_key=dims, values=stacked)


@functools.cache
def _torchrec_keyed_tensor() -> type | None:
    """TorchRec's KeyedTensor class where TorchRec is installed (looked for once), else None."""
    try:
        from torchrec.sparse.jagged_tensor import KeyedTensor
    except ImportError:
        return None
    return KeyedTensor
