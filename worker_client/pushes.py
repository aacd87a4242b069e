"""The push path: gradients to per-shard items, sending, outcomes, and top-k settlement.

:class:`Pushes` turns the caller's gradients into each shard's items
(checked before anything is sent), and with top-k settles the residual by
what each shard did with its push. :class:`PushSender` sends one push per
shard at once, each retried as the same push (same sequence, same chunks),
so a server applies it at most once, and records what became of each.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from wehub_ps.kernels.groups import sum_groups
from wehub_ps.kernels.rowops import RowGather, take_rows
from wehub_ps.process import allocator
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.arrays import as_wire_array
from wehub_ps.wire.codec import EXCHANGE_PUSH, join_pieces, split_push_response
from worker_client.arrays import check_array, check_ids, is_gpu_array, parse_device, to_host
from worker_client.errors import InvalidArgumentError, PSError, PSUnavailableError, PushWrittenOffError
from worker_client.gpu import LazyGpuTransfers
from worker_client.id_groups import grouped_ids
from worker_client.prefetch import NextPull, Prefetch, Prefetches
from worker_client.pull_receiver import PullReceiver
from worker_client.pulls import Puller
from worker_client.push_framing import PushFramer, PushItem, ShardPush
from worker_client.registry import Registry, Variable, rows_by_shard
from worker_client.session import Session
from worker_client.topk import TopKRows
from worker_client.transport.fanout import ShardCall

__all__ = ["PushOutcome", "PushSender", "Pushes"]

log = logging.getLogger("worker_client")

_FLOAT16_MAX = float(np.finfo(np.float16).max)


@dataclass
class PushOutcome:
    """What became of each shard's push of one push() call."""

    sent: dict[int, ShardPush] = field(default_factory=dict)
    delivered: set[int] = field(default_factory=set)
    failed: dict[int, BaseException] = field(default_factory=dict)


def may_complete_later(error: BaseException | None) -> bool:
    """Whether the same push, sent again, can still complete: the shard did not answer (or was cut off)."""
    return not isinstance(error, PSError) or isinstance(error, PSUnavailableError)


def refused_whole(error: BaseException | None) -> bool:
    """Whether the shard refused the push, so none of it was applied.

    A server refuses a push before it applies anything. A push written off
    by the shard's ledger may be partly applied and is not counted here.
    """
    return error is not None and not may_complete_later(error) and not isinstance(error, PushWrittenOffError)


def check_fits_wire(values: np.ndarray, wire_dtype: np.dtype | None, what: str) -> None:
    """Refuse finite gradient values that float16 on the wire cannot hold.

    The cast would turn them into ±inf, and the optimizer would then make the
    variable inf or NaN for good, with nothing reported. NaN and ±inf given
    by the caller are sent as they are (as with float32 on the wire).
    Two reductions over the gradient; only with ``wire_dtype="float16"``.
    """
    if wire_dtype != np.float16 or values.dtype.itemsize <= 2 or not values.size:
        return
    flat = values.reshape(-1)
    low, high = float(np.fmin.reduce(flat)), float(np.fmax.reduce(flat))  # NaN is skipped
    if max(-low, high) <= _FLOAT16_MAX:
        return
    if not (math.isfinite(low) and math.isfinite(high)):  # ±inf given: is a finite value too large as well?
        finite_too_large = np.isfinite(flat) & (np.abs(flat) > _FLOAT16_MAX)
        if not finite_too_large.any():
            return
        low = high = float(flat[np.argmax(finite_too_large)])
    worst = high if high > _FLOAT16_MAX else low
    raise InvalidArgumentError(
        f"{what} holds {worst:g}, beyond {_FLOAT16_MAX:g}, the largest float16: with wire_dtype='float16' it "
        "would arrive as inf and ruin the variable; nothing was sent. Scale or clip the gradient, or use "
        "wire_dtype='bfloat16' (float32's range)")


class PushSender:
    """Sends one push per shard at once; thread-safe.

    With a prefetch, each shard also answers the values it lists
    (PushBegin.pull_after); they are kept for this thread's next step.
    """

    def __init__(self, session: Session, framer: PushFramer, prefetches: Prefetches, use_lane: bool) -> None:
        self._session = session
        self.framer = framer
        self._prefetches = prefetches
        self._use_lane = use_lane

    def assign(self, by_shard: dict[int, list[PushItem]]) -> set[int]:
        """Explicit initial values (kind ASSIGN)."""
        return self.send(by_shard, ps_pb2.ASSIGN)

    def send(self, by_shard: dict[int, list[PushItem]], kind: int, prefetch: Prefetch | None = None,
             outcome: PushOutcome | None = None) -> set[int]:
        """Push to every shard in ``by_shard`` at once; returns the shards pushed to.

        ``outcome`` records each shard's push as sent, and which shards
        confirmed it or failed, also when one fails.
        """
        pushes = {i: self._new_shard_push(i, by_shard[i], kind, prefetch) for i in sorted(by_shard)}
        self.run(pushes, prefetch, outcome)
        return set(by_shard)

    def _new_shard_push(self, shard_index: int, items: list[PushItem], kind: int,
                        prefetch: Prefetch | None) -> ShardPush:
        # The sequence is taken once: every retry resends the same push,
        # chunked the same way, so the server applies it exactly once.
        sequence, base_versions, step = self._session.state.push_header(shard_index, items)
        if prefetch is None or shard_index not in prefetch.by_shard:
            return ShardPush(shard_index, items, kind, sequence, base_versions, step)
        return ShardPush(shard_index, items, kind, sequence, base_versions, step,
                         prefetch.requests[shard_index], prefetch.by_shard[shard_index])

    def run(self, pushes: dict[int, ShardPush], prefetch: Prefetch | None,
            outcome: PushOutcome | None) -> None:
        """Send ``pushes`` (one per shard) at once, each retried as one push (see _call)."""
        generation = self._prefetches.push_started()
        if outcome is not None:
            outcome.sent.update(pushes)
        results = self._session.run_calls((self._call(push, outcome) for push in pushes.values()),
                                          outcome.failed if outcome is not None else None)
        if prefetch is not None and all(results.get(s, False) for s in prefetch.by_shard):
            self._prefetches.keep(prefetch, generation)

    def _call(self, push: ShardPush, outcome: PushOutcome | None = None) -> ShardCall:
        """One shard's push; its result is True when it also brought back ``push.after``'s values."""
        session = self._session
        shard = session.shards[push.shard_index]
        ticket = session.state.take_ticket()
        receiver = PullReceiver(shard.address, push.after) if push.after else None
        framer = self.framer

        def ordinary() -> bytes:
            # Each message is joined before the generator converts the next chunk.
            messages = (join_pieces(pieces) for pieces in framer.messages(push))
            return shard.push(messages, session.data_timeout)

        def finish(answer: bytes | memoryview) -> bool:
            response, pulled = split_push_response(answer)
            if outcome is not None:
                outcome.delivered.add(shard.index)  # applied, whatever happens to the values riding back
            if response.duplicate and this_call().attempts > 1:
                session.state.count("duplicate_acks")
            session.state.record_versions(shard, {e.variable: e.version for e in response.versions}, ticket)
            session.note_cluster_step(response.cluster_step, response.dropped)
            if receiver is None or pulled is None:
                return False  # no values asked for, or a server that predates pull_after
            receiver.take_chunks(pulled)
            receiver.check_complete()
            session.state.record_versions(shard, receiver.versions, ticket)
            return True

        small = self._use_lane and framer.fits_one_message(push.items)
        call = ShardCall(shard, "push", ordinary, finish, EXCHANGE_PUSH,
                         (lambda: framer.one_message(push)) if small else None)
        # Weak: the call holds ``finish``, and a strong reference back would make a cycle that keeps the
        # pushed arrays alive (through ``ordinary``) until Python's cyclic collector runs, steps later.
        # The heap then grows by a whole step's gradients at a time and freed memory goes back to the
        # kernel in bursts, to be faulted in again (docs/benchmarks.md, "Training loops").
        this_call = weakref.ref(call)
        return call


class Pushes:
    """push() and Step.push for one client: checking, splitting by shard, sending, top-k settlement.

    ``topk``: with a ratio, dense gradients go as their largest rows and the
    rest waits in the residual (worker_client.topk). ``prefetch``: a step's
    push brings the next step's values back (asynchronous mode, lane only).
    """

    def __init__(self, session: Session, registry: Registry, sender: PushSender, puller: Puller,
                 gpu: LazyGpuTransfers, wire_dtype: np.dtype | None, topk: TopKRows | None,
                 prefetch: bool, use_lane: bool) -> None:
        self._session = session
        self._registry = registry
        self._sender = sender
        self._puller = puller
        self._gpu = gpu
        self._wire_dtype = wire_dtype
        self.topk = topk
        self._prefetch = prefetch and use_lane
        #: Top-k: per shard, the push it did not confirm, sent again before the next one
        #: (guarded by the compressor's pushing(); see _push_topk).
        self.unfinished: dict[int, ShardPush] = {}

    def push_step(self, gradients: Mapping[str, Any], rows: Mapping[str, tuple[Any, Any]] | None,
                  names: list[str] | None, device: Any) -> set[int]:
        """Step.push: the push and, riding on it, the next step's pull (see Puller.take_prefetched).

        In asynchronous mode, when the step's variables are small enough for
        the exchange lane and live on shards this push goes to, each shard
        answers the push with the values right after applying it
        (``PushBegin.pull_after``): a step costs one round trip per shard
        instead of two. Otherwise the next step pulls as usual.
        """
        next_pull = None
        if self._prefetch and self._session.consistency == "async":
            next_pull = NextPull(tuple(names) if names is not None else None, parse_device(device))
        return self.push(gradients, rows, next_pull)

    def push(self, gradients: Mapping[str, Any], rows: Mapping[str, tuple[Any, Any]] | None,
             next_pull: NextPull | None = None) -> set[int]:
        """PSClient.push; with ``next_pull``, the push also brings back those values."""
        if not isinstance(gradients, Mapping):
            raise TypeError(f"gradients must be a mapping name -> array, got {type(gradients).__name__}")
        rows = dict(rows or {})
        if not gradients and not rows:
            return set()
        variables = {v.name: v for v in self._registry.resolve([*gradients, *rows])}
        by_shard: dict[int, list[PushItem]] = {}
        # Top-k: rows chosen from dense gradients, and the gradients they came from.
        selected: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        chosen_from: dict[str, np.ndarray] = {}
        with self.topk.pushing() if self.topk is not None else contextlib.nullcontext():
            # Everything is checked (and the rows chosen) before anything is sent or settled:
            # a bad argument changes neither the residual nor the servers.
            self._add_dense(gradients, variables, rows, by_shard, selected, chosen_from)
            for name, pair in rows.items():
                if not isinstance(pair, tuple) or len(pair) != 2:
                    raise TypeError(f"rows[{name!r}] must be a tuple (ids, gradients), "
                                    f"got {type(pair).__name__}")
            for name, pair in [*rows.items(), *selected.items()]:
                for shard, item in self._row_items(variables[name], *pair).items():
                    by_shard.setdefault(shard, []).append(item)
            # A training step allocates and frees its gradients (and values) each step: keep that much
            # freed heap for the next one rather than faulting it in again (wehub_ps.process.allocator).
            allocator.keep_room_for_step(sum(item.values.nbytes for items in by_shard.values() for item in items
                                             if isinstance(item.values, np.ndarray)))
            if self.topk is None:
                return self._sender.send(by_shard, ps_pb2.GRADIENT, self._plan_prefetch(by_shard, next_pull))
            return self._push_topk(by_shard, variables, selected, chosen_from, next_pull)

    def _plan_prefetch(self, by_shard: dict[int, list[PushItem]],
                       next_pull: NextPull | None) -> Prefetch | None:
        return self._puller.plan_prefetch(by_shard, next_pull, self._sender.framer.fits_one_message)

    def _push_topk(self, by_shard: dict[int, list[PushItem]], variables: dict[str, Variable],
                   selected: dict[str, tuple[np.ndarray, np.ndarray]], chosen_from: dict[str, np.ndarray],
                   next_pull: NextPull | None) -> set[int]:
        """Send a top-k push (the caller holds ``self.topk.pushing()``) and settle the residual.

        Every gradient given to push() is taken into the residual; the rows
        sent are owed nothing once the shard that holds them applied them.
        A shard that did not answer (PSUnavailableError) may have applied
        part of its push: that push is kept, with its sequence, and the next
        push first sends it again, so the shard's ledger completes exactly
        what is missing (never a row twice, never a row lost). A shard that
        refused its push applied none of it: its rows are owed again.
        """
        topk = self.topk
        nothing = np.empty(0, dtype=np.int64)
        try:
            self._finish_unfinished_pushes()
        except BaseException:
            for name in selected:  # nothing of this push was sent: its gradient is owed whole
                topk.settle(name, chosen_from[name], nothing)
            raise
        outcome = PushOutcome()
        try:
            prefetch = self._plan_prefetch(by_shard, next_pull)
            shards = self._sender.send(by_shard, ps_pb2.GRADIENT, prefetch, outcome)
        except BaseException:
            refused = {shard for shard in by_shard
                       if shard not in outcome.sent or refused_whole(outcome.failed.get(shard))}
            pending = {shard for shard in by_shard if shard not in outcome.delivered and shard not in refused
                       and may_complete_later(outcome.failed.get(shard))}
            num_shards = self._session.num_shards
            for name, (ids, sent_rows) in selected.items():
                back = [at for shard, at in rows_by_shard(variables[name], ids, num_shards).items()
                        if shard in refused]
                owed_again = np.concatenate([np.arange(len(ids))[at] for at in back]) if back else nothing
                topk.settle(name, chosen_from[name], ids, ids[owed_again], sent_rows[owed_again])
            for shard in pending:
                if any(item.name in selected for item in by_shard[shard]):
                    self.unfinished[shard] = outcome.sent[shard].detached()
            raise
        for name, (ids, _) in selected.items():
            topk.settle(name, chosen_from[name], ids)
        return shards

    def _finish_unfinished_pushes(self) -> None:
        """Send again, unchanged, the top-k pushes a shard did not confirm (see :meth:`_push_topk`).

        Raises like a push when one still fails; a shard that refuses one, or
        whose ledger wrote it off, will never complete it: it is dropped.
        """
        if not self.unfinished:
            return
        outcome = PushOutcome()
        try:
            self._sender.run(dict(self.unfinished), None, outcome)
        finally:
            for shard in list(self.unfinished):
                error = outcome.failed.get(shard)
                if shard in outcome.delivered or (error is not None and not may_complete_later(error)):
                    if shard not in outcome.delivered:
                        address = self._session.shards[shard].address
                        log.warning("a top-k push sent again was refused by ps-server %s; its rows are "
                                    "dropped: %s", address, error,
                                    extra={"fields": {"address": address, "error": str(error)}})
                    del self.unfinished[shard]

    def _add_dense(self, gradients: Mapping[str, Any], variables: dict[str, Variable],
                   rows: Mapping[str, Any], by_shard: dict[int, list[PushItem]],
                   selected: dict[str, tuple[np.ndarray, np.ndarray]],
                   chosen_from: dict[str, np.ndarray]) -> None:
        """Each dense gradient's parts into ``by_shard``; with top-k, its chosen rows into ``selected``."""
        # Every GPU gradient is copied out at once: one wait for them all, not one per variable.
        on_gpu = {name: g for name, g in gradients.items() if type(g) is not np.ndarray and is_gpu_array(g)}
        downloaded = self._gpu.get().download_all(on_gpu, f"push:{threading.get_ident()}") if on_gpu else {}
        topk, wire_dtype = self.topk, self._wire_dtype
        for name, grad in gradients.items():
            spec = variables[name].spec
            if spec.hash_table:
                raise InvalidArgumentError(
                    f"{name!r} is a hash table: send its rows with rows={{name: (ids, grads)}}")
            host = downloaded[name] if name in downloaded else self._host(grad, f"gradients[{name!r}]", name)
            check_array(host, spec.shape, spec.dtype, f"gradient for {name!r}")
            if topk is not None and spec.shape:
                if name in rows:
                    raise InvalidArgumentError(f"{name!r} is in both gradients and rows: push it once")
                selected[name] = topk.choose(name, host)  # its largest rows go as rows
                chosen_from[name] = host
                continue
            check_fits_wire(host, wire_dtype, f"gradient for {name!r}")
            flat = as_wire_array(host)  # a narrower wire dtype is applied chunk by chunk when sending
            for shard, first, end in variables[name].element_ranges:
                by_shard.setdefault(shard, []).append(PushItem(name, flat[first:end]))

    def _row_items(self, variable: Variable, ids: Any, gradients: Any) -> dict[int, PushItem]:
        """Per shard, the summed gradients of the unique rows it holds."""
        spec = variable.spec
        ids = check_ids(ids, "ids")
        row_shape = spec.shape if spec.hash_table else spec.shape[1:]
        host = self._host(gradients, "gradients", spec.name)
        check_array(host, (len(ids), *row_shape), spec.dtype, f"gradients for {spec.name!r}")
        width = spec.row_elements
        rows = as_wire_array(host).reshape(len(ids), width)  # C-contiguous, little-endian
        groups = grouped_ids(ids)
        unique = groups.unique
        if not groups.repeats:
            # No id repeats: the rows are gathered in id order straight into each message.
            summed: np.ndarray | RowGather = RowGather(rows, groups.order)
            check_fits_wire(rows, self._wire_dtype, f"gradient for rows of {spec.name!r}")
        else:
            summed = sum_groups(rows, groups.inverse, len(unique))
            check_fits_wire(summed, self._wire_dtype, f"gradient for rows of {spec.name!r} (repeats summed)")
        items = {}
        for shard, positions in rows_by_shard(variable, unique, self._session.num_shards).items():
            part: np.ndarray | RowGather
            if isinstance(summed, RowGather):
                part = summed.select(positions)
            elif isinstance(positions, slice):  # a dense part's rows: a view
                part = summed[positions].reshape(-1)
            else:  # a hash table's rows: gathered
                part = take_rows(summed, positions).reshape(-1)
            row_ids = unique[positions].astype("<i8", copy=False).tobytes()
            items[shard] = PushItem(spec.name, part, row_ids, width)
        return items

    def _host(self, array: Any, argument: str, name: str) -> np.ndarray:
        """Host memory for a gradient: GPU arrays go through this thread's pinned buffer for ``name``."""
        if is_gpu_array(array):
            return self._gpu.get().download_all({name: array}, f"push:{threading.get_ident()}")[name]
        return to_host(array, argument)
