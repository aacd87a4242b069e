"""The pod's role label: which value each replica state gives, and the label thread against an API server.

The API server is tests/fake_kube_api.py, a stand-in for the Kubernetes API
server (which cannot run here): real HTTPS on loopback with a test CA, the
pod PATCH with JSON merge patches of labels, and answers the test chooses
(403 as RBAC refuses, 503, or held unanswered).
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
from fake_kube_api import FakeKubeApi, service_account

from ps_server.ops.pod_label import ROLE_LABEL, PodRoleLabel, PodTarget, label_value, pod_target
from ps_server.replication import role


@pytest.fixture
def api(tls):
    server = FakeKubeApi(tls.server.cert, tls.server.key).start()
    yield server
    server.stop()


@pytest.fixture
def account(tmp_path, tls):
    return service_account(tmp_path / "serviceaccount", tls.ca.cert)


def _target(api: FakeKubeApi, account, pod: str = "ps-0-1") -> PodTarget:
    environ = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api.port),
               "POD_NAME": pod, "POD_NAMESPACE": "wehub-ps"}
    target, why = pod_target(environ, str(account))
    assert target is not None, why
    return target


@pytest.fixture
def labels():
    made: list[PodRoleLabel] = []

    def make(target: PodTarget, **kwargs) -> PodRoleLabel:
        label = PodRoleLabel(target, **kwargs)
        label.start()
        made.append(label)
        return label

    yield make
    for label in made:
        label.stop(wait=0)


def test_each_role_state_has_its_label():
    assert {state: label_value(state) for state in (
        role.STARTING, role.CATCHING_UP, role.BACKUP, role.CANDIDATE, role.PRIMARY, role.DEPOSED,
        role.STOPPING)} == {
        "starting": "joining", "catching-up": "joining", "backup": "backup", "candidate": "joining",
        "primary": "primary", "deposed": "joining", "stopping": None}


def test_the_pod_comes_from_the_in_cluster_environment(tmp_path, tls):
    account = service_account(tmp_path / "sa", tls.ca.cert, namespace="from-file")
    base = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    target, _ = pod_target({**base, "HOSTNAME": "ps-1-0"}, str(account))
    assert (target.host, target.port, target.namespace, target.pod) == (
        "10.96.0.1", 443, "from-file", "ps-1-0")
    assert target.path == "/api/v1/namespaces/from-file/pods/ps-1-0"
    named = {**base, "HOSTNAME": "h", "POD_NAME": "ps-0-0", "POD_NAMESPACE": "ns"}
    target, _ = pod_target(named, str(account))
    assert (target.namespace, target.pod) == ("ns", "ps-0-0")
    # Outside a pod, or a pod that mounts no token: off, with the reason.
    target, why = pod_target({"HOSTNAME": "laptop"}, str(account))
    assert target is None and "KUBERNETES_SERVICE_HOST" in why
    target, why = pod_target({**base, "POD_NAME": "ps-0-0"}, str(tmp_path / "absent"))
    assert target is None and "token" in why


def test_the_label_follows_the_newest_value(api, account, labels):
    label = labels(_target(api, account))
    label.set("joining")
    api.wait_for(lambda: api.label("ps-0-1") == "joining")
    label.set("backup")
    api.wait_for(lambda: api.label("ps-0-1") == "backup")
    label.set("backup")  # the same value again sends nothing
    label.set("primary")
    api.wait_for(lambda: api.label("ps-0-1") == "primary")
    sent = api.patches("ps-0-1")
    assert [p.body for p in sent] == [{"metadata": {"labels": {ROLE_LABEL: v}}}
                                      for v in ("joining", "backup", "primary")]
    assert all(p.method == "PATCH" and p.content_type == "application/merge-patch+json"
               and p.authorization == "Bearer sa-token" and p.status == 200 for p in sent)
    label.stop(None)  # stopping: the label comes off before stop returns
    assert api.label("ps-0-1") is None
    assert api.patches()[-1].body == {"metadata": {"labels": {ROLE_LABEL: None}}}


def test_values_given_while_a_patch_is_out_coalesce_and_never_block(api, account, labels):
    label = labels(_target(api, account))
    api.hold()
    label.set("joining")
    api.wait_for(lambda: api.waiting == 1)  # the thread's request is out, unanswered
    setter = threading.Thread(target=lambda: [label.set(v) for v in ["backup", "joining", "candidate"] * 1000
                                              + ["primary"]])
    setter.start()
    setter.join(timeout=5)
    assert not setter.is_alive(), "set() waited for the API server"
    api.release()
    api.wait_for(lambda: api.label("ps-0-1") == "primary")
    time.sleep(0.2)
    assert [p.body["metadata"]["labels"][ROLE_LABEL] for p in api.patches()] == ["joining", "primary"]


def test_failures_are_retried_with_growing_waits(api, account, labels):
    api.failures = [503, 503, 500, 429, 503]
    label = labels(_target(api, account), first_retry=0.1, max_retry=0.2)
    label.set("primary")
    api.wait_for(lambda: api.label("ps-0-1") == "primary")
    times = [p.at for p in api.patches()]
    assert [p.status for p in api.patches()] == [503, 503, 500, 429, 503, 200]
    gaps = [b - a for a, b in zip(times, times[1:])]
    # 0.1, then 0.2 s (the cap) each time, each within +-20 %; without the cap the last three would
    # take 0.4 + 0.8 + 1.6 s.
    assert gaps[0] >= 0.08 and all(gap >= 0.16 for gap in gaps[1:]), gaps
    assert sum(gaps[2:]) < 1.5, gaps


def test_an_unreachable_api_server_is_retried(tmp_path, tls, labels, api):
    """Nothing listens at first (connection refused); the label lands once the API server is there."""
    account = service_account(tmp_path / "sa", tls.ca.cert)
    target = _target(api, account)
    api.stop()
    label = labels(target, first_retry=0.05, max_retry=0.1)
    label.set("backup")
    time.sleep(0.3)
    assert not label.off
    again = FakeKubeApi(tls.server.cert, tls.server.key, port=target.port)  # where the target points
    again.start()
    try:
        again.wait_for(lambda: again.label("ps-0-1") == "backup")
    finally:
        again.stop()


def test_no_permission_turns_the_label_off_and_says_so_once(api, account, labels, caplog):
    api.forbidden.add(("wehub-ps", "ps-0-1"))
    label = labels(_target(api, account))
    with caplog.at_level(logging.DEBUG, logger="ps_server.pod_label"):
        label.set("joining")
        api.wait_for(lambda: len(api.patches()) == 1)
        deadline = time.monotonic() + 5
        while not label.off:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for value in ("backup", "primary", "joining"):
            label.set(value)
        time.sleep(0.3)
    assert [p.status for p in api.patches()] == [403]  # nothing more is tried
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    fields = warnings[0].fields
    assert "forbidden" in fields["answer"] and "Role" in fields["needs"] and "patch" in fields["needs"]
    assert fields["pod"] == "ps-0-1" and fields["namespace"] == "wehub-ps"


def test_a_token_the_api_server_refuses_turns_the_label_off(api, account, labels):
    (account / "token").write_text("someone-else\n")
    label = labels(_target(api, account))
    label.set("primary")
    api.wait_for(lambda: len(api.patches()) == 1)
    assert api.patches()[0].status == 401
    deadline = time.monotonic() + 5
    while not label.off:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_the_token_is_read_again_for_each_patch(api, account, labels):
    """Projected service account tokens are rotated in place by the kubelet."""
    label = labels(_target(api, account))
    label.set("joining")
    api.wait_for(lambda: api.label("ps-0-1") == "joining")
    api.token = "rotated"
    (account / "token").write_text("rotated\n")
    label.set("backup")
    api.wait_for(lambda: api.label("ps-0-1") == "backup")
    assert api.patches()[-1].authorization == "Bearer rotated"


def test_stop_waits_a_bounded_time_for_an_api_server_that_does_not_answer(api, account, labels):
    label = labels(_target(api, account), timeout=30.0)
    api.hold()
    label.set("primary")
    started = time.monotonic()
    label.stop(None, wait=0.3)
    assert time.monotonic() - started < 1.0
    api.release()


def test_a_replica_labels_its_pod_only_in_kubernetes_and_unless_turned_off(api, account, monkeypatch, caplog):
    from ps_server.ops.config import parse_config
    from ps_server.replication.wiring import _pod_label

    replicated = ["--replicas", "2", "--etcd-endpoints", "e:1", "--service-account-dir", str(account)]
    for name in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "POD_NAME", "POD_NAMESPACE"):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.DEBUG, logger="ps_server"):
        assert _pod_label(parse_config(replicated, {})) is None  # not in a pod: quietly off
    assert [r.levelno for r in caplog.records if "pod role label" in r.getMessage()] == [logging.DEBUG]
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(api.port))
    monkeypatch.setenv("POD_NAME", "ps-1-0")
    label = _pod_label(parse_config(replicated, {}))
    assert label is not None and label.target.path == "/api/v1/namespaces/wehub-ps/pods/ps-1-0"
    assert _pod_label(parse_config([*replicated, "--role-label", "off"], {})) is None
