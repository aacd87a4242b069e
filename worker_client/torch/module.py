"""``attach``: a ``torch.nn.Module``'s parameters as variables on a cluster, and its training steps."""

from __future__ import annotations

from typing import Any

import torch

from worker_client.client import PSClient
from worker_client.torch.optimizers import optimizers_by_parameter, table_optimizer
from worker_client.torch.step import TorchStep
from worker_client.torch.variables import create_from_parameters, pull_when_initialized

__all__ = ["PSModel", "attach"]

_DTYPES = (torch.float16, torch.float32, torch.float64)


def _is_row_module(module: torch.nn.Module) -> bool:
    return all(callable(getattr(module, method, None)) for method in ("begin_step", "take_row_gradients"))


class PSModel:
    """A module attached to a cluster (made by :func:`attach`).

    ``parameters``: ``{variable name: parameter}``; ``row_modules``: the
    submodules that push rows of their own tables (the row protocol in
    worker_client.torch's docstring).
    """

    def __init__(self, client: PSClient, model: torch.nn.Module, prefix: str,
                 parameters: dict[str, torch.Tensor], row_modules: list[torch.nn.Module]) -> None:
        self.client = client
        self.model = model
        self.prefix = prefix
        self.parameters = parameters
        self.row_modules = row_modules

    def step(self, overlap: bool = False) -> TorchStep:
        """``with ps_model.step():`` pulls into the parameters; leaving pushes their gradients as one push.

        ``overlap=True`` (asynchronous mode): the push goes out in the background while the next step
        pulls and computes, as ``client.step(overlap=True)``; ``client.flush()`` waits for the last one.
        """
        return TorchStep(self, overlap)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every trained value: dense parameters by variable name, each table's ``<table>.ids`` and
        ``<table>.rows`` (worker_client.torch.export; torch.save and safetensors take it). Reads only."""
        from worker_client.torch.export import state_dict

        return state_dict(self)

    def plain_model(self, state: dict[str, torch.Tensor] | None = None,
                    missing: str = "initializer") -> torch.nn.Module:
        """A copy of the model with the trained values and plain torch tables, needing no ps-server
        (worker_client.torch.export.plain_model)."""
        from worker_client.torch.export import plain_model

        return plain_model(self, state, missing)

    def pull(self) -> None:
        """Pull the current values into the parameters, in place (to evaluate, say)."""
        self.client.pull(list(self.parameters), out=self.out_arrays())

    def out_arrays(self) -> dict[str, torch.Tensor]:
        """The parameters' memory, to pull into: tensors that share it and need no grad."""
        return {name: p.detach() for name, p in self.parameters.items()}

    def clear_gradients(self) -> None:
        """Drop every attached parameter's ``.grad`` (as ``zero_grad(set_to_none=True)``)."""
        for parameter in self.parameters.values():
            parameter.grad = None


def attach(client: PSClient, model: torch.nn.Module, *, prefix: str, optimizer: Any,
           timeout: float = 300.0) -> PSModel:
    """Make ``model``'s parameters variables ``prefix/<name in named_parameters()>`` and pull them in.

    Every worker calls it with its own freshly built model: per variable,
    the first worker to create it gives its initial values, and every
    worker's parameters then hold them (pulled in place). ``optimizer`` runs on the
    servers: a ``torch.optim`` optimizer over the model's parameters (each
    parameter group mapped with torch's values and defaults; see
    worker_client.torch.optimizers), or a wehub optimizer for all.
    ``timeout``: how long to wait for another worker that is creating the
    same variables. Parameters of row modules (worker_client.torch's
    docstring) belong to their module's tables and are not attached; a row
    module built without an optimizer (``needs_optimizer``) gets this one
    through ``use_optimizer`` (a torch optimizer's constructor settings,
    worker_client.torch.optimizers.table_optimizer).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"prefix must be a non-empty string naming the model, got {prefix!r}")
    row_modules = [m for m in model.modules() if _is_row_module(m)]
    owned_by_rows = {id(p) for m in row_modules for p in m.parameters()}
    named = [(name, p) for name, p in model.named_parameters() if id(p) not in owned_by_rows]
    for name, p in named:
        if p.dtype not in _DTYPES:
            raise TypeError(f"parameter {name!r} has dtype {p.dtype}; attach supports float16, float32 and "
                            "float64 parameters")
    server_side = optimizers_by_parameter(optimizer, named)
    for module in row_modules:  # tables made without an optimizer of their own get this one's
        if getattr(module, "needs_optimizer", False):
            module.use_optimizer(table_optimizer(optimizer))
    parameters = {f"{prefix}/{name}": p for name, p in named}
    optimizers = {f"{prefix}/{name}": server_side[name] for name, _ in named}
    create_from_parameters(client, parameters, optimizers, timeout)
    attached = PSModel(client, model, prefix, parameters, row_modules)
    pull_when_initialized(client, list(parameters), attached.out_arrays(), timeout)
    return attached
