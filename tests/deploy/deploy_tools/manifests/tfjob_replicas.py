"""Checks of replicated shards as a Kubeflow TFJob (deploy/tfjob-replicated).

The training operator gives each PS pod one index i and injects a TF_CONFIG whose cluster.ps is a
flat list of the per-replica Services; ps-server and the workers read it as shards of PS_REPLICAS
consecutive replicas. These checks build the TF_CONFIG the operator would inject into each pod and
let ps-server's own configuration code (``parse_config``) and the workers' (``ps_addresses_from_env``)
read it with the pod's environment, so what is checked is what the programs will do: each PS pod's
(shard, replica), its advertised name (its own cluster.ps entry), a checkpoint directory no other
replica of its shard writes, the workers' grouped address list, the spread of a shard's replicas,
one budget per shard, and the network paths between replicas, to etcd and from the workers."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from .k8s_objects import label_selector_matches, namespace_of
from .pod_templates import PodUnit, expand, is_ps_server, mount_for, pod_env, volume_named
from .replica_wiring import etcd_problems, lane_port, replicas_of, replication_port, replication_port_problems

#: The operator's conventions: the container it reads the port from, and that port's name.
CONTAINER = "tensorflow"
PORT_NAME = "tfjob-port"
#: The operator's port when the container names none.
DEFAULT_PORT = 2222
#: The label the operator puts on each pod: its index in its replica type.
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
#: What TF_CONFIG gives a replicated PS pod; set in the pod, they override it (or contradict it).
TF_CONFIG_SETTINGS = ("PS_SHARD_INDEX", "PS_REPLICA_INDEX", "PS_PORT")
#: The variables by which ps-server reads its place in the cluster (the others play no part in it).
_PLACEMENT = ("PS_REPLICAS", "PS_SHARD_INDEX", "PS_REPLICA_INDEX", "PS_NUM_SHARDS", "PS_PORT")

PolicyCheck = Callable[[list[dict], PodUnit, PodUnit, int, str], list[str]]


@dataclass(frozen=True)
class Replica:
    """One PS pod as ps-server reads its TF_CONFIG: its operator index, shard and place in it."""

    index: int
    host: str
    shard: int
    replica: int
    entry: str  # its cluster.ps entry: the operator's Service, <job>-ps-<i>.<ns>.svc:<port>
    advertised: str


def tfjob_port(template_spec: dict) -> int:
    """The port the operator writes into TF_CONFIG for a replica type."""
    for container in template_spec.get("containers") or []:
        if container.get("name") == CONTAINER:
            for port in container.get("ports") or []:
                if port.get("name") == PORT_NAME:
                    return int(port["containerPort"])
    return DEFAULT_PORT


def operator_tf_config(tfjob: dict, replica_type: str, index: int) -> str:
    """TF_CONFIG as the training operator injects it into pod ``index`` of ``replica_type``:
    every replica type's pods by their Services, ``<job>-<type>-<i>.<ns>.svc:<port>``, in index order."""
    name, namespace = tfjob["metadata"]["name"], namespace_of(tfjob) or "default"
    cluster = {}
    for rtype, rspec in ((tfjob.get("spec") or {}).get("tfReplicaSpecs") or {}).items():
        port = tfjob_port(((rspec or {}).get("template") or {}).get("spec") or {})
        cluster[rtype.lower()] = [f"{name}-{rtype.lower()}-{i}.{namespace}.svc:{port}"
                                  for i in range((rspec or {}).get("replicas", 1))]
    return json.dumps({"cluster": cluster, "task": {"type": replica_type.lower(), "index": index},
                       "environment": "cloud"})


def derived_replicas(unit: PodUnit, container: dict, objects: list[dict]) -> tuple[list[Replica], list[str]]:
    """Each PS pod of the unit as ps-server places it from its TF_CONFIG and environment, or why
    ps-server would refuse to start there."""
    from ps_server.ops.config import ConfigError, parse_config

    where = f"{unit.where} container {container.get('name')}"
    replicas = []
    for index, host in enumerate(unit.hostnames):
        env = pod_env(unit, container, objects, index)
        environ = {k: v for k, v in env.items() if k in _PLACEMENT and isinstance(v, str)}
        tf_config = operator_tf_config(unit.owner, unit.role, index)
        # etcd is checked on its own; ps-server only needs some endpoint to accept R > 1.
        environ |= {"TF_CONFIG": tf_config, "PS_ETCD_ENDPOINTS": "etcd:2379"}
        try:
            config = parse_config([], environ)
        except ConfigError as exc:
            return [], [f"{where}: ps-server in pod {host} refuses the operator's TF_CONFIG: {exc}"]
        entry = json.loads(tf_config)["cluster"][unit.role.lower()][index]
        replicas.append(Replica(index, host, config.shard_index, config.replica_index, entry,
                                str(env.get("PS_ADVERTISE_ADDRESS") or "")))
    return replicas, []


def tfjob_replica_server_problems(unit: PodUnit, container: dict, env: dict, objects: list[dict]) -> list[str]:
    """The PS replicas of a TFJob: the operator's conventions, nothing set that TF_CONFIG gives, each
    pod advertising its own cluster.ps entry, a checkpoint directory per replica, the replication port."""
    where = f"{unit.where} container {container.get('name')}"
    problems = []
    names = {p.get("name") for p in container.get("ports") or []}
    if container.get("name") != CONTAINER or PORT_NAME not in names:
        problems.append(f"{where}: the training operator takes the port from a port named {PORT_NAME} "
                        f"in the container named {CONTAINER}")
    for var in TF_CONFIG_SETTINGS:
        if var in env:
            problems.append(f"{where}: sets {var}, which the TF_CONFIG the operator injects gives (task.index "
                            f"read as shards of PS_REPLICAS={env.get('PS_REPLICAS')} consecutive replicas)")
    replicas, refused = derived_replicas(unit, container, objects)
    problems += refused
    for replica in replicas:
        if replica.advertised != replica.entry:
            problems.append(f"{where}: PS_ADVERTISE_ADDRESS={env.get('PS_ADVERTISE_ADDRESS')!r} is "
                            f"{replica.advertised!r} in pod {replica.host}: it should be its TF_CONFIG entry, "
                            f"the operator's Service {replica.entry!r}, the name the workers have for it")
            break
    problems += _checkpoint_problems(unit, container, objects, replicas)
    return problems + replication_port_problems(where, container, env)


def _checkpoint_problems(unit: PodUnit, container: dict, objects: list[dict], replicas: list[Replica]) -> list[str]:
    """No two replicas of a shard write one checkpoint directory: the shared claim's subPath(Expr)
    differs between them."""
    where = f"{unit.where} container {container.get('name')}"
    env = pod_env(unit, container, objects, 0)
    path = env.get("PS_CHECKPOINT_DIR")
    mount = mount_for(container, str(path)) if isinstance(path, str) else None
    if mount is None:
        return []  # reported by the checkpoint check of every server
    volume = volume_named(unit, mount.get("name")) or {}
    source = (volume.get("persistentVolumeClaim") or {}).get("claimName") or mount.get("name")
    seen: dict[tuple[int, str, str], Replica] = {}
    for replica in replicas:
        sub = mount.get("subPath", "")
        if "subPathExpr" in mount:
            sub = expand(str(mount["subPathExpr"]), pod_env(unit, container, objects, replica.index))
        key = (replica.shard, source, sub)
        if key in seen:
            return [f"{where}: pods {seen[key].host} and {replica.host}, replicas {seen[key].replica} and "
                    f"{replica.replica} of shard {replica.shard}, write the same checkpoint directory (volume "
                    f"{source!r}, subPath {sub!r}): each replica needs its own (subPathExpr with $(POD_NAME))"]
        seen[key] = replica
    return []


def tfjob_replica_set_problems(objects: list[dict], unit: PodUnit, env: dict,
                               policy_allows: PolicyCheck) -> list[str]:
    """Across the shards of one TFJob: the replicas spread over nodes, one budget per shard that keeps
    one of its replicas, the replicas reach each other (replication, primary check) and etcd."""
    container = next(c for c in unit.containers() if is_ps_server(c))
    replicas, _ = derived_replicas(unit, container, objects)
    where = unit.where
    problems = []
    labels = unit.pod_labels()
    spread = [c for c in unit.spec.get("topologySpreadConstraints") or []
              if c.get("topologyKey") == "kubernetes.io/hostname" and c.get("whenUnsatisfiable") == "DoNotSchedule"
              and c.get("maxSkew") == 1
              and all(label_selector_matches(c.get("labelSelector"), pod) for pod in labels)]
    if not spread:
        problems.append(f"{where}: no topologySpreadConstraint over kubernetes.io/hostname (DoNotSchedule, "
                        "maxSkew 1) counts every PS pod of the job: a node could hold every replica of a shard")
    pdbs = [o for o in objects if o.get("kind") == "PodDisruptionBudget" and namespace_of(o) == unit.namespace]
    for shard in sorted({r.shard for r in replicas}):
        members = {r.index for r in replicas if r.shard == shard}
        covering = [p for p in pdbs if any(label_selector_matches((p.get("spec") or {}).get("selector"), labels[i])
                                           for i in members)]
        keeps = [p for p in covering
                 if {i for i, pod in enumerate(labels)
                     if label_selector_matches((p.get("spec") or {}).get("selector"), pod)} == members
                 and str((p.get("spec") or {}).get("minAvailable", "")) == "1"]
        if len(covering) != 1 or not keeps:
            problems.append(f"{where} shard {shard} (pods {sorted(unit.hostnames[i] for i in members)}): needs "
                            "exactly one PodDisruptionBudget that keeps a replica of the shard and selects its "
                            f"replicas alone (minAvailable: 1), found {[p['metadata']['name'] for p in covering]}")
    port = tfjob_port(unit.spec)
    problems += policy_allows(objects, unit, unit, replication_port(env), f"{where} (replication)")
    problems += policy_allows(objects, unit, unit, port, f"{where} (primary check)")
    return problems + etcd_problems(objects, unit, env, pdbs, policy_allows)


def tfjob_worker_problems(where: str, unit: PodUnit, container: dict, objects: list[dict],
                          servers: PodUnit, policy_allows: PolicyCheck) -> list[str]:
    """The workers of a TFJob with replicated PS: read with the workers' own code from the TF_CONFIG
    the operator injects and their PS_REPLICAS, cluster.ps gives every shard's replicas in order,
    spelled as the replicas advertise themselves; and NetworkPolicies let the workers reach them."""
    from wehub_ps.cluster import ClusterConfigError, ps_addresses_from_env

    server_container = next(c for c in servers.containers() if is_ps_server(c))
    replicas, refused = derived_replicas(servers, server_container, objects)
    if refused:
        return []  # reported with the servers
    env = pod_env(unit, container, objects, 0)
    environ = {"TF_CONFIG": operator_tf_config(unit.owner, unit.role, 0)}
    if isinstance(env.get("PS_REPLICAS"), str):
        environ["PS_REPLICAS"] = env["PS_REPLICAS"]
    problems = []
    try:
        addresses = list(ps_addresses_from_env(environ))
    except ClusterConfigError as exc:
        return [f"{where}: the workers cannot read the operator's TF_CONFIG: {exc}"]
    shards: dict[int, list[Replica]] = {}
    for replica in sorted(replicas, key=lambda r: (r.shard, r.replica)):
        shards.setdefault(replica.shard, []).append(replica)
    expected = ["|".join(r.advertised for r in shards[s]) for s in sorted(shards)]
    if addresses != expected:
        problems.append(f"{where}: with PS_REPLICAS={env.get('PS_REPLICAS')!r} the workers read TF_CONFIG's "
                        f"cluster.ps as the shards {addresses}, but the replicas serve the shards {expected} "
                        "(each shard's replicas in order, as they advertise themselves: the client follows a "
                        "backup's NOT_PRIMARY only to a listed name); the servers run with "
                        f"PS_REPLICAS={replicas_of_servers(servers, objects)}")
    server_env = pod_env(servers, server_container, objects, 0)
    problems += policy_allows(objects, unit, servers, tfjob_port(servers.spec), where)
    if lane_port(server_env):
        problems += policy_allows(objects, unit, servers, lane_port(server_env), f"{where} (TCP lane)")
    return problems


def replicas_of_servers(servers: PodUnit, objects: list[dict]) -> int:
    container = next(c for c in servers.containers() if is_ps_server(c))
    return replicas_of(pod_env(servers, container, objects, 0))
