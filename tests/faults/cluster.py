"""The processes one mode's run drives: ps-servers behind fault proxies, the workers, an admin client.

Starting, stopping and restarting them, and the failures of the processes
themselves (a SIGTERM that does not exit 0, a worker that hangs or dies).
Every SIGKILL of a server is recorded in the timeline with the newest
checkpoint it leaves, for the oracle. Every process is stopped by PID.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import random
import signal
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np
from fault_proxy import FaultProxy
from ps_testing import ROOT, ServerProcess, child_env, free_port

from faults import layout
from faults import worker as worker_process
from faults.layout import (
    BALLAST,
    EXCHANGE_LIMIT,
    LIMIT_ROWS,
    MODES,
    NUM_SHARDS,
    STREAMS_LIMIT,
    WORKERS,
    fresh_ids,
)
from faults.report import LossWindow, Report, Timeline

SERVER_EXIT_TIMEOUT = 60.0  # a SIGTERMed server that has not exited by then hangs
WORKER_EXIT_TIMEOUT = 120.0


#: Rows of emb each shard keeps in memory; the rest of its rows (one per slot) live on disk.
TABLE_MEMORY_ROWS = 8


class Cluster:
    """One mode's processes and the controller's client; ``setup`` starts them, ``cleanup`` ends them."""

    #: Whether the schedule must run every kind (a first round of each, a kind left out a failure).
    covers_every_kind = False

    def __init__(self, mode: str, seed: int, kinds: list[str], workdir: pathlib.Path, pace: float,
                 rng: random.Random, report: Report, timeline: Timeline) -> None:
        self.config = MODES[mode]
        self.seed = seed
        self.kinds = kinds
        self.workdir = workdir
        self.pace = pace
        self.rng = rng  # shared with the schedule: one seeded sequence per mode
        self.report = report
        self.timeline = timeline
        self.root = workdir / "ckpt"
        self.token_file = workdir / "token"
        self.stop_file = workdir / "stop"
        self.go_file = workdir / "go"  # the workers' addresses, written once the variables exist
        self.servers: list[ServerProcess] = []
        self.proxies: list[FaultProxy] = []
        # With TCP lanes (drawn per mode): a proxy per shard in front of its lane port too.
        self.tcp_lane = False
        self.lane_proxies: list[FaultProxy] = []
        self.workers: dict[int, subprocess.Popen] = {}
        self.worker_outputs: list[pathlib.Path] = []
        self.worker_output: dict[int, pathlib.Path] = {}  # index -> output of its current process
        self.trained: dict[str, np.ndarray] = {}  # limited/lru ids pre-trained to 1 (not in sync mode)
        self.next_fresh_id = 10 ** 12
        self.admin: Any = None
        self.small_shard = 0  # the shard holding "small" whole (read back from the placement)

    def _server_args(self) -> list[str]:
        # Checkpoints by change: two deltas after each full one, so kills restore from delta chains.
        # emb keeps most of its rows on disk (TABLE_MEMORY_ROWS in memory per shard): spilled, read back.
        args = ["--checkpoint-dir", str(self.root), "--checkpoint-interval", "1", "--keep-checkpoints", "3",
                "--full-checkpoint-every", "3", "--disk-tier-dir", str(self.workdir / "tables"),
                "--consistency", self.config["consistency"], "--worker-lease", "3",
                "--drain-timeout", "0" if "drain" in self.kinds else "20",
                "--auth-token-file", str(self.token_file), "--log-level", "info"]
        if self.config["consistency"] == "ssp":
            args += ["--staleness", "2"]
        if "streams" in self.kinds:
            args += ["--max-concurrent-rpcs", str(STREAMS_LIMIT),
                     "--max-exchange-streams", str(EXCHANGE_LIMIT)]
        return args

    def worker_log(self, index: int) -> pathlib.Path:
        """The log worker ``index`` appends to, across its incarnations (see worker.py)."""
        return self.workdir / f"worker-{index}.log"

    def start_worker(self, index: int) -> None:
        config = {"index": index, "go_file": str(self.go_file), "seed": self.seed,
                  "log": str(self.worker_log(index)), "stop_file": str(self.stop_file),
                  "token_file": str(self.token_file), "wire_dtype": self.config["wire_dtype"],
                  "topk_rows": self.config["topk_rows"], "chunk_bytes": self.config["chunk_bytes"][index],
                  "slots": layout.SLOTS,
                  "consistency": self.config["consistency"], "pace": self.pace}
        output = self.workdir / f"worker-{index}.out.{len(self.worker_outputs)}"
        self.worker_outputs.append(output)
        self.worker_output[index] = output
        with open(output, "wb") as out:
            self.workers[index] = subprocess.Popen(
                [*self.worker_prefix(index), sys.executable, worker_process.__file__, json.dumps(config)],
                stdout=out, stderr=out,
                # A worker that crashes leaves every thread's stack in its output, which a violation quotes.
                stdin=subprocess.DEVNULL, cwd=str(ROOT), env=child_env({"PYTHONFAULTHANDLER": "1"}))

    def _admin_client(self) -> Any:
        """The controller's client (unregistered: it observes, checkpoints and probes limits)."""
        from worker_client import PSClient

        if self.admin is None:
            self.admin = PSClient(self.admin_addresses(), worker_id="fault-admin", register=False,
                                  retry_timeout=60, auth_token_file=str(self.token_file))
        return self.admin

    def call_admin(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(admin_client)``, with a client that holds the current token."""
        from worker_client import AuthenticationError

        deadline = time.monotonic() + 30
        while True:
            try:
                return fn(self._admin_client())
            except AuthenticationError:
                if self.admin is not None:
                    self.admin.close()
                self.admin = None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def setup(self) -> None:
        """Workers (waiting), servers, proxies, variables; returns once every worker got a push through."""
        from worker_client import SGD, DiskTier, FixedShardsPartitioner

        self.token_file.write_text(f"token-{self.seed}-0\n")
        for index in range(WORKERS):
            self.start_worker(index)
        self.start_servers()
        self.proxies = self.make_proxies()
        sgd = SGD(learning_rate=1.0)

        def create(client) -> None:
            client.create_variable("dense", shape=(layout.DENSE,), optimizer=sgd, aggregation="sum",
                                   partitioner=FixedShardsPartitioner(NUM_SHARDS))
            client.create_variable("small", shape=(layout.SLOTS,), optimizer=sgd, aggregation="sum")
            client.create_embedding("emb", dim=2, initializer="zeros", optimizer=sgd, aggregation="sum",
                                    tier=DiskTier(memory_rows=TABLE_MEMORY_ROWS))
            client.create_embedding("emb_rows", dim=2, initializer="zeros", optimizer=sgd,
                                    aggregation="row_mean")
            client.create_variable("ballast", shape=(BALLAST,), initializer="uniform", optimizer=sgd,
                                   partitioner=FixedShardsPartitioner(NUM_SHARDS))
            client.create_embedding("limited", dim=2, initializer="zeros", optimizer=sgd, max_rows=LIMIT_ROWS)
            client.create_embedding("lru", dim=2, initializer="zeros", optimizer=sgd, max_rows=LIMIT_ROWS,
                                    eviction="lru")
            ranges = client.variables()["dense"].element_ranges
            half = layout.DENSE // 2
            assert [(s, a, b) for s, a, b in ranges] == [(0, 0, half), (1, half, layout.DENSE)], ranges
            self.small_shard = client.variables()["small"].element_ranges[0][0]
            if self.config["consistency"] != "sync":  # a sync push is a step: no pre-training there
                for name, per_shard in (("limited", 2), ("lru", LIMIT_ROWS)):
                    ids = np.concatenate([self.take_fresh_ids(shard, per_shard)
                                          for shard in range(NUM_SHARDS)])
                    client.push_rows(name, ids, -np.ones((len(ids), 2), np.float32))
                    self.trained[name] = ids
                # Durable before any fault: a SIGKILL may lose updates after the last checkpoint
                # (the limit events check these rows stay trained, not what a crash may lose).
                client.checkpoint()
            client.pull(["small"])
            lanes = [shard._conn.tcp_lane.on_tcp for shard in client._session.shards
                     if shard._conn.tcp_lane is not None and shard._conn.lane._stream is not None]
            if self.tcp_lane and not any(lanes):
                self.report.fail("lane",
                                 "the servers have TCP lanes, yet the client's lanes are gRPC streams")

        self.call_admin(create)
        tmp = self.go_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"addresses": self.worker_addresses()}))
        os.replace(tmp, self.go_file)
        deadline = time.monotonic() + 60
        logs = [self.worker_log(index) for index in range(WORKERS)]
        while not all(log.exists() and '"ack"' in log.read_text() for log in logs):
            if time.monotonic() > deadline:
                raise RuntimeError("the workers did not get a push through within 60 s of starting")
            time.sleep(0.05)

    def make_proxies(self) -> list[FaultProxy]:
        """A fault proxy, not cutting yet, in front of each server (``proxies[i]`` fronts ``servers[i]``)."""
        proxies = [FaultProxy(s.port, seed=self.rng.randrange(1 << 30), mean_bytes_up=30_000,
                              mean_bytes_down=3_000, cut_at_start=0.05) for s in self.servers]
        for proxy in proxies:
            proxy.cutting = False
        return proxies

    def worker_prefix(self, index: int) -> list[str]:
        """The argv prefix that runs worker ``index`` (none: on this host)."""
        return []

    def start_servers(self) -> None:
        """One ps-server per shard; returns once each serves."""
        self.draw_lane()
        self.servers = [ServerProcess(i, NUM_SHARDS, self.workdir, self._server_args() + self.lane_args())
                        for i in range(NUM_SHARDS)]
        for server in self.servers:
            server.launch()
        for server in self.servers:
            server.wait_ready()

    def draw_lane(self) -> None:
        """Whether this mode's servers have TCP lanes: drawn from the seed, so both run over the runs."""
        self.tcp_lane = self.rng.random() < 0.5
        self.report.notes.append(
            "small pulls and pushes over TCP lanes (--lane-port), each behind a fault proxy"
            if self.tcp_lane else "small pulls and pushes over gRPC Exchange streams")

    def lane_args(self) -> list[str]:
        """One server's lane flags (none without lanes), its lane proxy appended to ``lane_proxies``.

        The lane port is fixed (restarts reuse it) and reached through its own proxy, whose port
        Describe reports: cuts and restarts hit small pulls and pushes as they hit gRPC calls.
        """
        if not self.tcp_lane:
            return []
        lane_port = free_port()
        proxy = FaultProxy(lane_port, seed=self.rng.randrange(1 << 30), mean_bytes_up=30_000,
                           mean_bytes_down=3_000, cut_at_start=0.05)
        proxy.cutting = False
        self.lane_proxies.append(proxy)
        return ["--lane-port", str(lane_port), "--advertise-lane-port", str(proxy.port)]

    def admin_addresses(self) -> list[str]:
        """What the controller's clients are given: the servers themselves, one entry per shard."""
        return [s.address for s in self.servers]

    def worker_addresses(self) -> list[str]:
        """What the workers are given: the proxies, one entry per shard (``self.proxies[i]`` fronts
        ``self.servers[i]``)."""
        return [p.address for p in self.proxies]

    def shard_proxies(self, shard: int) -> list[FaultProxy]:
        """The proxies in front of ``shard``'s servers (and of their TCP lanes)."""
        return [self.proxies[shard], *self.lane_proxies[shard:shard + 1]]

    def take_fresh_ids(self, shard: int, count: int) -> np.ndarray:
        """``count`` ids on ``shard`` that no push and no earlier call uses."""
        ids = fresh_ids(shard, count, self.next_fresh_id)
        self.next_fresh_id = int(ids.max()) + 1
        return ids

    def shard_checkpoints(self, shard: int) -> pathlib.Path:
        """The directory holding ``shard``'s checkpoints."""
        return self.root / f"shard-{shard}-of-{NUM_SHARDS}"

    def newest_snapshot(self, shard: int) -> float:
        """``created_unix`` of the newest completed checkpoint of ``shard`` on disk (-inf: none)."""
        for path in sorted(self.shard_checkpoints(shard).glob("ckpt-*"), reverse=True):
            try:
                return float(json.loads((path / "manifest.json").read_text())["created_unix"])
            except (OSError, ValueError, KeyError):
                continue  # removed by keep-checkpoints while we looked, or damaged: the older one counts
        return -math.inf

    def stop_server(self, shard: int, signum: int) -> None:
        """Signal ``shard``'s server and wait; a SIGKILL (or a SIGTERM that hung) opens a loss window."""
        server = self.servers[shard]
        server.signal(signum)
        if signum == signal.SIGKILL:
            server.wait(30)
            self.timeline.windows.append(LossWindow(shard, self.newest_snapshot(shard), time.time()))
            return
        try:
            code = server.wait(SERVER_EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.report.fail("sigterm",
                             f"shard {shard}: SIGTERM did not end the server in {SERVER_EXIT_TIMEOUT:.0f}s "
                             f"(log tail: {server.log_text()[-300:]!r}); SIGKILLed it")
            server.popen.kill()
            server.wait(30)
            self.timeline.windows.append(LossWindow(shard, self.newest_snapshot(shard), time.time()))
            return
        if code != 0:
            self.report.fail("sigterm", f"shard {shard}: SIGTERM exit code {code}")

    def restart_server(self, shard: int) -> None:
        """Start ``shard``'s server again on its port and checkpoint root; returns once it serves."""
        server = self.servers[shard]
        server.launch(port=server.port)
        server.wait_ready()

    def stop_workers(self) -> None:
        """Tell the workers to stop and wait; a hang, a nonzero exit or a traceback is a failure."""
        self.stop_file.write_text("stop")
        for index, popen in self.workers.items():
            try:
                popen.wait(WORKER_EXIT_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.report.fail("worker",
                                 f"worker {index} did not stop within {WORKER_EXIT_TIMEOUT:.0f}s (hung)")
                popen.kill()
                popen.wait(30)
            if popen.returncode != 0:
                self.report.fail("worker", f"worker {index} exited with {popen.returncode}")
        for output in self.worker_outputs:
            text = output.read_text(errors="replace") if output.exists() else ""
            if "Traceback" in text:
                self.report.fail("worker", f"{output.name}: {text[-800:]!r}")

    def flush_sync_step(self) -> None:
        """Close the step the workers left open: a worker that pushes zeros for two steps."""
        from worker_client import PSClient

        zeros = {"dense": np.zeros(layout.DENSE, np.float32), "small": np.zeros(layout.SLOTS, np.float32)}
        with PSClient(self.admin_addresses(), worker_id="fault-flush", retry_timeout=60,
                      auth_token_file=str(self.token_file)) as client:
            for _ in range(2):
                with client.step(["dense", "small"]) as step:
                    step.push(zeros)

    def cleanup(self) -> None:
        if self.admin is not None:
            try:
                self.admin.close()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        for popen in self.workers.values():
            if popen.poll() is None:
                popen.kill()
                popen.wait(30)
        for proxy in [*self.proxies, *self.lane_proxies]:
            proxy.stop()
        for server in self.servers:
            if server.popen is not None and server.popen.poll() is None:
                server.popen.kill()
                server.popen.wait(30)
