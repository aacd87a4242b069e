"""Check running pods from outside as Kubernetes and Prometheus would: the process's user,
gRPC health probes, metrics scrapes, and checkpoints left on the volume."""

from __future__ import annotations

from pathlib import Path

from .errors import ContractError, HarnessError
from .pod_plan import Pod
from .processes import Proc, wait_for


def credentials(pid: int) -> tuple[int, int, set[int]]:
    """(uid, gid, supplementary groups) of a running process."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.split()
    return int(fields["Uid"][0]), int(fields["Gid"][0]), {int(g) for g in fields.get("Groups", [])}


def identity_problems(proc: Proc) -> list[str]:
    """The process runs as the pod's securityContext says (runAsUser, runAsGroup, fsGroup)."""
    ident = proc.pod.identity
    uid, gid, groups = credentials(proc.pid)
    problems = []
    if ident.uid is not None and uid != ident.uid:
        problems.append(f"{proc.pod.name}: runs as uid {uid}, not runAsUser {ident.uid}")
    if ident.gid is not None and gid != ident.gid:
        problems.append(f"{proc.pod.name}: runs as gid {gid}, not runAsGroup {ident.gid}")
    missing = set(ident.groups) - groups - {gid}
    if missing:
        problems.append(f"{proc.pod.name}: lacks supplementary groups {sorted(missing)}")
    return problems


def listening_ports(pid: int) -> set[int]:
    """TCP ports listened on in the network namespace of process ``pid`` (its pod's: one pod per
    namespace in the separate-hosts runs), from /proc/<pid>/net/tcp and tcp6."""
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == "0A":  # TCP_LISTEN
                ports.add(int(fields[1].rpartition(":")[2], 16))
    return ports


def undeclared_port_problems(proc: Proc) -> list[str]:
    """Ports the pod listens on that its container does not declare: a Service, a NetworkPolicy
    or a probe can only name declared ports, so traffic to such a port would be blocked."""
    declared = set(proc.pod.ports.values())
    extra = sorted(listening_ports(proc.pid) - declared)
    if not extra:
        return []
    return [f"{proc.pod.name}: listens on {extra}, which are not containerPorts ({sorted(declared)})"]


def grpc_health(address: str, service: str, timeout: float = 1.0) -> str:
    """The gRPC health status of ``service`` at ``address`` (plaintext, as kubelet asks)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return f"error: {exc.code().name}"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def http_get(address: str, path: str, timeout: float = 1.0) -> str:
    """The HTTP status of ``GET path`` at ``address`` (plain HTTP, as kubelet's httpGet probe),
    or ``error: ...``; kubelet counts 200 to 399 as success."""
    import http.client

    host, _, port = address.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.request("GET", path)
        return str(connection.getresponse().status)
    except OSError as exc:
        return f"error: {exc}"
    finally:
        connection.close()


def probe_address(proc: Proc, probe: dict) -> str:
    """Where kubelet sends ``probe`` (gRPC or httpGet): the pod IP and the probe's port."""
    kind = "grpc" if "grpc" in probe else "httpGet"
    port = proc.pod.container_port(probe[kind]["port"])
    if port not in proc.pod.ports:
        raise ContractError(f"{proc.pod.name}: probe port {port} is not a container port "
                            f"({sorted(proc.pod.ports)})")
    host = proc.pod.meta.ip
    return f"{host}:{proc.pod.ports.get(port, port)}"


def probe_answer(proc: Proc, probe: dict) -> tuple[str, bool]:
    """(what the probe got, whether kubelet counts it a success) for a gRPC or httpGet probe."""
    address = probe_address(proc, probe)
    if "grpc" in probe:
        answer = grpc_health(address, probe["grpc"].get("service", ""))
        return answer, answer == "SERVING"
    if probe["httpGet"].get("scheme", "HTTP") != "HTTP":
        raise HarnessError(f"{proc.pod.name}: only plain-HTTP httpGet probes are emulated")
    answer = http_get(address, probe["httpGet"].get("path", "/"))
    return answer, answer.isdigit() and 200 <= int(answer) < 400


def wait_ready(procs: list[Proc], timeout: float) -> None:
    """Every pod's readinessProbe (gRPC or httpGet, as kubelet runs it) succeeds."""
    for proc in procs:
        probe = proc.pod.container.get("readinessProbe") or {}
        if "grpc" not in probe and "httpGet" not in probe:
            raise HarnessError(f"{proc.pod.name}: only gRPC and httpGet readiness probes are emulated")
        last: list[str] = []

        def ready(probe: dict = probe, proc: Proc = proc, last: list[str] = last) -> bool:
            answer, ok = probe_answer(proc, probe)
            last[:] = [answer]
            return ok

        what = probe.get("grpc", {}).get("service", probe.get("httpGet", {}).get("path"))
        try:
            wait_for(ready, timeout,
                     f"readiness of {proc.pod.name} at {probe_address(proc, probe)} ({what!r})", [proc], 0.1)
        except ContractError as exc:
            raise ContractError(f"{exc}\nlast probe answer: {last}") from None


def probe_problems(proc: Proc) -> list[str]:
    """Every gRPC and httpGet probe of the container succeeds now (the pod is ready)."""
    problems = []
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = proc.pod.container.get(kind)
        if probe and ("grpc" in probe or "httpGet" in probe):
            answer, ok = probe_answer(proc, probe)
            if not ok:
                problems.append(f"{proc.pod.name} {kind}: {answer}")
    return problems


def scrape(proc: Proc, ca_file: str, server_name: str, timeout: float = 5.0, *,
           client_cert: str | None = None, client_key: str | None = None,
           token_file: str | None = None) -> dict[str, float]:
    """Scrape the pod as Prometheus would from its ``prometheus.io/*`` annotations
    (pod IP, annotated port, annotated scheme; TLS verified with ``ca_file`` under
    ``server_name``), presenting ``client_cert``/``client_key`` and the bearer token
    in ``token_file`` as a scrape config's ``tls_config.cert_file``/``key_file`` and
    ``authorization.credentials_file`` do. Returns {sample name with labels: value}."""
    import socket
    import ssl

    annotations = proc.pod.meta.annotations
    if annotations.get("prometheus.io/scrape") != "true":
        raise ContractError(f"{proc.pod.name}: not annotated prometheus.io/scrape: \"true\"")
    port = int(annotations.get("prometheus.io/port", "0"))
    if port not in proc.pod.ports:
        raise ContractError(f"{proc.pod.name}: prometheus.io/port {port} is not a container port")
    scheme = annotations.get("prometheus.io/scheme", "http")
    path = annotations.get("prometheus.io/path", "/metrics")
    host, real_port = proc.pod.meta.ip, proc.pod.ports[port]
    url = f"{scheme}://{host}:{real_port}{path}"
    try:
        with socket.create_connection((host, real_port), timeout) as raw:
            sock = raw
            if scheme == "https":
                # Verified under server_name, as a scrape config's tls_config.server_name does.
                context = ssl.create_default_context(cafile=ca_file)
                if client_cert and client_key:
                    context.load_cert_chain(client_cert, client_key)
                sock = context.wrap_socket(raw, server_hostname=server_name)
            authorization = ""
            if token_file:
                with open(token_file) as f:
                    authorization = f"Authorization: Bearer {f.read().strip()}\r\n"
            sock.sendall(f"GET {path} HTTP/1.0\r\nHost: {host}:{real_port}\r\n{authorization}\r\n".encode())
            chunks = []
            while True:
                data = sock.recv(65536)
                if not data:
                    break
                chunks.append(data)
    except (OSError, ssl.SSLError) as exc:
        raise ContractError(f"{proc.pod.name}: scraping {url} failed: {exc}") from None
    head, _, body = b"".join(chunks).decode(errors="replace").partition("\r\n\r\n")
    status = head.split(" ", 2)[1] if head.count(" ") >= 1 else "?"
    if status != "200":
        raise ContractError(f"{proc.pod.name}: scraping {url} answered {head.splitlines()[:1]}")
    samples = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                samples[name] = float(value)
            except ValueError:
                pass
    return samples


def checkpoint_problems(pod: Pod, mount_path: str) -> list[str]:
    """The server's checkpoint volume holds an intact checkpoint of its shard (its ordinal)."""
    from ps_server.durability.format import CheckpointError, read_manifest

    root = pod.mount(mount_path)
    manifests = sorted(root.glob(f"shard-{pod.meta.index}-of-*/*/manifest.json"))
    if not manifests:
        listing = sorted(str(p.relative_to(root)) for p in root.rglob("*"))[:10]
        return [(f"{pod.name}: no checkpoint of shard {pod.meta.index} in its volume {mount_path} ({root}); "
                 f"it holds {listing}")]
    try:
        read_manifest(manifests[-1].parent)
    except CheckpointError as exc:
        return [f"{pod.name}: the checkpoint on its volume is damaged: {exc}"]
    return []
