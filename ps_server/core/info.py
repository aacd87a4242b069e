"""What the store reports about one variable part."""

from __future__ import annotations

from dataclasses import dataclass

from wehub_ps.placement import rows_of
from wehub_ps.specs import VariableSpec

__all__ = ["VariableInfo"]


@dataclass(frozen=True)
class VariableInfo:
    """A consistent snapshot of one variable's metadata on this shard."""

    spec: VariableSpec
    row_start: int
    row_end: int
    version: int
    initialized: bool
    optimizer_steps: int

    num_rows: int = 0
    evicted_rows: int = 0
    expired_rows: int = 0
    admitted_rows: int = 0
    unadmitted_reads: int = 0
    dropped_gradient_rows: int = 0
    memory_hits: int = 0
    cold_reads: int = 0
    rows_on_disk: int = 0
    disk_bytes: int = 0

    @property
    def elements(self) -> int:
        return (self.row_end - self.row_start) * rows_of(self.spec.shape)[1]
