"""ConsistencyController (ps_server.core.consistency) with a real Membership on a fake
clock and a real VariableStore; no servers, no network.

Gradients reach the store the way ps_server.core.pushes feeds them: decide at the
push's begin (gate shared), stage, merge and record when whole (gate shared),
then ``apply_ready_steps`` with no lock held. Blocking is checked with events
and generous timeouts, never with assertions on wall time.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ps_server.core.accumulator import PushStaging
from ps_server.core.consistency import ConsistencyController, PushDecision
from ps_server.core.errors import RequestError
from ps_server.core.membership import Membership
from ps_server.core.store import VariableStore
from wehub_ps.errors import Reason
from wehub_ps.specs import SGD, VariableSpec, Zeros

WAIT = 5.0  # generous bound for things that must happen
BRIEF = 0.2  # how long we watch for things that must not happen
LEASE = 10.0
ELEMENTS = 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Harness:
    """A controller, its membership, a store with one SGD(lr=1) variable 'w' of zeros."""

    def __init__(self, mode: str, staleness: int = 0, backup_workers: int = 0, expected_workers: int = 0,
                 aggregation: str = "mean") -> None:
        self.clock = FakeClock()
        self.membership = Membership(LEASE, clock=self.clock)
        self.store = VariableStore(0, 1, 1 << 30)
        spec = VariableSpec("w", (ELEMENTS,), "float32", initializer=Zeros(),
                            optimizer=SGD(learning_rate=1.0), aggregation=aggregation)
        self.store.create(spec)
        self.part = self.store.get("w")
        self.ctrl = ConsistencyController(mode, staleness, backup_workers, self.membership, self.store,
                                          expected_workers)

    def join(self, *workers: str, clock: int = 0) -> list[int]:
        """Register like the Heartbeat RPC does: membership first, then the controller."""
        answers = []
        for w in workers:
            if self.membership.seen(w, f"inc-{w}", clock):
                self.ctrl.forget(w)
            answers.append(self.ctrl.on_heartbeat(w, clock))
        return answers

    def renew(self, *workers: str) -> None:
        for w in workers:
            self.membership.seen(w, f"inc-{w}")

    def decide(self, worker: str, step: int) -> str:
        """A push's begin, as pushes.py runs it (WAIT is returned, not waited for)."""
        self.membership.seen(worker, f"inc-{worker}", step, pushed=True)
        with self.store.gate.shared():
            return self.ctrl.push_decision(step)

    def complete(self, worker: str, step: int, decision: str, grad) -> str:
        """The push arrived whole: merge and record it (gate shared), then apply a ready step."""
        staging = PushStaging()
        staging.add_dense(ELEMENTS, np.dtype("float32"), 0, np.asarray(grad, dtype=np.float32))
        with self.store.gate.shared():
            counted = self.ctrl.complete_push(worker, step, decision,
                                              lambda: self.part.merge_staged(step, staging))
        self.ctrl.apply_ready_steps()
        return decision if counted else PushDecision.DROP

    def push(self, worker: str, step: int, grad) -> str:
        """One whole push of ``grad`` for 'w' at ``step``; the final decision (WAIT: not sent)."""
        decision = self.decide(worker, step)
        if decision == PushDecision.WAIT:
            return decision
        return self.complete(worker, step, decision, grad)

    def value(self) -> np.ndarray:
        return self.part.value.copy()

    def stats(self):
        return self.ctrl.stats()

    def pull_allowed_now(self, worker: str, step: int) -> bool:
        try:
            self.ctrl.before_pull(worker, step, 0.0)
            return True
        except RequestError as exc:
            assert exc.reason == Reason.STEP_TIMEOUT
            return False


def _vec(*values) -> np.ndarray:
    return np.array(values, dtype=np.float32)


class Waiter:
    """``before_pull`` on a thread; records how it ended."""

    def __init__(self, ctrl: ConsistencyController, worker: str, step: int, timeout: float | None = 30.0):
        self.error: RequestError | None = None
        self.returned = threading.Event()
        self.entered = threading.Event()

        def run():
            self.entered.set()
            try:
                ctrl.before_pull(worker, step, timeout)
            except RequestError as exc:
                self.error = exc
            finally:
                self.returned.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert self.entered.wait(WAIT)

    def still_blocked(self) -> bool:
        return not self.returned.wait(BRIEF)

    def released(self) -> bool:
        return self.returned.wait(WAIT)


# ---- sync ------------------------------------------------------------------------------------------


def test_sync_applies_the_mean_once_all_but_k_workers_finished_and_drops_the_rest():
    h = Harness("sync", backup_workers=1)
    h.join("a", "b", "c")
    assert h.push("a", 0, _vec(6, 0, -6, 12)) == PushDecision.ACCUMULATE
    assert h.stats().steps_applied == 0 and h.stats().step == 0
    np.testing.assert_array_equal(h.value(), np.zeros(ELEMENTS, np.float32))  # accumulated, not applied
    assert not h.pull_allowed_now("a", 1)  # step 1 waits for step 0 to be applied
    assert h.push("b", 0, _vec(0, 6, 6, 0)) == PushDecision.ACCUMULATE
    # 3 live - 1 backup = 2 finished: applied once, with the mean of the two.
    s = h.stats()
    assert (s.steps_applied, s.step, s.dropped_gradients) == (1, 1, 0)
    np.testing.assert_array_equal(h.value(), -_vec(3, 3, 0, 6))
    assert h.pull_allowed_now("a", 1) and h.pull_allowed_now("b", 1)
    # The third gradient of step 0 is late: dropped, counted, never applied.
    assert h.push("c", 0, _vec(600, 600, 600, 600)) == PushDecision.DROP
    s = h.stats()
    assert (s.steps_applied, s.step, s.dropped_gradients) == (1, 1, 1)
    np.testing.assert_array_equal(h.value(), -_vec(3, 3, 0, 6))
    # The dropped worker continues at step 1 like the others.
    assert h.pull_allowed_now("c", 1)
    assert h.push("c", 1, _vec(3, 3, 3, 3)) == PushDecision.ACCUMULATE
    assert h.push("a", 1, _vec(1, 1, 1, 1)) == PushDecision.ACCUMULATE
    np.testing.assert_array_equal(h.value(), -_vec(3, 3, 0, 6) - _vec(2, 2, 2, 2))
    assert h.stats().steps_applied == 2


def test_sync_without_backup_workers_waits_for_every_live_worker():
    h = Harness("sync")
    h.join("a", "b", "c")
    h.push("a", 0, _vec(3, 3, 3, 3))
    h.push("b", 0, _vec(3, 3, 3, 3))
    assert h.stats().steps_applied == 0
    waiter = Waiter(h.ctrl, "a", 1)
    assert waiter.still_blocked()
    h.push("c", 0, _vec(9, 9, 9, 9))
    assert waiter.released() and waiter.error is None
    np.testing.assert_array_equal(h.value(), -_vec(5, 5, 5, 5))
    assert h.stats().steps_applied == 1


def test_sync_sum_aggregation_applies_the_sum():
    h = Harness("sync", aggregation="sum")
    h.join("a", "b")
    h.push("a", 0, _vec(1, 2, 3, 4))
    h.push("b", 0, _vec(10, 20, 30, 40))
    np.testing.assert_array_equal(h.value(), -_vec(11, 22, 33, 44))


def test_sync_push_that_began_before_the_step_was_applied_is_dropped_whole():
    """A push decided ACCUMULATE at its begin, but whose step was applied while it streamed."""
    h = Harness("sync", backup_workers=1)
    h.join("a", "b", "c")
    assert h.decide("c", 0) == PushDecision.ACCUMULATE  # c begins streaming step 0
    h.push("a", 0, _vec(2, 2, 2, 2))
    h.push("b", 0, _vec(4, 4, 4, 4))  # step 0 applied meanwhile
    # c's whole push arrives late: never merged.
    assert h.complete("c", 0, PushDecision.ACCUMULATE, _vec(100, 100, 100, 100)) == PushDecision.DROP
    np.testing.assert_array_equal(h.value(), -_vec(3, 3, 3, 3))
    assert h.stats().dropped_gradients == 1 and h.stats().step == 1


def test_sync_push_ahead_jumps_only_when_nothing_was_accumulated():
    h = Harness("sync")
    h.join("a", "b")
    # E.g. this shard restarted empty while the workers are at step 5: follow them.
    assert h.push("a", 5, _vec(2, 2, 2, 2)) == PushDecision.ACCUMULATE
    assert h.stats().step == 5
    # Now step 5 has a gradient: a push for step 7 must not throw it away; it waits.
    assert h.decide("b", 7) == PushDecision.WAIT
    with pytest.raises(RequestError) as info:
        h.ctrl.wait_for_step("b", 7, 0.05)
    assert info.value.reason == Reason.STEP_TIMEOUT  # retried by the client
    # b is at step 7, so it left steps 5 and 6 behind: step 5 is applied with a's gradient,
    # and step 6 waits for a.
    assert h.stats().step == 6 and h.stats().steps_applied == 1
    np.testing.assert_array_equal(h.value(), -_vec(2, 2, 2, 2))
    assert h.push("a", 6, _vec(4, 4, 4, 4)) == PushDecision.ACCUMULATE
    assert h.stats().step == 7
    assert h.push("b", 7, _vec(1, 1, 1, 1)) == PushDecision.ACCUMULATE
    assert h.push("a", 7, _vec(3, 3, 3, 3)) == PushDecision.ACCUMULATE
    np.testing.assert_array_equal(h.value(), -_vec(8, 8, 8, 8))
    assert h.stats().step == 8 and h.stats().steps_applied == 3


def test_sync_push_ahead_does_not_jump_over_a_finished_worker():
    """A worker that finished the step by heartbeat (nothing to push here) also pins it."""
    h = Harness("sync")
    h.join("a", "b", "c")
    h.ctrl.on_heartbeat("a", 1)  # a finished step 0 with nothing for this shard
    assert h.decide("b", 3) == PushDecision.WAIT
    assert h.stats().step == 0


def test_sync_push_ahead_waits_until_every_live_worker_left_the_open_step_behind():
    """A shard restored at step 2 (with a's gradient of it) while the workers are at step 5:
    a push of step 5 waits, not refused; once every live worker is past step 2, step 2 is
    applied with the gradients the shard has, steps 3 and 4 are skipped at once, and the push
    joins step 5."""
    h = Harness("sync")
    h.join("a", "b")
    h.push("a", 0, _vec(0, 0, 0, 0))
    h.push("b", 0, _vec(0, 0, 0, 0))
    h.push("a", 1, _vec(0, 0, 0, 0))
    h.push("b", 1, _vec(0, 0, 0, 0))
    assert h.push("a", 2, _vec(2, 2, 2, 2)) == PushDecision.ACCUMULATE
    assert h.decide("a", 5) == PushDecision.WAIT
    done = threading.Event()
    threading.Thread(target=lambda: (h.ctrl.wait_for_step("a", 5, 30.0), done.set()), daemon=True).start()
    assert not done.wait(BRIEF), "b has not left step 2 behind yet"
    h.ctrl.on_heartbeat("b", 5)  # b is at step 5 too
    assert done.wait(WAIT)
    s = h.stats()
    assert (s.step, s.steps_applied) == (5, 3), "steps 3 and 4 skipped in one go"
    np.testing.assert_array_equal(h.value(), -_vec(2, 2, 2, 2))
    assert h.push("a", 5, _vec(1, 1, 1, 1)) == PushDecision.ACCUMULATE
    assert h.push("b", 5, _vec(3, 3, 3, 3)) == PushDecision.ACCUMULATE
    np.testing.assert_array_equal(h.value(), -_vec(4, 4, 4, 4))


def test_sync_startup_barrier_holds_steps_until_expected_workers_registered():
    h = Harness("sync", backup_workers=1, expected_workers=3)
    h.join("a", "b")
    assert h.pull_allowed_now("a", 0)  # step 0 may always be read
    h.push("a", 0, _vec(3, 3, 3, 3))
    h.push("b", 0, _vec(3, 3, 3, 3))
    # 2 live - 1 backup would be enough, but only 2 of the 3 expected workers are here.
    assert h.stats().steps_applied == 0 and h.stats().step == 0
    waiter = Waiter(h.ctrl, "a", 1)
    assert waiter.still_blocked()
    h.join("c")  # the third registers: the step that was waiting for it is applied
    assert waiter.released() and waiter.error is None
    assert h.stats().steps_applied == 1
    np.testing.assert_array_equal(h.value(), -_vec(3, 3, 3, 3))


def test_sync_joining_worker_continues_at_the_clusters_step():
    h = Harness("sync")
    h.join("a")
    h.push("a", 0, _vec(1, 1, 1, 1))
    h.push("a", 1, _vec(1, 1, 1, 1))
    assert h.stats().step == 2
    assert h.join("b") == [2]  # the heartbeat answer says where to continue


def test_sync_expired_worker_stops_blocking_the_step():
    h = Harness("sync")
    h.join("a", "b")
    h.push("a", 0, _vec(4, 4, 4, 4))
    waiter = Waiter(h.ctrl, "a", 1)
    assert waiter.still_blocked()
    h.clock.advance(LEASE + 1)
    h.renew("a")
    assert h.membership.expire() == ["b"]
    assert waiter.released() and waiter.error is None
    np.testing.assert_array_equal(h.value(), -_vec(4, 4, 4, 4))
    assert h.stats().steps_applied == 1


def test_sync_workers_that_finished_and_left_do_not_stand_in_for_a_live_worker():
    """'once all live workers but K have finished step t': c is live and has not finished, K = 0.

    a and b pushed step 0 and said goodbye (or their leases ran out); the step must still
    wait for c, and then apply the mean of all three. Counting finished-but-gone workers
    against the live count applies it early and drops c's gradient.
    """
    h = Harness("sync")
    h.join("a", "b", "c")
    h.push("a", 0, _vec(3, 3, 3, 3))
    h.push("b", 0, _vec(6, 6, 6, 6))
    h.membership.leave("a", "inc-a")
    h.membership.leave("b", "inc-b")
    assert h.stats().steps_applied == 0, "step 0 was applied while live worker c had not finished it"
    assert h.push("c", 0, _vec(9, 9, 9, 9)) == PushDecision.ACCUMULATE
    np.testing.assert_array_equal(h.value(), -_vec(6, 6, 6, 6))
    assert h.stats().steps_applied == 1 and h.stats().dropped_gradients == 0


def test_sync_finished_worker_whose_lease_expired_does_not_stand_in_for_a_live_one():
    h = Harness("sync")
    h.join("a", "b", "c")
    h.push("a", 0, _vec(3, 3, 3, 3))  # a finishes step 0, then crashes
    h.clock.advance(LEASE / 2)
    h.renew("b", "c")
    h.clock.advance(LEASE / 2 + 1)
    assert h.membership.expire() == ["a"]
    assert h.stats().steps_applied == 0  # b and c are live and have not finished
    h.push("b", 0, _vec(6, 6, 6, 6))
    assert h.stats().steps_applied == 0, "step 0 was applied while live worker c had not finished it"
    assert h.push("c", 0, _vec(9, 9, 9, 9)) == PushDecision.ACCUMULATE
    np.testing.assert_array_equal(h.value(), -_vec(6, 6, 6, 6))


# ---- ssp -------------------------------------------------------------------------------------------


def _advance(h: Harness, worker: str, steps: int) -> None:
    for step in range(steps):
        assert h.push(worker, step, _vec(0, 0, 0, 0)) == PushDecision.APPLY


def test_ssp_pull_allowed_exactly_when_min_live_clock_reaches_c_minus_s():
    h = Harness("ssp", staleness=2)
    h.join("a", "b", "c")
    _advance(h, "a", 6)
    _advance(h, "b", 3)
    _advance(h, "c", 3)
    assert h.pull_allowed_now("a", 5)  # min clock 3 >= 5 - 2
    assert h.stats().max_staleness_admitted == 2
    assert not h.pull_allowed_now("a", 6)  # 3 < 6 - 2
    waiter = Waiter(h.ctrl, "a", 6)
    assert waiter.still_blocked()
    h.push("b", 3, _vec(0, 0, 0, 0))
    assert waiter.still_blocked()  # c is still at 3
    h.push("c", 3, _vec(0, 0, 0, 0))
    assert waiter.released() and waiter.error is None
    s = h.stats()
    assert s.max_staleness_admitted == 2 and s.step == 4
    assert s.pulls_blocked == 2 and s.pulls == 3  # blocked: the refused probe and the waiter
    assert s.steps_applied == 0 and s.dropped_gradients == 0


def test_ssp_heartbeat_clock_releases_a_pull():
    """A worker that had nothing to push to this shard reports its clock by heartbeat."""
    h = Harness("ssp", staleness=0)
    h.join("a", "b")
    _advance(h, "a", 1)
    waiter = Waiter(h.ctrl, "a", 1)
    assert waiter.still_blocked()
    h.ctrl.on_heartbeat("b", 1)
    assert waiter.released() and waiter.error is None


def test_ssp_startup_barrier_allows_only_the_first_staleness_steps():
    h = Harness("ssp", staleness=1, expected_workers=2)
    h.join("a")
    _advance(h, "a", 2)
    assert h.pull_allowed_now("a", 1)
    # Alone, a's own clock (2) would allow step 2, but b has not registered yet.
    assert not h.pull_allowed_now("a", 2)
    h.join("b")
    # b joins at the cluster's step (a's clock), so a may go on.
    assert h.pull_allowed_now("a", 2)


def test_ssp_expired_worker_stops_blocking():
    h = Harness("ssp", staleness=0)
    h.join("a", "b")
    _advance(h, "a", 1)
    waiter = Waiter(h.ctrl, "a", 1)
    assert waiter.still_blocked()
    h.clock.advance(LEASE / 2)
    h.renew("a")
    assert h.membership.expire() == []
    assert waiter.still_blocked()
    h.clock.advance(LEASE / 2 + 1)  # b last seen LEASE + 1 ago, a only LEASE / 2 + 1
    assert h.membership.expire() == ["b"]
    assert waiter.released() and waiter.error is None


def test_ssp_restarted_worker_rejoins_at_the_slowest_live_clock():
    h = Harness("ssp", staleness=1)
    h.join("a", "b", "c")
    _advance(h, "a", 4)
    _advance(h, "b", 3)
    _advance(h, "c", 1)
    # c restarts (new incarnation) with clock 0: it continues at the others' minimum (3).
    assert h.membership.seen("c", "inc-c-2", 0)
    h.ctrl.forget("c")
    assert h.ctrl.on_heartbeat("c", 0) == 3
    assert h.pull_allowed_now("a", 4)


# ---- timeouts and shutdown --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["ssp", "sync"])
def test_before_pull_times_out_with_step_timeout(mode):
    h = Harness(mode)
    h.join("a", "b")
    h.push("a", 0, _vec(1, 1, 1, 1))  # b has not finished step 0
    with pytest.raises(RequestError) as info:
        h.ctrl.before_pull("a", 1, 0.05)
    assert info.value.reason == Reason.STEP_TIMEOUT
    assert "step 1" in info.value.message
    s = h.stats()
    assert s.pulls_blocked == 1 and s.blocked_seconds >= 0.05 and s.pulls == 1


@pytest.mark.parametrize("mode", ["ssp", "sync"])
def test_close_releases_waiters_with_shutting_down(mode):
    h = Harness(mode)
    h.join("a", "b")
    h.push("a", 0, _vec(1, 1, 1, 1))
    waiters = [Waiter(h.ctrl, "a", 1, timeout=None), Waiter(h.ctrl, "a", 1, timeout=60.0)]
    assert waiters[0].still_blocked()
    h.ctrl.close()
    for waiter in waiters:
        assert waiter.released()
        assert waiter.error is not None and waiter.error.reason == Reason.SHUTTING_DOWN
    with pytest.raises(RequestError) as info:  # and later pulls do not wait at all
        h.ctrl.before_pull("b", 5, None)
    assert info.value.reason == Reason.SHUTTING_DOWN


def test_async_never_blocks_and_applies_every_push():
    h = Harness("async")
    h.join("a", "b")
    _advance(h, "a", 3)
    h.ctrl.before_pull("b", 100, 0.0)
    s = h.stats()
    assert (s.pulls, s.pulls_blocked, s.steps_applied, s.dropped_gradients) == (0, 0, 0, 0)
    assert h.ctrl.cluster_step() == 0 and h.ctrl.on_heartbeat("a", 7) == 0
