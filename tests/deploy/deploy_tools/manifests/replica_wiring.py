"""Checks of replicated shards (deploy/overlays/replicated: a StatefulSet per shard;
deploy/jobset-replicated: a JobSet's child Job per shard): every pod of a shard carries its shard
as a pod label the server reads, each pod resolves its own replica index and advertises its own
stable name, no two replicas of a shard share a checkpoint directory, the workers list every
shard's replicas in order ('|' between replicas, ',' between shards) as the replicas advertise
themselves and reach them (the gRPC port and the TCP lane), the replication stream has a fixed
container port, the replicas reach each other (that port, and the gRPC port) and etcd, and the
disruption budgets keep one replica of each shard and etcd's quorum."""

from __future__ import annotations

from collections.abc import Callable

from .k8s_objects import label_selector_matches, namespace_of
from .pod_templates import (
    FieldRef,
    PodUnit,
    claim_templates,
    expand,
    host_matches,
    is_ps_server,
    mount_for,
    pod_env,
    resolve_env,
    volume_named,
)

_LABEL_FIELD = "metadata.labels['"
#: The controllers that run a shard's replicas, one object (or child Job) per shard.
REPLICA_CONTROLLERS = ("StatefulSet", "JobSet")


def replicas_of(env: dict) -> int:
    value = env.get("PS_REPLICAS")
    return int(value) if isinstance(value, str) and value.isdigit() else 1


def shard_of(unit: PodUnit, env: dict) -> str | None:
    """The shard a replica set serves: the label PS_SHARD_INDEX reads, which every pod of the unit
    carries alike (a StatefulSet's template label, a JobSet child Job's job index)."""
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


def replica_server_problems(unit: PodUnit, container: dict, env: dict, objects: list[dict]) -> list[str]:
    """One shard's replica set: shard and replica index, replica count, advertised address, each
    pod's own checkpoint directory, the replication port."""
    where = f"{unit.where} container {container.get('name')}"
    problems = []
    if unit.controller not in REPLICA_CONTROLLERS:
        return [f"{where}: replicated shards run as a StatefulSet per shard or a JobSet child Job per "
                f"shard, not a {unit.controller}"]
    shard = shard_of(unit, env)
    if shard is None:
        problems.append(f"{where}: PS_SHARD_INDEX must be a label every pod of the shard carries (one "
                        f"StatefulSet per shard, or the JobSet's job index), got {env.get('PS_SHARD_INDEX')!r}")
    if unit.controller == "JobSet" and (not unit.indexed or unit.completions != unit.parallelism):
        problems.append(f"{where}: a shard's Job must be Indexed with completions = parallelism (every replica "
                        f"at once), got completions {unit.completions}, parallelism {unit.parallelism}")
    if unit.pods != replicas_of(env):
        problems.append(f"{where}: PS_REPLICAS={env.get('PS_REPLICAS')} but {unit.pods} pods")
    problems += _pod_problems(unit, container, env, objects, shard)
    problems += checkpoint_problems(unit, container, env, objects)
    return problems + replication_port_problems(where, container, env)


def _pod_problems(unit: PodUnit, container: dict, env: dict, objects: list[dict], shard: str | None) -> list[str]:
    """Each pod, as its downward API values resolve its environment: its shard, its replica index
    (its place among the shard's pods) and its advertised address (its own stable name)."""
    where = f"{unit.where} container {container.get('name')}"
    if not unit.hostnames:
        return [f"{where}: the replicas have no stable DNS names (a headless Service, the JobSet's "
                "enableDNSHostnames): backups could not dial their primary"]
    port = env.get("PS_PORT")
    problems: dict[str, str] = {}  # one message per variable: the first pod that gets it wrong
    for index, host in enumerate(unit.hostnames):
        penv = pod_env(unit, container, objects, index)
        if shard is not None and penv.get("PS_SHARD_INDEX") != shard:
            problems.setdefault("PS_SHARD_INDEX", f"{where}: PS_SHARD_INDEX is {penv.get('PS_SHARD_INDEX')!r} in "
                                f"pod {host}, not its shard {shard}")
        if penv.get("PS_REPLICA_INDEX") != str(index):
            problems.setdefault("PS_REPLICA_INDEX", f"{where}: PS_REPLICA_INDEX={env.get('PS_REPLICA_INDEX')!r} "
                                f"is {penv.get('PS_REPLICA_INDEX')!r} in pod {host}, not its replica index {index} "
                                f"(its ordinal or completion index)")
        advertised = str(penv.get("PS_ADVERTISE_ADDRESS") or "")
        advertised_host, _, advertised_port = advertised.rpartition(":")
        if advertised_port != str(port) or not host_matches(advertised_host, host, unit.namespace):
            problems.setdefault("PS_ADVERTISE_ADDRESS", f"{where}: PS_ADVERTISE_ADDRESS="
                                f"{env.get('PS_ADVERTISE_ADDRESS')!r} is {advertised!r} in pod {host}: it should be "
                                f"that pod's stable name on PS_PORT, {host}:{port} (or its namespaced form)")
    return list(problems.values())


def advertised_addresses(unit: PodUnit, container: dict, objects: list[dict]) -> list[str | None]:
    """PS_ADVERTISE_ADDRESS as each pod of the unit resolves it, in replica order."""
    return [pod_env(unit, container, objects, i).get("PS_ADVERTISE_ADDRESS") for i in range(len(unit.downward))]


def checkpoint_problems(unit: PodUnit, container: dict, env: dict, objects: list[dict]) -> list[str]:
    """No two replicas of a shard write one checkpoint directory (each writes <root>/shard-<i>-of-<n>):
    a claim template gives each pod its own volume; a shared claim needs a subPath(Expr) that
    differs between them."""
    where = f"{unit.where} container {container.get('name')}"
    path = env.get("PS_CHECKPOINT_DIR")
    mount = mount_for(container, str(path)) if isinstance(path, str) else None
    if mount is None:
        return []  # reported by the checkpoint check of every server
    if mount.get("name") in claim_templates(unit):
        return []
    volume = volume_named(unit, mount.get("name")) or {}
    source = (volume.get("persistentVolumeClaim") or {}).get("claimName") or mount.get("name")
    seen: dict[tuple[str, str], int] = {}
    for index in range(len(unit.downward)):
        sub = mount.get("subPath", "")
        if "subPathExpr" in mount:
            sub = expand(str(mount["subPathExpr"]), pod_env(unit, container, objects, index))
        key = (source, sub)
        if key in seen:
            return [(f"{where}: replicas {seen[key]} and {index} of the shard write the same checkpoint "
                     f"directory (volume {source!r}, subPath {sub!r}): each replica needs its own "
                     "(subPathExpr with $(PS_REPLICA_INDEX), or a claim template)")]
        seen[key] = index
    return []


def replication_port(env: dict) -> int:
    """PS_REPLICATION_PORT (0 when unset or not a number: ps-server then picks a free port)."""
    value = env.get("PS_REPLICATION_PORT")
    return int(value) if isinstance(value, str) and value.isdigit() else 0


def lane_port(env: dict) -> int:
    """PS_LANE_PORT (0 when unset, -1 or not a fixed number: no TCP lane a NetworkPolicy could name)."""
    value = env.get("PS_LANE_PORT")
    return int(value) if isinstance(value, str) and value.isdigit() else 0


def replication_port_problems(where: str, container: dict, env: dict) -> list[str]:
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
        problems.append(f"replicated shards: replica sets for shards {shards}, but PS_NUM_SHARDS={count}")
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
        problems += etcd_problems(objects, unit, env, pdbs, policy_allows)
    return problems


def _budget_keeps(spec: dict, pods: int) -> int:
    """Pods a PodDisruptionBudget keeps out of ``pods`` (integers only; percentages are refused)."""
    if str(spec.get("minAvailable", "")).isdigit():
        return int(spec["minAvailable"])
    if str(spec.get("maxUnavailable", "")).isdigit():
        return pods - int(spec["maxUnavailable"])
    return 0


def etcd_problems(objects: list[dict], unit: PodUnit, env: dict, pdbs: list[dict],
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
    """PS_ADDRESSES 'r0|r1,r0|r1' (as the worker pod resolves it): shard i's group names the pods of
    shard i's replica set in replica order, spelled as they advertise themselves (the client follows
    a backup's NOT_PRIMARY only to a listed name), on the port the replicas listen on, and
    NetworkPolicies let the worker reach them."""
    by_shard: dict[str, tuple[PodUnit, dict, dict]] = {}
    for unit in server_units:
        if unit.namespace != worker.namespace:
            continue
        container = next(c for c in unit.containers() if is_ps_server(c))
        env = resolve_env(container, objects, unit.namespace)
        if replicas_of(env) > 1 and shard_of(unit, env) is not None:
            by_shard[str(shard_of(unit, env))] = (unit, container, env)
    groups = [g.strip() for g in raw.split(",") if g.strip()]
    problems = []
    if sorted(by_shard) != [str(i) for i in range(len(groups))]:
        return [(f"{where}: PS_ADDRESSES has {len(groups)} shards but the replicated servers serve "
                 f"shards {sorted(by_shard)}")]
    for i, group in enumerate(groups):
        unit, container, env = by_shard[str(i)]
        entries = [e.strip() for e in group.split("|")]
        hosts = [e.rpartition(":")[0] for e in entries]
        ports = {e.rpartition(":")[2] for e in entries}
        if len(hosts) != len(unit.hostnames) or not all(
                host_matches(h, expected, unit.namespace) for h, expected in zip(hosts, unit.hostnames)):
            problems.append(f"{where}: PS_ADDRESSES shard {i} is {hosts}, expected the replicas of "
                            f"{unit.where} in order, {unit.hostnames}")
        else:
            advertised = advertised_addresses(unit, container, objects)
            if entries != advertised:
                problems.append(f"{where}: PS_ADDRESSES shard {i} lists {entries}, but the replicas advertise "
                                f"themselves as {advertised}: a backup's NOT_PRIMARY names its primary so, and "
                                "the client follows only a name in its list")
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
