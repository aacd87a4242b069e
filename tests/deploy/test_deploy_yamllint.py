"""yamllint, with the repository's .yamllint, over deploy/ and .ci/."""

from __future__ import annotations

from pathlib import Path

import pytest
from deploy_tools.availability import require

require("yaml", "PyYAML")
require("yamllint", "yamllint")

from yamllint import linter  # noqa: E402
from yamllint.config import YamlLintConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CONFIG_FILE = REPO / ".yamllint"
LINTED_DIRS = ("deploy", ".ci")


def config() -> YamlLintConfig:
    return YamlLintConfig(file=str(CONFIG_FILE))


def yaml_files(conf: YamlLintConfig) -> list[Path]:
    files = [CONFIG_FILE]
    for top in LINTED_DIRS:
        for path in sorted((REPO / top).rglob("*")):
            rel = path.relative_to(REPO).as_posix()
            if path.is_file() and conf.is_yaml_file(rel) and not conf.is_file_ignored(rel):
                files.append(path)
    return files


def lint_problems(text: str, conf: YamlLintConfig, name: str = "<text>") -> list[str]:
    return [f"{name}:{p.line}:{p.column}: {p.desc} ({p.rule})"
            for p in linter.run(text, conf, name)
            if p.level in ("error", "warning")]


def test_yaml_files_are_found():
    files = {p.relative_to(REPO).as_posix() for p in yaml_files(config())}
    assert "deploy/base/kustomization.yaml" in files
    assert "deploy/jobset/jobset.yaml" in files
    assert not any(f.startswith("deploy/base/secrets/") for f in files)


@pytest.mark.parametrize("path", yaml_files(config()) if CONFIG_FILE.is_file() else [],
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_yamllint(path):
    conf = config()
    assert lint_problems(path.read_text(), conf, path.relative_to(REPO).as_posix()) == []


# --- the check can fail ----------------------------------------------------


def test_yamllint_reports_broken_yaml():
    conf = config()
    text = ("apiVersion: v1\nkind: ConfigMap\nmetadata:\n   name: x\n  namespace: y\n"
            "data:\n  a: yes\n  a: no\n  long: " + "x" * 130 + "\n")
    problems = lint_problems(text, conf)
    rules = {p.rsplit("(", 1)[1].rstrip(")") for p in problems}
    assert {"indentation", "truthy", "key-duplicates", "line-length"} <= rules, problems


def test_yamllint_reports_an_implicit_octal_mode():
    # defaultMode: 0440 is 288 to YAML 1.1 and 440 to YAML 1.2 (kustomize).
    problems = lint_problems("volumes:\n  - secret:\n      defaultMode: 0440\n", config())
    assert any("octal" in p for p in problems), problems
