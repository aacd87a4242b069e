"""The randomized fault test's replicated cluster: two replicas per shard on a real etcd, and their faults.

Each replica has its own FaultProxy; a worker is given a shard's proxies
in the replicated form ('p0|p1') and follows the primary through them. The
faults (``REPLICA_KINDS``) always leave one in-sync replica of each shard:
before each one the controller waits until the shard's other replica is in
the primary's in-sync set, and a killed or frozen replica is brought back
and waited for. So the oracle allows no loss at all (no loss window is ever
opened): every acknowledged push is in the values exactly once.
"""

from __future__ import annotations

import random
import signal
import time
import uuid

import grpc
from etcd_server import EtcdServer, etcd_binary
from ps_testing import ServerProcess
from replica_testing import Replica

from faults.cluster import Cluster
from faults.layout import NUM_SHARDS
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.rpc import method_path

REPLICAS = 2
LEASE_SECONDS = 1
#: kind -> weight. primary-stop: SIGSTOP the primary until the other replica leads, then SIGCONT.
REPLICA_KINDS = {"primary-kill": 3, "primary-stop": 1, "backup-kill": 2, "etcd-restart": 1}
#: The single-server kinds that also make sense with replicas (the rest stop or restart one server).
SHARED_KINDS = ("cut", "checkpoint", "worker-kill")
#: Modes ps-server refuses to replicate (sync steps are not replicated).
UNREPLICATED_MODES = ("sync",)
IN_SYNC_TIMEOUT = 60.0
ELECTION_TIMEOUT = 30.0


class ReplicatedCluster(Cluster):
    """``Cluster`` with ``REPLICAS`` replicas per shard; ``servers`` and ``proxies`` list every replica."""

    etcd: EtcdServer | None = None
    replicas: list[list[Replica]]

    def start_servers(self) -> None:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("the replicated mode needs etcd: apt-get install etcd-server, "
                               "or set ETCD_BINARY")
        self.etcd = EtcdServer(self.workdir / "etcd", binary).start()
        job = f"faults-{uuid.uuid4().hex[:8]}"
        self.draw_lane()
        self.replicas = []
        for shard in range(NUM_SHARDS):
            members = []
            for index in range(REPLICAS):
                directory = self.workdir / f"shard-{shard}-replica-{index}"
                directory.mkdir(parents=True, exist_ok=True)
                args = self._server_args()
                args[args.index("--checkpoint-dir") + 1] = str(directory / "ckpt")  # one per replica
                args += ["--replicas", str(REPLICAS), "--replica-index", str(index),
                         "--etcd-endpoints", self.etcd.endpoint, "--job-name", job,
                         "--primary-lease-seconds", str(LEASE_SECONDS), *self.lane_args()]
                # Port 0: the OS picks it at the first start; restarts reuse it.
                members.append(Replica(shard, index, ServerProcess(shard, NUM_SHARDS, directory, args), 0))
            self.replicas.append(members)
        self.servers = [replica.process for replica in self._all()]  # cleanup stops them, even if one fails
        for replica in self._all():
            replica.launch()
        for replica in self._all():
            replica.wait_ready()
        for shard in range(NUM_SHARDS):
            self.wait_in_sync(shard)

    def _all(self) -> list[Replica]:
        return [replica for members in self.replicas for replica in members]

    def admin_addresses(self) -> list[str]:
        return ["|".join(r.address for r in members) for members in self.replicas]

    def worker_addresses(self) -> list[str]:
        return ["|".join(p.address for p in self.proxies[shard * REPLICAS:(shard + 1) * REPLICAS])
                for shard in range(NUM_SHARDS)]

    def shard_proxies(self, shard: int) -> list:
        """The proxies in front of ``shard``'s replicas (and of their TCP lanes)."""
        replicas = slice(shard * REPLICAS, (shard + 1) * REPLICAS)
        return [*self.proxies[replicas], *self.lane_proxies[replicas]]

    # ---- the replicas' roles ----

    def primary(self, shard: int, timeout: float = ELECTION_TIMEOUT) -> Replica:
        deadline = time.monotonic() + timeout
        while True:
            for replica in self.replicas[shard]:
                if replica.running() and replica.is_primary():
                    return replica
            if time.monotonic() > deadline:
                raise RuntimeError(f"shard {shard} has no primary after {timeout:.0f}s")
            time.sleep(0.05)

    def wait_in_sync(self, shard: int, timeout: float = IN_SYNC_TIMEOUT) -> Replica:
        """Until the primary counts every other replica of ``shard`` in sync; the primary."""
        deadline = time.monotonic() + timeout
        while True:
            primary = self.primary(shard, timeout=max(1.0, deadline - time.monotonic()))
            try:
                backups = self._status(primary).backups
            except grpc.RpcError:  # between roles: asked again
                backups = []
            if len(backups) == REPLICAS - 1 and all(b.in_sync for b in backups):
                return primary
            if time.monotonic() > deadline:
                raise RuntimeError(f"shard {shard}: replicas not in sync after {timeout:.0f}s "
                                   f"(backups: {[(b.replica_index, b.in_sync) for b in backups]})")
            time.sleep(0.05)

    def _status(self, replica: Replica) -> ps_pb2.ReplicaStatus:
        """``replica``'s ReplicaStatus (Replica.status with the servers' bearer token)."""
        token = self.token_file.read_text().strip()
        with grpc.insecure_channel(replica.address) as channel:
            raw = channel.unary_unary(method_path("Describe"))(
                ps_pb2.DescribeRequest(any_replica=True).SerializeToString(), timeout=2,
                metadata=(("authorization", f"Bearer {token}"),))
        return ps_pb2.DescribeResponse.FromString(raw).replication

    # ---- the faults ----

    def replica_event(self, kind: str, shard: int, rng: random.Random) -> None:
        """Inject one of ``REPLICA_KINDS``; returns once every replica of ``shard`` is in sync again."""
        if kind == "etcd-restart":
            assert self.etcd is not None
            self.etcd.stop()
            time.sleep(rng.uniform(0.5, 3 * LEASE_SECONDS))  # primaries go on, proven by their backups
            self.etcd.restart()
            for each in range(NUM_SHARDS):
                self.wait_in_sync(each)
            return
        primary = self.wait_in_sync(shard)
        if kind == "primary-kill":
            self._kill_and_restart(primary, rng)
        elif kind == "backup-kill":
            self._kill_and_restart(next(r for r in self.replicas[shard] if r is not primary), rng)
        elif kind == "primary-stop":
            primary.process.signal(signal.SIGSTOP)
            try:
                deadline = time.monotonic() + ELECTION_TIMEOUT
                while not any(r is not primary and r.is_primary() for r in self.replicas[shard]):
                    if time.monotonic() > deadline:
                        self.report.fail("failover", f"shard {shard}: no replica took over from a primary "
                                                     f"frozen for {ELECTION_TIMEOUT:.0f}s")
                        break
                    time.sleep(0.05)
            finally:
                primary.process.signal(signal.SIGCONT)
        else:
            raise ValueError(f"unknown replicated fault kind {kind!r}")
        self.wait_in_sync(shard)

    def _kill_and_restart(self, replica: Replica, rng: random.Random) -> None:
        replica.process.signal(signal.SIGKILL)
        replica.process.wait(30)
        time.sleep(rng.uniform(0, 0.5))  # workers retry against a dead address, or follow the survivor
        replica.start()  # the same port and checkpoint directory: a new incarnation that catches up

    def cleanup(self) -> None:
        for server in self.servers:
            server.signal(signal.SIGCONT)
        super().cleanup()
        if self.etcd is not None:
            self.etcd.kill()
