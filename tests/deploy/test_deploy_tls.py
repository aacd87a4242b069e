"""deploy/gen-secrets.sh: the certificates and token it writes are what the
manifests promise, they really work for gRPC with mutual TLS under the
server name the workers verify (`ps`), and OpenSSL clients (Python's ssl,
curl, Prometheus) accept them under every pod's name and no other."""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent import futures
from pathlib import Path

import pytest
from deploy_tools.availability import require

require("yaml", "PyYAML")

from deploy_tools.manifests.kustomize import DEPLOY, copy_deploy  # noqa: E402
from deploy_tools.manifests.tls_handshake import openssl_name_verdict  # noqa: E402
from deploy_tools.manifests.tls_material import (  # noqa: E402
    cert_sans,
    etcd_secret_problems,
    generated_secret_problems,
    statefulset_replicas,
    verify_chain,
)

SCRIPT = DEPLOY / "gen-secrets.sh"


def gen(out: Path, *args: str, check: bool = True, script: Path = SCRIPT,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("WEHUB_PS_REPLICAS", "WEHUB_PS_SHARDS", "WEHUB_PS_SHARD_REPLICAS")} | (env or {})
    return subprocess.run(["bash", str(script), "--out", str(out), "--etcd-out", str(out), *args],
                          capture_output=True, text=True,
                          timeout=120, check=check, env=environ)


def verdict(secrets: Path, name: str) -> str:
    """'' when Python's ssl module verifies the server certificate for ``name``."""
    read = {f: (secrets / f).read_bytes() for f in ("ca.crt", "server.crt", "server.key")}
    return openssl_name_verdict(read["ca.crt"], read["server.crt"], read["server.key"], name)


@pytest.fixture(scope="module")
def secrets(tmp_path_factory, openssl_cli) -> Path:
    out = tmp_path_factory.mktemp("secrets")
    gen(out)
    return out


def test_generated_material_is_sound(secrets):
    assert generated_secret_problems(secrets) == []
    assert etcd_secret_problems(secrets) == []


def test_etcd_has_its_own_ca(secrets):
    """etcd accepts only certificates of its CA: no worker certificate (the ps CA's) reaches it."""
    read = {f: (secrets / f).read_bytes() for f in ("etcd-ca.crt", "client.crt", "server.crt")}
    assert verify_chain(read["etcd-ca.crt"], read["client.crt"], "sslclient")
    assert verify_chain(read["etcd-ca.crt"], read["server.crt"], "sslclient")


def test_replica_pods_are_named(tmp_path, openssl_cli):
    gen(tmp_path, "--shard-replicas", "3")
    assert generated_secret_problems(tmp_path, replicas_per_shard=3) == []
    sans = cert_sans((tmp_path / "server.crt").read_bytes())
    assert "ps-1-2.ps" in sans and "ps-1-3.ps" not in sans


def test_namespaces_can_be_chosen(tmp_path, openssl_cli):
    gen(tmp_path, "--namespace", "team-a", "--days", "30")
    assert generated_secret_problems(tmp_path, ["team-a"]) == []
    sans = cert_sans((tmp_path / "server.crt").read_bytes())
    assert "*.ps.wehub-ps.svc.cluster.local" not in sans


# --- the names OpenSSL clients verify ------------------------------------

OPENSSL_ACCEPTED = [
    "ps", "ps-0.ps", "ps-1.ps", "ps-0.ps.wehub-ps", "ps-1.ps.wehub-ps.svc",
    "ps-1.ps.wehub-ps.svc.cluster.local", "ps-0.ps.wehub-ps-train.svc.cluster.local",
    "ps-1.ps.wehub-ps-tfjob", "ps.wehub-ps", "ps.wehub-ps.svc.cluster.local",
    # the replicas of deploy/overlays/replicated, ps-<shard>-<replica>
    "ps-0-0.ps", "ps-1-1.ps", "ps-0-1.ps.wehub-ps", "ps-1-0.ps.wehub-ps.svc.cluster.local",
    # the JobSet's pods, by their full names (namespaced wildcard)
    "train-ps-0-1.ps.wehub-ps-train.svc.cluster.local", "train-ps-0-0.ps.wehub-ps-train.svc",
    # the replicated TFJob's per-replica Services (each replica advertises its own), shards x replicas
    "train-ps-0.wehub-ps-tfjob.svc", "train-ps-3.wehub-ps-tfjob.svc", "train-ps-2.wehub-ps-tfjob",
    "train-ps-1.wehub-ps-tfjob.svc.cluster.local",
    "localhost",
]
OPENSSL_REJECTED = [
    "ps-2.ps",  # beyond the StatefulSet's replicas
    "ps-0-2.ps",  # beyond the replicas of a shard
    "ps-2.ps.wehub-ps",  # the same, namespaced (full names ending in .svc match the wildcard)
    "x.ps",  # no single-label wildcard
    "train-ps-0-0.ps",  # the JobSet's short name: only its full name is covered
    "train-ps-4.wehub-ps-tfjob.svc",  # beyond the replicated TFJob's shards x replicas
    "train-ps-0",  # a TFJob Service's bare name: only its namespaced names are covered
    "ps-0.ps.team-a.svc.cluster.local",  # a namespace not asked for
    "a.ps-0.ps.wehub-ps.svc",  # a wildcard covers one label only
    "wehub",
]


def test_default_replicas_are_the_statefulsets():
    assert statefulset_replicas() == 2, "update OPENSSL_ACCEPTED/OPENSSL_REJECTED for the new replica count"


@pytest.mark.parametrize("name", OPENSSL_ACCEPTED)
def test_openssl_clients_verify_every_pod_name(secrets, name):
    assert verdict(secrets, name) == ""


@pytest.mark.parametrize("name", OPENSSL_REJECTED)
def test_openssl_clients_reject_names_outside_the_set(secrets, name):
    assert "Hostname mismatch" in verdict(secrets, name)


def test_replicated_shards_are_named_beyond_the_first_two(tmp_path, openssl_cli):
    """--shards (or WEHUB_PS_SHARDS) names every replica of every shard, apart from --replicas."""
    gen(tmp_path / "arg", "--shards", "3", "--replicas", "2")
    gen(tmp_path / "env", env={"WEHUB_PS_SHARDS": "3", "WEHUB_PS_SHARD_REPLICAS": "3"})
    assert generated_secret_problems(tmp_path / "arg", shards=3) == []
    assert generated_secret_problems(tmp_path / "env", shards=3, replicas_per_shard=3) == []
    for name in ("ps-2-0.ps", "ps-2-1.ps", "ps-2-1.ps.wehub-ps.svc.cluster.local"):
        assert verdict(tmp_path / "arg", name) == ""
    assert "Hostname mismatch" in verdict(tmp_path / "arg", "ps-2.ps")
    assert "Hostname mismatch" in verdict(tmp_path / "arg", "ps-3-0.ps")
    assert verdict(tmp_path / "env", "ps-2-2.ps") == ""
    # ... and the replicated TFJob's Services, shards x replicas of them.
    assert verdict(tmp_path / "arg", "train-ps-5.wehub-ps-tfjob.svc") == ""
    assert "Hostname mismatch" in verdict(tmp_path / "arg", "train-ps-6.wehub-ps-tfjob.svc")
    assert verdict(tmp_path / "env", "train-ps-8.wehub-ps-tfjob.svc") == ""
    # The check itself sees the third shard missing from a two-shard certificate.
    gen(tmp_path / "two", "--shards", "2")
    problems = generated_secret_problems(tmp_path / "two", shards=3)
    assert len(problems) == 1 and "'ps-2-0.ps'" in problems[0], problems


def test_default_shards_follow_the_replicated_overlay(tmp_path, openssl_cli):
    """A shard added as the README says (a copy of shard-1/) is named on a rerun without arguments."""
    deploy = copy_deploy(tmp_path / "copy")
    replicated = deploy / "overlays" / "replicated"
    shutil.copytree(replicated / "shard-1", replicated / "shard-2")
    gen(tmp_path / "out", script=deploy / "gen-secrets.sh")
    assert generated_secret_problems(tmp_path / "out", shards=3) == []
    assert verdict(tmp_path / "out", "ps-2-1.ps") == ""
    assert "Hostname mismatch" in verdict(tmp_path / "out", "ps-3-0.ps")


def test_replicas_can_be_chosen_by_argument_or_environment(tmp_path, openssl_cli):
    gen(tmp_path / "arg", "--replicas", "3")
    gen(tmp_path / "env", env={"WEHUB_PS_REPLICAS": "3"})
    for out in (tmp_path / "arg", tmp_path / "env"):
        assert generated_secret_problems(out, replicas=3) == []
        assert verdict(out, "ps-2.ps") == ""
        assert verdict(out, "ps-2.ps.wehub-ps.svc.cluster.local") == ""
        assert "Hostname mismatch" in verdict(out, "ps-3.ps")
    # the argument wins over the environment
    gen(tmp_path / "both", "--replicas", "1", env={"WEHUB_PS_REPLICAS": "3"})
    assert "Hostname mismatch" in verdict(tmp_path / "both", "ps-1.ps")


def test_default_replicas_follow_the_statefulset(tmp_path, openssl_cli):
    deploy = copy_deploy(tmp_path / "copy")
    manifest = deploy / "base" / "ps-statefulset.yaml"
    text = manifest.read_text()
    assert "\n  replicas: 2\n" in text
    manifest.write_text(text.replace("\n  replicas: 2\n", "\n  replicas: 4\n"))
    gen(tmp_path / "out", script=deploy / "gen-secrets.sh")
    assert generated_secret_problems(tmp_path / "out", replicas=4) == []
    assert verdict(tmp_path / "out", "ps-3.ps") == ""
    assert "Hostname mismatch" in verdict(tmp_path / "out", "ps-4.ps")


def test_existing_files_are_kept_unless_forced(tmp_path, openssl_cli):
    gen(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    refused = gen(tmp_path, check=False)
    assert refused.returncode == 1 and "--force" in refused.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    # token rotation: only the token changes
    gen(tmp_path, "--token-only", "--force")
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert after["token"] != before["token"]
    assert {k: v for k, v in after.items() if k != "token"} == {k: v for k, v in before.items() if k != "token"}
    assert generated_secret_problems(tmp_path) == []


def test_bad_arguments_are_refused(tmp_path, openssl_cli):
    result = gen(tmp_path, "--days", "soon", check=False)
    assert result.returncode == 2 and "--days" in result.stderr
    result = gen(tmp_path, "--bogus", check=False)
    assert result.returncode == 2 and "unknown argument" in result.stderr
    for flag in ("--replicas", "--shards", "--shard-replicas"):
        for count in ("0", "two"):
            result = gen(tmp_path, flag, count, check=False)
            assert result.returncode == 2 and f"{flag} must be" in result.stderr, result.stderr
    assert not any(tmp_path.iterdir())


# --- a real mutual-TLS gRPC handshake with the generated material ---------

grpc = pytest.importorskip("grpc", reason="grpcio is not installed")
health = pytest.importorskip("grpc_health.v1.health", reason="grpcio-health-checking is not installed")
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402


@pytest.fixture(scope="module")
def tls_server(secrets):
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    creds = grpc.ssl_server_credentials(
        [((secrets / "server.key").read_bytes(), (secrets / "server.crt").read_bytes())],
        root_certificates=(secrets / "ca.crt").read_bytes(), require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    yield port
    server.stop(0)


def check_health(port: int, ca: bytes, key: bytes | None, cert: bytes | None, server_name: str) -> str:
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    with grpc.secure_channel(f"127.0.0.1:{port}", creds,
                             options=[("grpc.ssl_target_name_override", server_name)]) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        except grpc.RpcError as exc:
            return exc.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@pytest.mark.parametrize("server_name", ["ps", "ps-1.ps", "ps-0.ps.wehub-ps.svc.cluster.local", "localhost"])
def test_workers_reach_servers_with_mutual_tls(secrets, tls_server, server_name):
    read = {p.name: p.read_bytes() for p in secrets.iterdir() if p.is_file()}
    assert check_health(tls_server, read["ca.crt"], read["client.key"], read["client.crt"], server_name) == "SERVING"


def test_handshake_fails_for_a_wrong_name_a_foreign_client_or_no_client_cert(secrets, tls_server, tmp_path):
    read = {p.name: p.read_bytes() for p in secrets.iterdir() if p.is_file()}
    # the certificate does not cover the name
    assert check_health(tls_server, read["ca.crt"], read["client.key"], read["client.crt"], "wehub") == "UNAVAILABLE"
    # a client certificate from another CA
    gen(tmp_path)
    other = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert check_health(tls_server, read["ca.crt"], other["client.key"], other["client.crt"], "ps") == "UNAVAILABLE"
    # no client certificate at all
    assert check_health(tls_server, read["ca.crt"], None, None, "ps") == "UNAVAILABLE"


# --- the check can fail ----------------------------------------------------


def test_secret_check_reports_missing_sans_wrong_usage_and_a_bad_token(secrets, tmp_path):
    for p in secrets.iterdir():
        (tmp_path / p.name).write_bytes(p.read_bytes())
        (tmp_path / p.name).chmod(0o600)
    # a server certificate without SANs, self-signed, and a client certificate for servers only
    subprocess.run(["openssl", "req", "-x509", "-new", "-key", str(tmp_path / "server.key"), "-subj", "/CN=ps",
                    "-days", "1", "-out", str(tmp_path / "server.crt")], check=True, capture_output=True)
    subprocess.run(["openssl", "req", "-x509", "-new", "-key", str(tmp_path / "client.key"), "-subj", "/CN=w",
                    "-addext", "extendedKeyUsage=serverAuth", "-days", "1",
                    "-out", str(tmp_path / "client.crt")],
                   check=True, capture_output=True)
    (tmp_path / "token").write_bytes(b"secret\n")
    (tmp_path / "ca.key").chmod(0o644)
    problems = generated_secret_problems(tmp_path)
    assert problems == ["ca.key is readable by others (mode 0o644)"]
    (tmp_path / "ca.key").chmod(0o600)
    problems = generated_secret_problems(tmp_path)
    text = "\n".join(problems)
    assert "server.crt does not verify against ca.crt" in text
    assert "server.crt lacks the subject alternative names" in text
    assert "client.crt lacks the extended key usage 'TLS Web Client Authentication'" in text
    assert "token should be" in text
