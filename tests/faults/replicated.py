"""The randomized fault test's replicated cluster: two replicas per shard on a real etcd, and their faults.

Each replica has its own FaultProxy; a worker is given a shard's proxies
in the replicated form ('p0|p1') and follows the primary through them. The
faults (``REPLICA_KINDS``) always leave one in-sync replica of each shard:
before each one the controller waits until the shard's other replica is in
the primary's in-sync set, a fault on the primary holds only if etcd's
in-sync set still names the backup once it is in place (``fault_on_primary``;
else it is undone at once and tried again), and a killed or frozen replica
is brought back and waited for. So the oracle allows no loss at all (no loss window is ever
opened): every acknowledged push is in the values exactly once.

At the end (``check_replicas``) every replica of a shard writes a checkpoint
at the same point of the shard's order, and they must hold the same bits:
values, optimizer slots, hash-table rows, versions and the ledger, also
after the pushes the "limit" kind has refused part way (a message whose
later chunk a full table refused keeps the chunks before it, on every
replica); the rows those pushes applied must also have survived every
failover.
"""

from __future__ import annotations

import random
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
from etcd_server import EtcdServer, etcd_binary
from ps_testing import ServerProcess
from replica_testing import Replica, checkpoint_contents

from faults.cluster import Cluster
from faults.layout import NUM_SHARDS
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.rpc import method_path

REPLICAS = 2
LEASE_SECONDS = 1
#: kind -> weight. primary-stop: SIGSTOP the primary until the other replica leads, then SIGCONT.
#: primary-term: SIGTERM the primary (it hands its role to the in-sync backup first), then restart it;
#: switchover: an operator's switchover (PSClient.switchover, as ps-admin's) to the in-sync backup.
REPLICA_KINDS = {"primary-kill": 3, "primary-stop": 1, "backup-kill": 2, "etcd-restart": 1, "primary-term": 1,
                 "switchover": 1}
#: The single-server kinds that also make sense with replicas (the rest stop or restart one server).
#: "limit" pushes over a table's free rows, also one message refused part way (probes.refused_part_way).
SHARED_KINDS = ("cut", "checkpoint", "worker-kill", "limit")
IN_SYNC_TIMEOUT = 60.0
#: What Python logs when a replica's role thread dies of an exception; looked for after ROLE_LOOK_AFTER s of
#: waiting for a shard's replicas to get in sync.
ROLE_DIED = "Exception in thread ps-replica:"
ROLE_LOOK_AFTER = 10.0
#: What a backup logs when it could not apply its primary's record (and starts over with a snapshot).
DIVERGED = '"event": "cannot apply the primary\'s change"'
#: What a backup logs when its primary's stream skipped or swapped a record (never right).
GAP = '"event": "a record does not continue the log; starting over"'

ELECTION_TIMEOUT = 30.0


class ReplicatedCluster(Cluster):
    """``Cluster`` with ``REPLICAS`` replicas per shard; ``servers`` and ``proxies`` list every replica."""

    etcd: EtcdServer | None = None
    replicas: list[list[Replica]]
    #: Rows that pushes refused part way applied, as read back then: (table, ids, values).
    refused_prefixes: list[tuple[str, np.ndarray, np.ndarray]]

    def start_servers(self) -> None:
        self.refused_prefixes = []
        self._roles_died: dict[tuple[int, int], int] = {}
        self._start_replicas()

    def _start_replicas(self) -> None:
        endpoints = self.etcd_endpoints = self.start_etcd()
        job = self.job = f"faults-{uuid.uuid4().hex[:8]}"
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
                         "--etcd-endpoints", endpoints, "--job-name", job,
                         "--primary-lease-seconds", str(LEASE_SECONDS)]
                members.append(self.make_replica(shard, index, directory, args))
            self.replicas.append(members)
        self.servers = [replica.process for replica in self._all()]  # cleanup stops them, even if one fails
        for replica in self._all():
            replica.launch()
        for replica in self._all():
            replica.wait_ready()
        for shard in range(NUM_SHARDS):
            self.wait_in_sync(shard)

    def start_etcd(self) -> str:
        """Start etcd; its endpoints as ``--etcd-endpoints`` takes them."""
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("the replicated mode needs etcd: apt-get install etcd-server, "
                               "or set ETCD_BINARY")
        self.etcd = EtcdServer(self.workdir / "etcd", binary).start()
        return self.etcd.endpoint

    def make_replica(self, shard: int, index: int, directory, args: list[str]) -> Replica:
        """Replica ``index`` of ``shard`` (not started), with the flags every replica gets."""
        # Port 0: the OS picks it at the first start; restarts reuse it.
        process = ServerProcess(shard, NUM_SHARDS, directory, [*args, *self.lane_args()])
        return Replica(shard, index, process, 0)

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
        """Until the primary counts every other replica of ``shard`` in sync; the primary.

        A replica whose role thread died (it would never follow again) is a
        failure; it is restarted, so the run goes on and the oracle still runs.
        """
        deadline = time.monotonic() + timeout
        next_look = time.monotonic() + ROLE_LOOK_AFTER
        while True:
            if time.monotonic() > next_look:
                self._restart_dead_roles(shard)
                next_look = time.monotonic() + 2.0
            primary = self.primary(shard, timeout=max(1.0, deadline - time.monotonic()))
            try:
                backups = self._status(primary).backups
            except grpc.RpcError:  # between roles: asked again
                backups = []
            if len(backups) == REPLICAS - 1 and all(b.in_sync for b in backups):
                return primary
            if time.monotonic() > deadline:
                raise RuntimeError(f"shard {shard}: replicas not in sync after {timeout:.0f}s "
                                   f"(backups: {[(b.replica_index, b.in_sync) for b in backups]}); the "
                                   f"replicas' last warnings:\n{self.log_tails(shard)}")
            time.sleep(0.05)

    def _restart_dead_roles(self, shard: int) -> None:
        """Report and restart each replica of ``shard`` whose ``ps-replica`` thread died since last seen."""
        for replica in self.replicas[shard]:
            text = replica.process.log_text()
            died = text.count(ROLE_DIED)
            key = (shard, replica.replica_index)
            if died <= self._roles_died.get(key, 0):
                continue
            self._roles_died[key] = died
            where = text.rfind(ROLE_DIED)
            self.report.fail("replica role died",
                             f"shard {shard} replica {replica.replica_index}: its ps-replica thread died, so "
                             f"it never follows or leads again (restarted it; {replica.process.log_path}):\n"
                             f"{text[where:where + 1500]}")
            replica.process.signal(signal.SIGKILL)
            replica.process.wait(30)
            replica.start()

    def log_tails(self, shard: int, lines: int = 6) -> str:
        """The last ``lines`` log lines at warning or above of each replica of ``shard`` (for a failure)."""
        tails = []
        for replica in self.replicas[shard]:
            found = [line for line in replica.process.log_text().splitlines()
                     if '"level": "warning"' in line or '"level": "error"' in line or "Traceback" in line]
            tails.append(f"replica {replica.replica_index} ({replica.process.log_path}):\n  "
                         + "\n  ".join(line[:400] for line in found[-lines:]))
        return "\n".join(tails)

    def wait_caught_up(self, shard: int, timeout: float = IN_SYNC_TIMEOUT) -> None:
        """Until every running replica of ``shard`` applied all its primary had applied when asked."""
        primary = self.wait_in_sync(shard, timeout)
        target = self._status(primary).applied_sequence
        deadline = time.monotonic() + timeout
        for replica in self.replicas[shard]:
            while (replica is not primary and replica.running()
                   and self._status(replica).applied_sequence < target):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"shard {shard}: replica {replica.replica_index} did not apply "
                                       f"sequence {target} within {timeout:.0f}s")
                time.sleep(0.05)

    def check_replicas(self) -> None:
        """At the end, the workers stopped: every replica of a shard holds the same bits.

        A ``checkpoint()`` makes every in-sync replica write one at the same
        point of its shard's order; their values, optimizer slots, hash-table
        rows, versions and ledgers are compared. The rows of pushes refused
        part way must hold what they held after the refusal.
        """
        for shard in range(NUM_SHARDS):
            self.wait_in_sync(shard)
        self.call_admin(lambda c: c.checkpoint())
        for shard in range(NUM_SHARDS):
            self.wait_caught_up(shard)
            (first, *others) = self.replicas[shard]
            expected = checkpoint_contents(self._newest_checkpoint(first))
            for replica in others:
                differ = _differences(expected, checkpoint_contents(self._newest_checkpoint(replica)))
                if differ:
                    self.report.fail("replicas differ", f"shard {shard}: replicas {first.replica_index} and "
                                                        f"{replica.replica_index} differ in {differ}")
        self._check_no_divergence()
        for table, ids, values in self.refused_prefixes:
            now = self.call_admin(lambda c, table=table, ids=ids: c.pull_rows(table, ids))
            if now.tobytes() != values.tobytes():
                self.report.fail("refused push", f"{table} rows {ids.tolist()} that a push refused part way "
                                                  f"applied held {values.tolist()}, now {now.tolist()}")

    def _check_no_divergence(self) -> None:
        """No backup was sent a record that does not continue its log (a primary's records are numbered
        and queued in one order), and none failed to apply one (each costs a new snapshot).

        A catch-up snapshot carries the push streams open in it, so outside
        sync mode none may fail. A sync push's gradients are staged on the
        primary until it ends; a snapshot waits a bounded time for none to be
        open, so there a failure is counted in a note, not a violation.
        """
        for shard in range(NUM_SHARDS):
            for replica in self.replicas[shard]:
                lines = replica.process.log_text().splitlines()
                gaps = [line for line in lines if GAP in line]
                if gaps:
                    self.report.fail("log gap", f"shard {shard} replica {replica.replica_index} was sent "
                                                f"{len(gaps)} records that do not continue its log: {gaps[0][:600]}")
                found = [line for line in lines if DIVERGED in line]
                if not found:
                    continue
                if self.config["consistency"] == "sync":
                    self.report.notes.append(f"shard {shard} replica {replica.replica_index}: {len(found)} "
                                             "records not applied (a sync push open in a snapshot)")
                else:
                    self.report.fail("replica diverged", f"shard {shard} replica {replica.replica_index} could "
                                                         f"not apply {len(found)} records: {found[0][:600]}")

    def _newest_checkpoint(self, replica: Replica):
        """The newest checkpoint in ``replica``'s own --checkpoint-dir."""
        found = sorted((replica.process.workdir / "ckpt").glob("shard-*/ckpt-*"))
        if not found:
            raise RuntimeError(f"replica {replica.replica_index} of shard {replica.shard_index} wrote no "
                               "checkpoint")
        return found[-1]

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
        if kind == "primary-kill":
            primary = self.fault_on_primary(shard, lambda p: p.process.freeze(),
                                            lambda p: p.process.signal(signal.SIGCONT))
            self.timeline.failovers.append(("process death", time.time()))
            self._kill_and_restart(primary, rng)  # frozen, so it acknowledged nothing since the check
        elif kind == "primary-term":
            # Frozen while etcd's in-sync set is checked, so the SIGTERM meets it with its backup in sync.
            primary = self.fault_on_primary(shard, lambda p: p.process.freeze(),
                                            lambda p: p.process.signal(signal.SIGCONT))
            self.timeline.failovers.append(("planned switchover", time.time()))
            primary.process.signal(signal.SIGTERM)
            primary.process.signal(signal.SIGCONT)
            primary.process.wait(60)
            time.sleep(rng.uniform(0, 0.5))
            primary.start()
        elif kind == "switchover":
            from worker_client import FailedPreconditionError, PSUnavailableError

            self.wait_in_sync(shard)
            try:
                self.call_admin(lambda c: c.switchover(shard))
            except FailedPreconditionError as error:  # the backup left the in-sync set meanwhile
                self.report.notes.append(f"shard {shard}: a switchover was refused: {error}")
            except PSUnavailableError as error:  # the answer was lost (handed over or not): the oracle holds
                self.report.notes.append(f"shard {shard}: a switchover's answer was lost: {error}")
        elif kind == "backup-kill":
            primary = self.wait_in_sync(shard)
            self._kill_and_restart(next(r for r in self.replicas[shard] if r is not primary), rng)
        elif kind == "primary-stop":
            primary = self.fault_on_primary(shard, lambda p: p.process.freeze(),
                                            lambda p: p.process.signal(signal.SIGCONT))
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

    def fault_on_primary(self, shard: int, inject: Callable[[Replica], Any], undo: Callable[[Replica], Any],
                         attempts: int = 10) -> Replica:
        """Inject a fault on ``shard``'s primary while its backup is in sync; the primary.

        The backup can leave the in-sync set between ``wait_in_sync`` and the
        fault (a slow answer), and then the primary is the only in-sync
        replica: losing it may lose what it acknowledged alone. So once
        ``inject`` holds (the primary frozen, or cut off), etcd's in-sync set,
        which the primary must shrink before it acknowledges without the backup,
        is read: if it no longer names the backup, ``undo`` at once and try again.
        """
        for attempt in range(attempts):
            primary = self.wait_in_sync(shard)
            backup = next(r for r in self.replicas[shard] if r is not primary)
            inject(primary)
            if self.in_sync_set_names(shard, backup):
                return primary
            undo(primary)
            self.report.notes.append(f"shard {shard}: the backup left the in-sync set just before a fault on "
                                     "the primary; the fault was undone and injected again")
        raise RuntimeError(f"shard {shard}: the backup kept leaving the in-sync set ({attempts} tries)")

    def in_sync_set_names(self, shard: int, replica: Replica) -> bool:
        """Whether etcd's in-sync set of ``shard`` (what an election counts) names ``replica``."""
        from ps_server.coordination import EtcdClient, InSync, ShardKeys

        client = EtcdClient(self.etcd_endpoints.split(","), timeout=2.0)
        try:
            kv = client.get(ShardKeys(self.job, shard).isr)
        finally:
            client.close()
        return kv is not None and any(index == replica.replica_index
                                      for index, _ in InSync.from_kv(kv).members)

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


def _differences(first: tuple[dict, dict], second: tuple[dict, dict]) -> list[str]:
    """What two checkpoints (checkpoint_contents) hold differently: tensor names, "variables", "ledger"."""
    (tensors_a, state_a), (tensors_b, state_b) = first, second
    names = sorted(set(tensors_a) | set(tensors_b))
    differ = [name for name in names if name not in tensors_a or name not in tensors_b
              or tensors_a[name].dtype != tensors_b[name].dtype
              or tensors_a[name].tobytes() != tensors_b[name].tobytes()]
    return differ + [key for key in ("variables", "ledger") if state_a.get(key) != state_b.get(key)]
