"""Shard elections against a real etcd (tests/etcd_server.py): terms, fencing, failover, losing etcd."""

from __future__ import annotations

import logging
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
from etcd_server import EtcdTls
from ps_testing import ROOT, child_env, free_port
from tls_material import make_tls_material

from ps_server.coordination import CoordinationError, EtcdClient, Leader, ShardCoordinator

pytestmark = pytest.mark.timeout(120)


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)


@pytest.fixture
def client(etcd_server):
    etcd = EtcdClient([etcd_server.endpoint], timeout=2.0)
    yield etcd
    etcd.close()


@pytest.fixture
def replicas(client):
    """``replicas(replica_index, incarnation, lease_ttl=1, **kw) -> started ShardCoordinator``;
    closed at teardown."""
    started: list[ShardCoordinator] = []

    def start(replica_index: int, incarnation: int, lease_ttl: int = 1, **kwargs) -> ShardCoordinator:
        replica = ShardCoordinator(client, job="test-job", shard_index=0, replica_index=replica_index,
                                   incarnation=incarnation, address=f"127.0.0.1:{7000 + replica_index}",
                                   lease_ttl=lease_ttl, **kwargs)
        started.append(replica)
        return replica.start()

    yield start
    for replica in started:
        replica.close()


def test_first_campaign_wins_and_the_second_is_refused(replicas):
    first, second = replicas(0, 10), replicas(1, 20)
    assert first.may_campaign() and second.may_campaign()  # no isr yet
    epoch = first.campaign()
    assert epoch is not None and first.epoch == epoch
    assert second.campaign() is None
    assert second.leader() == Leader(0, "127.0.0.1:7000", 10, epoch, second.leader().lease)
    in_sync = second.in_sync()
    assert (in_sync.epoch, in_sync.members) == (epoch, ((0, 10),))
    second.set_state("catching-up")
    members = first.shard_state().members
    assert [(m.replica_index, m.incarnation, m.state) for m in members.values()] == [
        (0, 10, "starting"), (1, 20, "catching-up")]


def test_each_term_has_a_larger_epoch(replicas):
    a, b = replicas(0, 10), replicas(1, 20)
    first = a.campaign()
    assert a.set_in_sync(first, [(0, 10), (1, 20)])
    assert a.resign()
    second = b.campaign()  # in the isr: a fresh state is not needed
    assert second is not None and second > first
    assert b.set_in_sync(second, [(1, 20), (0, 10)])
    assert b.resign()
    third = a.campaign()
    assert third is not None and third > second
    assert a.leader().epoch == third


def test_a_deposed_leader_cannot_write_the_isr(replicas):
    lost = threading.Event()
    a, b = replicas(0, 10, on_lease_lost=lost.set), replicas(1, 20)
    old = a.campaign()
    assert a.set_in_sync(old, [(0, 10), (1, 20)])
    assert b.revoke_leader(b.leader())
    new = b.campaign()
    assert new is not None and new > old
    assert not a.set_in_sync(old, [(0, 10)])  # the deposed leader is fenced out
    assert not b.set_in_sync(old, [(1, 20)])  # and so is any write for the old term
    assert b.in_sync().members == ((1, 20),)
    assert b.set_in_sync(new, [(1, 20), (0, 11)])
    assert b.in_sync().epoch == new
    assert lost.wait(2.0), "the deposed leader was not told that its lease is gone"
    assert a.lease_valid_until() < time.monotonic() and a.epoch is None


_FROZEN_LEADER = """
import sys, threading, time
from ps_server.coordination import EtcdClient, ShardCoordinator
lost = threading.Event()
client = EtcdClient([sys.argv[1]], timeout=2.0)
leader = ShardCoordinator(client, job="test-job", shard_index=0, replica_index=0, incarnation=10,
                          address="127.0.0.1:7000", lease_ttl=1, on_lease_lost=lost.set).start()
epoch = leader.campaign()
assert leader.set_in_sync(epoch, [(0, 10), (1, 20)])
print("leader", epoch, flush=True)
lost.wait(60)
print("lost", leader.lease_valid_until() < time.monotonic(), leader.set_in_sync(epoch, [(0, 10)]), flush=True)
"""


def _lines(popen: subprocess.Popen) -> queue.Queue:
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.split()) for line in popen.stdout], daemon=True,
                     name="frozen-leader-stdout").start()
    return lines


def test_a_frozen_leader_loses_its_lease_and_an_in_sync_backup_takes_over(etcd_server, replicas):
    backup = replicas(1, 20)
    popen = subprocess.Popen([sys.executable, "-c", _FROZEN_LEADER, etcd_server.endpoint], cwd=str(ROOT),
                             env=child_env(), stdout=subprocess.PIPE, text=True)
    try:
        lines = _lines(popen)
        word, old_epoch = lines.get(timeout=30)
        assert word == "leader"
        seen: queue.Queue = queue.Queue()
        backup.watch_leader(seen.put)
        assert seen.get(timeout=5).epoch == int(old_epoch)
        popen.send_signal(signal.SIGSTOP)  # the leader's process freezes: no renewals, no answers
        frozen = time.monotonic()
        assert seen.get(timeout=5) is None, "the frozen leader's key did not expire"
        expired = time.monotonic() - frozen
        assert expired < 3.0, f"a 1 s lease took {expired:.2f} s to expire"
        new_epoch = backup.campaign()
        assert new_epoch is not None and new_epoch > int(old_epoch)
        assert seen.get(timeout=5).replica_index == 1
        popen.send_signal(signal.SIGCONT)
        # Resumed, the old leader learns its lease is gone, its validity is over,
        # and its isr write is refused.
        assert lines.get(timeout=10) == ["lost", "True", "False"]
    finally:
        popen.send_signal(signal.SIGCONT)
        popen.kill()
        popen.wait()


def test_revoking_a_dead_leaders_lease_fails_over_at_once(replicas):
    lost = threading.Event()
    leader = replicas(0, 10, lease_ttl=5, on_lease_lost=lost.set)
    backup = replicas(1, 20, lease_ttl=5)
    epoch = leader.campaign()
    assert leader.set_in_sync(epoch, [(0, 10), (1, 20)])
    seen = backup.leader()
    started = time.monotonic()
    assert backup.revoke_leader(seen)
    assert backup.leader() is None
    new_epoch = backup.campaign()
    elapsed = time.monotonic() - started
    assert new_epoch is not None and elapsed < 2.0, f"failover took {elapsed:.2f} s with a 5 s lease"
    assert not backup.revoke_leader(seen), "a past term's lease was revoked again"
    assert backup.leader().replica_index == 1  # the new term's lease is untouched
    assert lost.wait(3.0) and leader.lease_lost


def test_a_replica_out_of_the_isr_waits_while_an_isr_member_lives(replicas):
    a, b = replicas(0, 10), replicas(1, 20)
    epoch = a.campaign()
    assert epoch is not None and a.resign()  # isr = [a]; a lives on without leading
    assert not b.may_campaign()
    assert b.campaign() is None
    replacement = replicas(0, 11)  # replica 0 restarted: a new incarnation is not the in-sync one...
    a.close()  # ...and the in-sync process is gone: every in-sync copy is lost
    assert b.may_campaign()  # nobody holds state: b's newest checkpoint is what is left
    new_epoch = b.campaign()
    assert new_epoch is not None and new_epoch > epoch
    assert b.in_sync().members == ((1, 20),) and b.in_sync().epoch == new_epoch
    assert replacement.campaign() is None


def test_with_the_in_sync_primary_gone_a_replica_that_followed_it_wins_over_a_restarted_one(replicas):
    primary, follower = replicas(0, 10), replicas(1, 20)
    assert primary.campaign() is not None  # isr = [primary]
    follower.set_state("backup", holds_state=True)  # applied the primary's stream, not yet in the isr
    restarted = replicas(0, 11)  # the primary's process restarted from its checkpoint
    primary.close()  # the in-sync process is gone
    assert not restarted.may_campaign()
    assert restarted.campaign() is None
    epoch = follower.campaign()
    assert epoch is not None and follower.in_sync().members == ((1, 20),)


def test_a_campaign_counting_on_no_member_holding_state_fails_if_one_starts_to(replicas):
    primary, other = replicas(0, 10), replicas(1, 20)
    assert primary.campaign() is not None
    restarted = replicas(0, 11)
    primary.close()
    assert restarted.may_campaign()  # nobody holds followed state
    stale = restarted.shard_state()
    other.set_state("backup", holds_state=True)
    restarted.shard_state = lambda: stale  # the campaign acts on the read from before that change...
    assert restarted.campaign() is None  # ...and etcd's compare refuses it


def test_losing_etcd_freezes_the_lease_validity_and_the_keepalive_recovers(etcd_server, replicas, caplog):
    caplog.set_level(logging.INFO, logger="ps_server.coordination")
    leader = replicas(0, 10, lease_ttl=2)
    epoch = leader.campaign()
    watcher = replicas(1, 20)
    seen: queue.Queue = queue.Queue()
    watcher.watch_leader(seen.put)
    assert seen.get(timeout=5).epoch == epoch
    wait_until(lambda: leader.lease_valid_until() > time.monotonic() + 1.0, 3, "the lease is renewed")

    etcd_server.stop()
    wait_until(lambda: any("etcd unreachable" in r.getMessage() for r in caplog.records), 3,
               "a warning that etcd is unreachable")
    frozen = leader.lease_valid_until()
    time.sleep(1.0)
    assert leader.lease_valid_until() == frozen, "the lease validity advanced without etcd"
    assert frozen < time.monotonic() + 1.0

    etcd_server.restart()  # etcd renews every lease when it starts: the term survives
    wait_until(lambda: leader.lease_valid_until() > time.monotonic() + 1.0, 5, "the keepalive recovers")
    assert any("etcd reachable again" in r.getMessage() for r in caplog.records)
    assert not leader.lease_lost
    assert leader.leader().epoch == epoch
    assert leader.resign()
    assert seen.get(timeout=5) is None, "the leader watch did not resume after etcd restarted"


def test_the_client_tries_each_endpoint_and_names_them_all_when_none_answers(etcd_server):
    dead = f"127.0.0.1:{free_port()}"
    with_live = EtcdClient([dead, etcd_server.endpoint], timeout=1.0)
    try:
        with_live.put("/k", b"v")
        assert with_live.get("/k").value == b"v"
    finally:
        with_live.close()
    only_dead = EtcdClient([dead, f"http://127.0.0.1:{free_port()}"], timeout=1.0)
    try:
        with pytest.raises(CoordinationError, match="no etcd endpoint answered Range") as caught:
            only_dead.get("/k")
        assert caught.value.unreachable and dead in str(caught.value)
    finally:
        only_dead.close()


def test_mutual_tls(etcd_factory, tmp_path):
    (tmp_path / "tls").mkdir()
    material = make_tls_material(tmp_path / "tls")
    tls = EtcdTls(material.server.cert, material.server.key, material.ca.cert, material.client.cert,
                  material.client.key)
    server = etcd_factory(tls=tls)
    trusted = EtcdClient([server.endpoint], timeout=2.0, **tls.client_files())
    try:
        replica = ShardCoordinator(trusted, job="tls", shard_index=0, replica_index=0, incarnation=1,
                                   address="127.0.0.1:7000").start()
        assert replica.campaign() is not None
        replica.close()
    finally:
        trusted.close()
    stranger = EtcdClient([server.endpoint], timeout=2.0, ca=material.ca.cert,
                          cert=material.other_client.cert, key=material.other_client.key)
    try:
        with pytest.raises(CoordinationError) as caught:
            stranger.get("/k")
        assert "client certificate" in str(caught.value)
    finally:
        stranger.close()
