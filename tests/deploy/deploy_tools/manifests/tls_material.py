"""TLS material, in a render's Secrets and as deploy/gen-secrets.sh writes it: certificates
chain to their CA, keys match, names are covered, checked with the openssl CLI."""

from __future__ import annotations

import base64
import functools
import re
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path

import yaml

from .kustomize import DEPLOY
from .pod_templates import PodUnit, is_ps_server, is_ps_worker, pod_env, pod_units, resolve_env
from .wehub_wiring import secret_file


def openssl(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["openssl", *args], input=stdin, capture_output=True, timeout=60)


@functools.cache
def cert_sans(pem: bytes) -> frozenset[str]:
    proc = openssl("x509", "-noout", "-ext", "subjectAltName", stdin=pem)
    text = proc.stdout.decode()
    sans = set()
    for part in re.split(r"[,\n]", text):
        part = part.strip()
        if part.startswith("DNS:"):
            sans.add(part[4:])
        elif part.startswith("IP Address:"):
            sans.add(part[len("IP Address:"):])
    return frozenset(sans)


@functools.cache
def cert_ext(pem: bytes, ext: str) -> str:
    return openssl("x509", "-noout", "-ext", ext, stdin=pem).stdout.decode()


def name_matches_san(name: str, sans: Iterable[str]) -> bool:
    """OpenSSL's rule: a wildcard stands for one whole label and needs two labels after it."""
    for san in sans:
        if san == name:
            return True
        if (san.startswith("*.") and san.count(".") >= 2 and "." in name
                and name.split(".", 1)[1] == san[2:]):
            return True
    return False


@functools.cache
def verify_chain(ca_pem: bytes, cert_pem: bytes, purpose: str) -> str:
    """'' if cert_pem chains to ca_pem for purpose (sslserver/sslclient), else openssl's complaint."""
    with tempfile.TemporaryDirectory() as tmp:
        ca, cert = Path(tmp, "ca.crt"), Path(tmp, "cert.crt")
        ca.write_bytes(ca_pem)
        cert.write_bytes(cert_pem)
        proc = openssl("verify", "-purpose", purpose, "-CAfile", str(ca), str(cert))
    return "" if proc.returncode == 0 else (proc.stdout + proc.stderr).decode().strip()


@functools.cache
def key_matches_cert(key_pem: bytes, cert_pem: bytes) -> bool:
    pub_from_key = openssl("pkey", "-pubout", stdin=key_pem).stdout
    pub_from_cert = openssl("x509", "-noout", "-pubkey", stdin=cert_pem).stdout
    return bool(pub_from_key) and pub_from_key == pub_from_cert


def pod_names(unit: PodUnit) -> list[str]:
    """The names a client may verify a server pod under: a StatefulSet pod's short and
    full names, a JobSet pod's full name, a TFJob pod's per-replica Service as TF_CONFIG
    names it (a replicated TFJob's replicas advertise it, and backups verify it)."""
    names = []
    for host in unit.hostnames:
        if unit.controller == "StatefulSet":
            names.append(host)
        if unit.controller in ("StatefulSet", "JobSet") and unit.namespace:
            names.append(f"{host}.{unit.namespace}.svc.cluster.local")
        if unit.controller == "TFJob" and unit.namespace:
            names.append(f"{host}.{unit.namespace}.svc")
    return names


def _secret_bytes(secret: dict, key: str) -> bytes:
    data = secret.get("data") or {}
    if key in data:
        return base64.b64decode(data[key])
    return str((secret.get("stringData") or {}).get(key, "")).encode()


def tls_problems(objects: list[dict]) -> list[str]:
    """Certificates the servers present are what the workers expect, and vice versa."""
    problems = []
    units = pod_units(objects)
    servers = [(u, c) for u in units for c in u.containers() if is_ps_server(c)]
    workers = [(u, c) for u in units for c in u.containers() if is_ps_worker(c)]

    def load(unit: PodUnit, container: dict, var: str, env: dict) -> bytes | None:
        path = env.get(var)
        if not isinstance(path, str):
            return None
        secret, key, _ = secret_file(unit, container, path, objects)
        return _secret_bytes(secret, key) if secret is not None and key else None

    for unit, container in servers:
        env = resolve_env(container, objects, unit.namespace)
        where = f"{unit.where} container {container.get('name')}"
        cert, key = load(unit, container, "PS_TLS_CERT", env), load(unit, container, "PS_TLS_KEY", env)
        client_ca = load(unit, container, "PS_TLS_CLIENT_CA", env)
        if cert is None or key is None:
            problems.append(f"{where}: serves without TLS (PS_TLS_CERT / PS_TLS_KEY not from a Secret)")
            continue
        if not key_matches_cert(key, cert):
            problems.append(f"{where}: PS_TLS_KEY does not belong to PS_TLS_CERT")
        sans = cert_sans(cert)
        for name in pod_names(unit):
            if not name_matches_san(name, sans):
                problems.append(f"{where}: the server certificate does not name the pod {name!r} "
                                "(deploy/gen-secrets.sh --replicas / --namespace)")
        # A backup dials its primary at the address the primary advertises, and verifies that host.
        for index, host in enumerate(unit.hostnames if "PS_ADVERTISE_ADDRESS" in env else []):
            advertised = str(pod_env(unit, container, objects, index).get("PS_ADVERTISE_ADDRESS") or "")
            if not name_matches_san(advertised.rpartition(":")[0], sans):
                problems.append(f"{where}: pod {host} advertises {advertised!r}, a name the server certificate "
                                "does not have: its backups would refuse it as their primary")
                break
        if client_ca is None:
            problems.append(f"{where}: no PS_TLS_CLIENT_CA: clients are not authenticated by certificate")
        if not isinstance(env.get("PS_AUTH_TOKEN_FILE"), str):
            problems.append(f"{where}: no PS_AUTH_TOKEN_FILE")
        for wunit, wcontainer in (w for w in workers if w[0].namespace == unit.namespace):
            wenv = resolve_env(wcontainer, objects, wunit.namespace)
            wwhere = f"{wunit.where} container {wcontainer.get('name')}"
            ca = load(wunit, wcontainer, "PS_TLS_CA", wenv)
            if ca is None:
                problems.append(f"{wwhere}: no PS_TLS_CA to verify the servers with")
                continue
            complaint = verify_chain(ca, cert, "sslserver")
            if complaint:
                problems.append(f"{wwhere}: its PS_TLS_CA does not verify {where}'s certificate: {complaint}")
            server_name = wenv.get("PS_SERVER_NAME")
            sans = cert_sans(cert)
            if not isinstance(server_name, str) or not name_matches_san(server_name, sans):
                problems.append(f"{wwhere}: PS_SERVER_NAME={server_name!r} is not among the server "
                                f"certificate's names {sorted(sans)}")
            wcert, wkey = load(wunit, wcontainer, "PS_TLS_CERT", wenv), load(wunit, wcontainer, "PS_TLS_KEY", wenv)
            if client_ca is not None:
                if wcert is None or wkey is None:
                    problems.append(f"{wwhere}: the servers require a client certificate (mutual TLS) "
                                    "but PS_TLS_CERT / PS_TLS_KEY are not set from a Secret")
                else:
                    complaint = verify_chain(client_ca, wcert, "sslclient")
                    if complaint:
                        problems.append(f"{wwhere}: its client certificate is not accepted by {where}'s "
                                        f"PS_TLS_CLIENT_CA: {complaint}")
                    if not key_matches_cert(wkey, wcert):
                        problems.append(f"{wwhere}: PS_TLS_KEY does not belong to PS_TLS_CERT")
                    if wkey == key:
                        problems.append(f"{wwhere}: workers hold the servers' private key")
    return problems


DEFAULT_NAMESPACES = ("wehub-ps", "wehub-ps-train", "wehub-ps-tfjob")


def statefulset_replicas(deploy: Path = DEPLOY) -> int:
    """The replicas of the StatefulSet ``ps`` in deploy/base: the pods gen-secrets.sh names by default."""
    statefulset = yaml.safe_load((deploy / "base" / "ps-statefulset.yaml").read_text())
    return int(statefulset["spec"]["replicas"])


def shard_replicas(deploy: Path = DEPLOY) -> int:
    """The replicas of one shard in deploy/overlays/replicated: the ``ps-<i>-<r>`` gen-secrets.sh names."""
    path = deploy / "overlays" / "replicated" / "shard" / "ps-statefulset.yaml"
    return int(yaml.safe_load(path.read_text())["spec"]["replicas"])


def replicated_shards(deploy: Path = DEPLOY) -> int:
    """The shards of deploy/overlays/replicated: its ``shard-<i>/`` directories, 0, 1, ... without a gap."""
    count = 0
    while (deploy / "overlays" / "replicated" / f"shard-{count}").is_dir():
        count += 1
    return count


def required_sans(namespaces: Iterable[str], replicas: int, replicas_per_shard: int = 0,
                  shards: int | None = None) -> set[str]:
    """The service ``ps`` and every pod ``ps-<i>`` (i < replicas) and ``ps-<s>-<r>`` (s < shards,
    r < replicas_per_shard) by its short and namespaced names, and the replicated TFJob's Services
    ``train-ps-<i>`` (i < shards x replicas_per_shard) by their namespaced names; ``shards``
    defaults to ``replicas``."""
    pods = [f"ps-{i}" for i in range(replicas)]
    shards = replicas if shards is None else shards
    pods += [f"ps-{i}-{r}" for i in range(shards) for r in range(replicas_per_shard)]
    sans = {"ps", "localhost", "127.0.0.1"} | {f"{pod}.ps" for pod in pods}
    for ns in namespaces:
        sans |= {f"ps.{ns}", f"ps.{ns}.svc", f"ps.{ns}.svc.cluster.local"}
        for pod in pods:
            sans |= {f"{pod}.ps.{ns}", f"{pod}.ps.{ns}.svc", f"{pod}.ps.{ns}.svc.cluster.local"}
        for i in range(shards * replicas_per_shard):
            sans |= {f"train-ps-{i}.{ns}", f"train-ps-{i}.{ns}.svc", f"train-ps-{i}.{ns}.svc.cluster.local"}
    return sans


def etcd_sans(namespaces: Iterable[str], members: int = 3) -> set[str]:
    """etcd's members ``etcd-<i>`` behind the headless Service ``etcd``, short and namespaced."""
    sans = {"etcd", "localhost", "127.0.0.1"} | {f"etcd-{i}.etcd" for i in range(members)}
    for ns in namespaces:
        for i in range(members):
            sans |= {f"etcd-{i}.etcd.{ns}", f"etcd-{i}.etcd.{ns}.svc",
                     f"etcd-{i}.etcd.{ns}.svc.cluster.local"}
    return sans


def generated_secret_problems(directory: Path, namespaces: Iterable[str] = DEFAULT_NAMESPACES,
                              replicas: int | None = None,
                              replicas_per_shard: int | None = None, shards: int | None = None) -> list[str]:
    """What deploy/gen-secrets.sh wrote is a usable CA, server and client certificate and token;
    ``replicas`` defaults to the StatefulSet's, ``replicas_per_shard`` and ``shards`` to the replicated
    overlay's. The server certificate is also a client certificate: a backup presents it to its primary."""
    if replicas is None:
        replicas = statefulset_replicas()
    if replicas_per_shard is None:
        replicas_per_shard = shard_replicas()
    if shards is None:
        shards = replicated_shards()
    problems = []
    names = ("ca.crt", "ca.key", "server.crt", "server.key", "client.crt", "client.key", "token")
    for name in names:
        path = directory / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_mode & 0o077:
            problems.append(f"{name} is readable by others (mode {oct(path.stat().st_mode & 0o777)})")
    if problems:
        return problems
    read = {name: (directory / name).read_bytes() for name in names}
    if "CA:TRUE" not in cert_ext(read["ca.crt"], "basicConstraints"):
        problems.append("ca.crt is not a CA certificate")
    for cert, purpose, usage in (("server", "sslserver", "TLS Web Server Authentication"),
                                 ("server", "sslclient", "TLS Web Client Authentication"),
                                 ("client", "sslclient", "TLS Web Client Authentication")):
        complaint = verify_chain(read["ca.crt"], read[f"{cert}.crt"], purpose)
        if complaint:
            problems.append(f"{cert}.crt does not verify against ca.crt for {purpose}: {complaint}")
        if usage not in cert_ext(read[f"{cert}.crt"], "extendedKeyUsage"):
            problems.append(f"{cert}.crt lacks the extended key usage {usage!r}")
        if not key_matches_cert(read[f"{cert}.key"], read[f"{cert}.crt"]):
            problems.append(f"{cert}.key does not belong to {cert}.crt")
    missing = required_sans(namespaces, replicas, replicas_per_shard, shards) - set(cert_sans(read["server.crt"]))
    if missing:
        problems.append(f"server.crt lacks the subject alternative names {sorted(missing)}")
    token = read["token"]
    if len(token) < 32 or token != token.strip() or not re.fullmatch(rb"[0-9a-f]+", token):
        problems.append(f"token should be at least 32 hex characters without a newline, got {len(token)} bytes")
    return problems


def etcd_secret_problems(directory: Path, namespaces: Iterable[str] = DEFAULT_NAMESPACES) -> list[str]:
    """etcd's material from deploy/gen-secrets.sh: its own CA, a member certificate for clients and
    peers naming every member, and a client certificate; neither signed by the ps-servers' CA."""
    names = ("etcd-ca.crt", "etcd-ca.key", "etcd-server.crt", "etcd-server.key", "etcd-client.crt",
             "etcd-client.key")
    problems = []
    for name in names:
        path = directory / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_mode & 0o077:
            problems.append(f"{name} is readable by others (mode {oct(path.stat().st_mode & 0o777)})")
    if problems:
        return problems
    read = {name: (directory / name).read_bytes() for name in names}
    for cert, purpose in (("etcd-server", "sslserver"), ("etcd-server", "sslclient"),
                          ("etcd-client", "sslclient")):
        complaint = verify_chain(read["etcd-ca.crt"], read[f"{cert}.crt"], purpose)
        if complaint:
            problems.append(f"{cert}.crt does not verify against etcd-ca.crt for {purpose}: {complaint}")
        if not key_matches_cert(read[f"{cert}.key"], read[f"{cert}.crt"]):
            problems.append(f"{cert}.key does not belong to {cert}.crt")
    missing = etcd_sans(namespaces) - set(cert_sans(read["etcd-server.crt"]))
    if missing:
        problems.append(f"etcd-server.crt lacks the subject alternative names {sorted(missing)}")
    return problems
