"""The step loop: pull at the start of a step, push at its end."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker_client.client import PSClient

__all__ = ["Step"]


class Step:
    """``with client.step() as step:`` pulls on entry into ``step.params``.

    Call ``step.push(grads)`` once inside the block. Leaving the block by an
    exception pushes nothing, so a failed step never sends half a gradient.
    """

    def __init__(self, client: "PSClient", names: Iterable[str] | None, device: Any) -> None:
        self._client = client
        self._names = list(names) if names is not None else None
        self._device = device
        self.params: dict[str, Any] = {}
        self.pushed = False
        self._pushed_shards: set[int] = set()

    def __enter__(self) -> "Step":
        # The previous step's push may have brought these values back already.
        params = self._client._take_prefetched(self._names, self._device)
        self.params = params if params is not None else self._client.pull(self._names, device=self._device)
        return self

    def push(self, gradients: Mapping[str, Any], rows: Mapping[str, tuple[Any, Any]] | None = None) -> None:
        """Push this step's gradients, dense and sparse (``rows={table: (ids, grads)}``), once."""
        if self.pushed:
            raise RuntimeError("this step already pushed its gradients; start a new step")
        self._pushed_shards = self._client._push_step(gradients, rows, self._names, self._device)
        self.pushed = True

    def __exit__(self, exc_type, *exc_info: object) -> None:
        if exc_type is None and self.pushed:
            self._client._finish_step(self._pushed_shards)
        return None
