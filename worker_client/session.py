"""A worker's session with a cluster: identity, connection, lease, clock and what it has seen.

:class:`Session` holds the shards' channels, checks on connect that the
address list is the cluster, keeps the worker's lease with a heartbeat
thread, and runs every call through the retry policy and the one fan-out
(worker_client.transport.fanout). :class:`SessionState` is the worker's
clock (its step, each shard's push sequence), the versions it has seen
(with the tickets that tell a rollback from a late answer), and its counters.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from typing import Any

from wehub_ps.cluster import ClusterConfigError, parse_shard_replicas, shard_spec
from wehub_ps.specs import VariableSpec
from wehub_ps.v1 import ps_pb2
from worker_client.errors import (
    AuthenticationError,
    ClusterMismatchError,
    NotPrimaryError,
    PSError,
    PSUnavailableError,
)
from worker_client.shard_info import ReplicaInfo, ShardInfo, read_describe, read_replica_status
from worker_client.transport.channels import ShardChannel
from worker_client.transport.credentials import BearerToken, tls_material
from worker_client.transport.fanout import ShardCall, run_on_shards, run_shard_calls
from worker_client.transport.handshake import diagnose
from worker_client.transport.retry import RetryPolicy, call_with_retry

__all__ = ["DEFAULT_LEASE_SECONDS", "Session", "SessionState", "check_addresses"]

log = logging.getLogger("worker_client")

#: The worker lease assumed when no server states one (the servers' own default).
DEFAULT_LEASE_SECONDS = 30.0
# At most this long to name a TLS mismatch after a failed connect attempt (two handshakes).
_TLS_CHECK_SECONDS = 5.0
#: Pauses between rounds of a switchover request over a shard's replicas while none takes it as the primary.
_SWITCHOVER_FIRST_PAUSE = 0.05
_SWITCHOVER_MAX_PAUSE = 1.0


def check_addresses(addresses: Sequence[str | Sequence[str]] | str) -> tuple[tuple[str, ...], ...]:
    """Each shard's replica addresses, position = shard index; ValueError names what is wrong.

    Every form of :func:`wehub_ps.cluster.parse_shard_replicas`: 'a:1,b:1',
    'a:1|a:2,b:1|b:2', or a list whose items are 'a:1', 'a:1|a:2' or lists of
    addresses.
    """
    try:
        return parse_shard_replicas(addresses)
    except ClusterConfigError as exc:
        raise ValueError(str(exc)) from None


class SessionState:
    """The worker's step, push sequences, versions seen and counters, under one lock.

    Versions: calls from several threads can be answered out of order. Each
    pull or push takes a ticket (the count of calls started) when it starts;
    a version older than one seen before proves a rollback only when the
    call that saw it started after the newer version was seen.
    """

    def __init__(self, num_shards: int) -> None:
        # Guards every field.
        self._lock = threading.Lock()
        self._step = 0
        #: Per shard, the sequences of this client's pushes (each push takes one, retries keep it).
        self.sequences = [itertools.count(1) for _ in range(num_shards)]
        #: Per variable and shard: the newest version seen, and the ticket count when it was seen.
        self._versions: dict[str, dict[int, int]] = {}
        self._versions_seen_at: dict[tuple[str, int], int] = {}
        self._calls_started = 0
        self._stats = {"retries": 0, "duplicate_acks": 0, "rollbacks": 0, "dropped_pushes": 0,
                       "prefetched_steps": 0}

    @property
    def step(self) -> int:
        with self._lock:
            return self._step

    def advance_step(self) -> None:
        with self._lock:
            self._step += 1

    def adopt_step(self, cluster_step: int) -> None:
        """Continue at the cluster's step (a (re)joining worker), never going back."""
        with self._lock:
            self._step = max(self._step, cluster_step)

    def note_dropped(self, cluster_step: int) -> None:
        """sync: a push came after its step was applied; continue at the cluster's step (it ends next)."""
        with self._lock:
            self._step = max(self._step, cluster_step - 1)
            self._stats["dropped_pushes"] += 1

    def count(self, counter: str) -> None:
        with self._lock:
            self._stats[counter] += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)

    def push_header(self, shard_index: int, items: Iterable[Any]) -> tuple[int, dict[str, int], int]:
        """A new push of ``items`` (each with a ``name``) to one shard: its sequence, the base
        version of each item's variable, and the step."""
        with self._lock:
            sequence = next(self.sequences[shard_index])
            base_versions = {i.name: self._versions.get(i.name, {}).get(shard_index, 0) for i in items}
            return sequence, base_versions, self._step

    def versions(self, name: str) -> dict[int, int]:
        with self._lock:
            return dict(self._versions.get(name, {}))

    def take_ticket(self) -> int:
        with self._lock:
            ticket = self._calls_started
            self._calls_started += 1
            return ticket

    def record_versions(self, shard: ShardChannel, versions: dict[str, int], ticket: int) -> None:
        """Remember the newest versions; one that went backwards means the server rolled back."""
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
            versions = {n: f"{a} -> {b}" for n, (a, b) in rolled_back.items()}
            meaning = "it restarted from a checkpoint; updates after that checkpoint are lost"
            log.warning("ps-server rolled back: %s (shard %d): %s (versions %s)", shard.address, shard.index,
                        meaning, ", ".join(f"{n} {v}" for n, v in versions.items()), extra={"fields": {
                            "address": shard.address, "shard": shard.index, "versions": versions,
                            "meaning": meaning}})


class Session:
    """The shards of one cluster as one worker (or observer) sees them; thread-safe.

    ``chunk_bytes`` and ``consistency`` are what the servers allow and run,
    settled by :meth:`connect`. ``closed`` is set by the client's close.
    """

    def __init__(self, addresses: Sequence[str | Sequence[str]] | str, worker_id: str, *, register: bool,
                 chunk_bytes: int, control_timeout: float, data_timeout: float, retry_timeout: float,
                 tls_ca: str | bytes | None, tls_cert: str | bytes | None, tls_key: str | bytes | None,
                 server_name: str | None, auth_token: str | None, auth_token_file: str | None,
                 tcp_lane: bool = True) -> None:
        replicas = check_addresses(addresses)
        #: Each shard's entry as PS_ADDRESSES spells it: 'host:port', replicas joined by '|'.
        self.addresses = tuple(shard_spec(r) for r in replicas)
        self.worker_id = worker_id
        #: A registered client is a worker: it holds a lease and counts in the
        #: ssp/sync modes. Unregistered ones (evaluators, admin tools) only observe.
        self.register = register
        #: New on every construction: tells servers apart retries of this
        #: process from pushes of an earlier run with the same worker_id.
        self.incarnation = uuid.uuid4().hex
        self.chunk_bytes = chunk_bytes
        #: The servers' --consistency: "async", "ssp" or "sync" (read on connect).
        self.consistency = "async"
        self.control_timeout = control_timeout
        self.data_timeout = data_timeout
        self.closed = False
        # Warned about while waiting from 10 s on, or half a shorter retry_timeout: never silent.
        self._retry = RetryPolicy(timeout=retry_timeout, warn_after=min(10.0, retry_timeout / 2))
        self._tls = tls_material(tls_ca, tls_cert, tls_key)
        self._server_name = server_name
        self._token = BearerToken(auth_token, auth_token_file)
        credentials = self._tls.channel_credentials() if self._tls is not None else None
        self.shards = [ShardChannel(i, r, credentials=credentials, server_name=server_name,
                                    token=self._token, incarnation=self.incarnation,
                                    request_timeout=data_timeout,
                                    tls_context=self._tls.context if self._tls is not None else None,
                                    tcp_lane=tcp_lane)
                       for i, r in enumerate(replicas)]
        self.executor = futures.ThreadPoolExecutor(
            max_workers=max(2, 2 * len(self.shards)), thread_name_prefix=f"ps-client-{worker_id}")
        self.state = SessionState(len(self.shards))
        self._stop_heartbeat = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    # ---- calls ----

    def call(self, shard: ShardChannel, what: str, call: Callable[[], Any]) -> Any:
        """``call()`` retried while the server is unavailable (see :mod:`worker_client.transport.retry`).

        Before each retry the shard follows its primary (``ShardChannel.follow``).
        """
        return call_with_retry(call, self._retry, what, shard.address if len(shard.replicas) == 1
                               else lambda: shard.address, on_retry=self._count_retry,
                               also_retry=self.token_may_be_rotated, before_retry=shard.follow)

    def _count_retry(self) -> None:
        self.state.count("retries")

    def on_shards(self, shards: Iterable[int], fn: Callable[[ShardChannel], Any]) -> dict[int, Any]:
        """Run ``fn`` on each shard concurrently; raise the first error by shard order."""
        return run_on_shards([self.shards[i] for i in shards], fn, self.executor)

    def on_every_shard(self, fn: Callable[[ShardChannel], Any]) -> list[Any]:
        """``fn`` on every shard concurrently; the results in shard order."""
        results = run_on_shards(self.shards, fn, self.executor)
        return [results[i] for i in range(len(self.shards))]

    def run_calls(self, calls: Iterable[ShardCall], errors: dict[int, BaseException] | None = None
                  ) -> dict[int, Any]:
        """Data calls (pulls, pushes) to several shards at once, each retried (see transport.fanout)."""
        return run_shard_calls(calls, self.executor, self.call, errors)

    def token_may_be_rotated(self, error: PSError, changed_only: bool = False) -> bool:
        """A refused token from a file: re-read the file; whether to retry (see PSClient's docstring).

        ``changed_only`` (connecting): retry only if the file changed, so a wrong token fails at once.
        """
        if not isinstance(error, AuthenticationError) or not self._token.from_file:
            return False
        changed = self._token.reread()
        return changed or not changed_only

    # ---- describe and connect ----

    def describe_once(self, shard: ShardChannel, timeout: float) -> tuple[ShardInfo, list[VariableSpec]]:
        """One Describe of ``shard`` (no retry): its state and its variables' specs."""
        raw = shard.describe(ps_pb2.DescribeRequest().SerializeToString(), timeout)
        return read_describe(shard.address, raw)

    def describe_primary(self, shard: ShardChannel, timeout: float) -> tuple[ShardInfo, list[VariableSpec]]:
        """Describe ``shard`` without retrying a server, but following it to its primary: at most one
        try per replica (a replicated shard's backups refuse and name the primary)."""
        for _ in range(len(shard.replicas) - 1):
            try:
                return self.describe_once(shard, timeout)
            except PSError as error:
                if not shard.follow(error):
                    raise
        return self.describe_once(shard, timeout)

    def connect(self, timeout: float) -> tuple[float, list[VariableSpec]]:
        """Check the cluster's identity; the shortest worker lease of the servers, and the specs they hold."""
        connect_policy = RetryPolicy(timeout=timeout, warn_after=min(10.0, timeout / 2),
                                     timeout_setting="connect_timeout")
        answers = self.on_shards(range(len(self.shards)), lambda s: call_with_retry(
            lambda: self._connect_once(s, timeout), connect_policy, "connect", lambda: s.address,
            also_retry=lambda error: self.token_may_be_rotated(error, changed_only=True),
            before_retry=s.follow))
        infos = {i: info for i, (info, _) in answers.items()}
        specs = [spec for _, (_, shard_specs) in sorted(answers.items()) for spec in shard_specs]
        wrong = [f"{info.address} says it is shard {info.shard_index} of {info.num_shards}"
                 for i, info in infos.items()
                 if (info.shard_index, info.num_shards) != (i, len(self.shards))]
        # Never send a message a server would refuse for its size.
        limits = [info.chunk_bytes_limit for info in infos.values() if info.chunk_bytes_limit]
        if limits:
            self.chunk_bytes = min(self.chunk_bytes, *limits)
        if wrong:
            raise ClusterMismatchError(
                f"the address list {list(self.addresses)} does not match the cluster: "
                + "; ".join(wrong) + f" (position in the list = shard index, length = {len(self.shards)})")
        self.consistency = _one_consistency(infos.values())
        leases = [info.worker_lease_seconds for info in infos.values() if info.worker_lease_seconds > 0]
        return (min(leases) if leases else DEFAULT_LEASE_SECONDS), specs

    def _connect_once(self, shard: ShardChannel, timeout: float) -> tuple[ShardInfo, list[VariableSpec]]:
        """One Describe; when it fails as unavailable, PSTLSError if the TLS set-up is the cause."""
        try:
            return self.describe_once(shard, self.control_timeout)
        except NotPrimaryError:
            raise  # a replica answered: the connection is sound
        except PSUnavailableError as error:
            mismatch = diagnose(shard.address, self._tls, self._server_name, min(_TLS_CHECK_SECONDS, timeout))
            if mismatch is not None:
                raise mismatch from error
            raise

    # ---- lease and clock ----

    def start_heartbeat(self, lease: float) -> None:
        """Register (continuing at the cluster's step), then renew the lease a third of it apart."""
        self.heartbeat_all(self.control_timeout, adopt_step=True)
        self._heartbeat_thread = threading.Thread(
            target=self._heartbeat_loop, args=(max(0.2, lease / 3),),
            name=f"ps-heartbeat-{self.worker_id}", daemon=True)
        self._heartbeat_thread.start()

    def _heartbeat_loop(self, interval: float) -> None:
        while not self._stop_heartbeat.wait(interval):
            self.heartbeat_all(min(self.control_timeout, interval))

    def heartbeat_all(self, timeout: float, shards: Iterable[int] | None = None,
                      adopt_step: bool = False) -> None:
        """Renew the lease (and report the step) on every shard, in parallel; errors are logged.

        ``adopt_step`` (registration only): continue at the cluster's step. Never
        later: a shard that finished a step before another must not make this
        worker skip the step it is still pushing elsewhere.
        """
        request = ps_pb2.HeartbeatRequest(worker_id=self.worker_id, incarnation=self.incarnation,
                                          step=self.state.step).SerializeToString()

        def beat(shard: ShardChannel) -> int:
            try:
                return ps_pb2.HeartbeatResponse.FromString(shard.heartbeat(request, timeout)).cluster_step
            except PSError as error:  # the next beat, or a retried RPC, will tell more
                self.token_may_be_rotated(error)  # a rotated token file: the next beat carries the new one
                shard.follow(error)  # the next beat goes to the primary
                log.debug("heartbeat to ps-server %s failed (the next beat tries again): %s", shard.address,
                          error, extra={"fields": {"address": shard.address, "error": str(error)}})
                return 0

        steps = self.on_shards(range(len(self.shards)) if shards is None else shards, beat)
        cluster_step = max(steps.values(), default=0)
        if adopt_step and cluster_step:
            self.state.adopt_step(cluster_step)

    def finish_step(self, pushed_shards: set[int]) -> None:
        """A step ended. In ssp/sync mode, shards this step did not push to learn the
        new clock right away (they may be holding other workers' pulls for it)."""
        self.state.advance_step()
        if self.consistency != "async":
            others = [i for i in range(len(self.shards)) if i not in pushed_shards]
            if others:
                self.heartbeat_all(self.control_timeout, others)

    def note_cluster_step(self, cluster_step: int, dropped: bool) -> None:
        """sync: a push that came after its step was applied was dropped; the
        worker then continues at the cluster's step (its step ends next)."""
        if dropped and cluster_step:
            self.state.note_dropped(cluster_step)

    # ---- operator calls and the end ----

    def checkpoint(self) -> list[dict[str, Any]]:
        """Make every server write a checkpoint now; returns once all are durable."""
        request = ps_pb2.CheckpointRequest().SerializeToString()

        def on(shard: ShardChannel) -> dict[str, Any]:
            raw = self.call(shard, "checkpoint", lambda: shard.checkpoint(request, self.data_timeout))
            c = ps_pb2.CheckpointResponse.FromString(raw).checkpoint
            return {"address": shard.address, "checkpoint_id": c.checkpoint_id, "path": c.path,
                    "bytes": c.bytes, "write_seconds": c.write_seconds, "pause_seconds": c.pause_seconds}

        return self.on_every_shard(on)

    def export_rows(self, name: str) -> list[list[ps_pb2.ExportRowsResponse]]:
        """Each shard's ExportRows answer for hash table ``name`` (read only), in shard order."""

        def on(shard: ShardChannel) -> list[ps_pb2.ExportRowsResponse]:
            request = ps_pb2.ExportRowsRequest(variable=name, shard_index=shard.index, num_shards=self.num_shards,
                                               chunk_bytes=self.chunk_bytes).SerializeToString()
            messages = self.call(shard, "export_rows", lambda: shard.export_rows(request, self.data_timeout))
            return [ps_pb2.ExportRowsResponse.FromString(m) for m in messages]

        return self.on_every_shard(on)

    def finish(self) -> None:
        """Every server writes its final checkpoint and exits (servers run with --allow-finish)."""
        request = ps_pb2.FinishRequest(worker_id=self.worker_id).SerializeToString()
        self.on_every_shard(lambda s: self.call(s, "finish", lambda: s.finish(request, self.control_timeout)))

    def switchover(self, shard_index: int, to_replica: int | None, timeout: float) -> dict[str, Any]:
        """Hand shard ``shard_index``'s primary role to an in-sync backup (``to_replica``, or the one
        furthest along); the replica told to take over. Not retried once a primary took the request (a
        retry could hand the role on again); a refusal naming another primary is followed there, round the
        replicas and with growing pauses while an election is under way, for up to ``timeout``."""
        if not 0 <= shard_index < len(self.shards):
            raise ValueError(f"shard must be in [0, {len(self.shards)}), got {shard_index}")
        shard = self.shards[shard_index]
        request = ps_pb2.SwitchoverRequest(timeout_seconds=timeout)
        if to_replica is not None:
            request.to_replica = to_replica
        raw_request = request.SerializeToString()
        # Replicas may point at each other for a while (an election under way, a handover not yet won):
        # refusals are followed round the list, with a growing pause after each round, until ``timeout``.
        deadline = time.monotonic() + timeout
        rounds = itertools.count()
        for attempt in itertools.count(1):
            if attempt > 2 * len(shard.replicas) and time.monotonic() >= deadline:
                break
            if attempt > len(shard.replicas) and attempt % len(shard.replicas) == 1:
                pause = min(_SWITCHOVER_MAX_PAUSE, _SWITCHOVER_FIRST_PAUSE * 2 ** next(rounds))
                time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
            try:
                raw = shard.switchover(raw_request, timeout + self.control_timeout)
            except NotPrimaryError as error:  # refused before anything was handed over: go to the primary
                if not shard.follow(error):
                    raise
                continue
            except PSUnavailableError as error:
                # The client left that replica mid-call (it stopped serving as the primary: often the very
                # handover asked for). With the target named, asking the replica now in use again is
                # safe: the target, once it leads, answers at once; another primary hands over to it.
                if to_replica is None or error.address == shard.address:
                    raise
                continue
            answer = ps_pb2.SwitchoverResponse.FromString(raw)
            return {"shard": shard_index, "from": shard.address, "replica_index": answer.replica_index,
                    "address": answer.address, "seconds": answer.seconds}
        raise PSUnavailableError(f"switchover: no replica of shard {shard_index} took the request as its "
                                 f"primary within {timeout:g}s ({', '.join(shard.replicas)}); the replicas "
                                 "name no primary that answers: see `ps-admin status`", address=shard.address)

    def health(self, timeout: float) -> list[str]:
        """Each shard's gRPC health status, in shard order (one check each, shard by shard): of the
        replica in use, the primary once a call found it."""
        return [shard.health(timeout) for shard in self.shards]

    def replica_health(self, timeout: float) -> list[dict[str, str]]:
        """Each shard's replicas' health status by address, in shard order (one check each)."""
        return [shard.replica_health(timeout) for shard in self.shards]

    def replica_status(self, timeout: float) -> list[dict[str, ReplicaInfo | PSError | None]]:
        """Each shard's replicas' replication status by address, in shard order (one Describe each, asked
        even of backups): None for a replica that runs unreplicated, the error for one that failed."""
        request = ps_pb2.DescribeRequest(any_replica=True).SerializeToString()
        statuses = []
        for shard in self.shards:
            answers = shard.describe_each_replica(request, timeout)
            statuses.append({address: answer if isinstance(answer, PSError)
                             else read_replica_status(address, answer)
                             for address, answer in answers.items()})
        return statuses

    def close(self) -> None:
        """Stop the heartbeat, leave the live set, close every channel. Called once."""
        self._stop_heartbeat.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join()
            self._say_goodbye()
        for shard in self.shards:
            shard.close()
        self.executor.shutdown(wait=True)

    def _say_goodbye(self) -> None:
        """Leave the live set now, so synchronous steps stop waiting for this worker."""
        request = ps_pb2.HeartbeatRequest(worker_id=self.worker_id, incarnation=self.incarnation,
                                          leaving=True).SerializeToString()
        for shard in self.shards:
            for _ in shard.replicas:  # a failed goodbye moves on to the primary
                try:
                    shard.heartbeat(request, min(2.0, self.control_timeout))
                    break
                except PSError as error:
                    if not shard.follow(error):
                        break  # the lease expires on its own


def _one_consistency(infos: Iterable[ShardInfo]) -> str:
    """The servers' one consistency mode; ClusterMismatchError when they differ (in mode or its bound)."""
    infos = list(infos)
    modes = {info.consistency.get("mode", "async") for info in infos}
    if len(modes) > 1:
        raise ClusterMismatchError(f"the servers run different consistency modes {sorted(modes)}; "
                                   "start every ps-server with the same --consistency")
    # The mode's bound too: shards with different ones would hold the same step differently.
    bound = {"ssp": ("staleness", "--staleness"), "sync": ("backup_workers", "--backup-workers")}
    for key, flag in [bound[mode] for mode in modes if mode in bound]:
        values = {info.address: info.consistency.get(key, 0) for info in infos}
        if len(set(values.values())) > 1:
            raise ClusterMismatchError(
                f"the servers run with different {flag} ("
                + ", ".join(f"{address}: {value}" for address, value in values.items())
                + f"); start every ps-server with the same {flag}")
    return modes.pop()
