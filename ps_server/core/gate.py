"""Applies run together; a checkpoint snapshot runs alone.

Every mutation of the store (a chunk applied, a push finalised, a variable
or an initial value installed) holds the gate shared, briefly: a new
variable's values are generated before, outside the gate. A snapshot holds
it exclusive, so the copy it takes of values, optimizer slots, versions and
the exactly-once ledger is one consistent instant. A waiting snapshot stops
new mutations from starting, so it cannot be starved, and the pause it
causes is exactly the time of the in-memory copy.

The final checkpoint of a shutdown seals the gate in the same exclusive
hold as its snapshot: from then on every entry raises SHUTTING_DOWN, so
nothing is applied, and so nothing acknowledged, that the final checkpoint
does not hold. A push still open at that instant is cut off unacknowledged
and its retry completes it against the restarted server.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ps_server.core.errors import RequestError
from wehub_ps.errors import Reason

__all__ = ["ApplyGate"]


class ApplyGate:
    def __init__(self) -> None:
        # Guards _shared, _exclusive, _waiting and _sealed; notified on every release.
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0
        self._sealed = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        """Hold the gate with other mutations; RequestError(SHUTTING_DOWN) once sealed."""
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            if self._sealed:
                raise _sealed_error()
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                if not self._shared:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self, seal: bool = False) -> Iterator[None]:
        """Hold the gate alone; with ``seal``, nobody enters it again after this hold.

        RequestError(SHUTTING_DOWN) once sealed.
        """
        with self._cond:
            self._waiting += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            finally:  # also when interrupted: never leave shared entrants blocked
                self._waiting -= 1
                self._cond.notify_all()
            if self._sealed:
                raise _sealed_error()
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                # Sealed even if the body failed: a failed final snapshot must
                # not let pushes be acknowledged that no checkpoint holds.
                self._sealed = self._sealed or seal
                self._cond.notify_all()

    def seal(self) -> None:
        """Wait for the holders in progress, then refuse every later entry (idempotent)."""
        with self._cond:
            if self._sealed:
                return
        try:
            with self.exclusive(seal=True):
                pass
        except RequestError:
            pass  # another caller sealed it meanwhile

    @property
    def sealed(self) -> bool:
        with self._cond:
            return self._sealed


def _sealed_error() -> RequestError:
    return RequestError(Reason.SHUTTING_DOWN,
                        "this ps-server has written its final checkpoint and is shutting down; nothing more "
                        "is applied here: retry against its replacement")
