"""Checks of the image recipes under deploy/: the Dockerfiles' base images, build
stages, default command and arguments, and the build context filter."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


def dockerfile_instructions(text: str) -> tuple[list[str], list[Instruction]]:
    """(header comment lines, instructions) with continuation lines joined."""
    header: list[str] = []
    instructions: list[Instruction] = []
    lines = text.splitlines()
    in_header = True
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            if in_header and stripped.startswith("#"):
                header.append(stripped.lstrip("#").strip())
            i += 1
            continue
        in_header = False
        start = i
        joined = stripped
        while joined.endswith("\\") and i + 1 < len(lines):
            i += 1
            nxt = lines[i].strip()
            if nxt.startswith("#"):
                continue
            joined = joined[:-1].rstrip() + " " + nxt
        keyword, _, args = joined.partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip(), start + 1))
        i += 1
    return header, instructions


def _exec_form(args: str) -> list[str] | None:
    try:
        value = json.loads(args)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


def dockerfile_problems(text: str, *, base_pattern: str, default_cmd: list[str], required_args: Iterable[str],
                        extras_must_include: Iterable[str]) -> list[str]:
    problems = []
    header, instructions = dockerfile_instructions(text)
    froms = [ins for ins in instructions if ins.keyword == "FROM"]
    if len(froms) < 2:
        problems.append("not a multi-stage build (a builder stage and a runtime stage)")
    builder = froms[0] if froms else None
    if builder and not re.search(r"\bAS\s+builder\b", builder.args, re.I):
        problems.append("the first stage is not named `builder`")
    if builder and not re.match(r"python:\$\{PYTHON_VERSION\}-slim\b", builder.args):
        problems.append(f"the builder stage should be python:${{PYTHON_VERSION}}-slim, got {builder.args!r}")
    if froms and not re.match(base_pattern, froms[-1].args):
        problems.append(f"runtime base {froms[-1].args!r} does not match {base_pattern!r}")
    for ins in froms:
        if re.search(r":latest\b", ins.args) or ("${" not in ins.args and ":" not in ins.args.split()[0]):
            problems.append(f"line {ins.line}: FROM {ins.args} has no fixed tag")
    runs_in_builder = []
    if froms:
        builder_end = froms[1].line if len(froms) > 1 else 10**9
        runs_in_builder = [ins.args for ins in instructions
                           if ins.keyword == "RUN" and froms[0].line < ins.line < builder_end]
    if not any(re.search(r"pip wheel --no-deps -w /dist \.(\s|$)", r) for r in runs_in_builder):
        problems.append("the builder does not run `pip wheel --no-deps -w /dist .`")
    args = {}
    for ins in instructions:
        if ins.keyword == "ARG":
            name, _, default = ins.args.partition("=")
            args[name.strip()] = default.strip().strip('"')
    for name in set(args) | set(required_args):
        if name not in args:
            problems.append(f"build arg {name} is not declared")
        # documented: a header comment line that starts with the name and says something
        if not any(re.match(rf"{re.escape(name)}\s+\S", line) for line in header):
            problems.append(f"build arg {name} is not documented in the header comment")
    extras = args.get("EXTRAS", "")
    for extra in extras_must_include:
        if extra not in [e.strip() for e in extras.split(",")]:
            problems.append(f"EXTRAS default {extras!r} does not include {extra!r}")
    final_start = froms[-1].line if froms else 0
    final = [ins for ins in instructions if ins.line > final_start]
    users = [ins for ins in final if ins.keyword == "USER"]
    if not users or users[-1].args not in ("10001", "10001:10001"):
        problems.append(f"the runtime stage must end as USER 10001, got {users[-1].args if users else None!r}")
    if not any(ins.keyword == "RUN" and re.search(r"useradd\b.*--uid 10001\b", ins.args) for ins in final):
        problems.append("the runtime stage creates no user with uid 10001")
    entrypoints = [ins for ins in final if ins.keyword == "ENTRYPOINT"]
    if not entrypoints or _exec_form(entrypoints[-1].args) != []:
        problems.append("the runtime stage must reset ENTRYPOINT []")
    cmds = [ins for ins in final if ins.keyword == "CMD"]
    if not cmds or _exec_form(cmds[-1].args) != default_cmd:
        problems.append(f"CMD must be the exec form {json.dumps(default_cmd)}, got "
                        f"{cmds[-1].args if cmds else None!r}")
    for ins in instructions:
        if ins.keyword in ("CMD", "ENTRYPOINT") and _exec_form(ins.args) is None:
            problems.append(f"line {ins.line}: {ins.keyword} in shell form")
        if ins.keyword in ("CMD", "ENTRYPOINT") and re.search(r'"(/bin/)?(ba)?sh"', ins.args):
            problems.append(f"line {ins.line}: {ins.keyword} wraps a shell")
        if ins.keyword == "ADD" and re.search(r"https?://", ins.args):
            problems.append(f"line {ins.line}: ADD from a URL")
        if ins.keyword == "RUN" and re.search(r"(curl|wget)[^|]*\|\s*(ba)?sh", ins.args):
            problems.append(f"line {ins.line}: pipes a download into a shell")
    return problems


def dockerignore_problems(text: str) -> list[str]:
    patterns = {line.strip().rstrip("/") for line in text.splitlines()
                if line.strip() and not line.strip().startswith("#")}
    problems = []
    for needed in (".git", "deploy", "tests", ".venv"):
        if needed not in patterns:
            problems.append(f"the build context filter does not exclude {needed}/")
    return problems
