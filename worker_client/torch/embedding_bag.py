"""PSEmbeddingBag: torch's ``nn.EmbeddingBag`` over a table on the ps-servers.

Each bag (a row of a 2-D input, or a slice of a 1-D input between
``offsets``) is pooled, ``sum``, ``mean`` or ``max``, with optional
``per_sample_weights`` (``sum`` only) and ``padding_idx`` (those entries
leave the bag: a mean counts only the others, an empty bag gives zeros), as
torch does. The batch's unique rows are pulled once and pooled by torch's
own ``embedding_bag``, so outputs and gradients are torch's; backward
delivers each unique id's gradient to the table as PSEmbedding does (held
within a step, pushed at once outside one).

Not supported: ``max_norm``, ``scale_grad_by_freq`` and ``sparse`` (the
table's optimizer runs on the servers, on the rows a step touched).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from worker_client.client import PSClient
from worker_client.torch.embedding import PSEmbedding

__all__ = ["PSEmbeddingBag"]

_MODES = ("sum", "mean", "max")


class PSEmbeddingBag(PSEmbedding):
    """``nn.EmbeddingBag`` over a server-side table: the arguments of PSEmbedding, plus ``mode`` and
    ``include_last_offset`` as torch's."""

    def __init__(self, client: PSClient, name: str, embedding_dim: int, num_embeddings: int | None = None, *,
                 mode: str = "mean", include_last_offset: bool = False, **table: Any) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {', '.join(_MODES)}, got {mode!r}")
        super().__init__(client, name, embedding_dim, num_embeddings, **table)
        self.mode = mode
        self.include_last_offset = bool(include_last_offset)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}"

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,  # noqa: A002 - torch's name
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """One pooled row per bag, shape ``(bags, embedding_dim)``, on the input's device."""
        if not isinstance(input, torch.Tensor) or input.dim() not in (1, 2):
            raise ValueError(f"PSEmbeddingBag {self.name!r}: input must be a 1-D (with offsets) or 2-D tensor "
                             f"of ids, got {getattr(input, 'shape', type(input).__name__)}")
        if input.dim() == 1 and offsets is None:
            raise ValueError(f"PSEmbeddingBag {self.name!r}: a 1-D input needs offsets (where each bag starts)")
        if input.dim() == 2 and offsets is not None:
            raise ValueError(f"PSEmbeddingBag {self.name!r}: a 2-D input is one bag per row; give no offsets")
        if per_sample_weights is not None and self.mode != "sum":
            raise ValueError(f"PSEmbeddingBag {self.name!r}: per_sample_weights need mode='sum', not "
                             f"{self.mode!r} (as torch's)")
        weight, positions, padding = self._lookup(input)
        positions = positions.reshape(input.shape)
        if offsets is not None:
            offsets = offsets.to(device=positions.device, dtype=torch.long)
        return F.embedding_bag(positions, weight, offsets, mode=self.mode, per_sample_weights=per_sample_weights,
                               include_last_offset=self.include_last_offset, padding_idx=padding)
