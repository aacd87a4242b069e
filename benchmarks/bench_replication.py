"""Replicated shards for the benchmarks: one etcd and R ps-server processes of one shard on loopback.

``replicated_shard(R)`` yields the primary's address: with R = 1 a plain
ps-server (no etcd), with R > 1 a single-member etcd and R replicas, each
with its own checkpoint directory, once the primary is elected and every
backup is in sync, so a push measured there is acknowledged only after
every backup applied it. Everything started is stopped by PID on exit.
Ports are picked by the OS (ps-server ``--port 0``; etcd's from a socket
bound to port 0, retried when another process took one meanwhile).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from common import REPO_ROOT, SERVER_START_TIMEOUT_S, child_env, ps_cluster, stop_process, wait_for_port

#: etcd's raft timing (ms): a 50 ms election timeout lets etcd grant the 1 s
#: primary lease (it refuses TTLs under 1.5 election timeouts); on loopback
#: with one member no election follows startup.
ETCD_HEARTBEAT_MS, ETCD_ELECTION_MS = 10, 50
PRIMARY_LEASE_SECONDS = 1
PRIMARY_SERVICE = "wehub_ps.v1.ParameterServer"


def etcd_binary() -> str | None:
    """``$ETCD_BINARY`` or ``etcd`` on PATH; None when neither is there."""
    configured = os.environ.get("ETCD_BINARY")
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    return shutil.which("etcd")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_etcd(proc: subprocess.Popen, endpoint: str, log_file: Path) -> None:
    """Until a linearizable read answers (a leader exists); RuntimeError if etcd exits or stays silent."""
    from ps_server.coordination import CoordinationError, EtcdClient

    client = EtcdClient([endpoint], timeout=1.0)
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"etcd exited with status {proc.returncode}:\n"
                                   f"{log_file.read_text()[-3000:]}")
            try:
                client.get("/wehub-ps-bench/ready")
                return
            except CoordinationError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd did not answer within {SERVER_START_TIMEOUT_S}s:\n"
                                       f"{log_file.read_text()[-3000:]}") from None
                time.sleep(0.05)
    finally:
        client.close()


@contextmanager
def etcd_server(binary: str, workdir: Path) -> Iterator[str]:
    """A single-member etcd on free loopback ports; yields its client endpoint; stopped by PID on exit."""
    log_file = workdir / "etcd.log"
    for attempt in range(5):
        client_port, peer_port = _free_port(), _free_port()
        if client_port == peer_port:
            continue
        client_url, peer_url = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
        with open(log_file, "ab") as log:
            proc = subprocess.Popen(
                [binary, "--name", "bench", "--data-dir", str(workdir / f"etcd-data-{attempt}"),
                 "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                 "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                 "--initial-cluster", f"bench={peer_url}", "--initial-cluster-state", "new",
                 "--heartbeat-interval", str(ETCD_HEARTBEAT_MS), "--election-timeout", str(ETCD_ELECTION_MS),
                 "--logger", "zap", "--log-level", "warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            try:
                _wait_for_etcd(proc, f"127.0.0.1:{client_port}", log_file)
            except RuntimeError:
                if "address already in use" not in log_file.read_text() or attempt == 4:
                    raise
                continue
            yield f"127.0.0.1:{client_port}"
            return
        finally:
            stop_process(proc)
    raise RuntimeError("could not find two free loopback ports for etcd")


def _health(address: str, service: str) -> int | None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2.0).status
    except grpc.RpcError:
        return None


def _wait_for_primary(addresses: list[str], procs: list[subprocess.Popen], logs: list[Path]) -> str:
    """The primary's address once every replica is ready (the primary, or a backup in sync)."""
    from grpc_health.v1 import health_pb2

    serving = health_pb2.HealthCheckResponse.SERVING
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        for proc, log in zip(procs, logs):
            if proc.poll() is not None:
                raise RuntimeError(f"a replica exited with status {proc.returncode}:\n"
                                   f"{log.read_text()[-3000:]}")
        if all(_health(a, "") == serving for a in addresses):
            primaries = [a for a in addresses if _health(a, PRIMARY_SERVICE) == serving]
            if len(primaries) == 1:
                return primaries[0]
        time.sleep(0.05)
    raise RuntimeError(f"no primary with every backup in sync within {SERVER_START_TIMEOUT_S}s:\n"
                       + "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs))


@contextmanager
def replicated_shard(replicas: int, etcd: str | None = None) -> Iterator[tuple[str, list[subprocess.Popen]]]:
    """One shard of ``replicas`` processes; yields (the primary's address, the processes, primary first).

    ``replicas`` > 1 needs ``etcd``, the etcd binary. The processes are
    stopped by PID on exit, then etcd.
    """
    if replicas == 1:
        # Both replica counts alike: over gRPC Exchange streams (replicated servers here have no lane port).
        with ps_cluster(1, lane=False) as (addresses, procs):
            yield addresses[0], procs
        return
    if etcd is None:
        raise RuntimeError("replicas > 1 need an etcd binary")
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-replicas-")))
        endpoint = stack.enter_context(etcd_server(etcd, workdir))
        procs: list[subprocess.Popen] = []
        stack.callback(lambda: [stop_process(p) for p in procs])
        job = f"bench-{uuid.uuid4().hex[:8]}"
        logs = []
        for index in range(replicas):
            replica_dir = workdir / f"replica-{index}"
            replica_dir.mkdir()
            logs.append(replica_dir / "server.log")
            with open(logs[-1], "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "ps_server", "--host", "127.0.0.1", "--port", "0",
                     "--port-file", str(replica_dir / "port"), "--shard-index", "0", "--num-shards", "1",
                     "--log-level", "warning", "--replicas", str(replicas), "--replica-index", str(index),
                     "--etcd-endpoints", endpoint, "--job-name", job,
                     "--primary-lease-seconds", str(PRIMARY_LEASE_SECONDS),
                     "--checkpoint-dir", str(replica_dir / "checkpoints")],
                    cwd=REPO_ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT))
        addresses = [f"127.0.0.1:{wait_for_port(p, workdir / f'replica-{i}' / 'port', logs[i])}"
                     for i, p in enumerate(procs)]
        primary = _wait_for_primary(addresses, procs, logs)
        at = addresses.index(primary)
        yield primary, [procs[at]] + procs[:at] + procs[at + 1:]
