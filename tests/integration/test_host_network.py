"""The network nemesis's tools: hosts in network namespaces (tests/host_network.py) and a 3-member etcd
cluster on them (tests/etcd_cluster.py).

Packets dropped one way or both ways stall a connection instead of failing
it, the controller (this process) keeps reaching every host, healing
removes exactly the rules added, and ``close()`` leaves no namespace, veth
or bridge behind. An etcd leader cut off from the other members is
replaced, and a killed member rejoins. Skips without root, namespaces or
iptables, unless WEHUB_PS_REQUIRE_NETFAULTS=1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from etcd_cluster import EtcdCluster
from etcd_server import etcd_binary
from host_network import HostNetwork, unavailable


@pytest.fixture
def net():
    why = unavailable()
    if why:
        if os.environ.get("WEHUB_PS_REQUIRE_NETFAULTS") == "1":
            pytest.fail(f"{why} (WEHUB_PS_REQUIRE_NETFAULTS=1 requires network faults)")
        pytest.skip(why)
    network = HostNetwork()
    try:
        yield network
    finally:
        assert network.close() == []
        assert network.leftovers() == []


_CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.0).close()
    print("connected")
except OSError as error:
    print(type(error).__name__)
"""


def _connect(net: HostNetwork, where: str | None, address: str, port: int) -> str:
    """What a TCP connect from host ``where`` (None: the controller) to ``address:port`` gives."""
    prefix = net.exec_prefix(where) if where else []
    done = subprocess.run([*prefix, sys.executable, "-c", _CONNECT, address, str(port)], capture_output=True,
                          text=True, timeout=30, check=False)
    return done.stdout.strip()


def _connects(net: HostNetwork, where: str | None, address: str, port: int, within: float = 15.0) -> bool:
    """Whether a connect succeeds within ``within`` s (a loaded machine may miss one 1 s attempt)."""
    deadline = time.monotonic() + within
    while _connect(net, where, address, port) != "connected":
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.timeout(180)
def test_drops_stall_connections_one_way_or_both_and_heal(net):
    net.add("a")
    net.add("b")
    program = (f"import socket\ns = socket.create_server(('{net.ip('b')}', 7000)); s.listen(64)\n"
               "while True:\n    s.accept()[0].close()\n")
    server = subprocess.Popen([*net.exec_prefix("b"), sys.executable, "-c", program],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert _connects(net, None, net.ip("b"), 7000, within=30), "the server in host b never listened"
        assert _connects(net, "a", net.ip("b"), 7000)
        for fault in (lambda: net.drop("b", [net.ip("a")], "in"),  # a -> b dropped
                      lambda: net.drop("a", [net.ip("b")], "in"),  # b -> a dropped: no SYN-ACK arrives
                      lambda: net.drop("a", [net.ip("b")], "both"),
                      lambda: net.isolate("b")):
            rules = fault()
            assert _connect(net, "a", net.ip("b"), 7000) == "TimeoutError"  # dropped, never refused
            assert _connects(net, None, net.ip("b"), 7000)  # the controller still reaches b
            net.heal(rules)
            assert _connects(net, "a", net.ip("b"), 7000)
        net.cut("b")
        assert _connect(net, None, net.ip("b"), 7000) == "TimeoutError"
        net.reconnect("b")
        assert _connects(net, "a", net.ip("b"), 7000)
    finally:
        server.kill()
        server.wait(30)


@pytest.mark.timeout(180)
def test_etcd_cluster_replaces_a_cut_off_leader_and_takes_back_a_killed_member(net, tmp_path):
    binary = etcd_binary()
    if binary is None:
        pytest.skip("etcd is not installed: apt-get install etcd-server, or set ETCD_BINARY")
    hosts = []
    for index in range(3):
        net.add(f"etcd{index}")
        hosts.append((net.ip(f"etcd{index}"), net.exec_prefix(f"etcd{index}")))
    cluster = EtcdCluster(tmp_path, binary, hosts)
    try:
        cluster.start()
        leader = cluster.leader()
        assert leader is not None
        others = [m.address for m in cluster.members if m is not leader]
        rules = net.drop(f"etcd{cluster.members.index(leader)}", others, "both")
        deadline = time.monotonic() + 30
        while (now := cluster.leader()) is None or now is leader:
            assert time.monotonic() < deadline, "no other member took over from the cut-off leader"
            time.sleep(0.1)
        net.heal(rules)
        cluster.wait_ready()
        victim = cluster.members[0]
        cluster.kill(victim)
        assert not victim.running()
        cluster.restart(victim)
        assert victim.running() and victim.status() is not None
    finally:
        cluster.kill_all()
