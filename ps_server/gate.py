"""Applies run together; a checkpoint snapshot runs alone.

Every mutation of the store (a chunk applied, a push finalised, a variable
created) holds the gate shared; a snapshot holds it exclusive, so the copy
it takes of values, optimizer slots, versions and the exactly-once ledger
is one consistent instant. A waiting snapshot stops new mutations from
starting, so it cannot be starved, and the pause it causes is exactly the
time of the in-memory copy.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["ApplyGate"]


class ApplyGate:
    def __init__(self) -> None:
        # Guards _shared, _exclusive and _waiting; notified on every release.
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                if not self._shared:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            finally:  # also when interrupted: never leave shared entrants blocked
                self._waiting -= 1
                self._cond.notify_all()
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()
