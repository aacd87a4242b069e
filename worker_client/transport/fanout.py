"""Sending one request to each of several shards at once.

A pull or push goes to every shard involved in parallel. Small requests
travel over each shard's exchange lane (worker_client.transport.lane): they are all
sent first and their answers read in turn on the calling thread, so the
shards overlap without handing work to a thread per shard (a hand-off
cost about as much as the Python work of a small request, measured with
py-spy). Requests that are large, or whose lane is busy, run on the
executor as ordinary calls. Every request is retried by ``call`` (see
worker_client.transport.retry); a retry of a lane request is a whole new attempt.

Control calls (describe, create, heartbeat, checkpoint, finish) take the same
fan-out through :func:`run_on_shards`: no lane, and no retry beyond their own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from worker_client.transport.channels import PendingExchange, ShardChannel
from worker_client.transport.lane import LaneRefused

__all__ = ["ShardCall", "run_on_shards", "run_shard_calls"]

#: How a call is retried: ``call(shard, what, attempt)`` returns the answer of the attempt that succeeded.
Retrying = Callable[[ShardChannel, str, Callable[[], Any]], Any]


def _as_is(answer: Any) -> Any:
    return answer


@dataclass
class ShardCall:
    """One shard's part of a pull or push, ready to send."""

    shard: ShardChannel
    what: str
    #: One attempt by the ordinary (streaming) call; returns the answer.
    ordinary: Callable[[], Any]
    #: What the caller gets for the answer of the last attempt.
    finish: Callable[[Any], Any] = _as_is
    #: The exchange-lane request when the call is small enough (None: never the lane).
    lane_field: int = 0
    lane_payload: Callable[[], Any] | None = None
    #: Turns the lane's answer into what ``ordinary`` would have returned.
    on_lane_answer: Callable[[Any], Any] = lambda answer: answer
    #: Attempts made so far (a push answered as a duplicate after a retry was
    #: applied by an earlier attempt whose answer was lost).
    attempts: int = 0

    def attempt(self) -> Any:
        """One whole attempt: over the lane when it is free (and the server takes it), else the ordinary call."""
        if self.lane_payload is not None and not self.shard.lane.refused:  # skip building it for nothing
            try:
                answer = self.shard.exchange(self.lane_field, self.lane_payload(), self.what)
            except LaneRefused:
                answer = None  # the stream was refused before it read the request
            if answer is not None:
                return self.on_lane_answer(answer)
        return self.ordinary()

    def run(self, call: Retrying | None, sent: PendingExchange | None = None) -> Any:
        """Attempts through ``call`` (None: one attempt) until one answers; the first may be ``sent``."""
        first = [sent]

        def attempt() -> Any:
            self.attempts += 1
            pending, first[0] = first[0], None
            if pending is not None:
                try:
                    return self.on_lane_answer(pending.result())
                except LaneRefused:
                    pass  # the stream was refused before it read the request: send it otherwise
            return self.attempt()

        return self.finish(attempt() if call is None else call(self.shard, self.what, attempt))


def run_on_shards(shards: Iterable[ShardChannel], fn: Callable[[ShardChannel], Any],
                  executor: Executor) -> dict[int, Any]:
    """``fn(shard)`` on every shard at once; {shard index: result}. Raises the first error by shard order.

    For control calls: ``fn`` retries as it needs to; the first shard's
    runs on this thread.
    """
    return run_shard_calls([ShardCall(shard, "", functools.partial(fn, shard)) for shard in shards], executor)


def run_shard_calls(calls: Iterable[ShardCall], executor: Executor, call: Retrying | None = None,
                    errors: dict[int, BaseException] | None = None) -> dict[int, Any]:
    """Run every call at once; {shard index: result}. Raises the first error by shard order.

    ``call`` retries each call's attempts (None: one attempt each).
    ``errors``, when given, receives every shard's error (not just the one raised).
    """
    calls = list(calls)
    sent: dict[int, PendingExchange] = {}
    for c in calls:
        if c.lane_payload is not None and not c.shard.lane.refused:
            try:
                pending = c.shard.exchange_start(c.lane_field, c.lane_payload(), c.what)
            except Exception:  # noqa: BLE001, S112 - the ordinary path below retries, or raises it again
                continue
            if pending is not None:
                sent[c.shard.index] = pending
    others = [c for c in calls if c.shard.index not in sent]
    # With nothing sent over a lane, the first ordinary call runs on this thread.
    inline = others[0] if others and not sent else None
    futures = {c.shard.index: executor.submit(c.run, call) for c in others if c is not inline}
    results: dict[int, Any] = {}
    errors = {} if errors is None else errors
    # Every sent request is read here, even after an error: each holds its shard's lane.
    for c in calls:
        index = c.shard.index
        if index in sent or c is inline:
            try:
                results[index] = c.run(call, sent.get(index))
            except BaseException as exc:  # noqa: BLE001 - re-raised below, by shard order
                errors[index] = exc
    for index, future in futures.items():
        try:
            results[index] = future.result()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, by shard order
            errors[index] = exc
    if errors:
        raise errors[min(errors)]
    return results
