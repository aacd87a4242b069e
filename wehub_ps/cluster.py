"""Cluster specs from the environment: TF_CONFIG or PS_ADDRESSES.

TF_CONFIG is what Kubeflow's TFJob operator and TensorFlow's own tooling
inject: ``{"cluster": {"ps": [...], "worker": [...], "chief": [...]},
"task": {"type": "ps", "index": 0}}``. The order of ``cluster.ps`` is the
shard order.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ClusterConfigError", "TaskSpec", "ps_addresses_from_env", "task_from_tf_config", "split_host_port"]


class ClusterConfigError(ValueError):
    """The environment describes no usable cluster; the message says what to set."""


@dataclass(frozen=True)
class TaskSpec:
    """This process's role according to TF_CONFIG."""

    ps_addresses: tuple[str, ...]
    task_type: str
    task_index: int
    num_workers: int


def split_host_port(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); ClusterConfigError otherwise."""
    host, sep, port = address.rpartition(":")
    bad_v6 = ":" in host and not (host.startswith("[") and host.endswith("]"))
    if not sep or not host or bad_v6 or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterConfigError(f"address must look like host:port or [ipv6]:port, got {address!r}")
    return host.strip("[]"), int(port)


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
    raw = environ.get("TF_CONFIG")
    if not raw:
        return None
    config = _parse_tf_config(raw)
    cluster = config["cluster"]
    ps = cluster.get("ps") or []
    if not isinstance(ps, list) or not all(isinstance(a, str) for a in ps):
        raise ClusterConfigError("TF_CONFIG cluster.ps must be a list of 'host:port' strings")
    for address in ps:
        split_host_port(address)
    task = config.get("task") or {}
    task_type = str(task.get("type", ""))
    try:
        task_index = int(task.get("index", 0))
    except (TypeError, ValueError):
        raise ClusterConfigError(f"TF_CONFIG task.index must be an integer, got {task.get('index')!r}") from None
    workers = len(cluster.get("worker") or []) + len(cluster.get("chief") or [])
    return TaskSpec(tuple(ps), task_type, task_index, workers)


def ps_addresses_from_env(environ: Mapping[str, str]) -> tuple[str, ...]:
    """PS_ADDRESSES ('h:p,h:p') if set, else TF_CONFIG's cluster.ps."""
    raw = environ.get("PS_ADDRESSES", "").strip()
    if raw:
        addresses = tuple(a.strip() for a in raw.split(",") if a.strip())
        for address in addresses:
            split_host_port(address)
        return addresses
    task = task_from_tf_config(environ)
    if task is None or not task.ps_addresses:
        raise ClusterConfigError(
            "no parameter servers configured: set PS_ADDRESSES='host:port,host:port' or a "
            "TF_CONFIG whose cluster has a 'ps' list"
        )
    return task.ps_addresses
