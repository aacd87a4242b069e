"""The pods a render makes, wherever they are templated (Deployments, StatefulSets,
Jobs, CronJobs, the JobSet and TFJob replicas), and what their containers run and see in
their environment."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .k8s_objects import find, namespace_of, ref

POD_TEMPLATE_KINDS = {"Deployment", "ReplicaSet", "StatefulSet", "DaemonSet", "Job"}


@dataclass
class PodUnit:
    """One pod template and what its controller makes of it."""

    owner: dict  # the object that holds the template
    where: str  # for messages
    namespace: str | None
    labels: dict
    spec: dict
    controller: str  # StatefulSet, Job, JobSet, TFJob, Deployment, ...
    #: Number of pods created from the template (None: unknown / unbounded).
    pods: int | None = None
    #: Stable DNS names of the pods, in index order (StatefulSet, JobSet).
    hostnames: list[str] = field(default_factory=list)
    #: The pods carry a completion index (Indexed Job, JobSet child Job).
    indexed: bool = False
    completions: int | None = None
    parallelism: int | None = None
    #: The replicated job / replica type inside a CRD.
    role: str = ""

    def containers(self) -> list[dict]:
        return list(self.spec.get("containers") or [])


def _job_counts(job_spec: dict) -> tuple[int | None, int | None, bool]:
    completions = job_spec.get("completions")
    parallelism = job_spec.get("parallelism", 1)
    indexed = job_spec.get("completionMode") == "Indexed"
    return completions, parallelism, indexed


def pod_units(objects: Iterable[dict]) -> list[PodUnit]:
    units: list[PodUnit] = []
    for obj in objects:
        kind, spec = obj.get("kind"), obj.get("spec") or {}
        ns = namespace_of(obj)
        name = (obj.get("metadata") or {}).get("name")
        if kind in POD_TEMPLATE_KINDS:
            template = spec.get("template") or {}
            unit = PodUnit(obj, ref(obj), ns, (template.get("metadata") or {}).get("labels") or {},
                           template.get("spec") or {}, kind)
            if kind == "StatefulSet":
                replicas = spec.get("replicas", 1)
                unit.pods = replicas
                unit.hostnames = [f"{name}-{i}.{spec.get('serviceName')}" for i in range(replicas)]
            elif kind == "Job":
                unit.completions, unit.parallelism, unit.indexed = _job_counts(spec)
                unit.pods = unit.completions
            elif kind in ("Deployment", "ReplicaSet"):
                unit.pods = spec.get("replicas", 1)
            units.append(unit)
        elif kind == "CronJob":
            job_spec = ((spec.get("jobTemplate") or {}).get("spec")) or {}
            template = job_spec.get("template") or {}
            unit = PodUnit(obj, ref(obj), ns, (template.get("metadata") or {}).get("labels") or {},
                           template.get("spec") or {}, kind)
            unit.completions, unit.parallelism, unit.indexed = _job_counts(job_spec)
            unit.pods = unit.completions
            units.append(unit)
        elif kind == "Pod":
            units.append(PodUnit(obj, ref(obj), ns, (obj.get("metadata") or {}).get("labels") or {},
                                 spec, "Pod", pods=1))
        elif kind == "JobSet":
            network = spec.get("network") or {}
            subdomain = network.get("subdomain") or name
            dns = network.get("enableDNSHostnames", True)
            for rjob in spec.get("replicatedJobs") or []:
                job_spec = ((rjob.get("template") or {}).get("spec")) or {}
                template = job_spec.get("template") or {}
                labels = dict((template.get("metadata") or {}).get("labels") or {})
                labels.update({"jobset.sigs.k8s.io/jobset-name": name,
                               "jobset.sigs.k8s.io/replicatedjob-name": rjob.get("name")})
                completions, parallelism, indexed = _job_counts(job_spec)
                replicas = rjob.get("replicas", 1)
                unit = PodUnit(obj, f"{ref(obj)} replicatedJob {rjob.get('name')}", ns, labels,
                               template.get("spec") or {}, "JobSet", indexed=indexed,
                               completions=completions, parallelism=parallelism, role=rjob.get("name"))
                if completions is not None:
                    unit.pods = replicas * completions
                    if dns:
                        unit.hostnames = [f"{name}-{rjob.get('name')}-{j}-{i}.{subdomain}"
                                          for j in range(replicas) for i in range(completions)]
                units.append(unit)
        elif kind == "TFJob":
            for rtype, rspec in (spec.get("tfReplicaSpecs") or {}).items():
                template = (rspec or {}).get("template") or {}
                labels = dict((template.get("metadata") or {}).get("labels") or {})
                labels.update({"training.kubeflow.org/job-name": name,
                               "training.kubeflow.org/replica-type": rtype.lower()})
                replicas = (rspec or {}).get("replicas", 1)
                units.append(PodUnit(obj, f"{ref(obj)} {rtype}", ns, labels, template.get("spec") or {},
                                     "TFJob", pods=replicas, role=rtype,
                                     hostnames=[f"{name}-{rtype.lower()}-{i}" for i in range(replicas)]))
    return units


def container_ports(container: dict) -> tuple[set[str], set[int]]:
    names, numbers = set(), set()
    for port in container.get("ports") or []:
        if port.get("name"):
            names.add(port["name"])
        if port.get("containerPort") is not None:
            numbers.add(int(port["containerPort"]))
    return names, numbers


def unit_has_port(unit: PodUnit, port: Any) -> bool:
    for container in unit.containers():
        names, numbers = container_ports(container)
        if (isinstance(port, str) and not port.isdigit() and port in names) or \
                (str(port).isdigit() and int(port) in numbers):
            return True
    return False


def command_of(container: dict) -> list[str]:
    return [str(c) for c in (container.get("command") or []) + (container.get("args") or [])]


def is_ps_server(container: dict) -> bool:
    return bool(container.get("command")) and Path(str(container["command"][0])).name == "ps-server"


def is_ps_worker(container: dict) -> bool:
    return bool(container.get("command")) and Path(str(container["command"][0])).name == "ps-worker"


@dataclass(frozen=True)
class FieldRef:
    path: str


@dataclass(frozen=True)
class SecretValue:
    secret: str
    key: str


def resolve_env(container: dict, objects: list[dict], namespace: str | None) -> dict[str, Any]:
    """The container's environment as far as the render can tell.

    Literal values and ConfigMap values are resolved; fieldRefs and Secret
    values come back as FieldRef / SecretValue markers. env overrides envFrom,
    as in Kubernetes.
    """
    env: dict[str, Any] = {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            cm = find(objects, "ConfigMap", source["configMapRef"].get("name"), namespace)
            for key, value in ((cm or {}).get("data") or {}).items():
                env[prefix + key] = value
        elif "secretRef" in source:
            secret = find(objects, "Secret", source["secretRef"].get("name"), namespace)
            for key in secret_keys(secret or {}):
                env[prefix + key] = SecretValue(source["secretRef"].get("name"), key)
    for var in container.get("env") or []:
        name = var.get("name")
        if "value" in var:
            env[name] = str(var["value"])
            continue
        source = var.get("valueFrom") or {}
        if "fieldRef" in source:
            env[name] = FieldRef(source["fieldRef"].get("fieldPath", ""))
        elif "configMapKeyRef" in source:
            sel = source["configMapKeyRef"]
            cm = find(objects, "ConfigMap", sel.get("name"), namespace)
            env[name] = ((cm or {}).get("data") or {}).get(sel.get("key"))
        elif "secretKeyRef" in source:
            env[name] = SecretValue(source["secretKeyRef"].get("name"), source["secretKeyRef"].get("key"))
        else:
            env[name] = None
    return env


def secret_keys(secret: dict) -> set[str]:
    """The keys a Secret provides, from data and stringData alike."""
    return set(secret.get("data") or {}) | set(secret.get("stringData") or {})
