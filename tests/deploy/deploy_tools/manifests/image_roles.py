"""Which image each pod runs: ps-servers the slim server image (no extras),
workers an image with the examples extra (ps-worker's examples load
scikit-learn), and only images that a target of deploy/Dockerfile or
deploy/Dockerfile.gpu builds."""

from __future__ import annotations

from pathlib import Path

from .dockerfiles import Installs, target_installs
from .pod_templates import command_of, is_ps_server, is_ps_worker, pod_units, resolve_env

#: The image names the manifests use, each built by one target of one Dockerfile
#: (the table in each Dockerfile's header says the same).
IMAGE_TARGETS = {
    "wehub-ps": ("Dockerfile", "server"),
    "wehub-ps-worker": ("Dockerfile", "worker"),
    "wehub-ps-worker-torch": ("Dockerfile", "worker-torch"),
    "wehub-ps-gpu": ("Dockerfile.gpu", "worker"),
    "wehub-ps-gpu-torch": ("Dockerfile.gpu", "worker-torch"),
}


def image_name(image: str) -> str:
    """The repository's last path component: registry.example.com/wehub-ps:0.1.0 -> wehub-ps."""
    without_digest = image.split("@", 1)[0]
    last = without_digest.rsplit("/", 1)[-1]
    return last.split(":", 1)[0]


def _example_of(container: dict, objects: list[dict], namespace: str | None) -> str:
    """The example a ps-worker runs: --example, else PS_EXAMPLE, else its default (digits)."""
    argv = command_of(container)
    for i, word in enumerate(argv):
        if word == "--example" and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith("--example="):
            return word.split("=", 1)[1]
    return str(resolve_env(container, objects, namespace).get("PS_EXAMPLE") or "digits")


def image_role_problems(objects: list[dict], deploy_dir: Path) -> list[str]:
    problems = []
    installs: dict[str, Installs] = {}
    for unit in pod_units(objects):
        for container in unit.containers():
            server, worker = is_ps_server(container), is_ps_worker(container)
            if not (server or worker):
                continue
            where = f"{unit.where}: container {container.get('name')}"
            name = image_name(str(container.get("image", "")))
            if name not in IMAGE_TARGETS:
                problems.append(f"{where}: image {container.get('image')!r} is not one deploy/Dockerfile* "
                                f"builds ({', '.join(IMAGE_TARGETS)})")
                continue
            dockerfile, target = IMAGE_TARGETS[name]
            if name not in installs:
                installs[name] = target_installs((deploy_dir / dockerfile).read_text(), target)
            carried = installs[name]
            if server and (carried.extras or carried.packages):
                problems.append(f"{where}: runs ps-server from {name}, which carries "
                                f"{sorted(carried.extras | carried.packages)}: use the server image wehub-ps")
            if worker:
                example = _example_of(container, objects, unit.namespace)
                needed = {"examples", "torch"} if example.startswith("torch") else {"examples"}
                for extra in sorted(needed - carried.extras):
                    problems.append(f"{where}: runs ps-worker (example {example}) from {name}, which lacks "
                                    f"the {extra} extra")
    return problems
