"""PSClient: create, pull and push variables on a cluster of ps-servers.

The public API, over the parts that do the work: the session (connection,
identity, lease, clock: worker_client.session), the variables it knows
(worker_client.registry), the pull path (worker_client.pulls) and the push
path (worker_client.pushes). Tensor bytes are copied once on each side: a
push frames views of the caller's arrays, a pull writes each received chunk
straight into the preallocated result.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from wehub_ps.cluster import (
    CONNECTION_ENVIRONMENT,
    WORKER_ID_ENV,
    ClusterConfigError,
    ps_addresses_from_env,
    task_from_tf_config,
)
from wehub_ps.dtypes import is_wire_float, parse_dtype
from wehub_ps.placement import Partitioner
from wehub_ps.process import allocator
from wehub_ps.specs import Admission, DiskTier, Expiry, Initializer, Optimizer
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.rpc import DEFAULT_CHUNK_BYTES
from worker_client.background import BackgroundPushes, PushHandle
from worker_client.blas_threads import warn_if_blas_oversubscribed
from worker_client.errors import PSError, PSUnavailableError
from worker_client.gpu import GpuTransfers, LazyGpuTransfers
from worker_client.overlap import OverlappedStep, StepPipeline
from worker_client.prefetch import Prefetches
from worker_client.pulls import Puller
from worker_client.push_framing import PushFramer
from worker_client.pushes import Pushes, PushSender
from worker_client.registry import Registry, Variable
from worker_client.session import DEFAULT_LEASE_SECONDS, Session, check_addresses
from worker_client.shard_info import ReplicaInfo, ShardInfo
from worker_client.step import Step
from worker_client.topk import TopKRows

__all__ = ["PSClient", "Variable", "ShardInfo"]

log = logging.getLogger("worker_client")


def _check_wire_dtype(wire_dtype: Any) -> np.dtype | None:
    if wire_dtype is None:
        return None
    dt = parse_dtype(wire_dtype)
    if not is_wire_float(dt):
        raise ValueError(f"wire_dtype must be None, 'float16' or 'bfloat16', got {wire_dtype!r}")
    return dt


class PSClient:
    """A worker's connection to every ps-server of one cluster.

    (Long for its docstrings only: this is the public API, documented where
    users read it; the work is done by the parts it delegates to.)

    Thread-safe: pulls and pushes may run from several threads at once.
    Connecting checks that server ``i`` of ``addresses`` really is shard
    ``i`` of ``len(addresses)``, and raises :class:`ClusterMismatchError`
    otherwise, so a mis-ordered address list can never mis-route data.
    Replicated shards: an entry of ``addresses`` may list a shard's
    replicas, ``"a:7001|b:7001"`` or ``["a:7001", "b:7001"]`` (so may
    PS_ADDRESSES and TF_CONFIG, see wehub_ps.cluster). The client talks to the
    shard's primary; a backup's refusal that names the primary sends the
    retry there at once, and a replica that cannot be reached makes it try
    the next one. A retried push is deduplicated by the new primary's copy
    of the ledger, so a failover neither drops nor repeats it.
    ``connect=False`` (an observer, ``register=False``) skips that check so
    that :meth:`describe_each` can report a cluster with a shard down.
    When a connect attempt fails, the client checks the TLS handshake
    itself (worker_client.transport.handshake) and raises :class:`PSTLSError`, naming
    the mismatch, instead of retrying a set-up that cannot work.

    Tokens: a token given as ``auth_token`` is used as is. One read from
    ``auth_token_file`` is read again whenever a server refuses it; calls
    and streams opened afterwards carry what the file holds then. After
    connecting, a refused token from a file is retried like an unavailable
    server (up to ``retry_timeout``), re-reading the file each time, so a
    worker outlives a rotation whichever of its mount and the servers'
    is updated first. When connecting, a refusal is retried only if the
    file changed: a wrong token fails at once with AuthenticationError.

    Delivery: :meth:`push` returns once every shard involved has applied the
    gradient; each push carries (worker_id, incarnation, sequence) so the
    servers apply it at most once.

    Steps: in asynchronous mode the push of a :meth:`step` of a small model
    brings the next step's values back with it, so a step costs one round
    trip per shard, not two (``prefetch=False`` pulls at every step start).
    The next step uses them only if nothing was pushed since and they are
    under a second old; otherwise it pulls.

    Small requests: each shard keeps one long-lived lane open for pulls and
    pushes that fit one message (``exchange_lane=False``: ordinary gRPC
    calls only). It is the server's TCP lane when the server was started
    with ``--lane-port`` (a round trip about a sixth of one on gRPC, the
    same answers, token and TLS), else a gRPC Exchange stream
    (``tcp_lane=False``: always the stream).

    Compression: ``wire_dtype="bfloat16"`` (or float16) halves the bytes of
    every tensor on the wire. ``topk_ratio=r`` sends only the fraction ``r``
    of each dense gradient's rows with the largest norms (as row updates)
    and adds the rest to the next push's gradient (error feedback, see
    worker_client.topk); it holds one residual per variable pushed, the
    size of the variable.

    Memory: by default the process's malloc keeps freed message-sized
    blocks for reuse (see wehub_ps.process.allocator; glibc only, process-wide):
    otherwise each received message faults in fresh pages, which cost a
    fifth of a worker's CPU; blocks up to 32 MiB come from the heap, so a
    training step's gradient arrays are reused rather than faulted in again
    each step, and the heap keeps free twice the bytes of the largest push
    (a step's values and gradients) instead of giving them back to the
    kernel between steps. It also caps malloc at 2 arenas, so that what
    is kept does not grow with the cores (``MALLOC_ARENA_MAX`` in the
    environment wins). ``keep_freed_buffers=False`` leaves malloc as it is.
    """

    def __init__(
        self,
        addresses: Sequence[str | Sequence[str]] | str,
        worker_id: str | None = None,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        wire_dtype: str | np.dtype | None = None,
        topk_ratio: float | None = None,
        connect_timeout: float = 60.0,
        control_timeout: float = 30.0,
        data_timeout: float = 300.0,
        retry_timeout: float = 300.0,
        register: bool = True,
        heartbeat: bool | None = None,
        exchange_lane: bool = True,
        tcp_lane: bool = True,
        prefetch: bool = True,
        tls_ca: str | bytes | None = None,
        tls_cert: str | bytes | None = None,
        tls_key: str | bytes | None = None,
        server_name: str | None = None,
        auth_token: str | None = None,
        auth_token_file: str | None = None,
        keep_freed_buffers: bool = True,
        connect: bool = True,
    ) -> None:
        addresses = check_addresses(addresses)
        if worker_id is None:
            worker_id = f"{socket.gethostname()}-{os.getpid()}"
        if not isinstance(worker_id, str) or not 0 < len(worker_id) <= 256:
            raise ValueError(f"worker_id must be a string of 1 to 256 characters, got {worker_id!r}")
        if not isinstance(chunk_bytes, int) or not 4096 <= chunk_bytes <= 32 << 20:
            raise ValueError(f"chunk_bytes must be an int in [4096, 32 MiB], got {chunk_bytes!r}")
        for arg, value in (("connect_timeout", connect_timeout), ("control_timeout", control_timeout),
                           ("data_timeout", data_timeout), ("retry_timeout", retry_timeout)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{arg} must be positive seconds, got {value!r}")
        register = register if heartbeat is None else bool(heartbeat)
        if not connect and register:
            raise ValueError("connect=False is for observers: pass register=False too")
        if keep_freed_buffers:
            allocator.keep_freed_buffers(mmap_threshold=allocator.WORKER_MMAP_THRESHOLD)
        warn_if_blas_oversubscribed()
        self._wire_dtype = _check_wire_dtype(wire_dtype)
        topk = TopKRows(topk_ratio) if topk_ratio is not None else None
        self._closed = False
        self._session = session = Session(
            addresses, worker_id, register=register, chunk_bytes=chunk_bytes, control_timeout=control_timeout,
            data_timeout=data_timeout, retry_timeout=retry_timeout, tls_ca=tls_ca, tls_cert=tls_cert,
            tls_key=tls_key, server_name=server_name, auth_token=auth_token, auth_token_file=auth_token_file,
            tcp_lane=tcp_lane)
        self._gpu = LazyGpuTransfers()
        prefetches = Prefetches()
        #: Small pulls and pushes go over a long-lived stream per shard (worker_client.transport.lane).
        sender = PushSender(session, PushFramer(session, self._wire_dtype), prefetches, exchange_lane)
        self._registry = Registry(session, sender.assign)
        self._puller = Puller(session, self._registry, self._gpu, prefetches, self._wire_dtype, exchange_lane)
        self._pushes = Pushes(session, self._registry, sender, self._puller, self._gpu, self._wire_dtype,
                              topk, prefetch, exchange_lane)
        self._background = BackgroundPushes(session, self._registry, self._pushes, self._puller, prefetches,
                                            self._gpu, prefetch and exchange_lane)
        self._steps = StepPipeline(session, self._registry, self._puller, self._background, prefetches)
        try:
            # An observer that skips connecting (ps-admin status) reads each shard on its own.
            lease = DEFAULT_LEASE_SECONDS
            if connect:
                lease, specs = session.connect(connect_timeout)
                for spec in specs:
                    self._registry.remember(spec)
            if register:
                # Register before the first step; a (re)joining worker continues at the cluster's step.
                session.start_heartbeat(lease)
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **kwargs: Any) -> "PSClient":
        """Build from PS_ADDRESSES or TF_CONFIG; worker id from PS_WORKER_ID or TF_CONFIG's task.

        The connection's settings come from the variables of
        :data:`wehub_ps.cluster.CONNECTION_ENVIRONMENT` (PS_TLS_*, PS_SERVER_NAME,
        PS_AUTH_TOKEN_FILE, PS_AUTH_TOKEN) unless given as arguments.
        """
        environ = os.environ if environ is None else environ
        try:
            addresses = ps_addresses_from_env(environ)
            task = task_from_tf_config(environ)
        except ClusterConfigError as exc:
            raise ValueError(str(exc)) from None
        for setting in CONNECTION_ENVIRONMENT:
            if setting.argument not in kwargs and environ.get(setting.name):
                kwargs[setting.argument] = environ[setting.name]
        if "worker_id" not in kwargs:
            if environ.get(WORKER_ID_ENV):
                kwargs["worker_id"] = environ[WORKER_ID_ENV]
            elif task is not None and task.task_type:
                kwargs["worker_id"] = f"{task.task_type}-{task.task_index}"
        return cls(addresses, **kwargs)

    # ---- who this client is, and what it settled with the servers ----

    @property
    def addresses(self) -> tuple[str, ...]:
        """The ps-servers, position = shard index; a replicated shard's replicas joined by '|'."""
        return self._session.addresses

    @property
    def replicas(self) -> tuple[tuple[str, ...], ...]:
        """Each shard's replica addresses, position = shard index."""
        return tuple(shard.replicas for shard in self._session.shards)

    @property
    def primaries(self) -> tuple[str, ...]:
        """The replica each shard's calls go to: its primary, as far as this client knows."""
        return tuple(shard.address for shard in self._session.shards)

    @property
    def worker_id(self) -> str:
        return self._session.worker_id

    @property
    def register(self) -> bool:
        """Whether this client is a worker (holds a lease, counts in ssp/sync), not an observer."""
        return self._session.register

    @property
    def incarnation(self) -> str:
        """New on every construction: tells servers apart this process's pushes from an earlier run's."""
        return self._session.incarnation

    @property
    def chunk_bytes(self) -> int:
        """Bytes of values per message: the one asked for, lowered to the servers' bound on connect."""
        return self._session.chunk_bytes

    @property
    def wire_dtype(self) -> np.dtype | None:
        """The dtype tensors travel in (float16 or bfloat16), or None: each variable's own."""
        return self._wire_dtype

    @property
    def consistency(self) -> str:
        """The servers' --consistency: "async", "ssp" or "sync" (read on connect)."""
        return self._session.consistency

    # ---- the cluster and its variables ----

    def describe(self) -> list[ShardInfo]:
        """Ask every server for its identity and variables (also refreshes the client's cache)."""
        return self._registry.describe()

    def describe_each(self, timeout: float) -> list[ShardInfo | PSError]:
        """Each shard's state, or the error it answered (one try each within ``timeout``, no retries).

        For an operator's view of a cluster with a shard down: unlike
        :meth:`describe`, the shards that answer are shown whatever the others do.
        """
        return self._registry.describe_each(timeout)

    def health(self, timeout: float) -> list[str]:
        """Each shard's gRPC health status ('SERVING', ..., or 'UNREACHABLE'), in shard order.

        A replicated shard's status is its primary's, once a call found it (:meth:`describe_each` does).
        """
        return self._session.health(timeout)

    def replica_health(self, timeout: float) -> list[dict[str, str]]:
        """Each replica's health status by address, per shard in shard order."""
        return self._session.replica_health(timeout)

    def replica_status(self, timeout: float) -> list[dict[str, ReplicaInfo | PSError | None]]:
        """Each replica's replication status (role, epoch, sequence; on a primary its backups' in-sync
        state and lag) by address, per shard in shard order: one Describe each, backups included.

        None for a replica that runs unreplicated; the PSError for one that
        did not answer (unreachable, or refusing while it starts).
        """
        return self._session.replica_status(timeout)

    def variables(self, refresh: bool = False) -> dict[str, Variable]:
        """Variables this client knows; ``refresh`` re-reads them from the servers."""
        if refresh:
            self.describe()
        return self._registry.known()

    def create_variable(
        self,
        name: str,
        shape: Sequence[int] | int,
        dtype: str | np.dtype = "float32",
        initializer: str | Initializer | Any = "zeros",
        optimizer: Optimizer | None = None,
        partitioner: Partitioner | None = None,
        aggregation: str = "mean",
    ) -> Variable:
        """Create a variable on the cluster, or return the existing one.

        Idempotent: the same spec again (from this or any worker) returns the
        existing variable; a different spec under the same name raises
        :class:`VariableConflictError` naming the difference. ``initializer``
        is a name ('zeros', 'constant', 'uniform', 'normal', 'glorot_uniform'),
        an initializer object, or an array with the initial value.
        ``aggregation`` ('mean', 'sum' or 'row_mean') is how synchronous mode
        combines the workers' gradients of a step: 'mean' divides a row's sum
        by the pushes that sent rows of this variable to its shard,
        'row_mean' by the pushes that sent that row (README, "Consistency
        modes"); for whole gradients both divide by the pushes that carried one.
        """
        self._background.raise_failure()
        return self._registry.create_variable(name, shape, dtype, initializer, optimizer, partitioner,
                                              aggregation)

    def create_embedding(
        self,
        name: str,
        dim: int | Sequence[int],
        dtype: str | np.dtype = "float32",
        initializer: str | Initializer = "uniform",
        optimizer: Optimizer | None = None,
        max_rows: int = 0,
        eviction: str = "none",
        aggregation: str = "mean",
        admission: Admission | None = None,
        expiry: Expiry | None = None,
        tier: DiskTier | None = None,
    ) -> Variable:
        """Create (or return) a hash table of rows keyed by unbounded 64-bit ids.

        Rows are created on first touch from the seeded initializer and live on
        shard ``splitmix64(id) % num_shards``. ``max_rows`` bounds the rows per
        shard: beyond it, eviction 'none' refuses new rows (ResourceExhaustedError)
        and 'lru' evicts the least recently used ones. ``aggregation`` is as for
        :meth:`create_variable`: 'row_mean' averages each row over the workers
        that pushed it in a sync step.

        ``admission=Admission(min_count=k, probability=p)``: a new id becomes
        a row only at the training pull that sees it the k-th time (counted
        in a bounded count-min filter per shard), with probability p; until
        then pulls answer its initializer's value (or zeros) and pushes drop
        its gradient. ``expiry=Expiry(steps=n, seconds=s)``: rows not updated
        for n versions of the table on their shard, or s seconds, are removed
        by the shard's next sweep (``--expiry-interval``). ``tier=DiskTier(memory_rows=n)``:
        each shard keeps at most n rows in memory and the rest on its local
        disk (servers need ``--disk-tier-dir``), for tables bigger than memory.
        """
        self._background.raise_failure()
        return self._registry.create_embedding(name, dim, dtype, initializer, optimizer, max_rows, eviction,
                                               aggregation, admission, expiry, tier)

    # ---- pulls and pushes ----

    def pull(self, names: Iterable[str] | str | None = None, *, device: Any = None,
             out: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Current values, ``{name: array}``; all known dense variables when ``names`` is None.

        Blocks until every shard has answered. Arrays are numpy, or CuPy on
        ``device`` ('cuda', 'cuda:1', 1). ``out`` gives preallocated,
        writable, C-contiguous arrays to receive into, and they are returned
        (no allocation per pull: a training loop's memory stays flat): numpy,
        or any DLPack array (PyTorch, JAX, CuPy). Host arrays are written in
        place through DLPack, with no copy in between; CUDA arrays are
        received into a pinned host buffer and copied to their device (needs
        CuPy). Every array is checked first: one that cannot take its values
        (shape, dtype, read-only, strided, a tensor that requires grad:
        InvalidArgumentError) leaves them all untouched.

        Each chunk is read atomically on its server; a variable larger than
        one chunk may mix updates that were being applied during the pull
        (as in any asynchronous parameter server).
        """
        self._background.raise_failure()
        return self._puller.pull(names, device, out)

    def pull_rows(self, name: str, ids: Any, *, device: Any = None) -> Any:
        """Rows ``ids`` of an embedding table, shape ``(len(ids), *row_shape)``, in the order given.

        ``name`` is a hash table (:meth:`create_embedding`; missing rows are
        created from the initializer) or a dense variable (rows along axis 0).
        Repeated ids are fetched once.
        """
        self._background.raise_failure()
        return self._puller.pull_rows(name, ids, device)

    def lookup_rows(self, name: str, ids: Any, *, missing: str = "initializer", device: Any = None) -> Any:
        """Rows ``ids`` as :meth:`pull_rows` returns them, read without changing anything on the servers.

        For evaluation and serving: a hash table's row that does not exist
        is not created; it is answered with the initializer's value for its
        id (``missing="initializer"``: the row it would start from) or with
        zeros (``missing="zeros"``). No access is recorded for LRU eviction,
        and the read is anonymous (no lease, no step), so it waits for no
        consistency mode. Dense tables read as :meth:`pull_rows`.
        """
        modes = {"initializer": ps_pb2.ROW_LOOKUP_READ_ONLY, "zeros": ps_pb2.ROW_LOOKUP_READ_ONLY_ZEROS}
        if missing not in modes:
            raise ValueError(f"missing must be 'initializer' or 'zeros', got {missing!r}")
        self._background.raise_failure()
        return self._puller.pull_rows(name, ids, device, lookup=modes[missing])

    def export_rows(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """Every row of embedding table ``name`` with its id: ``(ids, rows)``, ids sorted, read only.

        For serving and export: a hash table's rows as they are on the
        servers (created by training; unseen ids are not in it), a dense
        table's rows with ids ``0..n-1``. Nothing changes on the servers. A
        row created or evicted while this runs may be in the answer or not:
        export once training has stopped for one instant's table.
        """
        self._background.raise_failure()
        variable = self._registry.resolve([name])[0]
        spec = variable.spec
        if not spec.hash_table:
            return np.arange(spec.shape[0], dtype=np.int64), self.pull([name])[name]
        row_shape = tuple(spec.shape)
        ids, rows = [], []
        for pieces in self._session.export_rows(name):
            for piece in pieces:
                ids.append(np.frombuffer(piece.ids, "<i8"))
                rows.append(np.frombuffer(piece.rows, spec.dtype).reshape(-1, *row_shape))
        all_ids = np.concatenate(ids) if ids else np.empty(0, np.int64)
        all_rows = np.concatenate(rows) if rows else np.empty((0, *row_shape), spec.dtype)
        order = np.argsort(all_ids, kind="stable")
        return all_ids[order].astype(np.int64), all_rows[order]

    def push(self, gradients: Mapping[str, Any], rows: Mapping[str, tuple[Any, Any]] | None = None, *,
             wait: bool = True) -> set[int] | PushHandle:
        """Send gradients; returns once every shard involved has applied them.

        ``gradients`` maps variable names to arrays of exactly the variable's
        shape and dtype (numpy, CuPy or DLPack). ``rows`` maps embedding
        tables to ``(ids, row_gradients)`` (see :meth:`push_rows`); everything
        goes to each shard as one push, which synchronous mode requires of a
        step. Each server runs the optimizers as the chunks arrive. Returns
        the shards pushed to.

        With ``topk_ratio``, the gradients are taken into the residual even
        when this raises PSUnavailableError: a shard's push that was not
        confirmed is sent again, unchanged, at the start of the next push
        (see worker_client.pushes), so do not push the same gradients again.

        ``wait=False`` (async mode only, else OverlapRefusedError): the
        gradients are copied and pushed on a background thread, one push in
        flight at most; returns a :class:`PushHandle` whose ``wait()`` raises
        the push's error. Nobody waited: the client's next call raises it.
        """
        if not wait:
            return self._background.start(gradients, rows)[0]
        self._background.raise_failure()
        return self._pushes.push(gradients, rows)

    def push_rows(self, name: str, ids: Any, gradients: Any) -> set[int]:
        """Sparse update: gradients for rows ``ids`` only; repeated ids are summed first.

        ``gradients`` has shape ``(len(ids), *row_shape)`` and the table's
        dtype. Only the touched rows and their optimizer state change (lazy
        Adam keeps a step count per row). Returns once every shard applied it.
        """
        return self.push({}, rows={name: (ids, gradients)})

    def step(self, names: Iterable[str] | None = None, *, device: Any = None,
             out: Mapping[str, Any] | None = None, overlap: bool = False,
             pull_ahead: bool = False) -> Step | OverlappedStep:
        """A training step: pulls at the start (into ``out`` as :meth:`pull` does); call
        ``step.push(grads)`` at the end.

        ``overlap=True`` (async mode only): ``step.push`` pushes in the
        background while the next step pulls and computes (its values may
        miss this worker's previous push); ``pull_ahead=True`` (without
        ``out``) also reads the next step's values while this one computes.
        See worker_client.overlap.
        """
        if not overlap:
            if pull_ahead:
                raise ValueError("pull_ahead=True needs overlap=True")
            self._background.raise_failure()
            return Step(self._puller, self._pushes, self._session, names, device, out)
        return OverlappedStep(self._steps, names, device, out, pull_ahead)

    def flush(self) -> None:
        """Wait for the background push in flight; raise its error if no call raised it yet."""
        self._background.flush()

    # ---- operator actions ----

    def checkpoint(self) -> list[dict[str, Any]]:
        """Make every server write a checkpoint now; returns once all are durable."""
        self._background.raise_failure()
        return self._session.checkpoint()

    def switchover(self, shard: int, to_replica: int | None = None, timeout: float = 5.0) -> dict[str, Any]:
        """Planned switchover of a replicated shard: its primary hands the role to an in-sync backup
        (``to_replica``, or the one furthest along) once that backup confirmed every change; workers'
        calls wait for it meanwhile and nothing is lost. Returns the shard, the old primary's address
        (``from``), the replica told to take over (``replica_index``, ``address``) and ``seconds``.
        FailedPreconditionError (reason SWITCHOVER_REFUSED) when no such backup is in sync or it did not
        confirm within ``timeout``: the primary then goes on leading."""
        return self._session.switchover(shard, to_replica, timeout)

    def finish(self, wait_for_workers: bool = True, timeout: float = 3600.0) -> None:
        """End a run-to-completion job: every server writes its final checkpoint and exits 0.

        With ``wait_for_workers`` (the chief's case) it first waits until no
        other worker holds a lease, so nobody is cut off mid-training. The
        servers must run with ``--allow-finish``; a long-lived service refuses.
        """
        self._background.flush()
        deadline = time.monotonic() + timeout
        while wait_for_workers:
            others = {w for info in self.describe() for w, record in info.workers.items()
                      if record["live"] and w != self.worker_id}
            if not others:
                break
            if time.monotonic() > deadline:
                raise PSUnavailableError(f"finish: workers {sorted(others)} are still live after {timeout:.0f}s")
            time.sleep(0.5)
        self._session.finish()

    # ---- what the client has seen ----

    @property
    def step_count(self) -> int:
        """Steps completed through :meth:`step` (reported to the servers)."""
        return self._session.state.step

    def stats(self) -> dict[str, int]:
        """Counters: ``retries`` (RPC attempts repeated), ``duplicate_acks`` (retried
        pushes the server had already applied), ``rollbacks`` (versions that went
        backwards: a server restored an older checkpoint), ``dropped_pushes``
        (sync mode: per shard, pushes that arrived after their step was applied),
        ``prefetched_steps`` (steps that began with values their previous step's
        push brought back, instead of a pull)."""
        return self._session.state.stats()

    def gradient_residuals(self) -> dict[str, np.ndarray]:
        """With ``topk_ratio``: per variable, the gradient rows not sent yet (error feedback), as copies."""
        topk = self._pushes.topk
        return {} if topk is None else topk.residuals()

    def versions(self, name: str) -> dict[int, int]:
        """Per shard, the newest version of ``name`` this client's pulls and pushes have seen."""
        return self._session.state.versions(name)

    def gpu_transfers(self) -> GpuTransfers:
        """This client's GPU transfers (pinned buffers, a stream per device), made on first use.

        For code that moves arrays to and from GPUs alongside the client
        (worker_client.replicas.ReplicaGroup), so both share the same
        buffers and streams. Needs CuPy.
        """
        return self._gpu.get()

    # ---- the end ----

    def close(self) -> None:
        """Close every channel; the client cannot be used afterwards. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._background.close()  # the push in flight completes first; its unseen error is logged
        self._session.closed = True
        unfinished = self._pushes.unfinished
        if unfinished:  # top-k pushes no later push completed (see worker_client.pushes)
            addresses = [self._session.shards[shard].address for shard in sorted(unfinished)]
            log.warning("top-k push left unfinished on ps-server %s: the client was closed before a later "
                        "push completed it; it may be partly applied", ", ".join(addresses),
                        extra={"fields": {
                            "shards": sorted(unfinished), "addresses": addresses,
                            "meaning": "the client was closed before a push completed them; they may be "
                                       "partly applied"}})
        self._session.close()

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
