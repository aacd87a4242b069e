"""Start planned pods as local processes (as the pod's user where possible, dying with
the test), stop them as the kubelet does, and wait on them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ContractError
from .pod_plan import Pod
from .pod_volumes import Identity
from .workloads import executable


@dataclass
class Proc:
    pod: Pod
    popen: subprocess.Popen
    stdout_path: Path
    stderr_path: Path
    #: (monotonic time of arrival, line) of stdout, read as it comes.
    lines: list[tuple[float, str]] = field(default_factory=list)
    reader: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stderr_tail(self, n: int = 25) -> str:
        try:
            return "".join(self.stderr_path.read_text(errors="replace").splitlines(True)[-n:])
        except OSError:
            return ""

    def json_lines(self) -> list[tuple[float, dict]]:
        out = []
        for t, line in list(self.lines):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.append((t, obj))
        return out

    def events(self, kind: str) -> list[tuple[float, dict]]:
        return [(t, o) for t, o in self.json_lines() if o.get("type") == kind]

    def describe(self) -> str:
        rc = self.popen.poll()
        state = "running" if rc is None else f"exited with code {rc}"
        return f"{self.pod.name} (pid {self.pid}, {state}); stderr:\n{self.stderr_tail()}"


def _die_with_parent() -> None:  # between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _death_signal_prefix() -> list[str]:
    """``setpriv --pdeathsig=KILL --`` in front of a pod's command: the pod dies with the test
    (the signal survives the wrappers' execs; the run-as prefix sets it again after its uid
    change). Preferred to a preexec_fn: with one, Python starts the child by fork(), which runs
    this process's pthread_atfork handlers, and gRPC's (the probes' channels) can wait there
    forever on gRPC's shutdown thread; without one it uses vfork(), which runs none."""
    return ["setpriv", "--pdeathsig=KILL", "--"] if shutil.which("setpriv") else []


def _setpriv_prefix(identity: Identity) -> list[str]:
    args = ["setpriv"]
    if identity.uid is not None:
        args.append(f"--reuid={identity.uid}")
    if identity.gid is not None:
        args.append(f"--regid={identity.gid}")
    if identity.groups:
        args.append("--groups=" + ",".join(str(g) for g in identity.groups))
    else:
        args.append("--clear-groups")
    if identity.no_new_privs:
        args.append("--no-new-privs")
    if identity.drop_all_caps:
        args += ["--inh-caps=-all", "--bounding-set=-all"]
    # The uid change clears a parent-death signal set before it: set it again, so that
    # a killed test run cannot leave pods running.
    return args + ["--pdeathsig=KILL", "--"]


_RUN_AS: dict[tuple, str | None] = {}


def run_as_problem(identity: Identity) -> str | None:
    """None when the process can run as the pod's user here; else why not (checked once)."""
    if identity.uid is None and identity.gid is None:
        return "the pod sets no runAsUser/runAsGroup"
    if os.geteuid() != 0:
        return "not root: cannot switch to the pod's user"
    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed"
    key = (identity.uid, identity.gid, tuple(identity.groups), identity.no_new_privs, identity.drop_all_caps)
    if key not in _RUN_AS:
        _RUN_AS[key] = _probe_run_as(identity)
    return _RUN_AS[key]


_INTERPRETER = "import json, sys; print(json.dumps([sys.version, sys.prefix, sys.base_prefix, sys.path]))"


def _probe_run_as(identity: Identity) -> str | None:
    """Can the pod's user run this very interpreter, the project and its console scripts?

    The interpreter must be the same one, seen the same way (an interpreter
    that cannot read its own installation may fall back to another standard
    library and still start: that is not the program under test)."""
    prefix = _setpriv_prefix(identity)
    who = f"uid {identity.uid}"
    expected = json.loads(subprocess.run([sys.executable, "-c", _INTERPRETER], capture_output=True, text=True,
                                         timeout=60, check=True, cwd="/").stdout)
    checks = [
        ([*prefix, sys.executable, "-c", _INTERPRETER], expected),
        ([*prefix, sys.executable, "-c", "import ps_server.ops.cli, ps_local.worker, sklearn.datasets"], None),
        ([*prefix, executable("ps-server"), "--help"], None),
        ([*prefix, executable("ps-worker"), "--help"], None),
    ]
    for argv, want in checks:
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd="/", check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"setpriv does not work here: {exc}"
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["?"])[-1]
            return f"{Path(argv[len(prefix)]).name} does not run as {who}: {last}"
        if want is not None and json.loads(proc.stdout) != want:
            return (f"{sys.executable} runs as {who} but cannot read its own installation "
                    f"(base prefix {json.loads(proc.stdout)[2]} instead of {want[2]})")
    return None


class Launcher:
    """Starts pods as processes and always stops them, by PID."""

    def __init__(self, run_as: bool = True) -> None:
        self.procs: list[Proc] = []
        self.run_as = run_as
        self.notes: list[str] = []

    def start(self, pod: Pod, wrap: list[str] | None = None) -> Proc:
        prefix: list[str] = []
        if self.run_as:
            problem = run_as_problem(pod.identity)
            if problem is None:
                prefix = _setpriv_prefix(pod.identity)
            else:
                note = f"the pods ran as uid {os.geteuid()}, not as their securityContext's user: {problem}"
                if note not in self.notes:
                    self.notes.append(note)
        dies_with_test = _death_signal_prefix()
        argv = [*dies_with_test, *(wrap or []), *prefix, *pod.argv]
        out, err = pod.logdir / "stdout", pod.logdir / "stderr"
        with open(err, "wb") as err_f:
            # Without setpriv, preexec_fn only calls prctl (async-signal-safe), as ps_local.processes does.
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err_f,
                                     env=pod.env, cwd=pod.cwd,
                                     preexec_fn=None if dies_with_test else _die_with_parent)  # noqa: PLW1509
        proc = Proc(pod, popen, out, err)

        def read() -> None:
            assert popen.stdout is not None
            with open(out, "wb") as f:
                for raw in popen.stdout:
                    f.write(raw)
                    f.flush()
                    proc.lines.append((time.monotonic(), raw.decode(errors="replace").rstrip("\n")))

        proc.reader = threading.Thread(target=read, name=f"stdout-{pod.name}", daemon=True)
        proc.reader.start()
        self.procs.append(proc)
        return proc

    def run_as_pod_user(self, proc: Proc) -> bool:
        """Whether ``proc`` was started as its pod's user (False: see ``notes``)."""
        return self.run_as and run_as_problem(proc.pod.identity) is None

    def stop(self, proc: Proc, grace: float = 10.0) -> int | None:
        """SIGTERM, wait ``grace`` seconds, then SIGKILL; the exit code (None: it would not die)."""
        if proc.popen.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.popen.wait(grace)
            except subprocess.TimeoutExpired:
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    proc.popen.wait(5)
                except subprocess.TimeoutExpired:
                    return None
        if proc.reader is not None:
            proc.reader.join(5)
        return proc.popen.returncode

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc, grace=5.0)


def wait_exit(procs: list[Proc], timeout: float) -> None:
    """Wait until every process has exited; ContractError naming those still running."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    running = [p for p in procs if p.popen.poll() is None]
    if running:
        raise ContractError(f"still running after {timeout:.0f}s:\n"
                            + "\n".join(p.describe() for p in running))


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, procs: list[Proc],
             interval: float = 0.05) -> float:
    """Poll ``predicate``; ContractError when a process in ``procs`` dies first or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return time.monotonic()
        dead = [p for p in procs if p.popen.poll() is not None]
        if dead:
            raise ContractError(f"waiting for {what}: " + "\n".join(p.describe() for p in dead))
        if time.monotonic() > deadline:
            raise ContractError(f"{what}: not within {timeout:.0f}s\n"
                                + "\n".join(p.describe() for p in procs))
        time.sleep(interval)
