"""Skip cleanly when a deployment-check tool is not installed."""

from __future__ import annotations

import pytest


def require(module: str, what: str):
    """Import a tool's module or skip the calling test module, saying how to get it."""
    return pytest.importorskip(module, reason=f"{what} is not installed ({module} not importable); "
                                              "pip install -e '.[dev]' provides it")
