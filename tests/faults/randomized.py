"""A randomized fault test of real ps-servers against a reference model.

Worker processes (``worker_client.PSClient``) push known gradients through
fault proxies to a 2-shard cluster while a seeded schedule injects faults
(``KINDS``): server SIGKILL and SIGTERM (restarted on the same port and
checkpoint root), SIGTERM with a 0.05 s ``--drain-timeout``, connection cuts,
Checkpoint calls (also while a restarted server restores), token rotation,
worker SIGKILL (restarted: a new incarnation), requests over the table
limits, and idle clients holding streams against ``--max-concurrent-rpcs``.
At the end an oracle compares the servers' values with what the workers'
logs say was acknowledged, under the rules of docs/failure-semantics.md.

**Why the oracle is exact.** Push number ``k`` of worker ``w`` owns slot
``s = w * P + k`` and writes only there: one to four of its four elements
of ``dense`` (two in the part on each shard, see ``dense_positions``),
element ``s`` of ``small`` (whole on one shard), and one row of the hash
table ``emb`` on each shard. Its gradient is the integer ``g(s)`` in 1..8
(exact in float32 and bfloat16), SGD with learning rate 1 from zeros
(``aggregation="sum"`` in sync mode), so each element holds
``-count * g(s)``: it tells how many times its push was applied there.
With top-k an element may ride on a later push of the same worker; every
acknowledged push logs which elements are still owed (the residual), so
the oracle knows which push carried each element. A worker appends (and
fsyncs) a line per acknowledged push before its next push, so a SIGKILL
loses none of its record.

**The rules** (per push, per shard it touches; ``count`` per element):

- never begun: 0.
- acknowledged: exactly 1; except where that shard was SIGKILLed after the
  push started and the push was acknowledged after the shard's newest
  completed checkpoint at the kill (``created_unix`` in the manifest, taken
  inside the snapshot): 0 or 1 (what a crash may lose).
- sync mode, acknowledged as dropped on ``d`` shards: those shards hold
  none of it and the others all of it ("dropped whole, never half-counted").
- ``push()`` raised, or its worker was SIGKILLed during it: 0 or 1 (a
  failed push may be applied partly; never twice); 0 if nothing was sent.
- top-k: an element still owed when its client closed: 0; owed when its
  worker was killed or replaced its client: 0 or 1; otherwise the rules of
  the acknowledged push that carried it, over the span from its own push's
  start to that push's acknowledgement.
- failures besides wrong values: a push that raised anything but an
  ``AuthenticationError`` after a token rotation (every fault here is one
  the docs say clients ride out); a call answered with a token rotated out
  ``TOKEN_GRACE`` s before, on a stream opened before; a worker or server that
  hangs; a SIGTERM that does not exit 0; a limit request not refused with
  RESOURCE_EXHAUSTED or one that changed a table; a checkpoint written
  while restoring that lacks variables; ``checkpoint()`` refused while idle
  clients hold streams; a step (pull and push) longer than
  ``STALL_SECONDS``.

Run: ``python tests/faults/randomized.py --seed 7`` (``--modes``, ``--kinds``,
``--events``, ``--budget``, ``--soak``, ``--workdir`` to keep the logs);
the seed is printed, and the same seed replays the same schedule of faults
(the processes' timing still varies). Every process is stopped by PID.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

_TESTS = pathlib.Path(__file__).resolve().parents[1]
for _path in (str(_TESTS.parent), str(_TESTS)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from fault_proxy import FaultProxy  # noqa: E402
from ps_testing import ServerProcess, child_env  # noqa: E402
from wehub_ps.placement import hash_shards  # noqa: E402
from wehub_ps.wire.rpc import method_path  # noqa: E402
from wehub_ps.v1 import ps_pb2  # noqa: E402

NUM_SHARDS = 2
WORKERS = 3
SLOTS = 6144  # S: pushes a run can hold; each worker owns SLOTS // WORKERS of them (see configure)
PER_WORKER = SLOTS // WORKERS
DENSE = 4 * SLOTS  # elements of "dense": 2 per slot in each shard's half
SOAK_SLOTS = 60_000  # --soak: "small" (S floats) stays under 256 KiB, so whole on one shard
TOPK_ROWS = 3  # rows of "dense" a top-k push sends: the ratio is TOPK_ROWS / DENSE
BALLAST = 8 << 20  # float32 elements (32 MiB) never pushed: restores and checkpoints take a while
LIMIT_ROWS = 4  # max_rows per shard of the tables the limit events push against
TOKEN_GRACE = 4.0  # seconds a server may take to notice a rotated token file (it re-reads every 2 s)
SERVER_EXIT_TIMEOUT = 60.0  # a SIGTERMed server that has not exited by then hangs
WORKER_EXIT_TIMEOUT = 120.0
# A step (pull and push) waiting longer is a stall. Legitimate waits here: a server's restart (up to 10 s
# on a loaded 2-core machine, and two events may restart both shards in turn), the client's backoff (3 s),
# a dead worker's lease (3 s), a token file re-read (2 s).
STALL_SECONDS = 45.0

KINDS = {  # kind -> weight in the schedule: the quick kinds more often, so a short run still has many events
    "server-kill": 3, "server-term": 1, "drain": 1, "cut": 4, "checkpoint": 3, "ckpt-restore": 1,
    "token": 2, "worker-kill": 3, "limit": 2, "streams": 1,
}
IDLE_CLIENTS = 24  # the "streams" event's idle clients, each holding (or asking for) an Exchange stream
STREAMS_LIMIT = 24  # --max-concurrent-rpcs of the servers when the "streams" kind is on
EXCHANGE_LIMIT = 10  # --max-exchange-streams then: the workers' and the admin's fit, most idle clients' not
# chunk_bytes per worker: 4096 or 8192 make every dense push a multi-chunk Push stream (cuts and drain
# deadlines land mid-push); 128 KiB sends a shard's part as one message over the long-lived Exchange
# stream. Top-k pushes are a few rows: always one message.
MODES = {
    "async": {"consistency": "async", "wire_dtype": None, "topk_rows": None,
              "chunk_bytes": (128 << 10, 8192, 8192)},
    "async-bf16": {"consistency": "async", "wire_dtype": "bfloat16", "topk_rows": None,
                   "chunk_bytes": (4096,) * WORKERS},
    "async-topk-bf16": {"consistency": "async", "wire_dtype": "bfloat16", "topk_rows": TOPK_ROWS,
                        "chunk_bytes": (4096,) * WORKERS},
    "ssp": {"consistency": "ssp", "wire_dtype": None, "topk_rows": None, "chunk_bytes": (4096,) * WORKERS},
    "sync": {"consistency": "sync", "wire_dtype": None, "topk_rows": None, "chunk_bytes": (4096,) * WORKERS},
}
VARIABLES = ("dense", "small", "emb", "ballast", "limited", "lru")


def gradient_value(slot: int) -> float:
    """The integer each element of push ``slot`` carries: exact in float32 and bfloat16."""
    return float(1 + slot % 8)


def configure(slots: int) -> None:
    """Set the number of slots (a soak run needs more); controller and workers must agree."""
    global SLOTS, PER_WORKER, DENSE
    SLOTS, PER_WORKER, DENSE = slots, slots // WORKERS, 4 * slots


def topk_ratio(config: dict[str, Any]) -> float | None:
    """The PSClient topk_ratio of a mode: ``TOPK_ROWS`` rows of ``dense`` per push."""
    return None if config["topk_rows"] is None else config["topk_rows"] / DENSE


def dense_positions(slot: int) -> list[tuple[int, int]]:
    """``[(shard, element)]`` of ``dense`` that push ``slot`` writes: a fixed, non-empty subset of its 4.

    The subset varies (1 to 4 elements, 2.1 on average) so that top-k, which
    sends 3 rows of ``dense`` per push, sometimes has to carry some to a later push.
    """
    mask = 1 + (slot * 2654435761 >> 7) % 15
    own = [(0, 2 * slot), (0, 2 * slot + 1), (1, DENSE // 2 + 2 * slot), (1, DENSE // 2 + 2 * slot + 1)]
    return [position for bit, position in enumerate(own) if mask >> bit & 1]


def table_ids() -> tuple[np.ndarray, np.ndarray]:
    """``(A, B)``: ``emb`` row ids of each slot, ``A[s]`` on shard 0 and ``B[s]`` on shard 1."""
    candidates = np.arange(1, 8 * SLOTS, dtype=np.int64)
    shards = hash_shards(candidates, NUM_SHARDS)
    return candidates[shards == 0][:SLOTS], candidates[shards == 1][:SLOTS]


def fresh_ids(shard: int, count: int, start: int) -> np.ndarray:
    """``count`` ids on ``shard`` from ``start`` up (limit events use ids no push uses)."""
    candidates = np.arange(start, start + 8 * count + 64, dtype=np.int64)
    return candidates[hash_shards(candidates, NUM_SHARDS) == shard][:count]


def read_token(path: pathlib.Path) -> str:
    """The token the file holds now (for clients given a token, not the file)."""
    return path.read_text().strip()


# ---------------------------------------------------------------- the worker process


def worker_main(config: dict[str, Any]) -> int:
    """One worker: pushes its slots in order, logging every acknowledged push durably."""
    from worker_client import AuthenticationError, PSClient, PSError

    index = config["index"]
    configure(config["slots"])
    go_file = pathlib.Path(config["go_file"])
    parent = os.getppid()
    while not go_file.exists():  # started before the cluster, so that imports overlap its start-up
        if os.getppid() != parent:
            return 1  # the controller is gone
        time.sleep(0.02)
    addresses = json.loads(go_file.read_text())["addresses"]
    log_path = pathlib.Path(config["log"])
    stop_file = pathlib.Path(config["stop_file"])
    token_file = pathlib.Path(config["token_file"])
    topk = config["topk_rows"] is not None
    begun = []
    for line in log_path.read_text().splitlines() if log_path.exists() else []:
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut by SIGKILL
        if entry["ev"] == "begin":
            begun.append(entry["k"])
    k = max(begun) + 1 if begun else 0  # a slot a killed incarnation began is never reused
    ids_a, ids_b = table_ids()
    rng = random.Random(f"{config['seed']}-{index}-{k}")
    log = open(log_path, "a")

    def write(entry: dict[str, Any], durable: bool) -> None:
        log.write(json.dumps(entry) + "\n")
        log.flush()
        if durable:
            os.fsync(log.fileno())

    def connect() -> PSClient:
        deadline = time.monotonic() + 60
        while True:
            try:  # the client reads the token file, and again when a server refuses the token
                return PSClient(addresses, worker_id=f"worker-{index}", chunk_bytes=config["chunk_bytes"],
                                wire_dtype=config["wire_dtype"], topk_ratio=topk_ratio(config),
                                retry_timeout=60, auth_token_file=str(token_file))
            except AuthenticationError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)  # the servers have not re-read the rotated file yet

    def owed(client: PSClient) -> dict[str, list[int]]:
        if not topk:
            return {}
        return {name: np.flatnonzero(r).tolist() for name, r in client.gradient_residuals().items()}

    client = connect()
    write({"ev": "start", "inc": client.incarnation, "k": k, "t": time.time()}, durable=True)
    dense = np.zeros(DENSE, np.float32)
    small = np.zeros(SLOTS, np.float32)
    while k < PER_WORKER and not stop_file.exists() and os.getppid() == parent:
        slot = index * PER_WORKER + k
        g = gradient_value(slot)
        positions = [element for _, element in dense_positions(slot)]
        dense[positions] = small[slot] = g
        rows = {"emb": (np.array([ids_a[slot], ids_b[slot]]), np.full((2, 2), g, np.float32))}
        write({"ev": "begin", "k": k, "inc": client.incarnation, "t": time.time()}, durable=False)
        pushed_at = None
        dropped_before = client.stats()["dropped_pushes"]
        try:
            # In async mode worker 0 only pushes (as a trainer that keeps its own copy may), the others
            # pull half the time: a push that fits the Exchange stream opens no new RPC.
            if config["consistency"] == "async" and (index == 0 or rng.random() < 0.5):
                pushed_at = time.time()
                client.push({"dense": dense, "small": small}, rows=rows)
            else:
                with client.step(["dense", "small"]) as step:
                    pushed_at = time.time()
                    step.push({"dense": dense, "small": small}, rows=rows)
            write({"ev": "ack", "k": k, "inc": client.incarnation, "t0": pushed_at, "t1": time.time(),
                   "drop": client.stats()["dropped_pushes"] - dropped_before,
                   "owed": owed(client)}, durable=True)
        except PSError as error:
            write({"ev": "raise", "k": k, "inc": client.incarnation, "pushed": pushed_at is not None,
                   "t0": pushed_at, "t1": time.time(), "error": type(error).__name__,
                   "message": str(error)[:300]}, durable=True)
            if isinstance(error, AuthenticationError):
                client.close()
                client = connect()
                write({"ev": "start", "inc": client.incarnation, "k": k + 1, "t": time.time()}, durable=True)
        dense[positions] = small[slot] = 0
        k += 1
        time.sleep(rng.uniform(0, config["pace"]))
    write({"ev": "end", "inc": client.incarnation, "t": time.time(), "owed": owed(client)}, durable=True)
    client.close()  # leaves the live set: ssp and sync steps stop waiting for this worker
    while not stop_file.exists() and os.getppid() == parent:  # every slot used: wait for the end
        time.sleep(0.1)
    return 0


# ---------------------------------------------------------------- the controller


@dataclass
class Report:
    mode: str
    seed: int
    events: collections.Counter = field(default_factory=collections.Counter)
    violations: list[str] = field(default_factory=list)
    #: category -> its violations, for a summary that names each kind of failure once
    by_category: dict[str, list[str]] = field(default_factory=dict)
    pushes: collections.Counter = field(default_factory=collections.Counter)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def fail(self, category: str, message: str) -> None:
        self.violations.append(message)
        self.by_category.setdefault(category, []).append(message)

    def summary(self) -> str:
        lines = [f"mode {self.mode} seed {self.seed}: {sum(self.events.values())} fault events "
                 f"{dict(sorted(self.events.items()))}, pushes {dict(sorted(self.pushes.items()))}, "
                 f"{self.seconds:.1f}s, violations {len(self.violations)}"]
        lines += [f"  note: {n}" for n in self.notes]
        for category, messages in self.by_category.items():
            lines.append(f"  VIOLATION {category} x{len(messages)}: {messages[0]}")
            lines += [f"      also: {m}" for m in messages[1:3]]
        return "\n".join(lines)


@dataclass
class LossWindow:
    """Shard ``shard`` was SIGKILLed at ``killed``; its newest checkpoint was taken at ``snapshot``."""

    shard: int
    snapshot: float  # -inf: no checkpoint
    killed: float


class Run:
    """One mode's run: cluster, proxies, workers, the fault schedule and the oracle."""

    def __init__(self, mode: str, seed: int, events: int, kinds: list[str], budget: float,
                 workdir: pathlib.Path, pace: float) -> None:
        self.mode = mode
        self.config = MODES[mode]
        self.seed = seed
        self.rng = random.Random(f"{seed}-{mode}")
        self.target_events = events
        self.kinds = kinds
        self.budget = budget
        self.workdir = workdir
        self.pace = pace
        self.report = Report(mode, seed)
        self.root = workdir / "ckpt"
        self.token_file = workdir / "token"
        self.stop_file = workdir / "stop"
        self.go_file = workdir / "go"  # the workers' addresses, written once the variables exist
        self.servers: list[ServerProcess] = []
        self.proxies: list[FaultProxy] = []
        self.workers: dict[int, subprocess.Popen] = {}
        self.worker_outputs: list[pathlib.Path] = []
        self.worker_output: dict[int, pathlib.Path] = {}  # index -> output of its current process
        self.windows: list[LossWindow] = []
        self.rotations: list[float] = []  # times the token file changed
        self.checks: list[threading.Thread] = []  # delayed checks of events, joined before the oracle
        self.trained: dict[str, np.ndarray] = {}  # limited/lru ids pre-trained to 1 (not in sync mode)
        self.next_fresh_id = 10 ** 12
        self.token_generation = 0
        self.admin: Any = None
        self.small_shard = 0  # the shard holding "small" whole (read back from the placement)

    # ---- processes

    def _server_args(self) -> list[str]:
        args = ["--checkpoint-dir", str(self.root), "--checkpoint-interval", "1", "--keep-checkpoints", "3",
                "--consistency", self.config["consistency"], "--worker-lease", "3",
                "--drain-timeout", "0" if "drain" in self.kinds else "20",
                "--auth-token-file", str(self.token_file), "--log-level", "info"]
        if self.config["consistency"] == "ssp":
            args += ["--staleness", "2"]
        if "streams" in self.kinds:
            args += ["--max-concurrent-rpcs", str(STREAMS_LIMIT),
                     "--max-exchange-streams", str(EXCHANGE_LIMIT)]
        return args

    def _start_worker(self, index: int) -> None:
        config = {"index": index, "go_file": str(self.go_file), "seed": self.seed,
                  "log": str(self.workdir / f"worker-{index}.log"), "stop_file": str(self.stop_file),
                  "token_file": str(self.token_file), "wire_dtype": self.config["wire_dtype"],
                  "topk_rows": self.config["topk_rows"], "chunk_bytes": self.config["chunk_bytes"][index],
                  "slots": SLOTS,
                  "consistency": self.config["consistency"], "pace": self.pace}
        output = self.workdir / f"worker-{index}.out.{len(self.worker_outputs)}"
        self.worker_outputs.append(output)
        self.worker_output[index] = output
        with open(output, "wb") as out:
            self.workers[index] = subprocess.Popen(
                [sys.executable, __file__, "worker", json.dumps(config)], stdout=out, stderr=out,
                stdin=subprocess.DEVNULL, cwd=str(_TESTS.parent), env=child_env())

    def _admin_client(self) -> Any:
        """The controller's client (unregistered: it observes, checkpoints and probes limits)."""
        from worker_client import PSClient

        if self.admin is None:
            self.admin = PSClient([s.address for s in self.servers], worker_id="fault-admin", register=False,
                                  retry_timeout=60, auth_token_file=str(self.token_file))
        return self.admin

    def _admin(self, fn: Any) -> Any:
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
        from worker_client import SGD, FixedShardsPartitioner

        self.token_file.write_text(f"token-{self.seed}-0\n")
        for index in range(WORKERS):
            self._start_worker(index)
        self.servers = [ServerProcess(i, NUM_SHARDS, self.workdir, self._server_args())
                        for i in range(NUM_SHARDS)]
        for server in self.servers:
            server.launch()
        for server in self.servers:
            server.wait_ready()
        self.proxies = [FaultProxy(s.port, seed=self.rng.randrange(1 << 30), mean_bytes_up=30_000,
                                   mean_bytes_down=3_000, cut_at_start=0.05) for s in self.servers]
        for proxy in self.proxies:
            proxy.cutting = False
        sgd = SGD(learning_rate=1.0)

        def create(client) -> None:
            client.create_variable("dense", shape=(DENSE,), optimizer=sgd, aggregation="sum",
                                   partitioner=FixedShardsPartitioner(NUM_SHARDS))
            client.create_variable("small", shape=(SLOTS,), optimizer=sgd, aggregation="sum")
            client.create_embedding("emb", dim=2, initializer="zeros", optimizer=sgd, aggregation="sum")
            client.create_variable("ballast", shape=(BALLAST,), initializer="uniform", optimizer=sgd,
                                   partitioner=FixedShardsPartitioner(NUM_SHARDS))
            client.create_embedding("limited", dim=2, initializer="zeros", optimizer=sgd, max_rows=LIMIT_ROWS)
            client.create_embedding("lru", dim=2, initializer="zeros", optimizer=sgd, max_rows=LIMIT_ROWS,
                                    eviction="lru")
            ranges = client.variables()["dense"].element_ranges
            assert [(s, a, b) for s, a, b in ranges] == [(0, 0, DENSE // 2), (1, DENSE // 2, DENSE)], ranges
            self.small_shard = client.variables()["small"].element_ranges[0][0]
            if self.config["consistency"] != "sync":  # a sync push is a step: no pre-training there
                for name, per_shard in (("limited", 2), ("lru", LIMIT_ROWS)):
                    ids = np.concatenate([self._fresh(shard, per_shard) for shard in range(NUM_SHARDS)])
                    client.push_rows(name, ids, -np.ones((len(ids), 2), np.float32))
                    self.trained[name] = ids
                # Durable before any fault: a SIGKILL may lose updates after the last checkpoint
                # (the limit events check these rows stay trained, not what a crash may lose).
                client.checkpoint()

        self._admin(create)
        tmp = self.go_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"addresses": [p.address for p in self.proxies]}))
        os.replace(tmp, self.go_file)
        deadline = time.monotonic() + 60
        logs = [self.workdir / f"worker-{index}.log" for index in range(WORKERS)]
        while not all(log.exists() and '"ack"' in log.read_text() for log in logs):
            if time.monotonic() > deadline:
                raise RuntimeError("the workers did not get a push through within 60 s of starting")
            time.sleep(0.05)

    def _fresh(self, shard: int, count: int) -> np.ndarray:
        ids = fresh_ids(shard, count, self.next_fresh_id)
        self.next_fresh_id = int(ids.max()) + 1
        return ids

    # ---- fault events

    def _newest_snapshot(self, shard: int) -> float:
        """``created_unix`` of the newest completed checkpoint of ``shard`` on disk (-inf: none)."""
        directory = self.root / f"shard-{shard}-of-{NUM_SHARDS}"
        for path in sorted(directory.glob("ckpt-*"), reverse=True):
            try:
                return float(json.loads((path / "manifest.json").read_text())["created_unix"])
            except (OSError, ValueError, KeyError):
                continue  # removed by keep-checkpoints while we looked, or damaged: the older one counts
        return -math.inf

    def _stop_server(self, shard: int, signum: int) -> None:
        server = self.servers[shard]
        server.signal(signum)
        if signum == signal.SIGKILL:
            server.wait(30)
            self.windows.append(LossWindow(shard, self._newest_snapshot(shard), time.time()))
            return
        try:
            code = server.wait(SERVER_EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.report.fail("sigterm",
                             f"shard {shard}: SIGTERM did not end the server in {SERVER_EXIT_TIMEOUT:.0f}s "
                             f"(log tail: {server.log_text()[-300:]!r}); SIGKILLed it")
            server.popen.kill()
            server.wait(30)
            self.windows.append(LossWindow(shard, self._newest_snapshot(shard), time.time()))
            return
        if code != 0:
            self.report.fail("sigterm", f"shard {shard}: SIGTERM exit code {code}")

    def _restart_server(self, shard: int, hammer: bool) -> None:
        server = self.servers[shard]
        launched = time.time()
        server.launch(port=server.port)
        calls: collections.Counter = collections.Counter()
        thread = None
        if hammer:
            ready = threading.Event()
            thread = threading.Thread(target=self._hammer_checkpoint, args=(server.port, ready, calls),
                                      name=f"fault-hammer-{shard}", daemon=True)
            thread.start()
        try:
            server.wait_ready()
        finally:
            if thread is not None:
                ready.set()
                thread.join(30)
        if hammer:
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
                metadata = (("authorization", f"Bearer {read_token(self.token_file)}"),)
                try:
                    call(request, timeout=2, metadata=metadata)
                    calls["OK"] += 1
                    return
                except grpc.RpcError as error:
                    calls[error.code().name] += 1
                time.sleep(0.003)

    def _check_checkpoints_since(self, shard: int, since: float) -> None:
        """Every checkpoint the restarted server wrote holds every variable (none is ever deleted)."""
        directory = self.root / f"shard-{shard}-of-{NUM_SHARDS}"
        for path in sorted(directory.glob("ckpt-*")):
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

    def event(self, kind: str) -> None:
        shard = self.rng.randrange(NUM_SHARDS)
        with open(self.workdir / "events.log", "a") as events:
            events.write(json.dumps({"t": time.time(), "kind": kind, "shard": shard}) + "\n")
        if kind == "server-kill":
            self._stop_server(shard, signal.SIGKILL)
            time.sleep(self.rng.uniform(0, 0.5))  # workers retry against a dead address
            self._restart_server(shard, hammer=False)
        elif kind in ("server-term", "drain"):
            self._stop_server(shard, signal.SIGTERM)
            self._restart_server(shard, hammer=False)
        elif kind == "ckpt-restore":
            if self.rng.random() < 0.5:
                self._stop_server(shard, signal.SIGKILL)
            else:
                self._stop_server(shard, signal.SIGTERM)
            self._restart_server(shard, hammer=True)
        elif kind == "cut":
            if self.rng.random() < 0.5:
                for proxy in (self.proxies if self.rng.random() < 0.3 else [self.proxies[shard]]):
                    proxy.cut_open()
            else:  # a burst: every connection for a while is cut at a random byte
                proxy = self.proxies[shard]
                proxy.cutting = True
                time.sleep(self.rng.uniform(0.2, 1.0))
                proxy.cutting = False
        elif kind == "checkpoint":
            self._admin(lambda c: c.checkpoint())
        elif kind == "token":
            self._token_event()
        elif kind == "worker-kill":
            index = self.rng.randrange(WORKERS)
            popen = self.workers[index]
            if popen.poll() is None:
                popen.kill()
            popen.wait(30)
            time.sleep(self.rng.uniform(0, 0.5))
            self._start_worker(index)
        elif kind == "limit":
            self._limit_event(shard)
        elif kind == "streams":
            self._streams_event()
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
        self.report.events[kind] += 1

    def _token_event(self) -> None:
        """Rotate the token file; a client that keeps the old token is refused, also on its open stream.

        Workers read the file (and again when refused), so they carry on. A
        client given the old token itself, with its Exchange stream open,
        pulls again ``TOKEN_GRACE`` s after the rotation (in a thread, so
        the schedule goes on): that must raise AuthenticationError.
        """
        from worker_client import AuthenticationError, PSClient, PSError

        deadline = time.monotonic() + 10
        while True:  # the servers may not have re-read the previous rotation yet
            try:
                stale = PSClient([s.address for s in self.servers], worker_id="fault-stale", register=False,
                                 retry_timeout=10, auth_token=read_token(self.token_file))
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
        tmp = self.token_file.with_suffix(".tmp")
        tmp.write_text(f"token-{self.seed}-{self.token_generation}\n")
        os.replace(tmp, self.token_file)  # a new inode and mtime, as a kubelet's Secret update
        rotated = time.time()
        self.rotations.append(rotated)

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

    def _limit_event(self, shard: int) -> None:
        """Requests over a table's bound: RESOURCE_EXHAUSTED, and the tables unchanged."""
        from worker_client import PSError, ResourceExhaustedError

        def rows(client) -> dict[str, list[int]]:
            infos = client.describe()
            return {name: [info.variables[name]["num_rows"] for info in infos] for name in ("limited", "lru")}

        before = self._admin(rows)
        over = self._fresh(shard, LIMIT_ROWS + 1)  # more new rows on one shard than the table may hold
        attempts = {
            "push_rows(limited, new rows over max_rows)":
                lambda c: c.push_rows("limited", over, np.ones((len(over), 2), np.float32)),
            "pull_rows(limited, new rows over max_rows)": lambda c: c.pull_rows("limited", over),
            "pull_rows(lru, more new rows than max_rows)": lambda c: c.pull_rows("lru", over),
        }
        for what, attempt in attempts.items():
            try:
                self._admin(attempt)
                self.report.fail("limit", f"limit: {what} was accepted")
            except ResourceExhaustedError:
                pass
            except PSError as error:
                self.report.fail("limit", f"limit: {what} raised {type(error).__name__}: {error}")
        after = self._admin(rows)
        if after != before:
            self.report.fail("limit", f"limit: refused requests changed the tables' rows per shard: "
                             f"{before} -> {after}")
        for name, ids in self.trained.items():
            values = self._admin(lambda c: c.pull_rows(name, ids))
            if not np.array_equal(values, np.ones_like(values)):
                self.report.fail("limit", f"limit: trained rows of {name!r} changed by refused requests: "
                                 f"{values[:, 0].tolist()} (expected all 1)")

    def _streams_event(self) -> None:
        """Idle clients holding streams starve neither control calls nor the workers; over the bound
        of streams, clients use ordinary calls (README: --max-exchange-streams)."""
        from worker_client import PSClient, PSError

        if self.rotations:  # a fresh client reads the file: let the servers take up a rotation first
            time.sleep(max(0.0, self.rotations[-1] + TOKEN_GRACE - time.time()))
        idle = []
        try:
            for number in range(IDLE_CLIENTS):
                try:
                    client = PSClient([s.address for s in self.servers], worker_id=f"fault-idle-{number}",
                                      register=False, connect_timeout=10, retry_timeout=10,
                                      auth_token_file=str(self.token_file))
                    idle.append(client)
                    client.pull(["small"])  # opens the Exchange stream to small's shard, then idles
                except PSError as error:
                    self.report.fail("streams", f"streams: idle client {number} of {IDLE_CLIENTS} failed: "
                                                f"{type(error).__name__}: {error}")
            try:
                self._admin(lambda c: c.checkpoint())
            except PSError as error:
                self.report.fail("streams",
                                 f"streams: with {len(idle)} idle clients connected, checkpoint() raised "
                                 f"{type(error).__name__}: {error}")
            time.sleep(self.rng.uniform(0.3, 1.5))
        finally:
            for client in idle:
                client.close()

    def schedule(self) -> None:
        deadline = time.monotonic() + self.budget
        weights = [KINDS[k] for k in self.kinds]
        time.sleep(self.rng.uniform(0.5, 1.5))
        while sum(self.report.events.values()) < self.target_events and time.monotonic() < deadline:
            for index, popen in self.workers.items():
                if popen.poll() is not None and not self.stop_file.exists():
                    self.report.fail("worker",
                                     f"worker {index} exited with {popen.returncode} before the end: "
                                     f"{self.worker_output[index].read_text(errors='replace')[-600:]!r}")
                    self._start_worker(index)
            kind = self.rng.choices(self.kinds, weights)[0]
            self.event(kind)
            time.sleep(self.rng.uniform(0.05, 0.8))

    # ---- the end

    def finish(self) -> None:
        for thread in self.checks:
            thread.join(TOKEN_GRACE + 30)
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
        if self.config["consistency"] == "sync":
            self._flush_sync_step()
        self.oracle()

    def _flush_sync_step(self) -> None:
        """Close the step the workers left open: a worker that pushes zeros for two steps."""
        from worker_client import PSClient

        zeros = {"dense": np.zeros(DENSE, np.float32), "small": np.zeros(SLOTS, np.float32)}
        with PSClient([s.address for s in self.servers], worker_id="fault-flush", retry_timeout=60,
                      auth_token_file=str(self.token_file)) as client:
            for _ in range(2):
                with client.step(["dense", "small"]) as step:
                    step.push(zeros)

    def _read_logs(self) -> list[dict[str, Any]]:
        entries = []
        for index in range(WORKERS):
            path = self.workdir / f"worker-{index}.log"
            for line in path.read_text().splitlines() if path.exists() else []:
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue  # a line cut by SIGKILL (only "begin" lines are written without fsync)
                entry["w"] = index
                entries.append(entry)
        return entries

    def oracle(self) -> None:
        ids_a, ids_b = table_ids()
        pushes: dict[int, dict[str, Any]] = {}  # slot -> its ack, raise, or (begun, never answered) inflight
        by_incarnation: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
        ended: dict[str, dict[str, Any]] = {}  # incarnations that closed their client (residual dropped)
        for entry in self._read_logs():
            if entry["ev"] == "end":
                ended[entry["inc"]] = entry
            elif entry["ev"] == "begin":
                pushes.setdefault(entry["w"] * PER_WORKER + entry["k"],
                                  {"ev": "inflight", "inc": entry["inc"], "t0": entry["t"]})
            elif entry["ev"] in ("ack", "raise"):
                entry["slot"] = entry["w"] * PER_WORKER + entry["k"]
                entry["began"] = pushes.get(entry["slot"], {}).get("t0", entry["t1"])
                pushes[entry["slot"]] = entry
                by_incarnation[entry["inc"]].append(entry)
        self.report.pushes.update(p["ev"] for p in pushes.values())
        answered = [p for p in pushes.values() if p["ev"] != "inflight"]
        if answered:
            slowest = max(answered, key=lambda p: p["t1"] - p["began"])
            waited = slowest["t1"] - slowest["began"]
            self.report.notes.append(f"slowest push (pull included): {waited:.1f}s, slot {slowest['slot']}")
            for push in answered:
                if push["t1"] - push["began"] > STALL_SECONDS:
                    self.report.fail("stall", f"slot {push['slot']}: the step (pull and push) took "
                                              f"{push['t1'] - push['began']:.1f}s (> {STALL_SECONDS:.0f}s)")

        begun = sorted(pushes)
        final = self._admin(lambda c: c.pull(["dense", "small"]))
        emb_ids = np.concatenate([ids_a[begun], ids_b[begun]])
        emb = self._admin(lambda c: c.pull_rows("emb", emb_ids)) if begun else np.zeros((0, 2), np.float32)
        row_of = {slot: i for i, slot in enumerate(begun)}

        # Elements no begun push writes must be untouched.
        written = np.zeros(DENSE, bool)
        for slot in begun:
            written[[element for _, element in dense_positions(slot)]] = True
        small_written = np.zeros(SLOTS, bool)
        small_written[begun] = True
        for name, values, mask in (("dense", final["dense"], written),
                                   ("small", final["small"], small_written)):
            stray = np.flatnonzero(values[~mask])
            if stray.size:
                self.report.fail("stray write",
                                 f"{name}: {stray.size} elements no push wrote are nonzero, e.g. "
                                 f"{np.flatnonzero(~mask)[stray[:5]].tolist()}")

        topk = self.config["topk_rows"] is not None
        carriers = self._topk_carriers(by_incarnation) if topk else {}
        raised: dict[str, list[str]] = {}  # error type -> the pushes that raised it
        for slot, push in sorted(pushes.items()):
            g = gradient_value(slot)
            i = row_of[slot]
            # shard -> [(variable, element or row id, times applied)]
            elements: dict[int, list[tuple[str, int, float]]] = {
                0: [("emb", int(ids_a[slot]), -float(v) / g + 0.0) for v in emb[i]],
                1: [("emb", int(ids_b[slot]), -float(v) / g + 0.0) for v in emb[len(begun) + i]],
            }
            for shard, element in dense_positions(slot):
                elements[shard].append(("dense", element, -float(final["dense"][element]) / g + 0.0))
            elements[self.small_shard].append(("small", slot, -float(final["small"][slot]) / g + 0.0))
            where = f"slot {slot} (worker {slot // PER_WORKER} push {slot % PER_WORKER}, {push['ev']})"
            for shard, items in elements.items():
                carried = [item for item in items if topk and item[0] != "emb"]
                self._check(push, shard, [item for item in items if item not in carried], where)
                for item in carried:
                    self._check_carried(push, shard, item, carriers, ended, where)
            if push["ev"] == "raise" and not self._raise_allowed(push):
                raised.setdefault(push["error"], []).append(f"{where}: {push['message']}")
            if push["ev"] == "ack" and push.get("drop"):
                self._check_sync_drop(push, elements, where)
        for error, which in raised.items():
            self.report.fail("push raised", f"push() raised {error} {len(which)} times (first: {which[0]})")

    def _topk_carriers(self, by_incarnation) -> dict[tuple[str, int], dict[str, Any]]:
        """(variable, element) -> the acknowledged push that sent it: the first after which it is not owed."""
        carriers: dict[tuple[str, int], dict[str, Any]] = {}
        for entries in by_incarnation.values():
            acks = [e for e in entries if e["ev"] == "ack"]
            for push in acks:
                slot = push["slot"]
                for what, element in [*(("dense", e) for _, e in dense_positions(slot)), ("small", slot)]:
                    for ack in (a for a in acks if a["slot"] >= slot):
                        if element not in ack["owed"].get(what, ()):
                            carriers[what, element] = ack
                            break
        return carriers

    def _check_carried(self, push: dict[str, Any], shard: int, item: tuple[str, int, float],
                       carriers: dict[tuple[str, int], dict[str, Any]], ended: dict[str, Any],
                       where: str) -> None:
        """Top-k: an element of a dense gradient counts under the rules of the push that carried it."""
        what, element, times = item
        if push["ev"] != "ack":  # a failed push's gradient is not taken into the residual: its own rules
            self._check(push, shard, [item], where)
            return
        carrier = carriers.get((what, element))
        if carrier is None:  # still owed when its client went away: never sent, or sent by a push that failed
            allowed = (0.0,) if push["inc"] in ended else (0.0, 1.0)
            if times not in allowed:
                self.report.fail("top-k residual",
                                 f"{where}: {what}[{element}] on shard {shard} applied {times:g} times, "
                                 f"but it "
                                 f"was still owed (top-k residual) when its client "
                                 f"{'closed' if push['inc'] in ended else 'was killed or replaced'}")
            return
        # It may have been applied any time from this push's start to the carrier's acknowledgement.
        self._check(dict(carrier, t0=push["t0"]), shard, [item], f"{where}, sent with slot {carrier['slot']}")

    def _lossy(self, push: dict[str, Any], shard: int) -> bool:
        """Whether a SIGKILL of ``shard`` may have lost this acknowledged push (after its last checkpoint)."""
        t0, t1 = push.get("t0"), push.get("t1")
        return any(w.shard == shard and t1 > w.snapshot and t0 < w.killed for w in self.windows)

    def _check(self, push: dict[str, Any], shard: int, items: list[tuple[str, int, float]],
               where: str) -> None:
        counts = [c for _, _, c in items]
        described = ", ".join(f"{what}[{element}]={c:g}" for what, element, c in items)
        if any(c not in (0.0, 1.0) for c in counts):
            self.report.fail("applied twice",
                             f"{where}: shard {shard} applied it {described} times (each must be 0 or 1)")
            return
        if push["ev"] in ("raise", "inflight"):
            if push["ev"] == "raise" and not push["pushed"] and any(counts):
                self.report.fail("applied unsent",
                                 f"{where}: shard {shard} holds a push that was never sent: {described}")
            return  # a failed push may be applied partly
        if self._lossy(push, shard):
            return
        if push.get("drop"):
            return  # checked per push in _check_sync_drop
        if not all(c == 1.0 for c in counts):
            kills = [(round(w.snapshot, 3), round(w.killed, 3)) for w in self.windows
                     if w.shard == shard and abs(w.killed - push["t1"]) < 30]
            self.report.fail("acknowledged push missing",
                             f"{where}: acknowledged (t0 {push['t0']:.3f}, t1 {push['t1']:.3f}) but "
                             f"shard {shard} has {described} (each must be 1; SIGKILLs of shard {shard} "
                             f"near then as (newest checkpoint, kill): {kills})")

    def _check_sync_drop(self, push: dict[str, Any], elements: dict[int, list[tuple[str, int, float]]],
                         where: str) -> None:
        """sync: a push dropped on ``d`` shards holds nothing there and everything elsewhere."""
        if any(self._lossy(push, shard) for shard in elements):
            return
        whole = {shard: {times for _, _, times in items} for shard, items in elements.items()}
        dropped_shards = sum(1 for counts in whole.values() if counts == {0.0})
        if any(len(counts) != 1 for counts in whole.values()) or dropped_shards != push["drop"]:
            self.report.fail("sync drop",
                             f"{where}: acknowledged as dropped on {push['drop']} shard(s), but the shards "
                             f"hold "
                             f"it {whole} times (a late push is dropped whole, never half-counted)")

    def _raise_allowed(self, push: dict[str, Any]) -> bool:
        """An AuthenticationError answers a rotated-out token; nothing else is expected of these faults."""
        return push["error"] == "AuthenticationError" and any(t <= push["t1"] for t in self.rotations)

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
        for proxy in self.proxies:
            proxy.stop()
        for server in self.servers:
            if server.popen is not None and server.popen.poll() is None:
                server.popen.kill()
                server.popen.wait(30)


def run_mode(mode: str, seed: int, events: int, kinds: list[str], budget: float, workdir: pathlib.Path,
             pace: float) -> Report:
    workdir.mkdir(parents=True, exist_ok=True)
    run = Run(mode, seed, events, kinds, budget, workdir, pace)
    started = time.monotonic()
    phases = []
    try:
        for phase in (run.setup, run.schedule, run.finish):
            phase()
            phases.append(f"{phase.__name__} {time.monotonic() - started:.1f}s")
    except Exception as error:  # noqa: BLE001 - a crash of the harness is a failure to report with the seed
        import traceback

        run.report.fail("harness error",
                        f"{type(error).__name__}: {error}\n{traceback.format_exc()[-1500:]}")
    finally:
        run.cleanup()
    run.report.seconds = time.monotonic() - started
    run.report.notes.append(f"phases ended at: {', '.join(phases)}, cleanup {run.report.seconds:.1f}s")
    return run.report


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=None,
                        help="schedule seed (default: $WEHUB_FAULT_SEED or a random one; always printed)")
    parser.add_argument("--events", type=int, default=None,
                        help="fault events in all, split over the modes (default 60; --soak: 1,000)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"comma-separated fault kinds, of {', '.join(KINDS)}")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds of fault schedule in all, split over the modes (default 160; --soak: "
                             "3,600); setup and checks come on top")
    parser.add_argument("--soak", action="store_true",
                        help=f"long run: more events and time by default, {SOAK_SLOTS:,} push slots")
    parser.add_argument("--pace", type=float, default=0.02,
                        help="longest random pause between a worker's pushes")
    parser.add_argument("--workdir", default=None,
                        help="keep logs and checkpoints here (default: a temporary dir)")
    args = parser.parse_args(argv)
    if args.events is None:
        args.events = 1000 if args.soak else 60
    if args.budget is None:
        args.budget = 3600.0 if args.soak else 160.0
    if args.soak:
        configure(SOAK_SLOTS)
    if args.seed is None:
        args.seed = int(os.environ.get("WEHUB_FAULT_SEED") or random.SystemRandom().randrange(1 << 31))
    args.modes = [m for m in args.modes.split(",") if m]
    args.kinds = [k for k in args.kinds.split(",") if k]
    for mode in args.modes:
        if mode not in MODES:
            parser.error(f"--modes: unknown mode {mode!r}; choose from {', '.join(MODES)}")
    for kind in args.kinds:
        if kind not in KINDS:
            parser.error(f"--kinds: unknown fault kind {kind!r}; choose from {', '.join(KINDS)}")
    return args


def main(argv: list[str]) -> list[Report]:
    args = parse_args(argv)
    soak = " --soak" if args.soak else ""
    print(f"randomized fault test: seed {args.seed} (reproduce: --seed {args.seed}{soak} "
          f"--budget {args.budget:g} --modes {','.join(args.modes)} --kinds {','.join(args.kinds)} "
          f"--events {args.events})", flush=True)
    keep = args.workdir is not None
    root = pathlib.Path(args.workdir) if keep else pathlib.Path(tempfile.mkdtemp(prefix="wehub-faults-"))
    reports = []
    try:
        per_mode_events = math.ceil(args.events / len(args.modes))
        for mode in args.modes:
            report = run_mode(mode, args.seed, per_mode_events, args.kinds, args.budget / len(args.modes),
                              root / mode, args.pace)
            print(report.summary(), flush=True)
            reports.append(report)
    finally:
        if not keep and not any(r.violations for r in reports):
            shutil.rmtree(root, ignore_errors=True)
        elif reports:
            print(f"logs and checkpoints kept in {root}", flush=True)
    return reports


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(f"randomized fault test: signal {signum}; stopping every process it started")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        sys.exit(worker_main(json.loads(sys.argv[2])))
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # run the cleanup: servers and workers stopped by PID
    results = main(sys.argv[1:])
    total = sum(sum(r.events.values()) for r in results)
    failed = sum(len(r.violations) for r in results)
    print(f"fault events {total}, violations {failed}", flush=True)
    sys.exit(1 if failed else 0)
