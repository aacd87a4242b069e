"""Killing and restarting real ps-servers: checkpoints, restore, exactly-once across restarts."""

from __future__ import annotations

import json
import signal
import threading
import time

import grpc
import numpy as np
import pytest

from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.arrays import byte_view
from wehub_ps.wire.codec import OutgoingChunk, encode_push_request
from wehub_ps.wire.rpc import method_path
from worker_client import SGD, Adam, Momentum, PSClient, PSUnavailableError


def _ckpt_args(root, interval: float = 0) -> tuple[str, ...]:
    return ("--checkpoint-dir", str(root), "--checkpoint-interval", str(interval))


def _kill_and_restart(server, signum=signal.SIGKILL) -> None:
    server.signal(signum)
    server.wait(30)
    server.start(port=server.port)


def test_sigkill_during_training_restores_and_workers_carry_on(cluster_factory, tmp_path):
    cluster = cluster_factory(2, *_ckpt_args(tmp_path / "ckpt", interval=0.5))
    config = json.dumps({"epochs": 40})
    workers = [cluster_factory.process("-m", "ps_local.worker", "--example", "digits", "--addresses",
                                       ",".join(cluster.addresses), "--worker-index", str(i),
                                       "--num-workers", "2", "--config", config) for i in range(2)]
    # Wait for real progress, then kill shard 0 without warning.
    for line in workers[0].stdout:
        message = json.loads(line)
        if message.get("type") == "progress" and message["step"] >= 150:
            break
    victim = cluster.servers[0]
    time.sleep(1.0)  # let a periodic checkpoint land
    victim.signal(signal.SIGKILL)
    victim.wait(30)
    time.sleep(0.5)  # workers now retry against a dead address
    victim.start(port=victim.port)
    for w in workers:
        out, err = w.communicate(timeout=300)
        assert w.returncode == 0, err[-3000:]
    assert '"event": "restored"' in victim.log_text()
    from ps_local.examples import digits_mlp

    with PSClient(cluster.addresses) as client:
        info = client.describe()[0]
        assert info.restored_from is not None
        accuracy = digits_mlp.evaluate(client, digits_mlp.Config())
    assert accuracy >= 0.90


def test_sigkill_during_a_checkpoint_write_keeps_the_previous_one(cluster_factory, tmp_path):
    root = tmp_path / "ckpt"
    cluster = cluster_factory(1, *_ckpt_args(root))
    server = cluster.servers[0]
    with PSClient(cluster.addresses, retry_timeout=1) as client:
        client.create_variable("w", shape=(40_000_000,), initializer="uniform", optimizer=SGD(learning_rate=1.0))
        first = client.checkpoint()[0]
        before = client.pull(["w"])["w"]
        client.push({"w": np.ones(40_000_000, np.float32)})
        writer = threading.Thread(target=lambda: pytest.raises(PSUnavailableError, client.checkpoint))
        writer.start()
        shard_dir = root / "shard-0-of-1"
        deadline = time.monotonic() + 60
        while not any(p.name.startswith(".tmp-") for p in shard_dir.iterdir()):
            assert time.monotonic() < deadline, "the second checkpoint never started"
            time.sleep(0.002)
        server.signal(signal.SIGKILL)
        server.wait(30)
        writer.join(60)
    assert sorted(p.name for p in shard_dir.iterdir() if p.name.startswith("ckpt-")) == [
        f"ckpt-{first['checkpoint_id']}"]
    server.start(port=server.port)
    assert not any(p.name.startswith(".tmp-") for p in shard_dir.iterdir()), "half-written checkpoint left"
    with PSClient(cluster.addresses) as client:
        assert client.describe()[0].restored_from["checkpoint_id"] == f"0:{first['checkpoint_id']}"
        np.testing.assert_array_equal(client.pull(["w"])["w"], before)


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest"])
def test_damaged_newest_checkpoint_is_skipped(cluster_factory, tmp_path, damage):
    root = tmp_path / "ckpt"
    cluster = cluster_factory(1, *_ckpt_args(root))
    server = cluster.servers[0]
    with PSClient(cluster.addresses) as client:
        client.create_variable("w", shape=(300, 300), initializer="normal", optimizer=Adam(learning_rate=0.01))
        client.push({"w": np.ones((300, 300), np.float32)})
        client.checkpoint()
        older = client.pull(["w"])["w"]
        client.push({"w": np.ones((300, 300), np.float32)})
        newest = client.checkpoint()[0]
    server.signal(signal.SIGKILL)
    server.wait(30)
    path = root / "shard-0-of-1" / f"ckpt-{newest['checkpoint_id']}"
    tensors = path / "tensors.safetensors"
    if damage == "truncate":
        data = tensors.read_bytes()
        tensors.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        data = bytearray(tensors.read_bytes())
        data[len(data) - 100] ^= 0xFF
        tensors.write_bytes(bytes(data))
    else:
        manifest = json.loads((path / "manifest.json").read_text())
        manifest["variables"][0]["version"] += 1
        (path / "manifest.json").write_text(json.dumps(manifest))
    server.start(port=server.port)
    assert "CHECKPOINT SKIPPED" in server.log_text()
    with PSClient(cluster.addresses) as client:
        np.testing.assert_array_equal(client.pull(["w"])["w"], older)
        assert client.describe()[0].variables["w"]["version"] == 1


def test_a_server_whose_every_checkpoint_is_damaged_refuses_to_start(cluster_factory, tmp_path):
    """Damaged checkpoints are skipped loudly; with none intact the server exits 1 instead of starting empty."""
    root = tmp_path / "ckpt"
    cluster = cluster_factory(1, *_ckpt_args(root))
    server = cluster.servers[0]
    with PSClient(cluster.addresses) as client:
        client.create_variable("w", shape=(100,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        for _ in range(2):
            client.push({"w": np.ones(100, np.float32)})
            client.checkpoint()
    server.signal(signal.SIGKILL)
    server.wait(30)
    checkpoints = sorted((root / "shard-0-of-1").glob("ckpt-*"))
    assert len(checkpoints) == 2
    for path in checkpoints:
        tensors = path / "tensors.safetensors"
        data = bytearray(tensors.read_bytes())
        data[-10] ^= 0xFF
        tensors.write_bytes(bytes(data))
    server.launch(server.port)
    assert server.wait(60) == 1
    log = server.log_text()
    assert log.count("CHECKPOINT SKIPPED") == 2 and "every checkpoint" in log
    assert not server.port_file.exists()  # it never served
    assert sorted((root / "shard-0-of-1").glob("ckpt-*")) == checkpoints  # and removed nothing


def test_sigterm_during_pushes_checkpoints_them_and_exits_zero(cluster_factory, tmp_path):
    cluster = cluster_factory(1, *_ckpt_args(tmp_path / "ckpt"))
    server = cluster.servers[0]
    acknowledged = []
    with PSClient(cluster.addresses, retry_timeout=2, heartbeat=False) as client:
        client.create_variable("w", shape=(1000, 1000), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        grad = np.ones((1000, 1000), np.float32)

        def pusher() -> None:
            while True:
                try:
                    client.push({"w": grad})
                except PSUnavailableError:
                    return
                acknowledged.append(1)

        thread = threading.Thread(target=pusher)
        thread.start()
        while len(acknowledged) < 5:
            time.sleep(0.005)
        server.signal(signal.SIGTERM)
        assert server.wait(60) == 0
        thread.join(60)
    log = server.log_text()
    assert '"reason": "shutdown"' in log and '"drained": true' in log
    server.start(port=server.port)
    with PSClient(cluster.addresses) as client:
        np.testing.assert_array_equal(client.pull(["w"])["w"],
                                      np.full((1000, 1000), -len(acknowledged), np.float32))


def _raw_push(address: str, sequence: int) -> ps_pb2.PushResponse:
    begin = ps_pb2.PushBegin(worker_id="w", incarnation="inc-1", sequence=sequence, shard_index=0, num_shards=1,
                             kind=ps_pb2.GRADIENT,
                             items=[ps_pb2.PushItem(variable="v", elements=4, wire_dtype=ps_pb2.FLOAT32)])
    header = ps_pb2.ChunkHeader(variable="v", offset=0, count=4, dtype=ps_pb2.FLOAT32)
    message = encode_push_request(begin, [OutgoingChunk(header, byte_view(np.ones(4, np.float32)))])
    with grpc.insecure_channel(address) as channel:
        raw = channel.stream_unary(method_path("Push"))(iter([message]), timeout=10)
    return ps_pb2.PushResponse.FromString(raw)


def test_deduplication_survives_a_restart(cluster_factory, tmp_path):
    cluster = cluster_factory(1, *_ckpt_args(tmp_path / "ckpt"))
    server = cluster.servers[0]
    with PSClient(cluster.addresses) as client:
        client.create_variable("v", shape=(4,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
    assert not _raw_push(server.address, 1).duplicate
    with PSClient(cluster.addresses) as client:
        client.checkpoint()
    _kill_and_restart(server)
    again = _raw_push(server.address, 1)  # the retry of a push applied before the checkpoint
    assert again.duplicate and again.elements_applied == 0
    assert not _raw_push(server.address, 2).duplicate
    with PSClient(cluster.addresses) as client:
        np.testing.assert_array_equal(client.pull(["v"])["v"], np.full(4, -2, np.float32))


def test_a_client_notices_that_its_server_rolled_back(cluster_factory, tmp_path, caplog):
    cluster = cluster_factory(1, *_ckpt_args(tmp_path / "ckpt"))
    with PSClient(cluster.addresses, retry_timeout=30) as client:
        client.create_variable("v", shape=(4,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        for _ in range(2):
            client.push({"v": np.ones(4, np.float32)})
        client.checkpoint()  # version 2 is durable
        for _ in range(3):
            client.push({"v": np.ones(4, np.float32)})
        assert client.versions("v") == {0: 5} and client.stats()["rollbacks"] == 0
        _kill_and_restart(cluster.servers[0])
        np.testing.assert_array_equal(client.pull(["v"])["v"], np.full(4, -2, np.float32))
    # The three pushes after the checkpoint are lost, and the user is told.
    assert client.versions("v") == {0: 2}
    assert client.stats()["rollbacks"] == 1
    assert "ps-server rolled back" in caplog.text


def _train(clients: list[PSClient], steps: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        grads = {"emb": rng.standard_normal((1000, 64)).astype(np.float32),
                 "dense": rng.standard_normal((64, 32)).astype(np.float32),
                 "bias": rng.standard_normal(32).astype(np.float32)}
        for client in clients:
            client.push(grads)


def _create(client: PSClient) -> None:
    client.create_variable("emb", shape=(1000, 64), initializer="normal", optimizer=Adam(learning_rate=0.01))
    client.create_variable("dense", shape=(64, 32), initializer="glorot_uniform",
                           optimizer=Momentum(learning_rate=0.05, nesterov=True))
    client.create_variable("bias", shape=(32,), initializer="zeros", optimizer=SGD(learning_rate=0.1))


def test_restore_onto_a_different_number_of_shards(cluster_factory, tmp_path):
    root = tmp_path / "ckpt"
    reference = cluster_factory(1)  # the same updates on one shard: the expected values
    three = cluster_factory(3, *_ckpt_args(root))
    with PSClient(reference.addresses) as ref, PSClient(three.addresses) as client:
        _create(ref)
        _create(client)
        assert len(client.variables()["emb"].placement.parts) == 1  # 256 KB: whole
        _train([ref, client], steps=5, seed=1)
        trained = client.pull()
    three.stop()  # SIGTERM: final checkpoints
    for num_shards in (2, 4):
        resharded = cluster_factory(num_shards, *_ckpt_args(root))
        with PSClient(resharded.addresses) as client, PSClient(reference.addresses) as ref:
            infos = client.describe()
            assert all(i.restored_from is not None for i in infos)
            pulled = client.pull()
            for name, value in trained.items():
                assert pulled[name].tobytes() == value.tobytes(), (num_shards, name)
            # Optimizer slots and step counts came along: further updates match too.
            _train([ref, client], steps=2, seed=num_shards)
            expected = ref.pull()
            after = client.pull()
            for name in expected:
                assert after[name].tobytes() == expected[name].tobytes(), (num_shards, name)
            trained = after
        resharded.stop()


def test_a_resharded_server_checkpoints_its_new_layout_before_serving(cluster_factory, tmp_path):
    """Restored onto another --num-shards, each server writes the new layout's checkpoint at once.

    So a SIGKILL right after the start restores from the new layout, not by resharding again.
    """
    root = tmp_path / "ckpt"
    one = cluster_factory(1, *_ckpt_args(root))
    with PSClient(one.addresses) as client:
        client.create_variable("w", shape=(200_000,), initializer="uniform", optimizer=SGD(learning_rate=1.0))
        client.push({"w": np.ones(200_000, np.float32)})
        trained = client.pull(["w"])["w"]
    one.stop()
    two = cluster_factory(2, *_ckpt_args(root))
    for i in range(2):  # written before the port file, so before any client could connect
        assert len(list((root / f"shard-{i}-of-2").glob("ckpt-*"))) == 1
    for server in two.servers:
        _kill_and_restart(server)
    with PSClient(two.addresses) as client:
        assert [info.restored_from["num_shards"] for info in client.describe()] == [2, 2]
        assert client.pull(["w"])["w"].tobytes() == trained.tobytes()
        assert len(client.variables()["w"].placement.parts) == 2


def test_a_killed_worker_drops_out_and_rejoins(cluster_factory):
    cluster = cluster_factory(2, "--worker-lease", "1")
    code = """
import sys, numpy as np
from worker_client import PSClient
with PSClient(sys.argv[1].split(","), worker_id=sys.argv[2]) as c:
    g = np.ones((500, 500), np.float32)
    for i in range(int(sys.argv[3])):
        c.push({"w": g})
        print(i, flush=True)
"""
    with PSClient(cluster.addresses, worker_id="observer") as observer:
        observer.create_variable("w", shape=(500, 500), optimizer=SGD(learning_rate=0.001))
        victim = cluster_factory.python(code, ",".join(cluster.addresses), "victim", "100000")
        survivor = cluster_factory.python(code, ",".join(cluster.addresses), "survivor", "300")
        for _ in range(20):
            victim.stdout.readline()
        workers = observer.describe()[0].workers
        assert workers["victim"]["live"]
        first_incarnation = workers["victim"]["incarnation"]
        victim.send_signal(signal.SIGKILL)  # most likely in the middle of a push
        victim.wait(10)
        out, err = survivor.communicate(timeout=120)
        assert survivor.returncode == 0, err
        deadline = time.monotonic() + 20
        while observer.describe()[0].workers["victim"]["live"]:
            assert time.monotonic() < deadline, "the dead worker's lease never expired"
            time.sleep(0.2)
        assert observer.describe()[1].workers["survivor"]["pushes"] == 300
        rejoined = cluster_factory.python(code, ",".join(cluster.addresses), "victim", "5")
        out, err = rejoined.communicate(timeout=60)
        assert rejoined.returncode == 0, err
        record = observer.describe()[0].workers["victim"]
        assert record["incarnation"] != first_incarnation and record["step"] == 0
