"""Run checkov over the renders and the Dockerfiles, and judge its findings: every
failure is a problem unless skipped with a reason, and every skip must still be needed."""

from __future__ import annotations

import copy
import json
import re
import subprocess
from pathlib import Path

from .k8s_objects import ref
from .kustomize import dump_all
from .schema_validation import CRD_ALLOWLIST, embedded_core_objects

#: Each input is scanned twice in the same run: as it is, and with every skip
#: removed (file names with this marker), to tell a needed skip from a stale one.
NOSKIP = ".noskip"
SKIP_PREFIXES = ("checkov.io/skip", "bridgecrew.io/skip")
_DOCKER_SKIP = re.compile(r"#\s*checkov:skip=([A-Z0-9_]+)(?::(.*))?")


def _strip_skips(obj: dict) -> dict:
    obj = copy.deepcopy(obj)
    annotations = (obj.get("metadata") or {}).get("annotations")
    if annotations:
        for key in [k for k in annotations if k.startswith(SKIP_PREFIXES)]:
            del annotations[key]
    return obj


def _with_crd_jobs(objects: list[dict], synthetic: dict[str, str]) -> list[dict]:
    docs = []
    for obj in objects:
        docs.append(obj)
        if (obj.get("apiVersion"), obj.get("kind")) not in CRD_ALLOWLIST:
            continue
        meta = obj.get("metadata") or {}
        for _, core in embedded_core_objects(obj):
            if core["kind"] == "Pod":
                core = {"apiVersion": "batch/v1", "kind": "Job", "metadata": core["metadata"],
                        "spec": {"template": {"metadata": {k: v for k, v in core["metadata"].items()
                                                           if k in ("labels", "annotations")},
                                              "spec": core["spec"]}}}
            job_meta = {"name": core["metadata"]["name"], "namespace": meta.get("namespace"),
                        "annotations": dict(meta.get("annotations") or {})}
            docs.append({**core, "metadata": job_meta})
            synthetic[f"Job.{meta.get('namespace')}.{job_meta['name']}"] = \
                f"{obj['kind']}.{meta.get('namespace')}.{meta.get('name')}"
    return docs


def checkov_inputs(renders: dict[str, list[dict]],
                   dockerfiles: dict[str, str] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """Files to scan ({file name: text}) and {synthetic resource id: custom resource id}.

    checkov does not look inside custom resources, so each JobSet
    replicatedJob and TFJob replica type is added as the batch/v1 Job it will
    become, carrying the custom resource's annotations (and so its skips).
    Every file also goes in a second time with its skips removed.
    """
    files, synthetic = {}, {}
    for target, objects in renders.items():
        docs = _with_crd_jobs(objects, synthetic)
        base = target.replace("/", "-")
        files[f"{base}.yaml"] = dump_all(docs)
        files[f"{base}{NOSKIP}.yaml"] = dump_all(_strip_skips(d) for d in docs)
    for name, text in (dockerfiles or {}).items():
        files[name] = text
        files[f"{name}{NOSKIP}"] = "\n".join(line for line in text.splitlines() if not _DOCKER_SKIP.search(line))
    return files, synthetic


def run_checkov(directory: Path, frameworks: tuple[str, ...] = ("kubernetes",)) -> list[dict]:
    """One checkov run over a directory; its JSON reports, one per framework."""
    import os
    import sys

    proc = subprocess.run([sys.executable, "-m", "checkov.main", "-d", str(directory), "--framework", *frameworks,
                           "--skip-download", "--output", "json"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "LOG_LEVEL": "WARNING"})
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"checkov failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    out = proc.stdout.strip()
    if not out:
        raise RuntimeError(f"checkov printed nothing:\n{proc.stderr[-4000:]}")
    reports = json.loads(out)
    if isinstance(reports, dict):
        reports = [reports] if "results" in reports else []
    return reports


_MIN_REASON = 20


def checkov_problems(reports: list[dict], objects_by_file: dict[str, list[dict]] | None = None,
                     synthetic: dict[str, str] | None = None,
                     dockerfiles: dict[str, str] | None = None) -> list[str]:
    """Failed checks, parse errors, unjustified skips, and skips that skip nothing.

    objects_by_file / dockerfiles: what was scanned under each file name (as
    given to checkov_inputs), to find each skip and check that the same check
    fails in the skip-free copy (else the skip is stale).
    """
    problems = []
    synthetic = synthetic or {}
    bare_failures: set[tuple[str, str, str]] = set()  # (check, file, resource) failing without skips
    for report in reports:
        results = report.get("results") or {}
        summary = report.get("summary") or {}
        if summary.get("parsing_errors"):
            problems.append(f"checkov ({report.get('check_type')}): {summary['parsing_errors']} files did not parse")
        for status in ("failed_checks", "skipped_checks"):
            for check in results.get(status) or []:
                file = Path(str(check.get("file_path"))).name
                resource = str(check.get("resource"))
                if NOSKIP in file:
                    if status == "failed_checks":
                        bare_failures.add((check.get("check_id"), file.replace(NOSKIP, ""),
                                           synthetic.get(resource, resource)))
                    continue
                if status == "failed_checks":
                    problems.append(f"checkov {check.get('check_id')} failed for {resource} "
                                    f"({check.get('file_path')}): {check.get('check_name')}")
                    continue
                comment = str((check.get("check_result") or {}).get("suppress_comment") or "").strip()
                if len(comment) < _MIN_REASON or comment == "No comment provided":
                    problems.append(f"checkov {check.get('check_id')} skipped for {resource} "
                                    f"without a justification (got {comment!r})")
    for file, objects in (objects_by_file or {}).items():
        for obj in objects:
            meta = obj.get("metadata") or {}
            resource = f"{obj.get('kind')}.{meta.get('namespace', 'default')}.{meta.get('name')}"
            for key, value in (meta.get("annotations") or {}).items():
                if not key.startswith(SKIP_PREFIXES):
                    continue
                check_id, sep, reason = (part.strip() for part in str(value).partition("="))
                if not sep or len(reason) < _MIN_REASON:
                    problems.append(f"{file}: {ref(obj)}: {key} must be 'CKV_K8S_NN=<reason>', got {value!r}")
                if "=" in reason:
                    problems.append(f"{file}: {ref(obj)}: {key}: checkov cuts the reason at a second '='")
                if (check_id, file, resource) not in bare_failures:
                    problems.append(f"{file}: {ref(obj)}: {key} skips {check_id}, which does not fail "
                                    "without it: remove the stale skip")
    for file, text in (dockerfiles or {}).items():
        for match in _DOCKER_SKIP.finditer(text):
            check_id, reason = match.group(1), (match.group(2) or "").strip()
            if len(reason) < _MIN_REASON:
                problems.append(f"{file}: checkov:skip={check_id} needs ':<reason>'")
            if not any(c == check_id and f == file for c, f, _ in bare_failures):
                problems.append(f"{file}: checkov:skip={check_id} skips a check that does not fail "
                                "without it: remove the stale skip")
    return problems
