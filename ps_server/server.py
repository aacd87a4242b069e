"""Building, serving and stopping one ps-server.

Building is separate from serving: :func:`create_server` binds the port
(tests bind port 0 and read :attr:`PSServer.port`), :meth:`PSServer.start`
serves. Health is NOT_SERVING until the server is ready and again from the
moment shutdown begins, so load balancers and Kubernetes probes never send
work to a server that cannot take it.
"""

from __future__ import annotations

import logging
import os
import tempfile
import uuid
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ps_server.config import ServerConfig
from ps_server.lifecycle import Lifecycle
from ps_server.push_ledger import PushLedger
from ps_server.service import ParameterServerService
from ps_server.store import VariableStore
from wehub_ps.logs import event
from wehub_ps.rpc import SERVICE_NAME

__all__ = ["PSServer", "create_server"]

log = logging.getLogger("ps_server")


class PSServer:
    """A bound, not yet serving, ps-server. Use :func:`create_server`."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.server_id = uuid.uuid4().hex
        self.store = VariableStore(config.shard_index, config.num_shards, config.memory_limit)
        self.ledger = PushLedger()
        self.lifecycle = Lifecycle()
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.service = ParameterServerService(
            self.store, self.ledger, self.lifecycle, self.server_id,
            default_chunk_bytes=config.chunk_bytes, max_chunk_bytes=config.max_message_bytes // 2)
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            # Never share a port with another process: two shards on one port
            # would silently split the traffic between them.
            ("grpc.so_reuseport", 0),
        ]
        # One thread per concurrent RPC: streams block their thread while
        # waiting for the network, and the RPC bound makes the pool the cap.
        self._executor = futures.ThreadPoolExecutor(
            max_workers=config.max_concurrent_rpcs, thread_name_prefix=f"ps{config.shard_index}-rpc")
        self.grpc_server = grpc.server(self._executor, options=options,
                                       maximum_concurrent_rpcs=config.max_concurrent_rpcs)
        self.grpc_server.add_generic_rpc_handlers((self.service.generic_handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.grpc_server)
        self.port = self.grpc_server.add_insecure_port(f"{config.host}:{config.port}")
        if self.port == 0:
            raise OSError(f"could not bind {config.host}:{config.port}")

    def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def start(self) -> None:
        """Serve; health turns SERVING once requests can be answered."""
        self.start_transport()
        self.mark_serving()

    def start_transport(self) -> None:
        """Accept connections; health still answers NOT_SERVING."""
        self.grpc_server.start()

    def mark_serving(self) -> None:
        """Ready for work: health SERVING, port file written."""
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        if self.config.port_file:
            _write_atomically(self.config.port_file, f"{self.port}\n")
        event(log, logging.INFO, "serving", host=self.config.host, port=self.port,
              shard_index=self.config.shard_index, num_shards=self.config.num_shards,
              server_id=self.server_id)

    def stop(self, grace: float = 5.0) -> bool:
        """Health NOT_SERVING, refuse new work, finish pushes in flight, stop.

        Returns True when every push in flight finished within the drain timeout.
        """
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        in_flight = self.lifecycle.in_flight
        event(log, logging.INFO, "draining", pushes_in_flight=in_flight)
        drained = self.lifecycle.drain(self.config.drain_timeout)
        if not drained:
            event(log, logging.WARNING, "drain timed out", pushes_in_flight=self.lifecycle.in_flight,
                  drain_timeout=self.config.drain_timeout)
        self.grpc_server.stop(grace).wait()
        self._executor.shutdown(wait=False)
        event(log, logging.INFO, "stopped", drained=drained)
        return drained

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self.grpc_server.wait_for_termination(timeout)


def create_server(config: ServerConfig) -> PSServer:
    """Build a ps-server and bind its port; call ``start()`` to serve."""
    return PSServer(config)


def _write_atomically(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".port-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
