"""What the kubelet puts in a container's environment: ``$(VAR)`` expansion, fieldRefs
from the pod's metadata, env and envFrom from ConfigMaps and Secrets."""

from __future__ import annotations

import base64
import random
import re
import string
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from .errors import ContractError, HarnessError

_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' dependent-variable expansion: $(VAR) when VAR is defined, $$ is $."""
    def sub(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return _REF.sub(sub, value)


_FIELD_KEY = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


@dataclass
class PodMeta:
    """What the controller and the kubelet decide about one pod."""

    name: str
    namespace: str
    hostname: str
    subdomain: str | None
    labels: dict[str, str]
    annotations: dict[str, str]
    ip: str
    index: int
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    extra_env: dict[str, str] = field(default_factory=dict)

    def field(self, path: str, spec: dict) -> str:
        match = _FIELD_KEY.match(path)
        if match:
            return (self.labels if match.group(1) == "labels" else self.annotations).get(match.group(2), "")
        simple = {
            "metadata.name": self.name,
            "metadata.namespace": self.namespace,
            "metadata.uid": self.uid,
            "spec.nodeName": "node-0",
            "spec.serviceAccountName": spec.get("serviceAccountName") or "default",
            "status.podIP": self.ip,
            "status.podIPs": self.ip,
            "status.hostIP": self.ip,
            "status.hostIPs": self.ip,
        }
        if path not in simple:
            raise HarnessError(f"fieldRef {path!r} is not emulated")
        return simple[path]


def pod_meta(workload: dict, index: int, ip: str) -> PodMeta:
    """Name, hostname, labels and annotations of pod ``index`` as the controller makes them."""
    kind, meta, spec = workload["kind"], workload["metadata"], workload["spec"]
    template = spec["template"]
    labels = dict((template.get("metadata") or {}).get("labels") or {})
    annotations = dict((template.get("metadata") or {}).get("annotations") or {})
    pod_spec = template.get("spec") or {}
    name, ns = meta["name"], meta.get("namespace") or "default"
    extra: dict[str, str] = {}
    if kind == "StatefulSet":
        if not 0 <= index < spec.get("replicas", 1):
            raise HarnessError(f"StatefulSet {name} has no ordinal {index}")
        pod = f"{name}-{index}"
        labels.update({"apps.kubernetes.io/pod-index": str(index),
                       "statefulset.kubernetes.io/pod-name": pod,
                       "controller-revision-hash": f"{name}-5d8f7c9b6c"})
        hostname, subdomain = pod, spec.get("serviceName")
    elif kind == "Job":
        if spec.get("completionMode") != "Indexed":
            raise HarnessError(f"Job {name} is not Indexed: its pods have no index to run by")
        if not 0 <= index < spec.get("completions", 1):
            raise HarnessError(f"Job {name} has no completion index {index}")
        suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        pod = f"{name}-{index}-{suffix}"
        labels.update({"batch.kubernetes.io/job-completion-index": str(index), "job-name": name,
                       "batch.kubernetes.io/job-name": name})
        annotations["batch.kubernetes.io/job-completion-index"] = str(index)
        # Indexed Jobs: hostname <job>-<index>; the controller adds JOB_COMPLETION_INDEX.
        hostname, subdomain = f"{name}-{index}", pod_spec.get("subdomain")
        extra["JOB_COMPLETION_INDEX"] = str(index)
    else:
        raise HarnessError(f"{kind} pods are not emulated")
    hostname = pod_spec.get("hostname") or hostname
    subdomain = pod_spec.get("subdomain") or subdomain
    return PodMeta(pod, ns, hostname, subdomain, labels, annotations, ip, index, extra_env=extra)


def resolve_env(objects: list[dict], workload: dict, container: dict, meta: PodMeta) -> dict[str, str]:
    """The container's environment, in Kubernetes' order: envFrom, then env (expanded)."""
    ns = meta.namespace
    pod_spec = workload["spec"]["template"]["spec"]

    def lookup(kind: str, name: str, key: str | None, optional: bool) -> dict[str, str] | str | None:
        objs = [o for o in objects if o.get("kind") == kind and o["metadata"].get("name") == name
                and o["metadata"].get("namespace", "default") == ns]
        if not objs:
            if optional:
                return None
            raise ContractError(f"{meta.name}: {kind} {name!r} does not exist in the render "
                                f"(namespace {ns})")
        obj = objs[0]
        data = {k: base64.b64decode(v).decode() if kind == "Secret" else str(v)
                for k, v in (obj.get("data") or {}).items()}
        data.update({k: str(v) for k, v in (obj.get("stringData") or {}).items()})
        if key is None:
            return data
        if key not in data:
            if optional:
                return None
            raise ContractError(f"{meta.name}: {kind} {name!r} has no key {key!r}")
        return data[key]

    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        ref_kind, ref = (("ConfigMap", source["configMapRef"]) if "configMapRef" in source
                         else ("Secret", source["secretRef"]))
        data = lookup(ref_kind, ref["name"], None, bool(ref.get("optional")))
        for key, value in (data or {}).items():
            env[prefix + key] = value
    # The controller's own variables come before the user's (which may override them).
    env.update(meta.extra_env)
    for var in container.get("env") or []:
        name = var["name"]
        if "value" in var:
            env[name] = expand(str(var["value"]), env)
            continue
        src = var.get("valueFrom") or {}
        if "fieldRef" in src:
            env[name] = meta.field(src["fieldRef"]["fieldPath"], pod_spec)
        elif "configMapKeyRef" in src or "secretKeyRef" in src:
            kind, sel = (("ConfigMap", src["configMapKeyRef"]) if "configMapKeyRef" in src
                         else ("Secret", src["secretKeyRef"]))
            value = lookup(kind, sel["name"], sel["key"], bool(sel.get("optional")))
            if value is not None:
                env[name] = value  # type: ignore[assignment]
        elif "resourceFieldRef" in src:
            raise HarnessError(f"{name}: resourceFieldRef is not emulated")
        else:
            env[name] = ""
    return env
