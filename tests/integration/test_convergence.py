"""The default example trains through real servers to its accuracy target."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
from ps_testing import ROOT, child_env, children_of, process_alive


def test_ps_local_trains_digits_to_target_accuracy():
    result = subprocess.run([sys.executable, "-m", "ps_local", "--num-ps", "2", "--num-workers", "2"],
                            capture_output=True, text=True, cwd=str(ROOT), env=child_env(), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    match = re.search(r"held-out accuracy (\d\.\d+) \(target 0\.9\)", result.stdout)
    assert match, result.stdout
    assert float(match.group(1)) >= 0.90
    assert "step" in result.stdout and "examples/s" in result.stdout  # progress was shown
    assert "tensors went over the wire as float32\n" in result.stdout


@pytest.mark.parametrize("flags, reported", [
    (["--wire-dtype", "bfloat16"], "as bfloat16\n"),
    (["--topk-ratio", "0.05"], "as float32, gradients as the top 0.05 of their rows\n"),
])
def test_ps_local_compresses_when_asked_and_still_reaches_the_target(flags, reported):
    # --wire-dtype once stopped at ps-local's own parser: the workers sent float32.
    result = subprocess.run([sys.executable, "-m", "ps_local", "--num-ps", "1", "--num-workers", "1", *flags],
                            capture_output=True, text=True, cwd=str(ROOT), env=child_env(), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tensors went over the wire " + reported in result.stdout
    match = re.search(r"held-out accuracy (\d\.\d+) \(target 0\.9\)", result.stdout)
    assert match and float(match.group(1)) >= 0.90, result.stdout


def test_ps_local_fails_loudly_when_the_target_is_missed():
    # One epoch at a tiny learning rate cannot reach 90%: the run must say so and exit 1.
    result = subprocess.run([sys.executable, "-m", "ps_local", "--num-ps", "1", "--num-workers", "1",
                             "--epochs", "1", "--set", "learning_rate=0.0001"],
                            capture_output=True, text=True, cwd=str(ROOT), env=child_env(), timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "NOT reached" in result.stdout


@pytest.mark.skipif(not pathlib.Path("/proc").is_dir(), reason="reads processes from /proc")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGKILL])
def test_ps_local_stops_every_process_it_started_on_ctrl_c_and_when_killed(signum):
    launcher = subprocess.Popen([sys.executable, "-m", "ps_local", "--num-ps", "2", "--num-workers", "2",
                                 "--epochs", "1000"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                cwd=str(ROOT), env=child_env())
    started: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(started) < 4:  # 2 servers and 2 workers
            assert launcher.poll() is None and time.monotonic() < deadline, "ps-local did not start its processes"
            time.sleep(0.2)
            started = children_of(launcher.pid)
        launcher.send_signal(signum)
        launcher.wait(60)
        deadline = time.monotonic() + 30
        while [pid for pid in started if process_alive(pid)]:
            assert time.monotonic() < deadline, f"left running: {[pid for pid in started if process_alive(pid)]}"
            time.sleep(0.2)
    finally:
        for pid in started:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
