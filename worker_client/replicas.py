"""Several model replicas in one worker process (one per GPU, or CPU replicas).

One pull per step, the parameters placed on every replica's device, the
replicas' gradients aggregated on a device (sum or mean), and a single push:
the servers see one worker, and the network carries one gradient per step
instead of R.

    group = ReplicaGroup(client, devices=["cuda:0", "cuda:1"])
    with group.step() as step:
        grads = [compute(params, batch[r]) for r, params in enumerate(step.params)]
        step.push(grads)

Sparse gradients are merged: each replica's ``rows={table: (ids, grads)}``
are concatenated (the client sums repeated ids) and scaled like the dense
ones. Without a GPU the same code runs on numpy ("cpu" devices).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from worker_client.arrays import is_gpu_array, parse_device, to_host
from worker_client.gpu import GpuTransfers
from worker_client.step import Step

__all__ = ["ReplicaClient", "ReplicaGroup", "ReplicaStep"]


class ReplicaClient(Protocol):
    """What a ReplicaGroup needs of its client (PSClient is one)."""

    def step(self, names: Iterable[str] | None = None, *, device: Any = None) -> Step:
        """A step: pull on entry, one push of the aggregated gradients."""

    def gpu_transfers(self) -> GpuTransfers:
        """The client's pinned buffers and device streams, shared so copies to and from GPUs overlap."""


class ReplicaGroup:
    """R replicas driven by one worker; ``devices`` has one entry per replica."""

    def __init__(self, client: ReplicaClient, devices: Sequence[Any] = ("cpu",),
                 reduce: str = "mean") -> None:
        if not devices:
            raise ValueError("devices must name at least one replica's device, got an empty list")
        if reduce not in ("mean", "sum"):
            raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
        self.client = client
        self.devices = [parse_device(d) for d in devices]
        self.reduce = reduce

    @property
    def num_replicas(self) -> int:
        return len(self.devices)

    def step(self, names: Iterable[str] | None = None) -> "ReplicaStep":
        return ReplicaStep(self, names)

    def place(self, host_params: Mapping[str, np.ndarray]) -> list[dict[str, Any]]:
        """The pulled parameters on each replica's device (a private copy per CPU replica)."""
        gpus = {d for d in self.devices if d is not None}
        transfers = self.client.gpu_transfers() if gpus else None
        # The devices' copies run side by side; one wait for them all.
        placed = [{name: value.copy() for name, value in host_params.items()} if device is None
                  else transfers.upload_all(host_params, device, wait=False) for device in self.devices]
        if transfers is not None:
            transfers.synchronize(gpus)
        return placed

    def aggregate(self, per_replica: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
        """Sum (or mean) of the replicas' gradients, reduced on the first replica's device."""
        if len(per_replica) != self.num_replicas:
            raise ValueError(f"expected gradients from {self.num_replicas} replicas, got {len(per_replica)}")
        names = set(per_replica[0])
        for r, grads in enumerate(per_replica):
            if set(grads) != names:
                raise ValueError(f"replica {r} has gradients for {sorted(grads)}, replica 0 for {sorted(names)}")
        scale = 1.0 / self.num_replicas if self.reduce == "mean" else 1.0
        out = {}
        for name in names:
            values = [grads[name] for grads in per_replica]
            if any(is_gpu_array(v) for v in values):
                transfers = self.client.gpu_transfers()
                first = next(d for d in self.devices if d is not None)
                # CPU replicas' gradients go up in one batch; GPU ones stay where they are.
                uploaded = transfers.upload_all({str(r): np.asarray(v) for r, v in enumerate(values)
                                                 if not is_gpu_array(v)}, first)
                total = transfers.sum_on(first, [uploaded.get(str(r), v) for r, v in enumerate(values)])
                if scale != 1.0:
                    total *= total.dtype.type(scale)
                out[name] = total  # the client downloads it through its pinned buffer
            else:
                host = [to_host(v, f"gradients[{name!r}]") for v in values]
                total = host[0].copy()
                for v in host[1:]:
                    total += v
                if scale != 1.0:
                    total *= total.dtype.type(scale)
                out[name] = total
        return out

    def merge_rows(self, per_replica: Sequence[Mapping[str, tuple[Any, Any]]]) -> dict[str, tuple[Any, Any]]:
        """Concatenate each table's (ids, grads) over replicas, scaled like the dense gradients."""
        scale = 1.0 / self.num_replicas if self.reduce == "mean" else 1.0
        merged: dict[str, tuple[list, list]] = {}
        for rows in per_replica:
            for name, (ids, grads) in rows.items():
                entry = merged.setdefault(name, ([], []))
                entry[0].append(to_host(ids, "ids"))
                entry[1].append(to_host(grads, "gradients"))
        out = {}
        for name, (ids, grads) in merged.items():
            g = np.concatenate(grads)
            if scale != 1.0:
                g = g * g.dtype.type(scale)
            out[name] = (np.concatenate(ids), g)
        return out


class ReplicaStep:
    """``with group.step() as step``: one pull on entry, ``step.params[r]`` per replica."""

    def __init__(self, group: ReplicaGroup, names: Iterable[str] | None) -> None:
        self._group = group
        self._step = group.client.step(names)
        self.params: list[dict[str, Any]] = []

    def __enter__(self) -> "ReplicaStep":
        self._step.__enter__()
        self.params = self._group.place(self._step.params)
        return self

    def push(self, gradients: Sequence[Mapping[str, Any]],
             rows: Sequence[Mapping[str, tuple[Any, Any]]] | None = None) -> None:
        """Aggregate the replicas' gradients (one mapping per replica) and push them once."""
        dense = self._group.aggregate(gradients)
        merged = self._group.merge_rows(rows) if rows else None
        self._step.push(dense, merged)

    def __exit__(self, *exc_info: Any) -> None:
        self._step.__exit__(*exc_info)
