"""The PyTorch adapter (the ``torch`` extra); the core package never imports torch."""

from worker_client.torch.embedding import PSEmbedding

__all__ = ["PSEmbedding"]
