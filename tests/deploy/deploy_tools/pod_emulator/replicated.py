"""The replicated overlay's pods on separate network hosts: etcd's members, every shard's
replicas and a worker, each in its own network namespace with the hosts file cluster DNS
would give it; and which replica of a shard is its primary, asked as an operator would.

Nothing of the render is rewritten but mounted paths: the members find each other and
the replicas find etcd and their primary by the rendered names (``etcd-0.etcd``,
``ps-0-1.ps``), over the rendered ports, with the rendered TLS material.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .cluster_dns import dns_records, hosts_file
from .errors import HarnessError
from .netns import PodNetwork
from .pod_plan import Pod, plan_pod
from .probes import grpc_health
from .workloads import workload_running, workloads_running

#: The health service a replica reports SERVING only while it is its shard's primary.
PRIMARY_SERVICE = "wehub_ps.v1.ParameterServer"

#: The pod label that carries a replica's shard index (deploy/overlays/replicated/shard-<i>/).
SHARD_LABEL = "wehub-ps/shard"


@dataclass
class ReplicatedPods:
    """The render's pods, planned in namespaces of ``net``; ``wraps[pod name]`` runs a command in its pod."""

    etcd: list[Pod]
    #: shard index -> its replicas, position = replica index (the StatefulSet's ordinal)
    shards: dict[int, list[Pod]]
    worker: Pod
    #: pod name -> the key of its namespace in the PodNetwork (for ``cut`` and ``reconnect``)
    keys: dict[str, str] = field(default_factory=dict)
    wraps: dict[str, list[str]] = field(default_factory=dict)

    @property
    def replicas(self) -> list[Pod]:
        return [pod for shard in sorted(self.shards) for pod in self.shards[shard]]


def plan_replicated(objects: list[dict], work: Path, net: PodNetwork,
                    worker_index: int = 0) -> ReplicatedPods:
    """Every etcd member and every shard replica of the render, and worker ``worker_index``,
    each in a namespace of its own (keyed by pod name) with its hosts file written."""
    etcd_sts = workload_running(objects, "StatefulSet", "etcd")
    job = workload_running(objects, "Job", "ps-worker")
    shard_sets = workloads_running(objects, "StatefulSet", "ps-server")
    if not shard_sets:
        raise HarnessError("the render has no StatefulSet running ps-server")
    keys: dict[str, str] = {}  # pod name -> its namespace's key: <workload>-<index>
    pods: list[Pod] = []

    def plan(workload: dict, program: str, index: int) -> Pod:
        key = f"{workload['metadata']['name']}-{index}"  # a StatefulSet's pod name; a Job's, less its suffix
        _, ip = net.add(key)
        pod = plan_pod(objects, workload, program, index, work, ip=ip)
        keys[pod.name] = key
        pods.append(pod)
        return pod

    etcd = [plan(etcd_sts, "etcd", i) for i in range(etcd_sts["spec"].get("replicas", 1))]
    shards: dict[int, list[Pod]] = {}
    for sts in shard_sets:
        label = sts["spec"]["template"]["metadata"].get("labels", {}).get(SHARD_LABEL)
        if label is None or not label.isdigit():
            raise HarnessError(f"StatefulSet {sts['metadata']['name']}: pod label {SHARD_LABEL} is "
                               f"{label!r}, not a shard index")
        if int(label) in shards:
            raise HarnessError(f"two StatefulSets run the replicas of shard {label}")
        shards[int(label)] = [plan(sts, "ps-server", i) for i in range(sts["spec"].get("replicas", 1))]
    worker = plan(job, "ps-worker", worker_index)
    records = dns_records(objects, pods)
    wraps = {}
    for pod in pods:
        net.write_etc(keys[pod.name], hosts_file(pod, records), pod.meta.namespace)
        wraps[pod.name] = net.exec_prefix(keys[pod.name], pod.meta.hostname)
    return ReplicatedPods(etcd, shards, worker, keys, wraps)


def replace_pod(cluster: ReplicatedPods, objects: list[dict], work: Path, net: PodNetwork, name: str) -> Pod:
    """Pod ``name`` again, as its StatefulSet controller recreates it once the pod of a lost node was
    force-deleted: on another host (a namespace and address of its own), with empty claims (the volume
    was deleted with the node, or by the operator), planned from ``objects`` as they are now (a
    ConfigMap an operator edited meanwhile is read again). Every pod's hosts file then answers the
    name with the new address, as cluster DNS does; the old host stays as it was (cut off, for good)."""
    old = next((pod for pod in [*cluster.etcd, *cluster.replicas] if pod.name == name), None)
    if old is None or old.workload["kind"] != "StatefulSet":
        raise HarnessError(f"{name} is not a StatefulSet pod of this cluster")
    kind, workload_name = old.workload["kind"], old.workload["metadata"]["name"]
    workload = next(o for o in objects if o.get("kind") == kind and o["metadata"]["name"] == workload_name)
    index = int(name.rpartition("-")[2])
    generation = sum(1 for key in net.namespaces if key.startswith(f"{cluster.keys[name]}-r")) + 1
    key = f"{cluster.keys[name]}-r{generation}"
    home = work / f"{key}-node"  # claims and emptyDirs of their own: an empty volume
    home.mkdir()
    _, ip = net.add(key)
    pod = plan_pod(objects, workload, Path(str(old.container["command"][0])).name, index, home, ip=ip)
    if old in cluster.etcd:
        cluster.etcd[cluster.etcd.index(old)] = pod
    else:
        replicas = next(pods for pods in cluster.shards.values() if old in pods)
        replicas[replicas.index(old)] = pod
    cluster.keys[name] = key
    records = dns_records(objects, [*cluster.etcd, *cluster.replicas, cluster.worker])
    net.write_etc(key, hosts_file(pod, records), pod.meta.namespace)
    cluster.wraps[name] = net.exec_prefix(key, pod.meta.hostname)
    for other in [*cluster.etcd, *cluster.replicas, cluster.worker]:
        if other is not pod:
            net.rewrite_hosts(cluster.keys[other.name], hosts_file(other, records))
    return pod


def health_address(pod: Pod) -> str:
    """Where the pod's readinessProbe (gRPC) is sent: its IP and the probe's port."""
    probe = pod.container.get("readinessProbe") or {}
    if "grpc" not in probe:
        raise HarnessError(f"{pod.name}: the primary is asked on the gRPC readiness probe's port, "
                           "which it lacks")
    port = pod.container_port(probe["grpc"]["port"])
    return f"{pod.meta.ip}:{pod.ports.get(port, port)}"


def primaries(replicas: list[Pod], timeout: float = 1.0) -> list[Pod]:
    """The replicas that report :data:`PRIMARY_SERVICE` SERVING (the node asking each pod)."""
    return [pod for pod in replicas
            if grpc_health(health_address(pod), PRIMARY_SERVICE, timeout) == "SERVING"]
