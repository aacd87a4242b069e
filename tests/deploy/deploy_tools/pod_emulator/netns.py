"""Separate network hosts for pods: ``host_network.HostNetwork`` (a namespace per pod, veth pairs on a
bridge, an address per pod), plus /etc/netns files as cluster DNS would answer and each pod's hostname;
pods can be cut off and reconnected."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from .cluster_dns import search_domains

_TESTS = Path(__file__).resolve().parents[3]
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))

from host_network import HostNetwork, NetworkUnavailable

__all__ = ["NetworkUnavailable", "PodNetwork"]


class PodNetwork(HostNetwork):
    """A ``HostNetwork`` whose hosts are pods: names carry a random token, the subnet is a random free
    10.x.y.0/24, so runs in parallel do not collide. The host gets ``.1`` on the bridge (it stands for
    the node: kubelet's probes and our evaluation client come from there); pods get ``.10`` and up.
    ``close()`` deletes everything, the /etc/netns files too."""

    def __init__(self) -> None:
        self.etc_dirs: list[Path] = []
        self.made_etc_netns = not Path("/etc/netns").exists()
        super().__init__(prefix="wp")

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

    def rewrite_hosts(self, key: str, hosts: str) -> None:
        """Pod ``key``'s hosts file, rewritten in place (the inode that ``ip netns exec`` bound over
        its running processes' /etc/hosts): a name now answers as cluster DNS answers after a pod
        moved to another node."""
        with open(Path("/etc/netns") / self.namespaces[key] / "hosts", "r+") as file:
            file.truncate(0)
            file.write(hosts)

    def exec_prefix(self, key: str, hostname: str | None = None) -> list[str]:
        """Run in pod ``key``'s namespace, under its own hostname (a UTS namespace of its own)."""
        prefix = super().exec_prefix(key)
        if hostname is None:
            return prefix
        return [*prefix, "unshare", "--uts", "--", "sh", "-c", 'hostname "$0"; exec "$@"', hostname]

    def close(self) -> list[str]:
        """Delete namespaces, veths, the bridge and /etc/netns dirs; returns what failed."""
        problems = super().close()
        for directory in self.etc_dirs:
            shutil.rmtree(directory, ignore_errors=True)
        if self.made_etc_netns:
            try:
                Path("/etc/netns").rmdir()  # only if empty: another run may be using it
            except OSError:
                pass
        return problems

    def leftovers(self) -> list[str]:
        return super().leftovers() + [str(d) for d in self.etc_dirs if d.exists()]
