"""A client given a shard's replicas finds and follows the primary, on every path that talks to a shard.

The primary is a real ps-server. The backup is a stand-in: a tiny in-process
gRPC server that refuses every method of the ParameterServer service as a
backup replica does (UNAVAILABLE, reason NOT_PRIMARY, the primary's address
in the trailing metadata, or none). It holds no state, so these tests check
the client's side of a failover (which replica it talks to, and that every
acknowledged push is applied once), not the servers' replication.
"""

from __future__ import annotations

import re
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
from ps_testing import free_port

from wehub_ps.errors import REASON_METADATA_KEY, Reason
from wehub_ps.wire.rpc import PRIMARY_METADATA_KEY, SERVICE_NAME
from worker_client import SGD, PSClient
from worker_client.admin import main as admin_main
from worker_client.errors import FailedPreconditionError, PSUnavailableError

_UNARY = ("Describe", "CreateVariable", "Heartbeat", "Checkpoint", "Finish")


class FakeBackup:
    """A replica that is not the primary: refuses every call, naming ``primary`` (None: no name)."""

    def __init__(self, primary: str | None) -> None:
        self.primary = primary
        self.refused: list[str] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(8))
        handlers = {name: grpc.unary_unary_rpc_method_handler(self._refuse(name)) for name in _UNARY}
        handlers["Pull"] = grpc.unary_stream_rpc_method_handler(self._refuse("Pull"))
        handlers["Push"] = grpc.stream_unary_rpc_method_handler(self._refuse("Push"))
        handlers["Exchange"] = grpc.stream_stream_rpc_method_handler(self._refuse("Exchange"))
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def count(self, method: str) -> int:
        with self._lock:
            return self.refused.count(method)

    def _refuse(self, method: str):
        def handler(request, context: grpc.ServicerContext):
            with self._lock:
                self.refused.append(method)
            trailers = [(REASON_METADATA_KEY, Reason.NOT_PRIMARY.value)]
            if self.primary:
                trailers.append((PRIMARY_METADATA_KEY, self.primary))
            context.set_trailing_metadata(tuple(trailers))
            context.abort(grpc.StatusCode.UNAVAILABLE, "this replica is a backup")
        return handler

    def stop(self) -> None:
        self.server.stop(0).wait()


@pytest.fixture
def primary(cluster_factory):
    """One real ps-server, shard 0 of 1, with a short worker lease (heartbeats every second)."""
    return cluster_factory(1, "--worker-lease", "3").servers[0]


@pytest.fixture
def backups():
    made: list[FakeBackup] = []

    def make(primary: str | None) -> FakeBackup:
        made.append(FakeBackup(primary))
        return made[-1]

    yield make
    for backup in made:
        backup.stop()


def _exercise(client: PSClient) -> None:
    """Create, push (small over the lane, large as a stream), pull; the values add up exactly."""
    client.create_variable("small", shape=(8,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
    client.create_variable("large", shape=(600_000,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
    for _ in range(3):
        client.push({"small": -np.ones(8, np.float32), "large": -np.ones(600_000, np.float32)})
    values = client.pull()
    np.testing.assert_array_equal(values["small"], np.full(8, 3.0, np.float32))
    np.testing.assert_array_equal(values["large"], np.full(600_000, 3.0, np.float32))


def test_a_backup_listed_first_sends_the_client_to_the_primary(primary, backups):
    backup = backups(primary.address)
    with PSClient([f"{backup.address}|{primary.address}"], worker_id="w", retry_timeout=30) as client:
        assert client.replicas == ((backup.address, primary.address),)
        assert client.addresses == (f"{backup.address}|{primary.address}",)
        assert client.primaries == (primary.address,)
        _exercise(client)
    assert backup.count("Describe") == 1  # asked once, on connect; everything else went to the primary


def test_a_backup_that_names_no_primary_makes_the_client_try_the_next_replica(primary, backups):
    backup = backups(None)
    with PSClient([[backup.address, primary.address]], worker_id="w", retry_timeout=30) as client:
        assert client.primaries == (primary.address,)
        _exercise(client)


def test_a_refused_connection_moves_on_to_the_next_replica(primary):
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    with PSClient(f"{dead}|{primary.address}", worker_id="w", retry_timeout=30) as client:
        assert client.primaries == (primary.address,)
        _exercise(client)
    assert time.monotonic() - started < 20


def test_every_path_follows_the_primary_back_when_sent_to_a_backup(primary, backups):
    """Each path is sent to the backup first (as after a failover to it and back), and finds the primary."""
    backup = backups(primary.address)
    with PSClient([f"{primary.address}|{backup.address}"], worker_id="w", retry_timeout=30) as client:
        client.create_variable("small", shape=(8,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        client.create_variable("large", shape=(600_000,), initializer="zeros",
                               optimizer=SGD(learning_rate=1.0))
        shard = client._session.shards[0]

        def to_backup() -> None:
            shard.follow(PSUnavailableError("gone", address=primary.address, code="UNAVAILABLE"))
            assert client.primaries == (backup.address,)

        steps = {
            "Exchange": lambda: client.push({"small": -np.ones(8, np.float32)}),
            "Push": lambda: client.push({"large": -np.ones(600_000, np.float32)}),
            "Pull": lambda: client.pull(["large"]),
            "CreateVariable": lambda: client.create_variable("other", shape=(4,), initializer="zeros"),
            "Describe": lambda: client.describe(),
            # No --checkpoint-dir: the primary refuses, after the backup did.
            "Checkpoint": lambda: pytest.raises(FailedPreconditionError, client.checkpoint),
        }
        # A lane opens with a Describe (asking for the server's TCP lane port), which the backup refuses too.
        lane = ("Exchange", "Describe")
        for method, step in steps.items():
            to_backup()
            asked = lane if method == "Exchange" else (method,)
            before = sum(backup.count(m) for m in asked)
            step()
            assert sum(backup.count(m) for m in asked) > before, method
            assert client.primaries == (primary.address,), method
        # The small pull rides the lane.
        to_backup()
        before = sum(backup.count(m) for m in lane)
        np.testing.assert_array_equal(client.pull(["small"])["small"], np.ones(8, np.float32))
        assert sum(backup.count(m) for m in lane) > before
        # The client finds the primary on its own: the replica watch (a health check every 0.25 s) or the
        # heartbeat thread (a beat a second), whichever asks the backup first.
        to_backup()
        deadline = time.monotonic() + 10
        while client.primaries != (primary.address,) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.primaries == (primary.address,)
        np.testing.assert_array_equal(client.pull(["large"])["large"], np.ones(600_000, np.float32))


def test_threads_pushing_through_repeated_switches_apply_every_push_once(primary, backups):
    backup = backups(primary.address)
    threads, pushes = 4, 100
    with PSClient([f"{primary.address}|{backup.address}"], worker_id="w", retry_timeout=30) as client:
        client.create_variable("counter", shape=(16,), dtype="float64", initializer="zeros",
                               optimizer=SGD(learning_rate=1.0))
        shard = client._session.shards[0]
        done = threading.Event()
        switches: list[bool] = []

        def switcher() -> None:
            """Sends the shard to the backup 20 times, 50 ms apart, while the pushes run."""
            while len(switches) < 20 and not done.wait(0.05):
                current = shard.address
                if current == primary.address:
                    gone = PSUnavailableError("gone", address=current, code="UNAVAILABLE")
                    switches.append(shard.follow(gone))

        def worker(k: int) -> None:
            for _ in range(pushes):
                client.push({"counter": np.full(16, -(k + 1), np.float64)})

        switching = threading.Thread(target=switcher)
        switching.start()
        with futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(worker, range(threads)))
        done.set()
        switching.join()
        expected = pushes * sum(range(1, threads + 1))
        np.testing.assert_array_equal(client.pull(["counter"])["counter"], np.full(16, expected, np.float64))
        assert len(switches) >= 5, "the pushes ended before the switches began: make them more"
        assert backup.count("Exchange") + backup.count("Push") > 0  # pushes did meet the backup


def test_ps_admin_status_shows_each_replica(primary, backups, capsys):
    backup = backups(primary.address)
    addresses = f"{backup.address}|{primary.address}"
    assert admin_main(["status", "--timeout", "10", "--addresses", addresses]) == 0
    out = capsys.readouterr().out
    table = next(t for t in out.split("\n\n") if t.startswith("shard  replica")).splitlines()
    columns = re.split(r"\s{2,}", table[0])
    rows = {cells["replica"]: cells for cells in (dict(zip(columns, re.split(r"\s{2,}", line)))
                                                  for line in table[2:])}
    # The real server runs unreplicated: it is the primary as the one that answered the shard's Describe.
    assert (rows[primary.address]["role"], rows[primary.address]["health"]) == ("primary", "SERVING")
    # The stand-in refuses even an any_replica Describe, and has no health service.
    assert (rows[backup.address]["role"], rows[backup.address]["health"]) == ("refused (NOT_PRIMARY)",
                                                                              "UNREACHABLE")
    assert f"shard 0/1: primary {primary.address} (unreplicated)" in out
