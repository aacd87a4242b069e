"""Names as cluster DNS would answer them: records for the render's Services and pods,
search domains, the address lists workers are given, and the hosts file of each pod."""

from __future__ import annotations

from collections.abc import Callable

from .pod_plan import Pod

CLUSTER_DOMAIN = "cluster.local"


def dns_records(objects: list[dict], pods: list[Pod]) -> dict[str, list[Pod]]:
    """Fully qualified name -> pods, for the names cluster DNS answers.

    A pod with hostname and subdomain gets ``<hostname>.<subdomain>.<ns>.svc``
    only when a headless Service named like the subdomain selects it; a
    headless Service's own name answers with all the pods it selects (the
    harness starts workers once the servers are ready, so whether not-ready
    addresses are published does not matter here).
    """
    records: dict[str, list[Pod]] = {}
    for svc in (o for o in objects if o.get("kind") == "Service"):
        spec = svc.get("spec") or {}
        if spec.get("clusterIP") != "None":
            continue
        ns = svc["metadata"].get("namespace", "default")
        selector = spec.get("selector") or {}
        selected = [p for p in pods if p.meta.namespace == ns and selector
                    and all(p.meta.labels.get(k) == v for k, v in selector.items())]
        svc_fqdn = f"{svc['metadata']['name']}.{ns}.svc.{CLUSTER_DOMAIN}"
        for pod in selected:
            records.setdefault(svc_fqdn, []).append(pod)
            if pod.meta.subdomain == svc["metadata"]["name"]:
                records.setdefault(f"{pod.meta.hostname}.{svc_fqdn}", []).append(pod)
    return records


def search_domains(namespace: str) -> list[str]:
    return [f"{namespace}.svc.{CLUSTER_DOMAIN}", f"svc.{CLUSTER_DOMAIN}", CLUSTER_DOMAIN]


def resolve_name(host: str, records: dict[str, list[Pod]], namespace: str) -> list[Pod]:
    """The pods a pod in ``namespace`` reaches under ``host`` (search path, ndots:5)."""
    candidates = [f"{host}.{d}" for d in search_domains(namespace)] if host.count(".") < 5 else []
    for name in [*candidates, host.rstrip(".")]:
        if name in records:
            return records[name]
    return []


def split_addresses(value: str) -> list[tuple[str, int]]:
    out = []
    for entry in value.split(","):
        host, _, port = entry.strip().rpartition(":")
        out.append((host.strip("[]"), int(port) if port.isdigit() else -1))
    return out


def map_addresses(value: str, records: dict[str, list[Pod]], namespace: str,
                  address_of: Callable[[Pod, int], str]) -> str:
    """Rewrite each ``host:port`` of a list that names exactly one pod on one of its
    container ports; anything else is left as it is (and will fail as it would)."""
    out = []
    for entry, (host, port) in zip(value.split(","), split_addresses(value)):
        pods = resolve_name(host, records, namespace)
        if len(pods) == 1 and port in pods[0].ports:
            out.append(address_of(pods[0], port))
        else:
            out.append(entry.strip())
    return ",".join(out)


def hosts_file(pod: Pod, records: dict[str, list[Pod]]) -> str:
    """The pod's /etc/hosts: the kubelet's lines, then every name cluster DNS would answer
    for it, in all the forms its search path accepts (a hosts file has no search path)."""
    own = pod.meta.hostname
    if pod.meta.subdomain:
        own = f"{pod.meta.hostname}.{pod.meta.subdomain}.{pod.meta.namespace}.svc.{CLUSTER_DOMAIN} {own}"
    lines = ["# Kubernetes-managed hosts file (emulated by tests/deploy/pod_harness.py).",
             "127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback",
             f"{pod.meta.ip}\t{own}"]
    suffixes = search_domains(pod.meta.namespace)
    for fqdn, pods in sorted(records.items()):
        names = [fqdn]
        for suffix in suffixes:
            if fqdn.endswith("." + suffix):
                names.append(fqdn[:-len(suffix) - 1])
        for target in pods:
            lines.append(f"{target.meta.ip}\t" + " ".join(dict.fromkeys(names)))
    return "\n".join(lines) + "\n"
