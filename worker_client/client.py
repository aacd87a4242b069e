"""PSClient: create, pull and push variables on a cluster of ps-servers.

One channel per shard; a pull or push runs on all shards involved at once
(one thread per shard, gRPC releases the GIL while waiting). Tensor bytes
are copied once on each side: a push frames views of the caller's arrays,
a pull writes each received chunk straight into the preallocated result.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from worker_client.arrays import parse_device, to_device, to_host
from worker_client.errors import (
    ClusterMismatchError,
    DTypeMismatchError,
    InvalidArgumentError,
    PSError,
    PSInternalError,
    ShapeMismatchError,
    VariableNotFoundError,
)
from worker_client.retry import RetryPolicy, call_with_retry
from worker_client.step import Step
from worker_client.transport import ShardChannel
from wehub_ps.cluster import ClusterConfigError, ps_addresses_from_env, split_host_port, task_from_tf_config
from wehub_ps.codec import (
    CodecError,
    OutgoingChunk,
    as_wire_array,
    byte_view,
    chunk_ranges,
    decode_pull_response,
    encode_push_request,
)
from wehub_ps.dtypes import BFLOAT16, dtype_name, parse_dtype, to_numpy_dtype, to_wire_dtype
from wehub_ps.placement import MinSizePartitioner, Partitioner, Placement, rows_of
from wehub_ps.rpc import DEFAULT_CHUNK_BYTES
from wehub_ps.specs import (
    SGD,
    Constant,
    Explicit,
    GlorotUniform,
    Normal,
    Uniform,
    Zeros,
    Initializer,
    Optimizer,
    VariableSpec,
    initializer_from_name,
)
from wehub_ps.v1 import ps_pb2

__all__ = ["PSClient", "Variable", "ShardInfo"]

log = logging.getLogger("worker_client")

_WIRE_DTYPES = (np.dtype("float16"), BFLOAT16)
_INITIALIZER_TYPES = (Zeros, Constant, Uniform, Normal, GlorotUniform)


@dataclass(frozen=True)
class Variable:
    """A variable as the cluster holds it."""

    spec: VariableSpec
    placement: Placement
    created: bool = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.spec.shape

    @property
    def dtype(self) -> np.dtype:
        return self.spec.dtype


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

    Delivery: :meth:`push` returns once every shard involved has applied the
    gradient; each push carries (worker_id, incarnation, sequence) so the
    servers apply it at most once.
    """

    def __init__(
        self,
        addresses: Sequence[str] | str,
        worker_id: str | None = None,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        wire_dtype: str | np.dtype | None = None,
        connect_timeout: float = 60.0,
        control_timeout: float = 30.0,
        data_timeout: float = 300.0,
        retry_timeout: float = 300.0,
        heartbeat: bool = True,
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
        #: New on every construction: tells servers apart retries of this
        #: process from pushes of an earlier run with the same worker_id.
        self.incarnation = uuid.uuid4().hex
        self.chunk_bytes = chunk_bytes
        self.wire_dtype = self._check_wire_dtype(wire_dtype)
        self._control_timeout = control_timeout
        self._data_timeout = data_timeout
        self._retry = RetryPolicy(timeout=retry_timeout)
        self._shards = [ShardChannel(i, a) for i, a in enumerate(self.addresses)]
        self._executor = futures.ThreadPoolExecutor(
            max_workers=max(2, 2 * len(self._shards)), thread_name_prefix=f"ps-client-{worker_id}")
        # Guards _variables, _versions, _sequences, _stats and _step.
        self._lock = threading.Lock()
        self._variables: dict[str, Variable] = {}
        self._versions: dict[str, dict[int, int]] = {}
        self._sequences = [itertools.count(1) for _ in self._shards]
        self._stats = {"retries": 0, "duplicate_acks": 0, "rollbacks": 0}
        self._step = 0
        self._closed = False
        self._stop_heartbeat = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        try:
            lease = self._connect(connect_timeout)
            if heartbeat:
                self._heartbeat_all(self._control_timeout)  # register before the first step
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
        if "worker_id" not in kwargs:
            if environ.get("PS_WORKER_ID"):
                kwargs["worker_id"] = environ["PS_WORKER_ID"]
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
            lambda: self._describe_once(s, self._control_timeout), connect_policy, "connect", s.address))
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
        leases = [info.worker_lease_seconds for info in infos.values() if info.worker_lease_seconds > 0]
        return min(leases) if leases else 30.0

    def _describe_shard(self, shard: ShardChannel) -> ShardInfo:
        return self._call(shard, "describe", lambda: self._describe_once(shard, self._control_timeout))

    def _describe_once(self, shard: ShardChannel, timeout: float) -> ShardInfo:
        raw = shard.describe(ps_pb2.DescribeRequest().SerializeToString(), timeout)
        msg = ps_pb2.DescribeResponse.FromString(raw)
        variables = {}
        for info in msg.variables:
            spec = VariableSpec.from_proto(info.spec)
            self._remember(spec)
            variables[spec.name] = {"row_start": info.row_start, "row_end": info.row_end,
                                    "version": info.version, "initialized": info.initialized,
                                    "optimizer_steps": info.optimizer_steps}
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
        return ShardInfo(shard.address, msg.shard_index, msg.num_shards, msg.server_id,
                         msg.server_version, variables, msg.chunk_bytes_limit, msg.worker_lease_seconds,
                         workers, checkpoint, restored)

    def _remember(self, spec: VariableSpec, created: bool = False) -> Variable:
        variable = Variable(spec, spec.placement(len(self._shards)), created)
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
    ) -> Variable:
        """Create a variable on the cluster, or return the existing one.

        Idempotent: the same spec again (from this or any worker) returns the
        existing variable; a different spec under the same name raises
        :class:`VariableConflictError` naming the difference. ``initializer``
        is a name ('zeros', 'constant', 'uniform', 'normal', 'glorot_uniform'),
        an initializer object, or an array with the initial value.
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
                            partitioner=partitioner if partitioner is not None else MinSizePartitioner())
        placement = spec.placement(len(self._shards))
        # Every shard records the spec (so conflicts are caught everywhere);
        # only the shards in the placement allocate rows.
        results = self._on_shards(range(len(self._shards)), lambda s: self._create_on(s, spec))
        created = any(r.created for r in results.values())
        if initial is not None:
            pending = [p.shard for p in placement.parts if not results[p.shard].variable.initialized]
            if pending:
                self._send_push({name: initial}, pending, ps_pb2.ASSIGN, {name: spec})
        with self._lock:
            self._variables[name] = Variable(spec, placement, created)
            return self._variables[name]

    def _create_on(self, shard: ShardChannel, spec: VariableSpec) -> ps_pb2.CreateVariableResponse:
        request = ps_pb2.CreateVariableRequest(spec=spec.to_proto(), shard_index=shard.index,
                                               num_shards=len(self._shards)).SerializeToString()
        return ps_pb2.CreateVariableResponse.FromString(self._call(
            shard, "create_variable", lambda: shard.create_variable(request, self._control_timeout)))

    def pull(self, names: Iterable[str] | str | None = None, *, device: Any = None) -> dict[str, Any]:
        """Current values, ``{name: array}``; all known variables when ``names`` is None.

        Blocks until every shard has answered. Arrays are numpy, or CuPy on
        ``device`` ('cuda', 'cuda:1', 1). Each chunk is read atomically on its
        server; a variable larger than one chunk may mix updates that were
        being applied during the pull (as in any asynchronous parameter server).
        """
        gpu = parse_device(device)
        variables = self._resolve(names)
        out = {v.name: np.empty(v.shape, dtype=v.dtype) for v in variables}
        flat = {name: arr.reshape(-1) for name, arr in out.items()}
        by_shard: dict[int, list[tuple[Variable, int, int]]] = {}
        for v in variables:
            row_elements = rows_of(v.shape)[1]
            for part in v.placement.parts:
                by_shard.setdefault(part.shard, []).append(
                    (v, part.row_start * row_elements, part.rows * row_elements))
        self._on_shards(by_shard, lambda s: self._pull_from(s, by_shard[s.index], flat))
        if gpu is None:
            return out
        return {name: to_device(arr, gpu) for name, arr in out.items()}

    def _pull_from(self, shard: ShardChannel, items: list[tuple[Variable, int, int]],
                   flat: dict[str, np.ndarray]) -> None:
        with self._lock:
            step = self._step
        request = ps_pb2.PullRequest(
            shard_index=shard.index, num_shards=len(self._shards),
            items=[ps_pb2.PullItem(variable=v.name) for v, _, _ in items],
            wire_dtype=to_wire_dtype(self.wire_dtype) if self.wire_dtype is not None else 0,
            chunk_bytes=self.chunk_bytes, worker_id=self.worker_id, incarnation=self.incarnation,
            step=step).SerializeToString()
        expected = {v.name: (base, count) for v, base, count in items}
        received: dict[str, int] = {}
        versions: dict[str, int] = {}

        def on_message(message: bytes) -> None:
            try:
                chunks = decode_pull_response(message)
                for chunk in chunks:
                    h = chunk.header
                    base, count = expected[h.variable]
                    if h.offset + h.count > count:
                        raise CodecError(f"chunk [{h.offset}, {h.offset + h.count}) is outside {count} elements")
                    dest = flat[h.variable][base + h.offset: base + h.offset + h.count]
                    np.copyto(dest, chunk.array(), casting="unsafe")
                    received[h.variable] += h.count
                    versions[h.variable] = h.version
            except (CodecError, KeyError) as exc:
                raise PSInternalError(f"pull from {shard.address}: malformed response: {exc}",
                                      address=shard.address) from exc

        def attempt() -> None:
            received.clear()
            received.update(dict.fromkeys(expected, 0))
            versions.clear()
            shard.pull(request, self._data_timeout, on_message)

        self._call(shard, "pull", attempt)
        short = {name: (received[name], expected[name][1]) for name in expected
                 if received[name] != expected[name][1]}
        if short:
            raise PSInternalError(f"pull from {shard.address} ended early: received/expected "
                                  f"elements {short}", address=shard.address)
        self._record_versions(shard, versions)

    def push(self, gradients: Mapping[str, Any]) -> None:
        """Send gradients; returns once every shard involved has applied them.

        ``gradients`` maps variable names to arrays of exactly the variable's
        shape and dtype (numpy, CuPy or DLPack). Each server runs the
        variable's optimizer on its part as the chunks arrive.
        """
        if not isinstance(gradients, Mapping):
            raise TypeError(f"gradients must be a mapping name -> array, got {type(gradients).__name__}")
        if not gradients:
            return
        variables = {v.name: v for v in self._resolve(list(gradients))}
        arrays = {}
        for name, grad in gradients.items():
            spec = variables[name].spec
            host = to_host(grad, f"gradients[{name!r}]")
            if host.shape != spec.shape:
                raise ShapeMismatchError(
                    f"gradient for {name!r} has shape {host.shape}, the variable has shape {spec.shape}")
            if parse_dtype(host.dtype) != spec.dtype:
                raise DTypeMismatchError(
                    f"gradient for {name!r} has dtype {dtype_name(host.dtype)}, the variable is "
                    f"{dtype_name(spec.dtype)}; cast it with .astype({dtype_name(spec.dtype)!r})")
            arrays[name] = as_wire_array(host, self.wire_dtype)
        shards = sorted({p.shard for name in arrays for p in variables[name].placement.parts})
        self._send_push(arrays, shards, ps_pb2.GRADIENT, {n: variables[n].spec for n in arrays})

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

    @property
    def step_count(self) -> int:
        """Steps completed through :meth:`step` (reported to the servers)."""
        with self._lock:
            return self._step

    def stats(self) -> dict[str, int]:
        """Counters: ``retries`` (RPC attempts repeated), ``duplicate_acks`` (retried
        pushes the server had already applied), ``rollbacks`` (versions that went
        backwards: a server restored an older checkpoint)."""
        with self._lock:
            return dict(self._stats)

    def versions(self, name: str) -> dict[int, int]:
        """Per shard, the version of ``name`` seen by this client's last pull or push."""
        with self._lock:
            return dict(self._versions.get(name, {}))

    def close(self) -> None:
        """Close every channel; the client cannot be used afterwards. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_heartbeat.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join()
        for shard in self._shards:
            shard.close()
        self._executor.shutdown(wait=True)

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- internals ----

    def _call(self, shard: ShardChannel, what: str, call: Callable[[], Any]) -> Any:
        """``call()`` retried while the server is unavailable (see :mod:`worker_client.retry`)."""
        def counted() -> None:
            with self._lock:
                self._stats["retries"] += 1
        return call_with_retry(call, self._retry, what, shard.address, on_retry=counted)

    def _record_versions(self, shard: ShardChannel, versions: dict[str, int]) -> None:
        """Remember versions; a version that went backwards means the server rolled back."""
        rolled_back = {}
        with self._lock:
            for name, version in versions.items():
                known = self._versions.setdefault(name, {})
                if version < known.get(shard.index, 0):
                    rolled_back[name] = (known[shard.index], version)
                known[shard.index] = version
            if rolled_back:
                self._stats["rollbacks"] += 1
        if rolled_back:
            log.warning("ps-server rolled back", extra={"fields": {
                "address": shard.address, "shard": shard.index,
                "versions": {n: f"{a} -> {b}" for n, (a, b) in rolled_back.items()},
                "meaning": "it restarted from a checkpoint; updates after that checkpoint are lost"}})

    def _finish_step(self) -> None:
        with self._lock:
            self._step += 1

    def _heartbeat_all(self, timeout: float) -> None:
        with self._lock:
            step = self._step
        request = ps_pb2.HeartbeatRequest(worker_id=self.worker_id, incarnation=self.incarnation,
                                          step=step).SerializeToString()
        for shard in self._shards:
            try:
                shard.heartbeat(request, timeout)
            except PSError as error:  # the next beat, or a retried RPC, will tell more
                log.debug("heartbeat failed", extra={"fields": {"address": shard.address, "error": str(error)}})

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

    def _send_push(self, arrays: dict[str, np.ndarray], shards: Sequence[int], kind: int,
                   specs: dict[str, VariableSpec]) -> None:
        def push_to(shard: ShardChannel) -> None:
            # The sequence is taken once: every retry resends the same push,
            # chunked the same way, so the server applies it exactly once.
            with self._lock:
                sequence = next(self._sequences[shard.index])
                base_versions = {n: self._versions.get(n, {}).get(shard.index, 0) for n in arrays}
                step = self._step
            attempts = []

            def attempt() -> bytes:
                attempts.append(1)
                messages = self._push_messages(shard.index, arrays, specs, kind, sequence, base_versions, step)
                return shard.push(messages, self._data_timeout)

            response = ps_pb2.PushResponse.FromString(self._call(shard, "push", attempt))
            if response.duplicate and len(attempts) > 1:
                with self._lock:
                    self._stats["duplicate_acks"] += 1
            self._record_versions(shard, {e.variable: e.version for e in response.versions})

        self._on_shards(shards, push_to)

    def _push_messages(self, shard_index: int, arrays: dict[str, np.ndarray],
                       specs: dict[str, VariableSpec], kind: int, sequence: int,
                       base_versions: dict[str, int], step: int) -> Iterator[bytes]:
        """The messages of one push to one shard: begin first, chunks packed up to chunk_bytes."""
        parts = []
        for name, array in arrays.items():
            part = specs[name].placement(len(self._shards)).part_on(shard_index)
            if part is None:
                continue
            row_elements = rows_of(specs[name].shape)[1]
            start = part.row_start * row_elements
            count = part.rows * row_elements
            parts.append((name, array[start:start + count]))
        begin = ps_pb2.PushBegin(
            worker_id=self.worker_id, incarnation=self.incarnation, sequence=sequence,
            shard_index=shard_index, num_shards=len(self._shards), kind=kind, step=step,
            items=[ps_pb2.PushItem(variable=name, elements=values.size,
                                   wire_dtype=to_wire_dtype(values.dtype),
                                   base_version=base_versions.get(name, 0))
                   for name, values in parts])
        pending: list[OutgoingChunk] = []
        pending_bytes = 0
        for name, values in parts:
            wire = to_wire_dtype(values.dtype)
            per_chunk = max(1, self.chunk_bytes // values.dtype.itemsize)
            for offset, count in chunk_ranges(values.size, per_chunk):
                piece = values[offset:offset + count]
                nbytes = piece.nbytes
                if pending and pending_bytes + nbytes > self.chunk_bytes:
                    yield encode_push_request(begin, pending)
                    begin, pending, pending_bytes = None, [], 0
                header = ps_pb2.ChunkHeader(variable=name, offset=offset, count=count, dtype=wire,
                                            part_elements=values.size)
                pending.append(OutgoingChunk(header, byte_view(piece)))
                pending_bytes += nbytes
        yield encode_push_request(begin, pending)

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
