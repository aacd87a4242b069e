"""The step loop: pull at the start of a step, push at its end."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from worker_client.arrays import parse_device
from worker_client.pulls import Puller
from worker_client.pushes import Pushes
from worker_client.session import Session

__all__ = ["Step"]


class Step:
    """``with client.step() as step:`` pulls on entry into ``step.params``.

    With ``out``, the values are written into those arrays (see
    PSClient.pull), whether pulled or brought back by the previous step's push.

    Call ``step.push(grads)`` once inside the block. Leaving the block by an
    exception pushes nothing, so a failed step never sends half a gradient.
    A completed step advances the worker's clock (the session's step).
    """

    def __init__(self, puller: Puller, pushes: Pushes, session: Session, names: Iterable[str] | None,
                 device: Any, out: Mapping[str, Any] | None = None) -> None:
        self._puller = puller
        self._pushes = pushes
        self._session = session
        self._names = list(names) if names is not None else None
        self._device = device
        self._out = out
        self.params: dict[str, Any] = {}
        self.pushed = False
        self._pushed_shards: set[int] = set()

    def __enter__(self) -> "Step":
        gpu = parse_device(self._device)
        checked = self._puller.out_arrays(self._names, gpu, self._out)  # before anything is taken or pulled
        # The previous step's push may have brought these values back already.
        params = self._puller.take_prefetched(self._names, self._device, checked[1])
        self.params = params if params is not None else self._puller.pull_into(checked, gpu)
        return self

    def push(self, gradients: Mapping[str, Any], rows: Mapping[str, tuple[Any, Any]] | None = None) -> None:
        """Push this step's gradients, dense and sparse (``rows={table: (ids, grads)}``), once."""
        if self.pushed:
            raise RuntimeError("this step already pushed its gradients; start a new step")
        self._pushed_shards = self._pushes.push_step(gradients, rows, self._names, self._device)
        self.pushed = True

    def __exit__(self, exc_type, *exc_info: object) -> None:
        if exc_type is None and self.pushed:
            self._session.finish_step(self._pushed_shards)
        return None
