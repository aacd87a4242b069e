"""Cluster specs from the environment (TF_CONFIG or PS_ADDRESSES), and the names of a worker's settings.

TF_CONFIG is what Kubeflow's TFJob operator and TensorFlow's own tooling
inject: ``{"cluster": {"ps": [...], "worker": [...], "chief": [...]},
"task": {"type": "ps", "index": 0}}``. The order of ``cluster.ps`` is the
shard order.

A shard may run as several replicas (one primary, the others backups). Its
entry then lists them all, separated by ``|``: ``PS_ADDRESSES='h0a:p|h0b:p,
h1a:p|h1b:p'``; in TF_CONFIG a ``cluster.ps`` entry is such a string or a
list of strings. :func:`parse_shard_replicas` is the one parser of every
form (PS_ADDRESSES, TF_CONFIG, ``PSClient(addresses=...)``).

A flat ``cluster.ps`` (no entry lists replicas) with R replicas per shard
(``PS_REPLICAS``, ps-server's ``--replicas``) is read as shards of R
consecutive entries: entry i is replica ``i % R`` of shard ``i // R``
(:func:`group_flat_replicas`). That is how Kubeflow's TFJob operator lists
shards x R PS replicas, one address each, in index order.

The ``*_ENV`` names are the environment variables the worker side reads
(``PSClient.from_env``, ps-admin, ps-local's worker); :data:`WORKER_ENVIRONMENT`
lists them all, so that ps-server, which warns about PS_* variables it does
not read, knows them without naming them itself. :data:`CLUSTER_ENVIRONMENT`
and :data:`CONNECTION_ENVIRONMENT` say what each of ``PSClient.from_env``'s
means: it reads them from there, and ps-admin's ``--help`` lists them from
there, so the two cannot disagree.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["ClusterConfigError", "TaskSpec", "ps_addresses_from_env", "task_from_tf_config",
           "split_host_port", "parse_shard_replicas", "shard_spec", "REPLICA_SEPARATOR", "SHARD_SEPARATOR",
           "EnvSetting", "CLUSTER_ENVIRONMENT", "CONNECTION_ENVIRONMENT", "TF_CONFIG_ENV",
           "WORKER_ENVIRONMENT", "ADDRESSES_ENV", "WORKER_ID_ENV", "WORKER_INDEX_ENV", "NUM_WORKERS_ENV",
           "TLS_CA_ENV", "TLS_CERT_ENV", "TLS_KEY_ENV", "SERVER_NAME_ENV", "AUTH_TOKEN_FILE_ENV",
           "AUTH_TOKEN_ENV", "LOG_LEVEL_ENV", "FINISH_CLUSTER_ENV", "EXAMPLE_ENV", "EXAMPLE_CONFIG_ENV",
           "WIRE_DTYPE_ENV", "REPLICAS_ENV", "replicas_from_env", "group_flat_replicas"]

#: The ps-servers, 'host:port,host:port' in shard order, a shard's replicas joined by '|'
#: (else TF_CONFIG's cluster.ps).
ADDRESSES_ENV = "PS_ADDRESSES"
#: TensorFlow's cluster spec: the servers (cluster.ps) and this process's task.
TF_CONFIG_ENV = "TF_CONFIG"
#: Replicas per shard: groups a flat TF_CONFIG cluster.ps into shards (ps-server's --replicas too).
REPLICAS_ENV = "PS_REPLICAS"
#: PSClient.from_env: this worker's id (else TF_CONFIG's task type and index).
WORKER_ID_ENV = "PS_WORKER_ID"
#: PSClient.from_env: TLS, server name and bearer token of the connections to the servers.
TLS_CA_ENV = "PS_TLS_CA"
TLS_CERT_ENV = "PS_TLS_CERT"
TLS_KEY_ENV = "PS_TLS_KEY"
SERVER_NAME_ENV = "PS_SERVER_NAME"
AUTH_TOKEN_FILE_ENV = "PS_AUTH_TOKEN_FILE"
AUTH_TOKEN_ENV = "PS_AUTH_TOKEN"
#: ps-local's worker: its index and the number of workers (else JOB_COMPLETION_INDEX or TF_CONFIG).
WORKER_INDEX_ENV = "PS_WORKER_INDEX"
NUM_WORKERS_ENV = "PS_NUM_WORKERS"
#: ps-local's worker: log level; '1' to end the job when training is done; the example, its
#: config overrides (JSON) and the dtype on the wire.
LOG_LEVEL_ENV = "PS_LOG_LEVEL"
FINISH_CLUSTER_ENV = "PS_FINISH_CLUSTER"
EXAMPLE_ENV = "PS_EXAMPLE"
EXAMPLE_CONFIG_ENV = "PS_EXAMPLE_CONFIG"
WIRE_DTYPE_ENV = "PS_WIRE_DTYPE"

#: Every environment variable the worker side reads.
WORKER_ENVIRONMENT: tuple[str, ...] = (
    ADDRESSES_ENV, REPLICAS_ENV, WORKER_ID_ENV, TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, SERVER_NAME_ENV,
    AUTH_TOKEN_FILE_ENV, AUTH_TOKEN_ENV, WORKER_INDEX_ENV, NUM_WORKERS_ENV, LOG_LEVEL_ENV, FINISH_CLUSTER_ENV,
    EXAMPLE_ENV, EXAMPLE_CONFIG_ENV, WIRE_DTYPE_ENV,
)


@dataclass(frozen=True)
class EnvSetting:
    """An environment variable of the worker side: its name, the PSClient argument it fills (if any),
    and what it means, as ``--help`` texts show it."""

    name: str
    argument: str
    meaning: str


#: Where PSClient.from_env finds the servers and the worker's id, in the order it looks.
CLUSTER_ENVIRONMENT: tuple[EnvSetting, ...] = (
    EnvSetting(ADDRESSES_ENV, "addresses",
               "the ps-servers, 'host:port,host:port' in shard order; a replicated shard lists its "
               "replicas joined by '|' ('h0a:p|h0b:p,h1a:p|h1b:p')"),
    EnvSetting(TF_CONFIG_ENV, "addresses",
               "TensorFlow's cluster spec: the servers are its cluster.ps when PS_ADDRESSES is unset"),
    EnvSetting(REPLICAS_ENV, "addresses",
               "replicas per shard R (default 1): a TF_CONFIG cluster.ps of single addresses (a TFJob's PS "
               "replicas) is read as shards of R consecutive entries; PS_ADDRESSES marks replicas with '|'"),
    EnvSetting(WORKER_ID_ENV, "worker_id", "this worker's id (else TF_CONFIG's task type and index)"),
)

#: What PSClient.from_env reads for its connections to the servers (an argument given wins).
CONNECTION_ENVIRONMENT: tuple[EnvSetting, ...] = (
    EnvSetting(TLS_CA_ENV, "tls_ca", "CA certificate (PEM file) that verifies the servers; turns TLS on"),
    EnvSetting(TLS_CERT_ENV, "tls_cert", "client certificate (PEM file), for servers with --tls-client-ca"),
    EnvSetting(TLS_KEY_ENV, "tls_key", "the client certificate's private key (PEM file)"),
    EnvSetting(SERVER_NAME_ENV, "server_name",
               "the name the servers' certificate must hold (else each address's host)"),
    EnvSetting(AUTH_TOKEN_FILE_ENV, "auth_token_file",
               "file holding the bearer token (--auth-token-file); read again when a server refuses it"),
    EnvSetting(AUTH_TOKEN_ENV, "auth_token", "the bearer token itself (the file is preferred)"),
)


class ClusterConfigError(ValueError):
    """The environment describes no usable cluster; the message says what to set."""


#: Between the shards of PS_ADDRESSES, and between the replicas of one shard.
SHARD_SEPARATOR = ","
REPLICA_SEPARATOR = "|"


@dataclass(frozen=True)
class TaskSpec:
    """This process's role according to TF_CONFIG.

    ``ps_addresses``: one entry per shard, its replicas joined by ``|``
    (one replica: the plain 'host:port').
    """

    ps_addresses: tuple[str, ...]
    task_type: str
    task_index: int
    num_workers: int

    @property
    def ps_replicas(self) -> tuple[tuple[str, ...], ...]:
        """Each shard's replica addresses, in shard order."""
        return parse_shard_replicas(self.ps_addresses)


def split_host_port(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); ClusterConfigError otherwise."""
    host, sep, port = address.rpartition(":")
    bad_v6 = ":" in host and not (host.startswith("[") and host.endswith("]"))
    if not sep or not host or bad_v6 or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterConfigError(f"address must look like host:port or [ipv6]:port, got {address!r}")
    return host.strip("[]"), int(port)


def shard_spec(replicas: Sequence[str]) -> str:
    """One shard's entry as PS_ADDRESSES spells it: its replicas joined by '|'."""
    return REPLICA_SEPARATOR.join(replicas)


def parse_shard_replicas(value: str | Sequence[str | Sequence[str]], where: str = "addresses"
                         ) -> tuple[tuple[str, ...], ...]:
    """Every shard's replica addresses, position = shard index; ClusterConfigError names what is wrong.

    ``value`` is PS_ADDRESSES' form ('a:1|b:1,c:1|d:1'; blank shards between
    commas are skipped), or a sequence with one item per shard, each either
    such a string ('a:1' or 'a:1|b:1') or a sequence of 'host:port' strings.
    Each replica must be a valid address, and no address may appear twice in
    the whole list (two shards, or two replicas of one, are never one server).
    ``where`` names the setting in the messages.
    """
    if isinstance(value, str):
        items: list[str | Sequence[str]] = [s.strip() for s in value.split(SHARD_SEPARATOR) if s.strip()]
    elif isinstance(value, Sequence):
        items = list(value)
    else:
        raise ClusterConfigError(f"{where} must be a string or a list of shards, got {type(value).__name__}")
    if not items:
        raise ClusterConfigError(f"{where} must list at least one ps-server as 'host:port', got none")
    shards: list[tuple[str, ...]] = []
    seen: dict[str, int] = {}
    for index, item in enumerate(items):
        replicas = _shard_replicas(item, index, where)
        for address in replicas:
            if address in seen:
                twice = (f"twice in shard {index}" if seen[address] == index
                         else f"for shard {seen[address]} and shard {index}")
                raise ClusterConfigError(f"{where}: {address!r} is listed {twice}; every replica of every "
                                         "shard must be a different server")
            seen[address] = index
        shards.append(replicas)
    return tuple(shards)


def _shard_replicas(item: str | Sequence[str], index: int, where: str) -> tuple[str, ...]:
    """One shard's replicas from its entry ('a:1', 'a:1|b:1' or ['a:1', 'b:1'])."""
    if isinstance(item, str):
        replicas = [r.strip() for r in item.strip().split(REPLICA_SEPARATOR)]
    elif isinstance(item, Sequence) and all(isinstance(r, str) for r in item):
        replicas = [r.strip() for r in item]
    else:
        raise ClusterConfigError(f"{where}: shard {index} must be 'host:port', 'host:port|host:port' or a "
                                 f"list of 'host:port' strings, got {item!r}")
    if not replicas or any(not r for r in replicas):
        raise ClusterConfigError(f"{where}: shard {index} has an empty replica address in {item!r} "
                                 "(replicas are joined by a single '|', none may be blank)")
    for address in replicas:
        if REPLICA_SEPARATOR in address or SHARD_SEPARATOR in address:
            raise ClusterConfigError(f"{where}: shard {index} replica {address!r} must be one 'host:port'")
        try:
            split_host_port(address)
        except ClusterConfigError as exc:
            raise ClusterConfigError(f"{where}: shard {index}: {exc}") from None
    return tuple(replicas)


def _parse_tf_config(raw: str) -> dict:
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ClusterConfigError(f"TF_CONFIG is not valid JSON: {exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
        raise ClusterConfigError("TF_CONFIG must be an object with a 'cluster' object")
    return config


def task_from_tf_config(environ: Mapping[str, str]) -> TaskSpec | None:
    """The task described by TF_CONFIG, or None when TF_CONFIG is unset."""
    raw = environ.get(TF_CONFIG_ENV)
    if not raw:
        return None
    config = _parse_tf_config(raw)
    cluster = config["cluster"]
    ps = cluster.get("ps") or []
    if not isinstance(ps, list):
        raise ClusterConfigError("TF_CONFIG cluster.ps must be a list of 'host:port' strings (a replicated "
                                 "shard: 'host:port|host:port' or a list of 'host:port' strings)")
    shards = parse_shard_replicas(ps, "TF_CONFIG cluster.ps") if ps else ()
    task = config.get("task") or {}
    task_type = str(task.get("type", ""))
    try:
        task_index = int(task.get("index", 0))
    except (TypeError, ValueError):
        raise ClusterConfigError(f"TF_CONFIG task.index must be an integer, got {task.get('index')!r}") from None
    workers = len(cluster.get("worker") or []) + len(cluster.get("chief") or [])
    return TaskSpec(tuple(shard_spec(r) for r in shards), task_type, task_index, workers)


def replicas_from_env(environ: Mapping[str, str]) -> int:
    """PS_REPLICAS, the replicas per shard (1 when unset); ClusterConfigError when not a whole number >= 1."""
    raw = environ.get(REPLICAS_ENV, "").strip()
    if not raw:
        return 1
    if not raw.isdigit() or int(raw) < 1:
        raise ClusterConfigError(f"{REPLICAS_ENV} must be a whole number >= 1 (the replicas per shard), "
                                 f"got {raw!r}")
    return int(raw)


def group_flat_replicas(shards: Sequence[Sequence[str]], replicas: int, where: str = "TF_CONFIG cluster.ps",
                        setting: str = REPLICAS_ENV) -> tuple[tuple[str, ...], ...]:
    """A flat list (one address per entry) read as shards of ``replicas`` consecutive entries.

    Entry i becomes replica ``i % replicas`` of shard ``i // replicas``: a
    TFJob's operator lists its PS replicas so, one per index, and cannot mark a
    shard's replicas with '|'. A list that already groups replicas (an entry
    with several), or ``replicas`` 1, comes back as it is. ClusterConfigError
    when the length is not a multiple of ``replicas``; ``where`` and
    ``setting`` name the list and the replica count in the message.
    """
    groups = tuple(tuple(shard) for shard in shards)
    if replicas <= 1 or any(len(shard) != 1 for shard in groups):
        return groups
    if len(groups) % replicas:
        raise ClusterConfigError(
            f"{where} lists {len(groups)} ps-servers, which is not a multiple of {setting} {replicas}: "
            f"a flat list is read as shards of {replicas} consecutive replicas, so it needs shards x {replicas} "
            f"entries (a TFJob's PS replicas); set {setting} to the replicas per shard, or list every "
            "replica of every shard")
    flat = [shard[0] for shard in groups]
    return tuple(tuple(flat[i:i + replicas]) for i in range(0, len(flat), replicas))


def ps_addresses_from_env(environ: Mapping[str, str]) -> tuple[str, ...]:
    """PS_ADDRESSES ('h:p,h:p', a replicated shard 'h:p|h:p') if set, else TF_CONFIG's cluster.ps.

    One entry per shard, its replicas joined by '|' (see :func:`parse_shard_replicas`). A flat
    cluster.ps is grouped into shards of PS_REPLICAS consecutive replicas
    (:func:`group_flat_replicas`); PS_ADDRESSES is taken as written.
    """
    raw = environ.get(ADDRESSES_ENV, "").strip()
    if raw:
        return tuple(shard_spec(r) for r in parse_shard_replicas(raw, ADDRESSES_ENV))
    task = task_from_tf_config(environ)
    if task is None or not task.ps_addresses:
        raise ClusterConfigError(
            "no parameter servers configured: set PS_ADDRESSES='host:port,host:port' (a replicated "
            "shard: 'host:port|host:port') or a "
            "TF_CONFIG whose cluster has a 'ps' list"
        )
    shards = group_flat_replicas(task.ps_replicas, replicas_from_env(environ))
    return tuple(shard_spec(replicas) for replicas in shards)
