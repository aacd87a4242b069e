"""One training step of an attached module: values pulled into its parameters, gradients pushed as one.

Entering pulls every variable straight into its parameter's memory (a
host tensor through a shared numpy view, a CUDA tensor through a pinned
buffer: worker_client.out_arrays) and tells each row module a step begins.
Leaving pushes every parameter's ``.grad`` and every row module's row
gradients in one push (synchronous mode counts one push per worker and
step), then clears the gradients. Leaving by an exception pushes nothing
(the row modules' rows are taken and dropped).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from worker_client.overlap import OverlappedStep
from worker_client.step import Step

if TYPE_CHECKING:
    from worker_client.torch.module import PSModel

__all__ = ["TorchStep"]


class TorchStep:
    """``with ps_model.step():`` around a forward and backward pass (see the module docstring)."""

    def __init__(self, model: PSModel, overlap: bool = False) -> None:
        self._model = model
        self._overlap = overlap
        self._step: Step | OverlappedStep | None = None

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """The parameters by variable name, holding this step's pulled values."""
        return dict(self._model.parameters)

    def __enter__(self) -> TorchStep:
        model = self._model
        model.clear_gradients()
        for module in model.row_modules:
            module.begin_step()
        step = model.client.step(list(model.parameters), out=model.out_arrays(), overlap=self._overlap)
        step.__enter__()
        self._step = step
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: Any) -> None:
        step, self._step = self._step, None
        model = self._model
        try:
            rows: dict[str, tuple[Any, Any]] = {}
            for module in model.row_modules:  # taken also after an exception: they stop holding rows
                for table, pair in module.take_row_gradients().items():
                    if table in rows:
                        raise ValueError(f"two row modules gave row gradients for table {table!r}; "
                                         "each table belongs to one module")
                    rows[table] = pair
            if exc_type is None:
                gradients = {name: p.grad.detach() for name, p in model.parameters.items()
                             if p.grad is not None}
                step.push(gradients, rows)
        finally:
            model.clear_gradients()
            step.__exit__(exc_type, *exc_info)
