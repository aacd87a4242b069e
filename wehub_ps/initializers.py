"""Seeded initial values that do not depend on the number of shards.

Every element's value is a pure function of (seed, position): a
counter-based generator (SplitMix64) maps the position to 64 random bits.
For a dense variable the position is the global flat element index, so a
shard generates exactly its own rows and the assembled variable is
bit-identical whether it lives on one shard or on sixty-four. For a hash
table the position is (row id, column), so a row created on first touch has
the same value on whichever shard, and after whichever restart, it is made.
No variable-sized temporaries: values are produced in fixed-size blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from wehub_ps.specs import Constant, Explicit, GlorotUniform, Initializer, Normal, Uniform, Zeros

__all__ = ["fill_initial_values", "fill_rows", "glorot_limit"]

_BLOCK = 1 << 18  # elements per block: a few MiB of temporaries at most
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


def _splitmix_scalar(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix(z: np.ndarray) -> np.ndarray:
    """The SplitMix64 finaliser, in place on a uint64 array."""
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= _MIX1
        z ^= z >> np.uint64(27)
        z *= _MIX2
        z ^= z >> np.uint64(31)
    return z


def _stream(key, counters: np.ndarray) -> np.ndarray:
    """float64 in [0, 1) for ``counters`` (uint64, >= 1) of stream(s) ``key``."""
    with np.errstate(over="ignore"):
        z = counters * _GOLDEN
        z = z + key
    _mix(z)
    z >>= np.uint64(11)
    out = z.astype(np.float64)
    out *= 2.0**-53
    return out


def _stream_keys(seed: int) -> tuple[int, int]:
    key = _splitmix_scalar(seed)
    return key, _splitmix_scalar(key ^ 0x5DEECE66D)


def glorot_limit(shape: tuple[int, ...]) -> float:
    """sqrt(6 / (fan_in + fan_out)) with Keras' definition of the fans."""
    if len(shape) == 0:
        fan_in = fan_out = 1
    elif len(shape) == 1:
        fan_in = fan_out = shape[0]
    elif len(shape) == 2:
        fan_in, fan_out = shape
    else:
        receptive = math.prod(shape[:-2])
        fan_in, fan_out = shape[-2] * receptive, shape[-1] * receptive
    total = fan_in + fan_out
    return math.sqrt(6.0 / total) if total else 0.0


def _random_values(initializer: Initializer, shape: tuple[int, ...],
                   uniform: Callable[[int], np.ndarray]) -> np.ndarray:
    """Values from uniform draws of stream 0 (and 1, for the normal)."""
    u = uniform(0)
    if isinstance(initializer, Uniform):
        u *= initializer.maxval - initializer.minval
        u += initializer.minval
    elif isinstance(initializer, GlorotUniform):
        limit = glorot_limit(shape)
        u *= 2 * limit
        u -= limit
    elif isinstance(initializer, Normal):
        # Box-Muller on two independent streams.
        u2 = uniform(1)
        np.subtract(1.0, u, out=u)  # (0, 1]: log is finite
        np.log(u, out=u)
        u *= -2.0
        np.sqrt(u, out=u)
        u2 *= 2 * math.pi
        np.cos(u2, out=u2)
        u *= u2
        u *= initializer.stddev
        u += initializer.mean
    else:  # pragma: no cover - guarded by VariableSpec validation
        raise TypeError(f"unsupported initializer {initializer!r}")
    return u


def _fill_constant(initializer: Initializer, out: np.ndarray) -> bool:
    if isinstance(initializer, Zeros):
        out.fill(0)
    elif isinstance(initializer, Constant):
        out.fill(initializer.value)
    elif not isinstance(initializer, Explicit):
        return False
    return True  # (explicit values are uploaded by the client)


def fill_initial_values(
    initializer: Initializer, shape: tuple[int, ...], out: np.ndarray, first_element: int
) -> None:
    """Write the values of global elements [first_element, first_element + out.size).

    ``out`` is a flat array (this shard's part). Explicit initializers leave it
    untouched: the client uploads those values.
    """
    if _fill_constant(initializer, out):
        return
    assert initializer.seed is not None, "specs always carry a seed (wehub_ps.specs.with_seed)"
    keys = _stream_keys(initializer.seed)
    for block_start in range(0, out.size, _BLOCK):
        count = min(_BLOCK, out.size - block_start)
        first = first_element + block_start + 1
        counters = np.arange(first, first + count, dtype=np.uint64)
        out[block_start:block_start + count] = _random_values(
            initializer, shape, lambda s: _stream(np.uint64(keys[s]), counters))


def fill_rows(initializer: Initializer, row_shape: tuple[int, ...], ids: np.ndarray, out: np.ndarray) -> None:
    """Initial values of hash-table rows ``ids`` into ``out`` (len(ids), row elements)."""
    if _fill_constant(initializer, out):
        return
    assert initializer.seed is not None, "specs always carry a seed (wehub_ps.specs.with_seed)"
    keys = _stream_keys(initializer.seed)
    row_keys = []
    for key in keys:
        k = np.asarray(ids, dtype=np.int64).view(np.uint64) ^ np.uint64(key)
        row_keys.append(_mix(k)[:, None])
    counters = np.arange(1, out.shape[1] + 1, dtype=np.uint64)[None, :]
    out[...] = _random_values(initializer, row_shape, lambda s: _stream(row_keys[s], counters))
