"""Variable specifications: what a variable is, independent of where it lives.

Pure dataclasses: no protobuf here (:mod:`wehub_ps.specs_proto` converts
to and from the wire), so the server's core can use them.

Dataclasses that both sides use: the client builds them from user arguments
(and checks them at the API edge), the server rebuilds them from the wire and
runs exactly the same checks. Equality of two specs is what makes
``create_variable`` idempotent.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Union

import numpy as np

from wehub_ps.dtypes import VARIABLE_DTYPES, dtype_name, parse_dtype
from wehub_ps.placement import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
    Placement,
    place,
    rows_of,
    stable_hash64,
)

__all__ = [
    "SpecError",
    "SGD",
    "Momentum",
    "Adagrad",
    "Adam",
    "Optimizer",
    "Zeros",
    "Constant",
    "Uniform",
    "Normal",
    "GlorotUniform",
    "Explicit",
    "Initializer",
    "VariableSpec",
    "MAX_NAME_LENGTH",
    "MAX_RANK",
    "OPTIMIZER_KINDS",
    "INITIALIZER_KINDS",
    "PARTITIONER_KINDS",
    "EVICTIONS",
    "AGGREGATIONS",
    "Admission",
    "DiskTier",
    "Expiry",
    "as_dict",
]

MAX_NAME_LENGTH = 256
MAX_RANK = 16
# Names end up in checkpoint keys, metric labels and file listings.
_NAME_PATTERN = re.compile(r"[A-Za-z0-9_.:/\-]+")
_UINT64_MAX = 2**64 - 1


class SpecError(ValueError):
    """A specification is invalid; the message names the field and value."""


def _check_rate(owner: str, name: str, value: float, *, low: float = 0.0, high: float = math.inf,
                low_open: bool = True, high_open: bool = True) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecError(f"{owner}.{name} must be a finite number, got {value!r}")
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if too_low or too_high:
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        raise SpecError(f"{owner}.{name} must be in {lo}{low}, {high}{hi}, got {value!r}")


# ---- optimizers -------------------------------------------------------------


@dataclass(frozen=True)
class SGD:
    """Plain SGD: ``w -= learning_rate * g``."""

    learning_rate: float = 0.01

    def __post_init__(self) -> None:
        _check_rate("SGD", "learning_rate", self.learning_rate)


@dataclass(frozen=True)
class Momentum:
    """SGD with momentum, TensorFlow's formulation.

    ``a = momentum * a + g``; ``w -= lr * a``, or with Nesterov
    ``w -= lr * (g + momentum * a)``.
    """

    learning_rate: float = 0.01
    momentum: float = 0.9
    nesterov: bool = False

    def __post_init__(self) -> None:
        _check_rate("Momentum", "learning_rate", self.learning_rate)
        _check_rate("Momentum", "momentum", self.momentum, low_open=False)
        if not isinstance(self.nesterov, bool):
            raise SpecError(f"Momentum.nesterov must be a bool, got {self.nesterov!r}")


@dataclass(frozen=True)
class Adagrad:
    """``acc += g*g``; ``w -= lr * g / (sqrt(acc) + epsilon)`` (Keras defaults)."""

    learning_rate: float = 0.001
    initial_accumulator_value: float = 0.1
    epsilon: float = 1e-7

    def __post_init__(self) -> None:
        _check_rate("Adagrad", "learning_rate", self.learning_rate)
        _check_rate("Adagrad", "initial_accumulator_value", self.initial_accumulator_value,
                    low_open=False)
        _check_rate("Adagrad", "epsilon", self.epsilon)


@dataclass(frozen=True)
class Adam:
    """Adam with bias correction folded into the step size (Keras formulation).

    ``m = b1 m + (1-b1) g``; ``v = b2 v + (1-b2) g²``;
    ``w -= lr * sqrt(1-b2^t)/(1-b1^t) * m / (sqrt(v) + epsilon)``.
    """

    learning_rate: float = 0.001
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7

    def __post_init__(self) -> None:
        _check_rate("Adam", "learning_rate", self.learning_rate)
        _check_rate("Adam", "beta_1", self.beta_1, high=1.0, low_open=False)
        _check_rate("Adam", "beta_2", self.beta_2, high=1.0, low_open=False)
        _check_rate("Adam", "epsilon", self.epsilon)


Optimizer = Union[SGD, Momentum, Adagrad, Adam]
#: Each optimizer's kind name (also its field name in the wire spec).
OPTIMIZER_KINDS: dict[type, str] = {SGD: "sgd", Momentum: "momentum", Adagrad: "adagrad", Adam: "adam"}


# ---- initializers -------------------------------------------------------------


@dataclass(frozen=True)
class Zeros:
    """All zeros."""


@dataclass(frozen=True)
class Constant:
    """Every element ``value``."""

    value: float = 0.0

    def __post_init__(self) -> None:
        _check_rate("Constant", "value", self.value, low=-math.inf)


@dataclass(frozen=True)
class Uniform:
    """Uniform in ``[minval, maxval)``; seeded, identical for any shard count."""

    minval: float = -0.05
    maxval: float = 0.05
    seed: int | None = None

    def __post_init__(self) -> None:
        _check_rate("Uniform", "minval", self.minval, low=-math.inf)
        _check_rate("Uniform", "maxval", self.maxval, low=-math.inf)
        if self.maxval < self.minval:
            raise SpecError(f"Uniform.maxval ({self.maxval}) must be >= minval ({self.minval})")
        _check_seed("Uniform", self.seed)


@dataclass(frozen=True)
class Normal:
    """Normal with ``mean`` and ``stddev``; seeded, identical for any shard count."""

    mean: float = 0.0
    stddev: float = 0.05
    seed: int | None = None

    def __post_init__(self) -> None:
        _check_rate("Normal", "mean", self.mean, low=-math.inf)
        _check_rate("Normal", "stddev", self.stddev, low_open=False)
        _check_seed("Normal", self.seed)


@dataclass(frozen=True)
class GlorotUniform:
    """Uniform in ``±sqrt(6 / (fan_in + fan_out))`` (Keras' fan computation)."""

    seed: int | None = None

    def __post_init__(self) -> None:
        _check_seed("GlorotUniform", self.seed)


@dataclass(frozen=True)
class Explicit:
    """A value the client uploads; identified by the SHA-256 of its bytes."""

    sha256: bytes = b""

    def __post_init__(self) -> None:
        if not isinstance(self.sha256, bytes) or len(self.sha256) != 32:
            raise SpecError("Explicit.sha256 must be the 32-byte SHA-256 of the initial value")


def _check_seed(owner: str, seed: int | None) -> None:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not 0 <= seed <= _UINT64_MAX):
        raise SpecError(f"{owner}.seed must be an integer in [0, 2**64), got {seed!r}")


Initializer = Union[Zeros, Constant, Uniform, Normal, GlorotUniform, Explicit]
#: Each initializer's kind name (also its field name in the wire spec).
INITIALIZER_KINDS: dict[type, str] = {
    Zeros: "zeros", Constant: "constant", Uniform: "uniform", Normal: "normal",
    GlorotUniform: "glorot_uniform", Explicit: "explicit",
}
_INITIALIZERS_BY_NAME = {name: cls for cls, name in INITIALIZER_KINDS.items()}
_SEEDED = (Uniform, Normal, GlorotUniform)

#: Each partitioner's kind name (also its field name in the wire spec).
PARTITIONER_KINDS: dict[type, str] = {
    MinSizePartitioner: "min_size", FixedShardsPartitioner: "fixed_shards", MaxSizePartitioner: "max_size",
}


def initializer_from_name(name: str) -> Initializer:
    """'zeros', 'glorot_uniform', ... with default parameters."""
    try:
        return _INITIALIZERS_BY_NAME[name]()
    except KeyError:
        known = ", ".join(sorted(n for n in _INITIALIZERS_BY_NAME if n != "explicit"))
        raise SpecError(f"initializer must be one of {known} or an array, got {name!r}") from None


def with_seed(initializer: Initializer, name: str) -> Initializer:
    """Fill in a missing seed from the variable name, so every worker agrees."""
    if isinstance(initializer, _SEEDED) and initializer.seed is None:
        return type(initializer)(**{**as_dict(initializer), "seed": stable_hash64(name)})
    return initializer


def as_dict(obj) -> dict:
    """A spec part's fields by name (the part's constructor takes them back)."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


#: Hash-table evictions and sync-mode aggregations a spec may name.
EVICTIONS = ("none", "lru")
AGGREGATIONS = ("mean", "sum", "row_mean")


# ---- hash-table row policies ------------------------------------------------------

#: Counters of an admission filter at most (4 rows of them, 2 bytes each: 512 MiB).
MAX_ADMISSION_COUNTERS = 1 << 26


@dataclass(frozen=True)
class Admission:
    """When a hash table's new id becomes a row: after ``min_count`` sightings, with ``probability``.

    A training pull of an id without a row is a sighting. The shard counts
    sightings in a count-min filter of ``counters`` 16-bit counters per
    each of its 4 hash rows (bounded memory; it may overcount, never
    undercount; its counts are halved after every ``10 * counters``
    sightings so old ones fade). An id is admitted at the sighting that
    brings its count to ``min_count``, if a draw seeded by the table, the
    id and the table's clock falls under ``probability``. Until then a pull
    answers the initializer's value for the id (``zeros=True``: zeros) and a
    push drops the id's gradient; both are counted.
    """

    min_count: int = 1
    probability: float = 1.0
    counters: int = 1 << 18
    zeros: bool = False

    def __post_init__(self) -> None:
        if (isinstance(self.min_count, bool) or not isinstance(self.min_count, int)
                or not 1 <= self.min_count <= 65535):
            raise SpecError(f"Admission.min_count must be an integer in [1, 65535], got {self.min_count!r}")
        if isinstance(self.probability, bool) or not isinstance(self.probability, (int, float)) or not (
                0.0 < float(self.probability) <= 1.0):
            raise SpecError(f"Admission.probability must be in (0, 1], got {self.probability!r}")
        object.__setattr__(self, "probability", float(self.probability))
        if (isinstance(self.counters, bool) or not isinstance(self.counters, int)
                or not 64 <= self.counters <= MAX_ADMISSION_COUNTERS):
            raise SpecError(f"Admission.counters must be an integer in [64, {MAX_ADMISSION_COUNTERS}], "
                            f"got {self.counters!r}")
        if not isinstance(self.zeros, bool):
            raise SpecError(f"Admission.zeros must be a bool, got {self.zeros!r}")


@dataclass(frozen=True)
class Expiry:
    """Rows of a hash table not updated for ``steps`` versions of the table or ``seconds`` are removed.

    ``steps`` counts the table's version on its shard (one per push applied
    there; one per step in sync mode). Each shard sweeps its tables every
    ``--expiry-interval`` seconds: a sweep removes the rows whose last update
    is ``steps`` or more versions old, or happened before a sweep at least
    ``seconds`` ago (so a row is never removed early and at most one interval
    late). 0 turns either rule off.
    """

    steps: int = 0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if (isinstance(self.steps, bool) or not isinstance(self.steps, int)
                or not 0 <= self.steps <= _UINT64_MAX):
            raise SpecError(f"Expiry.steps must be an integer >= 0, got {self.steps!r}")
        if isinstance(self.seconds, bool) or not isinstance(self.seconds, (int, float)) or not (
                math.isfinite(self.seconds) and self.seconds >= 0):
            raise SpecError(f"Expiry.seconds must be a finite number >= 0, got {self.seconds!r}")
        object.__setattr__(self, "seconds", float(self.seconds))
        if not self.steps and not self.seconds:
            raise SpecError("Expiry needs steps > 0 or seconds > 0")


@dataclass(frozen=True)
class DiskTier:
    """A hash table keeps at most ``memory_rows`` rows per shard in memory and the rest on the shard's
    local disk (``ps-server --disk-tier-dir``); the least recently used rows go to disk, a row read or
    updated comes back. Values, optimizer slots and every guarantee are the same as in memory."""

    memory_rows: int

    def __post_init__(self) -> None:
        if (isinstance(self.memory_rows, bool) or not isinstance(self.memory_rows, int)
                or not 1 <= self.memory_rows <= _UINT64_MAX):
            raise SpecError(f"DiskTier.memory_rows must be an integer >= 1, got {self.memory_rows!r}")


# ---- the variable spec ----------------------------------------------------------


@dataclass(frozen=True)
class VariableSpec:
    """A dense variable: name, global shape, dtype and how it is trained.

    Random initializers always carry an explicit seed here (see
    :func:`with_seed`), so two specs compare equal exactly when every worker
    would get identical values.
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    initializer: Initializer = field(default_factory=Zeros)
    optimizer: Optimizer = field(default_factory=SGD)
    partitioner: Partitioner = field(default_factory=MinSizePartitioner)
    #: A hash table of rows keyed by 64-bit ids; ``shape`` is then one row's shape.
    hash_table: bool = False
    #: Hash tables: rows per shard at most (0: bounded by the server's memory limit only).
    max_rows: int = 0
    #: Hash tables: "none" (refuse rows beyond max_rows) or "lru" (evict the least recently used).
    eviction: str = "none"
    #: Synchronous mode: apply the "mean" or the "sum" of the workers' gradients, or "row_mean":
    #: each row's sum divided by the workers that pushed that row (see ps_server.core.accumulator).
    aggregation: str = "mean"
    #: Hash tables: when a new id becomes a row (None: at its first touch).
    admission: Admission | None = None
    #: Hash tables: rows removed when not updated for a while (None: never).
    expiry: Expiry | None = None
    #: Hash tables: rows beyond a memory budget kept on local disk (None: all in memory).
    tier: DiskTier | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise SpecError(f"name must be a non-empty string, got {self.name!r}")
        if len(self.name) > MAX_NAME_LENGTH or not _NAME_PATTERN.fullmatch(self.name):
            raise SpecError(
                f"name {self.name!r} must be at most {MAX_NAME_LENGTH} characters of "
                "letters, digits and _ . : / -"
            )
        shape = self.shape
        if not isinstance(shape, tuple) or any(
            isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0 for d in shape
        ):
            raise SpecError(f"shape of {self.name!r} must be a tuple of non-negative ints, got {shape!r}")
        if len(shape) > MAX_RANK:
            raise SpecError(f"shape of {self.name!r} has rank {len(shape)}; at most {MAX_RANK} is supported")
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))
        if math.prod(self.shape) > _UINT64_MAX // 8:
            raise SpecError(f"shape {self.shape} of {self.name!r} has too many elements")
        try:
            dtype = parse_dtype(self.dtype)
        except ValueError as exc:
            raise SpecError(f"dtype of {self.name!r}: {exc}") from None
        if dtype not in VARIABLE_DTYPES:
            raise SpecError(
                f"dtype of {self.name!r} must be float16, float32 or float64, got {dtype_name(dtype)}"
            )
        object.__setattr__(self, "dtype", dtype)
        for attr, table in (("initializer", INITIALIZER_KINDS), ("optimizer", OPTIMIZER_KINDS),
                            ("partitioner", PARTITIONER_KINDS)):
            if type(getattr(self, attr)) not in table:
                raise SpecError(f"{attr} of {self.name!r} has unsupported type {type(getattr(self, attr)).__name__}")
        object.__setattr__(self, "initializer", with_seed(self.initializer, self.name))
        if self.eviction not in EVICTIONS:
            raise SpecError(f"eviction of {self.name!r} must be 'none' or 'lru', got {self.eviction!r}")
        if self.aggregation not in AGGREGATIONS:
            raise SpecError(f"aggregation of {self.name!r} must be 'mean', 'sum' or 'row_mean', "
                            f"got {self.aggregation!r}")
        if isinstance(self.max_rows, bool) or not isinstance(self.max_rows, int) or self.max_rows < 0:
            raise SpecError(f"max_rows of {self.name!r} must be an integer >= 0, got {self.max_rows!r}")
        if self.hash_table:
            if not self.shape or math.prod(self.shape) == 0:
                raise SpecError(f"a hash table's shape is one row's shape, e.g. (dim,); "
                                f"{self.name!r} has {self.shape}")
            if isinstance(self.initializer, Explicit):
                raise SpecError(f"hash table {self.name!r} creates rows on first touch; it cannot "
                                "take an explicit initial value")
            if self.partitioner != MinSizePartitioner():
                raise SpecError(f"hash table {self.name!r} is placed by id; it takes no partitioner")
        elif (self.max_rows or self.eviction != "none" or self.admission is not None or self.expiry is not None
              or self.tier is not None):
            raise SpecError(f"max_rows, eviction, admission, expiry and tier apply to hash tables only "
                            f"({self.name!r} is dense)")
        if self.tier is not None and not isinstance(self.tier, DiskTier):
            raise SpecError(f"tier of {self.name!r} must be a DiskTier, got {self.tier!r}")
        if self.admission is not None and not isinstance(self.admission, Admission):
            raise SpecError(f"admission of {self.name!r} must be an Admission, got {self.admission!r}")
        if self.expiry is not None and not isinstance(self.expiry, Expiry):
            raise SpecError(f"expiry of {self.name!r} must be an Expiry, got {self.expiry!r}")
        if self.eviction == "lru" and not self.max_rows:
            raise SpecError(f"eviction 'lru' of {self.name!r} needs max_rows > 0")

    @property
    def row_elements(self) -> int:
        """Elements of one row (axis 0 of a dense variable; one entry of a hash table)."""
        return math.prod(self.shape) if self.hash_table else rows_of(self.shape)[1]

    @property
    def num_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.num_elements * self.dtype.itemsize

    def placement(self, num_shards: int) -> Placement:
        """Row ranges per shard of a dense variable; hash tables are placed by id instead."""
        if self.hash_table:
            raise SpecError(f"{self.name!r} is a hash table: its rows are placed by id (hash_shards)")
        return place(self.name, self.shape, self.dtype.itemsize, self.partitioner, num_shards)

    def differences(self, other: "VariableSpec") -> list[str]:
        """Human-readable differences, e.g. ``["shape (10,) != (20,)"]``."""
        out = []
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                shown = (dtype_name(mine), dtype_name(theirs)) if f.name == "dtype" else (mine, theirs)
                out.append(f"{f.name} {shown[0]!r} != {shown[1]!r}")
        return out
