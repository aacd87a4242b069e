"""A pod's volumes as local directories: Secret and ConfigMap files written as the kubelet
writes them, claims and emptyDirs as empty directories, paths rewritten to them; and the
user the container runs as."""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import ContractError, HarnessError
from .pod_environment import PodMeta


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
