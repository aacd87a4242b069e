"""The variables a client knows: the cache of specs and placements, and creating variables.

The cache is filled by every Describe (connect, :meth:`Registry.describe`, a
name not seen yet) and by creating variables. A create reaches every shard
in two rounds (validate and book, then create), so a create one shard
refuses leaves nothing behind on the others.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from wehub_ps.dtypes import dtype_name, parse_dtype
from wehub_ps.placement import MinSizePartitioner, Partitioner, Placement, hash_shards
from wehub_ps.specs import (
    SGD,
    Admission,
    Constant,
    DiskTier,
    Expiry,
    Explicit,
    GlorotUniform,
    Initializer,
    Normal,
    Optimizer,
    Uniform,
    VariableSpec,
    Zeros,
    initializer_from_name,
)
from wehub_ps.specs_proto import spec_to_proto
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.arrays import as_wire_array, byte_view
from worker_client.arrays import to_host
from worker_client.errors import (
    DTypeMismatchError,
    InvalidArgumentError,
    PSError,
    ShapeMismatchError,
    VariableNotFoundError,
)
from worker_client.push_framing import PushItem
from worker_client.session import Session
from worker_client.shard_info import ShardInfo
from worker_client.transport.channels import ShardChannel

__all__ = ["Registry", "Variable", "rows_by_shard"]

log = logging.getLogger("worker_client")

_INITIALIZER_TYPES = (Zeros, Constant, Uniform, Normal, GlorotUniform)
# create_variable validates on every shard again (renewing the bookings, which servers keep 60 s)
# when one round of validation took longer than this; at most this many rounds.
_BOOKING_RENEW_SECONDS = 20.0
_VALIDATE_ROUNDS = 3


@dataclass(frozen=True)
class Variable:
    """A variable as the cluster holds it."""

    spec: VariableSpec
    #: Row ranges per shard; None for hash tables (placed by id).
    placement: Placement | None
    created: bool = False

    # Cached: a step reads them several times per variable.
    @functools.cached_property
    def name(self) -> str:
        return self.spec.name

    @functools.cached_property
    def shape(self) -> tuple[int, ...]:
        return self.spec.shape

    @functools.cached_property
    def dtype(self) -> np.dtype:
        return self.spec.dtype

    @functools.cached_property
    def element_ranges(self) -> tuple[tuple[int, int, int], ...]:
        """(shard, first, end) flat element ranges of each part, computed once.

        A step of a small model looks these up for every variable twice;
        deriving them from the placement each time showed in the profile
        (yappi: 40 calls of rows_of and row_elements per 20-variable step).
        """
        width = self.spec.row_elements
        return tuple((p.shard, p.row_start * width, p.row_end * width) for p in self.placement.parts)


def rows_by_shard(variable: Variable, unique_ids: np.ndarray,
                  num_shards: int) -> dict[int, slice | np.ndarray]:
    """Positions in ``unique_ids`` (sorted) grouped by the shard that holds each row.

    A dense variable's part is a range of rows, so its positions are a
    slice (views, not copies, downstream); a hash table's are an array.
    """
    if variable.spec.hash_table:
        shards = hash_shards(unique_ids, num_shards)
        return {int(s): np.flatnonzero(shards == s) for s in np.unique(shards)}
    rows = variable.shape[0] if variable.shape else 1
    if unique_ids.size and (unique_ids[0] < 0 or unique_ids[-1] >= rows):
        bad = unique_ids[(unique_ids < 0) | (unique_ids >= rows)][0]
        raise InvalidArgumentError(f"row {bad} is outside {variable.name!r}, which has {rows} rows")
    ranges: dict[int, list[tuple[int, int]]] = {}
    for part in variable.placement.parts:
        low, high = (int(i) for i in np.searchsorted(unique_ids, (part.row_start, part.row_end)))
        if high > low:
            ranges.setdefault(part.shard, []).append((low, high))
    return {shard: slice(*spans[0]) if len(spans) == 1
            else np.concatenate([np.arange(low, high) for low, high in spans])
            for shard, spans in ranges.items()}


class Registry:
    """The variables this client knows, by name; thread-safe.

    ``assign(by_shard)`` pushes explicit initial values (kind ASSIGN): the
    push path, given here so the registry does not depend on it.
    """

    def __init__(self, session: Session, assign: Callable[[dict[int, list[PushItem]]], Any]) -> None:
        self._session = session
        self._assign = assign
        # Guards _variables.
        self._lock = threading.Lock()
        self._variables: dict[str, Variable] = {}

    def remember(self, spec: VariableSpec, created: bool = False) -> Variable:
        """The variable of ``spec``, kept unless one of that name is known already."""
        placement = None if spec.hash_table else spec.placement(self._session.num_shards)
        variable = Variable(spec, placement, created)
        with self._lock:
            self._variables.setdefault(spec.name, variable)
            return self._variables[spec.name]

    def _keep(self, variable: Variable) -> Variable:
        with self._lock:
            self._variables[variable.name] = variable
            return variable

    def known(self) -> dict[str, Variable]:
        with self._lock:
            return dict(self._variables)

    # ---- describe ----

    def _describe_shard(self, shard: ShardChannel) -> ShardInfo:
        session = self._session
        info, specs = session.call(shard, "describe",
                                   lambda: session.describe_once(shard, session.control_timeout))
        for spec in specs:
            self.remember(spec)
        return info

    def describe(self) -> list[ShardInfo]:
        """Every server's identity and variables (refreshing the cache)."""
        return self._session.on_every_shard(self._describe_shard)

    def describe_each(self, timeout: float) -> list[ShardInfo | PSError]:
        """Each shard's state, or the error it answered (one try of each replica until the primary
        answers, within ``timeout`` each, no retries)."""
        def one(shard: ShardChannel) -> ShardInfo | PSError:
            try:
                info, specs = self._session.describe_primary(shard, timeout)
            except PSError as error:
                return error
            for spec in specs:
                self.remember(spec)
            return info

        return self._session.on_every_shard(one)

    # ---- lookups ----

    def resolve(self, names: Iterable[str] | str | None) -> list[Variable]:
        """Variables by name, asking the servers about names not seen yet."""
        if self._session.closed:
            raise PSError("the client was closed")
        known = self.known()
        if names is None:
            if not known:
                self.describe()
                known = self.known()
            return list(known.values())
        if isinstance(names, str):
            names = [names]
        names = list(names)
        for name in names:
            if not isinstance(name, str):
                raise TypeError(f"variable names must be strings, got {name!r}")
        if any(name not in known for name in names):
            self.describe()
            known = self.known()
        missing = [name for name in names if name not in known]
        if missing:
            raise VariableNotFoundError(
                f"no variable named {', '.join(map(repr, missing))} on the cluster; "
                "create it with create_variable first")
        return [known[name] for name in dict.fromkeys(names)]

    def dense(self, names: Iterable[str] | str | None) -> list[Variable]:
        """The variables a whole-variable pull reads: all dense ones when ``names`` is None."""
        variables = [v for v in self.resolve(names) if names is not None or not v.spec.hash_table]
        for v in variables:
            if v.spec.hash_table:
                raise InvalidArgumentError(f"{v.name!r} is a hash table: read it with pull_rows(name, ids)")
        return variables

    # ---- creating ----

    def create_variable(self, name: str, shape: Sequence[int] | int, dtype: str | np.dtype, initializer: Any,
                        optimizer: Optimizer | None, partitioner: Partitioner | None,
                        aggregation: str) -> Variable:
        """PSClient.create_variable: create on every shard, then send an explicit initial value."""
        shape_t = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        initial: np.ndarray | None = None
        if isinstance(initializer, str):
            init = initializer_from_name(initializer)
        elif isinstance(initializer, _INITIALIZER_TYPES):
            init = initializer
        else:
            initial = to_host(initializer, "initializer")
            if initial.shape != shape_t:
                raise ShapeMismatchError(f"initializer has shape {initial.shape}, but shape is {shape_t}")
            target = parse_dtype(dtype)
            if initial.dtype != target:
                raise DTypeMismatchError(
                    f"initializer has dtype {dtype_name(initial.dtype)}, but dtype is {dtype_name(target)}")
            initial = as_wire_array(initial)
            init = Explicit(hashlib.sha256(byte_view(initial)).digest())
        spec = VariableSpec(name=name, shape=shape_t, dtype=dtype, initializer=init,
                            optimizer=optimizer if optimizer is not None else SGD(),
                            partitioner=partitioner if partitioner is not None else MinSizePartitioner(),
                            aggregation=aggregation)
        placement = spec.placement(self._session.num_shards)
        results = self._create_everywhere(spec)
        created = any(r.created for r in results.values())
        if initial is not None:
            width = spec.row_elements
            pending = {p.shard: [PushItem(name, initial[p.row_start * width:p.row_end * width])]
                       for p in placement.parts if not results[p.shard].variable.initialized}
            if pending:
                self._assign(pending)
        return self._keep(Variable(spec, placement, created))

    def create_embedding(self, name: str, dim: int | Sequence[int], dtype: str | np.dtype,
                         initializer: str | Initializer, optimizer: Optimizer | None, max_rows: int,
                         eviction: str, aggregation: str, admission: Admission | None = None,
                         expiry: Expiry | None = None, tier: DiskTier | None = None) -> Variable:
        """PSClient.create_embedding: a hash table on every shard."""
        row_shape = (dim,) if isinstance(dim, (int, np.integer)) else tuple(dim)
        if isinstance(initializer, str):
            initializer = initializer_from_name(initializer)
        spec = VariableSpec(name=name, shape=row_shape, dtype=dtype, initializer=initializer,
                            optimizer=optimizer if optimizer is not None else SGD(), hash_table=True,
                            max_rows=max_rows, eviction=eviction, aggregation=aggregation,
                            admission=admission, expiry=expiry, tier=tier)
        results = self._create_everywhere(spec)
        return self._keep(Variable(spec, None, any(r.created for r in results.values())))

    def _create_everywhere(self, spec: VariableSpec) -> dict[int, ps_pb2.CreateVariableResponse]:
        """Create ``spec`` on every shard, after every shard accepted it; each shard's answer.

        Every shard records the spec (so conflicts are caught everywhere);
        only the shards in the placement allocate rows. Every shard first
        validates the create (spec, conflict, its limits) and books the
        part's memory without creating anything: a create that one shard
        refuses leaves no part on the others (where it would make every
        client's pull() of all variables fail), and the bookings are given
        back. A create that a shard still refuses after every shard accepted
        it (its booking expired, or the server restarted in between) leaves
        the parts made so far; calling create_variable again completes it.
        """
        shards = range(self._session.num_shards)
        booking = uuid.uuid4().hex

        def validate(shard: ShardChannel) -> ps_pb2.CreateVariableResponse | Exception:
            try:
                return self._create_on(shard, spec, validate_only=True, booking=booking)
            except Exception as exc:  # collected: the other shards' bookings are given back first
                return exc

        for _ in range(_VALIDATE_ROUNDS):
            started = time.monotonic()
            answers = self._session.on_shards(shards, validate)
            errors = {i: a for i, a in answers.items() if isinstance(a, Exception)}
            if errors:
                self._cancel_bookings([i for i in shards if i not in errors], spec, booking)
                raise errors[min(errors)]
            if time.monotonic() - started < _BOOKING_RENEW_SECONDS:
                break  # (otherwise validate again: that renews every booking)
        return self._session.on_shards(shards, lambda s: self._create_on(s, spec))

    def _cancel_bookings(self, shards: list[int], spec: VariableSpec, booking: str) -> None:
        """Give back the bookings of a create that another shard refused; best effort (they expire)."""
        def cancel(shard: ShardChannel) -> None:
            try:
                self._create_on(shard, spec, validate_only=True, booking=booking, cancel=True)
            except PSError as exc:
                log.debug("create_variable %r: ps-server %s kept its booking (it expires): %s", spec.name,
                          shard.address, exc, extra={"fields": {
                              "variable": spec.name, "address": shard.address, "error": str(exc)}})
        self._session.on_shards(shards, cancel)

    def _create_on(self, shard: ShardChannel, spec: VariableSpec, validate_only: bool = False,
                   booking: str = "", cancel: bool = False) -> ps_pb2.CreateVariableResponse:
        session = self._session
        request = ps_pb2.CreateVariableRequest(spec=spec_to_proto(spec), shard_index=shard.index,
                                               num_shards=session.num_shards, validate_only=validate_only,
                                               booking=booking, cancel_booking=cancel).SerializeToString()
        return ps_pb2.CreateVariableResponse.FromString(session.call(
            shard, "create_variable", lambda: shard.create_variable(request, session.control_timeout)))
