"""Checks of replicated shards (deploy/overlays/replicated): each shard's StatefulSet carries
its shard as a literal pod label the server reads, the workers list every shard's replicas in
order ('|' between replicas, ',' between shards) and reach them (the gRPC port and the TCP lane),
the replication stream has a fixed container port, the replicas reach each other (that port,
and the gRPC port) and etcd, and the disruption budgets keep one replica of each shard and
etcd's quorum."""

from __future__ import annotations

from collections.abc import Callable

from .k8s_objects import label_selector_matches, namespace_of
from .pod_templates import FieldRef, PodUnit, is_ps_server, resolve_env

POD_INDEX_FIELD = "metadata.labels['apps.kubernetes.io/pod-index']"
_LABEL_FIELD = "metadata.labels['"


def replicas_of(env: dict) -> int:
    value = env.get("PS_REPLICAS")
    return int(value) if isinstance(value, str) and value.isdigit() else 1


def shard_of(unit: PodUnit, env: dict) -> str | None:
    """The shard a replicated StatefulSet serves: the literal template label PS_SHARD_INDEX reads."""
    index = env.get("PS_SHARD_INDEX")
    if not isinstance(index, FieldRef) or not index.path.startswith(_LABEL_FIELD):
        return None
    return unit.labels.get(index.path[len(_LABEL_FIELD):-2])


def server_probe_problems(where: str, container: dict, health: object) -> list[str]:
    """Readiness asks health service "" (primary or in-sync backup);
    liveness only that the health port answers."""
    problems = []
    readiness = (container.get("readinessProbe") or {}).get("grpc")
    if not readiness or readiness.get("service", "") != "" or str(readiness.get("port")) != str(health):
        problems.append(f"{where}: a replica's readinessProbe must be gRPC on the health port "
                        f"(PS_HEALTH_PORT={health}) for service \"\" (primary or in-sync backup)")
    liveness = container.get("livenessProbe") or {}
    port = (liveness.get("grpc") or liveness.get("tcpSocket") or {}).get("port")
    if str(port) != str(health) or (liveness.get("grpc") or {}).get("service", "") != "":
        problems.append(f"{where}: a replica's livenessProbe must ask the health port (gRPC service \"\" "
                        "or a TCP connect)")
    return problems


def replica_server_problems(unit: PodUnit, container: dict, env: dict) -> list[str]:
    """One replicated StatefulSet: shard and replica index, replica count, advertised address."""
    where = f"{unit.where} container {container.get('name')}"
    problems = []
    if unit.controller != "StatefulSet":
        return [f"{where}: replicated shards run as a StatefulSet per shard, not a {unit.controller}"]
    if shard_of(unit, env) is None:
        problems.append(f"{where}: PS_SHARD_INDEX must be a pod template label (one StatefulSet per shard), "
                        f"got {env.get('PS_SHARD_INDEX')!r}")
    index = env.get("PS_REPLICA_INDEX")
    if not (isinstance(index, FieldRef) and index.path == POD_INDEX_FIELD):
        problems.append(f"{where}: PS_REPLICA_INDEX must be {POD_INDEX_FIELD}, got {index!r}")
    if unit.pods != replicas_of(env):
        problems.append(f"{where}: PS_REPLICAS={env.get('PS_REPLICAS')} but {unit.pods} pods")
    pod_name_vars = [k for k, v in env.items() if isinstance(v, FieldRef) and v.path == "metadata.name"]
    service = (unit.owner.get("spec") or {}).get("serviceName")
    expected = {f"$({var}).{service}:{env.get('PS_PORT')}" for var in pod_name_vars}
    if env.get("PS_ADVERTISE_ADDRESS") not in expected:
        problems.append(f"{where}: PS_ADVERTISE_ADDRESS={env.get('PS_ADVERTISE_ADDRESS')!r} should be the "
                        f"pod's stable name on PS_PORT, $(<pod name>).{service}:{env.get('PS_PORT')}")
    return problems + _replication_port_problems(where, container, env)


def replication_port(env: dict) -> int:
    """PS_REPLICATION_PORT (0 when unset or not a number: ps-server then picks a free port)."""
    value = env.get("PS_REPLICATION_PORT")
    return int(value) if isinstance(value, str) and value.isdigit() else 0


def lane_port(env: dict) -> int:
    """PS_LANE_PORT (0 when unset, -1 or not a fixed number: no TCP lane a NetworkPolicy could name)."""
    value = env.get("PS_LANE_PORT")
    return int(value) if isinstance(value, str) and value.isdigit() else 0


def _replication_port_problems(where: str, container: dict, env: dict) -> list[str]:
    """The replication stream listens on a fixed container port: a free port picked at start
    is announced through etcd, but no NetworkPolicy can let an unknown port through."""
    port = replication_port(env)
    if port == 0:
        return [f"{where}: PS_REPLICATION_PORT={env.get('PS_REPLICATION_PORT')!r}: the replication stream "
                "needs a fixed port (unset, ps-server picks a free one that no NetworkPolicy lets through)"]
    declared = {int(p["containerPort"]) for p in container.get("ports") or [] if "containerPort" in p}
    if port not in declared:
        return [f"{where}: PS_REPLICATION_PORT={port} is not a containerPort ({sorted(declared)})"]
    return []


def replica_set_problems(
        objects: list[dict], units: list[PodUnit],
        policy_allows: Callable[[list[dict], PodUnit, PodUnit, int, str], list[str]]) -> list[str]:
    """Across the shards: one StatefulSet per shard 0..N-1, spread, budgets, etcd and its reach."""
    problems = []
    envs = {id(u): resolve_env(next(c for c in u.containers() if is_ps_server(c)), objects, u.namespace)
            for u in units}
    shards = sorted(str(shard_of(u, envs[id(u)])) for u in units)
    count = envs[id(units[0])].get("PS_NUM_SHARDS")
    if shards != [str(i) for i in range(int(count or 0))]:
        problems.append(f"replicated shards: StatefulSets for shards {shards}, but PS_NUM_SHARDS={count}")
    pdbs = [o for o in objects if o.get("kind") == "PodDisruptionBudget"]
    for unit in units:
        env, where = envs[id(unit)], unit.where
        shard_key = (env["PS_SHARD_INDEX"].path[len(_LABEL_FIELD):-2]
                     if isinstance(env.get("PS_SHARD_INDEX"), FieldRef) else "")
        spread = [c for c in unit.spec.get("topologySpreadConstraints") or []
                  if c.get("topologyKey") == "kubernetes.io/hostname"
                  and c.get("whenUnsatisfiable") == "DoNotSchedule"
                  and (shard_key in (c.get("matchLabelKeys") or [])
                       or shard_key in ((c.get("labelSelector") or {}).get("matchLabels") or {}))]
        if not spread:
            problems.append(f"{where}: no topologySpreadConstraint over kubernetes.io/hostname on the shard "
                            f"label {shard_key!r}: a node could hold every replica of the shard")
        covering = [p for p in pdbs if namespace_of(p) == unit.namespace
                    and label_selector_matches((p.get("spec") or {}).get("selector"), unit.labels)]
        keeps = [p for p in covering if _budget_keeps(p.get("spec") or {}, unit.pods or 0) >= 1]
        if len(covering) != 1 or not keeps:
            problems.append(f"{where}: needs exactly one PodDisruptionBudget "
                            "that keeps a replica of the shard, "
                            f"found {[p['metadata']['name'] for p in covering]}")
        # The stream of updates, and the gRPC port a backup checks for a primary whose process is gone.
        problems += policy_allows(objects, unit, unit, replication_port(env), f"{where} (replication)")
        problems += policy_allows(objects, unit, unit, int(env.get("PS_PORT") or 0),
                                  f"{where} (primary check)")
        problems += _etcd_problems(objects, unit, env, pdbs, policy_allows)
    return problems


def _budget_keeps(spec: dict, pods: int) -> int:
    """Pods a PodDisruptionBudget keeps out of ``pods`` (integers only; percentages are refused)."""
    if str(spec.get("minAvailable", "")).isdigit():
        return int(spec["minAvailable"])
    if str(spec.get("maxUnavailable", "")).isdigit():
        return pods - int(spec["maxUnavailable"])
    return 0


def _etcd_problems(objects: list[dict], unit: PodUnit, env: dict, pdbs: list[dict],
                   policy_allows: Callable[[list[dict], PodUnit, PodUnit, int, str], list[str]]) -> list[str]:
    from .pod_templates import pod_units

    where = f"{unit.where} PS_ETCD_ENDPOINTS"
    endpoints = [e.strip() for e in str(env.get("PS_ETCD_ENDPOINTS") or "").split(",") if e.strip()]
    hosts = [e.rpartition(":")[0] for e in endpoints]
    etcd = [u for u in pod_units(objects) if u.controller == "StatefulSet" and u.namespace == unit.namespace
            and any("etcd" in str((c.get("command") or [""])[0]) for c in u.containers())]
    if not etcd:
        return [] if endpoints else [f"{where}: not set, and the render has no etcd"]
    members = etcd[0]
    if hosts != members.hostnames:
        return [f"{where}={env.get('PS_ETCD_ENDPOINTS')!r} should name every member, {members.hostnames}"]
    problems = []
    ports = {e.rpartition(":")[2] for e in endpoints}
    client_ports = {str(p.get("containerPort")) for c in members.containers() for p in c.get("ports") or []
                    if p.get("name") == "client"}
    if ports != client_ports:
        problems.append(f"{where}: port {sorted(ports)} is not etcd's client port {sorted(client_ports)}")
    quorum = (members.pods or 0) // 2 + 1
    budgets = [p for p in pdbs
               if label_selector_matches((p.get("spec") or {}).get("selector"), members.labels)]
    if not budgets or min(_budget_keeps(p.get("spec") or {}, members.pods or 0) for p in budgets) < quorum:
        problems.append(f"{members.where}: needs a PodDisruptionBudget that keeps its quorum of {quorum}")
    for port in sorted(client_ports):
        problems += policy_allows(objects, unit, members, int(port), f"{unit.where} (etcd)")
    return problems


def replica_address_problems(where: str, raw: str, worker: PodUnit, server_units: list[PodUnit],
                             objects: list[dict],
                             policy_allows: Callable[[list[dict], PodUnit, PodUnit, int, str], list[str]]
                             ) -> list[str]:
    """PS_ADDRESSES 'r0|r1,r0|r1': shard i's group names the pods of shard i's StatefulSet in ordinal
    order, on the port the replicas listen on, and NetworkPolicies let the worker reach them."""
    by_shard: dict[str, tuple[PodUnit, dict]] = {}
    for unit in server_units:
        if unit.namespace != worker.namespace:
            continue
        env = resolve_env(next(c for c in unit.containers() if is_ps_server(c)), objects, unit.namespace)
        if replicas_of(env) > 1 and shard_of(unit, env) is not None:
            by_shard[str(shard_of(unit, env))] = (unit, env)
    groups = [g.strip() for g in raw.split(",") if g.strip()]
    problems = []
    if sorted(by_shard) != [str(i) for i in range(len(groups))]:
        return [(f"{where}: PS_ADDRESSES has {len(groups)} shards but the replicated StatefulSets serve "
                 f"shards {sorted(by_shard)}")]
    for i, group in enumerate(groups):
        unit, env = by_shard[str(i)]
        entries = [e.strip() for e in group.split("|")]
        hosts = [e.rpartition(":")[0] for e in entries]
        ports = {e.rpartition(":")[2] for e in entries}
        if hosts != unit.hostnames:
            problems.append(f"{where}: PS_ADDRESSES shard {i} is {hosts}, expected the replicas of "
                            f"{unit.where} in order, {unit.hostnames}")
        if ports != {str(env.get("PS_PORT"))}:
            problems.append(f"{where}: PS_ADDRESSES shard {i} uses ports {sorted(ports)}, but the replicas "
                            f"listen on PS_PORT={env.get('PS_PORT')}")
        if str(env.get("PS_NUM_SHARDS")) != str(len(groups)):
            problems.append(f"{where}: PS_ADDRESSES has {len(groups)} shards but the servers run with "
                            f"PS_NUM_SHARDS={env.get('PS_NUM_SHARDS')}")
        problems += policy_allows(objects, worker, unit, int(env.get("PS_PORT") or 0), where)
        if lane_port(env):
            problems += policy_allows(objects, worker, unit, lane_port(env), f"{where} (TCP lane)")
    return problems
