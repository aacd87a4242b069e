"""Separate network hosts: one network namespace per pod, veth pairs on a bridge, an address
per pod, and /etc/netns files as cluster DNS would answer; pods can be cut off and reconnected."""

from __future__ import annotations

import ipaddress
import os
import random
import re
import secrets as _secrets
import shutil
import subprocess
from pathlib import Path

from .cluster_dns import search_domains


class NetworkUnavailable(RuntimeError):
    """Network namespaces, veths or bridges cannot be made here (the caller skips)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=15, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def _used_networks() -> list[ipaddress.IPv4Network]:
    nets = []
    for line in _ip("-4", "-o", "addr", "show", check=False).stdout.splitlines():
        m = re.search(r"inet (\S+)", line)
        if m:
            nets.append(ipaddress.ip_interface(m.group(1)).network)
    for line in _ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        first = line.split()[0] if line.split() else ""
        if first in ("default", "broadcast", "local", "unreachable", "blackhole", "prohibit", "throw"):
            parts = line.split()
            first = parts[1] if len(parts) > 1 and first != "default" else ""
        try:
            nets.append(ipaddress.ip_network(first, strict=False))
        except ValueError:
            pass
    return nets


class PodNetwork:
    """A bridge with one network namespace per pod, each on a veth pair.

    Names carry a random token, the subnet is a random free 10.x.y.0/24, so
    runs in parallel do not collide. The host gets ``.1`` on the bridge
    (it stands for the node: kubelet's probes and our evaluation client come
    from there); pods get ``.10`` and up. ``close()`` deletes everything.
    """

    def __init__(self) -> None:
        self.token = _secrets.token_hex(3)
        self.bridge = f"wp{self.token}br"
        self.namespaces: dict[str, str] = {}  # pod key -> netns
        self.host_veths: dict[str, str] = {}
        self.ips: dict[str, str] = {}
        self.etc_dirs: list[Path] = []
        self.made_etc_netns = not Path("/etc/netns").exists()
        self.closed = False
        used = _used_networks()
        for _ in range(50):
            net = ipaddress.ip_network(f"10.{random.randint(64, 254)}.{random.randint(0, 255)}.0/24")
            if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
                break
        else:
            raise NetworkUnavailable("no free 10.x.y.0/24 subnet")
        self.network = net
        hosts = list(net.hosts())
        self.gateway = str(hosts[0])
        self._next = iter(hosts[9:])
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
        except RuntimeError as exc:
            raise NetworkUnavailable(f"cannot create a bridge: {exc}") from None
        try:
            _ip("addr", "add", f"{self.gateway}/{net.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except RuntimeError as exc:
            self.close()
            raise NetworkUnavailable(str(exc)) from None

    def add(self, key: str) -> tuple[str, str]:
        """A namespace for pod ``key`` on the bridge: (netns name, its address)."""
        k = len(self.namespaces)
        ns = f"wehub-{self.token}-{key}"
        host_veth, pod_veth = f"wp{self.token}h{k}", f"wp{self.token}p{k}"
        try:
            _ip("netns", "add", ns)
        except RuntimeError as exc:
            raise NetworkUnavailable(f"cannot create a network namespace: {exc}") from None
        self.namespaces[key] = ns
        ip = str(next(self._next))
        _ip("link", "add", host_veth, "type", "veth", "peer", "name", pod_veth)
        self.host_veths[key] = host_veth
        _ip("link", "set", pod_veth, "netns", ns)
        _ip("-n", ns, "link", "set", pod_veth, "name", "eth0")
        _ip("link", "set", host_veth, "master", self.bridge)
        _ip("link", "set", host_veth, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{ip}/{self.network.prefixlen}", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "route", "add", "default", "via", self.gateway)
        self.ips[key] = ip
        return ns, ip

    def write_etc(self, key: str, hosts: str, namespace: str) -> None:
        """/etc/netns/<ns>/hosts and resolv.conf (Kubernetes' search path; the
        nameserver is the bridge address, where nothing answers: a name the
        hosts file does not know does not resolve)."""
        directory = Path("/etc/netns") / self.namespaces[key]
        directory.mkdir(parents=True, exist_ok=False)
        self.etc_dirs.append(directory)
        (directory / "hosts").write_text(hosts)
        (directory / "resolv.conf").write_text(
            f"search {' '.join(search_domains(namespace))}\nnameserver {self.gateway}\n"
            "options ndots:5 timeout:1 attempts:1\n")
        for name in ("hosts", "resolv.conf"):
            os.chmod(directory / name, 0o644)

    def exec_prefix(self, key: str, hostname: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[key], "unshare", "--uts", "--",
                "sh", "-c", 'hostname "$0"; exec "$@"', hostname]

    def cut(self, key: str) -> None:
        _ip("link", "set", self.host_veths[key], "down")

    def reconnect(self, key: str) -> None:
        _ip("link", "set", self.host_veths[key], "up")

    def close(self) -> list[str]:
        """Delete namespaces, veths, the bridge and /etc/netns dirs; returns what failed."""
        problems = []
        for ns in self.namespaces.values():
            r = _ip("netns", "del", ns, check=False)
            if r.returncode != 0:
                problems.append(f"ip netns del {ns}: {r.stderr.strip()}")
        for veth in self.host_veths.values():
            _ip("link", "del", veth, check=False)  # gone with its namespace's peer
        r = _ip("link", "del", self.bridge, check=False)
        if r.returncode != 0 and "Cannot find" not in r.stderr:
            problems.append(f"ip link del {self.bridge}: {r.stderr.strip()}")
        for directory in self.etc_dirs:
            shutil.rmtree(directory, ignore_errors=True)
        if self.made_etc_netns:
            try:
                Path("/etc/netns").rmdir()  # only if empty: another run may be using it
            except OSError:
                pass
        self.closed = True
        return problems

    def leftovers(self) -> list[str]:
        names = _ip("-o", "link", "show", check=False).stdout
        found = [n for n in [self.bridge, *self.host_veths.values()]
                 if f" {n}:" in names or f" {n}@" in names]
        netns = _ip("netns", "list", check=False).stdout
        found += [ns for ns in self.namespaces.values() if ns in netns]
        found += [str(d) for d in self.etc_dirs if d.exists()]
        return found
