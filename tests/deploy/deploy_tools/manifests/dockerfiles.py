"""Checks of the image recipes under deploy/: the Dockerfiles' base images, build
stages and targets, what each target's pip installs carry, default commands and
arguments, and the build context filter."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass
class Stage:
    """One FROM and the instructions under it."""

    name: str
    base: str  # an image reference or the name of an earlier stage
    line: int
    instructions: list[Instruction] = field(default_factory=list)

    def arg_defaults(self) -> dict[str, str]:
        return _arg_defaults(self.instructions)


@dataclass(frozen=True)
class Target:
    """What a build target must be: its default command, the wehub-ps extras its pip
    installs carry (exactly), and any other package it installs by name."""

    cmd: tuple[str, ...]
    extras: frozenset[str] = frozenset()
    packages: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Installs:
    """What the pip installs of a target's stages name: wehub-ps's extras, other packages."""

    extras: frozenset[str]
    packages: frozenset[str]
    problems: tuple[str, ...] = ()


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


def _arg_defaults(instructions: Iterable[Instruction]) -> dict[str, str]:
    args = {}
    for ins in instructions:
        if ins.keyword == "ARG":
            name, _, default = ins.args.partition("=")
            args[name.strip()] = default.strip().strip('"')
    return args


def dockerfile_stages(text: str) -> tuple[dict[str, str], list[Stage]]:
    """(the global ARGs before the first FROM, the stages in order)."""
    _, instructions = dockerfile_instructions(text)
    global_args: list[Instruction] = []
    stages: list[Stage] = []
    for ins in instructions:
        if ins.keyword == "FROM":
            words = ins.args.split()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(name, words[0] if words else "", ins.line))
        elif stages:
            stages[-1].instructions.append(ins)
        else:
            global_args.append(ins)
    return _arg_defaults(global_args), stages


def stage_chain(stages: list[Stage], name: str) -> list[Stage]:
    """The stage called `name` and the stages it is built FROM, base first."""
    by_name = {stage.name: stage for stage in stages}
    chain: list[Stage] = []
    stage = by_name.get(name)
    while stage is not None and stage not in chain:
        chain.insert(0, stage)
        stage = by_name.get(stage.base)
    return chain


def _substitute(word: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values.get(m.group(1) or m.group(2), m.group(0)), word)


#: pip install options that take a value (the value is not a requirement).
_PIP_VALUE_OPTIONS = {"-c", "--constraint", "-f", "--find-links", "-i", "--index-url", "--extra-index-url",
                      "-t", "--target", "--prefix", "--root", "--platform", "--python-version"}
_REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[([^\]]*)\])?")


def target_installs(text: str, target: str) -> Installs:
    """What the pip installs in `target` and the stages under it name: the extras of
    wehub-ps, and every other package named on a command line."""
    global_args, stages = dockerfile_stages(text)
    extras: set[str] = set()
    packages: set[str] = set()
    problems: list[str] = []
    for stage in stage_chain(stages, target):
        values = {**global_args, **stage.arg_defaults()}
        for ins in stage.instructions:
            if ins.keyword != "RUN":
                continue
            for command in re.split(r"&&|;|\|\|", ins.args):
                words = shlex.split(command)
                if words[:2] == ["python", "-m"] or words[:2] == ["python3", "-m"]:
                    words = words[2:]
                if words[:2] != ["pip", "install"]:
                    continue
                skip_value = False
                for word in words[2:]:
                    if skip_value:
                        skip_value = False
                    elif word in ("-r", "--requirement") or word.startswith("--requirement="):
                        problems.append(f"line {ins.line}: installs from a requirements file, which "
                                        "this check cannot read")
                        skip_value = word in ("-r", "--requirement")
                    elif word in _PIP_VALUE_OPTIONS:
                        skip_value = True
                    elif not word.startswith("-"):
                        match = _REQUIREMENT.match(_substitute(word, values))
                        if match is None:
                            problems.append(f"line {ins.line}: cannot read the requirement {word!r}")
                            continue
                        name = re.sub(r"[-_.]+", "-", match.group(1)).lower()
                        if name == "wehub-ps":
                            extras |= {e.strip() for e in (match.group(2) or "").split(",") if e.strip()}
                        else:
                            packages.add(name)
    return Installs(frozenset(extras), frozenset(packages), tuple(problems))


def _exec_form(args: str) -> list[str] | None:
    try:
        value = json.loads(args)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


def dockerfile_problems(text: str, *, base_pattern: str, targets: dict[str, Target], default_target: str,
                        required_args: Iterable[str]) -> list[str]:
    """Everything wrong with one Dockerfile, measured against the targets it must build."""
    problems = []
    header, instructions = dockerfile_instructions(text)
    global_args, stages = dockerfile_stages(text)
    names = [stage.name for stage in stages]
    if len(stages) < 2:
        problems.append("not a multi-stage build (a builder stage and a runtime stage)")
    builder = stages[0] if stages else None
    if builder and builder.name != "builder":
        problems.append("the first stage is not named `builder`")
    if builder and not re.match(r"python:\$\{PYTHON_VERSION\}-slim\b", builder.base):
        problems.append(f"the builder stage should be python:${{PYTHON_VERSION}}-slim, got {builder.base!r}")
    for stage in stages:
        if stage.base in names[:names.index(stage.name)]:
            continue
        if re.search(r":latest\b", stage.base) or ("${" not in stage.base and ":" not in stage.base):
            problems.append(f"line {stage.line}: FROM {stage.base} has no fixed tag")
    if builder and not any(ins.keyword == "RUN" and re.search(r"pip wheel --no-deps -w /dist \.(\s|$)", ins.args)
                           for ins in builder.instructions):
        problems.append("the builder does not run `pip wheel --no-deps -w /dist .`")
    if stages and stages[-1].name != default_target:
        problems.append(f"the last stage (what a build without --target makes) is {stages[-1].name!r}, "
                        f"not {default_target!r}")
    args = dict(global_args)
    for stage in stages:
        args.update(stage.arg_defaults())
    for name in set(args) | set(required_args):
        if name not in args:
            problems.append(f"build arg {name} is not declared")
        # documented: a header comment line that starts with the name and says something
        if not any(re.match(rf"{re.escape(name)}\s+\S", line) for line in header):
            problems.append(f"build arg {name} is not documented in the header comment")
    for name, target in targets.items():
        problems += [f"target {name}: {p}" for p in _target_problems(text, stages, header, name, target,
                                                                    base_pattern)]
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


def _target_problems(text: str, stages: list[Stage], header: list[str], name: str, target: Target,
                     base_pattern: str) -> list[str]:
    chain = stage_chain(stages, name)
    if not chain:
        return ["no such stage"]
    problems = []
    if not any(re.match(rf"{re.escape(name)}\s+\S", line) for line in header):
        problems.append("not documented in the header comment")
    if not re.match(base_pattern, chain[0].base):
        problems.append(f"runtime base {chain[0].base!r} does not match {base_pattern!r}")
    if any(stage.name == "builder" for stage in chain):
        problems.append("is built on the builder stage")
    own = chain[-1].instructions
    users = [ins for ins in own if ins.keyword == "USER"]
    if not users or users[-1].args not in ("10001", "10001:10001"):
        problems.append(f"must end as USER 10001, got {users[-1].args if users else None!r}")
    if not any(ins.keyword == "RUN" and re.search(r"useradd\b.*--uid 10001\b", ins.args)
               for stage in chain for ins in stage.instructions):
        problems.append("creates no user with uid 10001")
    entrypoints = [ins for ins in own if ins.keyword == "ENTRYPOINT"]
    if not entrypoints or _exec_form(entrypoints[-1].args) != []:
        problems.append("must reset ENTRYPOINT []")
    cmds = [ins for ins in own if ins.keyword == "CMD"]
    if not cmds or _exec_form(cmds[-1].args) != list(target.cmd):
        problems.append(f"CMD must be the exec form {json.dumps(list(target.cmd))}, got "
                        f"{cmds[-1].args if cmds else None!r}")
    installs = target_installs(text, name)
    problems += list(installs.problems)
    if installs.extras != target.extras:
        problems.append(f"installs wehub-ps[{','.join(sorted(installs.extras))}], "
                        f"expected wehub-ps[{','.join(sorted(target.extras))}]")
    for package in sorted(installs.packages - target.packages):
        problems.append(f"installs {package} besides wehub-ps and its extras")
    for package in sorted(target.packages - installs.packages):
        problems.append(f"does not install {package}")
    return problems


def dockerignore_problems(text: str) -> list[str]:
    patterns = {line.strip().rstrip("/") for line in text.splitlines()
                if line.strip() and not line.strip().startswith("#")}
    problems = []
    for needed in (".git", "deploy", "tests", ".venv"):
        if needed not in patterns:
            problems.append(f"the build context filter does not exclude {needed}/")
    return problems
