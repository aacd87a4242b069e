"""Building, serving and stopping one ps-server.

Building is separate from serving: :func:`create_server` binds the port
(tests bind port 0 and read :attr:`PSServer.port`), :meth:`PSServer.start`
restores the newest checkpoint and then serves. Health is NOT_SERVING until
the restore is done and again from the moment shutdown begins, so probes
and load balancers never send work to a server that cannot take it.

Shutdown (SIGTERM): health NOT_SERVING, refuse new work, let pushes in
flight finish (up to the drain timeout), write the final checkpoint and
seal the store with it (a push still open is cut off unacknowledged), stop
the gRPC server.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
import uuid
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ps_server.core.admission import Admission
from ps_server.core.consistency import ConsistencyController
from ps_server.core.fused import loops_for, prepare
from ps_server.core.gate import ApplyGate
from ps_server.core.ledger import PushLedger
from ps_server.core.lifecycle import Lifecycle
from ps_server.core.membership import Membership
from ps_server.core.ordering import UNLOGGED
from ps_server.core.pulls import PullPlanner
from ps_server.core.store import VariableStore
from ps_server.core.sweeps import ExpirySweeper
from ps_server.core.workers import WorkerPresence
from ps_server.durability.checkpointer import Checkpointer
from ps_server.durability.restore import RestoredFrom, RestoredState, load_restore
from ps_server.durability.spec_log import SpecLog
from ps_server.ops.config import ServerConfig
from ps_server.ops.disk_tier import DiskTierDirectory
from ps_server.ops.metrics import Metrics
from ps_server.service.auth import AuthInterceptor, TokenFile
from ps_server.service.context import ShardContext
from ps_server.service.roles import ShardRole, SingleReplica
from ps_server.service.servicer import ParameterServerService
from ps_server.service.standard_services import HealthServicer, add_reflection
from ps_server.service.tcp_lane import TcpLanes
from wehub_ps.process.logs import event
from wehub_ps.wire.rpc import SERVICE_NAME

__all__ = ["PSServer", "create_server"]

log = logging.getLogger("ps_server")

# How long stop() waits, past the grace period in which calls still open are
# cancelled, for gRPC to release them before it gives up on a clean stop.
_STOP_MARGIN_SECONDS = 10.0


class PSServer:
    """A bound, not yet serving, ps-server. Use :func:`create_server`."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.server_id = uuid.uuid4().hex
        spec_log = (SpecLog(config.checkpoint_dir, config.shard_index, config.num_shards)
                    if config.checkpoint_dir else None)
        #: --disk-tier-dir: this process's directory of row files (ps_server.ops.disk_tier).
        self.disk_tier = DiskTierDirectory(config.disk_tier_dir, self.server_id) if config.disk_tier_dir else None
        self.store = VariableStore(config.shard_index, config.num_shards, config.memory_limit, ApplyGate(),
                                   max_rows=config.max_rows, max_variables=config.max_variables,
                                   spec_log=spec_log,
                                   disk_files=self.disk_tier.file_for if self.disk_tier is not None else None)
        self.ledger = PushLedger()
        self.membership = Membership(config.worker_lease)
        self.consistency = ConsistencyController(config.consistency, config.staleness, config.backup_workers,
                                                 self.membership, self.store, config.expected_workers)
        self.lifecycle = Lifecycle()
        self.metrics = Metrics()
        self.metrics.watch_tables(self.store.describe)
        checkpointer = None
        if config.checkpoint_dir:
            checkpointer = Checkpointer(self.store, self.ledger, config.checkpoint_dir, self.server_id,
                                        keep=config.keep_checkpoints, interval=config.checkpoint_interval,
                                        full_every=config.full_checkpoint_every,
                                        persist_open_pushes=config.consistency != "sync",
                                        on_written=self.metrics.checkpoint_written,
                                        consistency_state=self.consistency.snapshot)
        #: Set by a client's finish() (with --allow-finish): the daemon then shuts down.
        self.finish_requested = threading.Event()
        #: The checkpoint the store was restored from (Describe reports it), set by restore().
        self.restored_from: RestoredFrom | None = None
        workers = WorkerPresence(self.membership, self.consistency)
        max_chunk_bytes = config.max_message_bytes // 2
        #: --replicas > 1: this process's role in its shard's replica set (ps_server.replication).
        self.replica = None
        role: ShardRole = SingleReplica()
        if config.replicas > 1:
            from ps_server.replication.wiring import ReplicaWiring

            self.replica = ReplicaWiring(self)
            role = self.replica.role
            if checkpointer is not None:
                replica_role = self.replica.role
                checkpointer.holds_state = lambda: replica_role.has_state
        admission = Admission(config.max_concurrent_rpcs, config.max_exchange_streams)
        #: The bearer token (--auth-token-file) that gRPC calls, lanes and metrics scrapes must present.
        self.tokens = TokenFile(config.auth_token_file) if config.auth_token_file else None
        #: --lane-port: the TCP lane (ps_server.service.tcp_lane), bound now: Describe reports its port.
        self.lanes: TcpLanes | None = None
        if config.lane_port >= 0:
            self.lanes = TcpLanes(config, lambda raw, wait: self.service.answer_exchange(raw, wait),
                                  admission, self.tokens, name=f"ps{config.shard_index}-lane")
        changes = self.replica.role if self.replica is not None else UNLOGGED
        #: Expiry of hash-table rows (ps_server.core.row_policies): swept on the primary, logged for backups.
        self.sweeper = ExpirySweeper(self.store, changes, config.expiry_interval)
        self.context = ShardContext(
            store=self.store, ledger=self.ledger, lifecycle=self.lifecycle, membership=self.membership,
            consistency=self.consistency, workers=workers,
            pulls=PullPlanner(self.store, self.lifecycle, self.consistency, workers,
                              default_chunk_bytes=config.chunk_bytes, max_chunk_bytes=max_chunk_bytes,
                              changes=changes),
            metrics=self.metrics,
            admission=admission,
            lane_port=(config.advertise_lane_port or self.lanes.port) if self.lanes is not None else 0,
            server_id=self.server_id, max_chunk_bytes=max_chunk_bytes, checkpointer=checkpointer,
            restored_from=lambda: self.restored_from, finish_requested=self.finish_requested,
            allow_finish=config.allow_finish, role=role)
        self.health = HealthServicer()
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.service = ParameterServerService(self.context)
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            # Never share a port with another process: two shards on one port
            # would silently split the traffic between them.
            ("grpc.so_reuseport", 0),
            # Clients ping every 20 s (every 1 s a replicated shard) to notice dead connections; allow it.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.max_ping_strikes", 0),
        ]
        if config.stream_window_bytes:
            # A fixed window instead of gRPC's probe-grown one bounds the memory
            # each push in flight can hold (see DEFAULT_STREAM_WINDOW_BYTES).
            options += [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", config.stream_window_bytes)]
        # One thread per concurrent RPC: streams block their thread while
        # waiting for the network, and the RPC bound makes the pool the cap.
        # Ordinary calls and Exchange streams have bounds of their own (see
        # ps_server.core.admission); gRPC's covers both, so idle streams never
        # take an ordinary call's thread.
        slots = self.context.admission.transport_slots
        self._executor = futures.ThreadPoolExecutor(
            max_workers=slots, thread_name_prefix=f"ps{config.shard_index}-rpc")
        interceptors = []
        if self.tokens is not None:
            interceptors.append(AuthInterceptor(self.tokens))
        self.grpc_server = grpc.server(self._executor, options=options, interceptors=interceptors,
                                       maximum_concurrent_rpcs=slots)
        self.grpc_server.add_generic_rpc_handlers((self.service.generic_handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        add_reflection(self.grpc_server, (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME))
        address = f"{config.host}:{config.port}"
        self.port = _bind(self.grpc_server, address, server_credentials(config))
        # kubelet's native gRPC probes cannot speak TLS: health alone, plaintext, on its own port.
        self.health_server = None
        self.health_port = 0
        if config.health_port:
            self.health_server = grpc.server(futures.ThreadPoolExecutor(2, thread_name_prefix="ps-health"),
                                             options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = _bind(self.health_server, f"{config.host}:{config.health_port}", None)
        self.metrics_port = 0
        self._stop_reaper = threading.Event()
        self._reaper: threading.Thread | None = None
        #: Set by mark_serving: loops for a restored or installed state are then prepared at once.
        self._serving = False

    @property
    def checkpointer(self) -> Checkpointer | None:
        return self.context.checkpointer

    def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def start(self) -> None:
        """Restore, then serve; health turns SERVING once requests can be answered.

        A replica (--replicas > 1) serves as soon as its transport is up: its
        role (ps_server.replication) then follows the shard's primary, or is
        elected and restores from its checkpoints when it holds nothing.
        """
        self.start_transport()
        if self.replica is not None:
            self.mark_serving()
            self.replica.start()
            return
        self.restore()
        self.mark_serving()

    def start_transport(self) -> None:
        """Accept connections; health answers NOT_SERVING and work is refused until ready."""
        self.grpc_server.start()
        if self.lanes is not None:
            self.lanes.start()
        if self.health_server is not None:
            self.health_server.start()
        if self.config.metrics_port:
            self.metrics_port = self.metrics.serve(
                self.config.metrics_port, self.config.host, self.config.tls_cert, self.config.tls_key,
                client_ca=self.config.tls_client_ca,
                token_matches=self.tokens.matches if self.tokens is not None else None)

    def restore(self) -> None:
        """Load the newest intact checkpoint, if any (CheckpointError if unusable)."""
        config = self.config
        if not config.checkpoint_dir:
            return
        started = time.perf_counter()
        restored = load_restore(config.checkpoint_dir, config.shard_index, config.num_shards)
        if restored is None:
            event(log, logging.INFO, "no checkpoint to restore", checkpoint_dir=config.checkpoint_dir)
            return
        self.install(restored)
        self.restored_from = restored.origin
        event(log, logging.INFO, "restored", from_num_shards=restored.from_num_shards,
              resharded=restored.resharded,
              checkpoints={i: str(p) for i, p in restored.checkpoints.items()},
              variables={p.spec.name: p.version for p in self.store.parts()},
              seconds=round(time.perf_counter() - started, 3))
        assert self.checkpointer is not None
        if restored.resharded:
            # Give the new layout a checkpoint of its own right away.
            self.checkpointer.checkpoint("resharded")
        else:
            self.checkpointer.mark_restored(restored.chain)

    def install(self, restored: RestoredState) -> None:
        """Replace the shard's state with a restored one (a checkpoint, or a replica's snapshot)."""
        self.store.restore(restored.parts)
        for part in self.store.parts():
            self.metrics.restored_version.labels(part.spec.name).set(part.version)
        self.ledger.restore(restored.ledger_entries)
        # ssp / sync: step, clocks, workers (and, with the parts, the step's sums) of that instant.
        self.consistency.restore(restored.consistency)
        if self._serving:  # a replica's snapshot, or a primary's restore: otherwise mark_serving does it
            self._prepare_loops()

    def _prepare_loops(self) -> None:
        """Load or compile the loops the shard's variables use, on a thread, so their first push need not.

        Started once the port is open, so that it never delays serving; a
        push that needs a loop before it is ready runs the NumPy kernel
        meanwhile (the same bits).
        """
        loops = loops_for(part.spec for part in self.store.parts())
        if loops:
            # Not a daemon: the interpreter's exit waits for it (under a second) rather than
            # tearing down under LLVM's compiler, which runs without the GIL.
            threading.Thread(target=_prepare_quietly, args=(loops,), name="ps-compile").start()

    def mark_serving(self) -> None:
        """Ready for work: accept requests, health SERVING, port file written."""
        self.lifecycle.open()
        if self.checkpointer is not None:
            self.checkpointer.start_periodic()
        self._reaper = threading.Thread(target=self._reap_leases, name="ps-lease-reaper", daemon=True)
        self._reaper.start()
        self.sweeper.start()
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        if self.config.port_file:
            _write_atomically(self.config.port_file, f"{self.port}\n")
        self._serving = True
        self._prepare_loops()
        event(log, logging.INFO, "serving", host=self.config.host, port=self.port, health_port=self.health_port,
              metrics_port=self.metrics_port, lane_port=self.lanes.port if self.lanes is not None else None,
              tls=bool(self.config.tls_cert),
              mutual_tls=bool(self.config.tls_client_ca), auth=bool(self.config.auth_token_file),
              shard_index=self.config.shard_index, num_shards=self.config.num_shards,
              consistency=self.config.consistency, server_id=self.server_id)

    def _reap_leases(self) -> None:
        interval = max(0.05, self.membership.lease_seconds / 4)
        while not self._stop_reaper.wait(interval):
            self.membership.expire()
            self.metrics.live_workers.set(len(self.membership.live_ids()))

    def stop(self, grace: float = 5.0) -> bool:
        """Health NOT_SERVING, refuse new work, finish pushes in flight, final checkpoint, stop.

        The final checkpoint seals the store's apply gate in the same instant
        as its snapshot: a push still open after the drain timeout is cut off
        at its next chunk (UNAVAILABLE) or after ``grace`` seconds (CANCELLED),
        never acknowledged, and its retry completes it on the restarted server.
        Returns True when every push in flight finished within the drain timeout.
        """
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.replica is not None:
            self.replica.stop()
        event(log, logging.INFO, "draining", pushes_in_flight=self.lifecycle.in_flight)
        self.consistency.close()  # pulls waiting for a step give up
        drained = self.lifecycle.drain(self.config.drain_timeout)
        if not drained:
            event(log, logging.WARNING, "drain timed out", pushes_in_flight=self.lifecycle.in_flight,
                  drain_timeout=self.config.drain_timeout)
        self._stop_reaper.set()
        if self._reaper is not None:
            self._reaper.join()  # a lease expiry may apply a sync step: before the seal, not after
        self.sweeper.stop()  # a sweep changes rows: before the final checkpoint
        if self.checkpointer is not None:
            self.checkpointer.stop_periodic()
            try:
                self.checkpointer.checkpoint("shutdown", final=True)
            except Exception:
                log.exception("final checkpoint failed")
        self.store.gate.seal()  # without a checkpoint dir, or when the final checkpoint failed
        ended_streams = self.service.end_exchange_streams()
        if self.lanes is not None:
            ended_streams += self.lanes.stop()
        if not self.grpc_server.stop(grace).wait(grace + _STOP_MARGIN_SECONDS):
            # SIGTERM must end the process: the final checkpoint is written, and
            # a call gRPC never releases must not keep the pod alive.
            event(log, logging.WARNING, "gRPC server did not stop; exiting anyway",
                  waited_seconds=grace + _STOP_MARGIN_SECONDS)
        if self.health_server is not None:
            self.health_server.stop(0)
        self.metrics.stop()
        self._executor.shutdown(wait=False)
        self.store.close()
        if self.disk_tier is not None:
            self.disk_tier.close()
        event(log, logging.INFO, "stopped", drained=drained, ended_exchange_streams=ended_streams)
        return drained

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self.grpc_server.wait_for_termination(timeout)


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS (and, with a client CA, mutual TLS) credentials from the configured PEM files."""
    if not config.tls_cert:
        return None
    with open(config.tls_key, "rb") as key, open(config.tls_cert, "rb") as cert:
        pair = (key.read(), cert.read())
    client_ca = None
    if config.tls_client_ca:
        with open(config.tls_client_ca, "rb") as f:
            client_ca = f.read()
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def _bind(server: grpc.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    port = (server.add_secure_port(address, credentials) if credentials is not None
            else server.add_insecure_port(address))
    if port == 0:
        raise OSError(f"could not bind {address}")
    return port


def _prepare_quietly(loops: list[str]) -> None:
    """``prepare``, a failure logged: the first push that needs the loop then meets it as it would have."""
    try:
        prepare(loops)
    except Exception as exc:  # noqa: BLE001 - any failure of numba's; the push path handles it again
        event(log, logging.WARNING, "could not prepare the compiled loops", loops=loops, error=repr(exc))


def create_server(config: ServerConfig) -> PSServer:
    """Build a ps-server and bind its port; call ``start()`` to serve."""
    return PSServer(config)


def _write_atomically(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".port-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
