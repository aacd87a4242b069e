"""Partitions of one loopback port for network fault tests: packets dropped, no reset sent.

``PortPartition(port)`` adds iptables rules that DROP every loopback TCP
packet to or from ``port`` (a port the test's own server listens on, so
nothing else on the machine is touched): open connections stall as on a
cut link, new ones hang in SYN retries. ``heal()`` removes exactly the
rules it added (matched by a comment naming this process and port), and
the context manager heals on exit, so a failing test never leaves a rule
behind. Needs root and iptables; ``available()`` says whether they work
here (tests skip otherwise, unless WEHUB_PS_REQUIRE_NETFAULTS=1).
"""

from __future__ import annotations

import os
import shutil
import subprocess

__all__ = ["PortPartition", "available"]


def _iptables(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["iptables", "-w", "5", *args], capture_output=True, text=True, timeout=30)


def available() -> str | None:
    """None when loopback partitions can be made here, else why not."""
    if shutil.which("iptables") is None:
        return "iptables is not installed (apt-get install iptables)"
    if os.geteuid() != 0:
        return "iptables rules need root"
    listed = _iptables("-L", "INPUT", "-n")
    if listed.returncode != 0:
        return f"iptables does not work here: {listed.stderr.strip()}"
    return None


class PortPartition:
    """Drops loopback TCP packets to and from ``port`` while active."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._comment = f"wehub-ps-test-{os.getpid()}-{port}"
        self._rules = [("-p", "tcp", "-i", "lo", "--dport", str(port)),
                       ("-p", "tcp", "-i", "lo", "--sport", str(port))]
        self.active = False

    def cut(self) -> PortPartition:
        for rule in self._rules:
            done = _iptables("-I", "INPUT", *rule, "-m", "comment", "--comment", self._comment, "-j", "DROP")
            if done.returncode != 0:
                self.heal()
                raise RuntimeError(f"iptables refused the rule: {done.stderr.strip()}")
        self.active = True
        return self

    def heal(self) -> None:
        for rule in self._rules:
            while _iptables("-D", "INPUT", *rule, "-m", "comment", "--comment", self._comment,
                            "-j", "DROP").returncode == 0:
                pass
        self.active = False

    def __enter__(self) -> PortPartition:
        return self.cut()

    def __exit__(self, *exc: object) -> None:
        self.heal()
