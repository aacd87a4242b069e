"""A real single-member etcd for tests, on free loopback ports, stopped and restarted by PID.

The binary is ``$ETCD_BINARY`` or ``etcd`` on PATH (Debian's etcd-server).

Raft timing: ``--heartbeat-interval 10 --election-timeout 50`` (ms). etcd
refuses leases shorter than 1.5 election timeouts (rounded up to whole
seconds): with its defaults (100/1000 ms) a lease is at least 2 s, with 50 ms
a 1 s lease is granted, so failover tests run fast. The price, on a real
multi-member etcd: a member that misses 50 ms of heartbeats (a GC pause, a
slow disk, a loaded network) starts an election, so such timing suits
loopback tests and quiet dedicated networks only. A single member never
elects after startup, so here it only shortens startup and lowers the TTL
floor.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

from ps_testing import free_port

START_TIMEOUT = 30.0
HEARTBEAT_MS = 10
ELECTION_TIMEOUT_MS = 50


def etcd_binary() -> str | None:
    """The etcd executable to run, or None when none is installed."""
    configured = os.environ.get("ETCD_BINARY")
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    return shutil.which("etcd")


@dataclass
class EtcdTls:
    """etcd's certificate and key, the CA both sides' certificates chain to, and a client certificate."""

    cert: pathlib.Path
    key: pathlib.Path
    ca: pathlib.Path
    client_cert: pathlib.Path
    client_key: pathlib.Path

    def client_files(self) -> dict[str, pathlib.Path]:
        """``EtcdClient`` keyword arguments for mutual TLS."""
        return {"ca": self.ca, "cert": self.client_cert, "key": self.client_key}


@dataclass
class EtcdServer:
    """One etcd process; ``endpoint`` is ``127.0.0.1:<client port>``."""

    workdir: pathlib.Path
    binary: str
    tls: EtcdTls | None = None
    client_port: int = 0
    peer_port: int = 0
    popen: subprocess.Popen | None = None
    starts: int = field(default=0)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def data_dir(self) -> pathlib.Path:
        return self.workdir / "etcd-data"

    @property
    def log_path(self) -> pathlib.Path:
        return self.workdir / "etcd.log"

    def _argv(self) -> list[str]:
        scheme = "https" if self.tls else "http"
        client_url = f"{scheme}://127.0.0.1:{self.client_port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        argv = [self.binary, "--name", "test", "--data-dir", str(self.data_dir),
                "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                "--initial-cluster", f"test={peer_url}", "--initial-cluster-state", "new",
                "--heartbeat-interval", str(HEARTBEAT_MS), "--election-timeout", str(ELECTION_TIMEOUT_MS),
                "--logger", "zap", "--log-level", "warn"]
        if self.tls:
            argv += ["--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key),
                     "--trusted-ca-file", str(self.tls.ca), "--client-cert-auth"]
        return argv

    def start(self) -> EtcdServer:
        """Start on free ports (retrying if another process took one meanwhile); wait until it answers."""
        for attempt in range(5):
            self.client_port, self.peer_port = free_port(), free_port()
            if self.client_port == self.peer_port:
                continue
            self._launch()
            try:
                return self.wait_ready()
            except RuntimeError:
                taken = "address already in use" in self.log_text()
                self.kill()
                if not taken or attempt == 4:
                    raise
        raise RuntimeError("could not find two free ports for etcd")

    def restart(self) -> EtcdServer:
        """Stop (if running) and start again on the same ports and data: keys and leases survive."""
        self.stop()
        self._launch()
        return self.wait_ready()

    def _launch(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(self._argv(), stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        self.starts += 1

    def wait_ready(self) -> EtcdServer:
        """Wait until a linearizable read answers (a leader exists and the client port is open)."""
        from ps_server.coordination import CoordinationError, EtcdClient

        client = EtcdClient([self.endpoint], timeout=1.0, **(self.tls.client_files() if self.tls else {}))
        deadline = time.monotonic() + START_TIMEOUT
        try:
            while True:
                assert self.popen is not None
                if self.popen.poll() is not None:
                    raise RuntimeError(f"etcd exited with {self.popen.returncode}:\n"
                                       f"{self.log_text()[-3000:]}")
                try:
                    client.get("/wehub-ps-test/ready")
                    return self
                except CoordinationError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"etcd did not answer within {START_TIMEOUT} s:\n"
                                           f"{self.log_text()[-3000:]}") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def signal(self, signum: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.kill(self.popen.pid, signum)

    def stop(self) -> None:
        """SIGTERM (etcd flushes and exits), SIGKILL after 10 s; by PID."""
        if self.popen is None or self.popen.poll() is not None:
            return
        self.signal(signal.SIGCONT)  # a paused etcd cannot handle SIGTERM
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
