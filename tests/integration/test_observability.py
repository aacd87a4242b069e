"""Metrics, the plaintext health port, server reflection, ps-admin, and finish()."""

from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from ps_testing import ROOT, child_env, free_port, metric_value, scrape

from ps_server import ServerConfig, create_server
from wehub_ps.v1 import ps_pb2
from worker_client import SGD, FailedPreconditionError, PSClient, PSError, PSUnavailableError


@pytest.fixture
def server(tmp_path):
    config = ServerConfig(host="127.0.0.1", port=0, metrics_port=free_port(), health_port=free_port(),
                          checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_interval=0)
    srv = create_server(config)
    srv.start()
    yield srv
    srv.stop(grace=1)




def test_metrics_count_what_happened(server):
    address = f"127.0.0.1:{server.port}"
    with PSClient([address], worker_id="m") as client:
        client.create_variable("w", shape=(300, 300), optimizer=SGD(learning_rate=0.1))
        for _ in range(3):
            client.pull(["w"])
            client.push({"w": np.ones((300, 300), np.float32)})
        with pytest.raises(Exception):
            client.push({"w": np.ones((300, 301), np.float32)})  # refused by the client: not counted
        client.checkpoint()
        server.metrics.live_workers.set(len(server.membership.live_ids()))
        text = scrape(server.metrics_port)
    assert metric_value(text, 'wehub_ps_pushes_total{outcome="ok",variable="w"}') == 3
    assert metric_value(text, 'wehub_ps_pulls_total{outcome="ok",variable="w"}') == 3
    assert metric_value(text, "wehub_ps_bytes_received_total") >= 3 * 300 * 300 * 4
    assert metric_value(text, "wehub_ps_bytes_sent_total") >= 3 * 300 * 300 * 4
    assert metric_value(text, "wehub_ps_apply_seconds_count") >= 3
    assert metric_value(text, "wehub_ps_push_staleness_count") >= 2
    assert metric_value(text, "wehub_ps_checkpoint_seconds_count") == 1
    assert metric_value(text, "wehub_ps_live_workers") == 1
    assert metric_value(text, "wehub_ps_checkpoint_age_seconds") < 60


def test_errors_are_counted_by_reason(server):
    """Refusals count by reason; names that are no variable here never become label values
    (a client making up names would otherwise add a time series per name)."""
    address = f"127.0.0.1:{server.port}"
    with grpc.insecure_channel(address) as channel:
        for i in range(20):
            request = ps_pull_request(f"nope-{i}")
            with pytest.raises(grpc.RpcError):
                list(channel.unary_stream("/wehub_ps.v1.ParameterServer/Pull")(request, timeout=5))
        begin = ps_pb2.PushBegin(worker_id="w", incarnation="i", sequence=1, shard_index=0, num_shards=1,
                                 kind=ps_pb2.GRADIENT,
                                 items=[ps_pb2.PushItem(variable="made-up", elements=1)])
        with pytest.raises(grpc.RpcError):
            channel.stream_unary("/wehub_ps.v1.ParameterServer/Push")(
                iter([ps_pb2.PushRequest(begin=begin).SerializeToString()]), timeout=5)
    text = scrape(server.metrics_port)
    assert metric_value(text, 'wehub_ps_pulls_total{outcome="UNKNOWN_VARIABLE",variable="-"}') == 20
    assert metric_value(text, 'wehub_ps_pushes_total{outcome="UNKNOWN_VARIABLE",variable="-"}') == 1
    assert "nope" not in text and "made-up" not in text


def ps_pull_request(name: str) -> bytes:
    return ps_pb2.PullRequest(shard_index=0, num_shards=1, items=[ps_pb2.PullItem(variable=name)]).SerializeToString()


def test_health_port_and_reflection(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        assert stub.Check(health_pb2.HealthCheckRequest(service="wehub_ps.v1.ParameterServer"),
                          timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:  # the health port serves health only
            channel.unary_unary("/wehub_ps.v1.ParameterServer/Describe")(b"", timeout=5)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                            timeout=5)
        services = {s.name for answer in answers for s in answer.list_services_response.service}
    assert "wehub_ps.v1.ParameterServer" in services and "grpc.health.v1.Health" in services


def test_ps_admin_shows_the_cluster_and_triggers_checkpoints(cluster_factory, tmp_path):
    cluster = cluster_factory(2, "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-interval", "0")
    with PSClient(cluster.addresses, worker_id="trainer") as client:
        client.create_variable("w", shape=(1000, 300), optimizer=SGD(learning_rate=0.1))
        client.push({"w": np.ones((1000, 300), np.float32)})

        def admin(*args: str) -> str:
            result = subprocess.run([sys.executable, "-m", "worker_client.admin", *args, "--addresses",
                                     ",".join(cluster.addresses)], capture_output=True, text=True,
                                    cwd=str(ROOT), env=child_env(), timeout=60)
            assert result.returncode == 0, result.stderr
            return result.stdout

        assert "checkpoint 0000000001" in admin("checkpoint")
        status = admin("status")
    lines = status.splitlines()
    assert lines[0].split()[:3] == ["shard", "address", "health"]
    for i, address in enumerate(cluster.addresses):
        row = next(line for line in lines if line.startswith(f"{i}/2 "))
        assert address in row and "SERVING" in row and "0000000001" in row and "1..1" in row
    assert any(line.startswith("trainer") and " yes " in line for line in lines)


def test_ps_admin_status_shows_a_down_shard_as_unreachable(cluster_factory):
    cluster = cluster_factory(2)
    with PSClient(cluster.addresses, worker_id="trainer") as client:
        client.create_variable("w", shape=(1000, 300), optimizer=SGD(learning_rate=0.1))
    cluster.servers[1].signal(signal.SIGKILL)
    cluster.servers[1].wait()
    result = subprocess.run([sys.executable, "-m", "worker_client.admin", "status", "--timeout", "5",
                             "--addresses", ",".join(cluster.addresses)], capture_output=True, text=True,
                            cwd=str(ROOT), env=child_env(), timeout=60)
    assert result.returncode == 3, (result.stdout, result.stderr)
    lines = result.stdout.splitlines()
    up = next(line for line in lines if line.startswith("0/2 "))
    assert up.split()[1:4] == [cluster.addresses[0], "SERVING", "1"]  # shown in full: its one variable
    down = next(line for line in lines if line.startswith("1/2 "))
    assert down.split()[:3] == ["1/2", cluster.addresses[1], "UNREACHABLE"]
    assert cluster.addresses[1] in result.stderr
    usage = subprocess.run([sys.executable, "-m", "worker_client.admin", "--help"], capture_output=True,
                           text=True, cwd=str(ROOT), env=child_env(), timeout=60).stdout
    assert "3 (status) a shard did not answer" in " ".join(usage.split())


def test_finish_ends_a_job_and_is_refused_by_a_service(cluster_factory, tmp_path):
    service = cluster_factory(1)
    with PSClient(service.addresses, worker_id="chief") as client:
        with pytest.raises(FailedPreconditionError, match="--allow-finish"):
            client.finish(wait_for_workers=False)
    assert service.servers[0].popen.poll() is None
    job = cluster_factory(2, "--allow-finish", "--checkpoint-dir", str(tmp_path / "job"),
                          "--checkpoint-interval", "0")
    with PSClient(job.addresses, worker_id="worker-1") as other, \
            PSClient(job.addresses, worker_id="worker-0") as chief:
        chief.create_variable("w", shape=(10,), optimizer=SGD(learning_rate=1.0))
        other.push({"w": np.ones(10, np.float32)})
        other.close()  # the other worker is done: it leaves the live set at once
        chief.finish()
    for server in job.servers:
        assert server.wait(60) == 0
        assert '"reason": "shutdown"' in server.log_text()


def test_server_logs_are_quiet_json_lines(cluster_factory, tmp_path):
    """Every line a ps-server writes is one JSON event; a short run at info is a handful of lines."""
    cluster = cluster_factory(1, "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-interval", "0")
    server = cluster.servers[0]
    with PSClient(cluster.addresses, worker_id="trainer") as client:
        client.create_variable("w", shape=(1000,), optimizer=SGD(learning_rate=0.1))
        for _ in range(50):
            client.push({"w": np.ones(1000, np.float32)})
            client.pull(["w"])
        with pytest.raises(PSError):
            client.pull(["missing"])  # refused requests are answered, not logged line by line
    server.stop()
    assert server.popen.returncode == 0
    lines = server.log_text().splitlines()
    events = [json.loads(line) for line in lines]  # raises on any line that is not JSON
    assert all({"ts", "level", "event"} <= set(e) for e in events), lines
    assert all(e["level"] in ("info", "warning", "error") for e in events)
    assert len(events) <= 12, "\n".join(lines)


# Long enough that a warning is sure: the client warns from half the timeout on, and its retries are at
# most 3 s (RetryPolicy.max_backoff) apart, so at least one of them fails in the second half.
_WAIT = 7.0


def _closed_port_address() -> str:
    """A loopback address nothing listens on: connections to it are refused at once."""
    return f"127.0.0.1:{free_port()}"


def _waiting_messages(caplog) -> list[str]:
    """The client's 'waiting for ps-server' warnings as a plain logging.basicConfig() prints them."""
    formatter = logging.Formatter(logging.BASIC_FORMAT)
    return [formatter.format(r) for r in caplog.records
            if r.name == "worker_client" and r.levelno == logging.WARNING and "waiting for" in r.getMessage()]


def test_waiting_to_connect_is_logged_in_words(caplog):
    """The connect's warning says which server, which call and what failed, in the text itself."""
    address = _closed_port_address()
    with caplog.at_level(logging.WARNING, logger="worker_client"):
        with pytest.raises(PSUnavailableError, match="connect_timeout 7s") as info:
            PSClient([address], worker_id="w", connect_timeout=_WAIT)
    messages = _waiting_messages(caplog)
    assert messages, "no warning while waiting for a server that refuses connections"
    for message, record in zip(messages, [r for r in caplog.records if "waiting for" in r.getMessage()]):
        assert f"waiting for ps-server {address} (call connect)" in message
        assert "Connection refused" in message and "UNAVAILABLE" in message
        assert record.fields["error"] in message  # the last error, whole
        assert record.fields["address"] == address and record.fields["call"] == "connect"
    assert address in str(info.value)


def test_waiting_in_a_call_is_logged_in_words(caplog):
    """A call on a client that did not connect first (as ps-admin's status) waits with the same words."""
    address = _closed_port_address()
    with PSClient([address], worker_id="w", connect=False, register=False, retry_timeout=_WAIT) as client:
        with caplog.at_level(logging.WARNING, logger="worker_client"):
            with pytest.raises(PSUnavailableError, match="retry_timeout 7s"):
                client.pull(["w"])
    messages = _waiting_messages(caplog)
    assert messages, "no warning while retrying against a server that refuses connections"
    for message in messages:
        assert f"waiting for ps-server {address} (call describe)" in message
        assert "Connection refused" in message and "giving up after 7s (retry_timeout)" in message


# Runs ps-admin with os.environ replaced by a mapping that notes every name this repository's code
# reads (not numba's or grpc's own), then writes those names as JSON to argv[1].
_RECORD_ENVIRONMENT = r"""
import collections.abc, json, os, pathlib, sys

ROOT = pathlib.Path.cwd().resolve()
PASSING = ("collections", "_collections_abc", "os.py")  # frames between a reader and the mapping


class Recording(collections.abc.MutableMapping):
    def __init__(self, environ):
        self._environ, self.read = environ, set()

    def _note(self, key):
        frame = sys._getframe(2)
        while frame is not None and any(part in frame.f_code.co_filename for part in PASSING):
            frame = frame.f_back
        if frame is None or frame.f_code.co_filename.startswith("<"):  # the import machinery, frozen
            return
        where = pathlib.Path(frame.f_code.co_filename).resolve()
        if ROOT in where.parents and "site-packages" not in where.parts:
            self.read.add(key)

    def __getitem__(self, key):
        self._note(key)
        return self._environ[key]

    def get(self, key, default=None):
        self._note(key)
        return self._environ.get(key, default)

    def __contains__(self, key):
        self._note(key)
        return key in self._environ

    def __setitem__(self, key, value):
        self._environ[key] = value

    def __delitem__(self, key):
        del self._environ[key]

    def __iter__(self):
        return iter(self._environ)

    def __len__(self):
        return len(self._environ)

    def copy(self):
        return dict(self._environ)


recording = os.environ = Recording(os.environ)
from worker_client.admin import main

statuses = [main(["status", "--timeout", "20"]), main(["checkpoint", "--timeout", "20"]),
            main(["status", "--timeout", "20", "--addresses", os.environ["PS_ADDRESSES"]])]
pathlib.Path(sys.argv[1]).write_text(json.dumps({"read": sorted(recording.read), "statuses": statuses}))
"""


def test_ps_admin_help_names_every_variable_it_reads(cluster_factory, tmp_path):
    cluster = cluster_factory(2, "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-interval", "0")
    with PSClient(cluster.addresses, worker_id="trainer") as client:
        client.create_variable("w", shape=(1000, 300), optimizer=SGD(learning_rate=0.1))
    record = tmp_path / "read.json"
    result = subprocess.run([sys.executable, "-c", _RECORD_ENVIRONMENT, str(record)], capture_output=True,
                            text=True, cwd=str(ROOT), timeout=120,
                            env=child_env({"PS_ADDRESSES": ",".join(cluster.addresses)}))
    assert result.returncode == 0, result.stderr
    seen = json.loads(record.read_text())
    assert seen["statuses"] == [0, 0, 0], result.stderr
    read = set(seen["read"])
    # The recording works: it saw what PSClient.from_env looks up.
    assert {"PS_ADDRESSES", "TF_CONFIG", "PS_TLS_CA", "PS_TLS_CERT", "PS_TLS_KEY", "PS_SERVER_NAME",
            "PS_AUTH_TOKEN_FILE", "PS_AUTH_TOKEN"} <= read
    usage = subprocess.run([sys.executable, "-m", "worker_client.admin", "--help"], capture_output=True,
                           text=True, cwd=str(ROOT), env=child_env(), timeout=60).stdout
    listed = {line.split()[0] for line in usage.splitlines() if line.startswith("  ") and line.split()}
    assert read <= listed, f"ps-admin reads {sorted(read - listed)} but --help does not list them:\n{usage}"


def _admin_status(addresses: list[str]) -> str:
    result = subprocess.run([sys.executable, "-m", "worker_client.admin", "status", "--addresses",
                             ",".join(addresses)], capture_output=True, text=True, cwd=str(ROOT),
                            env=child_env(), timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _shard_row(status: str, shard: str, table_header: str) -> list[str]:
    """The row of ``shard`` ("0/2") in the table whose header starts with ``table_header``, cut into cells."""
    table = next(t for t in status.split("\n\n") if t.startswith(table_header))
    row = next(line for line in table.splitlines() if line.startswith(shard + " "))
    return re.split(r"\s{2,}", row.strip())


def _summary(status: str) -> dict[str, str]:
    """'cluster step', 'dropped gradients', 'largest staleness' -> the value ps-admin shows."""
    lines = status[status.index("consistency: "):].splitlines()
    return {" ".join(line.split()[:2]): line.split()[2] for line in lines[1:]}


def _create_three(client: PSClient) -> int:
    """A variable on both shards, one whole on one shard and a table (a part on every shard).

    Returns the shard holding the small one."""
    client.create_variable("big", shape=(1000, 300), optimizer=SGD(learning_rate=0.1))
    small = client.create_variable("small", shape=(8,), optimizer=SGD(learning_rate=0.1))
    client.create_embedding("emb", dim=4)
    assert len(small.placement.parts) == 1
    return small.placement.parts[0].shard


def _check_variables(status: str, small_on: int) -> None:
    for shard in (0, 1):
        cells = _shard_row(status, f"{shard}/2", "shard  address")
        assert cells[3:5] == ["3", "3" if shard == small_on else "2"], cells  # known, held


def test_ps_admin_status_in_sync_mode_shows_the_step_and_dropped_gradients(cluster_factory):
    """Two workers, one backup: the first worker's push applies step 0, the second's comes late and is
    dropped on both shards."""
    cluster = cluster_factory(2, "--consistency", "sync", "--backup-workers", "1", "--expected-workers", "2")
    with PSClient(cluster.addresses, worker_id="chief", register=False) as chief:
        small_on = _create_three(chief)
    with PSClient(cluster.addresses, worker_id="fast") as fast, \
            PSClient(cluster.addresses, worker_id="late") as late:
        gradient = np.ones((1000, 300), np.float32)
        with fast.step(["big"]) as step:
            step.push({"big": gradient})
        with late.step(["big"]) as step:
            step.push({"big": gradient})
        assert late.stats()["dropped_pushes"] == 2
        status = _admin_status(cluster.addresses)
    _check_variables(status, small_on)
    assert "consistency: sync (backup workers 1)" in status
    for shard in ("0/2", "1/2"):  # step, steps applied, dropped gradients, largest staleness
        assert _shard_row(status, shard, "shard  step")[1:5] == ["1", "1", "1", "0"]
    assert _summary(status) == {"cluster step": "1", "dropped gradients": "2", "largest staleness": "0"}


def test_ps_admin_status_in_ssp_mode_shows_the_step_and_the_largest_staleness(cluster_factory):
    """Staleness bound 2: one worker runs three steps ahead of the other, its third pull two steps ahead."""
    cluster = cluster_factory(2, "--consistency", "ssp", "--staleness", "2", "--expected-workers", "2")
    with PSClient(cluster.addresses, worker_id="chief", register=False) as chief:
        small_on = _create_three(chief)
    with PSClient(cluster.addresses, worker_id="ahead") as ahead, \
            PSClient(cluster.addresses, worker_id="behind") as behind:
        gradient = np.ones((1000, 300), np.float32)
        for _ in range(3):
            with ahead.step(["big"]) as step:
                step.push({"big": gradient})
        with behind.step(["big"]) as step:
            step.push({"big": gradient})
        status = _admin_status(cluster.addresses)
    _check_variables(status, small_on)
    assert "consistency: ssp (staleness bound 2)" in status
    for shard in ("0/2", "1/2"):  # step (the slowest clock), steps applied, dropped, largest staleness
        assert _shard_row(status, shard, "shard  step")[1:5] == ["1", "0", "0", "2"]
    assert _summary(status) == {"cluster step": "1", "dropped gradients": "0", "largest staleness": "2"}
