"""The server-side optimizer of each parameter, from a ``torch.optim`` optimizer or a wehub one.

A ``torch.optim`` optimizer's parameter groups map one to one onto the
servers' optimizers, with torch's own values, so torch's defaults hold:
``torch.optim.Adam(params)`` runs on the servers as
``Adam(learning_rate=1e-3, beta_1=0.9, beta_2=0.999, epsilon=1e-8)``,
``torch.optim.Adagrad(params)`` as ``Adagrad(learning_rate=0.01,
initial_accumulator_value=0, epsilon=1e-10)``. Options the servers have no
counterpart for (weight decay, dampening, amsgrad, maximize, lr_decay,
another optimizer class) are refused, each named, rather than dropped.

The rules are torch's except Adam's ε: the servers divide by
``sqrt(v) + ε`` with the bias correction folded into the step size (Keras),
torch by ``sqrt(v / (1 - β₂ᵗ)) + ε``; they differ only where ``v`` is
about as small as ε² (README, "Defaults of optimizers and initializers").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from wehub_ps.specs import SGD, Adagrad, Adam, Momentum, Optimizer, SpecError

__all__ = ["UnsupportedOptimizerError", "server_optimizer", "optimizers_by_parameter", "table_optimizer"]

_WEHUB_OPTIMIZERS = (SGD, Momentum, Adagrad, Adam)

#: Per torch class: the group options that must hold their neutral value, and that value.
_NEUTRAL: dict[type, dict[str, Any]] = {
    torch.optim.SGD: {"weight_decay": 0, "dampening": 0, "maximize": False},
    torch.optim.Adam: {"weight_decay": 0, "amsgrad": False, "maximize": False},
    torch.optim.Adagrad: {"weight_decay": 0, "lr_decay": 0, "maximize": False},
}


class UnsupportedOptimizerError(SpecError):
    """A torch optimizer, or an option of it, that the servers cannot run; the message names it."""


def server_optimizer(optimizer_class: type, group: Mapping[str, Any]) -> Optimizer:
    """The server-side optimizer for one ``torch.optim`` parameter group of ``optimizer_class``."""
    neutral = _NEUTRAL.get(optimizer_class)
    if neutral is None:
        raise UnsupportedOptimizerError(
            f"{optimizer_class.__name__} has no server-side counterpart; use torch.optim.SGD (with or "
            "without momentum/nesterov), Adam or Adagrad, or a wehub optimizer (worker_client.SGD, "
            "Momentum, Adagrad, Adam)")
    refused = [f"{option}={group[option]!r}" for option, value in neutral.items()
               if option in group and group[option] != value]
    if refused:
        raise UnsupportedOptimizerError(
            f"torch.optim.{optimizer_class.__name__} with {', '.join(refused)}: the servers have no such "
            f"option; leave {' and '.join(o.split('=')[0] for o in refused)} at the default")
    lr = float(group["lr"])
    if optimizer_class is torch.optim.SGD:
        momentum = float(group.get("momentum", 0))
        if momentum == 0:
            return SGD(learning_rate=lr)
        return Momentum(learning_rate=lr, momentum=momentum, nesterov=bool(group.get("nesterov", False)))
    if optimizer_class is torch.optim.Adam:
        beta_1, beta_2 = (float(b) for b in group["betas"])
        return Adam(learning_rate=lr, beta_1=beta_1, beta_2=beta_2, epsilon=float(group["eps"]))
    return Adagrad(learning_rate=lr, initial_accumulator_value=float(group["initial_accumulator_value"]),
                   epsilon=float(group["eps"]))


def optimizers_by_parameter(optimizer: Any, parameters: Iterable[tuple[str, torch.Tensor]]
                            ) -> dict[str, Optimizer]:
    """Each named parameter's server-side optimizer.

    ``optimizer``: a wehub optimizer (every parameter gets it), or a
    ``torch.optim.Optimizer`` whose groups hold every one of ``parameters``.
    """
    parameters = list(parameters)
    if isinstance(optimizer, _WEHUB_OPTIMIZERS):
        return {name: optimizer for name, _ in parameters}
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("optimizer must be a torch.optim.Optimizer or a wehub optimizer (SGD, Momentum, "
                        f"Adagrad, Adam), got {type(optimizer).__name__}")
    by_tensor: dict[int, Optimizer] = {}
    for group in optimizer.param_groups:
        server_side = server_optimizer(type(optimizer), group)
        for tensor in group["params"]:
            by_tensor[id(tensor)] = server_side
    missing = [name for name, tensor in parameters if id(tensor) not in by_tensor]
    if missing:
        raise UnsupportedOptimizerError(
            f"parameters {', '.join(missing)} are in no parameter group of the {type(optimizer).__name__} "
            "given; build it from model.parameters()")
    return {name: by_tensor[id(tensor)] for name, tensor in parameters}


def table_optimizer(optimizer: Any) -> Optimizer:
    """The server-side optimizer of an embedding table attached without one of its own.

    A table has no torch parameters in any group, so a ``torch.optim``
    optimizer gives it its constructor's settings (``optimizer.defaults``,
    torch's defaults where not given); a wehub optimizer is used as it is.
    """
    if isinstance(optimizer, _WEHUB_OPTIMIZERS):
        return optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("optimizer must be a torch.optim.Optimizer or a wehub optimizer (SGD, Momentum, "
                        f"Adagrad, Adam), got {type(optimizer).__name__}")
    return server_optimizer(type(optimizer), optimizer.defaults)
