"""A one-member etcd for a local cluster of replicated shards (``ps-local --replicas R``, R > 1).

The replicas of a shard elect their primary through etcd. Locally one
member is enough: it lives in ps-local's work directory, on free loopback
ports, and is stopped by PID with the rest of the processes.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
import urllib.error
import urllib.request

from ps_local.processes import ProcessGroup

__all__ = ["ETCD_BINARY_ENV", "EtcdUnavailable", "start_etcd"]

#: The etcd executable to run; else ``etcd`` on PATH (Debian's etcd-server package).
ETCD_BINARY_ENV = "ETCD_BINARY"
_START_TIMEOUT = 30.0


class EtcdUnavailable(RuntimeError):
    """etcd is not installed, or did not start; the message says which and what to do."""


def _binary() -> str:
    configured = os.environ.get(ETCD_BINARY_ENV)
    if configured:
        if not os.access(configured, os.X_OK):
            raise EtcdUnavailable(f"{ETCD_BINARY_ENV}={configured!r} is not an executable file")
        return configured
    found = shutil.which("etcd")
    if found is None:
        raise EtcdUnavailable("--replicas > 1 needs etcd (the replicas elect their primary through it): "
                              f"install it (Debian: etcd-server) or set {ETCD_BINARY_ENV} to its path")
    return found


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _healthy(client_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{client_url}/health", timeout=1.0) as answer:
            return b'"true"' in answer.read()
    except (urllib.error.URLError, OSError):
        return False


def start_etcd(group: ProcessGroup) -> str:
    """Start etcd in ``group``; its client endpoint ``127.0.0.1:<port>`` once it answers healthy."""
    binary = _binary()
    for attempt in range(3):
        client_port, peer_port = _free_port(), _free_port()
        client_url, peer_url = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
        proc = group.start(f"etcd-{attempt}", [
            binary, "--name", "ps-local", "--data-dir", os.path.join(group.workdir, f"etcd-{attempt}"),
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"ps-local={peer_url}", "--initial-cluster-state", "new",
            "--logger", "zap", "--log-level", "warn"], python=False)
        deadline = time.monotonic() + _START_TIMEOUT
        while proc.popen.poll() is None and time.monotonic() < deadline:
            if _healthy(client_url):
                return f"127.0.0.1:{client_port}"
            time.sleep(0.1)
        if proc.popen.poll() is None:
            raise EtcdUnavailable(f"etcd did not answer healthy within {_START_TIMEOUT:.0f}s:\n{proc.stderr_tail()}")
        if "address already in use" not in proc.stderr_tail():  # else another process took a port: again
            raise EtcdUnavailable(f"etcd exited with code {proc.popen.returncode}:\n{proc.stderr_tail()}")
    raise EtcdUnavailable("etcd found no free ports in 3 tries")
