"""Keeps one etcd lease alive from a named thread, and knows until when it is surely still valid.

The lease is what lets a primary acknowledge: once it expires, etcd deletes
the primary's keys and another replica may be elected. ``valid_until()`` is
therefore computed from what etcd confirmed, never from what was sent: the
send time of the last confirmed renewal plus the TTL, less a safety margin
for clock drift between this host and etcd's leader. etcd starts the TTL
when it applies the renewal, which is after the send, so the bound holds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ps_server.coordination.errors import CoordinationError
from ps_server.coordination.etcd_client import EtcdClient
from ps_server.coordination.etcd_ops import Lease
from wehub_ps.process.logs import event

__all__ = ["LeaseKeeper", "safety_margin"]

_log = logging.getLogger(__name__)

#: While etcd stays away, one warning per this many seconds.
WARN_EVERY = 5.0


def safety_margin(ttl: float) -> float:
    """Seconds taken off each confirmed renewal: 10% of the TTL plus 50 ms."""
    return 0.1 * ttl + 0.05


class LeaseKeeper:
    """Renews ``lease`` every TTL/4 until stopped or until etcd says the lease is gone.

    ``granted_at``: ``time.monotonic()`` taken just before the grant was sent.
    ``on_lost`` runs once, on the keeper's thread, when etcd reports the
    lease expired or revoked; the keeper then stops. While etcd is
    unreachable it keeps trying, warns at most every ``WARN_EVERY`` seconds,
    and logs when etcd answers again. Thread-safe.
    """

    def __init__(self, client: EtcdClient, lease: Lease, *, granted_at: float, on_lost: Callable[[], None],
                 name: str) -> None:
        self._client = client
        self.lease = lease
        self._on_lost = on_lost
        self._interval = lease.ttl / 4
        self._margin = safety_margin(lease.ttl)
        self._lock = threading.Lock()
        self._valid_until = granted_at + lease.ttl - self._margin
        self._stopped = threading.Event()
        self._lost = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._down_since: float | None = None
        self._last_warning = 0.0

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def valid_until(self) -> float:
        """``time.monotonic()`` before which etcd cannot have expired the lease (in the past once lost)."""
        with self._lock:
            return self._valid_until

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop renewing (the lease then expires after its TTL unless revoked); idempotent."""
        self._stopped.set()
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        wait = self._interval
        while not self._stopped.wait(wait):
            sent = time.monotonic()
            try:
                ttl = self._client.keepalive(self.lease.id, timeout=max(self._interval * 2, 0.2))
            except CoordinationError as error:
                if self._client.closed:  # the process is shutting down
                    return
                self._note_unreachable(error, sent)
                wait = self._interval
                continue
            if self._stopped.is_set():
                return
            if ttl <= 0:
                self._lose()
                return
            with self._lock:
                self._valid_until = max(self._valid_until, sent + ttl - self._margin)
            self._note_reachable()
            wait = max(0.0, self._interval - (time.monotonic() - sent))

    def _note_unreachable(self, error: CoordinationError, now: float) -> None:
        if self._down_since is None:
            self._down_since = now
        if now - self._last_warning < WARN_EVERY:
            return
        self._last_warning = now
        valid_for = self.valid_until() - now
        consequence = ("acknowledgements stop when the lease validity runs out" if valid_for > 0 else
                       "the lease validity has run out: a primary acknowledges nothing until etcd answers")
        event(_log, logging.WARNING, f"etcd unreachable: lease not renewed; no elections are possible, "
              f"{consequence}", lease=f"{self.lease.id:x}", down_seconds=round(now - self._down_since, 3),
              lease_valid_for=round(valid_for, 3), error=str(error))

    def _note_reachable(self) -> None:
        if self._down_since is None:
            return
        down = time.monotonic() - self._down_since
        self._down_since, self._last_warning = None, 0.0
        event(_log, logging.WARNING, "etcd reachable again: lease renewed", lease=f"{self.lease.id:x}",
              down_seconds=round(down, 3))

    def _lose(self) -> None:
        with self._lock:
            self._valid_until = min(self._valid_until, time.monotonic())
        self._lost.set()
        event(_log, logging.ERROR, "etcd reports the lease expired or revoked: this replica left its "
              "replica set and rejoins it as a new member", lease=f"{self.lease.id:x}")
        try:
            self._on_lost()
        except Exception:  # noqa: BLE001 - the keeper's thread must end cleanly
            _log.exception("on_lease_lost callback failed")
