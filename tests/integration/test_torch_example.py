"""``ps-local --example torch-digits`` trains a PyTorch model through real servers to its target."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from ps_testing import ROOT, child_env

pytest.importorskip("torch")


def test_ps_local_trains_the_torch_digits_example_to_target_accuracy():
    result = subprocess.run([sys.executable, "-m", "ps_local", "--example", "torch-digits",
                             "--num-ps", "2", "--num-workers", "2"],
                            capture_output=True, text=True, cwd=str(ROOT), env=child_env(), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    match = re.search(r"held-out accuracy (\d\.\d+) \(target 0\.9\)", result.stdout)
    assert match, result.stdout
    assert float(match.group(1)) >= 0.90
    assert "examples/s" in result.stdout  # progress was shown
