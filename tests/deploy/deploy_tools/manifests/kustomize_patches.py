"""Every kustomize patch must match an object it patches, and no kustomization may use
a field kustomize has deprecated."""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

import yaml

from .kustomize import RenderError, render


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

    # A generated ConfigMap or Secret carries its content hash; kustomize matches its name without it.
    name = str(meta.get("name") or "")
    if obj.get("kind") in ("ConfigMap", "Secret"):
        name = re.sub(r"-[a-z0-9]{10}$", "", name) if not regex(name, target.get("name")) else name
    return (regex(group, target.get("group")) and regex(version, target.get("version"))
            and regex(obj.get("kind"), target.get("kind")) and regex(name, target.get("name"))
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
        # A Component renders only inside a kustomization that includes it: the target it is checked on.
        build = kdir
        if kust.get("kind") == "Component":
            from .kustomize import COMPONENTS, with_components

            build = with_components(root, COMPONENTS[rel], [rel], "patch-check")
        for i, patch in enumerate(patches):
            targets, errors = patch_targets(patch, kdir)
            problems += [f"{rel}: patches[{i}]: {e}" for e in errors]
            reduced = dict(kust)
            reduced["patches"] = [p for j, p in enumerate(patches) if j != i]
            if not reduced["patches"]:
                del reduced["patches"]
            kfile.write_text(yaml.safe_dump(reduced, sort_keys=False))
            try:
                objects = render(kubectl, build).objects
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
