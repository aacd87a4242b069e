"""Run the rendered manifests' pods as local processes: the runtime half of
the manifest/program contract (tests/deploy/test_contract.py).

From a render (a list of objects) this builds, for one pod of a StatefulSet or
an indexed Job, what the kubelet would give its container, and nothing else:

* the command and args exactly as rendered (``$(VAR)`` expanded as Kubernetes
  does), the executable looked up in the bin directory of this Python (the
  venv's console scripts ``ps-server`` / ``ps-worker``);
* the environment: ``envFrom`` ConfigMaps/Secrets, ``env`` values,
  ``configMapKeyRef``, ``secretKeyRef`` (base64 of the rendered Secret, names
  with their kustomize hash suffixes), ``fieldRef`` (name, namespace, labels
  and annotations the controller adds: ``apps.kubernetes.io/pod-index``,
  ``batch.kubernetes.io/job-completion-index``, pod IP, ...), plus what the
  Job controller and the image add (``JOB_COMPLETION_INDEX``, the image's
  ``ENV`` lines);
* the volumes: a Secret / ConfigMap volume becomes a directory of files written
  from the rendered object (``items``, ``defaultMode`` and the fsGroup
  ownership rules of the kubelet), a claim and an ``emptyDir`` become empty
  directories; every value in args/env that is a path under a ``mountPath``
  is rewritten to the directory standing in for that mount;
* the user: when we are root and ``setpriv`` works, the process runs as the
  securityContext's runAsUser / runAsGroup with fsGroup and
  supplementalGroups, no new privileges, an empty capability bounding set.

Anything the harness cannot emulate faithfully (a volume type, a subPath, a
fieldRef it does not know) raises :class:`HarnessError` rather than guessing.
Contract violations found while running (a process that dies at start, a
probe that never turns SERVING, a checkpoint that never reaches its volume)
raise :class:`ContractError` naming the pod and quoting its log.

:class:`PodNetwork` gives every pod its own network namespace (veth pairs on a
bridge, an address per pod, hosts files as Kubernetes DNS would answer) for
the "separate hosts" run.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import random
import re
import secrets as _secrets
import shutil
import signal
import string
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

#: What the image (deploy/Dockerfile) puts in every container's environment,
#: and its WORKDIR. HOME and the working directory are under /tmp, which the
#: pods mount as an emptyDir, so they are rewritten like any mounted path.
IMAGE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
    "HOME": "/tmp",
}
IMAGE_WORKDIR = "/tmp"

#: The settings that carry a listening port or address, as env and as flags.
PORT_SETTINGS = {"PS_PORT": "--port", "PS_HEALTH_PORT": "--health-port", "PS_METRICS_PORT": "--metrics-port"}
HOST_SETTINGS = {"PS_HOST": "--host"}

CLUSTER_DOMAIN = "cluster.local"


class HarnessError(RuntimeError):
    """The render uses something this harness cannot emulate faithfully."""


class ContractError(AssertionError):
    """The rendered pod does not work with the program it runs."""


# --------------------------------------------------------------------------
# Rendered objects


def workload_running(objects: Iterable[dict], kind: str, program: str) -> dict:
    """The one ``kind`` object of the render whose pods run ``program``."""
    def runs(obj: dict) -> bool:
        pod_spec = (((obj.get("spec") or {}).get("template") or {}).get("spec")) or {}
        return any(c.get("command") and Path(str(c["command"][0])).name == program
                   for c in pod_spec.get("containers") or [])

    found = [o for o in objects if o.get("kind") == kind and runs(o)]
    if len(found) != 1:
        raise HarnessError(f"expected exactly one {kind} running {program} in the render, found {len(found)}")
    return found[0]


def program_container(workload: dict, program: str) -> dict:
    """The container of the workload's pod template whose command runs ``program``."""
    containers = [c for c in (workload["spec"]["template"]["spec"].get("containers") or [])
                  if c.get("command") and Path(str(c["command"][0])).name == program]
    if len(containers) != 1:
        raise HarnessError(f"{workload['kind']}/{workload['metadata']['name']}: expected one container "
                           f"whose command runs {program}, found {len(containers)}")
    return containers[0]


def executable(name: str) -> str:
    """A console script of this Python's environment (the venv's bin directory)."""
    path = Path(sys.executable).parent / Path(name).name
    if not path.exists():
        raise HarnessError(f"{path.name} is not installed next to {sys.executable} "
                           "(pip install -e '.[dev]' provides the console scripts)")
    return str(path)


# --------------------------------------------------------------------------
# Kubernetes semantics: $(VAR) expansion, fieldRefs


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


# --------------------------------------------------------------------------
# Volumes


@dataclass
class Mount:
    path: str  # mountPath in the container
    local: Path  # the directory standing in for it
    volume: str
    kind: str


def _secret_or_configmap_files(objects: list[dict], kind: str, name: str, ns: str,
                               source: dict) -> dict[str, tuple[bytes, int | None]]:
    obj = [o for o in objects if o.get("kind") == kind and o["metadata"].get("name") == name
           and o["metadata"].get("namespace", "default") == ns]
    if not obj:
        if source.get("optional"):
            return {}
        raise ContractError(f"the pod mounts {kind} {name!r}, which the render does not contain")
    obj = obj[0]
    data: dict[str, bytes] = {}
    for key, value in (obj.get("data") or {}).items():
        data[key] = base64.b64decode(value) if kind == "Secret" else str(value).encode()
    for key, value in (obj.get("binaryData") or {}).items():
        data[key] = base64.b64decode(value)
    for key, value in (obj.get("stringData") or {}).items():
        data[key] = str(value).encode()
    items = source.get("items")
    if not items:
        return {key: (value, None) for key, value in data.items()}
    out = {}
    for item in items:
        if item["key"] not in data:
            if source.get("optional"):
                continue
            raise ContractError(f"{kind} {name!r} has no key {item['key']!r} (volume items)")
        out[item["path"]] = (data[item["key"]], item.get("mode"))
    return out


@dataclass
class Identity:
    uid: int | None
    gid: int | None
    fs_group: int | None
    groups: list[int]
    no_new_privs: bool
    drop_all_caps: bool


def identity_of(pod_spec: dict, container: dict) -> Identity:
    psc, csc = pod_spec.get("securityContext") or {}, container.get("securityContext") or {}
    uid = csc.get("runAsUser", psc.get("runAsUser"))
    gid = csc.get("runAsGroup", psc.get("runAsGroup"))
    fs_group = psc.get("fsGroup")
    groups = [g for g in [fs_group, *(psc.get("supplementalGroups") or [])] if g is not None]
    drop = [str(c).upper() for c in ((csc.get("capabilities") or {}).get("drop") or [])]
    return Identity(uid, gid, fs_group, groups, csc.get("allowPrivilegeEscalation") is False, "ALL" in drop)


def materialize_volumes(objects: list[dict], workload: dict, container: dict, meta: PodMeta,
                        root: Path, identity: Identity, shared: Path) -> list[Mount]:
    """A directory per volumeMount, filled as the kubelet would."""
    pod_spec = workload["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}
    claims = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates") or []}
    chown = os.geteuid() == 0
    fs_group = identity.fs_group
    mounts: list[Mount] = []
    for vm in container.get("volumeMounts") or []:
        if vm.get("subPath") or vm.get("subPathExpr"):
            raise HarnessError(f"volumeMount {vm['name']} uses subPath, which is not emulated")
        name = vm["name"]
        local = root / "volumes" / name
        if name in volumes:
            volume = volumes[name]
            kinds = [k for k in volume if k != "name"]
            kind = kinds[0] if kinds else "emptyDir"
        elif name in claims:
            volume, kind = {"name": name}, "volumeClaimTemplate"
        else:
            raise ContractError(f"{meta.name}: volumeMount {name!r} has no volume or claim template")
        if kind in ("secret", "configMap"):
            source = volume[kind]
            obj_name = source.get("secretName") if kind == "secret" else source.get("name")
            files = _secret_or_configmap_files(objects, "Secret" if kind == "secret" else "ConfigMap",
                                               obj_name, meta.namespace, source)
            local.mkdir(parents=True)
            default_mode = source.get("defaultMode", 0o644)
            for rel, (data, mode) in files.items():
                path = local / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
                mode = default_mode if mode is None else mode
                if fs_group is not None:
                    # kubelet SetVolumeOwnership on a read-only volume: group fsGroup, mode | 0440.
                    mode |= 0o440
                    if chown:
                        os.chown(path, 0, fs_group)
                os.chmod(path, mode)
            dir_mode = 0o755
            if fs_group is not None:
                dir_mode |= 0o2550
                if chown:
                    os.chown(local, 0, fs_group)
            os.chmod(local, dir_mode)
        elif kind == "emptyDir":
            local.mkdir(parents=True)
            os.chmod(local, 0o777)
        elif kind in ("volumeClaimTemplate", "persistentVolumeClaim"):
            # A claim template gives each pod its own volume (<claim>-<pod>); a named claim
            # is one volume shared by every pod that mounts it.
            if kind == "volumeClaimTemplate":
                local = shared / "claims" / f"{name}-{meta.name}"
            else:
                local = shared / "claims" / volume["persistentVolumeClaim"]["claimName"]
            local.mkdir(parents=True, exist_ok=True)
            mode = 0o755
            if fs_group is not None:
                mode |= 0o2770 | 0o110
                if chown:
                    os.chown(local, 0, fs_group)
            os.chmod(local, mode)
        else:
            raise HarnessError(f"volume {name!r} of type {kind} is not emulated")
        mounts.append(Mount(vm["mountPath"].rstrip("/") or "/", local, name, kind))
    return mounts


def rewrite_path(value: str, mounts: list[Mount]) -> str:
    """A path under a mountPath becomes the same path under its stand-in directory."""
    def one(v: str) -> str:
        for m in sorted(mounts, key=lambda m: len(m.path), reverse=True):
            if v == m.path or v.startswith(m.path + "/"):
                return str(m.local) + v[len(m.path):]
        return v

    if value.startswith("--") and "=" in value:
        flag, _, rest = value.partition("=")
        return f"{flag}={one(rest)}"
    return one(value)


# --------------------------------------------------------------------------
# Environment


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


# --------------------------------------------------------------------------
# A pod, ready to start


@dataclass
class Pod:
    meta: PodMeta
    workload: dict
    container: dict
    argv: list[str]
    env: dict[str, str]
    mounts: list[Mount]
    identity: Identity
    cwd: str
    #: container port -> port the process really uses (loopback rewrites them)
    ports: dict[int, int]
    logdir: Path

    @property
    def name(self) -> str:
        return self.meta.name

    def container_port(self, port: int | str) -> int:
        """A probe's port (number or name) as a container port number."""
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in self.container.get("ports") or []:
            if p.get("name") == port:
                return int(p["containerPort"])
        raise ContractError(f"{self.name}: port {port!r} is not a container port name")

    def mount(self, mount_path: str) -> Path:
        for m in self.mounts:
            if m.path == mount_path.rstrip("/"):
                return m.local
        raise KeyError(mount_path)


def plan_pod(objects: list[dict], workload: dict, program: str, index: int, work: Path, *,
             ip: str = "127.0.0.1") -> Pod:
    """Pod ``index`` of ``workload`` as it would run: argv, env, volumes, identity."""
    meta = pod_meta(workload, index, ip)
    container = program_container(workload, program)
    pod_spec = workload["spec"]["template"]["spec"]
    identity = identity_of(pod_spec, container)
    root = work / meta.name
    root.mkdir(parents=True)
    os.chmod(root, 0o755)
    mounts = materialize_volumes(objects, workload, container, meta, root, identity, work)
    env = resolve_env(objects, workload, container, meta)
    full_env = {**IMAGE_ENV, "HOSTNAME": meta.hostname, **env}
    rendered = (container.get("command") or []) + (container.get("args") or [])
    argv = [expand(str(a), full_env) for a in rendered]
    if not container.get("command"):
        raise HarnessError(f"{meta.name}: no command; the harness runs only explicit commands")
    argv = [executable(argv[0])] + [rewrite_path(a, mounts) for a in argv[1:]]
    full_env = {k: rewrite_path(v, mounts) for k, v in full_env.items()}
    full_env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), full_env["PATH"]])
    tmp = [m for m in mounts if m.path == "/tmp"]
    if tmp:
        full_env.setdefault("TMPDIR", str(tmp[0].local))  # the process's /tmp is that emptyDir
    cwd = rewrite_path(container.get("workingDir") or IMAGE_WORKDIR, mounts)
    if not Path(cwd).is_dir():
        cwd = str(root)
    ports = {int(p["containerPort"]): int(p["containerPort"]) for p in container.get("ports") or []}
    logdir = root / "logs"
    logdir.mkdir()
    return Pod(meta, workload, container, argv, full_env, mounts, identity, cwd, ports, logdir)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _set_setting(pod: Pod, env_name: str, flag: str, change: Callable[[str], str]) -> list[str]:
    """Apply ``change`` to a setting given as env var and/or flag; returns what was changed."""
    changed = []
    if env_name in pod.env:
        pod.env[env_name] = change(pod.env[env_name])
        changed.append(env_name)
    argv = pod.argv
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            argv[i + 1] = change(argv[i + 1])
            changed.append(flag)
        elif arg.startswith(flag + "="):
            argv[i] = f"{flag}={change(arg.split('=', 1)[1])}"
            changed.append(flag)
    return changed


def to_loopback(pod: Pod) -> None:
    """Listen on 127.0.0.1 and on free ports instead of the container ports."""
    pod.ports = {port: free_port() for port in pod.ports}

    def port(value: str) -> str:
        if not value.isdigit() or int(value) not in pod.ports:
            if value.isdigit() and int(value) == 0:
                return value
            raise ContractError(f"{pod.name}: listens on port {value}, which is not a container port "
                                f"({sorted(pod.ports)})")
        return str(pod.ports[int(value)])

    for env_name, flag in PORT_SETTINGS.items():
        _set_setting(pod, env_name, flag, port)
    for env_name, flag in HOST_SETTINGS.items():
        _set_setting(pod, env_name, flag, lambda _v: "127.0.0.1")


# --------------------------------------------------------------------------
# DNS as Kubernetes would answer


def dns_records(objects: list[dict], pods: list[Pod]) -> dict[str, list[Pod]]:
    """Fully qualified name -> pods, for the names cluster DNS answers.

    A pod with hostname and subdomain gets ``<hostname>.<subdomain>.<ns>.svc``
    only when a headless Service named like the subdomain selects it; a
    headless Service's own name answers with all the pods it selects (the
    harness starts workers once the servers are ready, so whether not-ready
    addresses are published does not matter here).
    """
    records: dict[str, list[Pod]] = {}
    for svc in (o for o in objects if o.get("kind") == "Service"):
        spec = svc.get("spec") or {}
        if spec.get("clusterIP") != "None":
            continue
        ns = svc["metadata"].get("namespace", "default")
        selector = spec.get("selector") or {}
        selected = [p for p in pods if p.meta.namespace == ns and selector
                    and all(p.meta.labels.get(k) == v for k, v in selector.items())]
        svc_fqdn = f"{svc['metadata']['name']}.{ns}.svc.{CLUSTER_DOMAIN}"
        for pod in selected:
            records.setdefault(svc_fqdn, []).append(pod)
            if pod.meta.subdomain == svc["metadata"]["name"]:
                records.setdefault(f"{pod.meta.hostname}.{svc_fqdn}", []).append(pod)
    return records


def search_domains(namespace: str) -> list[str]:
    return [f"{namespace}.svc.{CLUSTER_DOMAIN}", f"svc.{CLUSTER_DOMAIN}", CLUSTER_DOMAIN]


def resolve_name(host: str, records: dict[str, list[Pod]], namespace: str) -> list[Pod]:
    """The pods a pod in ``namespace`` reaches under ``host`` (search path, ndots:5)."""
    candidates = [f"{host}.{d}" for d in search_domains(namespace)] if host.count(".") < 5 else []
    for name in [*candidates, host.rstrip(".")]:
        if name in records:
            return records[name]
    return []


def split_addresses(value: str) -> list[tuple[str, int]]:
    out = []
    for entry in value.split(","):
        host, _, port = entry.strip().rpartition(":")
        out.append((host.strip("[]"), int(port) if port.isdigit() else -1))
    return out


def map_addresses(value: str, records: dict[str, list[Pod]], namespace: str,
                  address_of: Callable[[Pod, int], str]) -> str:
    """Rewrite each ``host:port`` of a list that names exactly one pod on one of its
    container ports; anything else is left as it is (and will fail as it would)."""
    out = []
    for entry, (host, port) in zip(value.split(","), split_addresses(value)):
        pods = resolve_name(host, records, namespace)
        if len(pods) == 1 and port in pods[0].ports:
            out.append(address_of(pods[0], port))
        else:
            out.append(entry.strip())
    return ",".join(out)


def hosts_file(pod: Pod, records: dict[str, list[Pod]]) -> str:
    """The pod's /etc/hosts: the kubelet's lines, then every name cluster DNS would answer
    for it, in all the forms its search path accepts (a hosts file has no search path)."""
    own = pod.meta.hostname
    if pod.meta.subdomain:
        own = f"{pod.meta.hostname}.{pod.meta.subdomain}.{pod.meta.namespace}.svc.{CLUSTER_DOMAIN} {own}"
    lines = ["# Kubernetes-managed hosts file (emulated by tests/deploy/pod_harness.py).",
             "127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
             f"{pod.meta.ip}\t{own}"]
    suffixes = search_domains(pod.meta.namespace)
    for fqdn, pods in sorted(records.items()):
        names = [fqdn]
        for suffix in suffixes:
            if fqdn.endswith("." + suffix):
                names.append(fqdn[:-len(suffix) - 1])
        for target in pods:
            lines.append(f"{target.meta.ip}\t" + " ".join(dict.fromkeys(names)))
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------
# Processes


@dataclass
class Proc:
    pod: Pod
    popen: subprocess.Popen
    stdout_path: Path
    stderr_path: Path
    #: (monotonic time of arrival, line) of stdout, read as it comes.
    lines: list[tuple[float, str]] = field(default_factory=list)
    reader: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stderr_tail(self, n: int = 25) -> str:
        try:
            return "".join(self.stderr_path.read_text(errors="replace").splitlines(True)[-n:])
        except OSError:
            return ""

    def json_lines(self) -> list[tuple[float, dict]]:
        out = []
        for t, line in list(self.lines):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.append((t, obj))
        return out

    def events(self, kind: str) -> list[tuple[float, dict]]:
        return [(t, o) for t, o in self.json_lines() if o.get("type") == kind]

    def describe(self) -> str:
        rc = self.popen.poll()
        state = "running" if rc is None else f"exited with code {rc}"
        return f"{self.pod.name} (pid {self.pid}, {state}); stderr:\n{self.stderr_tail()}"


def _die_with_parent() -> None:  # between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _setpriv_prefix(identity: Identity) -> list[str]:
    args = ["setpriv"]
    if identity.uid is not None:
        args.append(f"--reuid={identity.uid}")
    if identity.gid is not None:
        args.append(f"--regid={identity.gid}")
    if identity.groups:
        args.append("--groups=" + ",".join(str(g) for g in identity.groups))
    else:
        args.append("--clear-groups")
    if identity.no_new_privs:
        args.append("--no-new-privs")
    if identity.drop_all_caps:
        args += ["--inh-caps=-all", "--bounding-set=-all"]
    # The uid change clears a parent-death signal set before it: set it again, so that
    # a killed test run cannot leave pods running.
    return args + ["--pdeathsig=KILL", "--"]


_RUN_AS: dict[tuple, str | None] = {}


def run_as_problem(identity: Identity) -> str | None:
    """None when the process can run as the pod's user here; else why not (checked once)."""
    if identity.uid is None and identity.gid is None:
        return "the pod sets no runAsUser/runAsGroup"
    if os.geteuid() != 0:
        return "not root: cannot switch to the pod's user"
    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed"
    key = (identity.uid, identity.gid, tuple(identity.groups), identity.no_new_privs, identity.drop_all_caps)
    if key not in _RUN_AS:
        _RUN_AS[key] = _probe_run_as(identity)
    return _RUN_AS[key]


_INTERPRETER = "import json, sys; print(json.dumps([sys.version, sys.prefix, sys.base_prefix, sys.path]))"


def _probe_run_as(identity: Identity) -> str | None:
    """Can the pod's user run this very interpreter, the project and its console scripts?

    The interpreter must be the same one, seen the same way (an interpreter
    that cannot read its own installation may fall back to another standard
    library and still start: that is not the program under test)."""
    prefix = _setpriv_prefix(identity)
    who = f"uid {identity.uid}"
    expected = json.loads(subprocess.run([sys.executable, "-c", _INTERPRETER], capture_output=True, text=True,
                                         timeout=60, check=True, cwd="/").stdout)
    checks = [
        ([*prefix, sys.executable, "-c", _INTERPRETER], expected),
        ([*prefix, sys.executable, "-c", "import ps_server.ops.cli, ps_local.worker, sklearn.datasets"], None),
        ([*prefix, executable("ps-server"), "--help"], None),
        ([*prefix, executable("ps-worker"), "--help"], None),
    ]
    for argv, want in checks:
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd="/", check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"setpriv does not work here: {exc}"
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["?"])[-1]
            return f"{Path(argv[len(prefix)]).name} does not run as {who}: {last}"
        if want is not None and json.loads(proc.stdout) != want:
            return (f"{sys.executable} runs as {who} but cannot read its own installation "
                    f"(base prefix {json.loads(proc.stdout)[2]} instead of {want[2]})")
    return None


class Launcher:
    """Starts pods as processes and always stops them, by PID."""

    def __init__(self, run_as: bool = True) -> None:
        self.procs: list[Proc] = []
        self.run_as = run_as
        self.notes: list[str] = []

    def start(self, pod: Pod, wrap: list[str] | None = None) -> Proc:
        prefix: list[str] = []
        if self.run_as:
            problem = run_as_problem(pod.identity)
            if problem is None:
                prefix = _setpriv_prefix(pod.identity)
            else:
                note = f"the pods ran as uid {os.geteuid()}, not as their securityContext's user: {problem}"
                if note not in self.notes:
                    self.notes.append(note)
        argv = [*(wrap or []), *prefix, *pod.argv]
        out, err = pod.logdir / "stdout", pod.logdir / "stderr"
        with open(err, "wb") as err_f:
            # preexec_fn only calls prctl (async-signal-safe), as ps_local.processes does.
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err_f,
                                     env=pod.env, cwd=pod.cwd, preexec_fn=_die_with_parent)  # noqa: PLW1509
        proc = Proc(pod, popen, out, err)

        def read() -> None:
            assert popen.stdout is not None
            with open(out, "wb") as f:
                for raw in popen.stdout:
                    f.write(raw)
                    f.flush()
                    proc.lines.append((time.monotonic(), raw.decode(errors="replace").rstrip("\n")))

        proc.reader = threading.Thread(target=read, name=f"stdout-{pod.name}", daemon=True)
        proc.reader.start()
        self.procs.append(proc)
        return proc

    def run_as_pod_user(self, proc: Proc) -> bool:
        """Whether ``proc`` was started as its pod's user (False: see ``notes``)."""
        return self.run_as and run_as_problem(proc.pod.identity) is None

    def stop(self, proc: Proc, grace: float = 10.0) -> int | None:
        """SIGTERM, wait ``grace`` seconds, then SIGKILL; the exit code (None: it would not die)."""
        if proc.popen.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.popen.wait(grace)
            except subprocess.TimeoutExpired:
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    proc.popen.wait(5)
                except subprocess.TimeoutExpired:
                    return None
        if proc.reader is not None:
            proc.reader.join(5)
        return proc.popen.returncode

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc, grace=5.0)


def wait_exit(procs: list[Proc], timeout: float) -> None:
    """Wait until every process has exited; ContractError naming those still running."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    running = [p for p in procs if p.popen.poll() is None]
    if running:
        raise ContractError(f"still running after {timeout:.0f}s:\n"
                            + "\n".join(p.describe() for p in running))


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, procs: list[Proc],
             interval: float = 0.05) -> float:
    """Poll ``predicate``; ContractError when a process in ``procs`` dies first or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return time.monotonic()
        dead = [p for p in procs if p.popen.poll() is not None]
        if dead:
            raise ContractError(f"waiting for {what}: " + "\n".join(p.describe() for p in dead))
        if time.monotonic() > deadline:
            raise ContractError(f"{what}: not within {timeout:.0f}s\n"
                                + "\n".join(p.describe() for p in procs))
        time.sleep(interval)


# --------------------------------------------------------------------------
# Probes and checks


def credentials(pid: int) -> tuple[int, int, set[int]]:
    """(uid, gid, supplementary groups) of a running process."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.split()
    return int(fields["Uid"][0]), int(fields["Gid"][0]), {int(g) for g in fields.get("Groups", [])}


def identity_problems(proc: Proc) -> list[str]:
    """The process runs as the pod's securityContext says (runAsUser, runAsGroup, fsGroup)."""
    ident = proc.pod.identity
    uid, gid, groups = credentials(proc.pid)
    problems = []
    if ident.uid is not None and uid != ident.uid:
        problems.append(f"{proc.pod.name}: runs as uid {uid}, not runAsUser {ident.uid}")
    if ident.gid is not None and gid != ident.gid:
        problems.append(f"{proc.pod.name}: runs as gid {gid}, not runAsGroup {ident.gid}")
    missing = set(ident.groups) - groups - {gid}
    if missing:
        problems.append(f"{proc.pod.name}: lacks supplementary groups {sorted(missing)}")
    return problems


def grpc_health(address: str, service: str, timeout: float = 1.0) -> str:
    """The gRPC health status of ``service`` at ``address`` (plaintext, as kubelet asks)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return f"error: {exc.code().name}"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def probe_address(proc: Proc, probe: dict) -> str:
    port = proc.pod.container_port(probe["grpc"]["port"])
    if port not in proc.pod.ports:
        raise ContractError(f"{proc.pod.name}: probe port {port} is not a container port "
                            f"({sorted(proc.pod.ports)})")
    host = proc.pod.meta.ip
    return f"{host}:{proc.pod.ports.get(port, port)}"


def wait_ready(procs: list[Proc], timeout: float) -> None:
    """Every pod's readinessProbe (gRPC, as kubelet runs it) answers SERVING."""
    for proc in procs:
        probe = proc.pod.container.get("readinessProbe") or {}
        if "grpc" not in probe:
            raise HarnessError(f"{proc.pod.name}: only gRPC readiness probes are emulated")
        address, service = probe_address(proc, probe), probe["grpc"].get("service", "")
        last: list[str] = []

        def serving(address: str = address, service: str = service, last: list[str] = last) -> bool:
            last[:] = [grpc_health(address, service)]
            return last[0] == "SERVING"

        try:
            wait_for(serving, timeout, f"readiness of {proc.pod.name} at {address} ({service!r})",
                     [proc], 0.1)
        except ContractError as exc:
            raise ContractError(f"{exc}\nlast probe answer: {last}") from None


def probe_problems(proc: Proc) -> list[str]:
    """Every gRPC probe of the container answers SERVING now (the pod is ready)."""
    problems = []
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = proc.pod.container.get(kind)
        if probe and "grpc" in probe:
            answer = grpc_health(probe_address(proc, probe), probe["grpc"].get("service", ""))
            if answer != "SERVING":
                problems.append(f"{proc.pod.name} {kind}: {answer}")
    return problems


def scrape(proc: Proc, ca_file: str, server_name: str, timeout: float = 5.0, *,
           client_cert: str | None = None, client_key: str | None = None,
           token_file: str | None = None) -> dict[str, float]:
    """Scrape the pod as Prometheus would from its ``prometheus.io/*`` annotations
    (pod IP, annotated port, annotated scheme; TLS verified with ``ca_file`` under
    ``server_name``), presenting ``client_cert``/``client_key`` and the bearer token
    in ``token_file`` as a scrape config's ``tls_config.cert_file``/``key_file`` and
    ``authorization.credentials_file`` do. Returns {sample name with labels: value}."""
    import socket
    import ssl

    annotations = proc.pod.meta.annotations
    if annotations.get("prometheus.io/scrape") != "true":
        raise ContractError(f"{proc.pod.name}: not annotated prometheus.io/scrape: \"true\"")
    port = int(annotations.get("prometheus.io/port", "0"))
    if port not in proc.pod.ports:
        raise ContractError(f"{proc.pod.name}: prometheus.io/port {port} is not a container port")
    scheme = annotations.get("prometheus.io/scheme", "http")
    path = annotations.get("prometheus.io/path", "/metrics")
    host, real_port = proc.pod.meta.ip, proc.pod.ports[port]
    url = f"{scheme}://{host}:{real_port}{path}"
    try:
        with socket.create_connection((host, real_port), timeout) as raw:
            sock = raw
            if scheme == "https":
                # Verified under server_name, as a scrape config's tls_config.server_name does.
                context = ssl.create_default_context(cafile=ca_file)
                if client_cert and client_key:
                    context.load_cert_chain(client_cert, client_key)
                sock = context.wrap_socket(raw, server_hostname=server_name)
            authorization = ""
            if token_file:
                with open(token_file) as f:
                    authorization = f"Authorization: Bearer {f.read().strip()}\r\n"
            sock.sendall(f"GET {path} HTTP/1.0\r\nHost: {host}:{real_port}\r\n{authorization}\r\n".encode())
            chunks = []
            while True:
                data = sock.recv(65536)
                if not data:
                    break
                chunks.append(data)
    except (OSError, ssl.SSLError) as exc:
        raise ContractError(f"{proc.pod.name}: scraping {url} failed: {exc}") from None
    head, _, body = b"".join(chunks).decode(errors="replace").partition("\r\n\r\n")
    status = head.split(" ", 2)[1] if head.count(" ") >= 1 else "?"
    if status != "200":
        raise ContractError(f"{proc.pod.name}: scraping {url} answered {head.splitlines()[:1]}")
    samples = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                samples[name] = float(value)
            except ValueError:
                pass
    return samples


def checkpoint_problems(pod: Pod, mount_path: str) -> list[str]:
    """The server's checkpoint volume holds an intact checkpoint of its shard (its ordinal)."""
    from ps_server.durability.format import CheckpointError, read_manifest

    root = pod.mount(mount_path)
    manifests = sorted(root.glob(f"shard-{pod.meta.index}-of-*/*/manifest.json"))
    if not manifests:
        listing = sorted(str(p.relative_to(root)) for p in root.rglob("*"))[:10]
        return [(f"{pod.name}: no checkpoint of shard {pod.meta.index} in its volume {mount_path} ({root}); "
                 f"it holds {listing}")]
    try:
        read_manifest(manifests[-1].parent)
    except CheckpointError as exc:
        return [f"{pod.name}: the checkpoint on its volume is damaged: {exc}"]
    return []


# --------------------------------------------------------------------------
# Separate network hosts: one network namespace per pod


class NetworkUnavailable(RuntimeError):
    """Network namespaces, veths or bridges cannot be made here (the caller skips)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=15, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def _used_networks() -> list[ipaddress.IPv4Network]:
    nets = []
    for line in _ip("-4", "-o", "addr", "show", check=False).stdout.splitlines():
        m = re.search(r"inet (\S+)", line)
        if m:
            nets.append(ipaddress.ip_interface(m.group(1)).network)
    for line in _ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        first = line.split()[0] if line.split() else ""
        if first in ("default", "broadcast", "local", "unreachable", "blackhole", "prohibit", "throw"):
            parts = line.split()
            first = parts[1] if len(parts) > 1 and first != "default" else ""
        try:
            nets.append(ipaddress.ip_network(first, strict=False))
        except ValueError:
            pass
    return nets


class PodNetwork:
    """A bridge with one network namespace per pod, each on a veth pair.

    Names carry a random token, the subnet is a random free 10.x.y.0/24, so
    runs in parallel do not collide. The host gets ``.1`` on the bridge
    (it stands for the node: kubelet's probes and our evaluation client come
    from there); pods get ``.10`` and up. ``close()`` deletes everything.
    """

    def __init__(self) -> None:
        self.token = _secrets.token_hex(3)
        self.bridge = f"wp{self.token}br"
        self.namespaces: dict[str, str] = {}  # pod key -> netns
        self.host_veths: dict[str, str] = {}
        self.ips: dict[str, str] = {}
        self.etc_dirs: list[Path] = []
        self.made_etc_netns = not Path("/etc/netns").exists()
        self.closed = False
        used = _used_networks()
        for _ in range(50):
            net = ipaddress.ip_network(f"10.{random.randint(64, 254)}.{random.randint(0, 255)}.0/24")
            if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
                break
        else:
            raise NetworkUnavailable("no free 10.x.y.0/24 subnet")
        self.network = net
        hosts = list(net.hosts())
        self.gateway = str(hosts[0])
        self._next = iter(hosts[9:])
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
        except RuntimeError as exc:
            raise NetworkUnavailable(f"cannot create a bridge: {exc}") from None
        try:
            _ip("addr", "add", f"{self.gateway}/{net.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except RuntimeError as exc:
            self.close()
            raise NetworkUnavailable(str(exc)) from None

    def add(self, key: str) -> tuple[str, str]:
        """A namespace for pod ``key`` on the bridge: (netns name, its address)."""
        k = len(self.namespaces)
        ns = f"wehub-{self.token}-{key}"
        host_veth, pod_veth = f"wp{self.token}h{k}", f"wp{self.token}p{k}"
        try:
            _ip("netns", "add", ns)
        except RuntimeError as exc:
            raise NetworkUnavailable(f"cannot create a network namespace: {exc}") from None
        self.namespaces[key] = ns
        ip = str(next(self._next))
        _ip("link", "add", host_veth, "type", "veth", "peer", "name", pod_veth)
        self.host_veths[key] = host_veth
        _ip("link", "set", pod_veth, "netns", ns)
        _ip("-n", ns, "link", "set", pod_veth, "name", "eth0")
        _ip("link", "set", host_veth, "master", self.bridge)
        _ip("link", "set", host_veth, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{ip}/{self.network.prefixlen}", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "route", "add", "default", "via", self.gateway)
        self.ips[key] = ip
        return ns, ip

    def write_etc(self, key: str, hosts: str, namespace: str) -> None:
        """/etc/netns/<ns>/hosts and resolv.conf (Kubernetes' search path; the
        nameserver is the bridge address, where nothing answers: a name the
        hosts file does not know does not resolve)."""
        directory = Path("/etc/netns") / self.namespaces[key]
        directory.mkdir(parents=True, exist_ok=False)
        self.etc_dirs.append(directory)
        (directory / "hosts").write_text(hosts)
        (directory / "resolv.conf").write_text(
            f"search {' '.join(search_domains(namespace))}\nnameserver {self.gateway}\n"
            "options ndots:5 timeout:1 attempts:1\n")
        for name in ("hosts", "resolv.conf"):
            os.chmod(directory / name, 0o644)

    def exec_prefix(self, key: str, hostname: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[key], "unshare", "--uts", "--",
                "sh", "-c", 'hostname "$0"; exec "$@"', hostname]

    def cut(self, key: str) -> None:
        _ip("link", "set", self.host_veths[key], "down")

    def reconnect(self, key: str) -> None:
        _ip("link", "set", self.host_veths[key], "up")

    def close(self) -> list[str]:
        """Delete namespaces, veths, the bridge and /etc/netns dirs; returns what failed."""
        problems = []
        for ns in self.namespaces.values():
            r = _ip("netns", "del", ns, check=False)
            if r.returncode != 0:
                problems.append(f"ip netns del {ns}: {r.stderr.strip()}")
        for veth in self.host_veths.values():
            _ip("link", "del", veth, check=False)  # gone with its namespace's peer
        r = _ip("link", "del", self.bridge, check=False)
        if r.returncode != 0 and "Cannot find" not in r.stderr:
            problems.append(f"ip link del {self.bridge}: {r.stderr.strip()}")
        for directory in self.etc_dirs:
            shutil.rmtree(directory, ignore_errors=True)
        if self.made_etc_netns:
            try:
                Path("/etc/netns").rmdir()  # only if empty: another run may be using it
            except OSError:
                pass
        self.closed = True
        return problems

    def leftovers(self) -> list[str]:
        names = _ip("-o", "link", "show", check=False).stdout
        found = [n for n in [self.bridge, *self.host_veths.values()]
                 if f" {n}:" in names or f" {n}@" in names]
        netns = _ip("netns", "list", check=False).stdout
        found += [ns for ns in self.namespaces.values() if ns in netns]
        found += [str(d) for d in self.etc_dirs if d.exists()]
        return found


def work_dir() -> Path:
    """A scratch directory other users can traverse (the pods may run as uid 10001)."""
    path = Path(tempfile.mkdtemp(prefix="wehub-contract-"))
    os.chmod(path, 0o755)
    return path
