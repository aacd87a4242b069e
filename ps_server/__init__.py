"""The ps-server daemon: holds its shard of every variable and applies pushes.

Layers, each with one job: :mod:`.store` (variables, optimizer state,
versions; no gRPC), :mod:`.optimizers` and :mod:`.initializers` (numpy
math), :mod:`.push_ledger` (exactly-once bookkeeping), :mod:`.service`
(RPC handlers translating between wire and store), :mod:`.server` (building,
serving and stopping a gRPC server), :mod:`.config` and :mod:`.cli`.
"""

from ps_server.config import ServerConfig
from ps_server.server import PSServer, create_server

__all__ = ["PSServer", "ServerConfig", "create_server"]
