"""The replica's role loop outlives etcd failing at any step of a rejoin (ps_server/replication/role.py).

A coordination that stands in for ShardCoordinator (etcd cannot fail on cue here): its first
rejoin starts a lease but fails the leader watch's first read, as an etcd that goes away
again between the two calls does. The loop must try again and end up rejoined, its thread alive.
"""

from __future__ import annotations

import threading
import time

from ps_server.coordination.errors import CoordinationError
from ps_server.coordination.positions import NO_STATE
from ps_server.replication.role import ReplicaRole, ReplicaSettings


class _Coordination:
    """Answers as an etcd with no leader and nobody else would; ``watch_fails`` times its watch fails."""

    def __init__(self, watch_fails: int = 0) -> None:
        self.watch_fails = watch_fails
        self.started = self.closed = self.watched = 0

    def start(self) -> None:
        self.started += 1

    def watch_leader(self, callback) -> None:
        if self.watch_fails:
            self.watch_fails -= 1
            raise CoordinationError("no etcd endpoint answered Range (as in the nemesis etcd cut)",
                                    unreachable=True)
        self.watched += 1

    def lease_valid_until(self) -> float:
        return time.monotonic() + 1.0

    def leader(self):
        return None

    def may_campaign(self, refuses) -> bool:
        return False  # stay a candidate: this test is about rejoining

    def campaign(self, refuses):
        return None

    def set_state(self, state: str, holds_state: bool = False, position=NO_STATE) -> None:
        pass

    def close(self) -> None:
        self.closed += 1


def test_a_rejoin_whose_leader_watch_fails_is_tried_again_and_the_loop_lives_on():
    settings = ReplicaSettings(replica_index=0, replicas=2, address="127.0.0.1:1", incarnation=7,
                               lease_seconds=1.0, replication_timeout=0.4, failover_after=0.6,
                               backup_stall_timeout=5.0, max_backup_bytes=1 << 20)
    role = ReplicaRole(settings, lambda has_state: None)
    first = _Coordination()
    made: list[_Coordination] = []

    def new_coordination(incarnation: int) -> _Coordination:
        made.append(_Coordination(watch_fails=1 if not made else 0))
        return made[-1]

    role.connect("127.0.0.1:1", first)
    role.new_coordination = new_coordination
    role.follow = lambda leader: "not followed here"
    role.start()
    try:
        role.lease_lost()  # the loop must rejoin with a new lease
        deadline = time.monotonic() + 10
        while not (len(made) >= 2 and made[-1].watched) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(made) >= 2 and made[-1].watched == 1, [(c.started, c.watched, c.closed) for c in made]
        assert made[0].closed == 1, "the coordination whose watch failed was left open"
        assert role.coordination is made[-1]
        assert any(t.name == "ps-replica" and t.is_alive() for t in threading.enumerate())
    finally:
        role.stop()
