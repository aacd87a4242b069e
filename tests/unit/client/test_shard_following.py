"""A replicated shard's channel follows its primary: which replica it moves to, on which errors, once.

No server is involved: gRPC channels connect lazily, and these tests make no call
on them; the errors are built as the transport would translate them.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import grpc
import pytest
from ps_testing import child_env, free_port

from wehub_ps.errors import REASON_METADATA_KEY, Reason
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.rpc import PRIMARY_METADATA_KEY, SERVICE_NAME, method_path
from worker_client import NotPrimaryError, PSUnavailableError
from worker_client.errors import ServerBusyError, VariableNotFoundError, error_for, translate_rpc_error
from worker_client.session import Session
from worker_client.transport.channels import ShardChannel
from worker_client.transport.retry import RetryPolicy, call_with_retry

A, B, C = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"


@pytest.fixture
def shard():
    channel = ShardChannel(0, (A, B, C))
    yield channel
    channel.close()


def _not_primary(address: str, primary: str | None) -> NotPrimaryError:
    return error_for(grpc.StatusCode.UNAVAILABLE, Reason.NOT_PRIMARY.value, "backup", address, "push",
                     primary)


def _unavailable(address: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
                 reason: str | None = None) -> PSUnavailableError:
    return error_for(code, reason, "connection refused", address, "push")


def test_a_named_primary_is_followed(shard):
    assert shard.address == A
    old_lane = shard.lane
    assert shard.follow(_not_primary(A, C))
    assert shard.address == C
    assert shard.lane is not old_lane and shard.lane is not None


def test_no_name_or_an_unreachable_replica_moves_to_the_next_one(shard):
    assert shard.follow(_not_primary(A, None))
    assert shard.address == B
    assert shard.follow(_unavailable(B))
    assert shard.address == C
    assert shard.follow(_unavailable(C, grpc.StatusCode.DEADLINE_EXCEEDED))
    assert shard.address == A  # round and round


def test_a_name_not_in_the_list_is_warned_about_once_and_the_next_replica_tried(shard, caplog):
    with caplog.at_level(logging.WARNING, logger="worker_client"):
        assert shard.follow(_not_primary(A, "elsewhere:9"))
        assert shard.address == B
        assert shard.follow(_not_primary(B, "elsewhere:9"))
        assert shard.address == C
    warnings = [r for r in caplog.records if "elsewhere:9" in r.getMessage()]
    assert len(warnings) == 1 and "not among the addresses" in warnings[0].getMessage()


def test_a_replica_naming_itself_is_left_for_the_next(shard):
    assert shard.follow(_not_primary(A, A))
    assert shard.address == B


@pytest.mark.parametrize("error", [
    ServerBusyError("busy", address=A, reason=Reason.TOO_MANY_RPCS.value, code="RESOURCE_EXHAUSTED"),
    _unavailable(A, reason=Reason.EXCHANGE_STREAMS.value),
    _unavailable(A, grpc.StatusCode.CANCELLED),
    VariableNotFoundError("no such variable", address=A, code="NOT_FOUND"),
])
def test_errors_that_say_nothing_about_the_primary_change_nothing(shard, error):
    assert not shard.follow(error)
    assert shard.address == A


def test_a_failure_on_a_replica_already_left_changes_nothing(shard):
    assert shard.follow(_not_primary(A, C))
    assert not shard.follow(_unavailable(A))  # a call that was still running on A
    assert shard.address == C


def test_threads_failing_together_switch_once():
    shard = ShardChannel(0, (A, B, C))
    errors = [_unavailable(A) for _ in range(16)]
    switched: list[bool] = []
    barrier = threading.Barrier(len(errors))

    def fail(error: PSUnavailableError) -> None:
        barrier.wait()
        switched.append(shard.follow(error))

    threads = [threading.Thread(target=fail, args=(e,)) for e in errors]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shard.close()
    assert switched.count(True) == 1
    assert shard.address == B


def test_one_replica_never_switches():
    shard = ShardChannel(0, A)
    conn = shard._conn
    assert shard.replicas == (A,)
    assert not shard.follow(_not_primary(A, B))
    assert not shard.follow(_unavailable(A))
    assert shard._conn is conn and shard.address == A
    shard.close()


def test_a_call_that_finds_its_replica_left_is_retried_not_crashed(shard):
    """gRPC raises ValueError on a closed channel: a call begun just before a switch is retried."""
    old = shard._conn
    assert shard.follow(_unavailable(A))
    with pytest.raises(PSUnavailableError) as info:
        shard._guard(old, "describe", lambda: old.describe(b"", timeout=1))
    assert info.value.address == A and B in str(info.value)
    assert not shard.follow(info.value)  # it names the replica left: no second switch
    with pytest.raises(ValueError, match="not about the channel"):
        shard._guard(shard._conn, "describe", _raise_value_error)


def _raise_value_error() -> None:
    raise ValueError("not about the channel")


def test_a_closed_shard_does_not_switch(shard):
    shard.close()
    assert not shard.follow(_unavailable(A))
    assert shard.address == A


# ---- the error ----


class _FailedCall(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, trailers: tuple) -> None:
        self._code, self._trailers = code, trailers

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "this replica is a backup"

    def trailing_metadata(self) -> tuple:
        return self._trailers


def test_not_primary_is_translated_with_its_hint():
    error = translate_rpc_error(_FailedCall(grpc.StatusCode.UNAVAILABLE, (
        (REASON_METADATA_KEY, "NOT_PRIMARY"), (PRIMARY_METADATA_KEY, B))), A, "pull")
    assert type(error) is NotPrimaryError and isinstance(error, PSUnavailableError)
    assert error.primary == B and error.address == A and error.reason == "NOT_PRIMARY"
    assert f"the primary is {B}" in str(error) and A in str(error)
    without = translate_rpc_error(_FailedCall(grpc.StatusCode.UNAVAILABLE, (
        (REASON_METADATA_KEY, "NOT_PRIMARY"),)), A, "pull")
    assert type(without) is NotPrimaryError and without.primary is None
    # Nothing is claimed that the refusal did not say: no primary named, none invented or denied.
    assert str(without) == f"pull: ps-server {A} is not the primary of its shard: this replica is a backup"
    # A primary the details name already is not repeated.
    named = error_for(grpc.StatusCode.UNAVAILABLE, "NOT_PRIMARY", f"this replica is backup; the primary is {B}",
                      A, "pull", B)
    assert str(named).count(B) == 1 and named.primary == B
    # The trailer means nothing without the reason.
    plain = translate_rpc_error(_FailedCall(grpc.StatusCode.UNAVAILABLE, ((PRIMARY_METADATA_KEY, B),)), A,
                                "pull")
    assert type(plain) is PSUnavailableError


# ---- the retry ----


def test_the_first_named_primary_is_asked_at_once_then_backoff_resumes():
    failures = [_not_primary(A, B), _not_primary(B, A), _not_primary(A, B), _unavailable(B)]
    sleeps: list[float] = []
    followed: list[Exception] = []

    def call() -> str:
        if failures:
            raise failures.pop(0)
        return "ok"

    policy = RetryPolicy(timeout=60.0, initial_backoff=0.5, max_backoff=0.5)
    assert call_with_retry(call, policy, "push", A, sleep=sleeps.append, before_retry=followed.append) == "ok"
    assert len(followed) == 4 and isinstance(followed[0], NotPrimaryError)
    # Four retries: the first (a named primary) without sleeping, the other three after a backoff.
    assert len(sleeps) == 3


def test_giving_up_keeps_the_hint():
    def call() -> str:
        raise _not_primary(A, B)

    with pytest.raises(NotPrimaryError) as info:
        call_with_retry(call, RetryPolicy(timeout=0.0), "push", A, sleep=lambda s: None)
    assert info.value.primary == B and "gave up" in str(info.value)


# The primary watch checks health every half millisecond while this thread moves the shard between two
# replicas as fast as it can, each move closing the channel the watch may be using. gRPC crashes the
# process (SIGSEGV) when a method is registered on a channel being closed, so this runs in a child.
_WATCH_WHILE_MOVING = """
import sys, time
import worker_client.transport.channels as channels
from worker_client import PSUnavailableError
channels._WATCH_SECONDS, channels._WATCH_TIMEOUT_SECONDS = 0.0005, 0.05
shard = channels.ShardChannel(0, ["127.0.0.1:1", "127.0.0.1:2"])
moves, end = 0, time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    moves += shard.follow(PSUnavailableError("cut", address=shard.address, code="UNAVAILABLE"))
    time.sleep(0.0005)
shard.close()
print(moves)
"""


def test_the_primary_watch_survives_the_shard_moving_under_it():
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _WATCH_WHILE_MOVING, "5"],
                          check=False, capture_output=True, text=True, timeout=60, env=child_env())
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stderr[-3000:]}"
    assert int(done.stdout) > 1000, "the shard moved too rarely for the test to tell"


def test_a_replica_followed_again_is_connected_to_at_once_not_after_an_old_reconnect_backoff():
    """A replica that was down (restarted in a rolling restart) and is then handed the primary role:
    the channel the shard opens to it must connect at once. gRPC shares a process's subchannels between
    channels with the same target, and the one to that replica still waits out its reconnect backoff
    from the failures (up to 2 s), failing every call at once meanwhile."""
    from concurrent import futures

    from worker_client.errors import PSError

    port = free_port()
    replica = f"127.0.0.1:{port}"
    shard = ShardChannel(0, (replica, B))
    probe = shard._probe_channel(replica)  # as the primary watch holds one while a replica is silent
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:  # reconnect attempts fail: their backoff grows past 1 s
            with pytest.raises(PSError):
                shard.describe(b"", timeout=0.2)
            with pytest.raises(grpc.RpcError):
                probe.unary_unary(method_path("Describe"))(b"", timeout=0.2)
            time.sleep(0.05)
        server = grpc.server(futures.ThreadPoolExecutor(2))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            SERVICE_NAME, {"Describe": grpc.unary_unary_rpc_method_handler(
                lambda request, context: b"")}),))
        assert server.add_insecure_port(replica) == port
        server.start()
        try:
            assert shard.follow(_not_primary(replica, B)) and shard.address == B
            assert shard.follow(_not_primary(B, replica)) and shard.address == replica
            assert shard.describe(b"", timeout=5.0) == b"", "the first call on the new channel failed"
        finally:
            server.stop(None)
    finally:
        probe.close()
        shard.close()


class _HealthServer:
    """A gRPC health service on a free loopback port that answers ``status`` and counts its checks."""

    def __init__(self, status: str) -> None:
        from concurrent import futures

        from grpc_health.v1 import health_pb2, health_pb2_grpc

        outer = self
        self.checks: list[float] = []

        class Servicer(health_pb2_grpc.HealthServicer):
            def Check(self, request, context):
                outer.checks.append(time.monotonic())
                return health_pb2.HealthCheckResponse(
                    status=health_pb2.HealthCheckResponse.ServingStatus.Value(status))

        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        health_pb2_grpc.add_HealthServicer_to_server(Servicer(), self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(None)


def test_a_replica_named_the_primary_is_not_left_at_once_for_answering_as_a_backup():
    """A backup handed the primary role answers health checks as a backup until its election ends (and
    holds the calls sent to it meanwhile): the watch must not send the calls back to the old primary
    for that, only once the grace has passed without it leading."""
    old, named = _HealthServer("SERVING"), _HealthServer("NOT_SERVING")
    shard = ShardChannel(0, (old.address, named.address))
    try:
        assert shard.follow(_not_primary(old.address, named.address))
        moved = time.monotonic()
        deadline = moved + 10
        while not [t for t in named.checks if t > moved] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [t for t in named.checks if t > moved], "the watch never asked the named replica"
        time.sleep(0.3)  # one more round of the watch (every 0.25 s)
        if time.monotonic() - moved < 0.9:  # (a loaded runner may only get here after the grace)
            assert shard.address == named.address, "left a replica named the primary at its first answer"
        while shard.address == named.address and time.monotonic() < deadline:
            time.sleep(0.02)
        assert shard.address == old.address, "a replica that never leads is never left"
    finally:
        shard.close()
        old.stop()
        named.stop()


def _election_then_primary(session, refusals: int, primary: str, calls: list[str]):
    """Shard 0 of ``session`` answers a switchover as replicas in an election do: each backup names the
    other as the primary for ``refusals`` calls, then ``primary`` takes the request."""
    shard = session.shards[0]

    def switchover(raw: bytes, timeout: float) -> bytes:
        calls.append(shard.address)
        if len(calls) > refusals and shard.address == primary:
            return ps_pb2.SwitchoverResponse(replica_index=0, address=primary, seconds=0.0).SerializeToString()
        other = B if shard.address == A else A
        raise _not_primary(shard.address, other)

    shard.switchover = switchover


def test_a_switchover_waits_out_replicas_naming_each_other_until_its_timeout():
    session = Session([f"{A}|{B}"], "admin", register=False, chunk_bytes=1 << 20, control_timeout=5.0,
                      data_timeout=5.0, retry_timeout=5.0, tls_ca=None, tls_cert=None, tls_key=None,
                      server_name=None, auth_token=None, auth_token_file=None)
    try:
        calls: list[str] = []
        _election_then_primary(session, 9, A, calls)
        answer = session.switchover(0, to_replica=0, timeout=30.0)
        assert answer["address"] == A and len(calls) >= 10
        assert calls[:4] == [A, B, A, B]  # followed round the replicas, not stuck on one

        calls.clear()
        _election_then_primary(session, 10**6, A, calls)
        started = time.monotonic()
        with pytest.raises(PSUnavailableError, match="within 0.5s"):
            session.switchover(0, to_replica=0, timeout=0.5)
        assert 0.5 <= time.monotonic() - started < 5.0
        assert 4 <= len(calls) < 100  # paused between rounds, not asked in a tight loop
    finally:
        session.close()
