"""How the pod emulator fails: a render it cannot emulate faithfully, or a contract the
running programs break."""

from __future__ import annotations


class HarnessError(RuntimeError):
    """The render uses something this harness cannot emulate faithfully."""


class ContractError(AssertionError):
    """The rendered pod does not work with the program it runs."""
