"""The faults that check a guarantee as they run, each reporting its own violations.

Token rotation (a rotated-out token is refused, also on an open stream),
requests over a table's bound (refused, nothing changed; a push message
refused part way keeps what it applied before the refusal), idle clients
holding streams (control calls still served), and Checkpoint calls while a
restarted server restores (no checkpoint lacks a variable).
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import random
import threading
import time

import grpc
import numpy as np

from faults.cluster import Cluster
from faults.layout import IDLE_CLIENTS, LIMIT_ROWS, VARIABLES
from faults.replicated import ReplicatedCluster
from faults.report import Report, Timeline
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.rpc import method_path

TOKEN_GRACE = 4.0  # seconds a server may take to notice a rotated token file (it re-reads every 2 s)


def read_token(path: pathlib.Path) -> str:
    """The token the file holds now (for clients given a token, not the file)."""
    return path.read_text().strip()


class Probes:
    """The checking faults of one run; delayed checks run in threads that ``join_checks`` waits for."""

    def __init__(self, cluster: Cluster, rng: random.Random, report: Report, timeline: Timeline) -> None:
        self.cluster = cluster
        self.rng = rng
        self.report = report
        self.timeline = timeline
        self.checks: list[threading.Thread] = []  # delayed checks of events, joined before the oracle
        self.token_generation = 0

    def join_checks(self) -> None:
        for thread in self.checks:
            thread.join(TOKEN_GRACE + 30)

    # ---- Checkpoint while a restarted server restores

    def restart_while_checkpointing(self, shard: int) -> None:
        """Restart ``shard``'s server while calling Checkpoint on it; then check what it wrote."""
        server = self.cluster.servers[shard]
        launched = time.time()
        server.launch(port=server.port)
        calls: collections.Counter = collections.Counter()
        ready = threading.Event()
        thread = threading.Thread(target=self._hammer_checkpoint, args=(server.port, ready, calls),
                                  name=f"fault-hammer-{shard}", daemon=True)
        thread.start()
        try:
            server.wait_ready()
        finally:
            ready.set()
            thread.join(30)
        self.report.notes.append(f"checkpoint calls while shard {shard} restarted: {dict(calls)}")
        self._check_checkpoints_since(shard, launched)

    def _hammer_checkpoint(self, port: int, ready: threading.Event, calls: collections.Counter) -> None:
        """Call Checkpoint on the restarting server until one is answered (what a retrying admin does).

        One answered call at most: a later one, after the restore, would write
        a complete checkpoint that hides what an early one wrote.
        """
        request = ps_pb2.CheckpointRequest().SerializeToString()
        # Reconnect within milliseconds (not gRPC's 1 s backoff), to land inside the restore.
        options = [("grpc.initial_reconnect_backoff_ms", 5), ("grpc.min_reconnect_backoff_ms", 5),
                   ("grpc.max_reconnect_backoff_ms", 20)]
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            call = channel.unary_unary(method_path("Checkpoint"))
            while not ready.is_set():
                metadata = (("authorization", f"Bearer {read_token(self.cluster.token_file)}"),)
                try:
                    call(request, timeout=2, metadata=metadata)
                    calls["OK"] += 1
                    return
                except grpc.RpcError as error:
                    calls[error.code().name] += 1
                time.sleep(0.003)

    def _check_checkpoints_since(self, shard: int, since: float) -> None:
        """Every checkpoint the restarted server wrote holds every variable (none is ever deleted)."""
        for path in sorted(self.cluster.shard_checkpoints(shard).glob("ckpt-*")):
            try:
                manifest = json.loads((path / "manifest.json").read_text())
            except (OSError, ValueError):
                continue  # removed by keep-checkpoints while we looked
            if manifest["created_unix"] < since:
                continue
            names = {v["spec"]["name"] for v in manifest["variables"]}
            if set(VARIABLES) - names:
                self.report.fail("checkpoint",
                                 f"shard {shard}: checkpoint {path.name}, written after the restart, lacks "
                                 f"variables {sorted(set(VARIABLES) - names)} (written while it restored?)")

    # ---- token rotation

    def rotate_token(self) -> None:
        """Rotate the token file; a client that keeps the old token is refused, also on its open stream.

        Workers read the file (and again when refused), so they carry on. A
        client given the old token itself, with its Exchange stream open,
        pulls again ``TOKEN_GRACE`` s after the rotation (in a thread, so
        the schedule goes on): that must raise AuthenticationError.
        """
        from worker_client import AuthenticationError, PSClient, PSError

        cluster = self.cluster
        deadline = time.monotonic() + 10
        while True:  # the servers may not have re-read the previous rotation yet
            try:
                stale = PSClient([s.address for s in cluster.servers], worker_id="fault-stale",
                                 register=False, retry_timeout=10, auth_token=read_token(cluster.token_file))
            except AuthenticationError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
                continue
            try:
                stale.pull(["small"])  # opens its Exchange stream to small's shard with this token
                break
            except AuthenticationError:
                stale.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.token_generation += 1
        tmp = cluster.token_file.with_suffix(".tmp")
        tmp.write_text(f"token-{cluster.seed}-{self.token_generation}\n")
        os.replace(tmp, cluster.token_file)  # a new inode and mtime, as a kubelet's Secret update
        rotated = time.time()
        self.timeline.rotations.append(rotated)

        def check() -> None:
            time.sleep(TOKEN_GRACE)
            try:
                stale.pull(["small"])
                self.report.fail("revoked token", f"a pull with a token rotated out "
                                                  f"{time.time() - rotated:.1f}s before was answered")
            except AuthenticationError:
                pass
            except PSError as error:  # a server restarting meanwhile: not what is checked here
                self.report.notes.append(f"revoked-token check inconclusive: {type(error).__name__}")
            finally:
                stale.close()

        thread = threading.Thread(target=check, name=f"fault-stale-token-{self.token_generation}",
                                  daemon=True)
        thread.start()
        self.checks.append(thread)

    # ---- table limits

    def over_limits(self, shard: int) -> None:
        """Requests over a table's bound: RESOURCE_EXHAUSTED, and the tables unchanged."""
        from worker_client import PSError, ResourceExhaustedError

        cluster = self.cluster

        def rows(client) -> dict[str, list[int]]:
            infos = client.describe()
            return {name: [info.variables[name]["num_rows"] for info in infos] for name in ("limited", "lru")}

        before = cluster.call_admin(rows)
        over = cluster.take_fresh_ids(shard, LIMIT_ROWS + 1)  # more new rows on one shard than it may hold
        attempts = {
            "push_rows(limited, new rows over max_rows)":
                lambda c: c.push_rows("limited", over, np.ones((len(over), 2), np.float32)),
            "pull_rows(limited, new rows over max_rows)": lambda c: c.pull_rows("limited", over),
            "pull_rows(lru, more new rows than max_rows)": lambda c: c.pull_rows("lru", over),
        }
        for what, attempt in attempts.items():
            try:
                cluster.call_admin(attempt)
                self.report.fail("limit", f"limit: {what} was accepted")
            except ResourceExhaustedError:
                pass
            except PSError as error:
                self.report.fail("limit", f"limit: {what} raised {type(error).__name__}: {error}")
        if cluster.trained:  # "limited" holds 2 rows of LIMIT_ROWS per shard: new ones fit a push, not it
            self.refused_part_way(shard)
        after = cluster.call_admin(rows)
        if after != before:
            self.report.fail("limit", f"limit: refused requests changed the tables' rows per shard: "
                             f"{before} -> {after}")
        for name, ids in cluster.trained.items():
            values = cluster.call_admin(lambda c: c.pull_rows(name, ids))
            if not np.array_equal(values, np.ones_like(values)):
                self.report.fail("limit", f"limit: trained rows of {name!r} changed by refused requests: "
                                 f"{values[:, 0].tolist()} (expected all 1)")

    def refused_part_way(self, shard: int) -> None:
        """One push message: new rows of ``emb``, then new rows of ``limited`` that it has no room for.

        The ``limited`` chunk is refused (RESOURCE_EXHAUSTED) after the ``emb``
        chunk was applied, and that one stays applied. Its rows are read back
        (``cluster.refused_prefixes``): no later push touches them, so with
        replicas they must hold these values at the end, after any failover,
        on every replica alike (``ReplicatedCluster.check_replicas``).
        """
        from worker_client import PSError, ResourceExhaustedError

        cluster = self.cluster
        emb = cluster.take_fresh_ids(shard, 2)
        over = cluster.take_fresh_ids(shard, LIMIT_ROWS - 1)  # within a push's bound, past the free rows
        ones = np.ones((len(over), 2), np.float32)
        try:
            cluster.call_admin(lambda c: c.push({}, rows={"emb": (emb, ones[:len(emb)]),
                                                          "limited": (over, ones)}))
            self.report.fail("limit", "limit: a push of rows over limited's free rows was accepted")
        except ResourceExhaustedError:
            pass
        except PSError as error:
            self.report.fail("limit", f"limit: a push of rows over limited's free rows raised "
                                      f"{type(error).__name__}: {error}")
        values = cluster.call_admin(lambda c: c.pull_rows("emb", emb))
        if not np.array_equal(values, -np.ones_like(values)):
            self.report.fail("limit", f"limit: the emb rows a push applied before its refused chunk hold "
                                      f"{values.tolist()} (expected all -1: applied once, kept)")
        if isinstance(cluster, ReplicatedCluster):
            cluster.refused_prefixes.append(("emb", emb, values))

    # ---- idle streams

    def idle_streams(self) -> None:
        """Idle clients holding streams starve neither control calls nor the workers; over the bound
        of streams, clients use ordinary calls (README: --max-exchange-streams)."""
        from worker_client import PSClient, PSError

        cluster = self.cluster
        if self.timeline.rotations:  # a fresh client reads the file: let the servers take up a rotation first
            time.sleep(max(0.0, self.timeline.rotations[-1] + TOKEN_GRACE - time.time()))
        idle = []
        try:
            for number in range(IDLE_CLIENTS):
                try:
                    client = PSClient([s.address for s in cluster.servers], worker_id=f"fault-idle-{number}",
                                      register=False, connect_timeout=10, retry_timeout=10,
                                      auth_token_file=str(cluster.token_file))
                    idle.append(client)
                    client.pull(["small"])  # opens the Exchange stream to small's shard, then idles
                except PSError as error:
                    self.report.fail("streams", f"streams: idle client {number} of {IDLE_CLIENTS} failed: "
                                                f"{type(error).__name__}: {error}")
            try:
                cluster.call_admin(lambda c: c.checkpoint())
            except PSError as error:
                self.report.fail("streams",
                                 f"streams: with {len(idle)} idle clients connected, checkpoint() raised "
                                 f"{type(error).__name__}: {error}")
            time.sleep(self.rng.uniform(0.3, 1.5))
        finally:
            for client in idle:
                client.close()
