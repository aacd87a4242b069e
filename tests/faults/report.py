"""What a run records: the faults whose times the oracle must allow for, and what it found wrong."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


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

    def fail(self, category: str, message: str) -> None:
        self.violations.append(message)
        self.by_category.setdefault(category, []).append(message)

    def summary(self) -> str:
        lines = [f"mode {self.mode} seed {self.seed}: {sum(self.events.values())} fault events "
                 f"{dict(sorted(self.events.items()))}, pushes {dict(sorted(self.pushes.items()))}, "
                 f"{self.seconds:.1f}s, violations {len(self.violations)}"]
        lines += [f"  note: {n}" for n in self.notes]
        for category, messages in self.by_category.items():
            lines.append(f"  VIOLATION {category} x{len(messages)}: {messages[0]}")
            lines += [f"      also: {m}" for m in messages[1:3]]
        return "\n".join(lines)


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
