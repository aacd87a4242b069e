"""Find in a render the workloads and container that run a program, and the program's
executable here: the project's console scripts in this Python's bin directory, a
third-party image's program (etcd) where this machine has it installed."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

from .errors import HarnessError

#: Programs of third-party images that pods run: the variable naming the binary to use
#: instead, and what to install. The binary is the same program as the image's, not
#: always its release (Debian's etcd 3.4 for the image's 3.5: same flags and protocols).
IMAGE_PROGRAMS = {"etcd": ("ETCD_BINARY", "etcd (apt-get install etcd-server), or set ETCD_BINARY")}


def workloads_running(objects: Iterable[dict], kind: str, program: str) -> list[dict]:
    """Every ``kind`` object of the render whose pods run ``program``, in render order."""
    def runs(obj: dict) -> bool:
        pod_spec = (((obj.get("spec") or {}).get("template") or {}).get("spec")) or {}
        return any(c.get("command") and Path(str(c["command"][0])).name == program
                   for c in pod_spec.get("containers") or [])

    return [o for o in objects if o.get("kind") == kind and runs(o)]


def workload_running(objects: Iterable[dict], kind: str, program: str) -> dict:
    """The one ``kind`` object of the render whose pods run ``program``."""
    found = workloads_running(objects, kind, program)
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


def image_program(name: str) -> str | None:
    """This machine's binary for a third-party image's program, or None when none is installed."""
    variable, _ = IMAGE_PROGRAMS[Path(name).name]
    configured = os.environ.get(variable)
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    return shutil.which(Path(name).name)


def executable(name: str) -> str:
    """A console script of this Python's environment (the venv's bin directory), or the
    installed binary of a third-party image's program (:data:`IMAGE_PROGRAMS`)."""
    if Path(name).name in IMAGE_PROGRAMS:
        found = image_program(name)
        if found is None:
            raise HarnessError(f"the render runs {Path(name).name}, which is not installed here: "
                               f"{IMAGE_PROGRAMS[Path(name).name][1]}")
        return found
    path = Path(sys.executable).parent / Path(name).name
    if not path.exists():
        raise HarnessError(f"{path.name} is not installed next to {sys.executable} "
                           "(pip install -e '.[dev]' provides the console scripts)")
    return str(path)
