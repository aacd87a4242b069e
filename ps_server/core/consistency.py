"""Consistency modes: async, bounded staleness (SSP) and synchronous steps.

* ``async``: every push is applied the moment it arrives; pulls never wait.
* ``ssp`` (staleness S): each worker has a clock, the number of steps it has
  completed (a push of step c completes step c; a worker that had nothing to
  push to this shard reports its clock by heartbeat). A worker at step c may
  pull only when every live worker's clock is at least c - S. With S = 0
  this is a barrier per step without aggregation.
* ``sync`` (backup workers K): the gradients of step t are accumulated, not
  applied; once all live workers but K have finished step t, their mean (or
  sum, per variable) is applied once, and step t + 1 begins. A gradient of
  step t that arrives later is dropped and counted. A pull for step t + 1
  waits until step t is applied.

Only live workers count (see :mod:`.membership`): a worker whose lease
expired never blocks anyone. With ``expected_workers`` N, nothing moves
(no sync step is applied, no ssp pull waits less) until N workers have
registered, so the first steps are not taken by whoever started first. A worker that joins or restarts continues at
the cluster's step (its heartbeat answer says which). Pulls wait at most
their RPC deadline; so does a sync push for a step this shard has not
reached yet (the shard lost steps in a crash, or the step waits for other
workers). Clocks are kept for live workers only.

Locks: the store's apply gate, then this controller's condition, then the
parts' and the membership's locks. A sync push merges into the step and
records its worker's clock under the gate held shared; a step is applied
under the gate held exclusive, so a push is in every variable's sum of a
step or in none, and a checkpoint (which also holds it exclusive) sees
values, ledger, sums, clocks and workers of one instant
(:meth:`ConsistencyController.snapshot`).

A replicated shard (``--replicas`` > 1) moves its step in one order with
its other changes (:attr:`ConsistencyController.changes`): the primary
applies or jumps over a step under the order and logs it where it did; a
backup moves its step only as the log says (:meth:`follow_step`), with the
same code, so its step and sums are the primary's at every record.

No gRPC here; thread-safe.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from ps_server.core.errors import RequestError
from ps_server.core.gate import ApplyGate
from ps_server.core.membership import Membership
from ps_server.core.ordering import UNLOGGED, ChangeLog
from wehub_ps.errors import Reason
from wehub_ps.process.logs import event

__all__ = ["ConsistencyController", "PushDecision", "ConsistencyStats", "SteppedVariables"]

log = logging.getLogger("ps_server.core.consistency")


class SteppedVariables(Protocol):
    """What synchronous steps need of the variables (the store): their gate, and each step's sums."""

    gate: ApplyGate

    def apply_accumulated(self, step: int) -> list[str]:
        """Apply step ``step``'s sums (gate held exclusive); returns the variables updated."""

    def start_step(self, step: int) -> None:
        """Accumulate ``step`` from now on; sums of another step are discarded."""


class PushDecision:
    APPLY = "apply"  # async / ssp: run the optimizer now
    ACCUMULATE = "accumulate"  # sync: add to the step's sum
    DROP = "drop"  # sync: the step was applied already
    WAIT = "wait"  # sync: the step is ahead of this shard (see wait_for_step)


@dataclass(frozen=True)
class ConsistencyStats:
    mode: str
    staleness: int
    backup_workers: int
    step: int
    pulls: int
    pulls_blocked: int
    blocked_seconds: float
    max_staleness_admitted: int
    dropped_gradients: int
    steps_applied: int


class ConsistencyController:
    """The clocks, the step and the waits of one consistency mode; thread-safe.

    Longer than 300 lines because every field is guarded by one condition
    and each mode's rule reads several of them: split, the invariants of
    that condition would be spread over classes.
    """

    def __init__(self, mode: str, staleness: int, backup_workers: int, membership: Membership,
                 store: SteppedVariables, expected_workers: int = 0) -> None:
        if mode not in ("async", "ssp", "sync"):
            raise ValueError(f"mode must be async, ssp or sync, got {mode!r}")
        self.mode = mode
        self.staleness = staleness
        self.backup_workers = backup_workers
        self.expected_workers = expected_workers
        self._membership = membership
        self._store = store
        # Guards every field below; notified when a clock, the step or the live set changes.
        self._cond = threading.Condition()
        self._clocks: dict[str, int] = {}  # live workers only (see _on_membership_change)
        self._high_clock = 0  # ssp: the highest clock seen, the cluster's clock when nobody is live
        self._step = 0  # sync: the step being accumulated
        self._finished: set[str] = set()  # sync: workers done with the current step
        self._accumulating = False  # sync: some push of the current step began
        self._closed = False
        self._pulls = self._pulls_blocked = self._dropped = self._steps_applied = 0
        self._blocked_seconds = 0.0
        self._max_staleness = 0
        #: Where sync steps are put in order and logged (a replicated shard's role); set before serving.
        self.changes: ChangeLog = UNLOGGED
        membership.subscribe(self._on_membership_change)

    # ---- queries ----

    def stats(self) -> ConsistencyStats:
        with self._cond:
            step = self._step if self.mode == "sync" else self._min_live_clock()
            return ConsistencyStats(self.mode, self.staleness, self.backup_workers, step, self._pulls,
                                    self._pulls_blocked, self._blocked_seconds, self._max_staleness,
                                    self._dropped, self._steps_applied)

    def cluster_step(self) -> int:
        """Where a (re)joining worker continues: 0 in async mode."""
        with self._cond:
            if self.mode == "sync":
                return self._step
            if self.mode == "ssp":
                return self._min_live_clock()
            return 0

    def clock_count(self) -> int:
        """How many worker clocks are kept (bounded by the live workers)."""
        with self._cond:
            return len(self._clocks)

    def ordered(self) -> AbstractContextManager[None]:
        """Held while a sync decision or step is taken (and logged); nothing outside sync mode.

        On a replicated shard, the shard's order (taken before the gate):
        RequestError NOT_PRIMARY on a backup, whose steps move only as its
        primary's log says.
        """
        return self.changes.ordered() if self.mode == "sync" else contextlib.nullcontext()

    # ---- events ----

    def on_heartbeat(self, worker_id: str, clock: int) -> int:
        """A worker reports its clock; returns the step it should be at (never below its own)."""
        if self.mode == "async":
            return 0
        with self._cond:
            if worker_id not in self._clocks:  # a new or restarted worker joins at the cluster's step
                self._clocks[worker_id] = self._joining_clock(worker_id)
            self._advance_clock(worker_id, clock)
            answer = self._clocks[worker_id] if self.mode == "ssp" else max(self._step, clock)
        self.apply_ready_steps()
        return answer

    def forget(self, worker_id: str) -> None:
        """A worker restarted (new incarnation): its clock starts again from the cluster's."""
        with self._cond:
            self._finished.discard(worker_id)
            self._clocks[worker_id] = self._joining_clock(worker_id)

    def before_pull(self, worker_id: str, step: int, timeout: float | None) -> None:
        """Block until a pull at ``step`` is allowed; RequestError after ``timeout`` s."""
        if self.mode == "async":
            return
        started = time.monotonic()
        with self._cond:
            self._pulls += 1
            blocked = False
            while not self._closed and not self._pull_allowed(step):
                blocked = True
                remaining = None if timeout is None else timeout - (time.monotonic() - started)
                if remaining is not None and remaining <= 0:
                    self._record_block(started)
                    raise RequestError(Reason.STEP_TIMEOUT, self._wait_message(step))
                self._cond.wait(remaining if remaining is not None else 1.0)
            if self._closed:
                raise RequestError(Reason.SHUTTING_DOWN, "this ps-server is shutting down; retry shortly")
            if blocked:
                self._record_block(started)
            if self.mode == "ssp":
                self._max_staleness = max(self._max_staleness, step - self._min_live_clock())

    def push_decision(self, step: int, accumulate: Callable[[], None] | None = None) -> str:
        """What to do with a gradient of ``step`` (decided when the push begins).

        Sync mode: the caller holds :meth:`ordered`, then the store's gate
        shared, so the step cannot be applied between this decision and
        whatever the caller does under it. WAIT: the step is ahead of this
        shard, which holds a step of its own; call :meth:`wait_for_step`,
        then decide again.
        ACCUMULATE: ``accumulate()`` (e.g. pinning the push's table rows)
        runs first, under this controller's condition; when it raises, the
        push is refused and the step is not marked as accumulating (a step
        with no push in it may still be jumped over).
        """
        if self.mode != "sync":
            return PushDecision.APPLY
        with self._cond:
            if step > self._step and not self._accumulating and not self._finished:
                # E.g. after a restart without step state: follow the workers. Kept even when the
                # push is then refused: its worker is at ``step`` (its heartbeats say so too), and
                # the steps skipped hold no gradient here.
                self._jump_to(step)
            if step < self._step:
                return PushDecision.DROP
            if step > self._step:
                return PushDecision.WAIT
            if accumulate is not None:
                accumulate()
            self._accumulating = True
            return PushDecision.ACCUMULATE

    def wait_for_step(self, worker_id: str, step: int, timeout: float | None) -> None:
        """Sync: a push of ``step`` waits (no locks held) until this shard reaches that step.

        A worker at ``step`` has finished every step before it, so its clock
        moves there first: if the shard lost steps in a crash, the steps
        the workers have all left behind are applied (with the gradients
        the shard still has) and skipped. RequestError STEP_TIMEOUT after
        ``timeout`` s (the client retries), SHUTTING_DOWN on shutdown.
        """
        if self.mode != "sync":
            return
        if timeout is None:
            timeout = self._membership.lease_seconds  # never hold a thread longer unseen
        with self._cond:
            tracked = self._track(worker_id)
            # Not undone when the push then fails or is refused, and need not be: a clock of
            # ``step`` says only that the worker left the steps before it, which its asking to push
            # ``step`` shows (PSClient moves to a step only once every shard took the previous one,
            # and its heartbeats report the same clock meanwhile). The push's own step counts as
            # left only with clock ``step`` + 1, which complete_push alone records.
            if tracked:
                self._advance_clock(worker_id, step)
        self.apply_ready_steps()
        started = time.monotonic()
        with self._cond:
            while not self._closed and self._step < step:
                remaining = timeout - (time.monotonic() - started)
                if remaining <= 0:
                    raise RequestError(Reason.STEP_TIMEOUT,
                                       f"push for step {step} waited for this shard to finish step "
                                       f"{self._step} (other workers have not); retry")
                self._cond.wait(remaining)
            if self._closed:
                raise RequestError(Reason.SHUTTING_DOWN, "this ps-server is shutting down; retry shortly")

    def complete_push(self, worker_id: str, step: int, decision: str,
                      merge: Callable[[], None] | None = None) -> bool:
        """A push of ``step`` arrived whole; the caller holds the store's gate shared.

        Sync, ACCUMULATE: ``merge()`` adds it to every part's sum if its step
        is still the open one (the gate keeps it open until this returns),
        else it is dropped whole. The worker's clock moves past ``step``. No
        step is applied here: call :meth:`apply_ready_steps` once the gate is
        released. Returns False when the push was dropped.
        """
        if self.mode == "async":
            return True
        with self._cond:
            counted = decision != PushDecision.DROP and (self.mode != "sync" or step == self._step)
        if counted and decision == PushDecision.ACCUMULATE and merge is not None:
            merge()
        with self._cond:
            if not counted:
                self._dropped += 1
                event(log, logging.DEBUG, "late gradient dropped", worker_id=worker_id, step=step,
                      current_step=self._step)
            if self._track(worker_id):
                self._advance_clock(worker_id, step + 1)
        return counted

    def apply_ready_steps(self) -> None:
        """Sync: apply the open step once all live workers but K finished it (call with no locks held,
        or only :meth:`ordered`, as a push that finished the step does).

        The step is applied with the gate held exclusive: no push merges
        into it meanwhile, and no checkpoint sees it half applied. Once the
        final checkpoint sealed the gate, nothing is applied: the step and
        its sums are in that checkpoint, and the restarted server applies it.
        A backup replica applies nothing here: its primary's log says when.
        """
        if self.mode != "sync":
            return
        while True:
            with self._cond:
                if not self._ready():
                    return
            try:
                with self.ordered(), self._store.gate.exclusive(), self._cond:
                    if not self._ready():
                        return
                    step = self._step
                    self._apply_step(step)
                    self._jump_to(self._first_unfinished_step(step + 1), applied=True)
            except RequestError as error:
                if error.reason not in (Reason.SHUTTING_DOWN, Reason.NOT_PRIMARY):
                    raise
                return  # sealed by the final checkpoint, or a backup (its primary applies steps)

    # ---- a backup replica: the primary's decisions, in the primary's order ----

    def follow_decision(self, step: int, accumulate: bool, pin: Callable[[], None] | None = None) -> None:
        """Sync, a backup: the primary decided that a push of ``step`` accumulates (``pin()`` pins its
        table rows, as the primary's did) or is dropped; the caller holds the gate shared.

        The primary's decision stands (it may have depended on workers this
        replica does not see); RequestError when an accumulating push's
        step is not the step open here (the replica diverged).
        """
        with self._cond:
            if not accumulate:
                return
            if step != self._step:
                raise RequestError(Reason.INVALID_REQUEST, f"the primary accumulated a push of step {step}, "
                                                           f"but this replica's open step is {self._step}")
            if pin is not None:
                pin()
            self._accumulating = True

    def follow_step(self, step: int, applied: bool) -> None:
        """Sync, a backup: the primary applied its open step (``applied``) or jumped over it, and opened
        ``step``; the same here, with the gate held as the primary held it (call with no locks held)."""
        gate = self._store.gate.exclusive() if applied else self._store.gate.shared()
        with gate, self._cond:
            if applied:
                self._apply_step(self._step)
            self._move_to(step)

    def close(self) -> None:
        """Release every waiting pull and push (shutdown)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ---- checkpoints ----

    def snapshot(self) -> dict[str, Any]:
        """Step, clocks and workers, JSON-able; call with the store's gate held exclusive."""
        with self._cond:
            state: dict[str, Any] = {"mode": self.mode}
            if self.mode == "async":
                return state
            state.update(step=self._step, clocks=dict(self._clocks), finished=sorted(self._finished),
                         accumulating=self._accumulating, high_clock=self._high_clock,
                         steps_applied=self._steps_applied, dropped=self._dropped,
                         workers=self._membership.snapshot())
            return state

    def restore(self, state: dict[str, Any] | None) -> bool:
        """Continue from a :meth:`snapshot` (before serving); False when it does not fit this mode.

        Then the step's sums restored with the parts are discarded too:
        another mode never applies them.
        """
        if state is None or state.get("mode") != self.mode or self.mode == "async":
            self._store.start_step(-1)  # no step is -1: every restored sum goes
            return False
        self._membership.restore(state["workers"])
        with self._cond:
            self._step = int(state["step"])
            self._clocks = {str(w): int(c) for w, c in state["clocks"].items()}
            self._finished = set(state["finished"])
            self._accumulating = bool(state["accumulating"])
            self._high_clock = int(state["high_clock"])
            self._steps_applied = int(state["steps_applied"])
            self._dropped = int(state["dropped"])
            if self.mode == "sync":
                self._store.start_step(self._step)  # a sum of another step is stale
            self._cond.notify_all()
        return True

    # ---- internals (lock held) ----

    def _joining_clock(self, worker_id: str) -> int:
        """Where a worker without a clock (new, restarted, back after its lease ran out) starts."""
        return self._min_live_clock(exclude=worker_id) if self.mode == "ssp" else self._step

    def _track(self, worker_id: str) -> bool:
        """Whether ``worker_id`` has a clock (condition held), giving a live worker without one the
        cluster's. Clocks are kept for live workers (registered by heartbeat) only: a push of a client
        that is no worker moves none."""
        if worker_id in self._clocks:
            return True
        if worker_id not in self._membership.live_ids():
            return False
        self._clocks[worker_id] = self._joining_clock(worker_id)
        return True

    def _advance_clock(self, worker_id: str, clock: int) -> None:
        if clock > self._clocks.get(worker_id, 0):
            self._clocks[worker_id] = clock
            self._high_clock = max(self._high_clock, clock)
            self._cond.notify_all()
        if self.mode == "sync" and clock > self._step:
            self._finished.add(worker_id)

    def _on_membership_change(self) -> None:
        """Keep clocks for live workers only; a worker (back) without one starts at the cluster's."""
        with self._cond:
            live = self._membership.live_ids()  # under the condition: a clock set later is a live worker's
            for worker_id in [w for w in self._clocks if w not in live]:
                del self._clocks[worker_id]  # lease expired or replaced: bounded by the live set
            for worker_id in live - self._clocks.keys():
                self._clocks[worker_id] = self._joining_clock(worker_id)
            self._cond.notify_all()
        self.apply_ready_steps()

    def _started(self) -> bool:
        """The startup barrier: every expected worker has registered once."""
        return not self.expected_workers or self._membership.count() >= self.expected_workers

    def _pull_allowed(self, step: int) -> bool:
        if not self._started():
            return step == 0 if self.mode == "sync" else step <= self.staleness
        if self.mode == "sync":
            return self._step >= step
        return self._min_live_clock() >= step - self.staleness

    def _min_live_clock(self, exclude: str | None = None) -> int:
        live = [w for w in self._membership.live_ids() if w != exclude]
        if not live:
            return self._high_clock if self.mode == "ssp" else self._step
        return min(self._clocks.get(w, 0) for w in live)

    def _ready(self) -> bool:
        """All live workers but K have finished the open step (a worker that finished and then
        left counts for its gradient, never for someone else's)."""
        if not self._started():
            return False
        waiting_for = self._membership.live_ids() - self._finished
        return bool(self._finished) and len(waiting_for) <= self.backup_workers

    def _first_unfinished_step(self, after: int) -> int:
        """The first step from ``after`` on that the workers' clocks alone do not finish.

        Steps the live workers have all (but K) left behind hold no gradient
        here (pushes only ever join the open step); they are skipped at once
        instead of one per heartbeat.
        """
        if not self._clocks:
            return after
        bound = max(self._clocks.values())  # no worker has finished a step beyond it
        live_clocks = sorted(self._clocks.get(w, 0) for w in self._membership.live_ids())
        if len(live_clocks) > self.backup_workers:
            bound = min(bound, live_clocks[self.backup_workers])
        return max(after, bound)

    def _apply_step(self, step: int) -> None:
        """Apply the open step's sums (gate held exclusive, condition held)."""
        applied = self._store.apply_accumulated(step)
        event(log, logging.DEBUG, "sync step applied", step=step, workers=len(self._finished),
              variables=applied)
        self._steps_applied += 1

    def _jump_to(self, step: int, applied: bool = False) -> None:
        """Open ``step`` (``applied``: the open one was just applied) and log it where it happened."""
        self._move_to(step)
        self.changes.sync_step(step, applied)

    def _move_to(self, step: int) -> None:
        self._step = step
        self._finished = {w for w, c in self._clocks.items() if c > step}
        self._accumulating = False
        self._store.start_step(step)
        self._cond.notify_all()

    def _record_block(self, started: float) -> None:
        self._pulls_blocked += 1
        self._blocked_seconds += time.monotonic() - started

    def _wait_message(self, step: int) -> str:
        if self.mode == "sync":
            return f"pull for step {step} waited for step {step - 1} to be applied; still at {self._step}"
        return (f"pull for step {step} waited for the slowest live worker (clock "
                f"{self._min_live_clock()}, staleness {self.staleness})")
