"""``ps-local --script``: a user's script run once per worker on a local cluster, its status passed on."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from etcd_server import etcd_binary
from ps_testing import ROOT, child_env, process_alive

# Each copy pushes (index + 1) five times with SGD at 1.0, then waits for the others' pushes: the
# variable ends at -5 * (1 + ... + count) exactly, which only a shared cluster gives.
SCRIPT = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from worker_client import SGD, PSClient

    index, count = int(os.environ["PS_WORKER_INDEX"]), int(os.environ["PS_NUM_WORKERS"])
    print("pid", os.getpid(), "addresses", os.environ["PS_ADDRESSES"], flush=True)
    if "--fail" in sys.argv:
        if index == 1:
            print("failing on purpose", file=sys.stderr, flush=True)
            sys.exit(3)
        time.sleep(120)  # ps-local must stop this copy when the other one fails
    with PSClient.from_env() as client:
        client.create_variable("w", (4,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        for _ in range(5):
            client.push({"w": np.full(4, index + 1.0, np.float32)})
        expected = -5.0 * sum(range(1, count + 1))
        deadline = time.monotonic() + 60
        while client.pull(["w"])["w"][0] != expected and time.monotonic() < deadline:
            time.sleep(0.05)
        print("worker", client.worker_id, index, count, "args", sys.argv[1:], "w", client.pull(["w"])["w"].tolist())
""")


def _run(tmp_path, *flags: str, timeout: float = 240) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, "-m", "ps_local", "--script", str(script), *flags],
                          capture_output=True, text=True, cwd=str(ROOT), env=child_env(), timeout=timeout)


def _refused(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError:
        return True
    return False


def _addresses(stdout: str) -> list[str]:
    found = set()
    for line in re.findall(r"addresses (\S+)", stdout):
        found.update(a for shard in line.split(",") for a in shard.split("|"))
    return sorted(found)


def test_each_worker_runs_the_script_with_its_place_and_arguments(tmp_path):
    result = _run(tmp_path, "--workers", "2", "--servers", "2", "--", "--lr", "0.5")
    assert result.returncode == 0, result.stdout + result.stderr
    for index in range(2):
        line = next(line for line in result.stdout.splitlines() if line.startswith(f"[worker-{index}] worker "))
        assert line == (f"[worker-{index}] worker worker-{index} {index} 2 args ['--lr', '0.5'] "
                        f"w [-15.0, -15.0, -15.0, -15.0]")
    addresses = _addresses(result.stdout)
    assert len(addresses) == 2 and all(_refused(a) for a in addresses)  # the servers are gone


def test_a_failing_copy_stops_everything_and_its_status_is_ps_locals(tmp_path):
    result = _run(tmp_path, "--workers", "2", "--servers", "1", "--", "--fail")
    assert result.returncode == 3, result.stdout + result.stderr
    assert "[worker-1] failing on purpose" in result.stdout  # stderr streamed with its prefix
    assert "worker-1 (" in result.stdout and "exited with code 3" in result.stdout
    pids = [int(p) for p in re.findall(r"\] pid (\d+)", result.stdout)]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(process_alive(p) for p in pids), "a copy of the script was left running"
    assert all(_refused(a) for a in _addresses(result.stdout))


def test_replicated_shards_start_etcd_and_the_script_follows_their_primaries(tmp_path):
    if etcd_binary() is None:
        if os.environ.get("WEHUB_PS_REQUIRE_ETCD") == "1":
            pytest.fail("etcd is not installed (WEHUB_PS_REQUIRE_ETCD=1 requires it)")
        pytest.skip("etcd is not installed: apt-get install etcd-server, or set ETCD_BINARY")
    result = _run(tmp_path, "--workers", "2", "--servers", "2", "--replicas", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 ps-servers x 2 replicas" in result.stdout
    assert result.stdout.count("w [-15.0, -15.0, -15.0, -15.0]") == 2
    addresses = _addresses(result.stdout)
    assert len(addresses) == 4 and all(_refused(a) for a in addresses)


def test_arguments_after_the_separator_need_a_script(tmp_path):
    result = subprocess.run([sys.executable, "-m", "ps_local", "--", "--lr", "1"], capture_output=True, text=True,
                            cwd=str(ROOT), env=child_env(), timeout=60)
    assert result.returncode == 2 and "passed to a --script" in result.stderr
    result = subprocess.run([sys.executable, "-m", "ps_local", "--script", str(tmp_path / "missing.py")],
                            capture_output=True, text=True, cwd=str(ROOT), env=child_env(), timeout=60)
    assert result.returncode == 2 and "no such file" in result.stderr
