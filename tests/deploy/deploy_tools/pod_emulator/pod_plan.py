"""A pod planned from a render, ready to start: argv, environment, volumes and ports; the
rewrite of its listening settings to free loopback ports; and the scratch directory pods live in."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import ContractError, HarnessError
from .pod_environment import PodMeta, expand, pod_meta, resolve_env
from .pod_volumes import Identity, Mount, identity_of, materialize_volumes, rewrite_path
from .workloads import executable, program_container

#: What the image (deploy/Dockerfile) puts in every container's environment,
#: and its WORKDIR. HOME and the working directory are under /tmp, which the
#: pods mount as an emptyDir, so they are rewritten like any mounted path.
IMAGE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
    "HOME": "/tmp",
}
IMAGE_WORKDIR = "/tmp"

#: The settings that carry a listening port or address, as env and as flags.
PORT_SETTINGS = {"PS_PORT": "--port", "PS_LANE_PORT": "--lane-port", "PS_HEALTH_PORT": "--health-port",
                 "PS_METRICS_PORT": "--metrics-port"}
HOST_SETTINGS = {"PS_HOST": "--host"}


@dataclass
class Pod:
    meta: PodMeta
    workload: dict
    container: dict
    argv: list[str]
    env: dict[str, str]
    mounts: list[Mount]
    identity: Identity
    cwd: str
    #: container port -> port the process really uses (loopback rewrites them)
    ports: dict[int, int]
    logdir: Path

    @property
    def name(self) -> str:
        return self.meta.name

    def container_port(self, port: int | str) -> int:
        """A probe's port (number or name) as a container port number."""
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in self.container.get("ports") or []:
            if p.get("name") == port:
                return int(p["containerPort"])
        raise ContractError(f"{self.name}: port {port!r} is not a container port name")

    def mount(self, mount_path: str) -> Path:
        for m in self.mounts:
            if m.path == mount_path.rstrip("/"):
                return m.local
        raise KeyError(mount_path)


def plan_pod(objects: list[dict], workload: dict, program: str, index: int, work: Path, *,
             ip: str = "127.0.0.1") -> Pod:
    """Pod ``index`` of ``workload`` as it would run: argv, env, volumes, identity."""
    meta = pod_meta(workload, index, ip)
    container = program_container(workload, program)
    pod_spec = workload["spec"]["template"]["spec"]
    identity = identity_of(pod_spec, container)
    root = work / meta.name
    root.mkdir(parents=True)
    os.chmod(root, 0o755)
    mounts = materialize_volumes(objects, workload, container, meta, root, identity, work)
    env = resolve_env(objects, workload, container, meta)
    full_env = {**IMAGE_ENV, "HOSTNAME": meta.hostname, **env}
    rendered = (container.get("command") or []) + (container.get("args") or [])
    argv = [expand(str(a), full_env) for a in rendered]
    if not container.get("command"):
        raise HarnessError(f"{meta.name}: no command; the harness runs only explicit commands")
    argv = [executable(argv[0])] + [rewrite_path(a, mounts) for a in argv[1:]]
    full_env = {k: rewrite_path(v, mounts) for k, v in full_env.items()}
    full_env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), full_env["PATH"]])
    tmp = [m for m in mounts if m.path == "/tmp"]
    if tmp:
        full_env.setdefault("TMPDIR", str(tmp[0].local))  # the process's /tmp is that emptyDir
    cwd = rewrite_path(container.get("workingDir") or IMAGE_WORKDIR, mounts)
    if not Path(cwd).is_dir():
        cwd = str(root)
    ports = {int(p["containerPort"]): int(p["containerPort"]) for p in container.get("ports") or []}
    logdir = root / "logs"
    logdir.mkdir()
    return Pod(meta, workload, container, argv, full_env, mounts, identity, cwd, ports, logdir)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _set_setting(pod: Pod, env_name: str, flag: str, change: Callable[[str], str]) -> list[str]:
    """Apply ``change`` to a setting given as env var and/or flag; returns what was changed."""
    changed = []
    if env_name in pod.env:
        pod.env[env_name] = change(pod.env[env_name])
        changed.append(env_name)
    argv = pod.argv
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            argv[i + 1] = change(argv[i + 1])
            changed.append(flag)
        elif arg.startswith(flag + "="):
            argv[i] = f"{flag}={change(arg.split('=', 1)[1])}"
            changed.append(flag)
    return changed


def to_loopback(pod: Pod) -> None:
    """Listen on 127.0.0.1 and on free ports instead of the container ports."""
    pod.ports = {port: free_port() for port in pod.ports}

    def port(value: str) -> str:
        if not value.isdigit() or int(value) not in pod.ports:
            if value in ("0", "-1"):  # a free port; -1: off (--lane-port)
                return value
            raise ContractError(f"{pod.name}: listens on port {value}, which is not a container port "
                                f"({sorted(pod.ports)})")
        return str(pod.ports[int(value)])

    for env_name, flag in PORT_SETTINGS.items():
        _set_setting(pod, env_name, flag, port)
    for env_name, flag in HOST_SETTINGS.items():
        _set_setting(pod, env_name, flag, lambda _v: "127.0.0.1")


def work_dir() -> Path:
    """A scratch directory other users can traverse (the pods may run as uid 10001)."""
    path = Path(tempfile.mkdtemp(prefix="wehub-contract-"))
    os.chmod(path, 0o755)
    return path
