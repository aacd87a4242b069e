"""Daemon settings from flags, environment variables and TF_CONFIG.

Precedence, highest first: command-line flag, its environment variable
(``PS_`` + the flag in upper case, e.g. ``PS_SHARD_INDEX``), TF_CONFIG (for
shard index, shard count and port), the default.

TF_CONFIG's ``cluster.ps`` lists the shards in order. An entry that names a
shard's replicas ('a|b', or a list) gives the replica count, and
``--replica-index`` picks this process's entry (and port) among them. A flat
``cluster.ps`` (one address per entry, as Kubeflow's TFJob operator writes
it for shards x R PS replicas) with ``--replicas``/``PS_REPLICAS`` R > 1 is
read as shards of R consecutive entries: task.index i is replica ``i % R`` of
shard ``i // R``, of ``len(cluster.ps) / R`` shards, on its own entry's port.
A shard index, replica index or shard count given as a flag or ``PS_``
variable must then agree with that, or the start fails naming both.
"""

from __future__ import annotations

import argparse
import math
import os
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from ps_server.ops.pod_label import DEFAULT_SERVICE_ACCOUNT_DIR
from wehub_ps.cluster import (
    WORKER_ENVIRONMENT,
    ClusterConfigError,
    TaskSpec,
    group_flat_replicas,
    split_host_port,
    task_from_tf_config,
)
from wehub_ps.kernels.compiled import COMPILED_LOOPS_ENV
from wehub_ps.process.allocator import DEFAULT_ARENA_MAX, DEFAULT_TRIM_THRESHOLD
from wehub_ps.wire.rpc import DEFAULT_CHUNK_BYTES, MAX_MESSAGE_BYTES

__all__ = ["ServerConfig", "ConfigError", "parse_config", "default_memory_limit"]

_LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    """Settings that cannot work together; the message names the flag."""


def _check_tls_files(cert: str, key: str, client_ca: str | None) -> None:
    """Load the PEM files as a TLS server does, so a bad one stops the start naming its flag.

    gRPC reports each of these as "Failed to bind to address".
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    for flag, path in (("--tls-cert", cert), ("--tls-client-ca", client_ca)):
        if path:
            try:
                context.load_verify_locations(cafile=path)
            except (ssl.SSLError, OSError) as exc:
                raise ConfigError(f"{flag} {path!r} holds no PEM certificate ({exc})") from None
    try:
        # An encrypted key gets an empty password instead of a prompt on the terminal.
        context.load_cert_chain(cert, key, password=lambda: b"")
    except (ssl.SSLError, OSError) as exc:
        if getattr(exc, "reason", None) == "KEY_VALUES_MISMATCH":  # OpenSSL's code for this check
            raise ConfigError(f"--tls-key {key!r} is not the private key of the certificate in --tls-cert "
                              f"{cert!r}: the two do not match; give the key the certificate was issued "
                              "for") from None
        raise ConfigError(f"--tls-key {key!r} cannot be loaded as the unencrypted PEM private key of "
                          f"--tls-cert {cert!r} ({exc})") from None


def default_memory_limit() -> int:
    """80% of physical memory: room for the process itself and the OS."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 0.8)
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 8 << 30


# A fixed 2 MiB receive window per stream: with gRPC's bandwidth probe the
# windows grew until 4 concurrent 100 MB pushes held 250-270 MB of RSS for
# 100 MB of variables; fixed at 2 MiB, 220 MB, with the same throughput on
# loopback (docs/benchmarks.md). 2 MiB covers a 25 Gbit/s link up to a
# 0.6 ms round trip per stream; raise it for slower, farther links.
DEFAULT_STREAM_WINDOW_BYTES = 2 << 20


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 7001
    shard_index: int = 0
    num_shards: int = 1
    checkpoint_dir: str | None = None
    disk_tier_dir: str | None = None
    log_level: str = "info"
    port_file: str | None = None
    max_memory_bytes: int = 0  # 0: default_memory_limit()
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_message_bytes: int = MAX_MESSAGE_BYTES
    stream_window_bytes: int = DEFAULT_STREAM_WINDOW_BYTES
    keep_freed_bytes: int = DEFAULT_TRIM_THRESHOLD
    malloc_arenas: int = DEFAULT_ARENA_MAX
    max_concurrent_rpcs: int = 256
    # One idle stream per worker process: room for 256 workers, each replacing its
    # stream; each holds a thread and up to --stream-window-bytes of receive window.
    max_exchange_streams: int = 512
    lane_port: int = -1
    advertise_lane_port: int = 0
    drain_timeout: float = 30.0
    checkpoint_interval: float = 300.0
    keep_checkpoints: int = 3
    full_checkpoint_every: int = 1
    expiry_interval: float = 1.0
    worker_lease: float = 30.0
    max_rows: int = 0
    consistency: str = "async"
    staleness: int = 0
    backup_workers: int = 0
    expected_workers: int = 0
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    auth_token_file: str | None = None
    health_port: int = 0
    metrics_port: int = 0
    max_variables: int = 100_000
    allow_finish: bool = False
    replicas: int = 1
    replica_index: int = 0
    etcd_endpoints: str = ""
    job_name: str = "wehub-ps"
    advertise_address: str = ""
    replication_port: int = 0
    primary_lease_seconds: int = 2
    replication_timeout: float = 0.4
    failover_after: float = 0.6
    backup_stall_timeout: float = 5.0
    switchover_timeout: float = 5.0
    unclean_election_after: float = 60.0
    max_backup_bytes: int = 256 << 20
    etcd_ca: str | None = None
    etcd_cert: str | None = None
    etcd_key: str | None = None
    etcd_start_timeout: float = 60.0
    role_label: str = "auto"
    service_account_dir: str = DEFAULT_SERVICE_ACCOUNT_DIR
    #: PS_* variables that no setting reads (a misspelling?); logged at start.
    unknown_environment: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ConfigError(f"--num-shards must be at least 1, got {self.num_shards}")
        if not 0 <= self.shard_index < self.num_shards:
            raise ConfigError(
                f"--shard-index must be in [0, {self.num_shards}) for --num-shards "
                f"{self.num_shards}, got {self.shard_index}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        if self.log_level not in _LOG_LEVELS:
            raise ConfigError(f"--log-level must be one of {', '.join(_LOG_LEVELS)}, got {self.log_level!r}")
        if self.max_memory_bytes < 0:
            raise ConfigError(f"--max-memory-bytes must be >= 0, got {self.max_memory_bytes}")
        if not 4096 <= self.chunk_bytes <= self.max_message_bytes // 2:
            raise ConfigError(
                f"--chunk-bytes must be in [4096, {self.max_message_bytes // 2}] "
                f"(half of --max-message-bytes), got {self.chunk_bytes}")
        if self.stream_window_bytes != 0 and not 64 << 10 <= self.stream_window_bytes <= 256 << 20:
            raise ConfigError(f"--stream-window-bytes must be 0 (gRPC's automatic window) or in "
                              f"[64 KiB, 256 MiB], got {self.stream_window_bytes}")
        if self.keep_freed_bytes != 0 and self.keep_freed_bytes < 1 << 20:
            raise ConfigError(f"--keep-freed-bytes must be 0 (malloc's own thresholds) or at least 1 MiB, "
                              f"got {self.keep_freed_bytes}")
        if not 0 <= self.malloc_arenas <= 1024:
            raise ConfigError(f"--malloc-arenas must be 0 (glibc's own: 8 per core) or in [1, 1024], "
                              f"got {self.malloc_arenas}")
        if self.max_concurrent_rpcs < 4:
            raise ConfigError(f"--max-concurrent-rpcs must be at least 4, got {self.max_concurrent_rpcs}")
        if not 0 <= self.max_exchange_streams <= 100_000:
            raise ConfigError(f"--max-exchange-streams must be in [0, 100000] (0: clients use ordinary calls "
                              f"only), got {self.max_exchange_streams}")
        for flag, value in (("--drain-timeout", self.drain_timeout),
                            ("--checkpoint-interval", self.checkpoint_interval)):
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"{flag} must be a number >= 0, got {value}")
        if not (math.isfinite(self.expiry_interval) and 0.01 <= self.expiry_interval <= 86400):
            raise ConfigError(f"--expiry-interval must be in [0.01, 86400] seconds, got {self.expiry_interval}")
        if not 1 <= self.full_checkpoint_every <= 10_000:
            raise ConfigError(f"--full-checkpoint-every must be in [1, 10000], got {self.full_checkpoint_every}")
        if self.keep_checkpoints < 1:
            raise ConfigError(f"--keep-checkpoints must be at least 1, got {self.keep_checkpoints}")
        if not math.isfinite(self.worker_lease) or self.worker_lease <= 0:
            raise ConfigError(f"--worker-lease must be positive seconds, got {self.worker_lease}")
        if self.max_rows < 0:
            raise ConfigError(f"--max-rows must be >= 0, got {self.max_rows}")
        if self.consistency not in ("async", "ssp", "sync"):
            raise ConfigError(f"--consistency must be async, ssp or sync, got {self.consistency!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together: give both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        for flag, value in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key),
                            ("--tls-client-ca", self.tls_client_ca), ("--auth-token-file", self.auth_token_file)):
            if value and not os.path.isfile(value):
                raise ConfigError(f"{flag} {value!r} is not a readable file")
        if self.tls_cert and self.tls_key:
            _check_tls_files(self.tls_cert, self.tls_key, self.tls_client_ca)
        for flag, value in (("--health-port", self.health_port), ("--metrics-port", self.metrics_port)):
            if not 0 <= value < 65536:
                raise ConfigError(f"{flag} must be in [0, 65535] (0 = off), got {value}")
        if self.max_variables < 1:
            raise ConfigError(f"--max-variables must be at least 1, got {self.max_variables}")
        if self.staleness < 0 or self.backup_workers < 0 or self.expected_workers < 0:
            raise ConfigError(f"--staleness, --backup-workers and --expected-workers must be >= 0, got "
                              f"{self.staleness}, {self.backup_workers} and {self.expected_workers}")
        self._check_replication()

    def _check_replication(self) -> None:
        if not 1 <= self.replicas <= 9:
            raise ConfigError(f"--replicas must be in [1, 9], got {self.replicas}")
        if not 0 <= self.replica_index < self.replicas:
            raise ConfigError(f"--replica-index must be in [0, {self.replicas}) for --replicas "
                              f"{self.replicas}, got {self.replica_index}")
        if self.replicas == 1:
            return
        if not self.etcd_endpoints:
            raise ConfigError("--replicas > 1 needs --etcd-endpoints 'host:port,...': the replicas elect "
                              "their primary through etcd")
        if not self.job_name or "/" in self.job_name:
            raise ConfigError(f"--job-name must be a non-empty name without '/', got {self.job_name!r}")
        if not -1 <= self.lane_port < 65536:
            raise ConfigError(f"--lane-port must be -1 (no TCP lane) or in [0, 65535], got {self.lane_port}")
        if not 0 <= self.advertise_lane_port < 65536:
            raise ConfigError(f"--advertise-lane-port must be in [0, 65535], got {self.advertise_lane_port}")
        if not 0 <= self.replication_port < 65536:
            raise ConfigError(f"--replication-port must be in [0, 65535], got {self.replication_port}")
        if not 1 <= self.primary_lease_seconds <= 60:
            raise ConfigError(f"--primary-lease-seconds must be in [1, 60], got {self.primary_lease_seconds}")
        if not math.isfinite(self.replication_timeout) or self.replication_timeout <= 0:
            raise ConfigError(f"--replication-timeout must be positive seconds, got "
                              f"{self.replication_timeout}")
        if not math.isfinite(self.backup_stall_timeout) or self.backup_stall_timeout < self.replication_timeout:
            raise ConfigError(f"--backup-stall-timeout must be seconds >= --replication-timeout, got "
                              f"{self.backup_stall_timeout}")
        if not math.isfinite(self.switchover_timeout) or self.switchover_timeout < 0:
            raise ConfigError(f"--switchover-timeout must be seconds >= 0 (0: no handover at SIGTERM), got "
                              f"{self.switchover_timeout}")
        if not math.isfinite(self.unclean_election_after) or self.unclean_election_after < 0:
            raise ConfigError(f"--unclean-election-after must be seconds >= 0 (0: never), got "
                              f"{self.unclean_election_after}")
        if not math.isfinite(self.failover_after) or self.failover_after <= self.replication_timeout:
            raise ConfigError(f"--failover-after ({self.failover_after}) must be more seconds than "
                              f"--replication-timeout ({self.replication_timeout}): a primary that still "
                              "reaches etcd drops a silent backup from the in-sync set before that backup "
                              "may end the primary's term")
        if not math.isfinite(self.etcd_start_timeout) or self.etcd_start_timeout <= 0:
            raise ConfigError(f"--etcd-start-timeout must be positive seconds, got {self.etcd_start_timeout}")
        if self.role_label not in ("auto", "off"):
            raise ConfigError(f"--role-label must be auto or off, got {self.role_label!r}")
        if self.max_backup_bytes < 1 << 20:
            raise ConfigError(f"--max-backup-bytes must be at least 1 MiB, got {self.max_backup_bytes}")
        if self.tls_cert and not self.tls_client_ca:
            raise ConfigError("replicas with TLS (--tls-cert) also need --tls-client-ca: backups present "
                              "this server's certificate to their primary and check the primary's against "
                              "that CA")
        if bool(self.etcd_cert) != bool(self.etcd_key):
            raise ConfigError("--etcd-cert and --etcd-key go together: give both or neither")
        if self.etcd_cert and not self.etcd_ca:
            raise ConfigError("--etcd-cert (client certificate for etcd) needs --etcd-ca")
        for flag, value in (("--etcd-ca", self.etcd_ca), ("--etcd-cert", self.etcd_cert),
                            ("--etcd-key", self.etcd_key)):
            if value and not os.path.isfile(value):
                raise ConfigError(f"{flag} {value!r} is not a readable file")

    @property
    def memory_limit(self) -> int:
        return self.max_memory_bytes or default_memory_limit()


_HELP = {
    "host": "address to listen on",
    "port": "port to listen on; 0 picks a free one (see --port-file)",
    "shard_index": "this server's shard index, 0-based",
    "num_shards": "number of ps-servers in the cluster",
    "disk_tier_dir": "directory for the row files of hash tables with a disk tier (rows beyond their "
                     "memory_rows); a cache of state checkpoints persist: files of stopped servers are removed",
    "checkpoint_dir": "checkpoint root: one for all shards of a job (a restart with another shard count "
                      "reads the old shards' checkpoints there); each replica of a replicated shard needs "
                      "its own",
    "log_level": "one of " + ", ".join(_LOG_LEVELS),
    "port_file": "write the bound port to this file once serving",
    "max_memory_bytes": "bytes this shard may hold for clients (variables, optimizer slots, hash-table "
                        "indexes, rows of pulls in flight, records of unfinished pushes); 0 = 80%% of RAM",
    "chunk_bytes": "default tensor bytes per pull message",
    "max_message_bytes": "largest gRPC message accepted or sent",
    "stream_window_bytes": "HTTP/2 receive window per stream: bounds what each push in flight buffers; "
                           "0 = gRPC's automatic window (grows with its bandwidth probe)",
    "keep_freed_bytes": "free memory each malloc arena keeps for reuse instead of returning it to the OS "
                        "(glibc; saves a page fault per 4 KiB of every message); 0 = malloc's own thresholds",
    "malloc_arenas": "malloc arenas at most (glibc), so what --keep-freed-bytes keeps per arena does not "
                     "grow with the cores; 0 = glibc's own (8 per core); MALLOC_ARENA_MAX in the environment wins",
    "max_concurrent_rpcs": "calls (pulls, pushes, control calls) served at once, Exchange streams apart; "
                           "more get RESOURCE_EXHAUSTED (the client retries)",
    "max_exchange_streams": "long-lived Exchange streams (one per worker process) held at once, at most 2 "
                            "per worker process; more are refused and those clients use ordinary calls",
    "drain_timeout": "seconds to let pushes in flight finish on SIGTERM",
    "checkpoint_interval": "seconds between periodic checkpoints (with --checkpoint-dir); 0 = only on request and SIGTERM",
    "keep_checkpoints": "checkpoints of this shard to keep (with the ones they build on)",
    "full_checkpoint_every": "one checkpoint in this many is full; the others write only the hash-table "
                             "rows changed since the previous checkpoint (and every dense variable); 1 = all full",
    "expiry_interval": "seconds between sweeps of the hash tables that have expiry (a row is removed at "
                       "most this long after it is due)",
    "worker_lease": "seconds a worker stays live without a heartbeat",
    "max_rows": "rows per hash table on this shard at most; 0 = bounded by memory only",
    "consistency": "async (apply every push at once), ssp (bounded staleness) or sync (aggregate each step)",
    "staleness": "ssp: a worker at step c waits until every live worker has completed c - staleness steps",
    "backup_workers": "sync: apply a step once all live workers but this many have pushed it",
    "expected_workers": "ssp/sync: hold the first steps until this many workers have registered",
    "tls_cert": "PEM certificate chain: serve gRPC (and metrics) over TLS",
    "tls_key": "PEM private key of --tls-cert",
    "tls_client_ca": "PEM CA bundle: require client certificates signed by it (mutual TLS), also for metrics",
    "auth_token_file": "file holding the bearer token every RPC but health, and every metrics scrape, must "
                       "present (re-read on change)",
    "health_port": "also serve the gRPC health service alone, plaintext, on this port (for kubelet probes); 0 = off",
    "metrics_port": "serve Prometheus metrics on this port; 0 = off",
    "max_variables": "variables this shard holds at most; more is RESOURCE_EXHAUSTED",
    "allow_finish": "let a client's finish() make this server write its final checkpoint and exit 0 (jobs)",
    "replicas": "processes per shard: one primary and replicas - 1 backups that apply every update and "
                "take over when the primary dies (needs --etcd-endpoints)",
    "replica_index": "this process's index in its shard's replica set, 0-based",
    "etcd_endpoints": "etcd's client addresses, 'host:port,...' (replicas > 1): the primary's lease and the "
                      "elections",
    "job_name": "names this cluster's keys in etcd (/wehub-ps/<job-name>/...)",
    "advertise_address": "'host:port' other replicas and workers reach this one at; default the host name "
                         "and the bound port",
    "lane_port": "port of the TCP lane, where workers send small pulls and pushes as frames instead of over "
                 "the gRPC Exchange stream (a round trip about 6x cheaper); -1 none, 0 a free one; reported "
                 "to clients by Describe",
    "advertise_lane_port": "the lane port Describe reports to clients, when they reach it at another port "
                           "than the one bound (a Service's port, a proxy); 0: the bound port",
    "replication_port": "port backups connect to for the stream of updates (replicas > 1); 0 picks a free "
                        "one, announced through etcd",
    "primary_lease_seconds": "TTL of the primary's etcd lease: a primary that stopped renewing it is "
                             "replaced this long after (when its port still answers); shorter fails over "
                             "sooner, longer rides out slower etcd",
    "replication_timeout": "seconds a backup may leave an update unanswered before the primary drops it from "
                           "the in-sync set (it catches up again)",
    "backup_stall_timeout": "seconds an in-sync backup whose host still acknowledges the stream at the TCP "
                            "level (its process slow: compiling, paused, loaded) may leave an update "
                            "unanswered before it leaves the in-sync set; acknowledgements wait for it "
                            "meanwhile",
    "switchover_timeout": "SIGTERM on a primary: seconds an in-sync backup may take to confirm every change "
                          "before the primary role is handed to it (changes wait meanwhile, then go to "
                          "it); 0 = no handover (the backup takes over when the lease runs out)",
    "unclean_election_after": "seconds every in-sync replica of a shard may be missing from etcd, without "
                              "proof that its process is gone (another incarnation in its slot, or its "
                              "port refusing connections), before a replica outside the in-sync set may "
                              "lead (losing what was acknowledged after its state); 0 = never",
    "failover_after": "seconds an in-sync backup hears nothing from its primary (it pings every fifth of "
                      "this) before it ends the primary's term and is elected; more than "
                      "--replication-timeout",
    "max_backup_bytes": "bytes of updates queued for one backup at most; a backup further behind is cut off "
                        "and catches up from a snapshot",
    "etcd_ca": "PEM CA bundle that signed etcd's certificate: talk to etcd over TLS",
    "etcd_cert": "PEM client certificate for etcd (mutual TLS)",
    "etcd_key": "PEM private key of --etcd-cert",
    "etcd_start_timeout": "seconds a starting replica waits for etcd to answer (retrying, logging what it "
                          "waits for) before it exits with an error; covers etcd starting after the replica "
                          "and a slow first connection",
    "role_label": "keep the label wehub-ps/role (primary, backup, joining) on this replica's pod through the "
                  "Kubernetes API (replicas > 1): auto (when the pod has a service account token, off "
                  "without one or without the permission) or off",
    "service_account_dir": "where the pod's service account token, ca.crt and namespace are mounted "
                           "(--role-label)",
}


def _env_name(field_name: str) -> str:
    return "PS_" + field_name.upper()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ps-server", allow_abbrev=False,
        description="wehub-ps parameter server: holds one shard of the variables and applies pushes.",
        epilog="Every flag can also be set as an environment variable: PS_ plus the flag name "
               "in upper case with underscores (PS_SHARD_INDEX=1). TF_CONFIG with task.type 'ps' "
               "sets the shard index, shard count and port; with --replicas R > 1 a flat cluster.ps "
               "(a TFJob's PS replicas, no 'a|b' entries) is read as shards of R consecutive entries: "
               "shard task.index // R, replica index task.index % R.",
    )
    for f in fields(ServerConfig):
        if f.name not in _HELP:
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{_HELP[f.name]} (env {_env_name(f.name)}; default {f.default})"
        if isinstance(f.default, bool):
            parser.add_argument(flag, dest=f.name, action="store_const", const=True, default=None, help=help_text)
            continue
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        parser.add_argument(flag, dest=f.name, type=kind, default=None, help=help_text)
    return parser


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> ServerConfig:
    """Resolve the configuration; ConfigError with an actionable message on bad input."""
    environ = os.environ if environ is None else environ
    args = vars(build_parser().parse_args(argv))
    try:
        task = task_from_tf_config(environ)
    except ClusterConfigError as exc:
        raise ConfigError(str(exc)) from None
    if task is not None and task.ps_addresses:
        if task.task_type != "ps":
            raise ConfigError(
                f"TF_CONFIG describes a {task.task_type!r} task; ps-server needs task.type 'ps'")
        if not 0 <= task.task_index < len(task.ps_addresses):
            raise ConfigError(f"TF_CONFIG task.index {task.task_index} has no entry in cluster.ps")
    values, sources = _given_settings(args, environ)
    if task is not None and task.ps_addresses:
        # Flags and PS_ variables win over TF_CONFIG (a flat grouping refuses contradictions instead).
        for name, value in _tf_config_settings(task, values, sources).items():
            values.setdefault(name, value)
    # The worker side's settings share the PS_ prefix; those are no misspellings of a server's.
    known = {_env_name(f.name) for f in fields(ServerConfig)} | set(WORKER_ENVIRONMENT) | {COMPILED_LOOPS_ENV}
    unknown = sorted(k for k in environ if k.startswith("PS_") and k not in known)
    return ServerConfig(**values, unknown_environment=tuple(unknown))  # type: ignore[arg-type]


def _given_settings(args: dict[str, object], environ: Mapping[str, str]
                    ) -> tuple[dict[str, object], dict[str, str]]:
    """The settings given by a flag or a PS_ variable, typed, and where each came from (for messages)."""
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    for f in fields(ServerConfig):
        if f.name not in args:
            continue
        raw = args[f.name]
        source = f"--{f.name.replace('_', '-')}"
        if raw is None and _env_name(f.name) in environ:
            raw, source = environ[_env_name(f.name)], _env_name(f.name)
        if raw is None:
            continue
        sources[f.name] = source
        kind = type(f.default) if f.default is not None else str
        if kind is bool:
            if isinstance(raw, bool):
                values[f.name] = raw
            elif str(raw).strip().lower() in ("1", "true", "yes", "on"):
                values[f.name] = True
            elif str(raw).strip().lower() in ("0", "false", "no", "off", ""):
                values[f.name] = False
            else:
                raise ConfigError(f"{source} must be true or false, got {raw!r}")
            continue
        try:
            values[f.name] = kind(raw) if kind is not str else str(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{source} must be {kind.__name__}, got {raw!r}") from None
    return values, sources


def _tf_config_settings(task: TaskSpec, given: dict[str, object], sources: dict[str, str]
                        ) -> dict[str, object]:
    """What TF_CONFIG says of this process: shard index, shard count, port (and replica count and index).

    ``given`` are the settings from flags and PS_ variables. A flat cluster.ps with a given replica
    count R > 1 is grouped into shards of R (see the module docstring); otherwise each entry is one
    shard, and a replicated entry's replicas are picked by the given replica index.
    """
    replicas = int(given.get("replicas", 1))  # type: ignore[call-overload]
    if replicas > 1 and all(len(shard) == 1 for shard in task.ps_replicas):
        return _flat_tf_config_settings(task, given, sources, replicas)
    own = task.ps_replicas[task.task_index]
    settings: dict[str, object] = {"shard_index": task.task_index, "num_shards": len(task.ps_addresses)}
    if len(own) > 1:  # 'a|b': the shard's replica set; --replica-index picks this process's port
        settings["replicas"] = len(own)
    if "port" not in given:
        index = int(given.get("replica_index", 0))  # type: ignore[call-overload]
        if not 0 <= index < len(own):
            raise ConfigError(f"--replica-index {index} has no entry in TF_CONFIG's "
                              f"cluster.ps[{task.task_index}] ({'|'.join(own)})")
        settings["port"] = split_host_port(own[index])[1]
    return settings


def _flat_tf_config_settings(task: TaskSpec, given: dict[str, object], sources: dict[str, str],
                             replicas: int) -> dict[str, object]:
    """A flat cluster.ps as shards of ``replicas`` consecutive entries: task.index i is replica
    i % replicas of shard i // replicas. A given shard index, replica index or shard count that says
    otherwise is refused: it would make this process serve a shard or a slot its peers do not expect."""
    try:
        shards = group_flat_replicas(task.ps_replicas, replicas, "TF_CONFIG cluster.ps", sources["replicas"])
    except ClusterConfigError as exc:
        raise ConfigError(str(exc)) from None
    shard, replica = divmod(task.task_index, replicas)
    settings: dict[str, object] = {"shard_index": shard, "num_shards": len(shards), "replica_index": replica}
    for name, value in settings.items():
        if name in given and given[name] != value:
            raise ConfigError(
                f"{sources[name]} {given[name]} contradicts TF_CONFIG: task.index {task.task_index} of its "
                f"{len(task.ps_addresses)} cluster.ps entries, read as shards of {sources['replicas']} "
                f"{replicas} consecutive replicas, is replica {replica} of shard {shard} of {len(shards)} "
                f"shards; leave {sources[name]} unset (TF_CONFIG gives it) or set it to {value}")
    settings["port"] = split_host_port(task.ps_replicas[task.task_index][0])[1]
    return settings
