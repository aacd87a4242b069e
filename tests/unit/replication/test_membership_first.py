"""A replicated primary logs who is live before the next change it orders (ps_server/replication/role.py).

The replica elected next decides sync steps with the workers its log told it of: a worker that
joined after the last consistency record would not be waited for. The loop that logs the state
every 50 ms can be late (a stalled loop, a kill in between), so a change of the live set is
logged at the latest before the next ordered change, and a push acknowledged after that change
reached the backups with it. In one process: a primary role over a real update log, its
membership and sync controller, the records it appends captured and decoded.
"""

from __future__ import annotations

import json

from ps_server.core.consistency import ConsistencyController
from ps_server.core.membership import Membership
from ps_server.core.store import VariableStore
from ps_server.replication.log import UpdateLog
from ps_server.replication.role import PRIMARY, ReplicaRole, ReplicaSettings
from wehub_ps.v1 import ps_pb2


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _primary(membership: Membership) -> tuple[ReplicaRole, list[ps_pb2.ReplicationRecord]]:
    settings = ReplicaSettings(replica_index=0, replicas=2, address="127.0.0.1:1", incarnation=7,
                               lease_seconds=1.0, replication_timeout=0.4, failover_after=0.6,
                               backup_stall_timeout=5.0, max_backup_bytes=1 << 20, consistency="sync")
    role = ReplicaRole(settings, lambda has_state: None)
    consistency = ConsistencyController("sync", 0, 0, membership, VariableStore(0, 1, 1 << 30))
    role.consistency_state = consistency.snapshot
    role.membership_generation = lambda: membership.generation
    role._state, role._log = PRIMARY, UpdateLog()  # elected: what the role loop sets
    logged: list[ps_pb2.ReplicationRecord] = []
    append = role._append

    def captured(op: list, nbytes: int) -> int:
        logged.append(ps_pb2.ReplicationRecord.FromString(b"".join(bytes(piece) for piece in op)))
        return append(op, nbytes)

    role._append = captured
    return role, logged


def _live(record: ps_pb2.ReplicationRecord) -> list[str]:
    assert record.WhichOneof("op") == "consistency", record
    return sorted(w["worker_id"] for w in json.loads(record.consistency)["workers"] if w["live"])


def test_workers_that_joined_are_logged_before_the_next_ordered_change():
    clock = FakeClock()
    membership = Membership(10.0, clock)
    role, logged = _primary(membership)
    membership.seen("a", "1", 0)
    with role.ordered():
        role.checkpointed()
    assert [r.WhichOneof("op") for r in logged] == ["consistency", "checkpoint"] and _live(logged[0]) == ["a"]

    # Renewals and pushes change no live set: nothing more is logged before the next change.
    membership.seen("a", "1", 0)
    membership.seen("a", "1", 1, pushed=True, register=False)
    logged.clear()
    with role.ordered():
        role.checkpointed()
    assert [r.WhichOneof("op") for r in logged] == ["checkpoint"]

    # Two join, one restarts: the next change comes after a record naming them.
    membership.seen("b", "1", 0)
    membership.seen("c", "1", 0)
    membership.seen("a", "2", 0)
    logged.clear()
    with role.ordered():
        role.checkpointed()
        with role.ordered():  # the order is re-entrant: logged once, before the outer change
            role.checkpointed()
    assert [r.WhichOneof("op") for r in logged] == ["consistency", "checkpoint", "checkpoint"]
    assert _live(logged[0]) == ["a", "b", "c"]
    incarnations = {w["worker_id"]: w["incarnation"] for w in json.loads(logged[0].consistency)["workers"]}
    assert incarnations["a"] == "2"

    # One leaves, one's lease runs out: logged as well.
    membership.leave("b", "1")
    clock.now += 5.0
    membership.seen("a", "2", 0)
    clock.now += 6.0
    assert membership.expire() == ["c"]
    logged.clear()
    with role.ordered():
        role.checkpointed()
    assert [r.WhichOneof("op") for r in logged] == ["consistency", "checkpoint"] and _live(logged[0]) == ["a"]


def test_the_generation_moves_only_when_the_live_set_or_an_incarnation_changes():
    clock = FakeClock()
    membership = Membership(10.0, clock)
    moves = []

    def generation_after(action) -> None:
        before = membership.generation
        action()
        moves.append(membership.generation - before)

    generation_after(lambda: membership.seen("a", "1", 0))  # joins
    generation_after(lambda: membership.seen("a", "1", 3))  # renews
    generation_after(lambda: membership.seen("a", "1", 3, pushed=True, register=False))  # renews by a push
    generation_after(lambda: membership.seen("x", "1", 0, pushed=True, register=False))  # no worker: ignored
    generation_after(lambda: membership.seen("a", "2", 0))  # restarts
    generation_after(lambda: membership.leave("a", "2"))  # leaves
    generation_after(lambda: membership.seen("a", "2", 0))  # back
    clock.now += 11.0
    generation_after(membership.expire)  # its lease ran out
    generation_after(membership.expire)  # nothing more ran out
    generation_after(lambda: membership.restore(membership.snapshot()))  # a backup takes its primary's table
    assert moves == [1, 0, 0, 0, 1, 1, 1, 1, 0, 1]
