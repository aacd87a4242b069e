"""Shared fixtures: real ps-server processes on free loopback ports.

Servers bind port 0 and report the port through --port-file, so tests never
race for ports and two test runs can share the machine. Every process a
test starts is stopped by PID at teardown.
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]
for path in (str(_ROOT), str(_ROOT / "tests")):
    if path not in sys.path:
        sys.path.insert(0, path)

from etcd_server import EtcdServer, EtcdTls, etcd_binary  # noqa: E402
from ps_testing import ClusterFactory  # noqa: E402
from tls_material import make_tls_material  # noqa: E402


@pytest.fixture
def cluster_factory(tmp_path):
    """``cluster_factory(num_shards, **server_flags) -> Cluster``; all stopped at teardown."""
    factory = ClusterFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.stop_all()


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """A CA, server and client certificates (tests/tls_material.py), shared by a module's tests."""
    return make_tls_material(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def token_file(tmp_path):
    """A bearer token file for --auth-token-file / auth_token_file, holding 's3cret-token'."""
    path = tmp_path / "token"
    path.write_text("s3cret-token\n")
    return path


@pytest.fixture(scope="module")
def module_cluster2(tmp_path_factory):
    """A running 2-shard cluster shared by a module's tests (each test uses variable names of its own)."""
    factory = ClusterFactory(tmp_path_factory.mktemp("module-cluster"))
    try:
        yield factory(2)
    finally:
        factory.stop_all()


@pytest.fixture
def cluster2(cluster_factory):
    """A running 2-shard cluster."""
    return cluster_factory(2)


@pytest.fixture
def fake_cupy(monkeypatch):
    """``(FakeCuda, module)``: a logging stand-in for CuPy as ``cupy`` (tests/fake_cupy.py; no GPU here)."""
    from fake_cupy import FakeCuda, fake_cupy_module

    cuda = FakeCuda()
    module = fake_cupy_module(cuda)
    monkeypatch.setitem(sys.modules, "cupy", module)
    return cuda, module


@pytest.fixture
def etcd_factory(tmp_path):
    """``etcd_factory(tls=None) -> EtcdServer``: a started etcd (tests/etcd_server.py); killed at teardown.

    Skips when etcd is not installed, except under WEHUB_PS_REQUIRE_ETCD=1 (CI), where that fails.
    """
    binary = etcd_binary()
    if binary is None:
        message = ("etcd is not installed: apt-get install etcd-server, or set ETCD_BINARY to an etcd binary"
                   if not os.environ.get("ETCD_BINARY") else
                   f"ETCD_BINARY={os.environ['ETCD_BINARY']} is not an executable file")
        if os.environ.get("WEHUB_PS_REQUIRE_ETCD") == "1":
            pytest.fail(f"{message} (WEHUB_PS_REQUIRE_ETCD=1 requires it)")
        pytest.skip(message)
    servers: list[EtcdServer] = []

    def start(tls: EtcdTls | None = None) -> EtcdServer:
        server = EtcdServer(tmp_path / f"etcd-{len(servers)}", binary, tls)
        servers.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in servers:
            server.kill()


@pytest.fixture
def etcd_server(etcd_factory) -> EtcdServer:
    """A running single-member etcd on loopback (1 s leases allowed)."""
    return etcd_factory()


@pytest.fixture
def replicated(tmp_path, etcd_server):
    """``replicated(num_shards=1, replicas=2, *server_flags) -> ReplicatedCluster`` on a real etcd
    (tests/replica_testing.py), started; every cluster stopped at teardown."""
    from replica_testing import ReplicatedCluster

    clusters: list[ReplicatedCluster] = []

    def make(num_shards: int = 1, replicas: int = 2, *extra_args: str) -> ReplicatedCluster:
        cluster = ReplicatedCluster(tmp_path / f"replicated-{len(clusters)}", etcd_server.endpoint,
                                    num_shards, replicas, tuple(extra_args))
        clusters.append(cluster)
        return cluster.start()

    yield make
    for cluster in clusters:
        cluster.stop()
