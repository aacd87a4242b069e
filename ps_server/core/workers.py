"""A worker as requests name it: its identity checked, its lease renewed.

Heartbeats, pulls and pushes all carry a worker id and an incarnation;
the checks and the bookkeeping of a worker seen are one rule for all three.
"""

from __future__ import annotations

from ps_server.core.consistency import ConsistencyController
from ps_server.core.errors import RequestError
from ps_server.core.membership import Membership
from ps_server.core.pushes import MAX_WORKER_ID_LENGTH
from wehub_ps.errors import Reason

__all__ = ["check_worker", "WorkerPresence"]


def check_worker(worker_id: str, incarnation: str) -> None:
    """Refuse an empty or over-long worker id or incarnation (INVALID_REQUEST)."""
    if not worker_id or len(worker_id) > MAX_WORKER_ID_LENGTH:
        raise RequestError(Reason.INVALID_REQUEST,
                           f"worker_id must be 1 to {MAX_WORKER_ID_LENGTH} characters, got {worker_id!r}")
    if not incarnation or len(incarnation) > MAX_WORKER_ID_LENGTH:
        raise RequestError(Reason.INVALID_REQUEST, "incarnation must be a non-empty id of the worker process")


class WorkerPresence:
    """Renews leases and restarts the step clock of a worker that (re)joined."""

    def __init__(self, membership: Membership, consistency: ConsistencyController) -> None:
        self._membership = membership
        self._consistency = consistency

    def seen(self, worker_id: str, incarnation: str, step: int, pushed: bool = False) -> None:
        """A request of this worker arrived (a push renews a registered lease but registers nobody)."""
        if self._membership.seen(worker_id, incarnation, step, pushed, register=not pushed):
            self._consistency.forget(worker_id)  # a restarted worker rejoins at the cluster's step
