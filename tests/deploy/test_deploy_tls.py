"""deploy/gen-secrets.sh: the certificates and token it writes are what the
manifests promise, and they really work for gRPC with mutual TLS under the
server name the workers verify (`ps`)."""

from __future__ import annotations

import subprocess
from concurrent import futures
from pathlib import Path

import pytest
from deploy_tools.availability import require

require("yaml", "PyYAML")

from deploy_tools.manifests.kustomize import DEPLOY  # noqa: E402
from deploy_tools.manifests.tls_material import cert_sans, generated_secret_problems  # noqa: E402

SCRIPT = DEPLOY / "gen-secrets.sh"


def gen(out: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "--out", str(out), *args], capture_output=True, text=True,
                          timeout=120, check=check)


@pytest.fixture(scope="module")
def secrets(tmp_path_factory, openssl_cli) -> Path:
    out = tmp_path_factory.mktemp("secrets")
    gen(out)
    return out


def test_generated_material_is_sound(secrets):
    assert generated_secret_problems(secrets) == []


def test_namespaces_can_be_chosen(tmp_path, openssl_cli):
    gen(tmp_path, "--namespace", "team-a", "--days", "30")
    assert generated_secret_problems(tmp_path, ["team-a"]) == []
    sans = cert_sans((tmp_path / "server.crt").read_bytes())
    assert "*.ps.wehub-ps.svc.cluster.local" not in sans


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
    # a server certificate without SANs, self-signed, and a client cert swapped for the server's
    subprocess.run(["openssl", "req", "-x509", "-new", "-key", str(tmp_path / "server.key"), "-subj", "/CN=ps",
                    "-days", "1", "-out", str(tmp_path / "server.crt")], check=True, capture_output=True)
    (tmp_path / "client.crt").write_bytes((secrets / "server.crt").read_bytes())
    (tmp_path / "client.key").write_bytes((secrets / "server.key").read_bytes())
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
