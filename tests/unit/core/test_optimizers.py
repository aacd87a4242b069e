"""Optimizer kernels against textbook references written here in float64 numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ps_server.core.optimizers import make_kernel
from ps_server.core.parts import VariablePart
from wehub_ps.dtypes import BFLOAT16
from wehub_ps.placement import FixedShardsPartitioner
from wehub_ps.specs import SGD, Adagrad, Adam, Constant, Momentum, Uniform, VariableSpec

# ---- independent references (float64, formulas from the TF/Keras docs) ----------------


class RefSGD:
    def __init__(self, lr):
        self.lr = lr

    def init(self, w):
        return {}

    def step(self, w, g, state, t):
        return w - self.lr * g


class RefMomentum:
    """tf.raw_ops.ApplyMomentum: accum = accum*momentum + grad;
    var -= lr*accum, or with use_nesterov var -= lr*(grad + momentum*accum)."""

    def __init__(self, lr, momentum, nesterov):
        self.lr, self.mu, self.nesterov = lr, momentum, nesterov

    def init(self, w):
        return {"momentum": np.zeros_like(w)}

    def step(self, w, g, state, t):
        accum = state["momentum"] * self.mu + g
        state["momentum"] = accum
        if self.nesterov:
            return w - self.lr * (g + self.mu * accum)
        return w - self.lr * accum


class RefAdagrad:
    """keras.optimizers.Adagrad: accumulator += g**2; w -= lr * g / (sqrt(accumulator) + eps)."""

    def __init__(self, lr, initial, eps):
        self.lr, self.initial, self.eps = lr, initial, eps

    def init(self, w):
        return {"accumulator": np.full_like(w, self.initial)}

    def step(self, w, g, state, t):
        state["accumulator"] = state["accumulator"] + g ** 2
        return w - self.lr * g / (np.sqrt(state["accumulator"]) + self.eps)


class RefAdam:
    """keras.optimizers.Adam:
    alpha = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)
    m += (g - m) * (1 - beta_1); v += (g**2 - v) * (1 - beta_2)
    w -= alpha * m / (sqrt(v) + eps)"""

    def __init__(self, lr, b1, b2, eps):
        self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps

    def init(self, w):
        return {"m": np.zeros_like(w), "v": np.zeros_like(w)}

    def step(self, w, g, state, t):
        alpha = self.lr * math.sqrt(1 - self.b2 ** t) / (1 - self.b1 ** t)
        state["m"] = state["m"] + (g - state["m"]) * (1 - self.b1)
        state["v"] = state["v"] + (g * g - state["v"]) * (1 - self.b2)
        return w - alpha * state["m"] / (np.sqrt(state["v"]) + self.eps)


CASES = {
    "sgd": (SGD(learning_rate=0.1), RefSGD(0.1)),
    "momentum": (Momentum(learning_rate=0.05, momentum=0.9),
                 RefMomentum(0.05, 0.9, nesterov=False)),
    "nesterov": (Momentum(learning_rate=0.05, momentum=0.8, nesterov=True),
                 RefMomentum(0.05, 0.8, nesterov=True)),
    "adagrad": (Adagrad(learning_rate=0.1, initial_accumulator_value=0.2, epsilon=1e-7),
                RefAdagrad(0.1, 0.2, 1e-7)),
    "adam": (Adam(learning_rate=0.01, beta_1=0.9, beta_2=0.999, epsilon=1e-7),
             RefAdam(0.01, 0.9, 0.999, 1e-7)),
    "adam_odd_betas": (Adam(learning_rate=0.3, beta_1=0.5, beta_2=0.75, epsilon=1e-3),
                       RefAdam(0.3, 0.5, 0.75, 1e-3)),
}
EXPECTED_SLOTS = {"sgd": (), "momentum": ("momentum",), "nesterov": ("momentum",),
                  "adagrad": ("accumulator",), "adam": ("m", "v"), "adam_odd_betas": ("m", "v")}
TOLERANCE = {np.dtype("float32"): dict(rtol=1e-5, atol=1e-6),
             np.dtype("float64"): dict(rtol=1e-12, atol=1e-13)}

SIZE = 1000
STEPS = 6
CHUNK_BOUNDS = [0, 1, 2, 130, 131, 517, 999, SIZE]  # uneven, some of one element


def _run_kernel(config, dtype, w0, grads, chunked: bool):
    kernel = make_kernel(config)
    w = w0.astype(dtype)
    slots = {}
    for name in kernel.slot_names:
        slots[name] = np.full(w.size, np.nan, dtype=dtype)
        kernel.init_slot(name, slots[name])
    # Garbage in the scratch buffer: the kernel must not read it before writing.
    scratch = np.full(SIZE + 17, np.nan, dtype=dtype)
    bounds = CHUNK_BOUNDS if chunked else [0, SIZE]
    for t, g in enumerate(grads, start=1):
        g = g.astype(dtype)
        for a, b in zip(bounds, bounds[1:]):
            kernel.apply(w[a:b], g[a:b], {k: v[a:b] for k, v in slots.items()}, t, scratch)
    return w, slots


def _run_reference(ref, w0, grads):
    w = w0.astype(np.float64)
    state = ref.init(w)
    for t, g in enumerate(grads, start=1):
        w = ref.step(w, g.astype(np.float64), state, t)
    return w, state


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [np.dtype("float32"), np.dtype("float64")])
def test_kernel_matches_reference(case, dtype):
    config, ref = CASES[case]
    rng = np.random.default_rng(1234)
    w0 = rng.normal(size=SIZE)
    grads = [rng.normal(scale=scale, size=SIZE) for scale in (1.0, 0.1, 3.0, 0.5, 1.0, 2.0)]
    assert len(grads) == STEPS
    # Values exactly representable in dtype, so both sides start from the same numbers.
    w0 = w0.astype(dtype).astype(np.float64)
    grads = [g.astype(dtype).astype(np.float64) for g in grads]

    expected_w, expected_state = _run_reference(ref, w0, grads)
    for chunked in (True, False):
        w, slots = _run_kernel(config, dtype, w0, grads, chunked)
        assert w.dtype == dtype
        assert tuple(slots) == EXPECTED_SLOTS[case]
        np.testing.assert_allclose(w, expected_w, **TOLERANCE[dtype])
        for name in slots:
            np.testing.assert_allclose(slots[name], expected_state[name], **TOLERANCE[dtype])
    # The update really moved the weights (a no-op kernel would fail above, but be explicit).
    assert not np.allclose(expected_w, w0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_chunked_and_whole_application_are_bit_identical(case):
    config, _ = CASES[case]
    rng = np.random.default_rng(99)
    w0 = rng.normal(size=SIZE)
    grads = [rng.normal(size=SIZE) for _ in range(STEPS)]
    w_chunked, slots_chunked = _run_kernel(config, np.float32, w0, grads, chunked=True)
    w_whole, slots_whole = _run_kernel(config, np.float32, w0, grads, chunked=False)
    assert w_chunked.tobytes() == w_whole.tobytes()
    for name in slots_whole:
        assert slots_chunked[name].tobytes() == slots_whole[name].tobytes()


def _float16_gradients(rng, steps):
    # |g| in [0.5, 2]: (1 - beta_2) * g**2 stays representable in float16.
    return [(rng.uniform(0.5, 2.0, size=SIZE) * rng.choice([-1.0, 1.0], size=SIZE))
            .astype(np.float16).astype(np.float64) for _ in range(steps)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_float16_variables_follow_the_reference_loosely(case):
    config, ref = CASES[case]
    rng = np.random.default_rng(5)
    w0 = rng.normal(size=SIZE).astype(np.float16).astype(np.float64)
    grads = _float16_gradients(rng, 3)
    expected_w, _ = _run_reference(ref, w0, grads)
    w, _ = _run_kernel(config, np.float16, w0, grads, chunked=True)
    assert w.dtype == np.float16
    np.testing.assert_allclose(w.astype(np.float64), expected_w, rtol=1e-2, atol=1e-2)


def test_float16_adam_step_is_bounded_for_small_gradients():
    # Adam's first step is ~lr * sign(g) for any gradient scale. A float16
    # variable is updated in float32 (slots too), so g*g cannot underflow.
    spec = VariableSpec("h", (4,), "float16", optimizer=Adam(learning_rate=0.01))
    part = VariablePart(spec, 0, 4, True)
    part.allocate_and_fill()
    assert all(slot.dtype == np.float32 for slot in part.slots.values())
    g = np.array([1e-3, -5e-3, 0.5, -1.0], dtype=np.float16)
    part.apply_gradient(0, g, part.reserve_step())
    assert part.value.dtype == np.float16
    np.testing.assert_allclose(part.value.astype(np.float64), -0.01 * np.sign(g.astype(np.float64)),
                               rtol=5e-3)  # epsilon shaves 0.3% off the smallest


def test_adam_first_step_moves_every_weight_by_about_the_learning_rate():
    # Keras' Adam: the first step is ~lr * sign(g) whatever the gradient's scale.
    kernel = make_kernel(Adam(learning_rate=0.01))
    w = np.zeros(5, dtype=np.float64)
    g = np.array([0.1, -2.0, 50.0, -1e3, 0.5])
    slots = {"m": np.zeros(5), "v": np.zeros(5)}
    kernel.apply(w, g, slots, 1, np.empty(5))
    np.testing.assert_allclose(w, -0.01 * np.sign(g), rtol=1e-3)


# ---- through VariablePart -------------------------------------------------------------


def _part(optimizer, shape=(40, 25), dtype="float32", initializer=None):
    spec = VariableSpec("opt/var", shape, dtype,
                        initializer=initializer or Uniform(-1.0, 1.0),
                        optimizer=optimizer, partitioner=FixedShardsPartitioner(1))
    part = VariablePart(spec, 0, shape[0], True)
    with part.lock:
        part.allocate_and_fill()
    return part


@pytest.mark.parametrize("case", sorted(CASES))
def test_variable_part_applies_optimizer_with_its_slots(case):
    config, ref = CASES[case]
    part = _part(config)
    assert part.elements == 1000
    assert tuple(part.slots) == EXPECTED_SLOTS[case]
    assert part.nbytes == 1000 * 4 * (1 + len(EXPECTED_SLOTS[case]))
    assert part.initialized
    # Slots start at the optimizer's initial value.
    for name, slot in part.slots.items():
        assert slot.shape == (1000,) and slot.dtype == np.float32
        expected = 0.2 if name == "accumulator" else 0.0
        assert (slot == np.float32(expected)).all()

    w0 = part.value.astype(np.float64).copy()
    rng = np.random.default_rng(7)
    grads = [rng.normal(size=1000).astype(np.float32).astype(np.float64) for _ in range(4)]
    for t, g in enumerate(grads, start=1):
        step = part.reserve_step()
        assert step == t
        for a, b in zip(CHUNK_BOUNDS, CHUNK_BOUNDS[1:]):
            part.apply_gradient(a, g[a:b].astype(np.float32), step)
    assert part.info().optimizer_steps == 4
    expected_w, expected_state = _run_reference(ref, w0, grads)
    np.testing.assert_allclose(part.value, expected_w, rtol=1e-5, atol=1e-6)
    for name, slot in part.slots.items():
        np.testing.assert_allclose(slot, expected_state[name], rtol=1e-5, atol=1e-6)
        assert not np.allclose(slot, 0.2 if name == "accumulator" else 0.0)


@pytest.mark.parametrize("wire", [np.dtype("<f2"), BFLOAT16])
def test_variable_part_widens_narrow_gradients(wire):
    part = _part(Adam(learning_rate=0.01))
    w0 = part.value.astype(np.float64).copy()
    g = np.linspace(-2, 2, 1000).astype(wire)
    step = part.reserve_step()
    part.apply_gradient(0, g[:600], step)
    part.apply_gradient(600, g[600:], step)
    expected_w, expected_state = _run_reference(CASES["adam"][1], w0, [g.astype(np.float64)])
    np.testing.assert_allclose(part.value, expected_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(part.slots["v"], expected_state["v"], rtol=1e-5, atol=1e-9)


def test_variable_part_chunks_update_only_their_elements():
    part = _part(Momentum(learning_rate=0.1, momentum=0.5), initializer=Constant(1.0))
    step = part.reserve_step()
    part.apply_gradient(100, np.ones(50, dtype=np.float32), step)
    expected = np.ones(1000, dtype=np.float32)
    expected[100:150] = np.float32(1.0) - np.float32(0.1)
    np.testing.assert_array_equal(part.value, expected)
    momentum = np.zeros(1000, dtype=np.float32)
    momentum[100:150] = 1.0
    np.testing.assert_array_equal(part.slots["momentum"], momentum)


def test_variable_part_read_converts_to_wire_dtype():
    part = _part(SGD(), initializer=Constant(1.0 / 3.0))
    got = part.read(10, 5, np.dtype("<f2"), lambda values, version: (values.copy(), version))
    values, version = got
    assert version == 0
    assert values.dtype == np.float16
    np.testing.assert_array_equal(values, np.full(5, 1.0 / 3.0, dtype=np.float16))
    same = part.read(0, 3, np.dtype("<f4"), lambda values, version: values.copy())
    np.testing.assert_array_equal(same, np.full(3, np.float32(1.0 / 3.0)))


def test_finish_push_counts_versions():
    part = _part(SGD())
    assert part.finish_push() == 1
    assert part.finish_push() == 2
    assert part.info().version == 2


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_adam_gives_the_same_bits_as_the_numpy_kernel(dtype):
    pytest.importorskip("numba")
    rng = np.random.default_rng(7)
    n = 10_000
    start = {"w": rng.standard_normal(n).astype(dtype), "m": (rng.standard_normal(n) * 0.1).astype(dtype),
             "v": (rng.random(n) * 0.01).astype(dtype)}
    g = (rng.standard_normal(n) * 0.01).astype(dtype)
    results = {}
    for fused in (True, False):
        kernel = make_kernel(Adam(learning_rate=0.3, beta_1=0.8, beta_2=0.95, epsilon=1e-6))
        kernel.fused = fused
        w, slots = start["w"].copy(), {"m": start["m"].copy(), "v": start["v"].copy()}
        for step in (1, 2, 3):
            kernel.apply(w, g, slots, step, np.empty(n, dtype))
        results[fused] = (w, slots["m"], slots["v"])
    for a, b in zip(results[True], results[False]):
        assert a.tobytes() == b.tobytes()
    assert not np.array_equal(results[True][0], start["w"])
    from ps_server.core.fused import fused_adam  # and the compiled pass did run

    w = start["w"].copy()
    assert fused_adam(w, g, start["m"].copy(), start["v"].copy(), 0.9, 0.999, 1e-7, 0.01)
    assert not np.array_equal(w, start["w"])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_adam_takes_a_read_only_unaligned_gradient_with_the_same_bits(dtype):
    pytest.importorskip("numba")
    from ps_server.core.fused import fused_adam

    rng = np.random.default_rng(11)
    n = 1_000
    g = (rng.standard_normal(n) * 0.01).astype(dtype)
    unaligned = np.frombuffer(memoryview(bytes(1) + g.tobytes())[1:], dtype)
    assert not unaligned.flags.aligned and not unaligned.flags.writeable  # as read in place from a message
    start = {"w": rng.standard_normal(n).astype(dtype), "m": np.zeros(n, dtype), "v": np.zeros(n, dtype)}
    results = []
    for gradient in (g, unaligned):
        w, m, v = (start[k].copy() for k in ("w", "m", "v"))
        assert fused_adam(w, gradient, m, v, 0.9, 0.999, 1e-7, 0.01)
        results.append((w, m, v))
    for a, b in zip(*results):
        assert a.tobytes() == b.tobytes()
    assert not np.array_equal(results[1][0], start["w"])


def test_fused_adam_declines_arrays_it_cannot_take():
    from ps_server.core.fused import fused_adam

    w = np.zeros(8, np.float32)
    assert not fused_adam(w, np.zeros(8, np.float64), w.copy(), w.copy(), 0.9, 0.999, 1e-7, 0.01)
    assert not fused_adam(w, np.zeros(16, np.float32)[::2], w.copy(), w.copy(), 0.9, 0.999, 1e-7, 0.01)
    assert not fused_adam(w, np.zeros(4, np.float32), w.copy(), w.copy(), 0.9, 0.999, 1e-7, 0.01)
    assert not fused_adam(w.astype(np.float16), w.astype(np.float16), w.astype(np.float16),
                          w.astype(np.float16), 0.9, 0.999, 1e-7, 0.01)
    assert w.tolist() == [0.0] * 8


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_sgd_rows_give_the_same_bits_as_gather_update_scatter(dtype):
    pytest.importorskip("numba")
    rng = np.random.default_rng(11)
    rows = rng.choice(400, 64, replace=False)
    grads = rng.standard_normal((64, 25)).astype(dtype)
    results = {}
    for fused in (True, False):
        part = _part(SGD(learning_rate=0.37), shape=(400, 25), dtype=dtype)
        part.kernel.fused = fused
        before = part.value.copy()
        part.apply_rows(rows, grads)
        part.apply_rows(rows[::2], grads[::2].copy())
        results[fused] = part.value.copy()
    assert results[True].tobytes() == results[False].tobytes()
    changed = np.flatnonzero((results[True] != before).reshape(400, 25).any(axis=1))
    assert sorted(changed) == sorted(rows)  # only the rows pushed
    from ps_server.core.fused import fused_sgd_rows  # and the compiled loop did run

    table = np.zeros((4, 2), dtype)
    assert fused_sgd_rows(table, np.array([2, 0]), np.array([[1, 2], [3, 4]], dtype), 0.5)
    assert table.tolist() == [[-1.5, -2.0], [0, 0], [-0.5, -1.0], [0, 0]]
    unaligned = np.frombuffer(memoryview(bytes(1) + np.ones(4, dtype).tobytes())[1:], dtype).reshape(2, 2)
    assert not unaligned.flags.aligned  # as a gradient read in place from a message can be
    assert fused_sgd_rows(table, np.array([1, 3]), unaligned, 0.5)
    assert table.tolist() == [[-1.5, -2.0], [-0.5, -0.5], [-0.5, -1.0], [-0.5, -0.5]]


def test_fused_sgd_rows_declines_arrays_it_cannot_take():
    from ps_server.core.fused import fused_sgd_rows

    table = np.zeros((4, 2), np.float32)
    g = np.ones((2, 2), np.float32)
    assert not fused_sgd_rows(table, np.array([0, 4]), g, 0.1)  # a row outside the table
    assert not fused_sgd_rows(table, np.array([-1, 0]), g, 0.1)
    assert not fused_sgd_rows(table, np.array([0, 1]), g.astype(np.float64), 0.1)  # mixed dtypes
    assert not fused_sgd_rows(table, np.array([0, 1, 2]), g, 0.1)  # a gradient row short
    assert not fused_sgd_rows(table, np.array([0, 1]), np.ones((2, 4), np.float32)[:, ::2], 0.1)
    assert not fused_sgd_rows(table.astype(np.float16), np.array([0, 1]), g.astype(np.float16), 0.1)
    assert not fused_sgd_rows(table, np.array([0.0, 1.0]), g, 0.1)  # float "ids"
    assert table.tolist() == [[0.0, 0.0]] * 4
