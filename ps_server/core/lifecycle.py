"""Accepting work, and draining it on shutdown.

A ps-server is ``starting`` (transport up, checkpoint being restored),
then ``accepting``, then ``draining`` (after SIGTERM or finish()). While
starting, every RPC but health is refused: the state they would read or
change is not there yet. While draining, new work is refused and the pushes
in flight get until the drain timeout to finish; those still open then are
cut off by the store's apply gate, sealed with the final checkpoint (see
:class:`ps_server.core.gate.ApplyGate`). This object counts pushes in flight and
answers "are we ready / still accepting"; it knows nothing about gRPC.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

from ps_server.core.errors import RequestError
from wehub_ps.errors import Reason

__all__ = ["Lifecycle"]


class Lifecycle:
    """starting (restoring; refuses work) -> accepting -> draining (refuses work)."""

    def __init__(self) -> None:
        # Guards _state and _in_flight; notified when _in_flight drops.
        self._cond = threading.Condition()
        self._state = "starting"
        self._in_flight = 0

    @property
    def _accepting(self) -> bool:
        return self._state == "accepting"

    def open(self) -> None:
        """Ready: start accepting work."""
        with self._cond:
            if self._state == "starting":
                self._state = "accepting"

    @property
    def accepting(self) -> bool:
        with self._cond:
            return self._accepting

    def check_ready(self) -> None:
        """Raise SHUTTING_DOWN (UNAVAILABLE) while the checkpoint is being restored.

        For calls that only read state (Describe): they are answered while
        draining, where the state is real, but never before it is restored.
        """
        with self._cond:
            if self._state == "starting":
                raise _refusal(self._state)

    def check_accepting(self) -> None:
        """Raise SHUTTING_DOWN (UNAVAILABLE) while restoring and once draining started."""
        with self._cond:
            if not self._accepting:
                raise _refusal(self._state)

    @contextmanager
    def push_in_flight(self) -> Iterator[None]:
        """Count a push for the drain; refuses when the server is shutting down."""
        with self._cond:
            if not self._accepting:
                raise _refusal(self._state)
            self._in_flight += 1
        try:
            yield
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    @property
    def in_flight(self) -> int:
        with self._cond:
            return self._in_flight

    def drain(self, timeout: float) -> bool:
        """Stop accepting; wait up to ``timeout`` s for pushes in flight. True if none is left."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._state = "draining"
            while self._in_flight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True


def _refusal(state: str) -> RequestError:
    if state == "starting":
        return RequestError(Reason.SHUTTING_DOWN,
                            "this ps-server is restoring its checkpoint and not ready yet; retry shortly")
    return RequestError(Reason.SHUTTING_DOWN,
                        "this ps-server is shutting down; retry against its replacement")
