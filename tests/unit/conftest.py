"""Tier 1: pure unit tests (no servers, no network).

Makes the repository root importable when this directory is run on its own.
"""

import pathlib
import sys

_ROOT = str(pathlib.Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
