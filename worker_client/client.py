"""PSClient: create, pull and push variables on a cluster of ps-servers.

One channel per shard; a pull or push runs on all shards involved at once
(one thread per shard, gRPC releases the GIL while waiting). Tensor bytes
are copied once on each side: a push frames views of the caller's arrays,
a pull writes each received chunk straight into the preallocated result.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from wehub_ps.process import allocator
from wehub_ps.cluster import (
    AUTH_TOKEN_ENV,
    AUTH_TOKEN_FILE_ENV,
    SERVER_NAME_ENV,
    TLS_CA_ENV,
    TLS_CERT_ENV,
    TLS_KEY_ENV,
    WORKER_ID_ENV,
    ClusterConfigError,
    ps_addresses_from_env,
    split_host_port,
    task_from_tf_config,
)
from wehub_ps.wire.codec import (
    EXCHANGE_PULL,
    EXCHANGE_PUSH,
    OutgoingChunk,
    as_wire_array,
    byte_view,
    chunk_ranges,
    encode_chunk_header,
    encode_push_begin,
    encode_push_item,
    join_pieces,
    push_request_pieces,
    split_push_response,
)
from wehub_ps.kernels.convert import cast_into
from wehub_ps.dtypes import BFLOAT16, dtype_name, parse_dtype
from wehub_ps.wire.dtypes import to_wire_dtype
from wehub_ps.placement import MinSizePartitioner, Partitioner, Placement, hash_shards
from wehub_ps.kernels.rowops import RowGather, put_rows, take_rows
from wehub_ps.wire.rpc import DEFAULT_CHUNK_BYTES
from wehub_ps.kernels.segments import sort_ids, sum_sorted
from wehub_ps.specs import (
    SGD,
    Constant,
    Explicit,
    GlorotUniform,
    Initializer,
    Normal,
    Optimizer,
    Uniform,
    VariableSpec,
    Zeros,
    initializer_from_name,
)
from wehub_ps.specs_proto import spec_from_proto, spec_to_proto
from wehub_ps.v1 import ps_pb2
from worker_client.arrays import is_gpu_array, parse_device, to_device, to_host
from worker_client.transport.credentials import BearerToken, tls_material
from worker_client.errors import (
    AuthenticationError,
    ClusterMismatchError,
    DTypeMismatchError,
    InvalidArgumentError,
    PSError,
    PSUnavailableError,
    PushWrittenOffError,
    ShapeMismatchError,
    VariableNotFoundError,
)
from worker_client.transport.fanout import ShardCall, run_shard_calls
from worker_client.gpu import GpuTransfers
from worker_client.transport.handshake import diagnose
from worker_client.pulls import PullItem, PullReceiver, pull_request
from worker_client.transport.retry import RetryPolicy, call_with_retry
from worker_client.step import Step
from worker_client.topk import TopKRows
from worker_client.transport.channels import ShardChannel

__all__ = ["PSClient", "Variable", "ShardInfo"]

log = logging.getLogger("worker_client")

_WIRE_DTYPES = (np.dtype("float16"), BFLOAT16)
_INITIALIZER_TYPES = (Zeros, Constant, Uniform, Normal, GlorotUniform)
# At most this long to name a TLS mismatch after a failed connect attempt (two handshakes).
_TLS_CHECK_SECONDS = 5.0
# create_variable validates on every shard again (renewing the bookings, which servers keep 60 s)
# when one round of validation took longer than this; at most this many rounds.
_BOOKING_RENEW_SECONDS = 20.0
_VALIDATE_ROUNDS = 3


@dataclass(frozen=True)
class Variable:
    """A variable as the cluster holds it."""

    spec: VariableSpec
    #: Row ranges per shard; None for hash tables (placed by id).
    placement: Placement | None
    created: bool = False

    # Cached: a step reads them several times per variable.
    @functools.cached_property
    def name(self) -> str:
        return self.spec.name

    @functools.cached_property
    def shape(self) -> tuple[int, ...]:
        return self.spec.shape

    @functools.cached_property
    def dtype(self) -> np.dtype:
        return self.spec.dtype

    @functools.cached_property
    def element_ranges(self) -> tuple[tuple[int, int, int], ...]:
        """(shard, first, end) flat element ranges of each part, computed once.

        A step of a small model looks these up for every variable twice;
        deriving them from the placement each time showed in the profile
        (yappi: 40 calls of rows_of and row_elements per 20-variable step).
        """
        width = self.spec.row_elements
        return tuple((p.shard, p.row_start * width, p.row_end * width) for p in self.placement.parts)


@dataclass(frozen=True)
class ShardInfo:
    """What one ps-server reports about itself."""

    address: str
    shard_index: int
    num_shards: int
    server_id: str
    server_version: str
    variables: dict[str, dict[str, Any]]
    chunk_bytes_limit: int = 0
    worker_lease_seconds: float = 0.0
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    last_checkpoint: dict[str, Any] | None = None
    restored_from: dict[str, Any] | None = None
    consistency: dict[str, Any] = field(default_factory=dict)
    stored_bytes: int = 0
    memory_limit_bytes: int = 0


#: A step's values brought back by the previous step's push are used only
#: this soon after; a loop that pauses longer between steps pulls again.
PREFETCH_MAX_AGE_SECONDS = 1.0


@dataclass(frozen=True)
class _NextPull:
    """What the next step will pull: its variable names (None: all dense) and device."""

    names: tuple[str, ...] | None
    gpu: int | None


@dataclass
class _Prefetch:
    """Values pulled by a step's push for the next step, and when."""

    next_pull: _NextPull
    out: dict[str, np.ndarray]
    by_shard: dict[int, list[PullItem]]
    generation: int = -1
    fetched_at: float = 0.0


@dataclass
class _PushItem:
    """One variable's part (or rows) pushed to one shard.

    ``values``: flat values, or rows still to be gathered from the caller's
    gradients (straight into the message, rowops.RowGather).
    """

    name: str
    values: np.ndarray | RowGather
    row_ids: bytes = b""
    row_elements: int = 1


@dataclass
class _ShardPush:
    """One shard's part of a push as it is sent: every retry sends exactly this again."""

    shard_index: int
    items: list[_PushItem]
    kind: int
    sequence: int
    base_versions: dict[str, int]
    step: int
    pull_after: bytes | None = None
    #: Where the values pull_after asks for go.
    after: list[PullItem] | None = None

    def detached(self) -> _ShardPush:
        """The same push with its own copy of the values (the caller's arrays may change), no pull_after."""
        items = [_PushItem(i.name, RowGather(i.values.gather(), np.arange(len(i.values.rows)))
                           if isinstance(i.values, RowGather) else i.values.copy(), i.row_ids, i.row_elements)
                 for i in self.items]
        return _ShardPush(self.shard_index, items, self.kind, self.sequence, self.base_versions, self.step)


@dataclass
class _PushOutcome:
    """What became of each shard's push of one push() call."""

    sent: dict[int, _ShardPush] = field(default_factory=dict)
    delivered: set[int] = field(default_factory=set)
    failed: dict[int, BaseException] = field(default_factory=dict)


#: The worker lease assumed when no server states one (the servers' own default).
_DEFAULT_LEASE_SECONDS = 30.0


def _may_complete_later(error: BaseException | None) -> bool:
    """Whether the same push, sent again, can still complete: the shard did not answer (or was cut off)."""
    return not isinstance(error, PSError) or isinstance(error, PSUnavailableError)


def _refused_whole(error: BaseException | None) -> bool:
    """Whether the shard refused the push, so none of it was applied.

    A server refuses a push before it applies anything. A push written off
    by the shard's ledger may be partly applied and is not counted here.
    """
    return error is not None and not _may_complete_later(error) and not isinstance(error, PushWrittenOffError)


_conversion = threading.local()


class _ConversionArena:
    """This thread's reusable memory for chunks converted to a narrower wire dtype.

    Every converted chunk of one message gets its own region. A message's
    regions are its own from its first ``take`` until the ``reset`` before
    the next message built on this thread takes any: the caller joins
    (copies out) each message before it asks for the next one, so a chunk
    is never overwritten before it is sent, and a retry converts its chunks
    again from the unchanged gradient (the same bytes). The memory holds
    one message's converted chunks at most and is reused by the next, so a
    training loop allocates it once per thread.
    """

    def __init__(self) -> None:
        self._buffers: dict[np.dtype, np.ndarray] = {}
        self._used: dict[np.dtype, int] = {}

    def take(self, dtype: np.dtype, size: int) -> np.ndarray:
        used = self._used.get(dtype, 0)
        buffer = self._buffers.get(dtype)
        if buffer is None or used + size > buffer.size:
            # A bigger buffer; views handed out earlier keep the old one alive.
            buffer = self._buffers[dtype] = np.empty(max(size, 2 * used + size), dtype=dtype)
            used = 0
        self._used[dtype] = used + size
        return buffer[used:used + size]

    def reset(self) -> None:
        self._used.clear()


def _conversion_arena() -> _ConversionArena:
    arena = getattr(_conversion, "arena", None)
    if arena is None:
        arena = _conversion.arena = _ConversionArena()
    return arena


def _check_ids(ids: Any, argument: str) -> np.ndarray:
    array = to_host(ids, argument)
    if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
        raise InvalidArgumentError(f"{argument} must be a 1-D array of integer ids, got dtype "
                                   f"{array.dtype} and shape {array.shape}")
    if array.dtype == np.uint64 and array.size and array.max() > np.iinfo(np.int64).max:
        array = array.view(np.int64)  # ids are 64-bit patterns; keep them bit-exact
    return array.astype(np.int64, copy=False)


def _check_array(array: np.ndarray, shape: tuple[int, ...], dtype: np.dtype, what: str) -> None:
    if array.shape != tuple(shape):
        raise ShapeMismatchError(f"{what} has shape {array.shape}, expected {tuple(shape)}")
    if array.dtype != dtype and parse_dtype(array.dtype) != dtype:
        raise DTypeMismatchError(f"{what} has dtype {dtype_name(array.dtype)}, expected {dtype_name(dtype)}; "
                                 f"cast it with .astype({dtype_name(dtype)!r})")


_FLOAT16_MAX = float(np.finfo(np.float16).max)


def _check_fits_wire(values: np.ndarray, wire_dtype: np.dtype | None, what: str) -> None:
    """Refuse finite gradient values that float16 on the wire cannot hold.

    The cast would turn them into ±inf, and the optimizer would then make the
    variable inf or NaN for good, with nothing reported. NaN and ±inf given
    by the caller are sent as they are (as with float32 on the wire).
    Two reductions over the gradient; only with ``wire_dtype="float16"``.
    """
    if wire_dtype != np.float16 or values.dtype.itemsize <= 2 or not values.size:
        return
    flat = values.reshape(-1)
    low, high = float(np.fmin.reduce(flat)), float(np.fmax.reduce(flat))  # NaN is skipped
    if max(-low, high) <= _FLOAT16_MAX:
        return
    if not (math.isfinite(low) and math.isfinite(high)):  # ±inf given: is a finite value too large as well?
        finite_too_large = np.isfinite(flat) & (np.abs(flat) > _FLOAT16_MAX)
        if not finite_too_large.any():
            return
        low = high = float(flat[np.argmax(finite_too_large)])
    worst = high if high > _FLOAT16_MAX else low
    raise InvalidArgumentError(
        f"{what} holds {worst:g}, beyond {_FLOAT16_MAX:g}, the largest float16: with wire_dtype='float16' it "
        "would arrive as inf and ruin the variable; nothing was sent. Scale or clip the gradient, or use "
        "wire_dtype='bfloat16' (float32's range)")


def _check_addresses(addresses: Sequence[str] | str) -> tuple[str, ...]:
    if isinstance(addresses, str):
        addresses = [a.strip() for a in addresses.split(",") if a.strip()]
    if not addresses:
        raise ValueError("addresses must list at least one ps-server as 'host:port', got an empty list")
    for address in addresses:
        if not isinstance(address, str):
            raise TypeError(f"addresses must be strings 'host:port', got {address!r}")
        try:
            split_host_port(address)
        except ClusterConfigError as exc:
            raise ValueError(f"addresses: {exc}") from None
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"addresses must not repeat a server, got {list(addresses)}")
    return tuple(addresses)


class PSClient:
    """A worker's connection to every ps-server of one cluster.

    Thread-safe: pulls and pushes may run from several threads at once.
    Connecting checks that server ``i`` of ``addresses`` really is shard
    ``i`` of ``len(addresses)``, and raises :class:`ClusterMismatchError`
    otherwise, so a mis-ordered address list can never mis-route data.
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

    Compression: ``wire_dtype="bfloat16"`` (or float16) halves the bytes of
    every tensor on the wire. ``topk_ratio=r`` sends only the fraction ``r``
    of each dense gradient's rows with the largest norms (as row updates)
    and adds the rest to the next push's gradient (error feedback, see
    worker_client.topk); it holds one residual per variable pushed, the
    size of the variable.

    Memory: by default the process's malloc keeps freed message-sized
    blocks for reuse (see wehub_ps.process.allocator; glibc only, process-wide):
    otherwise each received message faults in fresh pages, which cost a
    fifth of a worker's CPU. It also caps malloc at 2 arenas, so that what
    is kept does not grow with the cores (``MALLOC_ARENA_MAX`` in the
    environment wins). ``keep_freed_buffers=False`` leaves malloc as it is.
    """

    def __init__(
        self,
        addresses: Sequence[str] | str,
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
        self.addresses = _check_addresses(addresses)
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
        self.worker_id = worker_id
        if keep_freed_buffers:
            allocator.keep_freed_buffers()
        #: A registered client is a worker: it holds a lease and counts in the
        #: ssp/sync modes. Unregistered ones (evaluators, admin tools) only observe.
        self.register = register if heartbeat is None else bool(heartbeat)
        #: New on every construction: tells servers apart retries of this
        #: process from pushes of an earlier run with the same worker_id.
        self.incarnation = uuid.uuid4().hex
        self.chunk_bytes = chunk_bytes
        #: Small pulls and pushes go over a long-lived stream per shard (worker_client.transport.lane).
        self._use_lane = exchange_lane
        self.wire_dtype = self._check_wire_dtype(wire_dtype)
        self._topk = TopKRows(topk_ratio) if topk_ratio is not None else None
        self._control_timeout = control_timeout
        self._data_timeout = data_timeout
        self._retry = RetryPolicy(timeout=retry_timeout)
        self._tls = tls_material(tls_ca, tls_cert, tls_key)
        self._server_name = server_name
        self._token = BearerToken(auth_token, auth_token_file)
        credentials = self._tls.channel_credentials() if self._tls is not None else None
        self._shards = [ShardChannel(i, a, credentials=credentials, server_name=server_name,
                                     token=self._token, incarnation=self.incarnation,
                                     request_timeout=data_timeout)
                        for i, a in enumerate(self.addresses)]
        self._executor = futures.ThreadPoolExecutor(
            max_workers=max(2, 2 * len(self._shards)), thread_name_prefix=f"ps-client-{worker_id}")
        # Guards _variables, _versions, _calls_started, _sequences, _stats and _step.
        self._lock = threading.Lock()
        self._variables: dict[str, Variable] = {}
        #: Per variable and shard: the newest version seen, and the value of
        #: _calls_started when it was seen (see _record_versions).
        self._versions: dict[str, dict[int, int]] = {}
        self._versions_seen_at: dict[tuple[str, int], int] = {}
        #: Pulls and pushes started so far; each takes the count as its ticket.
        self._calls_started = 0
        self._sequences = [itertools.count(1) for _ in self._shards]
        self._stats = {"retries": 0, "duplicate_acks": 0, "rollbacks": 0, "dropped_pushes": 0,
                       "prefetched_steps": 0}
        self._step = 0
        #: Step.push brings the next step's values back with it (see _push_step).
        self._prefetch = prefetch
        #: Counts pushes started by this client; a prefetch is used only while
        #: no push started after its own (so every push is seen by the next step).
        self._push_generation = 0
        self._prefetched: dict[int, _Prefetch] = {}
        #: Top-k: per shard, the push it did not confirm, sent again before the next one
        #: (guarded by the compressor's pushing(); see _push_topk).
        self._unfinished: dict[int, _ShardPush] = {}
        #: The servers' --consistency: "async", "ssp" or "sync" (read on connect).
        self.consistency = "async"
        self._closed = False
        self._gpu: GpuTransfers | None = None  # created on first use of a GPU
        self._stop_heartbeat = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        if not connect and self.register:
            raise ValueError("connect=False is for observers: pass register=False too")
        try:
            # An observer that skips connecting (ps-admin status) reads each shard on its own.
            lease = self._connect(connect_timeout) if connect else _DEFAULT_LEASE_SECONDS
            if self.register:
                # Register before the first step; a (re)joining worker continues at the cluster's step.
                self._heartbeat_all(self._control_timeout, adopt_step=True)
                self._heartbeat_thread = threading.Thread(
                    target=self._heartbeat_loop, args=(max(0.2, lease / 3),),
                    name=f"ps-heartbeat-{worker_id}", daemon=True)
                self._heartbeat_thread.start()
        except BaseException:
            self.close()
            raise

    # ---- construction helpers ----

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **kwargs: Any) -> "PSClient":
        """Build from PS_ADDRESSES or TF_CONFIG; worker id from PS_WORKER_ID or TF_CONFIG's task."""
        environ = os.environ if environ is None else environ
        try:
            addresses = ps_addresses_from_env(environ)
            task = task_from_tf_config(environ)
        except ClusterConfigError as exc:
            raise ValueError(str(exc)) from None
        for key, variable in (("tls_ca", TLS_CA_ENV), ("tls_cert", TLS_CERT_ENV), ("tls_key", TLS_KEY_ENV),
                              ("server_name", SERVER_NAME_ENV), ("auth_token_file", AUTH_TOKEN_FILE_ENV),
                              ("auth_token", AUTH_TOKEN_ENV)):
            if key not in kwargs and environ.get(variable):
                kwargs[key] = environ[variable]
        if "worker_id" not in kwargs:
            if environ.get(WORKER_ID_ENV):
                kwargs["worker_id"] = environ[WORKER_ID_ENV]
            elif task is not None and task.task_type:
                kwargs["worker_id"] = f"{task.task_type}-{task.task_index}"
        return cls(addresses, **kwargs)

    @staticmethod
    def _check_wire_dtype(wire_dtype: Any) -> np.dtype | None:
        if wire_dtype is None:
            return None
        dt = parse_dtype(wire_dtype)
        if dt not in _WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be None, 'float16' or 'bfloat16', got {wire_dtype!r}")
        return dt

    def _connect(self, timeout: float) -> float:
        """Check the cluster's identity; returns the shortest worker lease of the servers."""
        connect_policy = RetryPolicy(timeout=timeout, warn_after=min(10.0, timeout / 2))
        infos = self._on_shards(range(len(self._shards)), lambda s: call_with_retry(
            lambda: self._connect_once(s, timeout), connect_policy, "connect", s.address,
            also_retry=lambda error: self._token_may_be_rotated(error, changed_only=True)))
        wrong = [f"{info.address} says it is shard {info.shard_index} of {info.num_shards}"
                 for i, info in infos.items()
                 if (info.shard_index, info.num_shards) != (i, len(self._shards))]
        # Never send a message a server would refuse for its size.
        limits = [info.chunk_bytes_limit for info in infos.values() if info.chunk_bytes_limit]
        if limits:
            self.chunk_bytes = min(self.chunk_bytes, *limits)
        if wrong:
            raise ClusterMismatchError(
                f"the address list {list(self.addresses)} does not match the cluster: "
                + "; ".join(wrong) + f" (position in the list = shard index, length = {len(self._shards)})")
        modes = {info.consistency.get("mode", "async") for info in infos.values()}
        if len(modes) > 1:
            raise ClusterMismatchError(f"the servers run different consistency modes {sorted(modes)}; "
                                       "start every ps-server with the same --consistency")
        # The mode's bound too: shards with different ones would hold the same step differently.
        bound = {"ssp": ("staleness", "--staleness"), "sync": ("backup_workers", "--backup-workers")}
        for key, flag in [bound[mode] for mode in modes if mode in bound]:
            values = {info.address: info.consistency.get(key, 0) for info in infos.values()}
            if len(set(values.values())) > 1:
                raise ClusterMismatchError(
                    f"the servers run with different {flag} ("
                    + ", ".join(f"{address}: {value}" for address, value in values.items())
                    + f"); start every ps-server with the same {flag}")
        self.consistency = modes.pop()
        leases = [info.worker_lease_seconds for info in infos.values() if info.worker_lease_seconds > 0]
        return min(leases) if leases else _DEFAULT_LEASE_SECONDS

    def _connect_once(self, shard: ShardChannel, timeout: float) -> ShardInfo:
        """One Describe; when it fails as unavailable, PSTLSError if the TLS set-up is the cause."""
        try:
            return self._describe_once(shard, self._control_timeout)
        except PSUnavailableError as error:
            mismatch = diagnose(shard.address, self._tls, self._server_name, min(_TLS_CHECK_SECONDS, timeout))
            if mismatch is not None:
                raise mismatch from error
            raise

    def _describe_shard(self, shard: ShardChannel) -> ShardInfo:
        return self._call(shard, "describe", lambda: self._describe_once(shard, self._control_timeout))

    def _describe_once(self, shard: ShardChannel, timeout: float) -> ShardInfo:
        raw = shard.describe(ps_pb2.DescribeRequest().SerializeToString(), timeout)
        msg = ps_pb2.DescribeResponse.FromString(raw)
        variables = {}
        for info in msg.variables:
            spec = spec_from_proto(info.spec)
            self._remember(spec)
            variables[spec.name] = {"row_start": info.row_start, "row_end": info.row_end,
                                    "version": info.version, "initialized": info.initialized,
                                    "optimizer_steps": info.optimizer_steps, "num_rows": info.num_rows,
                                    "evicted_rows": info.evicted_rows}
        workers = {w.worker_id: {"incarnation": w.incarnation, "live": w.live, "step": w.step,
                                 "seconds_since_seen": w.seconds_since_seen, "pushes": w.pushes}
                   for w in msg.workers}
        checkpoint = None
        if msg.HasField("last_checkpoint"):
            c = msg.last_checkpoint
            checkpoint = {"checkpoint_id": c.checkpoint_id, "path": c.path, "created_unix": c.created_unix,
                          "bytes": c.bytes, "write_seconds": c.write_seconds, "pause_seconds": c.pause_seconds}
        restored = None
        if msg.HasField("restored_from"):
            r = msg.restored_from
            restored = {"checkpoint_id": r.checkpoint_id, "path": r.path, "created_unix": r.created_unix,
                        "num_shards": r.num_shards}
        c = msg.consistency
        consistency = {"mode": c.mode or "async", "staleness": c.staleness, "backup_workers": c.backup_workers,
                       "step": c.step, "pulls": c.pulls, "pulls_blocked": c.pulls_blocked,
                       "blocked_seconds": c.blocked_seconds, "max_staleness_admitted": c.max_staleness_admitted,
                       "dropped_gradients": c.dropped_gradients, "steps_applied": c.steps_applied}
        return ShardInfo(shard.address, msg.shard_index, msg.num_shards, msg.server_id,
                         msg.server_version, variables, msg.chunk_bytes_limit, msg.worker_lease_seconds,
                         workers, checkpoint, restored, consistency, msg.stored_bytes, msg.memory_limit_bytes)

    def describe_each(self, timeout: float) -> list[ShardInfo | PSError]:
        """Each shard's state, or the error it answered (one try each within ``timeout``, no retries).

        For an operator's view of a cluster with a shard down: unlike
        :meth:`describe`, the shards that answer are shown whatever the others do.
        """
        def one(shard: ShardChannel) -> ShardInfo | PSError:
            try:
                return self._describe_once(shard, timeout)
            except PSError as error:
                return error

        return [result for _, result in sorted(self._on_shards(range(len(self._shards)), one).items())]

    def _remember(self, spec: VariableSpec, created: bool = False) -> Variable:
        placement = None if spec.hash_table else spec.placement(len(self._shards))
        variable = Variable(spec, placement, created)
        with self._lock:
            self._variables.setdefault(spec.name, variable)
            return self._variables[spec.name]

    # ---- public API ----

    def describe(self) -> list[ShardInfo]:
        """Ask every server for its identity and variables (also refreshes the client's cache)."""
        infos = self._on_shards(range(len(self._shards)), self._describe_shard)
        return [infos[i] for i in range(len(self._shards))]

    def variables(self, refresh: bool = False) -> dict[str, Variable]:
        """Variables this client knows; ``refresh`` re-reads them from the servers."""
        if refresh:
            self.describe()
        with self._lock:
            return dict(self._variables)

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
        ``aggregation`` ('mean' or 'sum') is how synchronous mode combines the
        workers' gradients of a step.
        """
        shape_t = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        initial: np.ndarray | None = None
        if isinstance(initializer, str):
            init = initializer_from_name(initializer)
        elif isinstance(initializer, _INITIALIZER_TYPES):
            init = initializer
        else:
            initial = to_host(initializer, "initializer")
            if initial.shape != shape_t:
                raise ShapeMismatchError(f"initializer has shape {initial.shape}, but shape is {shape_t}")
            target = parse_dtype(dtype)
            if initial.dtype != target:
                raise DTypeMismatchError(
                    f"initializer has dtype {dtype_name(initial.dtype)}, but dtype is {dtype_name(target)}")
            initial = as_wire_array(initial)
            init = Explicit(hashlib.sha256(byte_view(initial)).digest())
        spec = VariableSpec(name=name, shape=shape_t, dtype=dtype, initializer=init,
                            optimizer=optimizer if optimizer is not None else SGD(),
                            partitioner=partitioner if partitioner is not None else MinSizePartitioner(),
                            aggregation=aggregation)
        placement = spec.placement(len(self._shards))
        results = self._create_everywhere(spec)
        created = any(r.created for r in results.values())
        if initial is not None:
            width = spec.row_elements
            pending = {p.shard: [_PushItem(name, initial[p.row_start * width:p.row_end * width])]
                       for p in placement.parts if not results[p.shard].variable.initialized}
            if pending:
                self._send_push(pending, ps_pb2.ASSIGN)
        with self._lock:
            self._variables[name] = Variable(spec, placement, created)
            return self._variables[name]

    def _create_everywhere(self, spec: VariableSpec) -> dict[int, ps_pb2.CreateVariableResponse]:
        """Create ``spec`` on every shard, after every shard accepted it; each shard's answer.

        Every shard records the spec (so conflicts are caught everywhere);
        only the shards in the placement allocate rows. Every shard first
        validates the create (spec, conflict, its limits) and books the
        part's memory without creating anything: a create that one shard
        refuses leaves no part on the others (where it would make every
        client's pull() of all variables fail), and the bookings are given
        back. A create that a shard still refuses after every shard accepted
        it (its booking expired, or the server restarted in between) leaves
        the parts made so far; calling create_variable again completes it.
        """
        shards = range(len(self._shards))
        booking = uuid.uuid4().hex

        def validate(shard: ShardChannel) -> ps_pb2.CreateVariableResponse | Exception:
            try:
                return self._create_on(shard, spec, validate_only=True, booking=booking)
            except Exception as exc:  # collected: the other shards' bookings are given back first
                return exc

        for _ in range(_VALIDATE_ROUNDS):
            started = time.monotonic()
            answers = self._on_shards(shards, validate)
            errors = {i: a for i, a in answers.items() if isinstance(a, Exception)}
            if errors:
                self._cancel_bookings([i for i in shards if i not in errors], spec, booking)
                raise errors[min(errors)]
            if time.monotonic() - started < _BOOKING_RENEW_SECONDS:
                break  # (otherwise validate again: that renews every booking)
        return self._on_shards(shards, lambda s: self._create_on(s, spec))

    def _cancel_bookings(self, shards: list[int], spec: VariableSpec, booking: str) -> None:
        """Give back the bookings of a create that another shard refused; best effort (they expire)."""
        def cancel(shard: ShardChannel) -> None:
            try:
                self._create_on(shard, spec, validate_only=True, booking=booking, cancel=True)
            except PSError as exc:
                log.debug("create_variable: booking not given back (it expires)",
                          extra={"fields": {"variable": spec.name, "address": shard.address,
                                            "error": str(exc)}})
        self._on_shards(shards, cancel)

    def _create_on(self, shard: ShardChannel, spec: VariableSpec, validate_only: bool = False,
                   booking: str = "", cancel: bool = False) -> ps_pb2.CreateVariableResponse:
        request = ps_pb2.CreateVariableRequest(spec=spec_to_proto(spec), shard_index=shard.index,
                                               num_shards=len(self._shards), validate_only=validate_only,
                                               booking=booking, cancel_booking=cancel).SerializeToString()
        return ps_pb2.CreateVariableResponse.FromString(self._call(
            shard, "create_variable", lambda: shard.create_variable(request, self._control_timeout)))

    def pull(self, names: Iterable[str] | str | None = None, *, device: Any = None,
             out: Mapping[str, np.ndarray] | None = None) -> dict[str, Any]:
        """Current values, ``{name: array}``; all known dense variables when ``names`` is None.

        Blocks until every shard has answered. Arrays are numpy, or CuPy on
        ``device`` ('cuda', 'cuda:1', 1). ``out`` gives preallocated,
        C-contiguous arrays to receive into (no allocation per pull: a training
        loop's memory stays flat). Each chunk is read atomically on its
        server; a variable larger than one chunk may mix updates that were
        being applied during the pull (as in any asynchronous parameter server).
        """
        gpu = parse_device(device)
        if out is not None and gpu is not None:
            raise ValueError("pull: out= receives on the host; it cannot be combined with device=")
        given = dict(out or {})
        for name, array in given.items():
            if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
                raise TypeError(f"out[{name!r}] must be a C-contiguous numpy array")
        out, by_shard = self._pull_targets(self._dense(names), gpu, given)
        self._pull_all(by_shard)
        return self._deliver(out, gpu)

    def _dense(self, names: Iterable[str] | str | None) -> list[Variable]:
        """The variables a whole-variable pull reads: all dense ones when ``names`` is None."""
        variables = [v for v in self._resolve(names) if names is not None or not v.spec.hash_table]
        for v in variables:
            if v.spec.hash_table:
                raise InvalidArgumentError(f"{v.name!r} is a hash table: read it with pull_rows(name, ids)")
        return variables

    def _pull_targets(self, variables: list[Variable], gpu: int | None, given: Mapping[str, np.ndarray]
                      ) -> tuple[dict[str, np.ndarray], dict[int, list[PullItem]]]:
        """Host arrays to receive into, and what each shard sends into which part of them.

        For a GPU the arrays are this thread's pinned buffers (uploaded on the
        device's stream by :meth:`_deliver`).
        """
        transfers = self._gpu_transfers() if gpu is not None else None
        out = {}
        for v in variables:
            if v.name in given:
                _check_array(given[v.name], v.shape, v.dtype, f"out[{v.name!r}]")
                out[v.name] = given[v.name]
            elif transfers is None:
                out[v.name] = np.empty(v.shape, dtype=v.dtype)
            else:
                out[v.name] = transfers.pinned(f"pull:{threading.get_ident()}:{v.name}", v.shape, v.dtype)
        by_shard: dict[int, list[PullItem]] = {}
        for v in variables:
            flat = out[v.name].reshape(-1)
            for shard, first, end in v.element_ranges:
                by_shard.setdefault(shard, []).append(PullItem(v.name, flat[first:end]))
        return out, by_shard

    def _deliver(self, out: dict[str, np.ndarray], gpu: int | None) -> dict[str, Any]:
        """Pulled host arrays as the caller asked for them (uploaded to ``gpu`` when given)."""
        if gpu is None:
            return out
        return self._gpu_transfers().upload_all(out, gpu)

    def pull_rows(self, name: str, ids: Any, *, device: Any = None) -> Any:
        """Rows ``ids`` of an embedding table, shape ``(len(ids), *row_shape)``, in the order given.

        ``name`` is a hash table (:meth:`create_embedding`; missing rows are
        created from the initializer) or a dense variable (rows along axis 0).
        Repeated ids are fetched once.
        """
        gpu = parse_device(device)
        variable = self._resolve([name])[0]
        ids = _check_ids(ids, "ids")
        width = variable.spec.row_elements
        # Sorted once: the unique ids, and for a dense variable each shard's rows as one slice.
        order, sorted_ids, first = sort_ids(ids, keep_order_of_repeats=False)
        if first.all():
            # No repeats: each shard's rows go from its answer straight to their places.
            result = np.empty((len(ids), width), dtype=variable.dtype)
            self._pull_all({shard: [PullItem(name, result, sorted_ids[positions], rows_at=order[positions])]
                            for shard, positions in self._rows_by_shard(variable, sorted_ids).items()})
        else:
            result = self._pull_unique_rows(variable, ids, order, sorted_ids, first)
        row_shape = variable.shape if variable.spec.hash_table else variable.shape[1:]
        result = result.reshape((len(ids), *row_shape))
        return result if gpu is None else to_device(result, gpu)

    def _pull_unique_rows(self, variable: Variable, ids: np.ndarray, order: np.ndarray, sorted_ids: np.ndarray,
                          first: np.ndarray) -> np.ndarray:
        """pull_rows of ids that repeat: each id fetched once, then copied to every place it was asked."""
        width = variable.spec.row_elements
        unique = sorted_ids[first]
        fetched = np.empty((len(unique), width), dtype=variable.dtype)
        by_shard: dict[int, list[PullItem]] = {}
        scattered: list[tuple[np.ndarray, np.ndarray]] = []
        for shard, positions in self._rows_by_shard(variable, unique).items():
            if isinstance(positions, slice):
                dest = fetched[positions]  # received in place
            else:
                dest = np.empty((len(positions), width), dtype=variable.dtype)
                scattered.append((positions, dest))
            by_shard[shard] = [PullItem(variable.name, dest.reshape(-1), unique[positions])]
        self._pull_all(by_shard)
        for positions, dest in scattered:
            put_rows(fetched, positions, dest)
        # Row i of the result is fetched row source[i]: one gather (a scatter
        # through ``order`` took twice as long).
        source = np.empty(len(ids), dtype=np.intp)
        source[order] = np.cumsum(first) - 1
        return take_rows(fetched, source)

    def _rows_by_shard(self, variable: Variable, unique_ids: np.ndarray) -> dict[int, slice | np.ndarray]:
        """Positions in ``unique_ids`` (sorted) grouped by the shard that holds each row.

        A dense variable's part is a range of rows, so its positions are a
        slice (views, not copies, downstream); a hash table's are an array.
        """
        if variable.spec.hash_table:
            shards = hash_shards(unique_ids, len(self._shards))
            return {int(s): np.flatnonzero(shards == s) for s in np.unique(shards)}
        rows = variable.shape[0] if variable.shape else 1
        if unique_ids.size and (unique_ids[0] < 0 or unique_ids[-1] >= rows):
            bad = unique_ids[(unique_ids < 0) | (unique_ids >= rows)][0]
            raise InvalidArgumentError(f"row {bad} is outside {variable.name!r}, which has {rows} rows")
        ranges: dict[int, list[tuple[int, int]]] = {}
        for part in variable.placement.parts:
            low, high = (int(i) for i in np.searchsorted(unique_ids, (part.row_start, part.row_end)))
            if high > low:
                ranges.setdefault(part.shard, []).append((low, high))
        return {shard: slice(*spans[0]) if len(spans) == 1
                else np.concatenate([np.arange(low, high) for low, high in spans])
                for shard, spans in ranges.items()}

    def _pull_all(self, by_shard: dict[int, list[PullItem]]) -> None:
        """Pull from every shard in ``by_shard`` at once, straight into the items' ``dest``.

        Row ids travel in the request: a shard's ids beyond chunk_bytes go in
        further requests, one round of requests (one per shard) after another.
        """
        rounds = {i: self._pull_requests(items) for i, items in by_shard.items()}
        for r in range(max((len(requests) for requests in rounds.values()), default=0)):
            self._run_calls(self._pull_call(self._shards[i], requests[r])
                            for i, requests in rounds.items() if r < len(requests))

    def _pull_requests(self, items: list[PullItem]) -> list[list[PullItem]]:
        """``items`` as the items of requests that carry at most chunk_bytes of row ids each.

        A request names each variable once (the answer is matched by name),
        so a variable's rows that need several requests are split between them.
        """
        max_ids = self.chunk_bytes // 8
        requests: list[list[PullItem]] = [[]]
        ids_in = 0
        for item in items:
            ids = item.row_ids
            if ids is None or len(ids) <= max_ids - ids_in:
                requests[-1].append(item)
                ids_in += 0 if ids is None else len(ids)
                continue
            width = item.dest.shape[1] if item.rows_at is not None else item.dest.size // max(1, len(ids))
            for start in range(0, len(ids), max_ids):
                end = min(len(ids), start + max_ids)
                piece = (PullItem(item.name, item.dest, ids[start:end], item.rows_at[start:end])
                         if item.rows_at is not None
                         else PullItem(item.name, item.dest[start * width:end * width], ids[start:end]))
                if requests[-1]:
                    requests.append([])
                requests[-1].append(piece)
                ids_in = end - start
        return requests

    def _pull_call(self, shard: ShardChannel, items: list[PullItem]) -> ShardCall:
        request = self._pull_request(shard, items)
        receiver = PullReceiver(shard.address, items)
        ticket = self._take_ticket()

        def ordinary() -> None:
            receiver.reset()
            shard.pull(request, self._data_timeout, receiver.take_message)

        def on_lane_answer(answer: memoryview) -> None:
            receiver.reset()
            receiver.take_message(answer)

        def finish(_: None) -> None:
            receiver.check_complete()
            self._record_versions(shard, receiver.versions, ticket)

        small = self._use_lane and self._pull_bytes(items) <= self.chunk_bytes
        return ShardCall(shard, "pull", ordinary, finish, EXCHANGE_PULL, (lambda: request) if small else None,
                         on_lane_answer)

    def _run_calls(self, calls: Iterable[ShardCall]) -> dict[int, Any]:
        return run_shard_calls(calls, self._executor, self._call)

    def _pull_request(self, shard: ShardChannel, items: list[PullItem], step_ahead: int = 0) -> bytes:
        with self._lock:
            step = self._step + step_ahead
        return pull_request(items, shard_index=shard.index, num_shards=len(self._shards),
                            wire_dtype=to_wire_dtype(self.wire_dtype) if self.wire_dtype is not None else 0,
                            chunk_bytes=self.chunk_bytes, worker_id=self.worker_id,
                            incarnation=self.incarnation if self.register else "", step=step)

    def _pull_bytes(self, items: list[PullItem]) -> int:
        """Tensor bytes the answer to a pull of ``items`` carries."""
        wire = self.wire_dtype.itemsize if self.wire_dtype is not None else None
        return sum(item.size * (wire or item.dest.dtype.itemsize) for item in items)

    def push(self, gradients: Mapping[str, Any],
             rows: Mapping[str, tuple[Any, Any]] | None = None) -> set[int]:
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
        (see :meth:`_push_topk`), so do not push the same gradients again.
        """
        return self._push(gradients, rows, None)

    def _push(self, gradients: Mapping[str, Any], rows: Mapping[str, tuple[Any, Any]] | None,
              next_pull: _NextPull | None) -> set[int]:
        if not isinstance(gradients, Mapping):
            raise TypeError(f"gradients must be a mapping name -> array, got {type(gradients).__name__}")
        rows = dict(rows or {})
        if not gradients and not rows:
            return set()
        variables = {v.name: v for v in self._resolve([*gradients, *rows])}
        by_shard: dict[int, list[_PushItem]] = {}
        # Top-k: rows chosen from dense gradients, and the gradients they came from.
        selected: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        chosen_from: dict[str, np.ndarray] = {}
        with self._topk.pushing() if self._topk is not None else contextlib.nullcontext():
            # Everything is checked (and the rows chosen) before anything is sent or settled:
            # a bad argument changes neither the residual nor the servers.
            self._add_dense(gradients, variables, rows, by_shard, selected, chosen_from)
            for name, pair in rows.items():
                if not isinstance(pair, tuple) or len(pair) != 2:
                    raise TypeError(f"rows[{name!r}] must be a tuple (ids, gradients), "
                                    f"got {type(pair).__name__}")
            for name, pair in [*rows.items(), *selected.items()]:
                for shard, item in self._row_items(variables[name], *pair).items():
                    by_shard.setdefault(shard, []).append(item)
            if self._topk is None:
                return self._send_push(by_shard, ps_pb2.GRADIENT, self._prefetch_plan(by_shard, next_pull))
            return self._push_topk(by_shard, variables, selected, chosen_from, next_pull)

    def _push_topk(self, by_shard: dict[int, list[_PushItem]], variables: dict[str, Variable],
                   selected: dict[str, tuple[np.ndarray, np.ndarray]], chosen_from: dict[str, np.ndarray],
                   next_pull: _NextPull | None) -> set[int]:
        """Send a top-k push (the caller holds ``self._topk.pushing()``) and settle the residual.

        Every gradient given to push() is taken into the residual; the rows
        sent are owed nothing once the shard that holds them applied them.
        A shard that did not answer (PSUnavailableError) may have applied
        part of its push: that push is kept, with its sequence, and the next
        push first sends it again, so the shard's ledger completes exactly
        what is missing (never a row twice, never a row lost). A shard that
        refused its push applied none of it: its rows are owed again.
        """
        topk = self._topk
        nothing = np.empty(0, dtype=np.int64)
        try:
            self._finish_unfinished_pushes()
        except BaseException:
            for name in selected:  # nothing of this push was sent: its gradient is owed whole
                topk.settle(name, chosen_from[name], nothing)
            raise
        outcome = _PushOutcome()
        try:
            shards = self._send_push(by_shard, ps_pb2.GRADIENT, self._prefetch_plan(by_shard, next_pull),
                                     outcome)
        except BaseException:
            refused = {shard for shard in by_shard
                       if shard not in outcome.sent or _refused_whole(outcome.failed.get(shard))}
            pending = {shard for shard in by_shard if shard not in outcome.delivered and shard not in refused
                       and _may_complete_later(outcome.failed.get(shard))}
            for name, (ids, sent_rows) in selected.items():
                back = [at for shard, at in self._rows_by_shard(variables[name], ids).items()
                        if shard in refused]
                owed_again = np.concatenate([np.arange(len(ids))[at] for at in back]) if back else nothing
                topk.settle(name, chosen_from[name], ids, ids[owed_again], sent_rows[owed_again])
            for shard in pending:
                if any(item.name in selected for item in by_shard[shard]):
                    self._unfinished[shard] = outcome.sent[shard].detached()
            raise
        for name, (ids, _) in selected.items():
            topk.settle(name, chosen_from[name], ids)
        return shards

    def _finish_unfinished_pushes(self) -> None:
        """Send again, unchanged, the top-k pushes a shard did not confirm (see :meth:`_push_topk`).

        Raises like a push when one still fails; a shard that refuses one, or
        whose ledger wrote it off, will never complete it: it is dropped.
        """
        if not self._unfinished:
            return
        outcome = _PushOutcome()
        try:
            self._run_pushes(dict(self._unfinished), None, outcome)
        finally:
            for shard in list(self._unfinished):
                error = outcome.failed.get(shard)
                if shard in outcome.delivered or (error is not None and not _may_complete_later(error)):
                    if shard not in outcome.delivered:
                        log.warning("a top-k push sent again was refused; its rows are dropped",
                                    extra={"fields": {"address": self._shards[shard].address,
                                                      "error": str(error)}})
                    del self._unfinished[shard]

    def _add_dense(self, gradients: Mapping[str, Any], variables: dict[str, Variable],
                   rows: Mapping[str, Any], by_shard: dict[int, list[_PushItem]],
                   selected: dict[str, tuple[np.ndarray, np.ndarray]],
                   chosen_from: dict[str, np.ndarray]) -> None:
        """Each dense gradient's parts into ``by_shard``; with top-k, its chosen rows into ``selected``."""
        # Every GPU gradient is copied out at once: one wait for them all, not one per variable.
        on_gpu = {name: g for name, g in gradients.items() if type(g) is not np.ndarray and is_gpu_array(g)}
        downloaded = self._gpu_transfers().download_all(on_gpu, f"push:{threading.get_ident()}") if on_gpu else {}
        for name, grad in gradients.items():
            spec = variables[name].spec
            if spec.hash_table:
                raise InvalidArgumentError(f"{name!r} is a hash table: send its rows with rows={{name: (ids, grads)}}")
            host = downloaded[name] if name in downloaded else self._host(grad, f"gradients[{name!r}]", name)
            _check_array(host, spec.shape, spec.dtype, f"gradient for {name!r}")
            if self._topk is not None and spec.shape:
                if name in rows:
                    raise InvalidArgumentError(f"{name!r} is in both gradients and rows: push it once")
                selected[name] = self._topk.choose(name, host)  # its largest rows go as rows
                chosen_from[name] = host
                continue
            _check_fits_wire(host, self.wire_dtype, f"gradient for {name!r}")
            flat = as_wire_array(host)  # a narrower wire dtype is applied chunk by chunk when sending
            for shard, first, end in variables[name].element_ranges:
                by_shard.setdefault(shard, []).append(_PushItem(name, flat[first:end]))

    def _push_step(self, gradients: Mapping[str, Any], rows: Mapping[str, tuple[Any, Any]] | None,
                   names: list[str] | None, device: Any) -> set[int]:
        """Step.push: the push and, riding on it, the next step's pull (see :meth:`_take_prefetched`).

        In asynchronous mode, when the step's variables are small enough for
        the exchange lane and live on shards this push goes to, each shard
        answers the push with the values right after applying it
        (``PushBegin.pull_after``): a step costs one round trip per shard
        instead of two. Otherwise the next step pulls as usual.
        """
        next_pull = None
        if self._prefetch and self._use_lane and self.consistency == "async":
            next_pull = _NextPull(tuple(names) if names is not None else None, parse_device(device))
        return self._push(gradients, rows, next_pull)

    def _prefetch_plan(self, by_shard: dict[int, list[_PushItem]], next_pull: _NextPull | None
                       ) -> _Prefetch | None:
        """Where the pulled values go, per shard, or None when this push cannot carry the pull."""
        if next_pull is None:
            return None
        variables = self._dense(next_pull.names)
        out, pull_by_shard = self._pull_targets(variables, next_pull.gpu, {})
        for shard, items in pull_by_shard.items():
            pushed = by_shard.get(shard)
            if pushed is None or not self._fits_lane(pushed) or self._pull_bytes(items) > self.chunk_bytes:
                return None  # a shard not pushed to, or too big for one message: pull next step
        return _Prefetch(next_pull, out, pull_by_shard)

    def _take_prefetched(self, names: list[str] | None, device: Any) -> dict[str, Any] | None:
        """The values a step's push brought back, if they are what this step would pull now.

        They must be this thread's, for the same names and device, no push may
        have started since, and they must be fresh (a loop that pauses between
        steps, to evaluate say, pulls again).
        """
        with self._lock:
            prefetch = self._prefetched.pop(threading.get_ident(), None)
            generation = self._push_generation
        if prefetch is None or prefetch.generation != generation:
            return None
        wanted = _NextPull(tuple(names) if names is not None else None, parse_device(device))
        if prefetch.next_pull != wanted or time.monotonic() - prefetch.fetched_at > PREFETCH_MAX_AGE_SECONDS:
            return None
        if names is None and set(prefetch.out) != {v.name for v in self._dense(None)}:
            return None  # variables were created since
        with self._lock:
            self._stats["prefetched_steps"] += 1
        return self._deliver(prefetch.out, wanted.gpu)

    def push_rows(self, name: str, ids: Any, gradients: Any) -> set[int]:
        """Sparse update: gradients for rows ``ids`` only; repeated ids are summed first.

        ``gradients`` has shape ``(len(ids), *row_shape)`` and the table's
        dtype. Only the touched rows and their optimizer state change (lazy
        Adam keeps a step count per row). Returns once every shard applied it.
        """
        return self.push({}, rows={name: (ids, gradients)})

    def _row_items(self, variable: Variable, ids: Any, gradients: Any) -> dict[int, _PushItem]:
        """Per shard, the summed gradients of the unique rows it holds."""
        spec = variable.spec
        ids = _check_ids(ids, "ids")
        row_shape = spec.shape if spec.hash_table else spec.shape[1:]
        host = self._host(gradients, "gradients", spec.name)
        _check_array(host, (len(ids), *row_shape), spec.dtype, f"gradients for {spec.name!r}")
        width = spec.row_elements
        rows = as_wire_array(host).reshape(len(ids), width)  # C-contiguous, little-endian
        order, unique, first = sort_ids(ids)
        if first.all():
            # No id repeats: the rows are gathered in id order straight into each message.
            summed: np.ndarray | RowGather = RowGather(rows, order)
            _check_fits_wire(rows, self.wire_dtype, f"gradient for rows of {spec.name!r}")
        else:
            unique, summed = sum_sorted(rows, order, unique, first)
            _check_fits_wire(summed, self.wire_dtype, f"gradient for rows of {spec.name!r} (repeats summed)")
        items = {}
        for shard, positions in self._rows_by_shard(variable, unique).items():
            part: np.ndarray | RowGather
            if isinstance(summed, RowGather):
                part = summed.select(positions)
            elif isinstance(positions, slice):  # a dense part's rows: a view
                part = summed[positions].reshape(-1)
            else:  # a hash table's rows: gathered
                part = take_rows(summed, positions).reshape(-1)
            row_ids = unique[positions].astype("<i8", copy=False).tobytes()
            items[shard] = _PushItem(spec.name, part, row_ids, width)
        return items

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
    ) -> Variable:
        """Create (or return) a hash table of rows keyed by unbounded 64-bit ids.

        Rows are created on first touch from the seeded initializer and live on
        shard ``splitmix64(id) % num_shards``. ``max_rows`` bounds the rows per
        shard: beyond it, eviction 'none' refuses new rows (ResourceExhaustedError)
        and 'lru' evicts the least recently used ones.
        """
        row_shape = (dim,) if isinstance(dim, (int, np.integer)) else tuple(dim)
        if isinstance(initializer, str):
            initializer = initializer_from_name(initializer)
        spec = VariableSpec(name=name, shape=row_shape, dtype=dtype, initializer=initializer,
                            optimizer=optimizer if optimizer is not None else SGD(), hash_table=True,
                            max_rows=max_rows, eviction=eviction, aggregation=aggregation)
        results = self._create_everywhere(spec)
        with self._lock:
            self._variables[name] = Variable(spec, None, any(r.created for r in results.values()))
            return self._variables[name]

    def step(self, names: Iterable[str] | None = None, *, device: Any = None) -> Step:
        """A training step: pulls at the start; call ``step.push(grads)`` at the end."""
        return Step(self, names, device)

    def checkpoint(self) -> list[dict[str, Any]]:
        """Make every server write a checkpoint now; returns once all are durable."""
        request = ps_pb2.CheckpointRequest().SerializeToString()

        def on(shard: ShardChannel) -> dict[str, Any]:
            raw = self._call(shard, "checkpoint", lambda: shard.checkpoint(request, self._data_timeout))
            c = ps_pb2.CheckpointResponse.FromString(raw).checkpoint
            return {"address": shard.address, "checkpoint_id": c.checkpoint_id, "path": c.path,
                    "bytes": c.bytes, "write_seconds": c.write_seconds, "pause_seconds": c.pause_seconds}

        results = self._on_shards(range(len(self._shards)), on)
        return [results[i] for i in range(len(self._shards))]

    def finish(self, wait_for_workers: bool = True, timeout: float = 3600.0) -> None:
        """End a run-to-completion job: every server writes its final checkpoint and exits 0.

        With ``wait_for_workers`` (the chief's case) it first waits until no
        other worker holds a lease, so nobody is cut off mid-training. The
        servers must run with ``--allow-finish``; a long-lived service refuses.
        """
        deadline = time.monotonic() + timeout
        while wait_for_workers:
            others = {w for info in self.describe() for w, record in info.workers.items()
                      if record["live"] and w != self.worker_id}
            if not others:
                break
            if time.monotonic() > deadline:
                raise PSUnavailableError(f"finish: workers {sorted(others)} are still live after {timeout:.0f}s")
            time.sleep(0.5)
        request = ps_pb2.FinishRequest(worker_id=self.worker_id).SerializeToString()
        self._on_shards(range(len(self._shards)),
                        lambda s: self._call(s, "finish", lambda: s.finish(request, self._control_timeout)))

    @property
    def step_count(self) -> int:
        """Steps completed through :meth:`step` (reported to the servers)."""
        with self._lock:
            return self._step

    def stats(self) -> dict[str, int]:
        """Counters: ``retries`` (RPC attempts repeated), ``duplicate_acks`` (retried
        pushes the server had already applied), ``rollbacks`` (versions that went
        backwards: a server restored an older checkpoint), ``dropped_pushes``
        (sync mode: per shard, pushes that arrived after their step was applied),
        ``prefetched_steps`` (steps that began with values their previous step's
        push brought back, instead of a pull)."""
        with self._lock:
            return dict(self._stats)

    def gradient_residuals(self) -> dict[str, np.ndarray]:
        """With ``topk_ratio``: per variable, the gradient rows not sent yet (error feedback), as copies."""
        return {} if self._topk is None else self._topk.residuals()

    def versions(self, name: str) -> dict[int, int]:
        """Per shard, the newest version of ``name`` this client's pulls and pushes have seen."""
        with self._lock:
            return dict(self._versions.get(name, {}))

    def close(self) -> None:
        """Close every channel; the client cannot be used afterwards. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._unfinished:  # top-k pushes no later push completed (see _push_topk)
            log.warning("top-k push left unfinished", extra={"fields": {
                "shards": sorted(self._unfinished),
                "meaning": "the client was closed before a push completed them; they may be partly applied"}})
        self._stop_heartbeat.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join()
            self._say_goodbye()
        for shard in self._shards:
            shard.close()
        self._executor.shutdown(wait=True)

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- internals ----

    def _gpu_transfers(self) -> GpuTransfers:
        with self._lock:
            if self._gpu is None:
                self._gpu = GpuTransfers()
            return self._gpu

    def _host(self, array: Any, argument: str, name: str) -> np.ndarray:
        """Host memory for a gradient: GPU arrays go through this thread's pinned buffer for ``name``."""
        if is_gpu_array(array):
            return self._gpu_transfers().download_all({name: array}, f"push:{threading.get_ident()}")[name]
        return to_host(array, argument)

    def _call(self, shard: ShardChannel, what: str, call: Callable[[], Any]) -> Any:
        """``call()`` retried while the server is unavailable (see :mod:`worker_client.transport.retry`)."""
        def counted() -> None:
            with self._lock:
                self._stats["retries"] += 1
        return call_with_retry(call, self._retry, what, shard.address, on_retry=counted,
                               also_retry=self._token_may_be_rotated)

    def _token_may_be_rotated(self, error: PSError, changed_only: bool = False) -> bool:
        """A refused token from a file: re-read the file; whether to retry (see the class docstring).

        ``changed_only`` (connecting): retry only if the file changed, so a wrong token fails at once.
        """
        if not isinstance(error, AuthenticationError) or not self._token.from_file:
            return False
        changed = self._token.reread()
        return changed or not changed_only

    def _take_ticket(self) -> int:
        with self._lock:
            ticket = self._calls_started
            self._calls_started += 1
            return ticket

    def _record_versions(self, shard: ShardChannel, versions: dict[str, int], ticket: int) -> None:
        """Remember the newest versions; one that went backwards means the server rolled back.

        Calls from several threads can be answered out of order: an answer
        to a call started before a newer version was seen may carry an older
        one, and says nothing. Only a call started after the newer version
        was seen (``ticket``, from _take_ticket) proves a rollback.
        """
        rolled_back = {}
        with self._lock:
            for name, version in versions.items():
                known = self._versions.setdefault(name, {})
                previous = known.get(shard.index)
                if previous is not None and version < previous:
                    if ticket < self._versions_seen_at[name, shard.index]:
                        continue  # an answer overtaken by a newer one
                    rolled_back[name] = (previous, version)
                known[shard.index] = version
                self._versions_seen_at[name, shard.index] = self._calls_started
            if rolled_back:
                self._stats["rollbacks"] += 1
        if rolled_back:
            log.warning("ps-server rolled back", extra={"fields": {
                "address": shard.address, "shard": shard.index,
                "versions": {n: f"{a} -> {b}" for n, (a, b) in rolled_back.items()},
                "meaning": "it restarted from a checkpoint; updates after that checkpoint are lost"}})

    def _finish_step(self, pushed_shards: set[int]) -> None:
        """A step ended. In ssp/sync mode, shards this step did not push to learn the
        new clock right away (they may be holding other workers' pulls for it)."""
        with self._lock:
            self._step += 1
        if self.consistency != "async":
            others = [i for i in range(len(self._shards)) if i not in pushed_shards]
            if others:
                self._heartbeat_all(self._control_timeout, others)

    def _note_cluster_step(self, cluster_step: int, dropped: bool) -> None:
        """sync: a push that came after its step was applied was dropped; the
        worker then continues at the cluster's step (its step ends next)."""
        if dropped and cluster_step:
            with self._lock:
                self._step = max(self._step, cluster_step - 1)
                self._stats["dropped_pushes"] += 1

    def _heartbeat_all(self, timeout: float, shards: Iterable[int] | None = None,
                       adopt_step: bool = False) -> None:
        """Renew the lease (and report the step) on every shard, in parallel; errors are logged.

        ``adopt_step`` (registration only): continue at the cluster's step. Never
        later: a shard that finished a step before another must not make this
        worker skip the step it is still pushing elsewhere.
        """
        with self._lock:
            step = self._step
        request = ps_pb2.HeartbeatRequest(worker_id=self.worker_id, incarnation=self.incarnation,
                                          step=step).SerializeToString()

        def beat(shard: ShardChannel) -> int:
            try:
                return ps_pb2.HeartbeatResponse.FromString(shard.heartbeat(request, timeout)).cluster_step
            except PSError as error:  # the next beat, or a retried RPC, will tell more
                self._token_may_be_rotated(error)  # a rotated token file: the next beat carries the new one
                log.debug("heartbeat failed", extra={"fields": {"address": shard.address, "error": str(error)}})
                return 0

        steps = self._on_shards(range(len(self._shards)) if shards is None else shards, beat)
        cluster_step = max(steps.values(), default=0)
        if adopt_step and cluster_step:
            with self._lock:
                self._step = max(self._step, cluster_step)

    def _say_goodbye(self) -> None:
        """Leave the live set now, so synchronous steps stop waiting for this worker."""
        request = ps_pb2.HeartbeatRequest(worker_id=self.worker_id, incarnation=self.incarnation,
                                          leaving=True).SerializeToString()
        for shard in self._shards:
            try:
                shard.heartbeat(request, min(2.0, self._control_timeout))
            except PSError:
                pass  # the lease expires on its own

    def _heartbeat_loop(self, interval: float) -> None:
        while not self._stop_heartbeat.wait(interval):
            self._heartbeat_all(min(self._control_timeout, interval))

    def _resolve(self, names: Iterable[str] | str | None) -> list[Variable]:
        """Variables by name, asking the servers about names not seen yet."""
        if self._closed:
            raise PSError("the client was closed")
        with self._lock:
            known = dict(self._variables)
        if names is None:
            if not known:
                self.describe()
                with self._lock:
                    known = dict(self._variables)
            return list(known.values())
        if isinstance(names, str):
            names = [names]
        names = list(names)
        for name in names:
            if not isinstance(name, str):
                raise TypeError(f"variable names must be strings, got {name!r}")
        if any(name not in known for name in names):
            self.describe()
            with self._lock:
                known = dict(self._variables)
        missing = [name for name in names if name not in known]
        if missing:
            raise VariableNotFoundError(
                f"no variable named {', '.join(map(repr, missing))} on the cluster; "
                "create it with create_variable first")
        return [known[name] for name in dict.fromkeys(names)]

    def _send_push(self, by_shard: dict[int, list[_PushItem]], kind: int,
                   prefetch: _Prefetch | None = None, outcome: _PushOutcome | None = None) -> set[int]:
        """Push to every shard in ``by_shard`` at once; returns the shards pushed to.

        With ``prefetch``, each shard also answers the values it lists
        (PushBegin.pull_after); they are kept for this thread's next step.
        ``outcome`` records each shard's push as sent, and which shards
        confirmed it or failed, also when one fails.
        """
        pushes = {i: self._new_shard_push(i, by_shard[i], kind,
                                          prefetch.by_shard.get(i) if prefetch else None)
                  for i in sorted(by_shard)}
        self._run_pushes(pushes, prefetch, outcome)
        return set(by_shard)

    def _new_shard_push(self, shard_index: int, items: list[_PushItem], kind: int,
                        after: list[PullItem] | None) -> _ShardPush:
        # The sequence is taken once: every retry resends the same push,
        # chunked the same way, so the server applies it exactly once.
        with self._lock:
            sequence = next(self._sequences[shard_index])
            base_versions = {i.name: self._versions.get(i.name, {}).get(shard_index, 0) for i in items}
            step = self._step
        pull_after = self._pull_request(self._shards[shard_index], after, step_ahead=1) if after else None
        return _ShardPush(shard_index, items, kind, sequence, base_versions, step, pull_after, after)

    def _run_pushes(self, pushes: dict[int, _ShardPush], prefetch: _Prefetch | None,
                    outcome: _PushOutcome | None) -> None:
        """Send ``pushes`` (one per shard) at once, each retried as one push (see _push_call)."""
        with self._lock:
            self._push_generation += 1
            generation = self._push_generation
        if outcome is not None:
            outcome.sent.update(pushes)
        results = run_shard_calls((self._push_call(push, outcome) for push in pushes.values()),
                                  self._executor, self._call, outcome.failed if outcome is not None else None)
        if prefetch is not None and all(results.get(s, False) for s in prefetch.by_shard):
            prefetch.generation = generation
            prefetch.fetched_at = time.monotonic()
            with self._lock:
                self._prefetched[threading.get_ident()] = prefetch

    def _push_call(self, push: _ShardPush, outcome: _PushOutcome | None = None) -> ShardCall:
        """One shard's push; its result is True when it also brought back ``push.after``'s values."""
        shard = self._shards[push.shard_index]
        items = push.items
        ticket = self._take_ticket()
        receiver = PullReceiver(shard.address, push.after) if push.after else None
        message = (push.shard_index, items, push.kind, push.sequence, push.base_versions, push.step,
                   push.pull_after)

        def ordinary() -> bytes:
            # Each message is joined before the generator converts the next chunk.
            messages = (join_pieces(pieces) for pieces in self._push_messages(*message))
            return shard.push(messages, self._data_timeout)

        def finish(answer: bytes | memoryview) -> bool:
            response, pulled = split_push_response(answer)
            if outcome is not None:
                outcome.delivered.add(shard.index)  # applied, whatever happens to the values riding back
            if response.duplicate and call.attempts > 1:
                with self._lock:
                    self._stats["duplicate_acks"] += 1
            self._record_versions(shard, {e.variable: e.version for e in response.versions}, ticket)
            self._note_cluster_step(response.cluster_step, response.dropped)
            if receiver is None or pulled is None:
                return False  # no values asked for, or a server that predates pull_after
            receiver.take_chunks(pulled)
            receiver.check_complete()
            self._record_versions(shard, receiver.versions, ticket)
            return True

        small = self._use_lane and self._fits_lane(items)
        call = ShardCall(shard, "push", ordinary, finish, EXCHANGE_PUSH,
                         (lambda: self._push_pieces(*message)) if small else None)
        return call

    def _fits_lane(self, items: list[_PushItem]) -> bool:
        """A push of at most chunk_bytes (values and row ids) is one message: it may use the exchange lane."""
        return sum(i.values.nbytes + len(i.row_ids) for i in items) <= self.chunk_bytes

    def _push_pieces(self, shard_index: int, items: list[_PushItem], kind: int, sequence: int,
                     base_versions: dict[str, int], step: int, pull_after: bytes | None) -> list:
        """A push that fits in one message, as pieces (see _push_messages); joined before another is built."""
        messages = list(self._push_messages(shard_index, items, kind, sequence, base_versions, step,
                                            pull_after, single=True))
        return messages[0]

    def _push_messages(self, shard_index: int, items: list[_PushItem], kind: int, sequence: int,
                       base_versions: dict[str, int], step: int, pull_after: bytes | None = None,
                       single: bool = False) -> Iterator[list]:
        """The messages of one push to one shard: begin first, chunks packed up to chunk_bytes.

        A begin with more row ids than chunk_bytes takes several messages
        (see _begin_parts); the row ids in a message count towards its chunk_bytes.

        Each message comes as pieces (codec.push_request_pieces) that the
        caller joins once, before asking for the next message (or building
        another push on this thread): converted chunks live in this thread's
        arena, which the next message reuses (see _ConversionArena).
        ``single``: everything in one message, whatever its size.
        """
        convert = self.wire_dtype is not None and kind == ps_pb2.GRADIENT
        wire_dtypes = [self.wire_dtype if convert and item.values.dtype != self.wire_dtype else item.values.dtype
                       for item in items]
        wires = [to_wire_dtype(dtype) for dtype in wire_dtypes]
        begin: bytes | None
        *continued, (begin, pending_bytes) = self._begin_parts(
            shard_index, items, wires, kind, sequence, base_versions, step, pull_after, single)
        for part, _ in continued:
            yield push_request_pieces(part, [])
        pending: list[OutgoingChunk] = []
        arena = _conversion_arena()
        arena.reset()
        chunk_bytes = self.chunk_bytes
        for item, wire_dtype, wire in zip(items, wire_dtypes, wires):
            values = item.values
            if type(values) is np.ndarray and item.row_elements == 1 and wire_dtype == values.dtype:
                nbytes = values.nbytes
                if nbytes <= chunk_bytes:
                    # A small model's common case: a whole variable, unconverted, is one chunk.
                    if pending and pending_bytes + nbytes > chunk_bytes and not single:
                        yield push_request_pieces(begin, pending)
                        arena.reset()
                        begin, pending, pending_bytes = None, [], 0
                    size = values.size
                    pending.append(OutgoingChunk(encode_chunk_header(item.name, 0, size, wire, 0, size),
                                                 byte_view(values)))
                    pending_bytes += nbytes
                    continue
            # Whole rows per chunk for row pushes (the server applies rows).
            per_chunk = max(1, self.chunk_bytes // (wire_dtype.itemsize * item.row_elements)) * item.row_elements
            for offset, count in chunk_ranges(values.size, per_chunk):
                if isinstance(values, RowGather):  # whole rows (per_chunk is)
                    width = item.row_elements
                    piece = values.select(slice(offset // width, (offset + count) // width))
                    if wire_dtype != values.dtype:
                        piece = piece.gather().reshape(-1)
                else:
                    piece = values if count == values.size else values[offset:offset + count]
                nbytes = count * wire_dtype.itemsize
                # The message is sent (and the arena reset) before this chunk is
                # converted: its region must not be handed out again while it waits.
                if pending and pending_bytes + nbytes > chunk_bytes and not single:
                    yield push_request_pieces(begin, pending)
                    arena.reset()
                    begin, pending, pending_bytes = None, [], 0
                if wire_dtype != values.dtype:
                    # Converted into this thread's arena (joining the message copies it out):
                    # no model-sized temporary, and the conversion overlaps the sending.
                    buffer = arena.take(wire_dtype, count)
                    cast_into(buffer, piece)
                    piece = buffer
                header = encode_chunk_header(item.name, offset, count, wire, 0, values.size)
                data = piece if isinstance(piece, RowGather) else byte_view(piece)
                pending.append(OutgoingChunk(header, data))
                pending_bytes += nbytes
        # No reset after the last message: its chunks are still to be joined (the
        # next push built on this thread resets the arena when it starts).
        yield push_request_pieces(begin, pending)

    def _begin_parts(self, shard_index: int, items: list[_PushItem], wires: list[int], kind: int,
                     sequence: int, base_versions: dict[str, int], step: int, pull_after: bytes | None,
                     single: bool) -> list[tuple[bytes, int]]:
        """The PushBegin of one push, as parts of at most chunk_bytes of row ids each, with their id bytes.

        Row ids travel in the begin; more than fit one message continue in
        the next ones (PushBegin.continued), so the push keeps its one
        sequence and the server's ledger claims its chunks as one push. The
        first part declares every item; later ones carry only row ids.
        ``single``: one part, whatever its size.
        """
        room = self.chunk_bytes // 8 * 8 if not single else sum(len(item.row_ids) for item in items)
        budget = room
        declared: list[bytes] = []
        rest: list[tuple[_PushItem, int, int]] = []  # (item, its first byte still to send, wire)
        for item, wire in zip(items, wires):
            ids = item.row_ids
            take = min(len(ids), room)
            room -= take
            elements = item.values.size if take == len(ids) else take // 8 * item.row_elements
            declared.append(encode_push_item(item.name, elements, wire, base_versions.get(item.name, 0),
                                             ids[:take]))
            if take < len(ids):
                rest.append((item, take, wire))
        head = (self.worker_id, self.incarnation, sequence, shard_index, len(self._shards), kind)
        parts = [(declared, budget - room)]
        while rest:
            part: list[bytes] = []
            room = budget
            while rest and room:
                item, start, wire = rest[0]
                take = min(len(item.row_ids) - start, room)
                part.append(encode_push_item(item.name, take // 8 * item.row_elements, wire, 0,
                                             item.row_ids[start:start + take]))
                room -= take
                if start + take < len(item.row_ids):
                    rest[0] = (item, start + take, wire)
                else:
                    rest.pop(0)
            parts.append((part, budget - room))
        return [(encode_push_begin(*head, part, step, pull_after if i == 0 else None,
                                   continued=i < len(parts) - 1), id_bytes)
                for i, (part, id_bytes) in enumerate(parts)]

    def _on_shards(self, shards: Iterable[int], fn: Callable[[ShardChannel], Any]) -> dict[int, Any]:
        """Run ``fn`` on each shard concurrently; raise the first error by shard order."""
        shards = list(shards)
        if not shards:
            return {}
        pending = {i: self._executor.submit(fn, self._shards[i]) for i in shards[1:]}
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        # The first shard runs on this thread: one thread hop less per call.
        try:
            results[shards[0]] = fn(self._shards[shards[0]])
        except BaseException as exc:  # collected, re-raised below in shard order
            errors[shards[0]] = exc
        for i, fut in pending.items():
            try:
                results[i] = fut.result()
            except BaseException as exc:
                errors[i] = exc
        if errors:
            raise errors[min(errors)]
        return results
