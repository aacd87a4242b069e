"""The overlapped step: step k's push goes out in the background while step k+1 computes.

``client.step(overlap=True)``: a step pulls when it starts, as a plain step
does, while the previous step's push may still be on its way; its own push
is copied and handed to the background (worker_client.background) when it
calls ``push``. The values a step computes on therefore hold every push of
this worker but possibly the previous step's (which may or may not have
landed when the pull read them): one step of its own staleness, on top of
what asynchronous training already admits from other workers.

``pull_ahead=True`` also moves the pull off the critical path: the values
for step k+1 are read in the background right after step k-1's push was
applied, while step k computes. A step then waits for nothing but its
compute when communication keeps up. Its values hold every push of this
worker up to two steps back and never the previous step's (exactly one
step of its own staleness), and were read while the previous step
computed. Values read before more than one later push of this client
started are not used (the step pulls itself), so the bound holds even when
other pushes come in between.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from worker_client.arrays import parse_device
from worker_client.background import BackgroundPushes, Job, PushHandle
from worker_client.prefetch import NextPull, Prefetches
from worker_client.pulls import Puller
from worker_client.registry import Registry
from worker_client.session import Session

__all__ = ["OverlappedStep", "StepPipeline"]


@dataclass(frozen=True)
class _Ahead:
    """Values read in the background for the next step of ``thread``."""

    thread: int
    next_pull: NextPull
    values: dict[str, Any]
    read_at_generation: int


class StepPipeline:
    """The state overlapped steps share across steps: the values pulled ahead; thread-safe."""

    def __init__(self, session: Session, registry: Registry, puller: Puller, background: BackgroundPushes,
                 prefetches: Prefetches) -> None:
        self.session = session
        self._registry = registry
        self._puller = puller
        self.background = background
        self._prefetches = prefetches
        # Guards _ahead.
        self._lock = threading.Lock()
        self._ahead: _Ahead | None = None

    def begin(self, wanted: NextPull, pull_ahead: bool, out: Mapping[str, Any] | None) -> dict[str, Any]:
        """A step's values: pulled now (into ``out`` when given), or (``pull_ahead``) read in the
        background for it."""
        background = self.background
        background.refuse_unless_async("step(overlap=True)")
        background.raise_failure()
        names = list(wanted.names) if wanted.names is not None else None
        device = wanted.gpu
        if not pull_ahead:
            with self._lock:
                self._ahead = None
            return self._puller.pull(names, device, out)
        if out is not None:
            raise ValueError("step(pull_ahead=True) reads the next step's values while this one computes on "
                             "its own, so they cannot land in the same out= arrays: use out= with "
                             "overlap=True alone")
        with self._lock:
            ahead_missing = self._ahead is None
        if ahead_missing:
            self._collect(background.settle())  # the last step handed nothing off: its job read them
        params = self._take(wanted)
        if params is None:
            params = self._puller.pull(names, device=device)
        if background.idle():
            background.start({}, None, wanted)  # nothing in flight: read the next step's values now
        return params

    def hand_off(self, gradients: Mapping[str, Any], rows: Mapping[str, tuple[Any, Any]] | None,
                 then_pull: NextPull | None) -> PushHandle:
        """Copy the step's gradients and push them in the background (after the job in flight)."""
        self.background.refuse_unless_async("step(overlap=True)")
        self._collect(self.background.settle())
        handle, _ = self.background.start(gradients, rows, then_pull)
        return handle

    def _collect(self, job: Job | None) -> None:
        """Keep the values a finished job read, delivered to their device (in the caller's thread)."""
        if job is None or job.values is None or job.then_pull is None:
            return
        values = self._puller.deliver(job.values, job.then_pull.gpu)
        with self._lock:
            self._ahead = _Ahead(job.thread, job.then_pull, values, job.read_at_generation)

    def _take(self, wanted: NextPull) -> dict[str, Any] | None:
        """The values read ahead if they are this thread's, for ``wanted``, and at most one push old."""
        with self._lock:
            ahead, self._ahead = self._ahead, None
        if ahead is None or ahead.thread != threading.get_ident() or ahead.next_pull != wanted:
            return None
        if self._prefetches.generation - ahead.read_at_generation > 1:
            return None  # more of this client's pushes started since than the step's own
        if wanted.names is None and set(ahead.values) != {v.name for v in self._registry.dense(None)}:
            return None  # variables were created since
        self.session.state.count("prefetched_steps")
        return ahead.values


class OverlappedStep:
    """``with client.step(overlap=True) as step:``: a step whose push goes out in the background.

    ``step.push(grads)`` copies the gradients and returns once the previous
    step's push is confirmed (so at most one is in flight) and this one is
    handed off; ``step.handle`` is its :class:`PushHandle`. Its failure is
    raised by the client's next call. Leaving the block by an exception
    pushes nothing.
    """

    def __init__(self, pipeline: StepPipeline, names: Iterable[str] | None, device: Any,
                 out: Mapping[str, Any] | None, pull_ahead: bool) -> None:
        self._pipeline = pipeline
        self._out = out
        self._wanted = NextPull(tuple(names) if names is not None else None, parse_device(device))
        self._pull_ahead = pull_ahead
        self.params: dict[str, Any] = {}
        self.pushed = False
        self.handle: PushHandle | None = None

    def __enter__(self) -> "OverlappedStep":
        self.params = self._pipeline.begin(self._wanted, self._pull_ahead, self._out)
        return self

    def push(self, gradients: Mapping[str, Any], rows: Mapping[str, tuple[Any, Any]] | None = None) -> None:
        """Hand the gradients, dense and sparse (``rows={table: (ids, grads)}``), to the background."""
        if self.pushed:
            raise RuntimeError("this step already pushed its gradients; start a new step")
        self.handle = self._pipeline.hand_off(gradients, rows, self._wanted if self._pull_ahead else None)
        self.pushed = True

    def __exit__(self, exc_type, *exc_info: object) -> None:
        if exc_type is None and self.pushed:
            self._pipeline.session.finish_step(set())  # async only: the clock advances, nothing is sent
        return None
