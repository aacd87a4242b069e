"""The pods a render makes, wherever they are templated (Deployments, StatefulSets,
Jobs, CronJobs, the JobSet and TFJob replicas), and what their containers run and see in
their environment: each pod's downward API values (the labels and annotations its controllers
add), so an environment variable resolves, ``$(VAR)`` references expanded, as in that pod."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .k8s_objects import find, label_selector_matches, namespace_of, ref

POD_TEMPLATE_KINDS = {"Deployment", "ReplicaSet", "StatefulSet", "DaemonSet", "Job"}
#: How a downward API fieldPath names a pod label.
_LABEL_FIELD = "metadata.labels['"


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
    #: Per pod, in index order: what the downward API gives it ({fieldPath: value}), with the
    #: labels and annotations its controllers add (pod ordinal, completion index, job index).
    downward: list[dict[str, str]] = field(default_factory=list)

    def containers(self) -> list[dict]:
        return list(self.spec.get("containers") or [])

    def pod_labels(self) -> list[dict[str, str]]:
        """Each pod's labels, with those its controllers add (its ordinal, completion or replica
        index), in index order; the template's labels alone when the render cannot tell the pods apart."""
        if not self.downward:
            return [dict(self.labels)]
        return [{key[len(_LABEL_FIELD):-2]: value for key, value in pod.items() if key.startswith(_LABEL_FIELD)}
                for pod in self.downward]

    def selected_by(self, selector: dict | None) -> bool:
        """A label selector (a budget's, say) selects some pod of the unit."""
        return any(label_selector_matches(selector, labels) for labels in self.pod_labels())


def _job_counts(job_spec: dict) -> tuple[int | None, int | None, bool]:
    completions = job_spec.get("completions")
    parallelism = job_spec.get("parallelism", 1)
    indexed = job_spec.get("completionMode") == "Indexed"
    return completions, parallelism, indexed


#: A pod name's random suffix (Job pods): a manifest that takes a Job pod's name for its host
#: name resolves to something else in the checks, as it would in the cluster.
RANDOM_SUFFIX = "x7k2p"

#: The prefix of the labels (and the same annotations) the JobSet controller puts on its child Jobs' pods.
JOBSET_PREFIX = "jobset.sigs.k8s.io/"
#: An Indexed Job's pod's completion index, a label and an annotation the Job controller sets.
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"


def _downward(name: str, namespace: str | None, labels: dict, annotations: dict) -> dict[str, str]:
    """The fieldPaths the downward API resolves for a pod with this name, labels and annotations."""
    values = {"metadata.name": name, "metadata.namespace": namespace or "default"}
    values |= {f"metadata.labels['{k}']": str(v) for k, v in labels.items()}
    values |= {f"metadata.annotations['{k}']": str(v) for k, v in annotations.items()}
    return values


def _template_meta(template: dict) -> tuple[dict, dict]:
    meta = template.get("metadata") or {}
    return dict(meta.get("labels") or {}), dict(meta.get("annotations") or {})


def _indexed_job_pods(job: str, ns: str | None, labels: dict, annotations: dict, job_spec: dict,
                      count: int | None) -> list[dict[str, str]]:
    """Downward values of a Job's pods: the Job controller names them <job>-<index>-<random>
    (Indexed) and labels them with the Job's name and, Indexed, the completion index."""
    indexed = job_spec.get("completionMode") == "Indexed"
    pods = []
    for i in range(count or 0):
        pod_labels = labels | {"batch.kubernetes.io/job-name": job, "job-name": job}
        pod_annotations = dict(annotations)
        if indexed:
            pod_labels[COMPLETION_INDEX] = str(i)
            pod_annotations[COMPLETION_INDEX] = str(i)
        name = f"{job}-{i}-{RANDOM_SUFFIX}" if indexed else f"{job}-{RANDOM_SUFFIX}"
        pods.append(_downward(name, ns, pod_labels, pod_annotations))
    return pods


def _jobset_units(obj: dict, ns: str | None, name: str) -> list[PodUnit]:
    """One unit per child Job (<jobset>-<replicatedJob>-<job index>), as the JobSet controller makes
    them: its labels (and the same annotations) on the pods, host names <job>-<index>.<subdomain>."""
    spec = obj.get("spec") or {}
    network = spec.get("network") or {}
    subdomain = network.get("subdomain") or name
    dns = network.get("enableDNSHostnames", True)
    units = []
    for rjob in spec.get("replicatedJobs") or []:
        job_spec = ((rjob.get("template") or {}).get("spec")) or {}
        template = job_spec.get("template") or {}
        completions, parallelism, indexed = _job_counts(job_spec)
        replicas = rjob.get("replicas", 1)
        for j in range(replicas):
            job = f"{name}-{rjob.get('name')}-{j}"
            jobset_meta = {f"{JOBSET_PREFIX}jobset-name": name,
                           f"{JOBSET_PREFIX}replicatedjob-name": rjob.get("name"),
                           f"{JOBSET_PREFIX}replicatedjob-replicas": str(replicas),
                           f"{JOBSET_PREFIX}job-index": str(j),
                           f"{JOBSET_PREFIX}restart-attempt": "0"}
            labels, annotations = _template_meta(template)
            labels |= jobset_meta
            annotations |= jobset_meta
            where = f"{ref(obj)} replicatedJob {rjob.get('name')}" + (f" Job {job}" if replicas > 1 else "")
            unit = PodUnit(obj, where, ns, labels | {"batch.kubernetes.io/job-name": job, "job-name": job},
                           template.get("spec") or {}, "JobSet", indexed=indexed, completions=completions,
                           parallelism=parallelism, role=rjob.get("name"))
            if completions is not None:
                unit.pods = completions
                if dns and indexed:
                    unit.hostnames = [f"{job}-{i}.{subdomain}" for i in range(completions)]
                unit.downward = _indexed_job_pods(job, ns, labels, annotations, job_spec, completions)
            units.append(unit)
    return units


def pod_units(objects: Iterable[dict]) -> list[PodUnit]:
    units: list[PodUnit] = []
    for obj in objects:
        kind, spec = obj.get("kind"), obj.get("spec") or {}
        ns = namespace_of(obj)
        name = (obj.get("metadata") or {}).get("name")
        if kind in POD_TEMPLATE_KINDS:
            template = spec.get("template") or {}
            labels, annotations = _template_meta(template)
            unit = PodUnit(obj, ref(obj), ns, labels, template.get("spec") or {}, kind)
            if kind == "StatefulSet":
                replicas = spec.get("replicas", 1)
                unit.pods = replicas
                unit.hostnames = [f"{name}-{i}.{spec.get('serviceName')}" for i in range(replicas)]
                unit.downward = [_downward(f"{name}-{i}", ns, labels | {
                    "apps.kubernetes.io/pod-index": str(i),
                    "statefulset.kubernetes.io/pod-name": f"{name}-{i}"}, annotations)
                    for i in range(replicas)]
            elif kind == "Job":
                unit.completions, unit.parallelism, unit.indexed = _job_counts(spec)
                unit.pods = unit.completions
                unit.downward = _indexed_job_pods(name, ns, labels, annotations, spec, unit.completions)
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
            labels, annotations = _template_meta(obj)
            units.append(PodUnit(obj, ref(obj), ns, labels, spec, "Pod", pods=1,
                                 downward=[_downward(name, ns, labels, annotations)]))
        elif kind == "JobSet":
            units += _jobset_units(obj, ns, name)
        elif kind == "TFJob":
            for rtype, rspec in (spec.get("tfReplicaSpecs") or {}).items():
                template = (rspec or {}).get("template") or {}
                labels, annotations = _template_meta(template)
                labels.update({"training.kubeflow.org/job-name": name,
                               "training.kubeflow.org/replica-type": rtype.lower()})
                replicas = (rspec or {}).get("replicas", 1)
                pods = [_downward(f"{name}-{rtype.lower()}-{i}", ns,
                                  labels | {"training.kubeflow.org/replica-index": str(i)}, annotations)
                        for i in range(replicas)]
                units.append(PodUnit(obj, f"{ref(obj)} {rtype}", ns, labels, template.get("spec") or {},
                                     "TFJob", pods=replicas, role=rtype,
                                     hostnames=[f"{name}-{rtype.lower()}-{i}" for i in range(replicas)],
                                     downward=pods))
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
    return _environment(container, objects, namespace, FieldRef, expand_values=False)


def _environment(container: dict, objects: list[dict], namespace: str | None,
                 field_value: Callable[[str], Any], expand_values: bool) -> dict[str, Any]:
    """envFrom, then env in order; ``field_value`` gives a fieldRef's value, and with ``expand_values`` a
    literal value has its ``$(VAR)`` references expanded with the variables defined before it."""
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
            env[name] = expand(str(var["value"]), env) if expand_values else str(var["value"])
            continue
        source = var.get("valueFrom") or {}
        if "fieldRef" in source:
            env[name] = field_value(source["fieldRef"].get("fieldPath", ""))
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


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(value: str, defined: dict[str, Any]) -> str:
    """Kubernetes' expansion of ``$(VAR)`` in an env value (or a command, a subPathExpr): a
    variable defined before it (a string) is replaced, an unknown reference stays as written,
    ``$$`` is one ``$``."""
    def substitute(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        known = defined.get(match.group(1))
        return known if isinstance(known, str) else match.group(0)

    return _REFERENCE.sub(substitute, value)


def pod_env(unit: PodUnit, container: dict, objects: list[dict], index: int) -> dict[str, Any]:
    """The container's environment in pod ``index`` of ``unit``, as the kubelet makes it: fieldRefs
    from that pod's downward values (None when the render cannot tell), and ``$(VAR)`` in a value
    expanded with the variables defined before it. Secret values stay SecretValue markers."""
    downward = unit.downward[index] if index < len(unit.downward) else {}
    return _environment(container, objects, unit.namespace, downward.get, expand_values=True)


def mount_for(container: dict, path: str) -> dict | None:
    """The volume mount a path in the container lies on (the longest mount path that holds it)."""
    best = None
    for mount in container.get("volumeMounts") or []:
        mp = str(mount.get("mountPath", "")).rstrip("/")
        holds = path == mp or path.startswith(mp + "/")
        if holds and (best is None or len(mp) > len(str(best.get("mountPath", "")).rstrip("/"))):
            best = mount
    return best


def host_matches(host: str, expected: str, namespace: str | None) -> bool:
    """``host`` names the pod whose stable name is ``expected`` (<pod>.<service>): as is, or with
    the namespace and cluster domain that DNS search paths complete."""
    if host == expected:
        return True
    if namespace:
        return host in (f"{expected}.{namespace}", f"{expected}.{namespace}.svc",
                        f"{expected}.{namespace}.svc.cluster.local")
    return False


def volume_named(unit: PodUnit, name: str | None) -> dict | None:
    """The pod template's volume ``name``."""
    return next((v for v in unit.spec.get("volumes") or [] if v.get("name") == name), None)


def claim_templates(unit: PodUnit) -> set[str]:
    """The names of a StatefulSet's volume claim templates: a volume of its own for every pod."""
    if unit.controller != "StatefulSet":
        return set()
    return {(t.get("metadata") or {}).get("name")
            for t in (unit.owner.get("spec") or {}).get("volumeClaimTemplates") or []}
