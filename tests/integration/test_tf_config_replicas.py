"""Replicated shards started as Kubeflow's TFJob operator starts them: each ps-server learns its
place only from a flat TF_CONFIG cluster.ps and PS_REPLICAS, and a worker reads the same list.

Real processes: one etcd, 2 shards x 2 replicas of ps-server, a PSClient from the environment
(tests/etcd_server.py skips where etcd is not installed)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
from ps_testing import ROOT, ServerProcess, child_env, free_port
from replica_testing import Replica

from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.rpc import method_path
from worker_client import SGD, PSClient

SHARDS, REPLICAS = 2, 2


@dataclass
class OperatorStartedServer(ServerProcess):
    """A ps-server given no shard index, shard count or port: TF_CONFIG (in ``env``) holds them."""

    def launch(self, port: int = 0) -> None:
        if self.port_file.exists():
            self.port_file.unlink()
        argv = [sys.executable, *self.program, "--host", self.host, "--port-file", str(self.port_file),
                *self.extra_args]
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                          cwd=str(ROOT), env=child_env(self.env))


def _tf_config(ps: list[str], task_type: str, index: int) -> str:
    return json.dumps({"cluster": {"ps": ps, "worker": ["127.0.0.1:1"]},
                       "task": {"type": task_type, "index": index}})


def _describe(replica: Replica) -> ps_pb2.DescribeResponse:
    with replica._channel() as channel:
        raw = channel.unary_unary(method_path("Describe"))(
            ps_pb2.DescribeRequest(any_replica=True).SerializeToString(), timeout=5)
    return ps_pb2.DescribeResponse.FromString(raw)


@pytest.fixture
def tfjob_ps(tmp_path, etcd_server):
    """The 4 PS replicas of a TFJob, index i at cluster.ps[i], each with PS_REPLICAS=2; stopped by PID."""
    ps = [f"127.0.0.1:{free_port()}" for _ in range(SHARDS * REPLICAS)]
    replicas = []
    for index, entry in enumerate(ps):
        directory = tmp_path / f"ps-{index}"
        directory.mkdir()
        env = {"TF_CONFIG": _tf_config(ps, "ps", index), "PS_REPLICAS": str(REPLICAS),
               # As deploy/tfjob-replicated: each replica advertises its own cluster.ps entry.
               "PS_ADVERTISE_ADDRESS": entry}
        args = ("--etcd-endpoints", etcd_server.endpoint, "--job-name", f"tfjob-{tmp_path.name}",
                "--primary-lease-seconds", "1", "--checkpoint-dir", str(directory / "checkpoints"))
        process = OperatorStartedServer(index, SHARDS * REPLICAS, directory, args, env=env)
        replicas.append(Replica(index // REPLICAS, index % REPLICAS, process, 0))
    try:
        for replica in replicas:
            replica.launch()
        for replica in replicas:
            replica.wait_ready()
        yield ps, replicas
    finally:
        for replica in replicas:
            replica.process.stop()


def test_each_server_takes_its_shard_replica_and_port_from_the_flat_cluster_ps(tfjob_ps):
    ps, replicas = tfjob_ps
    for index, replica in enumerate(replicas):
        assert replica.address == ps[index]  # the port of its own entry
        info = _describe(replica)
        assert (info.shard_index, info.num_shards) == (index // REPLICAS, SHARDS)
        assert (info.replication.replica_index, info.replication.replicas) == (index % REPLICAS, REPLICAS)


def test_a_worker_reads_the_same_list_as_each_shards_replicas_and_trains_through_the_primaries(tfjob_ps):
    ps, replicas = tfjob_ps
    env = {"TF_CONFIG": _tf_config(ps, "worker", 0), "PS_REPLICAS": str(REPLICAS)}
    # The client checks every shard's index and count against its list: a shard read otherwise is refused.
    with PSClient.from_env(env) as client:
        assert client.replicas == ((ps[0], ps[1]), (ps[2], ps[3]))
        client.create_variable("w", shape=(64, 8), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        client.push({"w": np.ones((64, 8), np.float32)})
        np.testing.assert_array_equal(client.pull(["w"])["w"], -np.ones((64, 8), np.float32))
        first, second = client.primaries
    assert first in ps[:2] and second in ps[2:]
