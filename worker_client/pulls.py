"""The pull path: whole variables, rows of a table, and values a push brought back.

Each shard involved is asked at once (worker_client.transport.fanout);
its answer is written chunk by chunk straight into the result
(worker_client.pull_receiver). Small pulls ride the shard's exchange lane.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from wehub_ps.kernels.rowops import take_rows
from wehub_ps.v1.ps_pb2 import ROW_LOOKUP_CREATE
from wehub_ps.wire.codec import EXCHANGE_PULL
from wehub_ps.wire.dtypes import to_wire_dtype
from worker_client.arrays import check_array, check_ids, parse_device, to_device
from worker_client.gpu import LazyGpuTransfers
from worker_client.id_groups import IdGroups, grouped_ids
from worker_client.out_arrays import OutArrays, check_out_arrays
from worker_client.prefetch import NextPull, Prefetch, Prefetches
from worker_client.pull_receiver import PullItem, PullReceiver, pull_request
from worker_client.registry import Registry, Variable, rows_by_shard
from worker_client.session import Session
from worker_client.transport.channels import ShardChannel
from worker_client.transport.fanout import ShardCall

__all__ = ["Puller"]


class Puller:
    """Pulls for one client; thread-safe.

    ``wire_dtype``: values are asked for in it (the servers convert);
    ``use_lane``: small pulls use each shard's exchange lane.
    """

    def __init__(self, session: Session, registry: Registry, gpu: LazyGpuTransfers, prefetches: Prefetches,
                 wire_dtype: np.dtype | None, use_lane: bool) -> None:
        self._session = session
        self._registry = registry
        self._gpu = gpu
        self._prefetches = prefetches
        self._wire_dtype = wire_dtype
        self._wire = to_wire_dtype(wire_dtype) if wire_dtype is not None else 0
        self._use_lane = use_lane

    # ---- whole variables ----

    def pull(self, names: Iterable[str] | str | None, device: Any = None,
             out: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """PSClient.pull: current values, into ``out`` when given, on ``device`` when given."""
        gpu = parse_device(device)
        return self.pull_into(self.out_arrays(names, gpu, out), gpu)

    def out_arrays(self, names: Iterable[str] | str | None, gpu: int | None,
                   out: Mapping[str, Any] | None) -> tuple[list[Variable], OutArrays]:
        """The variables a pull of ``names`` reads, and ``out`` checked against them (nothing pulled yet)."""
        if out and gpu is not None:
            raise ValueError("pull: out= arrays say where each value goes; do not combine it with device=")
        variables = self._registry.dense(names)
        return variables, check_out_arrays(out, {v.name: (v.shape, v.dtype) for v in variables})

    def pull_into(self, checked: tuple[list[Variable], OutArrays], gpu: int | None) -> dict[str, Any]:
        """Pull the variables of :meth:`out_arrays` into its checked arrays (the others onto ``gpu``/host)."""
        variables, outs = checked
        received, by_shard = self.targets(variables, gpu, self._receive_into(outs))
        self.pull_all(by_shard)
        if outs.device:
            self._gpu.get().upload_into(received, outs.device)
        return outs.returned(self.deliver(received, gpu))

    def _receive_into(self, outs: OutArrays) -> dict[str, np.ndarray]:
        """Host memory for the ``out=`` arrays: the host arrays themselves, pinned buffers for CUDA ones."""
        if not outs.device:
            return outs.host
        transfers = self._gpu.get()
        pinned = {name: transfers.pinned(f"pull:{threading.get_ident()}:{name}", array.shape,
                                         np.dtype(array.dtype))
                  for name, array in outs.device.items()}
        return {**outs.host, **pinned}

    def targets(self, variables: list[Variable], gpu: int | None, given: Mapping[str, np.ndarray]
                ) -> tuple[dict[str, np.ndarray], dict[int, list[PullItem]]]:
        """Host arrays to receive into, and what each shard sends into which part of them.

        For a GPU the arrays are this thread's pinned buffers (uploaded on the
        device's stream by :meth:`deliver`).
        """
        transfers = self._gpu.get() if gpu is not None else None
        out = {}
        for v in variables:
            if v.name in given:
                check_array(given[v.name], v.shape, v.dtype, f"out[{v.name!r}]")
                out[v.name] = given[v.name]
            elif transfers is None:
                out[v.name] = np.empty(v.shape, dtype=v.dtype)
            else:
                out[v.name] = transfers.pinned(f"pull:{threading.get_ident()}:{v.name}", v.shape, v.dtype)
        by_shard: dict[int, list[PullItem]] = {}
        for v in variables:
            flat = out[v.name].reshape(-1)
            for shard, first, end in v.element_ranges:
                by_shard.setdefault(shard, []).append(PullItem(v.name, flat[first:end]))
        return out, by_shard

    def deliver(self, out: dict[str, np.ndarray], gpu: int | None) -> dict[str, Any]:
        """Pulled host arrays as the caller asked for them (uploaded to ``gpu`` when given)."""
        if gpu is None:
            return out
        return self._gpu.get().upload_all(out, gpu)

    # ---- rows ----

    def pull_rows(self, name: str, ids: Any, device: Any = None, lookup: int = ROW_LOOKUP_CREATE) -> Any:
        """PSClient.pull_rows: rows ``ids`` in the order given; repeated ids are fetched once.

        ``lookup`` other than ROW_LOOKUP_CREATE (PSClient.lookup_rows): read
        only, as an anonymous reader (no lease, no step), so no server state changes.
        """
        gpu = parse_device(device)
        variable = self._registry.resolve([name])[0]
        ids = check_ids(ids, "ids")
        width = variable.spec.row_elements
        # Grouped once: the sorted unique ids, and for a dense variable each shard's rows as one slice.
        groups = grouped_ids(ids)
        if not groups.repeats:
            # No repeats: each shard's rows go from its answer straight to their places.
            result = np.empty((len(ids), width), dtype=variable.dtype)
            unique, order = groups.unique, groups.order
            self.pull_all({shard: [PullItem(name, result, unique[positions], rows_at=order[positions])]
                           for shard, positions in self._rows_by_shard(variable, unique).items()}, lookup)
        else:
            result = self._pull_unique_rows(variable, groups, lookup)
        row_shape = variable.shape if variable.spec.hash_table else variable.shape[1:]
        result = result.reshape((len(ids), *row_shape))
        return result if gpu is None else to_device(result, gpu)

    def _rows_by_shard(self, variable: Variable, unique_ids: np.ndarray) -> dict[int, slice | np.ndarray]:
        return rows_by_shard(variable, unique_ids, self._session.num_shards)

    def _pull_unique_rows(self, variable: Variable, groups: IdGroups, lookup: int) -> np.ndarray:
        """pull_rows of ids that repeat: each id fetched once, then copied to every place it was asked."""
        unique = groups.unique
        fetched = np.empty((len(unique), variable.spec.row_elements), dtype=variable.dtype)
        by_shard: dict[int, list[PullItem]] = {}
        for shard, positions in self._rows_by_shard(variable, unique).items():
            if isinstance(positions, slice):  # a dense variable's shard: its rows in one block
                by_shard[shard] = [PullItem(variable.name, fetched[positions].reshape(-1), unique[positions])]
            else:  # a hash table's shard: each answer's rows put in their places as they come
                by_shard[shard] = [PullItem(variable.name, fetched, unique[positions], rows_at=positions)]
        self.pull_all(by_shard, lookup)
        return take_rows(fetched, groups.inverse)  # row i of the result is fetched row inverse[i]

    # ---- the calls ----

    def pull_all(self, by_shard: dict[int, list[PullItem]], lookup: int = ROW_LOOKUP_CREATE) -> None:
        """Pull from every shard in ``by_shard`` at once, straight into the items' ``dest``.

        Row ids travel in the request: a shard's ids beyond chunk_bytes go in
        further requests, one round of requests (one per shard) after another.
        """
        rounds = {i: self._requests(items) for i, items in by_shard.items()}
        shards = self._session.shards
        for r in range(max((len(requests) for requests in rounds.values()), default=0)):
            self._session.run_calls(self._call(shards[i], requests[r], lookup)
                                    for i, requests in rounds.items() if r < len(requests))

    def _requests(self, items: list[PullItem]) -> list[list[PullItem]]:
        """``items`` as the items of requests that carry at most chunk_bytes of row ids each.

        A request names each variable once (the answer is matched by name),
        so a variable's rows that need several requests are split between them.
        """
        max_ids = self._session.chunk_bytes // 8
        requests: list[list[PullItem]] = [[]]
        ids_in = 0
        for item in items:
            ids = item.row_ids
            if ids is None or len(ids) <= max_ids - ids_in:
                requests[-1].append(item)
                ids_in += 0 if ids is None else len(ids)
                continue
            width = item.dest.shape[1] if item.rows_at is not None else item.dest.size // max(1, len(ids))
            for start in range(0, len(ids), max_ids):
                end = min(len(ids), start + max_ids)
                piece = (PullItem(item.name, item.dest, ids[start:end], item.rows_at[start:end])
                         if item.rows_at is not None
                         else PullItem(item.name, item.dest[start * width:end * width], ids[start:end]))
                if requests[-1]:
                    requests.append([])
                requests[-1].append(piece)
                ids_in = end - start
        return requests

    def _call(self, shard: ShardChannel, items: list[PullItem], lookup: int = ROW_LOOKUP_CREATE) -> ShardCall:
        session = self._session
        request = self.request(shard, items, lookup=lookup)
        receiver = PullReceiver(shard.address, items)
        ticket = session.state.take_ticket()

        def ordinary() -> None:
            receiver.reset()
            shard.pull(request, session.data_timeout, receiver.take_message)

        def on_lane_answer(answer: memoryview) -> None:
            receiver.reset()
            receiver.take_message(answer)

        def finish(_: None) -> None:
            receiver.check_complete()
            session.state.record_versions(shard, receiver.versions, ticket)

        small = self._use_lane and self.answer_bytes(items) <= session.chunk_bytes
        return ShardCall(shard, "pull", ordinary, finish, EXCHANGE_PULL, (lambda: request) if small else None,
                         on_lane_answer)

    def request(self, shard: ShardChannel, items: list[PullItem], step_ahead: int = 0,
                lookup: int = ROW_LOOKUP_CREATE) -> bytes:
        """The serialised PullRequest of ``items`` to ``shard`` (``step_ahead``: for the next step;
        ``lookup``: a read-only lookup is sent as an anonymous reader)."""
        session = self._session
        anonymous = lookup != ROW_LOOKUP_CREATE
        return pull_request(items, shard_index=shard.index, num_shards=session.num_shards,
                            wire_dtype=self._wire, chunk_bytes=session.chunk_bytes,
                            worker_id="" if anonymous else session.worker_id,
                            incarnation=session.incarnation if session.register and not anonymous else "",
                            step=0 if anonymous else session.state.step + step_ahead, lookup=lookup)

    def answer_bytes(self, items: list[PullItem]) -> int:
        """Tensor bytes the answer to a pull of ``items`` carries."""
        wire = self._wire_dtype.itemsize if self._wire_dtype is not None else None
        return sum(item.size * (wire or item.dest.dtype.itemsize) for item in items)

    # ---- values a push brings back ----

    def plan_prefetch(self, pushed: Mapping[int, list[Any]], next_pull: NextPull | None,
                      fits_one_message: Callable[[list[Any]], bool]) -> Prefetch | None:
        """Where the next step's values go, per shard, or None when the push cannot carry the pull.

        ``pushed``: each shard's push items, ``fits_one_message`` tells
        whether they are one message (the answer must be one message too).
        """
        if next_pull is None:
            return None
        variables = self._registry.dense(next_pull.names)
        out, pull_by_shard = self.targets(variables, next_pull.gpu, {})
        chunk_bytes = self._session.chunk_bytes
        for shard, items in pull_by_shard.items():
            items_pushed = pushed.get(shard)
            if (items_pushed is None or not fits_one_message(items_pushed)
                    or self.answer_bytes(items) > chunk_bytes):
                return None  # a shard not pushed to, or too big for one message: pull next step
        shards = self._session.shards
        requests = {i: self.request(shards[i], items, step_ahead=1) for i, items in pull_by_shard.items()}
        return Prefetch(next_pull, out, pull_by_shard, requests)

    def take_prefetched(self, names: list[str] | None, device: Any,
                        outs: OutArrays | None = None) -> dict[str, Any] | None:
        """The values a step's push brought back, if they are what this step would pull now.

        They must be this thread's, for the same names and device, no push may
        have started since, and they must be fresh (a loop that pauses between
        steps, to evaluate say, pulls again). ``outs``: checked ``out=``
        arrays, which receive the values (copied from where the push put them).
        """
        prefetch = self._prefetches.take()
        if prefetch is None:
            return None
        wanted = NextPull(tuple(names) if names is not None else None, parse_device(device))
        if prefetch.next_pull != wanted or not prefetch.is_fresh():
            return None
        if names is None and set(prefetch.out) != {v.name for v in self._registry.dense(None)}:
            return None  # variables were created since
        self._session.state.count("prefetched_steps")
        if outs is None:
            return self.deliver(prefetch.out, wanted.gpu)
        for name, view in outs.host.items():
            np.copyto(view, prefetch.out[name])
        if outs.device:
            self._gpu.get().upload_into(prefetch.out, outs.device)
        return outs.returned(self.deliver(prefetch.out, wanted.gpu))
