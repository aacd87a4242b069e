"""Values a step's push brought back for the next step (``PushBegin.pull_after``).

In asynchronous mode a step's push can carry the next step's pull: each
shard answers the push with the values right after applying it, so a step
costs one round trip per shard instead of two. The values are kept per
thread and used by that thread's next step only while they are what it
would pull now: same names and device, no push started since, and fresh.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from worker_client.pull_receiver import PullItem

__all__ = ["PREFETCH_MAX_AGE_SECONDS", "NextPull", "Prefetch", "Prefetches"]

#: A step's values brought back by the previous step's push are used only
#: this soon after; a loop that pauses longer between steps pulls again.
PREFETCH_MAX_AGE_SECONDS = 1.0


@dataclass(frozen=True)
class NextPull:
    """What the next step will pull: its variable names (None: all dense) and device."""

    names: tuple[str, ...] | None
    gpu: int | None


@dataclass
class Prefetch:
    """Values pulled by a step's push for the next step: where they go, per shard, and when they came."""

    next_pull: NextPull
    out: dict[str, np.ndarray]
    by_shard: dict[int, list[PullItem]]
    #: Per shard, the serialised PullRequest its push carries (PushBegin.pull_after).
    requests: dict[int, bytes] = field(default_factory=dict)
    generation: int = -1
    fetched_at: float = 0.0

    def is_fresh(self) -> bool:
        return time.monotonic() - self.fetched_at <= PREFETCH_MAX_AGE_SECONDS


class Prefetches:
    """Each thread's last prefetch, and the pushes started (a prefetch outlives no push); thread-safe."""

    def __init__(self) -> None:
        # Guards _generation and _kept.
        self._lock = threading.Lock()
        #: Pushes started by this client; a prefetch is used only while no push
        #: started after its own (so every push is seen by the next step).
        self._generation = 0
        self._kept: dict[int, Prefetch] = {}

    def push_started(self) -> int:
        """Count a push that starts; its generation."""
        with self._lock:
            self._generation += 1
            return self._generation

    @property
    def generation(self) -> int:
        """Pushes this client started so far."""
        with self._lock:
            return self._generation

    def keep(self, prefetch: Prefetch, generation: int) -> None:
        """Keep the values the push of ``generation`` brought back, for this thread's next step."""
        prefetch.generation = generation
        prefetch.fetched_at = time.monotonic()
        with self._lock:
            self._kept[threading.get_ident()] = prefetch

    def take(self) -> Prefetch | None:
        """This thread's prefetch, if no push started since it came."""
        with self._lock:
            prefetch = self._kept.pop(threading.get_ident(), None)
            generation = self._generation
        if prefetch is None or prefetch.generation != generation:
            return None
        return prefetch
