"""The replicated randomized fault test on separate network hosts (``--network``): the nemesis's cluster.

``NetworkedCluster`` is ``ReplicatedCluster`` with every party on a host of
its own (``host_network.HostNetwork``: a network namespace, a veth on a
bridge, an address): each replica (``s<shard>r<index>``), each worker
(``w<index>``) and each member of a 3-member etcd cluster (``etcd<i>``,
``etcd_cluster.EtcdCluster``). A replica listens on its host's address,
port ``PORT`` (its lane on ``LANE_PORT``), announces it with
``--advertise-address`` and its replication port through etcd; workers
reach the replicas directly (no fault proxies: the faults are the network's,
``nemesis.NETWORK_KINDS``). The controller (admin client, oracle, replica
comparison) stays on this host and reaches every host over the bridge; no
fault drops its packets except ``link-down``.

``cleanup`` stops every process by PID, then deletes the namespaces (and
their iptables rules), veths and the bridge; anything left is a failure.
``unavailable()`` says why this cannot run here.
"""

from __future__ import annotations

import pathlib
import time

from etcd_cluster import EtcdCluster
from etcd_server import etcd_binary
from host_network import HostNetwork
from host_network import unavailable as network_unavailable
from ps_testing import ServerProcess
from replica_testing import Replica

from faults.layout import NUM_SHARDS, WORKERS
from faults.nemesis import Nemesis
from faults.replicated import LEASE_SECONDS, REPLICAS, ReplicatedCluster

PORT = 7070
LANE_PORT = 7072
ETCD_MEMBERS = 3


def unavailable() -> str | None:
    """None when the networked mode can run here (etcd, namespaces, iptables), else why not."""
    if etcd_binary() is None:
        return "etcd is not installed: apt-get install etcd-server, or set ETCD_BINARY"
    return network_unavailable()


class NetworkedCluster(ReplicatedCluster):
    """``ReplicatedCluster`` with every replica, worker and etcd member on a network host of its own."""

    covers_every_kind = True
    net: HostNetwork | None = None
    etcd_cluster: EtcdCluster

    def setup(self) -> None:
        self.net = HostNetwork(prefix="wn")
        for key in [*(f"etcd{i}" for i in range(ETCD_MEMBERS)), *(f"w{i}" for i in range(WORKERS)),
                    *(f"s{s}r{r}" for s in range(NUM_SHARDS) for r in range(REPLICAS))]:
            self.net.add(key)
        self.nemesis = Nemesis(self)
        self.report.notes.append(f"network hosts on {self.net.network}, bridge {self.net.bridge}, etcd: "
                                 f"{ETCD_MEMBERS} members, lease {LEASE_SECONDS}s")
        super().setup()

    # ---- the hosts

    def replica_host(self, replica: Replica) -> str:
        return f"s{replica.shard_index}r{replica.replica_index}"

    def worker_host(self, index: int) -> str:
        return f"w{index}"

    def etcd_host(self, member) -> str:
        return f"etcd{self.etcd_cluster.members.index(member)}"

    def worker_prefix(self, index: int) -> list[str]:
        assert self.net is not None
        return self.net.exec_prefix(self.worker_host(index))

    # ---- the processes

    def start_etcd(self) -> str:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("the networked mode needs etcd: apt-get install etcd-server, "
                               "or set ETCD_BINARY")
        assert self.net is not None
        hosts = [(self.net.ip(f"etcd{i}"), self.net.exec_prefix(f"etcd{i}")) for i in range(ETCD_MEMBERS)]
        self.etcd_cluster = EtcdCluster(self.workdir / "etcd", binary, hosts).start()
        return ",".join(self.etcd_cluster.endpoints)

    def make_replica(self, shard: int, index: int, directory: pathlib.Path, args: list[str]) -> Replica:
        assert self.net is not None
        key = f"s{shard}r{index}"
        address = self.net.ip(key)
        args = [*args, "--advertise-address", f"{address}:{PORT}"]
        if self.tcp_lane:
            args += ["--lane-port", str(LANE_PORT)]
        process = ServerProcess(shard, NUM_SHARDS, directory, args, host=address,
                                prefix=self.net.exec_prefix(key))
        return Replica(shard, index, process, PORT)

    def draw_lane(self) -> None:
        super().draw_lane()
        if self.tcp_lane:
            self.report.notes[-1] = "small pulls and pushes over TCP lanes (--lane-port), reached directly"

    def make_proxies(self) -> list:
        return []

    def worker_addresses(self) -> list[str]:
        return self.admin_addresses()

    def shard_proxies(self, shard: int) -> list:
        return []

    # ---- the faults of ReplicatedCluster that differ here

    def replica_event(self, kind: str, shard: int, rng) -> None:
        if kind != "etcd-restart":
            super().replica_event(kind, shard, rng)
            return
        self.etcd_cluster.stop()  # every member: primaries go on, proven by their backups
        try:
            time.sleep(rng.uniform(0.5, 3 * LEASE_SECONDS))
        finally:
            self.etcd_cluster.restart_all()
        for each in range(NUM_SHARDS):
            self.wait_in_sync(each)

    def cleanup(self) -> None:
        try:
            super().cleanup()
        finally:
            if getattr(self, "etcd_cluster", None) is not None:
                self.etcd_cluster.kill_all()
            if self.net is not None:
                problems = self.net.close() + self.net.leftovers()
                if problems:
                    self.report.fail("cleanup", f"network hosts left behind: {problems}")
