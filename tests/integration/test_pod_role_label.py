"""Replicas keep the label wehub-ps/role on their pods: real ps-server processes on a real etcd.

The Kubernetes API server cannot run here: tests/fake_kube_api.py stands in
for it (HTTPS on loopback, the pod PATCH with merge patches of labels, 403
where RBAC would refuse). Each replica gets the in-cluster environment a pod
has (KUBERNETES_SERVICE_HOST/PORT, POD_NAME, POD_NAMESPACE) and a service
account directory laid out as the kubelet mounts it.
"""

from __future__ import annotations

import json
import signal
import time

import pytest
from fake_kube_api import FakeKubeApi, service_account
from replica_testing import ReplicatedCluster, wait_for


@pytest.fixture
def api(tls):
    server = FakeKubeApi(tls.server.cert, tls.server.key).start()
    yield server
    server.stop()


@pytest.fixture
def pod_cluster(tmp_path, etcd_server, tls, api):
    """One shard, 2 replicas, pods ps-0-0 and ps-0-1 in namespace wehub-ps (not started yet)."""
    account = service_account(tmp_path / "serviceaccount", tls.ca.cert)
    cluster = ReplicatedCluster(tmp_path / "replicated", etcd_server.endpoint, 1, 2,
                                ("--service-account-dir", str(account)))
    for replica in cluster.all():
        replica.process.env = {
            "KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api.port),
            "POD_NAME": f"ps-0-{replica.replica_index}", "POD_NAMESPACE": "wehub-ps"}
    yield cluster
    cluster.stop()


def _pod(replica) -> str:
    return f"ps-0-{replica.replica_index}"


def test_the_labels_follow_the_primary_through_a_failover_and_a_handover(pod_cluster, api):
    cluster = pod_cluster.start()
    primary = cluster.primary(0)
    backup = next(r for r in cluster.shards[0] if r is not primary)
    wait_for(lambda: api.label(_pod(primary)) == "primary" and api.label(_pod(backup)) == "backup", 10,
             "the primary's pod labelled primary, the backup's backup", cluster)
    # Each replica said joining before it knew its role, and patched nothing but its own pod.
    for replica in (primary, backup):
        values = [p.body["metadata"]["labels"]["wehub-ps/role"] for p in api.patches(_pod(replica))]
        assert values[0] == "joining" and values[-1] in ("primary", "backup"), values
    own_pods = {f"/api/v1/namespaces/wehub-ps/pods/{_pod(r)}" for r in cluster.all()}
    assert {p.path for p in api.patches()} == own_pods

    primary.process.signal(signal.SIGKILL)
    primary.process.wait()
    killed_at = time.monotonic()
    wait_for(lambda: api.label(_pod(backup)) == "primary", 20, "the new primary's pod labelled primary",
             cluster)
    assert backup.is_primary()
    # The killed process patches nothing more: its pod keeps its last label until the next process there.
    assert all(p.at < killed_at for p in api.patches(_pod(primary)))
    assert api.label(_pod(primary)) == "primary"

    restarted_at = time.monotonic()
    primary.start()
    wait_for(lambda: api.label(_pod(primary)) == "backup", 60, "the restarted replica's pod labelled backup",
             cluster)
    again = [p.body["metadata"]["labels"]["wehub-ps/role"] for p in api.patches(_pod(primary))
             if p.at > restarted_at]
    assert again[0] == "joining" and again[-1] == "backup", again
    assert api.label(_pod(backup)) == "primary"

    # SIGTERM of the primary: it hands its role over to the backup in sync, then takes its label off.
    cluster.wait_all_ready()
    backup.process.stop()
    assert backup.process.popen.returncode == 0
    assert api.label(_pod(backup)) is None
    wait_for(lambda: api.label(_pod(primary)) == "primary", 20,
             "the replica handed the role labelled primary", cluster)


def test_without_the_permission_the_label_is_off_and_said_once(pod_cluster, api):
    api.forbidden.update({("wehub-ps", "ps-0-0"), ("wehub-ps", "ps-0-1")})
    cluster = pod_cluster.start()
    primary = cluster.primary(0)
    # Roles change after the refusal; nothing more is tried, and the shard serves as without the label.
    primary.process.signal(signal.SIGKILL)
    primary.process.wait()
    cluster.primary(0)
    for replica in cluster.all():
        warnings = [json.loads(line) for line in replica.process.log_text().splitlines()
                    if '"pod role label off' in line]
        assert len(warnings) == 1, replica.process.log_text()[-3000:]
        assert warnings[0]["level"] == "warning" and "Role" in warnings[0]["needs"], warnings
        assert len(api.patches(_pod(replica))) == 1
        assert api.patches(_pod(replica))[0].status == 403
