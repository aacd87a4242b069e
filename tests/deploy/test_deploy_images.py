"""The Dockerfiles: multi-stage, wheel built in the builder, non-root
runtime, exec-form default command, build args documented, build context
filtered (no generated secrets in it). checkov's Dockerfile checks run in
test_deploy_checkov.py; no Docker engine is needed here."""

from __future__ import annotations

import pytest
from deploy_tools.availability import require

require("yaml", "PyYAML")

from deploy_tools.manifests.dockerfiles import (  # noqa: E402
    dockerfile_instructions,
    dockerfile_problems,
    dockerignore_problems,
)
from deploy_tools.manifests.kustomize import DEPLOY  # noqa: E402

IMAGES = {
    "Dockerfile": dict(base_pattern=r"python:\$\{PYTHON_VERSION\}-slim\b", default_cmd=["ps-server"],
                       required_args=("PYTHON_VERSION", "EXTRAS"), extras_must_include=("examples",)),
    "Dockerfile.gpu": dict(base_pattern=r"nvidia/cuda:\$\{CUDA_VERSION\}-runtime-", default_cmd=["ps-worker"],
                           required_args=("PYTHON_VERSION", "EXTRAS", "CUDA_VERSION"),
                           extras_must_include=("gpu",)),
}


@pytest.mark.parametrize("name", IMAGES)
def test_dockerfile(name):
    assert dockerfile_problems((DEPLOY / name).read_text(), **IMAGES[name]) == []


def test_gpu_image_is_cuda_12():
    _, instructions = dockerfile_instructions((DEPLOY / "Dockerfile.gpu").read_text())
    args = dict(ins.args.split("=", 1) for ins in instructions if ins.keyword == "ARG" and "=" in ins.args)
    assert args["CUDA_VERSION"].startswith("12."), args


@pytest.mark.parametrize("name", IMAGES)
def test_build_context_is_filtered(name):
    # BuildKit reads <Dockerfile>.dockerignore next to the Dockerfile.
    ignore = DEPLOY / f"{name}.dockerignore"
    assert ignore.is_file(), f"{ignore} is missing"
    assert dockerignore_problems(ignore.read_text()) == []


# --- the check can fail ----------------------------------------------------

GOOD = (DEPLOY / "Dockerfile").read_text()


@pytest.mark.parametrize("old, new, expected", [
    ("USER 10001", "USER root", "must end as USER 10001"),
    ('CMD ["ps-server"]', "CMD ps-server", "CMD in shell form"),
    ("ENTRYPOINT []", 'ENTRYPOINT ["/bin/sh", "-c"]', "ENTRYPOINT []"),
    ("#   EXTRAS ", "#   EXTRA_PACKAGES ", "EXTRAS is not documented"),
    ("ARG EXTRAS=examples", "ARG EXTRAS=bench", "does not include 'examples'"),
    ("RUN pip wheel --no-deps -w /dist .", "RUN pip wheel -w /dist .", "pip wheel --no-deps"),
    ("FROM python:${PYTHON_VERSION}-slim AS runtime", "FROM python:latest AS runtime", "no fixed tag"),
    ("--uid 10001", "--uid 1000", "no user with uid 10001"),
])
def test_dockerfile_check_reports_a_broken_copy(old, new, expected):
    assert old in GOOD
    problems = dockerfile_problems(GOOD.replace(old, new, 1), **IMAGES["Dockerfile"])
    assert any(expected in p for p in problems), problems


def test_dockerfile_check_reports_a_single_stage_build():
    single = "\n".join(line for line in GOOD.splitlines()
                       if not line.startswith("FROM python:${PYTHON_VERSION}-slim AS builder"))
    problems = dockerfile_problems(single, **IMAGES["Dockerfile"])
    assert any("multi-stage" in p for p in problems), problems


def test_dockerignore_check_reports_a_context_with_secrets():
    text = (DEPLOY / "Dockerfile.dockerignore").read_text().replace("\ndeploy\n", "\n")
    assert dockerignore_problems(text) == ["the build context filter does not exclude deploy/"]
