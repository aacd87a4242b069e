"""Puts a replica together inside one ps-server: role, etcd coordination, Follow service, follower.

``ps_server/server.py`` builds a :class:`ReplicaWiring` when ``--replicas``
is more than one; everything replication needs from the server (store,
ledger, consistency, restore, health, TLS and token) is taken from it here.
"""

from __future__ import annotations

import logging
import socket
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2

from ps_server.coordination import CoordinationError, EtcdClient, ShardCoordinator
from ps_server.core.consistency import ConsistencyController
from ps_server.core.ledger import PushLedger
from ps_server.core.store import VariableStore
from ps_server.durability.restore import RestoredState
from ps_server.ops.config import ServerConfig
from ps_server.ops.metrics import Metrics
from ps_server.replication.follower import Follower
from ps_server.replication.leader import REPLICATION_SERVICE, ReplicationService
from ps_server.replication.observe import ReplicationCollector
from ps_server.replication.records import RecordApplier
from ps_server.replication.role import BACKUP, PRIMARY, ReplicaRole, ReplicaSettings
from ps_server.replication.snapshots import take_snapshot
from ps_server.service.auth import TokenFile
from ps_server.service.standard_services import HealthServicer
from wehub_ps.process.logs import event
from wehub_ps.wire.rpc import MAX_MESSAGE_BYTES, SERVICE_NAME

__all__ = ["ReplicaWiring"]

log = logging.getLogger("ps_server.replication")


class ReplicatedServer(Protocol):
    """What a replica takes from its ps-server (ps_server.server.PSServer)."""

    config: ServerConfig
    server_id: str
    store: VariableStore
    metrics: Metrics
    ledger: PushLedger
    consistency: ConsistencyController
    health: HealthServicer
    tokens: TokenFile | None
    port: int

    def install(self, restored: RestoredState) -> None: ...
    def restore(self) -> None: ...


class ReplicaWiring:
    def __init__(self, server: ReplicatedServer) -> None:
        self._server = server
        config = server.config
        settings = ReplicaSettings(
            replica_index=config.replica_index, replicas=config.replicas, address="",
            incarnation=int(server.server_id[:12], 16), lease_seconds=float(config.primary_lease_seconds),
            replication_timeout=config.replication_timeout, max_backup_bytes=config.max_backup_bytes)
        self.role = ReplicaRole(settings, self._become_primary)
        self.role.on_state = self._state_changed
        self._applier = RecordApplier(server.store, server.ledger, server.consistency)
        if config.consistency == "ssp":
            self.role.consistency_state = server.consistency.snapshot
        self._coordination = None
        server.metrics.registry.register(ReplicationCollector(self.role))

    def add_service(self, grpc_server: grpc.Server) -> str:
        """Register the Replication service; its name (for reflection)."""
        server = self._server
        snapshot_parent = server.config.checkpoint_dir or None
        service = ReplicationService(
            self.role, server.config.shard_index, server.config.num_shards,
            lambda: take_snapshot(server.store, server.ledger, server.consistency, server.server_id),
            ping_seconds=max(0.05, self.role.settings.lease_seconds / 4), snapshot_parent=snapshot_parent)
        grpc_server.add_generic_rpc_handlers((service.generic_handler(),))
        return REPLICATION_SERVICE

    def start(self) -> None:
        server = self._server
        config = server.config
        address = config.advertise_address or f"{_advertised_host(config.host)}:{server.port}"
        client = EtcdClient([e.strip() for e in config.etcd_endpoints.split(",") if e.strip()],
                            ca=config.etcd_ca, cert=config.etcd_cert, key=config.etcd_key)
        self._state_changed(self.role.state)  # health before anything is known: not serving
        coordination = ShardCoordinator(
            client, job=config.job_name, shard_index=config.shard_index,
            replica_index=config.replica_index, address=address, incarnation=self.role.settings.incarnation,
            lease_ttl=config.primary_lease_seconds, on_lease_lost=self.role.lease_lost)
        self.role.connect(address, coordination)
        self.role.follow = Follower(self.role, config.shard_index, config.num_shards, self._applier,
                                    server.install, self._open_channel, config.checkpoint_dir or None,
                                    self._metadata).follow
        self._coordination = coordination
        self.role.start()
        event(log, logging.INFO, "replica started", replica_index=config.replica_index,
              replicas=config.replicas, address=address, job_name=config.job_name,
              etcd_endpoints=config.etcd_endpoints)

    def stop(self) -> None:
        self.role.stop()

    def _become_primary(self, has_state: bool) -> None:
        self._applier.forget_streams()
        if not has_state:
            self._server.restore()  # every in-sync replica is gone: the newest checkpoint is what is left

    def _state_changed(self, state: str) -> None:
        """Health: '' SERVING on the primary and in-sync backups; the service's name on the primary only."""
        if self._coordination is not None:
            try:
                self._coordination.set_state(state)
            except CoordinationError as error:  # etcd away: the member key keeps its last state
                event(log, logging.DEBUG, "could not publish the replica's state", error=str(error))
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        health = self._server.health
        health.set("", serving if state in (PRIMARY, BACKUP) else not_serving)
        health.set(SERVICE_NAME, serving if state == PRIMARY else not_serving)

    def _open_channel(self, address: str) -> grpc.Channel:
        config = self._server.config
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000)]
        if not config.tls_cert:
            return grpc.insecure_channel(address, options=options)
        with open(config.tls_client_ca, "rb") as ca, open(config.tls_key, "rb") as key, \
                open(config.tls_cert, "rb") as cert:
            credentials = grpc.ssl_channel_credentials(ca.read(), key.read(), cert.read())
        return grpc.secure_channel(address, credentials, options=options)

    def _metadata(self) -> tuple:
        tokens = self._server.tokens
        if tokens is None:
            return ()
        return (("authorization", "Bearer " + tokens.current().decode()),)


def _advertised_host(host: str) -> str:
    return socket.gethostname() if host in ("", "0.0.0.0", "::", "[::]") else host
