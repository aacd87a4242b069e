"""The ps-server daemon: holds its shard of every variable and applies pushes.

The parts, each a package with one job (docs/architecture.md is the map):

- :mod:`ps_server.core` holds the shard's state and its rules: variables,
  optimizers, the exactly-once ledger, consistency modes, membership,
  lifecycle. It imports neither gRPC nor protobuf.
- :mod:`ps_server.durability` writes and restores checkpoints and the spec log.
- :mod:`ps_server.service` translates gRPC calls to the core and back.
- :mod:`ps_server.ops` is configuration, the command line and metrics.
- :mod:`ps_server.server` builds one server from those parts.

Importing this package loads nothing else: ``PSServer``, ``ServerConfig`` and
``create_server`` are imported on first use, so ``import ps_server.core.store``
does not load gRPC.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ps_server.ops.config import ServerConfig
    from ps_server.server import PSServer, create_server

__all__ = ["PSServer", "ServerConfig", "create_server"]

_LAZY = {"PSServer": "ps_server.server", "create_server": "ps_server.server",
         "ServerConfig": "ps_server.ops.config"}


def __getattr__(name: str) -> Any:
    """Import the public names on first use, not when the package loads."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ps_server' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
