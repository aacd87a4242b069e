"""Retrying calls that may safely be repeated, and saying why we wait.

Every RPC of the client is safe to repeat: describe and pull read,
create is idempotent, and a push carries (worker, incarnation, sequence) so
the server applies it once however often it arrives. So on UNAVAILABLE or
DEADLINE_EXCEEDED (a server restarting, a connection cut) the client backs
off exponentially with full jitter and tries again, up to ``timeout``
seconds in total: a restarting ps-server makes workers wait, not crash.
Waiting is never silent: past ``warn_after`` seconds each retry logs which
server it waits for, in which call, and the last error, at most every
``warn_every`` seconds; the text says it all (a plain
``logging.basicConfig()`` shows it) and the same values are in the
record's structured ``fields``. A caller
may name other errors worth waiting out the same way (``also_retry``: the
client's refused bearer token while its token file may still be rotated).

Replicated shards: ``before_retry(error)`` runs before each retry with the
error that failed, so the caller can move to another replica (the one a
NOT_PRIMARY refusal names, see ShardChannel.follow). The first such refusal
that names the primary is retried at once: the primary is known and
a backoff would only add latency to a failover. Later ones back off as
usual, so replicas that point at each other (an election under way) are not
asked in a tight loop.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from worker_client.errors import NotPrimaryError, PSError, PSUnavailableError

__all__ = ["RetryPolicy", "call_with_retry"]

log = logging.getLogger("worker_client")

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    timeout: float = 300.0
    initial_backoff: float = 0.05
    max_backoff: float = 3.0
    warn_after: float = 10.0
    warn_every: float = 10.0
    #: The client argument that sets ``timeout``, named in the warning and the final error.
    timeout_setting: str = "retry_timeout"

    def __post_init__(self) -> None:
        for name in ("timeout", "initial_backoff", "max_backoff", "warn_after", "warn_every"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"retry {name} must be a number >= 0, got {value!r}")


def call_with_retry(call: Callable[[], T], policy: RetryPolicy, what: str, address: str | Callable[[], str],
                    on_retry: Callable[[], None] | None = None,
                    sleep: Callable[[float], None] = time.sleep,
                    also_retry: Callable[[PSError], bool] | None = None,
                    before_retry: Callable[[PSError], object] | None = None) -> T:
    """``call()``, retried on PSUnavailableError until ``policy.timeout`` has passed.

    ``also_retry(error)`` True: retry that error too (same backoff and
    timeout); when time runs out it is raised as its own type.
    ``before_retry(error)`` runs before each retry, with the error of the
    attempt that failed. Warnings name ``address``: the server, or a callable
    that says which one the calls go to (a replicated shard's may change).
    """
    started = time.monotonic()
    backoff = policy.initial_backoff
    attempts = 0
    last_warning = -float("inf")
    followed_hint = False
    while True:
        attempts += 1
        try:
            return call()
        except PSError as error:
            retryable = isinstance(error, PSUnavailableError) or (also_retry is not None and also_retry(error))
            if not retryable:
                raise
            waited = time.monotonic() - started
            if waited >= policy.timeout:
                hint = {"primary": error.primary} if isinstance(error, NotPrimaryError) else {}
                raise type(error)(
                    f"{error} — gave up after {attempts} attempts over {waited:.1f}s "
                    f"({policy.timeout_setting} {policy.timeout:g}s)", address=error.address,
                    reason=error.reason, code=error.code, **hint) from error
            if waited >= policy.warn_after and waited - last_warning >= policy.warn_every:
                last_warning = waited
                server = address() if callable(address) else address
                log.warning("waiting for ps-server %s (call %s): %d attempts over %.1fs, giving up after %gs "
                            "(%s); last error: %s", server, what, attempts, waited, policy.timeout,
                            policy.timeout_setting, error, extra={"fields": {
                                "address": server, "call": what, "waited_seconds": round(waited, 1),
                                "attempts": attempts, "error": str(error), "gives_up_after": policy.timeout}})
            if on_retry is not None:
                on_retry()
            if before_retry is not None:
                before_retry(error)
            if isinstance(error, NotPrimaryError) and error.primary and not followed_hint:
                followed_hint = True
                continue  # the primary is named: ask it now
            delay = min(random.uniform(0, backoff), policy.timeout - waited)
            sleep(max(0.0, delay))
            backoff = min(policy.max_backoff, backoff * 2)
