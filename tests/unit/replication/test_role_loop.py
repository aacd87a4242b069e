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


class _Leader:
    def __init__(self, epoch: int, replica_index: int = 1, incarnation: int = 99) -> None:
        self.epoch = epoch
        self.replica_index = replica_index
        self.incarnation = incarnation
        self.address = "127.0.0.1:2"
        self.replication_address = "127.0.0.1:3"


class _ElectedCoordination(_Coordination):
    """Elects this replica at epoch 5 while no leader is known; ``set_in_sync`` blocks until
    ``release_isr`` is set and then fails, as a write fenced on a term that has ended does."""

    def __init__(self) -> None:
        super().__init__()
        self.current = None
        self.callback = None
        self.isr_called = threading.Event()
        self.release_isr = threading.Event()

    def watch_leader(self, callback) -> None:
        self.callback = callback

    def leader(self):
        return self.current

    def may_campaign(self, refuses) -> bool:
        return self.current is None

    def campaign(self, refuses):
        return 5

    def set_in_sync(self, epoch, members, addresses) -> bool:
        self.isr_called.set()
        self.release_isr.wait(10)
        return False


def _settings() -> ReplicaSettings:
    return ReplicaSettings(replica_index=0, replicas=2, address="127.0.0.1:1", incarnation=7,
                           lease_seconds=1.0, replication_timeout=0.4, failover_after=0.6,
                           backup_stall_timeout=5.0, max_backup_bytes=1 << 20)


def _wait(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_deposition_found_after_the_replica_follows_the_next_primary_leaves_the_backup_alone():
    """The monitor's in-sync write of the ended term fails only once the replica already follows the
    next primary; that late finding must not depose the backup (it would stay DEPOSED, never Ready)."""
    coordination = _ElectedCoordination()
    role = ReplicaRole(_settings(), lambda has_state: None)
    following = threading.Event()
    stop_following = threading.Event()

    def follow(leader) -> str:
        following.set()
        stop_following.wait(10)
        return "the test ended the stream"

    role.connect("127.0.0.1:1", coordination)
    role.follow = follow
    role.start()
    try:
        _wait(lambda: role.state == "primary", "the replica was not elected")
        # The monitor's write of the in-sync set, slow on etcd, started while the term went on.
        writer = threading.Thread(target=role._change_in_sync, args=(set(), {(1, 99)}))
        writer.start()
        assert coordination.isr_called.wait(10)
        coordination.current = _Leader(epoch=6)
        coordination.callback(coordination.current)  # etcd's watch: another replica won epoch 6
        assert following.wait(10), "the deposed replica did not follow the new primary"
        assert role.state == "catching-up"
        coordination.release_isr.set()
        writer.join(10)
        assert role.state == "catching-up", "a late finding of the ended term deposed the backup"
    finally:
        stop_following.set()
        coordination.release_isr.set()
        role.stop()


def test_a_lease_lost_while_the_follower_connects_ends_the_stream_before_it_starts(monkeypatch):
    """interrupt_follow finds no connection to close while the follower is still connecting; the
    follower must see the rejoin asked for once connected, not follow on with a lease etcd dropped."""
    import socket

    from ps_server.replication import follower as follower_module
    from wehub_ps.wire.frames import FramedConnection

    role = ReplicaRole(_settings(), lambda has_state: None)
    role.connect("127.0.0.1:1", _Coordination())
    leader = _Leader(epoch=6)
    role._leader = leader  # as the role loop sets it before it follows

    class _Applier:
        def forget_streams(self) -> None:
            pass

    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def connect(address, tls, timeout, *args, **kwargs):
        ours = socket.create_connection(listener.getsockname())
        accepted.append(listener.accept()[0])
        role.lease_lost()  # etcd dropped the lease during the connect
        return FramedConnection(ours, address)

    monkeypatch.setattr(follower_module, "connect", connect)
    follower = follower_module.Follower(role, 0, 1, _Applier(), lambda state: None, None)
    role.interrupt_follow = follower.interrupt
    try:
        why = follower.follow(leader)
        assert "rejoins" in why, why
        theirs = accepted[0]
        theirs.settimeout(1.0)
        assert theirs.recv(1) == b"", "the follower sent its start to the primary anyway"
    finally:
        for sock in accepted + [listener]:
            sock.close()


def test_a_backup_turns_ready_only_once_the_in_sync_set_of_its_primarys_term_names_it():
    """Installed is not enough: a disruption budget counts Ready pods as in-sync replicas. An isr of an
    older term that names the replica does not count either."""
    from ps_server.coordination.records import InSync

    class _Following(_ElectedCoordination):
        def __init__(self) -> None:
            super().__init__()
            self.current = _Leader(epoch=6)
            self.isr = InSync(epoch=5, members=((0, 7), (1, 99)))  # the old term's set names this replica

        def in_sync(self):
            return self.isr

    coordination = _Following()
    role = ReplicaRole(_settings(), lambda has_state: None)
    stop = threading.Event()

    def follow(leader) -> str:
        while not stop.is_set():  # the primary's messages, each answered after the snapshot installed
            role.answered_primary(installed=True, epoch=leader.epoch)
            time.sleep(0.02)
        return "the test ended the stream"

    role.connect("127.0.0.1:1", coordination)
    role.follow = follow
    role.start()
    try:
        _wait(lambda: role.state == "catching-up", "the replica did not follow the primary")
        time.sleep(0.5)
        assert role.state == "catching-up", "Ready before the primary's in-sync set named the backup"
        coordination.isr = InSync(epoch=6, members=((1, 99),))
        time.sleep(0.3)
        assert role.state == "catching-up", "Ready while the term's in-sync set leaves the backup out"
        coordination.isr = InSync(epoch=6, members=((0, 7), (1, 99)))
        _wait(lambda: role.state == "backup", "the backup in the in-sync set never turned Ready")
    finally:
        stop.set()
        role.stop()


def test_a_stopping_replica_stays_stopping_whatever_its_thread_does_next():
    """role.stop() after a handover: the role's thread, woken by the deposition, may try to follow the new
    primary just after; its state (and so the pod's role label, which stopping takes off) must stay stopping."""
    from ps_server.replication.role import CATCHING_UP, STOPPING

    settings = ReplicaSettings(replica_index=0, replicas=2, address="127.0.0.1:1", incarnation=7,
                               lease_seconds=1.0, replication_timeout=0.4, failover_after=0.6,
                               backup_stall_timeout=5.0, max_backup_bytes=1 << 20)
    role = ReplicaRole(settings, lambda has_state: None)
    seen: list[str] = []
    role.on_state = seen.append
    role._set_state(STOPPING)
    role._set_state(CATCHING_UP)
    assert role.state == STOPPING and seen == [STOPPING]
