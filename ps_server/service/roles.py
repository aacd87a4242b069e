"""What the RPC methods ask of a shard's replica role.

An unreplicated shard (``--replicas 1``) is always the primary and orders
nothing: :class:`SingleReplica`. A replicated one hands its methods the
replication layer's role (``ps_server.replication``), which refuses work on
a backup (NOT_PRIMARY, naming the primary), puts every change in one order
and streams it to the backups, and acknowledges a change only once every
in-sync backup applied it and this replica can still prove it is primary.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Protocol

from ps_server.core.errors import RequestError
from wehub_ps.errors import Reason
from wehub_ps.v1 import ps_pb2

__all__ = ["ShardRole", "SingleReplica"]


class ShardRole(Protocol):
    #: False: every method below is free (no order, nothing to wait for).
    replicated: bool

    def check_primary(self) -> None:
        """RequestError(NOT_PRIMARY) with the primary's address unless this replica serves workers."""

    def ordered(self) -> AbstractContextManager[None]:
        """Held while a change is applied and logged (see ps_server.core.ordering)."""

    def next_stream(self) -> int:
        """A number for a push stream, unique on this primary."""

    def push_applied(self, stream: int, begin: ps_pb2.PushBegin | None, message: bytes | memoryview,
                     completed: bool = False) -> int:
        """Under ``ordered``: a push message was applied (``begin`` with its stream's first; ``completed``:
        the push finished with it); its sequence. ``message`` is kept, not copied: never reuse it."""

    def push_ended(self, stream: int, begin: ps_pb2.PushBegin | None, completed: bool) -> int:
        """Under ``ordered``: a push stream ended, whole (finished) or broken; its sequence."""

    def push_decided(self, stream: int, step: int, accumulate: bool, tables: list) -> int:
        """Under ``ordered``: a sync push stream's decision for ``step`` (``tables``: (name, ids) pinned); its
        sequence."""

    def variable_created(self, spec: ps_pb2.VariableSpec) -> int:
        """Under ``ordered``: a variable was created; its sequence."""

    def finishing(self) -> int:
        """Under ``ordered``: a worker's finish() ends the job; the backups end too. Its sequence."""

    def checkpointed(self) -> int:
        """Under ``ordered``: a worker asked for a checkpoint; the backups write one too. Its sequence."""

    def last_sequence(self) -> int:
        """The sequence of the newest change ordered so far."""

    def acknowledge(self, sequence: int, timeout: float | None) -> None:
        """Wait until every in-sync backup applied ``sequence``; RequestError(NOT_PRIMARY) if deposed."""

    def status(self) -> ps_pb2.ReplicaStatus | None:
        """For Describe; None when unreplicated."""

    def switch_over(self, to_replica: int | None, timeout: float) -> tuple[int, str]:
        """A planned switchover: hand the primary role to an in-sync backup (``to_replica``, or the one
        furthest along); its index and address. RequestError when it cannot."""


class SingleReplica:
    """``--replicas 1``: the only replica, always the primary."""

    replicated = False

    def check_primary(self) -> None:
        return None

    def ordered(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def next_stream(self) -> int:
        return 0

    def push_applied(self, stream: int, begin: ps_pb2.PushBegin | None, message: bytes | memoryview,
                     completed: bool = False) -> int:
        return 0

    def push_ended(self, stream: int, begin: ps_pb2.PushBegin | None, completed: bool) -> int:
        return 0

    def push_decided(self, stream: int, step: int, accumulate: bool, tables: list) -> int:
        return 0

    def variable_created(self, spec: ps_pb2.VariableSpec) -> int:
        return 0

    def finishing(self) -> int:
        return 0

    def checkpointed(self) -> int:
        return 0

    def last_sequence(self) -> int:
        return 0

    def acknowledge(self, sequence: int, timeout: float | None) -> None:
        return None

    def status(self) -> ps_pb2.ReplicaStatus | None:
        return None

    def switch_over(self, to_replica: int | None, timeout: float) -> tuple[int, str]:
        raise RequestError(Reason.SWITCHOVER_REFUSED,
                           "this ps-server runs unreplicated (--replicas 1): there is no backup to hand over to")
