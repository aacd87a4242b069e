"""wehub_ps.dtypes and the wire's dtype codes: bfloat16 without importing ml_dtypes until it is used.

The import checks run in a fresh interpreter: this test process has
imported ml_dtypes already.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np

from wehub_ps import dtypes
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.dtypes import numpy_dtype_or_code, to_numpy_dtype, to_wire_dtype

_NOT_IMPORTED = textwrap.dedent("""
    import sys
    import numpy as np
    import ps_server.server, ps_server.ops.cli, worker_client
    from wehub_ps.dtypes import dtype_name, is_bfloat16, is_wire_float, parse_dtype
    from wehub_ps.wire.dtypes import to_wire_dtype
    assert not is_bfloat16(np.dtype("<f4")) and is_wire_float(np.dtype("<f2"))
    assert dtype_name("float32") == "float32" and parse_dtype("float64") == np.dtype("<f8")
    assert to_wire_dtype(np.dtype("<f4")) > 0
    assert "ml_dtypes" not in sys.modules, "imported at start"
    if sys.argv[1] == "imported elsewhere":
        import ml_dtypes  # as JAX does
        assert is_bfloat16(np.dtype(ml_dtypes.bfloat16)) and is_wire_float(np.dtype(ml_dtypes.bfloat16))
        from wehub_ps.v1 import ps_pb2
        assert to_wire_dtype(np.dtype(ml_dtypes.bfloat16)) == ps_pb2.BFLOAT16
    else:
        assert str(parse_dtype("bfloat16")) == "bfloat16" and "ml_dtypes" in sys.modules
""")


def _run(mode: str) -> None:
    done = subprocess.run([sys.executable, "-c", _NOT_IMPORTED, mode], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def test_servers_and_workers_start_without_ml_dtypes():
    _run("asked for")


def test_bfloat16_of_ml_dtypes_imported_by_another_library_is_recognised():
    _run("imported elsewhere")


def test_bfloat16_names_and_wire_codes():
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    assert dtypes.bfloat16() == bf16 and dtypes.BFLOAT16 == bf16
    assert dtypes.WIRE_FLOAT_DTYPES == frozenset({np.dtype("<f2"), bf16})
    assert dtypes.dtype_name(bf16) == "bfloat16" and dtypes.parse_dtype("bfloat16") == bf16
    assert dtypes.is_wire_float(bf16) and not dtypes.is_wire_float(np.dtype("<f4"))
    assert to_wire_dtype(bf16) == ps_pb2.BFLOAT16 and to_numpy_dtype(ps_pb2.BFLOAT16) == bf16
    assert numpy_dtype_or_code(ps_pb2.BFLOAT16) == bf16 and numpy_dtype_or_code(999) == 999
