"""wehub-ps specific checks of a render: ps-server and ps-worker get the settings,
files, addresses, network access and shutdown time the programs need."""

from __future__ import annotations

from typing import Any

from .k8s_objects import find_secret, label_selector_matches, namespace_of, quantity
from .pod_templates import (
    FieldRef,
    PodUnit,
    claim_templates,
    command_of,
    container_ports,
    host_matches,
    is_ps_server,
    is_ps_worker,
    mount_for,
    pod_env,
    pod_units,
    resolve_env,
    secret_keys,
    volume_named,
)
from .replica_wiring import (
    lane_port,
    replica_address_problems,
    replica_server_problems,
    replica_set_problems,
    replicas_of,
    server_probe_problems,
)
from .role_label import role_label_problems
from .tfjob_replicas import tfjob_replica_server_problems, tfjob_replica_set_problems, tfjob_worker_problems

POD_INDEX_FIELD = "metadata.labels['apps.kubernetes.io/pod-index']"
COMPLETION_INDEX_FIELDS = {
    "metadata.annotations['batch.kubernetes.io/job-completion-index']",
    "metadata.labels['batch.kubernetes.io/job-completion-index']",
}

#: Environment variables that name files ps-server / ps-worker read.
FILE_ENV_VARS = ("PS_TLS_CERT", "PS_TLS_KEY", "PS_TLS_CLIENT_CA", "PS_TLS_CA", "PS_AUTH_TOKEN_FILE")

# ps-server defaults the manifests rely on when a variable is not set.
DEFAULT_DRAIN_TIMEOUT = 30.0
#: Seconds a final checkpoint may take on top of the drain.
CHECKPOINT_MARGIN = 60.0


def secret_key_at(unit: PodUnit, container: dict, path: str) -> tuple[str | None, str | None, str]:
    """(Secret name, key, problem) of a file path inside a container: which key of which Secret
    volume it reads, or why it is none."""
    mount = mount_for(container, path)
    if mount is None:
        return None, None, f"{path} is not on any volume mount"
    volume = volume_named(unit, mount.get("name"))
    if volume is None or "secret" not in volume:
        return None, None, f"{path} is on volume {mount.get('name')!r}, which is not a Secret volume"
    rel = path[len(str(mount["mountPath"]).rstrip("/")) + 1:]
    if mount.get("subPath"):
        rel = mount["subPath"] if not rel else f"{mount['subPath']}/{rel}"
    src = volume["secret"]
    key = rel
    for item in src.get("items") or []:
        if item.get("path") == rel:
            key = item.get("key")
            break
    else:
        if src.get("items"):
            return None, None, f"{path}: volume {mount.get('name')} projects no item at {rel!r}"
    return src.get("secretName"), key, ""


def secret_file(unit: PodUnit, container: dict, path: str, objects: list[dict]) -> tuple[dict | None, str | None, str]:
    """(Secret, key, problem) behind a file path inside a container."""
    name, key, problem = secret_key_at(unit, container, path)
    if problem:
        return None, None, problem
    secret = find_secret(objects, name, unit.namespace)
    if secret is None:
        return None, None, f"{path}: Secret {name!r} is not in the render"
    if key not in secret_keys(secret):
        return secret, None, f"{path}: Secret {name} has no key {key!r}"
    return secret, key, ""


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def wehub_problems(objects: list[dict]) -> list[str]:
    """How ps-server and ps-worker containers are wired to each other and to Kubernetes."""
    problems: list[str] = []
    units = pod_units(objects)
    server_units = [u for u in units if any(is_ps_server(c) for c in u.containers())]
    worker_units = [u for u in units if any(is_ps_worker(c) for c in u.containers())]
    for unit in server_units:
        for container in (c for c in unit.containers() if is_ps_server(c)):
            problems += _server_problems(unit, container, objects)
    replicated = [u for u in server_units if _replicated(u, objects)]
    # A TFJob holds every shard's replicas in one replica type; the others run a unit per shard.
    per_shard = [u for u in replicated if u.controller != "TFJob"]
    if per_shard:
        problems += replica_set_problems(objects, per_shard, _policy_allows)
    for unit in (u for u in replicated if u.controller == "TFJob"):
        env = resolve_env(next(c for c in unit.containers() if is_ps_server(c)), objects, unit.namespace)
        problems += tfjob_replica_set_problems(objects, unit, env, _policy_allows)
    if replicated:
        problems += role_label_problems(objects, replicated)
    for unit in worker_units:
        for container in (c for c in unit.containers() if is_ps_worker(c)):
            problems += _worker_problems(unit, container, objects, server_units)
    for unit in server_units + worker_units:
        for container in unit.containers():
            if is_ps_server(container) or is_ps_worker(container):
                problems += _file_problems(unit, container, objects)
    problems += _finish_problems(objects, server_units, worker_units)
    return problems


def _replicated(unit: PodUnit, objects: list[dict]) -> bool:
    container = next(c for c in unit.containers() if is_ps_server(c))
    return replicas_of(resolve_env(container, objects, unit.namespace)) > 1


def _server_problems(unit: PodUnit, container: dict, objects: list[dict]) -> list[str]:
    problems = []
    where = f"{unit.where} container {container.get('name')}"
    env = resolve_env(container, objects, unit.namespace)
    names, numbers = container_ports(container)
    replicated = replicas_of(env) > 1

    if replicated and unit.controller == "TFJob":
        # TF_CONFIG's flat cluster.ps, read as shards of PS_REPLICAS, gives shard, replica and count.
        problems += tfjob_replica_server_problems(unit, container, env, objects)
    elif replicated:
        problems += replica_server_problems(unit, container, env, objects)
        if env.get("PS_NUM_SHARDS") is None:
            problems.append(f"{where}: PS_NUM_SHARDS is not set")
    elif unit.controller == "TFJob":
        # TF_CONFIG gives shard index, shard count and port; these would override it.
        for var in ("PS_SHARD_INDEX", "PS_NUM_SHARDS", "PS_PORT"):
            if var in env:
                problems.append(f"{where}: sets {var}, which overrides the TF_CONFIG the operator injects")
        if container.get("name") != "tensorflow" or "tfjob-port" not in names:
            problems.append(f"{where}: the training operator takes the port from a port named tfjob-port "
                            "in the container named tensorflow")
    else:
        shards = env.get("PS_NUM_SHARDS")
        if shards is None:
            problems.append(f"{where}: PS_NUM_SHARDS is not set")
        elif unit.pods is not None and str(shards) != str(unit.pods):
            problems.append(f"{where}: PS_NUM_SHARDS={shards} but {unit.pods} server pods are created")
        index = env.get("PS_SHARD_INDEX")
        if unit.pods != 1 or index is not None:
            if not isinstance(index, FieldRef):
                problems.append(f"{where}: PS_SHARD_INDEX must come from the pod's ordinal or completion "
                                f"index (downward API), got {index!r}")
            elif unit.controller == "StatefulSet" and index.path != POD_INDEX_FIELD:
                problems.append(f"{where}: PS_SHARD_INDEX must be {POD_INDEX_FIELD}, got {index.path}")
            elif unit.controller in ("Job", "JobSet") and (index.path not in COMPLETION_INDEX_FIELDS
                                                            or not unit.indexed):
                problems.append(f"{where}: PS_SHARD_INDEX must be the completion index of an Indexed "
                                f"Job, got {index.path} (completionMode Indexed: {unit.indexed})")
            elif unit.controller not in ("StatefulSet", "Job", "JobSet"):
                problems.append(f"{where}: a {unit.controller} gives its pods no index for PS_SHARD_INDEX")
        if unit.controller in ("Job", "JobSet") and unit.completions != unit.parallelism:
            problems.append(f"{where}: completions {unit.completions} != parallelism {unit.parallelism}: "
                            "every shard must run at once")

    port_vars = {"PS_PORT": env.get("PS_PORT"), "PS_HEALTH_PORT": env.get("PS_HEALTH_PORT"),
                 "PS_METRICS_PORT": env.get("PS_METRICS_PORT")}
    if unit.controller == "TFJob":
        tf_ports = [p for p in container.get("ports") or [] if p.get("name") == "tfjob-port"]
        port_vars["PS_PORT"] = str(tf_ports[0]["containerPort"]) if tf_ports else None
    for var, value in port_vars.items():
        if value is None:
            if var != "PS_METRICS_PORT":
                problems.append(f"{where}: {var} is not set")
            continue
        if not str(value).isdigit() or int(value) not in numbers:
            problems.append(f"{where}: {var}={value} is not a container port")
    # The TCP lane (off at -1): a fixed, declared port, so that NetworkPolicies can let workers in.
    lane = env.get("PS_LANE_PORT")
    if lane is not None and str(lane) != "-1":
        if not lane_port(env):
            problems.append(f"{where}: PS_LANE_PORT={lane!r}: the TCP lane needs a fixed port (0 picks a "
                            "free one, which no NetworkPolicy lets through)")
        elif lane_port(env) not in numbers:
            problems.append(f"{where}: PS_LANE_PORT={lane} is not a container port")
    health = port_vars["PS_HEALTH_PORT"]
    if replicated:
        problems += server_probe_problems(where, container, health)
    for probe_name in () if replicated else ("livenessProbe", "readinessProbe", "startupProbe"):
        probe = container.get(probe_name)
        if not probe:
            if probe_name != "startupProbe":
                problems.append(f"{where}: no {probe_name}")
            continue
        if "grpc" not in probe:
            problems.append(f"{where}: {probe_name} should be a native gRPC probe")
            continue
        if str(probe["grpc"].get("port")) != str(health):
            problems.append(f"{where}: {probe_name} probes port {probe['grpc'].get('port')}, but only "
                            f"the health port (PS_HEALTH_PORT={health}) is plaintext; kubelet cannot speak TLS")
    readiness = (container.get("readinessProbe") or {}).get("grpc") or {}
    if readiness and not replicated and readiness.get("service") != "wehub_ps.v1.ParameterServer":
        problems.append(f"{where}: readinessProbe should ask for service wehub_ps.v1.ParameterServer, "
                        f"got {readiness.get('service')!r}")
    liveness = (container.get("livenessProbe") or {}).get("grpc") or {}
    if liveness and liveness.get("service", "") != "":
        problems.append(f"{where}: livenessProbe should ask for the server as a whole (service \"\")")

    drain = float(env.get("PS_DRAIN_TIMEOUT") or DEFAULT_DRAIN_TIMEOUT)
    grace = unit.spec.get("terminationGracePeriodSeconds", 30)
    if grace < drain + CHECKPOINT_MARGIN:
        problems.append(f"{where}: terminationGracePeriodSeconds {grace} does not cover the drain "
                        f"({drain:g} s) plus a final checkpoint ({CHECKPOINT_MARGIN:g} s)")

    limit = ((container.get("resources") or {}).get("limits") or {}).get("memory")
    budget = env.get("PS_MAX_MEMORY_BYTES")
    if limit is None:
        problems.append(f"{where}: no memory limit")
    elif budget is None:
        problems.append(f"{where}: PS_MAX_MEMORY_BYTES is not set: the default is 80% of the node's "
                        f"memory, not of the container's limit {limit}")
    elif float(budget) >= quantity(limit):
        problems.append(f"{where}: PS_MAX_MEMORY_BYTES={budget} is not below the memory limit {limit}")

    ckpt = env.get("PS_CHECKPOINT_DIR")
    if ckpt is None:
        problems.append(f"{where}: PS_CHECKPOINT_DIR is not set: a restart would lose everything")
    else:
        mount = mount_for(container, str(ckpt))
        volume = volume_named(unit, mount.get("name")) if mount else None
        persistent = mount is not None and (mount.get("name") in claim_templates(unit)
                                            or (volume is not None and "persistentVolumeClaim" in volume))
        if not persistent:
            problems.append(f"{where}: PS_CHECKPOINT_DIR={ckpt} is not on a persistent volume")
    return problems


def _worker_problems(unit: PodUnit, container: dict, objects: list[dict],
                     server_units: list[PodUnit]) -> list[str]:
    problems = []
    where = f"{unit.where} container {container.get('name')}"
    env = resolve_env(container, objects, unit.namespace)
    if unit.controller == "TFJob":
        for var in ("PS_ADDRESSES", "PS_WORKER_INDEX", "PS_NUM_WORKERS"):
            if var in env:
                problems.append(f"{where}: sets {var}, which overrides the TF_CONFIG the operator injects")
        replicated = [u for u in server_units if u.owner is unit.owner and _replicated(u, objects)]
        for servers in replicated:
            problems += tfjob_worker_problems(where, unit, container, objects, servers, _policy_allows)
        return problems
    if unit.controller in ("Job", "JobSet"):
        if not unit.indexed:
            problems.append(f"{where}: workers need completionMode Indexed (a stable worker index)")
        if unit.completions != unit.parallelism:
            problems.append(f"{where}: completions {unit.completions} != parallelism {unit.parallelism}")
    index = env.get("PS_WORKER_INDEX")
    if not (isinstance(index, FieldRef) and index.path in COMPLETION_INDEX_FIELDS):
        problems.append(f"{where}: PS_WORKER_INDEX must be the Job completion index, got {index!r}")
    workers = env.get("PS_NUM_WORKERS")
    if unit.pods is not None and str(workers) != str(unit.pods):
        problems.append(f"{where}: PS_NUM_WORKERS={workers} but {unit.pods} worker pods are created")

    # As the worker pod sees it: $(VAR) references (its namespace, say) expanded.
    raw = pod_env(unit, container, objects, 0).get("PS_ADDRESSES") if unit.downward else env.get("PS_ADDRESSES")
    if not isinstance(raw, str) or not raw.strip():
        problems.append(f"{where}: PS_ADDRESSES is not set")
        return problems
    if "|" in raw:
        return problems + replica_address_problems(where, raw, unit, server_units, objects, _policy_allows)
    addresses = [a.strip() for a in raw.split(",") if a.strip()]
    parsed = []
    for address in addresses:
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            problems.append(f"{where}: PS_ADDRESSES entry {address!r} is not host:port")
            return problems
        parsed.append((host, int(port)))
    # Which server group do these addresses name? The one whose first pod matches.
    candidates = [u for u in server_units if u.namespace == unit.namespace and u.hostnames]
    group = next((u for u in candidates if host_matches(parsed[0][0], u.hostnames[0], u.namespace)), None)
    if group is None:
        known = [u.hostnames for u in candidates]
        problems.append(f"{where}: PS_ADDRESSES starts with {parsed[0][0]!r}, which is not the first "
                        f"ps-server pod's stable name (expected one of {known})")
        return problems
    if len(parsed) != len(group.hostnames):
        problems.append(f"{where}: PS_ADDRESSES has {len(parsed)} entries but {group.where} has "
                        f"{len(group.hostnames)} pods")
    for i, ((host, _port), expected) in enumerate(zip(parsed, group.hostnames)):
        if not host_matches(host, expected, group.namespace):
            problems.append(f"{where}: PS_ADDRESSES[{i}] is {host!r}, expected {expected!r} "
                            "(shard order is pod order)")
    server_container = next(c for c in group.containers() if is_ps_server(c))
    server_env = resolve_env(server_container, objects, group.namespace)
    _, numbers = container_ports(server_container)
    for i, (_host, port) in enumerate(parsed):
        if port not in numbers or str(server_env.get("PS_PORT")) != str(port):
            problems.append(f"{where}: PS_ADDRESSES[{i}] uses port {port}, but the server listens on "
                            f"PS_PORT={server_env.get('PS_PORT')}")
    shards = server_env.get("PS_NUM_SHARDS")
    if shards is not None and str(shards) != str(len(parsed)):
        problems.append(f"{where}: PS_ADDRESSES has {len(parsed)} entries but the servers run with "
                        f"PS_NUM_SHARDS={shards}")
    # A worker must be allowed to reach the servers' port (and their TCP lane, which it
    # dials on the same host) by some NetworkPolicy if the servers are isolated for ingress.
    problems += _policy_allows(objects, unit, group, parsed[0][1], where)
    if lane_port(server_env):
        problems += _policy_allows(objects, unit, group, lane_port(server_env), f"{where} (TCP lane)")
    return problems


def _policy_allows(objects: list[dict], client: PodUnit, server: PodUnit, port: int, where: str) -> list[str]:
    problems = []
    ns = server.namespace
    policies = [p for p in objects if p.get("kind") == "NetworkPolicy" and namespace_of(p) == ns]

    def port_ok(rule: dict) -> bool:
        ports = rule.get("ports")
        if not ports:
            return True
        return any(str(p.get("port")) == str(port) or
                   (isinstance(p.get("port"), str) and any(
                       pp.get("name") == p.get("port") and pp.get("containerPort") == port
                       for c in server.containers() for pp in c.get("ports") or []))
                   for p in ports)

    def peer_ok(peers: list[dict] | None, target: PodUnit) -> bool:
        if peers is None:
            return True
        return any("namespaceSelector" not in peer and "ipBlock" not in peer
                   and label_selector_matches(peer.get("podSelector"), target.labels) for peer in peers)

    ingress = [p for p in policies if "Ingress" in ((p.get("spec") or {}).get("policyTypes") or ["Ingress"])
               and label_selector_matches((p.get("spec") or {}).get("podSelector"), server.labels)]
    if ingress and not any(port_ok(r) and peer_ok(r.get("from"), client)
                           for p in ingress for r in (p.get("spec") or {}).get("ingress") or []):
        problems.append(f"{where}: no NetworkPolicy lets it in to {server.where} on port {port}")
    egress = [p for p in policies if "Egress" in ((p.get("spec") or {}).get("policyTypes") or [])
              and label_selector_matches((p.get("spec") or {}).get("podSelector"), client.labels)]
    if egress and not any(port_ok(r) and peer_ok(r.get("to"), server)
                          for p in egress for r in (p.get("spec") or {}).get("egress") or []):
        problems.append(f"{where}: no NetworkPolicy lets it out to {server.where} on port {port}")
    return problems


def _file_problems(unit: PodUnit, container: dict, objects: list[dict]) -> list[str]:
    problems = []
    where = f"{unit.where} container {container.get('name')}"
    env = resolve_env(container, objects, unit.namespace)
    for var in FILE_ENV_VARS:
        path = env.get(var)
        if not isinstance(path, str):
            continue
        _, _, problem = secret_file(unit, container, path, objects)
        if problem:
            problems.append(f"{where}: {var}={problem}")
    return problems


def _finish_problems(objects: list[dict], servers: list[PodUnit], workers: list[PodUnit]) -> list[str]:
    """--allow-finish servers and PS_FINISH_CLUSTER workers come together."""
    problems = []
    for unit in servers:
        container = next(c for c in unit.containers() if is_ps_server(c))
        env = resolve_env(container, objects, unit.namespace)
        allow = "--allow-finish" in command_of(container) or _truthy(env.get("PS_ALLOW_FINISH", ""))
        finishing = [w for w in workers if w.namespace == unit.namespace and any(
            _truthy(resolve_env(c, objects, w.namespace).get("PS_FINISH_CLUSTER", ""))
            for c in w.containers() if is_ps_worker(c))]
        if allow and not finishing:
            problems.append(f"{unit.where}: servers run with --allow-finish but no worker sets "
                            "PS_FINISH_CLUSTER=1, so they never exit and the job never completes")
        if finishing and not allow:
            problems.append(f"{unit.where}: workers set PS_FINISH_CLUSTER=1 but the servers lack "
                            "--allow-finish and will refuse finish()")
        if unit.controller == "StatefulSet" and allow:
            problems.append(f"{unit.where}: --allow-finish on a long-lived StatefulSet: a server that "
                            "exits 0 is restarted by the StatefulSet")
    return problems
