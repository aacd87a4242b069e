"""Replicated shards for tests: R ps-server processes per shard on fixed loopback ports, one etcd.

Each replica has its own directory (port file, log, checkpoints) and a port
picked once, so a killed replica restarts where workers expect it.
"""

from __future__ import annotations

import json
import pathlib
import time
import uuid
from dataclasses import dataclass, field

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ps_testing import ServerProcess, free_port
from safetensors import safe_open

from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.rpc import method_path

PRIMARY_SERVICE = "wehub_ps.v1.ParameterServer"


@dataclass
class Replica:
    shard_index: int
    replica_index: int
    process: ServerProcess
    port: int
    #: TLS servers: (CA pair, client pair) for the test's own calls, and their bearer token.
    tls: tuple | None = None
    token: str | None = None
    #: The replica's --metrics-port (0: it serves no metrics).
    metrics_port: int = 0

    @property
    def address(self) -> str:
        return f"{self.process.host}:{self.port}"

    def start(self) -> Replica:
        """Start (or restart) on ``port``; 0 the first time lets the OS pick it, kept for restarts."""
        self.process.start(self.port)
        self.port = self.process.port
        return self

    def launch(self) -> None:
        self.process.launch(self.port)

    def wait_ready(self) -> Replica:
        """After ``launch``: until it listens; its port is kept for restarts."""
        self.process.wait_ready()
        self.port = self.process.port
        return self

    def health(self, service: str = PRIMARY_SERVICE, timeout: float = 2.0) -> int | None:
        """The health status of ``service`` here (the ParameterServer: SERVING on the primary only)."""
        try:
            with self._channel() as channel:
                return health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=timeout).status
        except grpc.RpcError:
            return None

    def _channel(self) -> grpc.Channel:
        if self.tls is None:
            return grpc.insecure_channel(self.address)
        ca, client = self.tls
        credentials = grpc.ssl_channel_credentials(ca.cert.read_bytes(), client.key.read_bytes(),
                                                   client.cert.read_bytes())
        return grpc.secure_channel(self.address, credentials)

    def is_primary(self) -> bool:
        return self.health() == health_pb2.HealthCheckResponse.SERVING

    def is_ready(self) -> bool:
        """Primary, or a backup in sync."""
        return self.health("") == health_pb2.HealthCheckResponse.SERVING

    def running(self) -> bool:
        popen = self.process.popen
        return popen is not None and popen.poll() is None

    def status(self, timeout: float = 5.0) -> ps_pb2.ReplicaStatus:
        """This replica's Describe (asked of any replica): its role, epoch, sequence and backups."""
        metadata = (("authorization", f"Bearer {self.token}"),) if self.token else None
        with self._channel() as channel:
            raw = channel.unary_unary(method_path("Describe"))(
                ps_pb2.DescribeRequest(any_replica=True).SerializeToString(), timeout=timeout,
                metadata=metadata)
        return ps_pb2.DescribeResponse.FromString(raw).replication

    def replication_port(self) -> int:
        """The replication port this replica announced (its log's "replica started" line)."""
        for line in self.process.log_text().splitlines():
            if '"replica started"' in line:
                return int(json.loads(line)["replication_address"].rpartition(":")[2])
        raise AssertionError(f"replica {self.replica_index} logged no replication address")

    def newest_checkpoint(self) -> pathlib.Path:
        shard_dirs = sorted((self.process.workdir / "checkpoints").glob("shard-*"))
        checkpoints = sorted(p for d in shard_dirs for p in d.glob("ckpt-*"))
        assert checkpoints, f"replica {self.replica_index} of shard {self.shard_index} wrote no checkpoint"
        return checkpoints[-1]


def checkpoint_contents(path: pathlib.Path) -> tuple[dict[str, np.ndarray], dict]:
    """What a checkpoint holds, as its tensors (values, optimizer slots, each table's rows) and the
    manifest's state (variables, ledger).

    Logical, not as laid out on disk: a delta is read with the checkpoints it
    builds on, and a tiered table's rows in memory and on disk as one set,
    sorted by id. Two replicas that applied the same changes hold the same
    contents even where their checkpoints' chains and their tables' split
    between memory and disk differ.
    """
    from ps_server.durability.chains import CheckpointChain, find_chain
    from ps_server.durability.format import spec_from_json

    chain = find_chain(path.parent, int(path.name.split("-")[1]))
    manifest = chain[-1][1]
    tensors: dict[str, np.ndarray] = {}
    with CheckpointChain(chain) as read:
        with safe_open(str(path / "tensors.safetensors"), framework="numpy") as f:
            for name in f.keys():
                if "@rows:" not in name and "@disk:" not in name:
                    tensors[name] = f.get_tensor(name)
        for entry in manifest["variables"]:
            if not entry.get("rows"):
                continue
            spec = spec_from_json(entry["spec"])
            rows, files = read.table_rows(spec)
            pieces = [p for p in [rows, *(piece for file in files for piece in file.chunks(65536))]
                      if len(p["ids"])] or [rows]
            merged = {key: np.concatenate([p[key] for p in pieces]) for key in rows}
            order = np.argsort(merged["ids"], kind="stable")
            tensors.update({f"{spec.name}@rows:{key}": values[order] for key, values in merged.items()})
    # Where rows lie and how often they were found in memory are a replica's own (a backup that
    # installed a snapshot holds other rows in memory); everything else is the shard's state.
    variables = [{key: ({k: v for k, v in value.items() if k not in ("memory_hits", "cold_reads")}
                        if key == "policy_counts" else value)
                  for key, value in entry.items() if key not in ("disk", "removed")}
                 for entry in manifest["variables"]]
    state = {key: manifest[key] for key in ("ledger", "consistency") if key in manifest}
    return tensors, {"variables": variables, **state}



def assert_same_bits(first: pathlib.Path, second: pathlib.Path) -> None:
    """Two checkpoints hold the same values, optimizer slots, hash-table rows, versions and ledger."""
    tensors_a, state_a = checkpoint_contents(first)
    tensors_b, state_b = checkpoint_contents(second)
    assert sorted(tensors_a) == sorted(tensors_b)
    for name, values in tensors_a.items():
        assert values.tobytes() == tensors_b[name].tobytes(), name
    assert state_a["variables"] == state_b["variables"]
    assert state_a["ledger"] == state_b["ledger"]


def log_events(log_text: str, name: str) -> list[dict]:
    """The structured events called ``name`` in a server's log (JSON lines)."""
    events = []
    for line in log_text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == name:
            events.append(record)
    return events

@dataclass
class ReplicatedCluster:
    """``num_shards`` shards of ``replicas`` processes each; stop() ends them all (by PID)."""

    workdir: pathlib.Path
    etcd_endpoint: str
    num_shards: int
    replicas: int
    extra_args: tuple[str, ...] = ()
    lease_seconds: int = 1
    health_tls: tuple | None = None
    health_token: str | None = None
    #: Give each replica a --metrics-port of its own.
    metrics: bool = False
    job: str = field(default_factory=lambda: f"test-{uuid.uuid4().hex[:8]}")
    shards: list[list[Replica]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for shard in range(self.num_shards):
            members = []
            for index in range(self.replicas):
                directory = self.workdir / f"shard-{shard}-replica-{index}"
                directory.mkdir(parents=True, exist_ok=True)
                args = ("--replicas", str(self.replicas), "--replica-index", str(index),
                        "--etcd-endpoints", self.etcd_endpoint, "--job-name", self.job,
                        "--primary-lease-seconds", str(self.lease_seconds),
                        "--checkpoint-dir", str(directory / "checkpoints"), *self.extra_args)
                metrics_port = free_port() if self.metrics else 0
                if metrics_port:
                    args += ("--metrics-port", str(metrics_port))
                # Port 0: the OS picks each replica's port at its first start (no race for a free one).
                members.append(Replica(shard, index, ServerProcess(shard, self.num_shards, directory, args),
                                       0, self.health_tls, self.health_token, metrics_port))
            self.shards.append(members)

    def start(self) -> ReplicatedCluster:
        for replica in self.all():
            replica.launch()
        for replica in self.all():
            replica.wait_ready()
        self.wait_all_ready()
        return self

    def all(self) -> list[Replica]:
        return [replica for members in self.shards for replica in members]

    @property
    def addresses(self) -> str:
        """PS_ADDRESSES' replicated form: shards by ',', replicas of a shard by '|'."""
        return ",".join("|".join(r.address for r in members) for members in self.shards)

    def primary(self, shard: int, timeout: float = 30.0) -> Replica:
        deadline = time.monotonic() + timeout
        while True:
            for replica in self.shards[shard]:
                if replica.running() and replica.is_primary():
                    return replica
            if time.monotonic() > deadline:
                raise AssertionError(f"shard {shard} has no primary after {timeout}s:\n" + self.logs(shard))
            time.sleep(0.02)

    def wait_all_ready(self, timeout: float = 60.0) -> None:
        """Every running replica is the primary or a backup in sync."""
        deadline = time.monotonic() + timeout
        while not (all(r.is_ready() for r in self.all() if r.running()) and self._backups_in_sync()):
            if time.monotonic() > deadline:
                raise AssertionError(f"replicas not in sync after {timeout}s:\n" + self.logs())
            time.sleep(0.05)

    def _backups_in_sync(self) -> bool:
        """Each shard's primary counts every other running replica in its in-sync set."""
        for shard, members in enumerate(self.shards):
            primary = self.primary(shard)
            try:
                backups = primary.status().backups
            except grpc.RpcError:
                return False
            running = sum(r.running() for r in members) - 1
            if sum(b.in_sync for b in backups) < running:
                return False
        return True

    def logs(self, shard: int | None = None) -> str:
        chosen = self.all() if shard is None else self.shards[shard]
        return "\n".join(f"--- shard {r.shard_index} replica {r.replica_index}\n"
                         f"{r.process.log_text()[-6000:]}" for r in chosen)

    def stop(self) -> None:
        for replica in self.all():
            replica.process.stop()


def wait_for(condition, timeout: float, what: str, cluster: ReplicatedCluster) -> float:
    """Poll ``condition`` until true; the time (monotonic) it was first seen true (fails after
    ``timeout`` seconds with ``what`` and the cluster's logs)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout}s:\n{cluster.logs()}"
        time.sleep(0.02)
    return time.monotonic()
