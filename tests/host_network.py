"""Separate network hosts for tests: a network namespace per host on a bridge, and packets dropped between.

``HostNetwork()`` makes a bridge on a random free ``10.x.y.0/24``; ``add(key)``
gives host ``key`` its own network namespace, a veth pair on the bridge and
an address (``.10`` and up). The test's own process stays outside, at the
bridge address ``.1`` (``gateway``), and reaches every host over the bridge.
A process runs on a host under ``exec_prefix(key)`` (``ip netns exec``, which
execs the command: the PID a test holds is the program's own).

Faults, all made of packets dropped (``DROP``, never ``REJECT``: no reset or
ICMP error is sent, so open connections stall and new ones hang in SYN
retries, as on a cut cable):

- ``drop(at, peers, direction)``: iptables rules inside host ``at``'s
  namespace dropping what it receives from (``"in"``), sends to (``"out"``)
  or both (``"both"``) the ``peers``' addresses; a one-way partition of
  A -> B is ``drop(B, [ip(A)], "in")``. The controller (``gateway``) is never
  matched, so a test still observes every host.
- ``isolate(key)``: every packet host ``key`` sends or receives on its link is
  dropped, except to and from the controller (a host lost to its peers).
- ``cut(key)`` / ``reconnect(key)``: the bridge's side of the host's veth down
  and up (the controller loses it too).

``heal(rules)`` removes exactly the rules a call added; every rule dies with
its namespace anyway, so ``close()`` (namespaces, veths, the bridge) leaves
nothing behind, and names carry a random token: two runs in parallel do not
collide. ``unavailable()`` says why none of this works here (no root, no
``ip``/``iptables``, no namespaces); tests skip then, unless
WEHUB_PS_REQUIRE_NETFAULTS=1.
"""

from __future__ import annotations

import ipaddress
import os
import random
import re
import secrets
import shutil
import subprocess
from dataclasses import dataclass

__all__ = ["HostNetwork", "NetworkUnavailable", "Rule", "unavailable"]

COMMAND_TIMEOUT = 15.0


class NetworkUnavailable(RuntimeError):
    """Network namespaces, veths or bridges cannot be made here (the caller skips)."""


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip()}")
    return proc


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check)


def unavailable() -> str | None:
    """None when namespaces, veths, bridges and iptables inside namespaces work here; else why not."""
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install iproute2 iptables)"
    if os.geteuid() != 0:
        return "network namespaces and iptables rules need root"
    probe = f"wehub-probe-{secrets.token_hex(3)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        listed = _run(["ip", "netns", "exec", probe, "iptables", "-w", "5", "-L", "INPUT", "-n"], check=False)
        if listed.returncode != 0:
            return f"iptables does not work inside a network namespace: {listed.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _used_networks() -> list[ipaddress.IPv4Network]:
    nets = []
    for line in _ip("-4", "-o", "addr", "show", check=False).stdout.splitlines():
        found = re.search(r"inet (\S+)", line)
        if found:
            nets.append(ipaddress.ip_interface(found.group(1)).network)
    for line in _ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        parts = line.split()
        first = parts[0] if parts else ""
        if first in ("default", "broadcast", "local", "unreachable", "blackhole", "prohibit", "throw"):
            first = parts[1] if len(parts) > 1 and first != "default" else ""
        try:
            nets.append(ipaddress.ip_network(first, strict=False))
        except ValueError:
            pass
    return nets


@dataclass(frozen=True)
class Rule:
    """One iptables rule in a namespace: ``chain`` and its match (without ``-j DROP``)."""

    namespace: str
    chain: str
    match: tuple[str, ...]


class HostNetwork:
    """A bridge with one network namespace per host, each on a veth pair; ``close()`` deletes them all.

    Not thread-safe: one controller thread adds hosts and drops packets.
    """

    def __init__(self, prefix: str = "wh") -> None:
        self.token = secrets.token_hex(3)
        self.prefix = prefix
        self.bridge = f"{prefix}{self.token}br"
        self.namespaces: dict[str, str] = {}  # host key -> netns
        self.host_veths: dict[str, str] = {}
        self.ips: dict[str, str] = {}
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
        """A namespace for host ``key`` on the bridge: (netns name, its address)."""
        number = len(self.namespaces)
        namespace = f"wehub-{self.token}-{key}"
        host_veth, inner_veth = f"{self.prefix}{self.token}h{number}", f"{self.prefix}{self.token}p{number}"
        try:
            _ip("netns", "add", namespace)
        except RuntimeError as exc:
            raise NetworkUnavailable(f"cannot create a network namespace: {exc}") from None
        self.namespaces[key] = namespace
        address = str(next(self._next))
        _ip("link", "add", host_veth, "type", "veth", "peer", "name", inner_veth)
        self.host_veths[key] = host_veth
        _ip("link", "set", inner_veth, "netns", namespace)
        _ip("-n", namespace, "link", "set", inner_veth, "name", "eth0")
        _ip("link", "set", host_veth, "master", self.bridge)
        _ip("link", "set", host_veth, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        _ip("-n", namespace, "addr", "add", f"{address}/{self.network.prefixlen}", "dev", "eth0")
        _ip("-n", namespace, "link", "set", "eth0", "up")
        _ip("-n", namespace, "route", "add", "default", "via", self.gateway)
        self.ips[key] = address
        return namespace, address

    def ip(self, key: str) -> str:
        return self.ips[key]

    def exec_prefix(self, key: str) -> list[str]:
        """The argv prefix that runs a program on host ``key`` (``ip netns exec``: the PID is its own)."""
        return ["ip", "netns", "exec", self.namespaces[key]]

    # ---- packets dropped

    def drop(self, at: str, peers: list[str], direction: str) -> list[Rule]:
        """DROP, inside host ``at``, packets from (``"in"``), to (``"out"``) or both ways with ``peers``
        (addresses); the rules added, for ``heal``."""
        if direction not in ("in", "out", "both"):
            raise ValueError(f"direction must be 'in', 'out' or 'both', got {direction!r}")
        namespace = self.namespaces[at]
        rules = []
        for peer in peers:
            if direction in ("in", "both"):
                rules.append(Rule(namespace, "INPUT", ("-s", peer)))
            if direction in ("out", "both"):
                rules.append(Rule(namespace, "OUTPUT", ("-d", peer)))
        return self._add(rules)

    def isolate(self, key: str) -> list[Rule]:
        """DROP every packet host ``key`` sends or receives on its link but the controller's."""
        namespace = self.namespaces[key]
        return self._add([Rule(namespace, "INPUT", ("-i", "eth0", "!", "-s", self.gateway)),
                          Rule(namespace, "OUTPUT", ("-o", "eth0", "!", "-d", self.gateway))])

    def _add(self, rules: list[Rule]) -> list[Rule]:
        added = []
        try:
            for rule in rules:
                _run(["ip", "netns", "exec", rule.namespace, "iptables", "-w", "5", "-I", rule.chain,
                      *rule.match, "-j", "DROP"])
                added.append(rule)
        except RuntimeError:
            self.heal(added)
            raise
        return added

    def heal(self, rules: list[Rule]) -> None:
        """Remove ``rules`` (each once; a namespace already gone took its rules with it)."""
        for rule in rules:
            if rule.namespace in self.namespaces.values():
                _run(["ip", "netns", "exec", rule.namespace, "iptables", "-w", "5", "-D", rule.chain,
                      *rule.match, "-j", "DROP"], check=False)

    def cut(self, key: str) -> None:
        """Host ``key``'s link down (on the bridge's side): the controller loses it too."""
        _ip("link", "set", self.host_veths[key], "down")

    def reconnect(self, key: str) -> None:
        _ip("link", "set", self.host_veths[key], "up")

    # ---- the end

    def close(self) -> list[str]:
        """Delete namespaces (their rules with them), veths and the bridge; returns what failed."""
        problems = []
        for namespace in self.namespaces.values():
            done = _ip("netns", "del", namespace, check=False)
            if done.returncode != 0:
                problems.append(f"ip netns del {namespace}: {done.stderr.strip()}")
        for veth in self.host_veths.values():
            _ip("link", "del", veth, check=False)  # gone with its namespace's peer
        done = _ip("link", "del", self.bridge, check=False)
        if done.returncode != 0 and "Cannot find" not in done.stderr:
            problems.append(f"ip link del {self.bridge}: {done.stderr.strip()}")
        self.closed = True
        return problems

    def leftovers(self) -> list[str]:
        """The links and namespaces of this network that still exist (after ``close``: none)."""
        names = _ip("-o", "link", "show", check=False).stdout
        found = [n for n in [self.bridge, *self.host_veths.values()]
                 if f" {n}:" in names or f" {n}@" in names]
        listed = _ip("netns", "list", check=False).stdout
        return found + [ns for ns in self.namespaces.values() if ns in listed]
