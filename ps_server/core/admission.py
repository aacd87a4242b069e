"""How many calls a server serves at once: ordinary calls and long-lived streams apart.

Every client keeps one Exchange stream per server open for its whole life
(worker_client.transport.lane). If those streams counted against the same bound as
every other call, N idle clients would hold all N slots and lock out the
next client's Describe, Heartbeat and Checkpoint. So the two have their own
bounds: ``--max-concurrent-rpcs`` ordinary calls (pulls, pushes, control
calls) and ``--max-exchange-streams`` Exchange streams, of which one worker
incarnation may hold at most :data:`STREAMS_PER_INCARNATION` (so a client
that leaks streams cannot take the others' share). A stream over its bound
is refused at once with EXCHANGE_STREAMS (the client then uses ordinary
calls); an ordinary call over its bound gets TOO_MANY_RPCS. Both are
RESOURCE_EXHAUSTED and change nothing.

No gRPC here; thread-safe.
"""

from __future__ import annotations

import threading

from ps_server.core.errors import RequestError
from wehub_ps.errors import Reason

__all__ = ["Admission", "STREAMS_PER_INCARNATION", "EXTRA_TRANSPORT_SLOTS"]

#: A client replaces its stream now and then (and after every break); the
#: server may not have seen the old one end yet when the new one arrives.
STREAMS_PER_INCARNATION = 2
#: gRPC's own bound is ours plus this: health checks and reflection (not
#: counted here) and calls being refused still get a thread.
EXTRA_TRANSPORT_SLOTS = 8


class Admission:
    """Counts ordinary calls and Exchange streams in progress; refuses what is over a bound."""

    def __init__(self, max_calls: int, max_streams: int,
                 streams_per_incarnation: int = STREAMS_PER_INCARNATION) -> None:
        self.max_calls = max_calls
        self.max_streams = max_streams
        self._per_incarnation = streams_per_incarnation
        # Guards _calls, _streams and _by_incarnation.
        self._lock = threading.Lock()
        self._calls = 0
        self._streams = 0
        self._by_incarnation: dict[str, int] = {}

    @property
    def transport_slots(self) -> int:
        """What the gRPC server's own concurrency bound (and thread pool) must allow."""
        return self.max_calls + self.max_streams + EXTRA_TRANSPORT_SLOTS

    def enter_call(self) -> None:
        """Take an ordinary call's slot; RequestError(TOO_MANY_RPCS) when none is free."""
        with self._lock:
            if self._calls >= self.max_calls:
                raise RequestError(
                    Reason.TOO_MANY_RPCS,
                    f"this ps-server is serving {self._calls} calls, its limit (--max-concurrent-rpcs "
                    f"{self.max_calls}); retry later or raise the limit")
            self._calls += 1

    def exit_call(self) -> None:
        with self._lock:
            self._calls -= 1

    def enter_stream(self, incarnation: str) -> None:
        """Take an Exchange stream's slot; RequestError(EXCHANGE_STREAMS) when over a bound.

        ``incarnation`` (the worker process the stream belongs to, from the
        call's metadata; "" when the client did not say) is bounded on its own.
        """
        with self._lock:
            if self._streams >= self.max_streams:
                raise RequestError(
                    Reason.EXCHANGE_STREAMS,
                    f"this ps-server holds {self._streams} exchange streams, its limit "
                    f"(--max-exchange-streams {self.max_streams}); use ordinary calls (the worker client "
                    "does so by itself)")
            held = self._by_incarnation.get(incarnation, 0)
            if incarnation and held >= self._per_incarnation:
                raise RequestError(
                    Reason.EXCHANGE_STREAMS,
                    f"worker incarnation {incarnation} already holds {held} exchange streams on this "
                    "ps-server, the most one worker process may; use ordinary calls")
            self._streams += 1
            if incarnation:
                self._by_incarnation[incarnation] = held + 1

    def exit_stream(self, incarnation: str) -> None:
        with self._lock:
            self._streams -= 1
            if incarnation:
                left = self._by_incarnation[incarnation] - 1
                if left:
                    self._by_incarnation[incarnation] = left
                else:
                    del self._by_incarnation[incarnation]
