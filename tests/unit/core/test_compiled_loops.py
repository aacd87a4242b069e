"""Compiled loops prepared ahead of the first push: which ones, and when a server starts preparing them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from ps_server.core import fused
from ps_server.core.fused import loops_for, prepare
from wehub_ps.kernels import compiled as compiled_module
from wehub_ps.specs import SGD, Adagrad, Adam, VariableSpec


def test_loops_for_names_the_loops_pushes_will_run():
    specs = [VariableSpec("a", (4,), "float32", optimizer=Adam()),
             VariableSpec("s", (4,), "float32", optimizer=SGD()),
             VariableSpec("t", (8,), "float32", optimizer=SGD(), hash_table=True),
             VariableSpec("g", (4,), "float32", optimizer=Adagrad())]
    assert loops_for(specs) == ["adam", "sgd_rows"]
    # A dense SGD variable alone loads no numba: only a push of its rows would use the loop.
    assert loops_for(specs[1:2] + specs[3:]) == []


def test_prepare_builds_the_loops_a_push_then_uses():
    pytest.importorskip("numba")
    prepare(["adam", "sgd_rows"])
    built = compiled_module._built
    assert built[fused._adam] is compiled_module.compiled(fused._adam, fused._adam_signatures)
    assert built[fused._sgd_rows] is not None


def test_prepare_refuses_an_unknown_loop():
    with pytest.raises(ValueError, match="'adam' or 'sgd_rows'"):
        prepare(["momentum"])


_CACHE_IN = textwrap.dedent("""
    import os, sys
    from wehub_ps.kernels.compiled import cache_in
    cache_in("/first")
    cache_in("/second")
    print(os.environ["NUMBA_CACHE_DIR"])
""")


@pytest.mark.parametrize("preset, expected", [(None, "/first"), ("/mine", "/mine")])
def test_cache_in_leaves_a_numba_cache_dir_set_by_the_user(preset, expected):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    if preset:
        env["NUMBA_CACHE_DIR"] = preset
    done = subprocess.run([sys.executable, "-c", _CACHE_IN], capture_output=True, text=True, timeout=60,
                          env=env, check=True)
    assert done.stdout.strip() == expected


def test_a_server_prepares_its_loops_once_its_port_file_is_written(tmp_path, monkeypatch):
    from ps_server import ServerConfig, create_server
    from ps_server import server as server_module

    port_file = tmp_path / "port"
    calls = []
    done = threading.Event()

    def record(loops):
        calls.append((list(loops), port_file.exists(), threading.current_thread().name))
        done.set()

    monkeypatch.setattr(server_module, "prepare", record)
    server = create_server(ServerConfig(host="127.0.0.1", port=0, port_file=str(port_file)))
    server.store.create(VariableSpec("w", (4,), "float32", optimizer=Adam()))
    server.start()
    try:
        assert done.wait(30)
        assert calls == [(["adam"], True, "ps-compile")]
    finally:
        server.stop(grace=0)
