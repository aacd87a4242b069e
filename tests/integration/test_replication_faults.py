"""Replicated shards (--replicas 2) under faults: a frozen primary, etcd down, both replicas lost.

Real ps-server processes and a real etcd on loopback (tests/etcd_server.py
skips where etcd is not installed). Workers push one-row gradients whose
every application can be counted (tests/replica_faults.py), so each test
checks exactly-once for every acknowledged push, not a sum that could hide
a loss behind a repeat.
"""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest
from replica_faults import SlotPusher, check_slots, create_slots
from replica_testing import ReplicatedCluster
from replica_testing import wait_for as _wait

from worker_client import NotPrimaryError, PSClient, PSUnavailableError

SLOTS = 20_000
#: After SIGCONT, answers a frozen primary decided before its SIGSTOP may still arrive this long (the
#: process is scheduled again, its threads send what they held).
_DECIDED_BEFORE = 0.25


@pytest.fixture
def replicated(tmp_path, etcd_server):
    """``(start, etcd)``: ``start()`` gives a running 1-shard, 2-replica cluster; stopped (by PID) after."""
    clusters: list[ReplicatedCluster] = []

    def start() -> ReplicatedCluster:
        cluster = ReplicatedCluster(tmp_path / f"replicated-{len(clusters)}", etcd_server.endpoint, 1, 2)
        clusters.append(cluster)
        return cluster.start()

    yield start, etcd_server
    for cluster in clusters:
        for replica in cluster.all():
            replica.process.signal(signal.SIGCONT)  # a frozen process cannot handle SIGTERM
        cluster.stop()


def _in_sync(primary) -> list[tuple[int, bool]]:
    """(replica index, in sync) of each backup the primary reports."""
    return [(b.replica_index, b.in_sync) for b in primary.status().backups]


def _role(replica) -> str:
    try:
        return replica.status(timeout=1.0).role
    except Exception:  # noqa: BLE001 - unreachable, frozen or restarting: no role to read
        return "unreachable"


def test_a_primary_frozen_past_its_lease_acknowledges_nothing_after_it_resumes(replicated):
    """SIGSTOP the primary until the backup leads, then SIGCONT: its pushes are refused (split brain)."""
    start, _ = replicated
    cluster = start()
    old = cluster.primary(0)
    backup = next(r for r in cluster.shards[0] if r is not old)
    # The pinned worker knows only the old primary: it cannot follow the failover, so any acknowledgement
    # it gets after the resume would come from a deposed primary. Short deadlines: each push ends quickly.
    pinned = PSClient([old.address], worker_id="pinned", control_timeout=2, data_timeout=2, retry_timeout=2)
    following = PSClient(cluster.addresses, worker_id="following", retry_timeout=60)
    create_slots(following, "slots", 2, SLOTS)
    pushers = [SlotPusher(pinned, "slots", 0, SLOTS, pause=0.005).start(),
               SlotPusher(following, "slots", 1, SLOTS, pause=0.005).start()]
    try:
        _wait(lambda: min(len(p.acknowledged) for p in pushers) >= 20, 30, "no pushes acknowledged", cluster)
        # In sync at the freeze (a first push's kernels may have kept it from answering in time): an
        # in-sync backup takes over; one outside the set would wait for the frozen primary.
        _wait(lambda: _in_sync(old) == [(backup.replica_index, True)], 20, "the backup is not in sync",
              cluster)
        old.process.signal(signal.SIGSTOP)
        frozen = time.monotonic()
        elected = _wait(lambda: _role(backup) == "primary", 15, "the backup was not elected", cluster)
        _wait(lambda: any(t > elected for t in pushers[1].acknowledged.values()), 15,
              "the following worker got no acknowledgement from the new primary", cluster)
        old.process.signal(signal.SIGCONT)
        resumed = time.monotonic()
        # Long enough for the old primary's in-flight calls to finish and for the pinned worker to retry.
        _wait(lambda: sum(isinstance(e, NotPrimaryError) for e in list(pushers[0].raised.values())) >= 3, 20,
              "the pinned worker's pushes were not refused", cluster)
        time.sleep(1.0)
        old_status = old.status()
        new_status = backup.status()
    finally:
        for pusher in pushers:
            pusher.join(60)
    pinned.close()
    # An answer decided before SIGSTOP (its change confirmed by the backup, its term proven) may still
    # reach the worker as the process resumes: the kernel stopped it between the proof and the send. Any
    # later one was decided after the resume: a split brain. Whatever was acknowledged, the new primary
    # holds exactly once (check_slots below).
    late = sorted(t - resumed for t in pushers[0].acknowledged.values() if t > resumed + _DECIDED_BEFORE)
    assert not late, (f"the deposed primary acknowledged {len(late)} pushes after it resumed "
                      f"(seconds after SIGCONT: {late[:5]})\n{cluster.logs()}")
    refusals = [e for e in pushers[0].raised.values() if isinstance(e, NotPrimaryError)]
    assert all(isinstance(e, PSUnavailableError) for e in pushers[0].raised.values())
    # The refusal names the new primary (in its message: over the Exchange lane ``primary`` stays None).
    assert refusals and all(e.primary in (backup.address, None) for e in refusals), refusals[:3]
    assert any(backup.address in str(e) for e in refusals), [str(e) for e in refusals[:3]]
    # The in-sync backup ends a silent primary's term after --failover-after (0.6 s), lease or not: the
    # frozen primary could acknowledge nothing without that backup's answer.
    assert elected - frozen > 0.6 * 0.9, "elected before the primary was silent for --failover-after"
    assert new_status.role == "primary" and new_status.epoch > 0
    assert old_status.role in ("backup", "catching-up") and old_status.epoch == new_status.epoch
    assert old_status.primary_address == backup.address
    assert any(t > resumed for t in pushers[1].acknowledged.values())
    check = check_slots(following.pull(["slots"])["slots"], pushers)
    following.close()
    assert not check.violations, check.violations[:10]
    print(f"frozen primary: elected {elected - frozen:.2f}s after SIGSTOP; pinned worker: "
          f"{len(pushers[0].acknowledged)} acknowledged before the freeze, {len(refusals)} split-brain "
          f"attempts refused, {len(pushers[0].raised) - len(refusals)} timed out while frozen; following "
          f"worker: {len(pushers[1].acknowledged)} acknowledged; {check.acknowledged} checked exactly once")


def test_training_goes_on_while_etcd_is_down_and_after_it_returns(replicated):
    """The primary proves its lease through its backup's answers while etcd is stopped: no pause, no loss."""
    start, etcd = replicated
    cluster = start()
    primary = cluster.primary(0)
    epoch = primary.status().epoch
    client = PSClient(cluster.addresses, worker_id="w0", retry_timeout=60)
    create_slots(client, "slots", 1, SLOTS)
    pusher = SlotPusher(client, "slots", 0, SLOTS, pause=0.002).start()
    try:
        _wait(lambda: len(pusher.acknowledged) >= 50, 30, "no pushes acknowledged", cluster)
        etcd.stop()
        stopped = time.monotonic()
        time.sleep(4 * cluster.lease_seconds)  # several leases: only the backup's answers prove it now
        unreachable = primary.status()
        returned = time.monotonic()
        etcd.restart()
        restarted = time.monotonic()
        _wait(lambda: primary.status().etcd_reachable, 15, "the primary did not reach etcd again", cluster)
        _wait(lambda: len([t for t in pusher.acknowledged.values() if t > restarted]) >= 50, 30,
              "no pushes acknowledged after etcd returned", cluster)
    finally:
        pusher.join(60)
    during = sorted(t for t in pusher.acknowledged.values() if stopped < t < returned)
    assert not unreachable.etcd_reachable and unreachable.role == "primary"
    assert len(during) >= 50, f"only {len(during)} pushes acknowledged while etcd was down\n{cluster.logs()}"
    gaps = np.diff([stopped, *during, returned])
    assert gaps.max() < cluster.lease_seconds, f"training paused {gaps.max():.2f}s while etcd was down"
    assert cluster.primary(0) is primary and primary.status().epoch == epoch, "a failover happened"
    check = check_slots(client.pull(["slots"])["slots"], [pusher])
    client.close()
    assert not pusher.raised, list(pusher.raised.values())[:3]
    assert not check.violations, check.violations[:10]
    print(f"etcd down {returned - stopped:.1f}s: {len(during)} pushes acknowledged meanwhile (longest gap "
          f"{gaps.max() * 1000:.0f} ms); {check.acknowledged} checked exactly once")


def test_both_replicas_killed_restore_the_newest_checkpoint(replicated):
    """Both replicas of the shard SIGKILLed: the shard restarts from its checkpoint, whichever replica leads.

    The pushes acknowledged after that checkpoint are lost: the documented loss when every replica of a
    shard is gone at once (as with one replica, docs/failure-semantics.md). The former backup is restarted
    first, so it is the one that leads after the restart.
    """
    start, _ = replicated
    cluster = start()
    old_primary = cluster.primary(0)
    old_backup = next(r for r in cluster.shards[0] if r is not old_primary)
    with PSClient(cluster.addresses, worker_id="w0") as client:
        create_slots(client, "slots", 1, 400)
        for row in range(200):
            client.push_rows("slots", np.array([row]), np.array([[1 + row % 7]], np.float32))
        client.checkpoint()
        checkpointed = client.pull(["slots"])["slots"]
        for row in range(200, 300):
            client.push_rows("slots", np.array([row]), np.array([[1 + row % 7]], np.float32))
    for replica in (old_primary, old_backup):
        replica.process.signal(signal.SIGKILL)
        replica.process.wait(10)
    old_backup.start()
    assert cluster.primary(0, timeout=20) is old_backup
    old_primary.start()
    cluster.wait_all_ready(30)
    with PSClient(cluster.addresses, worker_id="w1") as client:
        restored = client.pull(["slots"])["slots"]
        np.testing.assert_array_equal(restored, checkpointed)
        assert np.count_nonzero(restored) == 200  # the 100 pushes after the checkpoint: the documented loss
        client.push_rows("slots", np.array([300]), np.array([[1]], np.float32))
        assert client.pull(["slots"])["slots"][300, 0] == -1


def test_a_primary_resumed_after_a_freeze_takes_over_when_the_new_primary_dies(replicated):
    """Frozen past its lease, resumed, back in sync as a backup: it holds every acknowledged push, so when
    the primary that replaced it is SIGKILLed it must take over, and nothing acknowledged may be lost."""
    start, _ = replicated
    cluster = start()
    first = cluster.primary(0)
    second = next(r for r in cluster.shards[0] if r is not first)
    client = PSClient(cluster.addresses, worker_id="w0", retry_timeout=15)  # failovers take ~5 s here
    create_slots(client, "slots", 1, SLOTS)
    pusher = SlotPusher(client, "slots", 0, SLOTS, pause=0.005).start()
    try:
        _wait(lambda: len(pusher.acknowledged) >= 20, 30, "no pushes acknowledged", cluster)
        first.process.signal(signal.SIGSTOP)
        _wait(lambda: _role(second) == "primary", 15, "the backup was not elected", cluster)
        first.process.signal(signal.SIGCONT)
        _wait(lambda: _in_sync(second) == [(first.replica_index, True)],
              20, "the resumed replica did not get back in sync", cluster)
        acknowledged_before = len(pusher.acknowledged)
        second.process.signal(signal.SIGKILL)
        killed = time.monotonic()
        second.process.wait(10)
        took_over = _wait(lambda: _role(first) == "primary", 15,
                          "the resumed replica, the only one in sync, did not take over", cluster)
        _wait(lambda: len(pusher.acknowledged) > acknowledged_before + 20, 15,
              "no pushes acknowledged after the takeover", cluster)
        second.start()
        _wait(lambda: _in_sync(first) == [(second.replica_index, True)],
              20, "the restarted replica did not get in sync", cluster)
    finally:
        pusher.join(60)
    check = check_slots(client.pull(["slots"])["slots"], [pusher])
    client.close()
    assert not pusher.raised, list(pusher.raised.values())[:3]
    assert not check.violations, (f"{len(check.violations)} violations: {check.violations[:5]}\n"
                                  f"{cluster.logs()}")
    print(f"resumed replica took over {took_over - killed:.2f}s after the SIGKILL; {check.acknowledged} "
          f"pushes checked exactly once")
