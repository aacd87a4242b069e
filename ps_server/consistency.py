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
their RPC deadline. No gRPC here; thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from ps_server.errors import RequestError
from ps_server.membership import Membership
from ps_server.store import VariableStore
from wehub_ps.errors import Reason
from wehub_ps.logs import event

__all__ = ["ConsistencyController", "PushDecision", "ConsistencyStats"]

log = logging.getLogger("ps_server.consistency")


class PushDecision:
    APPLY = "apply"  # async / ssp: run the optimizer now
    ACCUMULATE = "accumulate"  # sync: add to the step's sum
    DROP = "drop"  # sync: the step was applied already


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
    def __init__(self, mode: str, staleness: int, backup_workers: int, membership: Membership,
                 store: VariableStore, expected_workers: int = 0) -> None:
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
        self._clocks: dict[str, int] = {}
        self._step = 0  # sync: the step being accumulated
        self._finished: set[str] = set()  # sync: workers done with the current step
        self._accumulating = False  # sync: some gradient of the current step arrived
        self._closed = False
        self._pulls = self._pulls_blocked = self._dropped = self._steps_applied = 0
        self._blocked_seconds = 0.0
        self._max_staleness = 0
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

    # ---- events ----

    def on_heartbeat(self, worker_id: str, clock: int) -> int:
        """A worker reports its clock; returns the step it should be at (never below its own)."""
        if self.mode == "async":
            return 0
        with self._cond:
            if worker_id not in self._clocks:  # a new or restarted worker joins at the cluster's step
                others = self._min_live_clock(exclude=worker_id)
                self._clocks[worker_id] = max(clock, others if self.mode == "ssp" else self._step)
            self._advance_clock(worker_id, clock)
            return self._clocks[worker_id] if self.mode == "ssp" else max(self._step, clock)

    def forget(self, worker_id: str) -> None:
        """A worker restarted (new incarnation): its clock starts again from the cluster's."""
        with self._cond:
            self._clocks.pop(worker_id, None)
            self._finished.discard(worker_id)

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

    def push_decision(self, step: int) -> str:
        """What to do with a gradient of ``step`` (decided when the push begins)."""
        if self.mode != "sync":
            return PushDecision.APPLY
        with self._cond:
            if step > self._step and not self._accumulating and not self._finished:
                self._jump_to(step)  # e.g. after a restart: follow the workers
            if step < self._step:
                return PushDecision.DROP
            if step > self._step:
                raise RequestError(Reason.INVALID_REQUEST,
                                   f"push for step {step}, but this shard is at step {self._step}; pull "
                                   "first (a synchronous step starts with a pull)")
            self._accumulating = True
            return PushDecision.ACCUMULATE

    def on_push_complete(self, worker_id: str, step: int, decision: str) -> None:
        """A push of ``step`` was applied, accumulated or dropped completely (called once)."""
        if self.mode == "async":
            return
        with self._cond:
            if decision == PushDecision.DROP:
                self._dropped += 1
                event(log, logging.DEBUG, "late gradient dropped", worker_id=worker_id, step=step,
                      current_step=self._step)
            self._advance_clock(worker_id, step + 1)

    def close(self) -> None:
        """Release every waiting pull (shutdown)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ---- internals (lock held) ----

    def _advance_clock(self, worker_id: str, clock: int) -> None:
        if clock > self._clocks.get(worker_id, 0):
            self._clocks[worker_id] = clock
            self._cond.notify_all()
        if self.mode == "sync" and clock > self._step:
            self._finished.add(worker_id)
            self._maybe_apply()

    def _on_membership_change(self) -> None:
        with self._cond:
            self._cond.notify_all()
            if self.mode == "sync":
                self._maybe_apply()

    def _started(self) -> bool:
        """The startup barrier: every expected worker has registered once."""
        return len(self._membership.workers()) >= self.expected_workers

    def _pull_allowed(self, step: int) -> bool:
        if not self._started():
            return step == 0 if self.mode == "sync" else step <= self.staleness
        if self.mode == "sync":
            return self._step >= step
        return self._min_live_clock() >= step - self.staleness

    def _min_live_clock(self, exclude: str | None = None) -> int:
        live = [w for w in self._membership.live_ids() if w != exclude]
        if not live:
            return max(self._clocks.values(), default=0) if self.mode == "ssp" else self._step
        return min(self._clocks.get(w, 0) for w in live)

    def _maybe_apply(self) -> None:
        if not self._started():
            return
        # All live workers but K have finished (a worker that finished and then
        # left counts for its gradient, never for someone else's).
        waiting_for = self._membership.live_ids() - self._finished
        if self._finished and len(waiting_for) <= self.backup_workers:
            applied = self._store.apply_accumulated(self._step)
            event(log, logging.DEBUG, "sync step applied", step=self._step, workers=len(self._finished),
                  variables=applied)
            self._steps_applied += 1
            self._jump_to(self._step + 1)

    def _jump_to(self, step: int) -> None:
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
