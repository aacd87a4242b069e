"""The Dockerfiles: multi-stage, wheel built in the builder, one build target per
image (a slim server with no extras as the default, workers with the examples
and torch extras), non-root runtime, exec-form default commands, build args
documented, build context filtered (no generated secrets in it). checkov's
Dockerfile checks run in test_deploy_checkov.py; no container engine is
needed here (deploy/README.md, "Images", says how they were built and
measured)."""

from __future__ import annotations

import re

import pytest
from deploy_tools.availability import require

require("yaml", "PyYAML")

from deploy_tools.manifests.dockerfiles import (  # noqa: E402
    Target,
    dockerfile_problems,
    dockerfile_stages,
    dockerignore_problems,
    target_installs,
)
from deploy_tools.manifests.image_roles import IMAGE_TARGETS, image_name, image_role_problems  # noqa: E402
from deploy_tools.manifests.kustomize import DEPLOY, RENDER_TARGETS  # noqa: E402

SERVER = ("ps-server",)
WORKER = ("ps-worker",)

IMAGES = {
    "Dockerfile": {
        "base_pattern": r"python:\$\{PYTHON_VERSION\}-slim\b", "default_target": "server",
        "required_args": ("PYTHON_VERSION", "EXTRAS", "TORCH_VERSION", "TORCH_INDEX_URL"),
        "targets": {"server": Target(SERVER),
                    "worker": Target(WORKER, frozenset({"examples"})),
                    "worker-torch": Target(WORKER, frozenset({"examples", "torch"}), frozenset({"torch"}))}},
    "Dockerfile.gpu": {
        "base_pattern": r"nvidia/cuda:\$\{CUDA_VERSION\}-runtime-", "default_target": "worker",
        "required_args": ("PYTHON_VERSION", "EXTRAS", "CUDA_VERSION", "TORCH_VERSION", "TORCH_INDEX_URL"),
        "targets": {"worker": Target(WORKER, frozenset({"gpu", "examples"})),
                    "worker-torch": Target(WORKER, frozenset({"gpu", "examples", "torch"}),
                                           frozenset({"torch"}))}},
}


def _args(name: str) -> dict[str, str]:
    global_args, stages = dockerfile_stages((DEPLOY / name).read_text())
    args = dict(global_args)
    for stage in stages:
        args.update(stage.arg_defaults())
    return args


@pytest.mark.parametrize("name", IMAGES)
def test_dockerfile(name):
    assert dockerfile_problems((DEPLOY / name).read_text(), **IMAGES[name]) == []


def test_server_image_installs_no_extras_and_the_worker_images_do():
    text = (DEPLOY / "Dockerfile").read_text()
    server = target_installs(text, "server")
    assert (server.extras, server.packages) == (frozenset(), frozenset())
    assert target_installs(text, "worker").extras == {"examples"}
    torch = target_installs(text, "worker-torch")
    assert torch.extras == {"examples", "torch"} and torch.packages == {"torch"}


def test_torch_images_take_the_cpu_build_on_cpu_and_the_tested_release():
    assert _args("Dockerfile")["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert _args("Dockerfile.gpu")["TORCH_INDEX_URL"] == "https://pypi.org/simple"
    # The pin in pyproject.toml's dev extra (tomllib is 3.11+; the project supports 3.10).
    tested = re.findall(r'^\s*"(torch==[^"]+)"', (DEPLOY.parent / "pyproject.toml").read_text(), re.MULTILINE)
    assert len(tested) == 1, tested
    for name in IMAGES:
        assert f"torch=={_args(name)['TORCH_VERSION']}" == tested[0], name


def test_gpu_image_is_cuda_12():
    assert _args("Dockerfile.gpu")["CUDA_VERSION"].startswith("12.")


def test_every_image_the_manifests_may_name_is_a_target():
    for image, (dockerfile, target) in IMAGE_TARGETS.items():
        assert target in IMAGES[dockerfile]["targets"], image
        header = (DEPLOY / dockerfile).read_text()
        assert re.search(rf"^#\s+{re.escape(target)}\s+{re.escape(image)}\s", header, re.MULTILINE), (image, target)


@pytest.mark.parametrize("target", RENDER_TARGETS)
def test_servers_run_the_server_image_and_workers_a_worker_image(renders, target):
    assert image_role_problems(renders[target].objects, DEPLOY) == []


def test_each_render_names_the_images_it_should(renders):
    """The renders say it directly, independently of the check."""
    def images(target):
        return sorted({image_name(c["image"]) for o in renders[target].objects
                       for c in _containers(o) if image_name(c["image"]) != "etcd"})

    for target in ("overlays/cpu", "overlays/replicated", "jobset", "tfjob"):
        assert images(target) == ["wehub-ps", "wehub-ps-worker"], target
    assert images("overlays/gpu") == ["wehub-ps", "wehub-ps-gpu"]


def _containers(obj):
    """Containers anywhere below an object (pod templates of workloads and custom resources)."""
    if isinstance(obj, dict):
        if isinstance(obj.get("containers"), list):
            yield from obj["containers"]
        for value in obj.values():
            yield from _containers(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _containers(value)


@pytest.mark.parametrize("swap, expected", [
    (("wehub-ps-worker:", "wehub-ps:"),
     "runs ps-worker (example digits) from wehub-ps, which lacks the examples extra"),
    (("/wehub-ps:", "/wehub-ps-worker:"), "runs ps-server from wehub-ps-worker, which carries ['examples']"),
    (("wehub-ps-worker:", "wehub-ps-trainer:"), "image 'wehub-ps-trainer:0.1.0' is not one"),
])
def test_image_check_reports_a_swapped_image(renders, swap, expected):
    import copy

    objects = copy.deepcopy(renders["overlays/cpu"].objects)
    for obj in objects:
        for container in _containers(obj):
            container["image"] = ("/" + container["image"]).replace(*swap).lstrip("/")
    problems = image_role_problems(objects, DEPLOY)
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize("name", IMAGES)
def test_build_context_is_filtered(name):
    # BuildKit reads <Dockerfile>.dockerignore next to the Dockerfile.
    ignore = DEPLOY / f"{name}.dockerignore"
    assert ignore.is_file(), f"{ignore} is missing"
    assert dockerignore_problems(ignore.read_text()) == []


# --- the check can fail ----------------------------------------------------

GOOD = (DEPLOY / "Dockerfile").read_text()
SERVER_STAGE = GOOD[GOOD.index("FROM core AS server"):]


@pytest.mark.parametrize("old, new, expected", [
    ("USER 10001\nENTRYPOINT []\nCMD [\"ps-server\"]", "USER root\nENTRYPOINT []\nCMD [\"ps-server\"]",
     "target server: must end as USER 10001"),
    ('CMD ["ps-server"]', "CMD ps-server", "CMD in shell form"),
    ('ENTRYPOINT []\nCMD ["ps-server"]', 'ENTRYPOINT ["/bin/sh", "-c"]\nCMD ["ps-server"]',
     "target server: must reset ENTRYPOINT []"),
    ('CMD ["ps-server"]', 'CMD ["ps-worker"]', 'target server: CMD must be the exec form ["ps-server"]'),
    ("#   EXTRAS ", "#   EXTRA_PACKAGES ", "EXTRAS is not documented"),
    ("ARG EXTRAS=examples", "ARG EXTRAS=bench",
     "target worker: installs wehub-ps[bench], expected wehub-ps[examples]"),
    ("--constraint /tmp/wehub-ps.constraints wehub-ps \\",
     '--constraint /tmp/wehub-ps.constraints "wehub-ps[examples]" \\',
     "target server: installs wehub-ps[examples], expected wehub-ps[]"),
    ("&& pip check \\\n    && rm -rf /dist", "&& pip install scikit-learn && pip check \\\n    && rm -rf /dist",
     "target server: installs scikit-learn besides wehub-ps"),
    ('"torch==${TORCH_VERSION}"', '"numpy"', "target worker-torch: does not install torch"),
    ("RUN pip wheel --no-deps -w /dist .", "RUN pip wheel -w /dist .", "pip wheel --no-deps"),
    ("FROM python:${PYTHON_VERSION}-slim AS core", "FROM python:latest AS core", "no fixed tag"),
    ("FROM core AS server", "FROM builder AS server", "target server: is built on the builder stage"),
    ("--uid 10001", "--uid 1000", "creates no user with uid 10001"),
    ("#   worker-torch ", "#   torch-worker ", "target worker-torch: not documented"),
])
def test_dockerfile_check_reports_a_broken_copy(old, new, expected):
    assert old in GOOD
    problems = dockerfile_problems(GOOD.replace(old, new, 1), **IMAGES["Dockerfile"])
    assert any(expected in p for p in problems), problems


def test_dockerfile_check_reports_a_worker_as_the_default_target():
    # The server stage moved up: a build without --target would make the worker.
    text = GOOD.replace(SERVER_STAGE, "")
    text = text.replace("FROM worker-deps AS worker-torch", SERVER_STAGE + "\nFROM worker-deps AS worker-torch")
    problems = dockerfile_problems(text, **IMAGES["Dockerfile"])
    assert problems == ["the last stage (what a build without --target makes) is 'worker', not 'server'"]


def test_dockerfile_check_reports_a_single_stage_build():
    single = "\n".join(line for line in GOOD.splitlines()
                       if not line.startswith("FROM python:${PYTHON_VERSION}-slim AS builder"))
    problems = dockerfile_problems(single, **IMAGES["Dockerfile"])
    assert any("the first stage is not named `builder`" in p for p in problems), problems


def test_dockerignore_check_reports_a_context_with_secrets():
    text = (DEPLOY / "Dockerfile.dockerignore").read_text().replace("\ndeploy\n", "\n")
    assert dockerignore_problems(text) == ["the build context filter does not exclude deploy/"]
