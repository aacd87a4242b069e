"""The compiled loops give the same bits as NumPy / ml_dtypes (numba installed), and are skipped cleanly otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from wehub_ps.dtypes import BFLOAT16
from wehub_ps.kernels.compiled import compiled
from wehub_ps.kernels.convert import _f32_to_bf16, cast_into

SPECIAL_BITS = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # zeros, infinities
                0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0xFF800001, 0xFFFFFFFF, 0x7F80FFFF,  # NaNs
                0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80000001, 0x00800000,  # extremes, subnormals
                0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001]  # ties to even, either side


def _float32_samples() -> np.ndarray:
    rng = np.random.default_rng(3)
    random_bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([np.array(SPECIAL_BITS, np.uint32), random_bits]).view(np.float32)


def test_float32_to_bfloat16_matches_ml_dtypes_bit_for_bit():
    pytest.importorskip("numba")
    assert compiled(_f32_to_bf16) is not None
    src = _float32_samples()
    dst = np.empty(src.size, BFLOAT16)
    cast_into(dst, src)
    with np.errstate(invalid="ignore"):
        expected = src.astype(BFLOAT16)
    assert dst.view(np.uint16).tobytes() == expected.view(np.uint16).tobytes()


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_bfloat16_to_float32_matches_ml_dtypes_for_every_bit_pattern(offset):
    """The widening shift gives ml_dtypes' bits, NaN payloads and subnormals included."""
    patterns = np.arange(1 << 16, dtype=np.uint16)
    message = bytes(offset) + patterns.tobytes()  # a message's chunk may start at any byte
    src = np.frombuffer(message, np.uint8, patterns.nbytes, offset).view(BFLOAT16)
    assert src.flags.aligned == (offset == 0)
    dst = np.empty(src.size, np.float32)
    cast_into(dst, src)
    expected = patterns.view(BFLOAT16).astype(np.float32)
    assert dst.view(np.uint32).tobytes() == expected.view(np.uint32).tobytes()
    square = np.empty((256, 256), np.float32)
    cast_into(square, src.reshape(256, 256))
    assert square.tobytes() == dst.tobytes()


@pytest.mark.parametrize("make", [
    lambda src: (np.empty(src.size, np.float16), src),  # another narrowing: NumPy's cast
    lambda src: (np.empty(src.size // 2, BFLOAT16), src[::2]),  # strided source: NumPy's cast
])
def test_other_casts_fall_back_to_numpy(make):
    src = np.linspace(-3, 3, 1000, dtype=np.float32)
    dst, source = make(src)
    cast_into(dst, source)
    assert dst.tobytes() == source.astype(dst.dtype).tobytes()


def test_ps_compiled_loops_0_keeps_numpy_and_never_imports_numba():
    code = textwrap.dedent("""
        import sys
        import numpy as np
        from wehub_ps.kernels.compiled import compiled
        from wehub_ps.kernels.convert import _f32_to_bf16, cast_into
        from wehub_ps.dtypes import BFLOAT16
        from ps_server.core.fused import fused_adam, fused_sgd_rows
        assert compiled(_f32_to_bf16) is None
        w = np.zeros(8, np.float32)
        assert not fused_adam(w, w.copy(), w.copy(), w.copy(), 0.9, 0.999, 1e-7, 0.01)
        assert not fused_sgd_rows(w.reshape(4, 2), np.array([0, 1]), np.ones((2, 2), np.float32), 0.1)
        dst = np.empty(8, BFLOAT16)
        cast_into(dst, np.linspace(-1, 1, 8, dtype=np.float32))
        assert dst.tolist() == np.linspace(-1, 1, 8, dtype=np.float32).astype(BFLOAT16).tolist()
        assert "numba" not in sys.modules
    """)
    env = {**os.environ, "PS_COMPILED_LOOPS": "0"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


def test_compiled_soon_answers_at_once_and_builds_on_a_thread():
    """The first call returns None without waiting (the caller's NumPy path runs), the build goes on
    on a thread of its own, started once however many calls ask meanwhile, and later calls get the loop."""
    pytest.importorskip("numba")
    import threading
    import time

    from wehub_ps.kernels.compiled import compiled_soon

    def _double(a):  # a loop no other test builds
        for i in range(a.shape[0]):
            a[i] *= 2.0

    before = {t.ident for t in threading.enumerate()}
    assert compiled_soon(_double) is None
    compiled_soon(_double)  # asked again while building (or built already): no second builder
    builders = [t for t in threading.enumerate() if t.ident not in before and t.name == "ps-compile"]
    assert len(builders) <= 1
    deadline = time.monotonic() + 60
    while (kernel := compiled_soon(_double)) is None:
        assert time.monotonic() < deadline, "the loop was never built"
        time.sleep(0.02)
    a = np.arange(4.0)
    kernel(a)
    assert a.tolist() == [0.0, 2.0, 4.0, 6.0]
