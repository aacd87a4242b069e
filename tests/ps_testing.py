"""Starting and stopping real ps-server and worker processes for tests."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = pathlib.Path(__file__).resolve().parents[1]
START_TIMEOUT = 60.0


def free_port() -> int:
    """A loopback port free right now, for flags that need a number (--metrics-port, --health-port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> str:
    """The Prometheus text a ps-server serves on ``--metrics-port``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def metric_value(text: str, sample: str) -> float:
    """The value of ``sample`` (a metric name with its labels, as printed) in ``text``."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{sample} not in the metrics:\n{text}")


def run_in_threads(worker: Callable[[int], object], count: int, timeout: float = 600.0) -> list:
    """``worker(index)`` for every index below ``count``, in threads at once; what each returned, by index.

    Every thread is waited for; then any error is raised (the first by index)
    and a thread still running after ``timeout`` fails the test.
    """
    results: list = [None] * count
    errors: dict[int, BaseException] = {}

    def run(index: int) -> None:
        try:
            results[index] = worker(index)
        except BaseException as exc:  # noqa: BLE001 - raised below, in the test's thread
            errors[index] = exc

    threads = [threading.Thread(target=run, args=(i,), name=f"worker-{i}") for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[min(errors)]
    assert not any(t.is_alive() for t in threads), f"worker threads still running after {timeout:g}s"
    return results


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("TF_CONFIG", None)
    env.pop("PS_ADDRESSES", None)
    # Tests run in CI pods too: a replica started here must not label that pod (tests give their own).
    env.pop("KUBERNETES_SERVICE_HOST", None)
    env.pop("KUBERNETES_SERVICE_PORT", None)
    if extra:
        extra = dict(extra)
        if "PYTHONPATH" in extra:
            env["PYTHONPATH"] = os.pathsep.join([extra.pop("PYTHONPATH"), env["PYTHONPATH"]])
        env.update(extra)
    return env


def children_of(pid: int) -> list[int]:
    """Live child processes of ``pid`` (from /proc)."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        return (pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


def memory_status(pid: int) -> dict[str, int]:
    """A process's resident bytes now (VmRSS) and at its peak (VmHWM), from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}


@dataclass
class ServerProcess:
    """One ps-server child process."""

    shard_index: int
    num_shards: int
    workdir: pathlib.Path
    extra_args: Sequence[str] = ()
    popen: subprocess.Popen | None = None
    port: int = 0
    #: What ``python`` runs: the ps-server, or a test's variant of it.
    program: Sequence[str] = ("-m", "ps_server")
    #: The address it listens on (``--host``), and the argv prefix that runs it there (a network
    #: namespace's ``ip netns exec``, which execs: the PID is still the server's).
    host: str = "127.0.0.1"
    prefix: Sequence[str] = ()
    #: Environment variables of this process beyond the test's own (a pod's POD_NAME, ...).
    env: dict[str, str] = field(default_factory=dict)

    @property
    def port_file(self) -> pathlib.Path:
        return self.workdir / f"ps-{self.shard_index}.port"

    @property
    def log_path(self) -> pathlib.Path:
        return self.workdir / f"ps-{self.shard_index}.log"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, port: int = 0) -> "ServerProcess":
        """Launch and wait until serving."""
        self.launch(port)
        return self.wait_ready()

    def launch(self, port: int = 0) -> None:
        if self.port_file.exists():
            self.port_file.unlink()
        argv = [*self.prefix, sys.executable, *self.program, "--host", self.host, "--port", str(port),
                "--port-file", str(self.port_file), "--shard-index", str(self.shard_index),
                "--num-shards", str(self.num_shards), *self.extra_args]
        log = open(self.log_path, "ab")
        self.popen = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                      cwd=str(ROOT), env=child_env(self.env))
        log.close()

    def wait_ready(self) -> "ServerProcess":
        assert self.popen is not None
        deadline = time.monotonic() + START_TIMEOUT
        while not self.port_file.exists():
            if self.popen.poll() is not None:
                raise RuntimeError(f"ps-server {self.shard_index} exited with {self.popen.returncode}:\n"
                                   + self.log_path.read_text(errors="replace"))
            if time.monotonic() > deadline:
                raise RuntimeError(f"ps-server {self.shard_index} did not start in {START_TIMEOUT}s")
            time.sleep(0.02)
        self.port = int(self.port_file.read_text())
        return self

    def signal(self, signum: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.kill(self.popen.pid, signum)

    def freeze(self, timeout: float = 5.0) -> None:
        """SIGSTOP, and wait until every thread is stopped: kill() returns before they are, and a
        request sent in between could still be answered."""
        assert self.popen is not None
        self.signal(signal.SIGSTOP)
        tasks = pathlib.Path(f"/proc/{self.popen.pid}/task")
        deadline = time.monotonic() + timeout
        while True:
            states = []
            for task in tasks.iterdir():
                try:
                    states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
                except OSError:  # the thread ended meanwhile
                    continue
            if states and all(state == "T" for state in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"ps-server {self.shard_index} not stopped {timeout:g}s after SIGSTOP: "
                                   f"{states}")
            time.sleep(0.005)

    def wait(self, timeout: float = 30.0) -> int:
        assert self.popen is not None
        return self.popen.wait(timeout)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s; by PID."""
        if self.popen is None or self.popen.poll() is not None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(15)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def health(self) -> int:
        """The health status of the server's ParameterServer service."""
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return stub.Check(health_pb2.HealthCheckRequest(service="wehub_ps.v1.ParameterServer"),
                              timeout=10).status


@dataclass
class Cluster:
    servers: list[ServerProcess]

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


@dataclass
class ClusterFactory:
    workdir: pathlib.Path
    clusters: list[Cluster] = field(default_factory=list)
    others: list[subprocess.Popen] = field(default_factory=list)

    def __call__(self, num_shards: int, *extra_args: str) -> Cluster:
        index = len(self.clusters)
        directory = self.workdir / f"cluster-{index}"
        directory.mkdir()
        servers = [ServerProcess(i, num_shards, directory, extra_args) for i in range(num_shards)]
        cluster = Cluster(servers)
        self.clusters.append(cluster)
        for server in servers:  # launch all before waiting: they boot in parallel
            server.launch()
        for server in servers:
            server.wait_ready()
        return cluster

    def process(self, *argv: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``python argv...`` with the repo importable; stopped at teardown."""
        popen = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, cwd=str(ROOT), env=child_env(env))
        self.others.append(popen)
        return popen

    def python(self, code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``python -c code args...`` with the repo importable; stopped at teardown."""
        popen = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, cwd=str(ROOT), env=child_env(env))
        self.others.append(popen)
        return popen

    def stop_all(self) -> None:
        for popen in self.others:
            if popen.poll() is None:
                popen.kill()
                popen.wait()
        for cluster in self.clusters:
            cluster.stop()
