"""Starting and always stopping the processes of a local cluster.

Every child is started with a parent-death signal (Linux: through
``setpriv --pdeathsig``, else a preexec_fn), so even a ``kill -9`` of
ps-local cannot leave ps-servers running; the normal path
stops them by PID: SIGTERM, a grace period, then SIGKILL.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["ManagedProcess", "ProcessGroup", "repo_python_env"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def _death_signal_prefix() -> list[str]:
    """``setpriv --pdeathsig=KILL --`` in front of a child's command (util-linux, Linux): the
    signal survives the exec into the program. Preferred to a preexec_fn: with one, Python starts
    the child by fork(), which runs this process's pthread_atfork handlers (gRPC's among them,
    once a client was made here), and a child can hang there before its exec, unregistered, and
    outlive a Ctrl-C; without one Python uses vfork(), which runs none."""
    return ["setpriv", "--pdeathsig=KILL", "--"] if shutil.which("setpriv") else []


#: One BLAS thread per process ps-local starts, unless the user's environment says otherwise: its
#: servers and workers share the machine's cores, where idle BLAS threads spin on the cores that
#: pulls and pushes need (worker_client/blas_threads.py).
BLAS_ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def repo_python_env() -> dict[str, str]:
    """The environment for child Pythons: unbuffered, same import path as ours, one BLAS thread."""
    env = {**BLAS_ONE_THREAD, **os.environ}
    env["PYTHONUNBUFFERED"] = "1"
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


@dataclass
class ManagedProcess:
    name: str
    popen: subprocess.Popen
    stderr_path: str

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stderr_tail(self, lines: int = 20) -> str:
        try:
            with open(self.stderr_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


@dataclass
class ProcessGroup:
    """Children started by this process, stopped by PID in reverse order."""

    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="ps-local-"))
    processes: list[ManagedProcess] = field(default_factory=list)

    def start(self, name: str, argv: Sequence[str], *, capture_stdout: bool = False, merge_stderr: bool = False,
              env: Mapping[str, str] | None = None, python: bool = True) -> ManagedProcess:
        """Start ``argv`` as a child that dies with this process.

        ``capture_stdout``: its stdout is a text pipe (``popen.stdout``);
        ``merge_stderr`` sends its stderr there too, else stderr goes to a
        file in the work directory (``stderr_tail``). ``env`` is added to
        the environment; ``python`` gives a Python child this package's
        import path and one BLAS thread (:func:`repo_python_env`).
        """
        stderr_path = os.path.join(self.workdir, f"{name}.stderr")
        linux = sys.platform.startswith("linux")
        prefix = _death_signal_prefix() if linux else []
        environment = {**(repo_python_env() if python else os.environ), **(env or {})}
        with open(stderr_path, "wb") as stderr:
            popen = subprocess.Popen(
                prefix + list(argv), stdout=subprocess.PIPE if capture_stdout else subprocess.DEVNULL,
                stderr=subprocess.STDOUT if merge_stderr and capture_stdout else stderr,
                stdin=subprocess.DEVNULL, env=environment,
                preexec_fn=_die_with_parent if linux and not prefix else None,
                text=capture_stdout, bufsize=1 if capture_stdout else -1)
        process = ManagedProcess(name, popen, stderr_path)
        self.processes.append(process)
        return process

    def stop_all(self, grace: float = 10.0) -> None:
        """SIGTERM every live child, wait up to ``grace`` s, SIGKILL what remains."""
        live = [p for p in reversed(self.processes) if p.popen.poll() is None]
        for p in live:
            try:
                os.kill(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        for p in live:
            try:
                p.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
