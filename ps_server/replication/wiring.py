"""Puts a replica together inside one ps-server: role, etcd coordination, replication port, follower.

``ps_server/server.py`` builds a :class:`ReplicaWiring` when ``--replicas``
is more than one; everything replication needs from the server (store,
ledger, consistency, restore, health, TLS and token) is taken from it here.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import ssl
import threading
from typing import Protocol

from grpc_health.v1 import health_pb2

from ps_server.coordination import CoordinationError, EtcdClient, ShardCoordinator
from ps_server.core.consistency import ConsistencyController
from ps_server.core.ledger import PushLedger
from ps_server.core.membership import Membership
from ps_server.core.store import VariableStore
from ps_server.durability.checkpointer import Checkpointer
from ps_server.durability.format import CheckpointError
from ps_server.durability.restore import RestoredState, find_restore_plan
from ps_server.ops.config import ServerConfig
from ps_server.ops.metrics import Metrics
from ps_server.ops.pod_label import PodRoleLabel, label_value, pod_target
from ps_server.replication.follower import Follower
from ps_server.replication.leader import BackupStreams
from ps_server.replication.observe import ReplicationCollector
from ps_server.replication.records import RecordApplier
from ps_server.replication.role import BACKUP, PRIMARY, ReplicaRole, ReplicaSettings
from ps_server.replication.snapshots import take_snapshot
from ps_server.service.auth import TokenFile
from ps_server.service.standard_services import HealthServicer
from wehub_ps.process.logs import event
from wehub_ps.wire.frames import HANDSHAKE_FRAME_BYTES, FrameListener, Handshake
from wehub_ps.wire.rpc import SERVICE_NAME

__all__ = ["ReplicaWiring"]

log = logging.getLogger("ps_server.replication")

# Replication connections open beyond --replicas, and at most this many before their FollowStart: room for
# backups reconnecting together; strangers hold at most 4 threads and 4 x 16 KiB.
_HANDSHAKING_CONNECTIONS = 4


class ReplicatedServer(Protocol):
    """What a replica takes from its ps-server (ps_server.server.PSServer)."""

    config: ServerConfig
    server_id: str
    store: VariableStore
    metrics: Metrics
    ledger: PushLedger
    membership: Membership
    consistency: ConsistencyController
    health: HealthServicer
    tokens: TokenFile | None
    port: int
    finish_requested: threading.Event

    @property
    def checkpointer(self) -> Checkpointer | None: ...

    def install(self, restored: RestoredState) -> None: ...
    def restore(self) -> None: ...


class ReplicaWiring:
    def __init__(self, server: ReplicatedServer) -> None:
        self._server = server
        config = server.config
        self._pod_label = _pod_label(config)  # the role's changes also go to the pod's label
        settings = ReplicaSettings(
            replica_index=config.replica_index, replicas=config.replicas, address="",
            incarnation=int(server.server_id[:12], 16), lease_seconds=float(config.primary_lease_seconds),
            replication_timeout=config.replication_timeout, failover_after=config.failover_after,
            backup_stall_timeout=config.backup_stall_timeout,
            max_backup_bytes=config.max_backup_bytes, consistency=config.consistency,
            handover_timeout=config.switchover_timeout)
        self.role = ReplicaRole(settings, self._become_primary)
        self.role.on_state = self._state_changed
        self.role.on_proof = lambda proven: self._set_health(self.role.state)
        self._applier = RecordApplier(server.store, server.ledger, server.consistency,
                                      on_finish=server.finish_requested.set,
                                      on_checkpoint=self._checkpoint)
        if config.consistency in ("ssp", "sync"):
            self.role.consistency_state = server.consistency.snapshot
            self.role.membership_generation = lambda: server.membership.generation
        # Sync: the step moves in the shard's order and is logged (a backup's moves only at the records).
        server.consistency.changes = self.role
        server.membership.follow()  # until elected: the primary's workers, as its records say
        self._started = False  # set_state needs the coordination started (role.start does it)
        server.metrics.registry.register(ReplicationCollector(self.role))
        streams = BackupStreams(
            self.role, config.shard_index, config.num_shards,
            lambda: take_snapshot(server.store, server.ledger, server.consistency, server.server_id),
            ping_seconds=max(0.02, min(settings.lease_seconds / 4, settings.failover_after / 5)),
            token_matches=lambda presented: server.tokens is None or server.tokens.matches(presented),
            snapshot_parent=config.checkpoint_dir or None)
        # A backup holds one connection; a restarted one may connect again before the primary sees its
        # old connection end. The primary only reads FollowRequests from them (a FollowStart, then the
        # sequence applied): every frame is within the handshake's bound.
        self._listener = FrameListener(
            config.host, config.replication_port, streams.serve,
            Handshake(max_pending=_HANDSHAKING_CONNECTIONS),
            max_connections=config.replicas + _HANDSHAKING_CONNECTIONS, tls=_server_tls(config),
            max_frame_bytes=HANDSHAKE_FRAME_BYTES)

    def start(self) -> None:
        """Join the replica set and start the role's loop; blocks until etcd answered.

        CoordinationError when etcd is away for ``--etcd-start-timeout`` or
        refuses this replica; nothing of the replica is left running then.
        """
        server = self._server
        config = server.config
        host = _advertised_host(config.host)
        address = config.advertise_address or f"{host}:{server.port}"
        advertised_host = address.rpartition(":")[0]
        replication_address = f"{advertised_host}:{self._listener.port}"
        self._listener.start()
        if self._pod_label is not None:
            self._pod_label.start()
        client = EtcdClient([e.strip() for e in config.etcd_endpoints.split(",") if e.strip()],
                            ca=config.etcd_ca, cert=config.etcd_cert, key=config.etcd_key)
        self._state_changed(self.role.state)  # health before anything is known: not serving

        def can_restore() -> bool:
            try:
                return bool(config.checkpoint_dir) and find_restore_plan(
                    config.checkpoint_dir, config.shard_index, config.num_shards) is not None
            except (OSError, CheckpointError):
                return True  # a damaged checkpoint: restoring will say so loudly, as without replicas

        def coordination_for(incarnation: int) -> ShardCoordinator:
            coordinator = ShardCoordinator(
                client, job=config.job_name, shard_index=config.shard_index,
                replica_index=config.replica_index,
                address=address, incarnation=incarnation, lease_ttl=config.primary_lease_seconds,
                unclean_after=config.unclean_election_after or math.inf,
                replication_address=replication_address, on_lease_lost=self.role.lease_lost)
            coordinator.can_restore = can_restore
            return coordinator

        coordination = coordination_for(self.role.settings.incarnation)
        try:  # etcd may start after this process, or answer its first connection late
            coordination.start(wait=config.etcd_start_timeout)
        except CoordinationError:
            client.close()
            self._listener.stop()
            if self._pod_label is not None:
                self._pod_label.stop(wait=0)
            raise
        self.role.connect(address, coordination)
        self.role.new_coordination = coordination_for
        follower = Follower(self.role, config.shard_index, config.num_shards, self._applier, server.install,
                            _client_tls(config), config.checkpoint_dir or None, self._token)
        self.role.follow = follower.follow
        self.role.interrupt_follow = follower.interrupt
        self._started = True
        self.role.start()
        event(log, logging.INFO, "replica started", replica_index=config.replica_index,
              replicas=config.replicas, address=address, replication_address=replication_address,
              job_name=config.job_name, etcd_endpoints=config.etcd_endpoints,
              role_label=self._pod_label.target.pod if self._pod_label is not None else "off")

    def stop(self) -> None:
        self.role.stop()
        self._listener.stop()
        if self._pod_label is not None:
            self._pod_label.stop(label_value(self.role.state))  # a stopping replica takes its label off

    def _become_primary(self, has_state: bool) -> None:
        self._applier.forget_streams()
        if not has_state:
            self._server.restore()  # every in-sync replica is gone: the newest checkpoint is what is left

    def _state_changed(self, state: str) -> None:
        """Health: '' SERVING on the primary and in-sync backups; the service's name on the primary only.
        Workers' leases run on the primary only: elected, the workers live in the table it followed get a
        fresh lease (a sync step in progress waits for them as the old primary did)."""
        if state == PRIMARY:
            self._server.membership.lead()
        else:
            self._server.membership.follow()
        self._set_health(state)  # before etcd hears of it: workers probing health find a new primary sooner
        if self._pod_label is not None:
            self._pod_label.set(label_value(state))  # returns at once; its own thread patches the pod
        coordination = self.role.coordination if self._started else None
        if coordination is not None:
            try:
                coordination.set_state(state, holds_state=self.role.has_state, position=self.role.position())
            except CoordinationError as error:  # etcd away: the member key keeps its last state
                event(log, logging.DEBUG, "could not publish the replica's state", error=str(error))

    def _set_health(self, state: str) -> None:
        """'' SERVING on the primary and in-sync backups; the service's name on a primary that can prove
        its term (it acknowledges nothing without the proof)."""
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        health = self._server.health
        health.set("", serving if state in (PRIMARY, BACKUP) else not_serving)
        health.set(SERVICE_NAME, serving if state == PRIMARY and self.role.proven else not_serving)

    def _checkpoint(self) -> None:
        """The primary wrote a checkpoint on a worker's request: write one here too."""
        checkpointer = self._server.checkpointer
        if checkpointer is not None:
            checkpointer.checkpoint("the primary's checkpoint")

    def _token(self) -> str:
        tokens = self._server.tokens
        return tokens.current().decode() if tokens is not None else ""


def _pod_label(config: ServerConfig) -> PodRoleLabel | None:
    """The pod's role label (--role-label auto) when this replica runs in a Kubernetes pod with a
    service account token; otherwise None, said at DEBUG (off is the normal case outside Kubernetes)."""
    if config.role_label == "off":
        event(log, logging.DEBUG, "pod role label off", why="--role-label off")
        return None
    target, why = pod_target(os.environ, config.service_account_dir)
    if target is None:
        event(log, logging.DEBUG, "pod role label off", why=why)
        return None
    return PodRoleLabel(target)


def _server_tls(config: ServerConfig) -> ssl.SSLContext | None:
    """Mutual TLS on the replication port with TLS servers: backups present the servers' certificate."""
    if not config.tls_cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=config.tls_client_ca)
    context.load_cert_chain(config.tls_cert, config.tls_key)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def _client_tls(config: ServerConfig) -> ssl.SSLContext | None:
    if not config.tls_cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=config.tls_client_ca)
    context.load_cert_chain(config.tls_cert, config.tls_key)
    return context


def _advertised_host(host: str) -> str:
    return socket.gethostname() if host in ("", "0.0.0.0", "::", "[::]") else host
