"""Pushes whose every application can be counted, for fault tests of replicated shards.

Push number ``k`` of worker ``w`` owns row ``w * slots_per_worker + k`` of a
``(workers * slots_per_worker, 1)`` float32 variable and writes only there,
with the integer gradient ``gradient(row)`` in 1..7 (exact in float32), SGD
with learning rate 1 from zeros. So after the run each row holds
``-count * gradient(row)``: how many times its push was applied. The rules:
an acknowledged push exactly once; a push that raised 0 or 1 times (it may
have been applied before the refusal came); a push never sent 0 times.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from worker_client import SGD, PSClient, Zeros

__all__ = ["SlotCheck", "SlotPusher", "check_slots", "create_slots", "gradient", "percentile"]


def gradient(row: int) -> int:
    return 1 + row % 7


def create_slots(client: PSClient, name: str, workers: int, slots_per_worker: int) -> None:
    client.create_variable(name, (workers * slots_per_worker, 1), initializer=Zeros(), optimizer=SGD(1.0))


@dataclass
class SlotPusher:
    """One worker's loop of one-row pushes on its own thread, each push's outcome recorded.

    ``acknowledged`` maps a row to the time (monotonic) its push returned;
    ``raised`` maps a row to the exception its push raised. ``on_ack`` runs
    after each acknowledgement (for timing failovers).
    """

    client: PSClient
    name: str
    worker: int
    slots_per_worker: int
    pause: float = 0.0
    on_ack: Callable[[int, float], None] = lambda row, at: None
    acknowledged: dict[int, float] = field(default_factory=dict)
    raised: dict[int, BaseException] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)
    exhausted: bool = False
    _thread: threading.Thread | None = None

    def start(self) -> SlotPusher:
        self._thread = threading.Thread(target=self._run, name=f"slot-pusher-{self.worker}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        first = self.worker * self.slots_per_worker
        for row in range(first, first + self.slots_per_worker):
            if self.stop.is_set():
                return
            try:
                self.client.push_rows(self.name, np.array([row]), np.array([[gradient(row)]], np.float32))
            except Exception as error:  # noqa: BLE001 - recorded: the rules allow 0 or 1 applications
                self.raised[row] = error
            else:
                at = time.monotonic()
                self.acknowledged[row] = at
                self.on_ack(row, at)
            if self.pause:
                self.stop.wait(self.pause)
        self.exhausted = True

    def join(self, timeout: float = 60.0) -> None:
        self.stop.set()
        assert self._thread is not None
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"worker {self.worker}'s push did not return in {timeout}s"
        assert not self.exhausted, f"worker {self.worker} ran out of its {self.slots_per_worker} slots"

    @property
    def rows_sent(self) -> set[int]:
        return set(self.acknowledged) | set(self.raised)


@dataclass
class SlotCheck:
    acknowledged: int = 0
    raised: int = 0
    raised_applied: int = 0
    violations: list[str] = field(default_factory=list)


def check_slots(values: np.ndarray, pushers: list[SlotPusher]) -> SlotCheck:
    """Every row against its push's outcome (the module's rules); the violations listed, not raised."""
    check = SlotCheck()
    column = values[:, 0]
    counts = -column / np.array([gradient(row) for row in range(len(column))], np.float32)
    sent: set[int] = set()
    for pusher in pushers:
        sent |= pusher.rows_sent
        for row in pusher.acknowledged:
            check.acknowledged += 1
            if counts[row] != 1:
                check.violations.append(f"row {row}: acknowledged, applied {counts[row]:g} times")
        for row in pusher.raised:
            check.raised += 1
            if counts[row] not in (0, 1):
                check.violations.append(f"row {row}: raised, applied {counts[row]:g} times")
            check.raised_applied += int(counts[row] == 1)
    for row in np.flatnonzero(column):
        if int(row) not in sent:
            check.violations.append(f"row {row}: never sent, applied {counts[row]:g} times")
    return check


def percentile(samples: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank, so p99 of few samples is their maximum)."""
    ordered = sorted(samples)
    rank = max(1, int(np.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]
