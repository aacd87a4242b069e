"""A module's parameters as variables: created from the first worker's values, read by every worker.

Each worker builds its model with its own random initial values, and each
offers them as the variable's initial value. The first create of each
variable wins (so racing workers may each give some of the variables: every
one of them is still an initial draw of its layer); a
later one differs only in that value (its SHA-256, the spec's
``Explicit`` initializer), which the servers report as a conflict. That
conflict is expected here: the worker takes the existing variable and
later pulls the winner's values into its parameters. Any other difference
(shape, dtype, optimizer) is a real conflict and is raised.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from wehub_ps.placement import MinSizePartitioner
from wehub_ps.specs import Explicit, Optimizer
from worker_client.client import PSClient
from worker_client.errors import NotInitializedError, PSUnavailableError, VariableConflictError

__all__ = ["create_from_parameters", "pull_when_initialized"]

#: How often to look again for a variable another worker is creating, or for its initial value.
_POLL_SECONDS = 0.05


def create_from_parameters(client: PSClient, parameters: Mapping[str, torch.Tensor],
                           optimizers: Mapping[str, Optimizer], timeout: float) -> None:
    """Create one variable per ``{variable name: parameter}``, or take the one another worker created."""
    for name, parameter in parameters.items():
        initial = parameter.detach().cpu()  # (a CPU tensor is itself: no copy)
        _create_one(client, name, initial, optimizers[name], timeout)


def _create_one(client: PSClient, name: str, initial: torch.Tensor, optimizer: Optimizer,
                timeout: float) -> None:
    dtype = np.dtype(str(initial.dtype).removeprefix("torch."))
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.create_variable(name, shape=tuple(initial.shape), dtype=dtype, initializer=initial,
                                   optimizer=optimizer)
            return
        except VariableConflictError as conflict:
            existing = client.variables(refresh=True).get(name)
            if existing is not None:
                spec = existing.spec
                if not (isinstance(spec.initializer, Explicit) and not spec.hash_table
                        and spec.shape == tuple(initial.shape) and spec.dtype == dtype
                        and spec.optimizer == optimizer and spec.aggregation == "mean"
                        and spec.partitioner == MinSizePartitioner()):
                    raise
                return  # another worker's initial values won
            # Another worker's create is still in flight: it is not visible yet.
            if time.monotonic() > deadline:
                raise PSUnavailableError(f"variable {name!r} is being created by another worker and did not "
                                         f"appear within {timeout:.0f}s") from conflict
            time.sleep(_POLL_SECONDS)


def pull_when_initialized(client: PSClient, names: list[str], out: Mapping[str, Any], timeout: float) -> None:
    """Pull ``names`` into ``out``, waiting (up to ``timeout``) for another worker's initial values."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.pull(names, out=out)
            return
        except NotInitializedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(_POLL_SECONDS)
