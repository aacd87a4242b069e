"""What a run records: the faults whose times the oracle must allow for, and what it found wrong."""

from __future__ import annotations

import collections
import json
import math
import pathlib
from dataclasses import dataclass, field

#: Longest wait for a worker's next acknowledged push that still counts as a failover sample.
FAILOVER_WINDOW = 60.0
# A worker gives a failover sample only if it had a push acknowledged this shortly before the loss: one
# restarted (a worker-kill just before) or stalled by another fault would time its own start or that fault.
FAILOVER_WORKING_BEFORE = 2.0


@dataclass
class Report:
    """One mode's outcome: events run, pushes by outcome, violations by category, notes."""

    mode: str
    seed: int
    events: collections.Counter = field(default_factory=collections.Counter)
    violations: list[str] = field(default_factory=list)
    #: category -> its violations, for a summary that names each kind of failure once
    by_category: dict[str, list[str]] = field(default_factory=dict)
    pushes: collections.Counter = field(default_factory=collections.Counter)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    #: what was lost -> seconds from the loss to each worker's next acknowledged push
    failovers: dict[str, list[float]] = field(default_factory=dict)

    def fail(self, category: str, message: str) -> None:
        self.violations.append(message)
        self.by_category.setdefault(category, []).append(message)

    def summary(self) -> str:
        lines = [f"mode {self.mode} seed {self.seed}: {sum(self.events.values())} fault events "
                 f"{dict(sorted(self.events.items()))}, pushes {dict(sorted(self.pushes.items()))}, "
                 f"{self.seconds:.1f}s, violations {len(self.violations)}"]
        for what, seconds in sorted(self.failovers.items()):
            lines.append(f"  failover after a {what}, from the workers' side: {len(seconds)} samples, "
                         f"p50 {percentile(seconds, 50):.2f}s, p99 {percentile(seconds, 99):.2f}s, "
                         f"max {max(seconds):.2f}s")
        lines += [f"  note: {n}" for n in self.notes]
        for category, messages in self.by_category.items():
            lines.append(f"  VIOLATION {category} x{len(messages)}: {messages[0]}")
            lines += [f"      also: {m}" for m in messages[1:3]]
        return "\n".join(lines)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (nearest rank); nan when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


@dataclass
class LossWindow:
    """Shard ``shard`` was SIGKILLed at ``killed``; its newest checkpoint was taken at ``snapshot``."""

    shard: int
    snapshot: float  # -inf: no checkpoint
    killed: float


@dataclass
class Timeline:
    """The faults that widen what the oracle allows, with their times (``time.time()``)."""

    windows: list[LossWindow] = field(default_factory=list)  # server SIGKILLs: what a crash may lose
    rotations: list[float] = field(default_factory=list)  # times the token file changed
    #: (what was lost, when): a primary SIGKILLed ("process death") or its host lost ("lost host"); the
    #: workers' logs tell how long each took to get a push acknowledged again (``failover_seconds``).
    failovers: list[tuple[str, float]] = field(default_factory=list)


def failover_seconds(timeline: Timeline, worker_logs: list[pathlib.Path]) -> dict[str, list[float]]:
    """For each loss in ``timeline.failovers``, per worker: seconds to its first push acknowledged after it.

    A push touches both shards, so the first acknowledgement after a
    primary was lost is the first the shard's new primary (or the healed
    one) gave that worker: what the worker waited, retries and the
    replica-set's election included. A worker with no acknowledgement
    within ``FAILOVER_WINDOW`` s (killed, or out of slots), or none in the
    ``FAILOVER_WORKING_BEFORE`` s before the loss (restarting, or held up by
    an earlier fault), gives no sample.
    """
    acks = []
    for path in worker_logs:
        times = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut by SIGKILL
            if entry.get("ev") == "ack":
                times.append(entry["t1"])
        acks.append(sorted(times))
    found: dict[str, list[float]] = {}
    for what, lost in timeline.failovers:
        for times in acks:
            if not any(lost - FAILOVER_WORKING_BEFORE < t <= lost for t in times):
                continue
            after = next((t for t in times if t > lost), None)
            if after is not None and after - lost < FAILOVER_WINDOW:
                found.setdefault(what, []).append(after - lost)
    return found
