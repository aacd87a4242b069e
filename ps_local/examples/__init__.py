"""Built-in examples. Each module defines the same small interface:

``NAME``, ``DESCRIPTION``, ``METRIC`` (name of the held-out metric),
``TARGET`` (the value training must reach), ``HIGHER_IS_BETTER``,
``Config`` (a dataclass of hyperparameters), ``setup(client, config)``
(create the variables; idempotent, so every worker calls it),
``train(client, worker_index, num_workers, config, report)`` and
``evaluate(client, config) -> float``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["EXAMPLES", "load_example"]

EXAMPLES = {
    "digits": "ps_local.examples.digits_mlp",
    "recommender": "ps_local.examples.recommender",
    "torch-digits": "ps_local.examples.torch_digits",
}


def load_example(name: str) -> ModuleType:
    try:
        return importlib.import_module(EXAMPLES[name])
    except KeyError:
        raise ValueError(f"unknown example {name!r}; choose one of {', '.join(sorted(EXAMPLES))}") from None
