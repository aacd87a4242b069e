"""Find in a render the workload and container that run a program, and the program's
executable in this Python's bin directory."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

from .errors import HarnessError


def workload_running(objects: Iterable[dict], kind: str, program: str) -> dict:
    """The one ``kind`` object of the render whose pods run ``program``."""
    def runs(obj: dict) -> bool:
        pod_spec = (((obj.get("spec") or {}).get("template") or {}).get("spec")) or {}
        return any(c.get("command") and Path(str(c["command"][0])).name == program
                   for c in pod_spec.get("containers") or [])

    found = [o for o in objects if o.get("kind") == kind and runs(o)]
    if len(found) != 1:
        raise HarnessError(f"expected exactly one {kind} running {program} in the render, found {len(found)}")
    return found[0]


def program_container(workload: dict, program: str) -> dict:
    """The container of the workload's pod template whose command runs ``program``."""
    containers = [c for c in (workload["spec"]["template"]["spec"].get("containers") or [])
                  if c.get("command") and Path(str(c["command"][0])).name == program]
    if len(containers) != 1:
        raise HarnessError(f"{workload['kind']}/{workload['metadata']['name']}: expected one container "
                           f"whose command runs {program}, found {len(containers)}")
    return containers[0]


def executable(name: str) -> str:
    """A console script of this Python's environment (the venv's bin directory)."""
    path = Path(sys.executable).parent / Path(name).name
    if not path.exists():
        raise HarnessError(f"{path.name} is not installed next to {sys.executable} "
                           "(pip install -e '.[dev]' provides the console scripts)")
    return str(path)
