"""Seeded initial values that do not depend on the number of shards.

Every element's value is a pure function of (seed, global flat element
index): a counter-based generator (SplitMix64) maps the index to 64 random
bits. A shard therefore generates exactly its own rows, and the assembled
variable is bit-identical whether it lives on one shard or on sixty-four.
No variable-sized temporaries: values are produced in fixed-size blocks.
"""

from __future__ import annotations

import math

import numpy as np

from wehub_ps.specs import Constant, Explicit, GlorotUniform, Initializer, Normal, Uniform, Zeros

__all__ = ["fill_initial_values", "glorot_limit"]

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


def _uniform01(key: int, start: int, count: int) -> np.ndarray:
    """float64 in [0, 1) for counters start..start+count-1 of stream ``key``."""
    with np.errstate(over="ignore"):
        z = np.arange(start + 1, start + count + 1, dtype=np.uint64)
        z *= _GOLDEN
        z += np.uint64(key)
        z ^= z >> np.uint64(30)
        z *= _MIX1
        z ^= z >> np.uint64(27)
        z *= _MIX2
        z ^= z >> np.uint64(31)
    z >>= np.uint64(11)
    out = z.astype(np.float64)
    out *= 2.0**-53
    return out


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


def fill_initial_values(
    initializer: Initializer, shape: tuple[int, ...], out: np.ndarray, first_element: int
) -> None:
    """Write the values of global elements [first_element, first_element + out.size).

    ``out`` is a flat array (this shard's part). Explicit initializers leave it
    untouched: the client uploads those values.
    """
    if isinstance(initializer, Zeros):
        out.fill(0)
        return
    if isinstance(initializer, Constant):
        out.fill(initializer.value)
        return
    if isinstance(initializer, Explicit):
        return
    assert initializer.seed is not None, "specs always carry a seed (wehub_ps.specs.with_seed)"
    key = _splitmix_scalar(initializer.seed)
    key2 = _splitmix_scalar(key ^ 0x5DEECE66D)
    for block_start in range(0, out.size, _BLOCK):
        count = min(_BLOCK, out.size - block_start)
        counter = first_element + block_start
        u = _uniform01(key, counter, count)
        if isinstance(initializer, Uniform):
            u *= initializer.maxval - initializer.minval
            u += initializer.minval
        elif isinstance(initializer, GlorotUniform):
            limit = glorot_limit(shape)
            u *= 2 * limit
            u -= limit
        elif isinstance(initializer, Normal):
            # Box-Muller on two independent streams.
            u2 = _uniform01(key2, counter, count)
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
        out[block_start : block_start + count] = u
