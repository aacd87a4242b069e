"""The apply gate (ps_server.core.gate), worker leases (ps_server.core.membership) and
the client's retry loop (worker_client.transport.retry).

Concurrency is checked with events and generous timeouts, never with
assertions on wall time; membership and retries run on fake clocks.
"""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

import ps_server.core.membership as membership_module
import worker_client.transport.retry as retry_module
from ps_server.core.errors import RequestError
from ps_server.core.gate import ApplyGate
from ps_server.core.membership import Membership
from wehub_ps.errors import Reason
from worker_client.errors import (
    AuthenticationError,
    InvalidArgumentError,
    PSUnavailableError,
    VariableNotFoundError,
)
from worker_client.transport.retry import RetryPolicy, call_with_retry

WAIT = 5.0  # generous bound for things that must happen
BRIEF = 0.2  # how long we watch for things that must not happen


def _thread(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def _wait_until(predicate, timeout=WAIT) -> bool:
    done = threading.Event()
    deadline = threading.Timer(timeout, done.set)
    deadline.start()
    try:
        while not predicate():
            if done.wait(0.005):
                return predicate()
        return True
    finally:
        deadline.cancel()


# ---- ApplyGate ------------------------------------------------------------------------------------


def test_many_shared_holders_at_once():
    gate = ApplyGate()
    holders = 8
    barrier = threading.Barrier(holders, timeout=WAIT)
    errors = []

    def hold():
        with gate.shared():
            try:
                barrier.wait()  # only passes if all 8 are inside together
            except threading.BrokenBarrierError as exc:
                errors.append(exc)

    threads = [_thread(hold) for _ in range(holders)]
    for t in threads:
        t.join(WAIT * 2)
    assert not errors and not any(t.is_alive() for t in threads)
    assert gate._shared == 0


def test_exclusive_waits_for_shared_holders_to_leave():
    gate = ApplyGate()
    inside = [threading.Event(), threading.Event()]
    leave = [threading.Event(), threading.Event()]
    exclusive_in = threading.Event()

    def shared(i):
        with gate.shared():
            inside[i].set()
            assert leave[i].wait(WAIT)

    def exclusive():
        with gate.exclusive():
            exclusive_in.set()

    readers = [_thread(lambda i=i: shared(i)) for i in range(2)]
    assert all(e.wait(WAIT) for e in inside)
    writer = _thread(exclusive)
    assert not exclusive_in.wait(BRIEF)
    leave[0].set()
    readers[0].join(WAIT)
    assert not exclusive_in.wait(BRIEF), "one shared holder is still inside"
    leave[1].set()
    assert exclusive_in.wait(WAIT)
    writer.join(WAIT)
    assert not writer.is_alive()


def test_waiting_exclusive_blocks_new_shared_entrants():
    gate = ApplyGate()
    order = []
    first_in, first_leave = threading.Event(), threading.Event()
    exclusive_in, exclusive_leave = threading.Event(), threading.Event()
    late_in = threading.Event()

    def first():
        with gate.shared():
            first_in.set()
            assert first_leave.wait(WAIT)

    def exclusive():
        with gate.exclusive():
            order.append("exclusive")
            exclusive_in.set()
            assert exclusive_leave.wait(WAIT)

    def late():
        with gate.shared():
            order.append("late")
            late_in.set()

    _thread(first)
    assert first_in.wait(WAIT)
    _thread(exclusive)
    assert _wait_until(lambda: gate._waiting == 1), "the exclusive request should be waiting"
    late_thread = _thread(late)
    assert not late_in.wait(BRIEF), "a new shared entrant overtook the waiting exclusive (writer starvation)"
    first_leave.set()
    assert exclusive_in.wait(WAIT)
    assert not late_in.wait(BRIEF), "shared entered while exclusive is held"
    exclusive_leave.set()
    assert late_in.wait(WAIT)
    late_thread.join(WAIT)
    assert order == ["exclusive", "late"]
    assert (gate._shared, gate._exclusive, gate._waiting) == (0, False, 0)


def test_exclusive_holders_never_overlap():
    gate = ApplyGate()
    inside = []
    overlaps = []
    lock = threading.Lock()
    barrier = threading.Barrier(4, timeout=WAIT)

    def exclusive():
        barrier.wait()
        for _ in range(50):
            with gate.exclusive():
                with lock:
                    inside.append(1)
                    if len(inside) > 1:
                        overlaps.append(len(inside))
                with lock:
                    inside.pop()

    threads = [_thread(exclusive) for _ in range(4)]
    for t in threads:
        t.join(WAIT * 2)
    assert not any(t.is_alive() for t in threads)
    assert overlaps == []


def test_gate_is_released_when_the_body_raises():
    gate = ApplyGate()
    with pytest.raises(RuntimeError):
        with gate.shared():
            raise RuntimeError("apply failed")
    with pytest.raises(RuntimeError):
        with gate.exclusive():
            raise RuntimeError("snapshot failed")
    assert (gate._shared, gate._exclusive, gate._waiting) == (0, False, 0)
    entered = threading.Event()

    def both():
        with gate.exclusive():
            pass
        with gate.shared():
            entered.set()

    _thread(both)
    assert entered.wait(WAIT)


def test_a_sealed_gate_refuses_every_later_entry_once_its_holders_left():
    gate = ApplyGate()
    holding, release = threading.Event(), threading.Event()
    late_outcome = []

    def holder():
        with gate.shared():
            holding.set()
            release.wait(WAIT)

    def late_entrant():
        try:
            with gate.shared():
                late_outcome.append("entered")
        except RequestError as error:
            late_outcome.append(error.reason)

    _thread(holder)
    assert holding.wait(WAIT)
    sealer = _thread(gate.seal)
    assert _wait_until(lambda: gate._waiting == 1), "the seal should wait for the holder"
    late = _thread(late_entrant)  # blocked behind the waiting seal
    sealer.join(BRIEF)
    assert sealer.is_alive() and not late_outcome and not gate.sealed
    release.set()
    sealer.join(WAIT)
    late.join(WAIT)
    assert gate.sealed and late_outcome == [Reason.SHUTTING_DOWN]
    for entry in (gate.shared, gate.exclusive):
        with pytest.raises(RequestError) as info:
            with entry():
                pass
        assert info.value.reason == Reason.SHUTTING_DOWN
    gate.seal()  # idempotent
    assert (gate._shared, gate._exclusive, gate._waiting) == (0, False, 0)


def test_a_final_snapshot_that_fails_still_seals_the_gate():
    gate = ApplyGate()
    with pytest.raises(RuntimeError):
        with gate.exclusive(seal=True):
            raise RuntimeError("snapshot failed")
    assert gate.sealed
    with pytest.raises(RequestError):
        with gate.shared():
            pass


# ---- Membership ---------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def members():
    clock = FakeClock()
    membership = Membership(10.0, clock=clock)
    calls = []
    membership.subscribe(lambda: calls.append(sorted(membership.live_ids())))
    return membership, clock, calls


def _record(membership, worker_id):
    (record,) = [r for r in membership.workers() if r.worker_id == worker_id]
    return record


def test_register_and_lease(members):
    membership, clock, calls = members
    assert membership.workers() == [] and membership.live_ids() == set()
    membership.seen("w1", "inc-1", step=5)
    assert calls == [["w1"]], "registration notifies"
    record = _record(membership, "w1")
    assert (record.incarnation, record.step, record.pushes, record.live, record.last_seen) == \
        ("inc-1", 5, 0, True, 100.0)
    clock.now = 110.0  # exactly the lease: still live
    assert membership.live_ids() == {"w1"}
    assert membership.expire() == []
    assert membership.seconds_since_seen(record) == 10.0
    membership.seen("w1", "inc-1")  # a renewal changes nothing observable: no notification
    assert calls == [["w1"]]
    assert _record(membership, "w1").last_seen == 110.0
    clock.now = 120.0
    assert membership.live_ids() == {"w1"}
    clock.now = 120.5
    assert membership.live_ids() == set()
    assert _record(membership, "w1").live is False


def test_expire_returns_the_ids_and_notifies(members):
    membership, clock, calls = members
    membership.seen("a", "1")
    clock.now = 105.0
    membership.seen("b", "1")
    calls.clear()
    clock.now = 112.0  # a's lease ran out, b's did not
    assert membership.expire() == ["a"]
    assert calls == [["b"]]
    assert membership.expire() == [], "expired once only"
    assert calls == [["b"]]
    clock.now = 116.0
    assert membership.expire() == ["b"]
    assert calls[-1] == []
    assert {r.worker_id: r.live for r in membership.workers()} == {"a": False, "b": False}
    # A worker that comes back is live again, and says so.
    membership.seen("a", "1")
    assert calls[-1] == ["a"]
    assert _record(membership, "a").live


def test_back_after_lease_without_expire_notifies(members):
    membership, clock, calls = members
    membership.seen("a", "1", step=3, pushed=True)
    clock.now = 200.0
    membership.seen("a", "1")
    assert calls == [["a"], ["a"]], "the live set changed (a was gone) even without expire()"
    record = _record(membership, "a")
    assert (record.step, record.pushes) == (3, 1), "same incarnation keeps its counters"


def test_step_is_the_maximum_and_pushes_are_counted(members):
    membership, clock, _ = members
    membership.seen("w", "1", step=7)
    membership.seen("w", "1", step=3, pushed=True)
    membership.seen("w", "1", step=None, pushed=True)
    membership.seen("w", "1", step=9)
    membership.seen("w", "1", step=8, pushed=True)
    record = _record(membership, "w")
    assert (record.step, record.pushes) == (9, 3)


def test_a_new_incarnation_replaces_the_record(members):
    membership, clock, calls = members
    membership.seen("w", "old", step=50, pushed=True)
    membership.seen("w", "old", pushed=True)
    clock.now = 103.0
    membership.seen("w", "new", step=1)
    assert len(calls) == 2, "a restart notifies"
    (record,) = membership.workers()
    assert (record.incarnation, record.step, record.pushes, record.last_seen) == ("new", 1, 0, 103.0)
    membership.seen("w", "newer", pushed=True)
    (record,) = membership.workers()
    assert (record.incarnation, record.step, record.pushes) == ("newer", 0, 1)


def test_listeners_run_without_the_lock_held(members):
    membership, clock, _ = members
    seen_from_listener = []
    # A listener that reads membership would deadlock if called under the lock.
    membership.subscribe(lambda: seen_from_listener.append(len(membership.workers())))
    worker = _thread(lambda: membership.seen("x", "1"))
    worker.join(WAIT)
    assert not worker.is_alive()
    assert seen_from_listener == [1]
    clock.now = 1000.0
    expirer = _thread(membership.expire)
    expirer.join(WAIT)
    assert not expirer.is_alive() and seen_from_listener == [1, 1]


def test_lease_must_be_positive():
    for lease in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="lease_seconds"):
            Membership(lease)


def test_table_is_bounded_by_forgetting_the_least_recently_seen(members, monkeypatch):
    membership, clock, _ = members
    monkeypatch.setattr(membership_module, "MAX_WORKERS", 2)
    membership.seen("a", "1")
    clock.now += 1
    membership.seen("b", "1")
    clock.now += 1
    membership.seen("a", "1")  # b is now the least recently seen
    clock.now += 1
    membership.seen("c", "1")
    assert sorted(r.worker_id for r in membership.workers()) == ["a", "c"]


def test_a_restart_at_capacity_forgets_no_other_worker(members, monkeypatch):
    """BUG (ps_server/core/membership.py, Membership.seen): the MAX_WORKERS eviction
    also runs when a known worker comes back with a new incarnation, which
    replaces its record and cannot grow the table; at capacity a restart thus
    throws away an unrelated (possibly live) worker's record.
    """
    membership, clock, _ = members
    monkeypatch.setattr(membership_module, "MAX_WORKERS", 2)
    membership.seen("b", "1")
    clock.now += 1
    membership.seen("a", "1")
    clock.now += 1
    membership.seen("a", "2")  # a restarts
    assert sorted(r.worker_id for r in membership.workers()) == ["a", "b"]


# ---- call_with_retry ------------------------------------------------------------------------------------


class FakeTime:
    """Stands in for the ``time`` module inside worker_client.transport.retry; sleeping advances it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def fake_time(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(retry_module, "time", fake)
    return fake


@pytest.fixture
def full_backoff(monkeypatch):
    """Jitter always picks the top of the range, so delays are predictable."""
    monkeypatch.setattr(retry_module, "random", SimpleNamespace(uniform=lambda low, high: high))


def _failing(times: int, result="ok", error=None):
    calls = []

    def call():
        calls.append(1)
        if len(calls) <= times:
            raise error or PSUnavailableError(f"attempt {len(calls)} failed", address="ps-0:5000",
                                              reason="R", code="UNAVAILABLE")
        return result

    return call, calls


def test_retries_until_success(fake_time):
    call, calls = _failing(3, result=42)
    retries = []
    result = call_with_retry(call, RetryPolicy(timeout=60.0), "pull", "ps-0:5000",
                             on_retry=lambda: retries.append(fake_time.now), sleep=fake_time.sleep)
    assert result == 42
    assert len(calls) == 4
    assert len(retries) == 3 and len(fake_time.sleeps) == 3
    # Full jitter: each delay is within [0, backoff], the backoff doubling from 0.05.
    for delay, cap in zip(fake_time.sleeps, (0.05, 0.1, 0.2)):
        assert 0.0 <= delay <= cap


def test_backoff_doubles_up_to_the_maximum(fake_time, full_backoff):
    call, calls = _failing(9)
    policy = RetryPolicy(timeout=1000.0, initial_backoff=0.25, max_backoff=2.0)
    call_with_retry(call, policy, "pull", "ps-0:5000", sleep=fake_time.sleep)
    assert fake_time.sleeps == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]


def test_gives_up_after_the_timeout(fake_time, full_backoff):
    call, calls = _failing(10**6)
    retries = []
    policy = RetryPolicy(timeout=5.0, initial_backoff=0.5, max_backoff=1.0)
    with pytest.raises(PSUnavailableError) as info:
        call_with_retry(call, policy, "push", "ps-0:5000", on_retry=lambda: retries.append(1),
                        sleep=fake_time.sleep)
    error = info.value
    # Delays 0.5 then 1.0 each: failures at t = 0, 0.5, 1.5, 2.5, 3.5, 4.5, 5.0 (the last delay is cut short).
    assert fake_time.sleeps == [0.5, 1.0, 1.0, 1.0, 1.0, 0.5]
    assert fake_time.now == 5.0
    assert len(calls) == 7
    assert len(retries) == 6, "on_retry runs once per retry, not on giving up"
    message = str(error)
    assert "gave up after 7 attempts" in message
    assert "attempt 7 failed" in message, "the last error is kept in the message"
    assert (error.address, error.reason, error.code) == ("ps-0:5000", "R", "UNAVAILABLE")
    assert isinstance(error.__cause__, PSUnavailableError)


def test_zero_timeout_tries_once(fake_time):
    call, calls = _failing(10)
    with pytest.raises(PSUnavailableError, match="gave up after 1 attempts"):
        call_with_retry(call, RetryPolicy(timeout=0.0), "pull", "ps-0:5000", sleep=fake_time.sleep)
    assert len(calls) == 1 and fake_time.sleeps == []


@pytest.mark.parametrize("error", [
    InvalidArgumentError("bad shape", address="ps-0:5000"),
    VariableNotFoundError("no such variable", address="ps-0:5000"),
    RuntimeError("a bug"),
])
def test_non_retryable_errors_surface_at_once(fake_time, error):
    call, calls = _failing(1, error=error)
    retries = []
    with pytest.raises(type(error)) as info:
        call_with_retry(call, RetryPolicy(timeout=60.0), "pull", "ps-0:5000",
                        on_retry=lambda: retries.append(1), sleep=fake_time.sleep)
    assert info.value is error
    assert len(calls) == 1 and retries == [] and fake_time.sleeps == []


def test_a_non_retryable_error_after_retries_stops_them(fake_time):
    errors = iter([PSUnavailableError("down"), PSUnavailableError("down"), InvalidArgumentError("bad")])

    def call():
        raise next(errors)

    with pytest.raises(InvalidArgumentError):
        call_with_retry(call, RetryPolicy(timeout=60.0), "pull", "ps-0:5000", sleep=fake_time.sleep)
    assert len(fake_time.sleeps) == 2


def test_waiting_is_logged_after_warn_after(fake_time, full_backoff, caplog):
    call, calls = _failing(10**6)
    policy = RetryPolicy(timeout=6.0, initial_backoff=0.5, max_backoff=0.5, warn_after=1.0, warn_every=2.0)
    with caplog.at_level(logging.WARNING, logger="worker_client"):
        with pytest.raises(PSUnavailableError):
            call_with_retry(call, policy, "pull", "ps-3:7777", sleep=fake_time.sleep)
    warnings = [r for r in caplog.records if r.name == "worker_client" and r.levelno == logging.WARNING]
    # Failures every 0.5 s; warnings from 1.0 s on, at most every 2.0 s.
    assert [r.fields["waited_seconds"] for r in warnings] == [1.0, 3.0, 5.0]
    for record in warnings:
        assert record.fields["address"] == "ps-3:7777"
        assert record.fields["call"] == "pull"
        assert record.fields["gives_up_after"] == 6.0
        assert "ps-server" in record.getMessage()
    assert [r.fields["attempts"] for r in warnings] == [3, 7, 11]
    # The text alone says it all, as a plain logging.basicConfig() prints it.
    assert [r.getMessage() for r in warnings][0] == (
        "waiting for ps-server ps-3:7777 (call pull): 3 attempts over 1.0s, giving up after 6s (retry_timeout); "
        "last error: attempt 3 failed")


def test_no_warning_before_warn_after(fake_time, full_backoff, caplog):
    call, calls = _failing(3)
    policy = RetryPolicy(timeout=60.0, initial_backoff=0.1, max_backoff=0.1, warn_after=1.0)
    with caplog.at_level(logging.DEBUG, logger="worker_client"):
        assert call_with_retry(call, policy, "pull", "ps-0:5000", sleep=fake_time.sleep) == "ok"
    assert [r for r in caplog.records if r.name == "worker_client"] == []


def test_real_clock_with_a_sleep_that_does_not_wait():
    """The unpatched module: elapsed time is real, the sleep returns at once."""
    call, calls = _failing(10**9)
    sleeps = []
    with pytest.raises(PSUnavailableError, match="gave up after"):
        call_with_retry(call, RetryPolicy(timeout=0.2), "pull", "ps-0:5000", sleep=sleeps.append)
    assert len(calls) >= 2 and len(sleeps) == len(calls) - 1
    assert all(0.0 <= s <= 3.0 for s in sleeps)


@pytest.mark.parametrize("field", ["timeout", "initial_backoff", "max_backoff", "warn_after", "warn_every"])
def test_policy_rejects_negative_values(field):
    with pytest.raises(ValueError, match=field):
        RetryPolicy(**{field: -1.0})
    with pytest.raises(ValueError, match=field):
        RetryPolicy(**{field: "1"})


def test_also_retry_waits_out_the_errors_it_names_and_gives_up_as_their_type(fake_time, full_backoff):
    call, calls = _failing(10**6, error=AuthenticationError("token refused", address="ps-0:5000",
                                                            reason="UNAUTHENTICATED", code="UNAUTHENTICATED"))
    asked = []

    def also_retry(error):
        asked.append(error)
        return isinstance(error, AuthenticationError)

    with pytest.raises(AuthenticationError, match="gave up after") as info:
        call_with_retry(call, RetryPolicy(timeout=2.0, initial_backoff=0.5, max_backoff=0.5), "push",
                        "ps-0:5000", sleep=fake_time.sleep, also_retry=also_retry)
    assert len(calls) == 5 and len(asked) == 5
    assert (info.value.address, info.value.reason) == ("ps-0:5000", "UNAUTHENTICATED")
    # Errors it does not name still surface at once.
    call, calls = _failing(1, error=InvalidArgumentError("bad", address="ps-0:5000"))
    with pytest.raises(InvalidArgumentError):
        call_with_retry(call, RetryPolicy(timeout=60.0), "push", "ps-0:5000", sleep=fake_time.sleep,
                        also_retry=also_retry)
    assert len(calls) == 1
