"""Seeded initial values: independent of the shard count, and statistically sane."""

from __future__ import annotations

import math

import numpy as np
import pytest

from wehub_ps.initializers import _BLOCK, fill_initial_values, glorot_limit
from wehub_ps.placement import FixedShardsPartitioner, rows_of, stable_hash64
from wehub_ps.specs import Constant, Explicit, GlorotUniform, Normal, Uniform, VariableSpec, Zeros

INITIALIZERS = {
    "uniform": Uniform(minval=-0.3, maxval=0.7),
    "normal": Normal(mean=0.5, stddev=2.0),
    "glorot_uniform": GlorotUniform(),
    "zeros": Zeros(),
    "constant": Constant(1.25),
}


def _global_values(spec: VariableSpec, num_shards: int) -> np.ndarray:
    """Fill every part as its shard would, then assemble the global variable."""
    rows, row_elements = rows_of(spec.shape)
    out = np.full(spec.num_elements, np.nan, dtype=spec.dtype)
    placement = spec.placement(num_shards)
    assert len(placement.parts) == min(num_shards, rows), "the variable should really be split"
    for part in placement.parts:
        local = np.full(part.rows * row_elements, np.nan, dtype=spec.dtype)
        fill_initial_values(spec.initializer, spec.shape, local, part.row_start * row_elements)
        out[part.row_start * row_elements: part.row_end * row_elements] = local
    return out.reshape(spec.shape)


@pytest.mark.parametrize("kind", sorted(INITIALIZERS))
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("shape", [(37, 5), (13,), (11, 3, 2, 4)])
def test_values_do_not_depend_on_the_number_of_parts(kind, dtype, shape):
    reference = None
    for n in (1, 2, 3, 5, 7):
        spec = VariableSpec(name=f"layer/{kind}", shape=shape, dtype=dtype,
                            initializer=INITIALIZERS[kind], partitioner=FixedShardsPartitioner(n))
        values = _global_values(spec, n)
        assert not np.isnan(values).any()
        if reference is None:
            reference = values
        else:
            assert values.tobytes() == reference.tobytes(), f"{n} parts differ from 1 part"
    if kind not in ("zeros", "constant"):
        assert len(np.unique(reference)) > reference.size // 2, "values should look random"


@pytest.mark.parametrize("kind", ["uniform", "normal", "glorot_uniform"])
def test_values_do_not_depend_on_parts_across_generator_blocks(kind):
    # More elements than one generator block, split so that part boundaries do
    # not fall on block boundaries.
    rows = _BLOCK // 2 + 7
    shape = (rows, 3)
    reference = None
    for n in (1, 2, 5, 7):
        spec = VariableSpec(name="big", shape=shape, dtype="float32",
                            initializer=INITIALIZERS[kind], partitioner=FixedShardsPartitioner(n))
        values = _global_values(spec, n)
        if reference is None:
            reference = values
        else:
            assert np.array_equal(reference, values)


def test_zeros_and_constant_values():
    out = np.full(10, 7.0, dtype=np.float32)
    fill_initial_values(Zeros(), (10,), out, 0)
    assert (out == 0).all()
    fill_initial_values(Constant(-3.5), (10,), out, 5)
    assert (out == -3.5).all()


def test_explicit_leaves_the_buffer_untouched():
    out = np.arange(6, dtype=np.float64)
    fill_initial_values(Explicit(b"\x00" * 32), (6,), out, 0)
    np.testing.assert_array_equal(out, np.arange(6))


# ---- statistics -----------------------------------------------------------------------

N = 100_000


def _sample(initializer, shape=(N,), dtype=np.float64, first_element=0):
    out = np.empty(math.prod(shape), dtype=dtype)
    fill_initial_values(initializer, shape, out, first_element)
    return out


@pytest.mark.parametrize("first_element", [0, 10**12])
def test_uniform_bounds_and_moments(first_element):
    lo, hi = -2.0, 3.0
    x = _sample(Uniform(lo, hi, seed=42), first_element=first_element)
    assert x.min() >= lo and x.max() < hi
    assert x.min() < lo + 0.01 and x.max() > hi - 0.01
    # mean (hi+lo)/2 = 0.5, standard error 5/sqrt(12)/sqrt(N) ~ 0.0046
    assert abs(x.mean() - 0.5) < 0.025
    assert abs(x.std() - (hi - lo) / math.sqrt(12)) < 0.02
    counts, _ = np.histogram(x, bins=10, range=(lo, hi))
    assert (np.abs(counts - N / 10) < 0.05 * N / 10).all()


def test_uniform_in_float32_stays_within_bounds():
    x = _sample(Uniform(-0.05, 0.05, seed=1), dtype=np.float32)
    assert x.min() >= np.float32(-0.05) and x.max() <= np.float32(0.05)


@pytest.mark.parametrize("mean, stddev", [(0.0, 1.0), (3.0, 0.5), (-1.0, 10.0)])
def test_normal_moments(mean, stddev):
    x = _sample(Normal(mean, stddev, seed=7))
    assert np.isfinite(x).all()
    assert abs(x.mean() - mean) < 0.02 * stddev  # standard error ~ 0.003 sigma
    assert abs(x.std() - stddev) < 0.02 * stddev
    z = (x - mean) / stddev
    assert abs(np.mean(np.abs(z) < 1) - 0.6827) < 0.01
    assert abs(np.mean(np.abs(z) < 2) - 0.9545) < 0.006
    # Symmetric, no heavy skew.
    assert abs(np.mean(z**3)) < 0.05


def test_normal_with_zero_stddev_is_the_mean():
    x = _sample(Normal(2.5, 0.0, seed=3), shape=(1000,))
    assert (x == 2.5).all()


def _keras_glorot_limit(shape):
    """tf.keras.initializers.GlorotUniform: limit = sqrt(3 * scale / n), scale=1, n=fan_avg."""
    if len(shape) < 1:
        fan_in = fan_out = 1
    elif len(shape) == 1:
        fan_in = fan_out = shape[0]
    elif len(shape) == 2:
        fan_in, fan_out = shape[0], shape[1]
    else:
        receptive_field_size = 1
        for dim in shape[:-2]:
            receptive_field_size *= dim
        fan_in = shape[-2] * receptive_field_size
        fan_out = shape[-1] * receptive_field_size
    n = max(1.0, (fan_in + fan_out) / 2.0)
    return math.sqrt(3.0 / n)


@pytest.mark.parametrize("shape, expected", [
    ((300, 200), math.sqrt(6.0 / 500)),
    ((3, 3, 64, 128), math.sqrt(6.0 / (9 * 64 + 9 * 128))),
    ((5, 7, 11), math.sqrt(6.0 / (5 * 7 + 5 * 11))),
    ((1000,), math.sqrt(6.0 / 2000)),
    ((), math.sqrt(6.0 / 2)),
])
def test_glorot_limit_matches_keras(shape, expected):
    assert glorot_limit(shape) == pytest.approx(expected, rel=1e-12)
    assert glorot_limit(shape) == pytest.approx(_keras_glorot_limit(shape), rel=1e-12)


@pytest.mark.parametrize("shape", [(300, 400), (3, 3, 64, 96)])
def test_glorot_values_fill_the_keras_range(shape):
    limit = _keras_glorot_limit(shape)
    x = _sample(GlorotUniform(seed=11), shape=shape)
    assert x.min() >= -limit and x.max() < limit
    assert x.min() < -0.99 * limit and x.max() > 0.99 * limit
    assert abs(x.mean()) < 0.01 * limit
    assert abs(x.std() - limit / math.sqrt(3)) < 0.01 * limit


# ---- seeds ----------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda seed: Uniform(-1.0, 1.0, seed=seed),
    lambda seed: Normal(0.0, 1.0, seed=seed),
    lambda seed: GlorotUniform(seed=seed),
])
def test_seeds(make):
    a = _sample(make(1), shape=(50, 40))
    again = _sample(make(1), shape=(50, 40))
    b = _sample(make(2), shape=(50, 40))
    big = _sample(make(2**64 - 1), shape=(50, 40))
    assert a.tobytes() == again.tobytes()
    assert not np.array_equal(a, b)
    assert not np.array_equal(a, big)
    # Different seeds are not merely shifted streams of each other.
    assert np.mean(a == b) < 0.01
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.1


def test_streams_at_different_offsets_are_not_shifted_copies():
    x = _sample(Uniform(0.0, 1.0, seed=5), shape=(2000,))
    assert abs(np.corrcoef(x[:-1], x[1:])[0, 1]) < 0.1


def test_default_seed_comes_from_the_name():
    a = VariableSpec("layer_a/kernel", (20, 30), "float32", initializer=GlorotUniform())
    b = VariableSpec("layer_b/kernel", (20, 30), "float32", initializer=GlorotUniform())
    a_again = VariableSpec("layer_a/kernel", (20, 30), "float32", initializer=GlorotUniform())
    assert a.initializer.seed == stable_hash64("layer_a/kernel")
    assert _global_values(a, 1).tobytes() == _global_values(a_again, 1).tobytes()
    assert not np.array_equal(_global_values(a, 1), _global_values(b, 1))
