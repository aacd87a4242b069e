"""The one order in which a shard's state changes, for its replicas.

A replicated shard (ps-server --replicas > 1) applies every change in a
total order and ships each to its backups in that order, so they apply the
same changes with the same code and hold the same bits. Most changes are
ordered by the service layer (pushes, variable creation); the one the core
makes on its own is a pull of hash-table rows, which creates missing rows and
refreshes the tables' LRU order, and in sync mode the move of the open step
(applied or jumped over), which a push, a heartbeat or a lease running out
may cause, and an expiry sweep of the tables (its time is the primary's
clock). The pull planner, the consistency controller and the sweeper report those
through :class:`ChangeLog`; an unreplicated shard uses :data:`UNLOGGED`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import numpy as np

__all__ = ["ChangeLog", "UNLOGGED"]


class ChangeLog(Protocol):
    """Where a shard's changes are put in order."""

    def ordered(self) -> AbstractContextManager[None]:
        """Held while a change is applied and logged: no other change comes between."""

    def table_rows_read(self, reads: Sequence[tuple[str, np.ndarray]]) -> None:
        """A pull read these rows (unique int64 ids) of these hash tables, creating missing ones."""

    def sync_step(self, step: int, applied: bool) -> None:
        """Under ``ordered``: the open sync step became ``step`` (``applied``: the one before was applied)."""

    def rows_expired(self, now: float, tables: Sequence[tuple[str, np.ndarray]]) -> None:
        """Under ``ordered``: an expiry sweep at ``now`` removed these rows (sorted ids) of these tables
        and stamped their rows updated since the last sweep."""


class _Unlogged:
    """An unreplicated shard: changes need no order beyond their locks."""

    def ordered(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def table_rows_read(self, reads: Sequence[tuple[str, np.ndarray]]) -> None:
        return None

    def sync_step(self, step: int, applied: bool) -> None:
        return None

    def rows_expired(self, now: float, tables: Sequence[tuple[str, np.ndarray]]) -> None:
        return None


UNLOGGED: ChangeLog = _Unlogged()
