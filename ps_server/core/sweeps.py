"""Expiry sweeps of a shard's hash tables, in the shard's one order of changes.

A sweep removes the rows its tables' expiry rules find due and stamps the
rows updated since the last sweep (ps_server.core.row_policies). It is a
change like a push: the primary takes the time from its clock, applies the
sweep and logs it under the order (:class:`ChangeLog`), and each backup
applies the logged sweep, the same ids with the same time, at the same place
among the other changes. A backup never sweeps on its own.
"""

from __future__ import annotations

import logging
import threading
import time

from ps_server.core.errors import RequestError
from ps_server.core.ordering import ChangeLog
from ps_server.core.store import VariableStore
from wehub_ps.errors import Reason
from wehub_ps.process.logs import event

__all__ = ["ExpirySweeper"]

log = logging.getLogger(__name__)


class ExpirySweeper:
    """Sweeps the store's tables with expiry every ``interval`` seconds on its own thread."""

    def __init__(self, store: VariableStore, changes: ChangeLog, interval: float) -> None:
        self._store = store
        self._changes = changes
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sweep(self, now: float | None = None) -> int:
        """One sweep at ``now`` (default: the clock); the rows it removed. NOT_PRIMARY on a backup."""
        now = time.time() if now is None else now
        with self._changes.ordered():
            swept = self._store.sweep_expiry(now)
            if swept:
                self._changes.rows_expired(now, swept)
        removed = sum(len(ids) for _, ids in swept)
        if removed:
            event(log, logging.DEBUG, "rows expired", rows=removed, tables=len(swept))
        return removed

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ps-expiry", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if not self._store.has_expiry():
                continue
            try:
                self.sweep()
            except RequestError as error:
                if error.reason != Reason.NOT_PRIMARY:  # a backup: the primary sweeps
                    event(log, logging.WARNING, "expiry sweep failed", error=str(error))
