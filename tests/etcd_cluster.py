"""A real 3-member etcd cluster for tests, one member per network host, killed and restarted by PID.

``EtcdCluster(workdir, binary, hosts)``: ``hosts`` is one ``(address, argv
prefix)`` per member (``host_network.HostNetwork.exec_prefix``: each member in
its own network namespace, listening on its own address, client port 2379
and peer port 2380, so members can be partitioned from each other). The
binary is ``etcd_server.etcd_binary()``.

Raft timing: ``--heartbeat-interval 50 --election-timeout 500`` (ms): a
member that hears nothing from the leader for 0.5 s starts an election, so a
partitioned leader is replaced within about a second, while a loaded test
machine's scheduling hiccups (tens of ms) do not start elections. etcd's
shortest lease is 1.5 election timeouts rounded up to whole seconds: 1 s.

``endpoints`` lists every member's ``address:2379``; ``leader()`` asks the
members (over HTTP, etcd's JSON gateway) which one leads.
"""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

__all__ = ["EtcdCluster", "EtcdMember"]

CLIENT_PORT = 2379
PEER_PORT = 2380
HEARTBEAT_MS = 50
ELECTION_TIMEOUT_MS = 500
START_TIMEOUT = 60.0


@dataclass
class EtcdMember:
    """One member: ``name``, its address, the argv prefix that runs it on its host."""

    name: str
    address: str
    prefix: list[str]
    workdir: pathlib.Path
    popen: subprocess.Popen | None = None
    starts: int = field(default=0)

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{CLIENT_PORT}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.address}:{PEER_PORT}"

    @property
    def log_path(self) -> pathlib.Path:
        return self.workdir / f"{self.name}.log"

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, signum: int) -> None:
        if self.running():
            assert self.popen is not None
            self.popen.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL, by PID, and wait."""
        if self.running():
            assert self.popen is not None
            self.popen.kill()
            self.popen.wait(30)

    def stop(self) -> None:
        """SIGTERM (etcd flushes and exits), SIGKILL after 10 s."""
        if not self.running():
            return
        assert self.popen is not None
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()

    def status(self, timeout: float = 1.0) -> dict | None:
        """This member's maintenance status (``member_id``, ``leader``, ...), None when it does not answer."""
        request = urllib.request.Request(f"http://{self.endpoint}/v3/maintenance/status", data=b"{}",
                                         method="POST", headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                return json.loads(answer.read())
        except (OSError, urllib.error.URLError, ValueError):
            return None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class EtcdCluster:
    """Members started together; ``kill``/``restart`` one, ``stop``/``restart_all`` them all; data kept."""

    def __init__(self, workdir: pathlib.Path, binary: str, hosts: list[tuple[str, list[str]]]) -> None:
        self.workdir = workdir
        self.binary = binary
        self.members = [EtcdMember(f"m{i}", address, list(prefix), workdir) for i, (address, prefix)
                        in enumerate(hosts)]
        self.initial_cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def _argv(self, member: EtcdMember) -> list[str]:
        client_url = f"http://{member.endpoint}"
        return [*member.prefix, self.binary, "--name", member.name,
                "--data-dir", str(self.workdir / f"{member.name}-data"),
                "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                "--listen-peer-urls", member.peer_url, "--initial-advertise-peer-urls", member.peer_url,
                "--initial-cluster", self.initial_cluster, "--initial-cluster-state", "new",
                "--initial-cluster-token", f"wehub-{id(self)}",
                "--heartbeat-interval", str(HEARTBEAT_MS), "--election-timeout", str(ELECTION_TIMEOUT_MS),
                "--logger", "zap", "--log-level", "warn"]

    def _launch(self, member: EtcdMember) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with member.log_path.open("ab") as log:
            member.popen = subprocess.Popen(self._argv(member), stdout=log, stderr=log,
                                            stdin=subprocess.DEVNULL)
        member.starts += 1

    def start(self) -> EtcdCluster:
        """Start every member; returns once the cluster has a leader that every member knows."""
        for member in self.members:
            self._launch(member)
        self.wait_ready()
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Until every running member answers and names the same leader."""
        deadline = time.monotonic() + timeout
        while True:
            for member in self.members:
                if member.popen is not None and member.popen.poll() is not None:
                    raise RuntimeError(f"etcd member {member.name} exited with {member.popen.returncode}:\n"
                                       f"{member.log_text()[-3000:]}")
            leaders = {(s or {}).get("leader") for s in (m.status() for m in self.members if m.running())}
            if len(leaders) == 1 and None not in leaders and "0" not in leaders:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd cluster without one leader after {timeout:.0f}s (leaders seen: "
                                   f"{leaders}):\n" + "\n".join(m.log_text()[-1500:] for m in self.members))
            time.sleep(0.1)

    def leader(self) -> EtcdMember | None:
        """The member most answering members name as leader (None: none answers, or no leader now)."""
        ids = {}
        votes: dict[str, int] = {}
        for member in self.members:
            found = member.status() if member.running() else None
            if found:
                ids[found["header"]["member_id"]] = member
                votes[found.get("leader", "0")] = votes.get(found.get("leader", "0"), 0) + 1
        named = max(votes, key=votes.__getitem__) if votes else None  # a cut-off old leader is outvoted
        return ids.get(named) if named else None

    def kill(self, member: EtcdMember) -> None:
        member.kill()

    def restart(self, member: EtcdMember) -> None:
        """Start ``member`` again on its data (it rejoins the cluster); returns once the cluster agrees."""
        member.stop()
        self._launch(member)
        self.wait_ready()

    def restart_all(self) -> None:
        for member in self.members:
            member.stop()
        for member in self.members:
            self._launch(member)
        self.wait_ready()

    def stop(self) -> None:
        """Every member stopped (SIGTERM, then SIGKILL), by PID."""
        for member in self.members:
            member.stop()

    def kill_all(self) -> None:
        for member in self.members:
            member.kill()
