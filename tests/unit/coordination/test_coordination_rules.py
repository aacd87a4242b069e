"""The election rules and key records of ps_server.coordination, without etcd."""

from __future__ import annotations

import pytest

from ps_server.coordination import CoordinationError, EtcdClient, InSync, KeyValue, Leader, Member, ShardKeys
from ps_server.coordination.etcd_ops import prefix_end
from ps_server.coordination.lease_keeper import safety_margin
from ps_server.coordination.positions import NO_STATE, Position, acknowledges, continues, fresher
from ps_server.coordination.shard import eligible

ISR = InSync(epoch=7, members=((0, 10), (1, 20)))


def _member(replica_index: int, incarnation: int) -> Member:
    return Member(replica_index, f"h:{replica_index}", incarnation, "in-sync")


def _holder(replica_index: int, incarnation: int, epoch: int, sequence: int) -> Member:
    return Member(replica_index, f"h:{replica_index}", incarnation, "candidate", True, Position(epoch, sequence))


def test_an_isr_member_may_campaign_unless_a_live_isr_member_holds_fresher_state():
    assert eligible((1, 20), ISR, {0: _member(0, 10)}, holds_state=False)
    assert eligible((1, 20), ISR, {0: _member(0, 10)}, holds_state=True, position=Position(7, 3))
    fresher_peer = {0: _holder(0, 10, 7, 9)}
    assert not eligible((1, 20), ISR, fresher_peer, holds_state=True, position=Position(7, 3))
    assert eligible((1, 20), ISR, fresher_peer, holds_state=True, position=Position(7, 9))  # a tie: either
    assert not eligible((1, 20), ISR, fresher_peer, holds_state=False)  # it would restore from disk
    # A later term's state is fresher than any sequence of an earlier term.
    assert eligible((1, 20), ISR, fresher_peer, holds_state=True, position=Position(8, 1))


def test_outside_the_isr_only_when_every_isr_member_is_gone():
    assert not eligible((2, 30), ISR, {0: _member(0, 10)}, holds_state=True, position=Position(9, 9))
    assert eligible((2, 30), ISR, {}, holds_state=False)
    # A restarted replica (same slot, new incarnation) is not the in-sync process.
    assert eligible((2, 30), ISR, {0: _member(0, 11), 1: _member(1, 21)}, holds_state=False)
    assert not eligible((0, 11), ISR, {1: _member(1, 20)}, holds_state=True, position=Position(7, 5))


def test_with_every_isr_member_gone_the_freshest_state_alive_leads_and_disk_comes_last():
    followed = _holder(1, 21, 7, 40)
    led_earlier = _holder(2, 31, 5, 900)
    checkpoint_only = Member(0, "h:0", 11, "candidate", holds_state=False)
    members = {0: checkpoint_only, 1: followed, 2: led_earlier}
    assert eligible((1, 21), ISR, members, holds_state=True, position=Position(7, 40))
    assert not eligible((2, 31), ISR, members, holds_state=True, position=Position(5, 900))
    assert not eligible((0, 11), ISR, members, holds_state=False)
    # Once the holders are gone, the checkpoint is what is left.
    assert eligible((0, 11), ISR, {0: checkpoint_only}, holds_state=False)
    # Two replicas with only their checkpoints: either may lead.
    assert eligible((0, 11), ISR, {0: checkpoint_only, 1: Member(1, "h:1", 21, "starting")}, holds_state=False)


def test_a_member_record_carries_whether_it_holds_state_and_where():
    member = _holder(2, 30, 12, 345)
    assert Member.from_kv(_kv("/wehub-ps/j/shards/0/members/2", member.encode(), 5, 5)) == member
    old_format = Member.from_kv(_kv("/wehub-ps/j/shards/0/members/2",
                                    b'{"address": "h:2", "incarnation": 30, "state": "backup"}', 5, 5))
    assert not old_format.holds_state and old_format.position == NO_STATE


def test_before_any_isr_the_freshest_holder_or_anyone_when_none_holds_state():
    assert eligible((0, 1), None, {}, holds_state=False)
    assert not eligible((0, 1), None, {1: _holder(1, 2, 3, 4)}, holds_state=False)
    assert eligible((0, 1), None, {1: _holder(1, 2, 3, 4)}, holds_state=True, position=Position(3, 5))


def test_the_log_rules():
    held = Position(7, 10)
    assert continues(held, 7, 11)
    assert not continues(held, 7, 12) and not continues(held, 7, 10)
    assert not continues(held, 8, 11), "a record of another term never continues this one"
    assert not continues(NO_STATE, 0, 1), "nothing continues before a snapshot is installed"
    assert acknowledges(7, 7)
    assert not acknowledges(7, 6) and not acknowledges(7, 0), "another term's answer acknowledges nothing"
    assert fresher(Position(8, 0), Position(7, 10**9)) and not fresher(held, held)


def _kv(key: str, value: bytes, create: int, mod: int, lease: int = 0) -> KeyValue:
    return KeyValue(key.encode(), value, create, mod, 1, lease)


def test_records_round_trip_and_the_epoch_comes_from_etcd_revisions():
    keys = ShardKeys("job", 3)
    assert (keys.leader, keys.isr, keys.member(2)) == (
        "/wehub-ps/job/shard/3/leader", "/wehub-ps/job/shard/3/isr", "/wehub-ps/job/shard/3/members/2")
    leader = Leader.from_kv(_kv(keys.leader, Leader.encode(1, "h:1", 20), create=42, mod=42, lease=9))
    assert leader == Leader(1, "h:1", 20, epoch=42, lease=9)
    member = Member.from_kv(_kv(keys.member(2), _member(2, 5).encode(), 3, 3))
    assert member == _member(2, 5)
    written = InSync.from_kv(_kv(keys.isr, InSync.encode([(1, 20)], epoch=42), 5, 50))
    assert written == InSync(42, ((1, 20),), 50)
    # A campaign's isr has no epoch field: the same transaction created the leader key.
    by_campaign = InSync.from_kv(_kv(keys.isr, InSync.encode([(1, 20)], epoch=None), 5, 61))
    assert by_campaign.epoch == 61


def test_records_refuse_what_is_not_theirs():
    with pytest.raises(ValueError, match="no JSON"):
        Leader.from_kv(_kv("/x/leader", b"not json", 1, 1))
    with pytest.raises(ValueError, match="not an object"):
        InSync.from_kv(_kv("/x/isr", b"[1]", 1, 1))
    with pytest.raises(ValueError, match="job name"):
        ShardKeys("a/b", 0)


def test_prefix_end_is_etcds_rule():
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


def test_the_safety_margin_grows_with_the_ttl():
    assert safety_margin(1) == pytest.approx(0.15)
    assert safety_margin(2) == pytest.approx(0.25)


def test_client_arguments_are_checked_before_any_call(tmp_path):
    with pytest.raises(CoordinationError, match="no etcd endpoint"):
        EtcdClient([" "])
    with pytest.raises(CoordinationError, match="give both or neither"):
        EtcdClient(["127.0.0.1:2379"], cert=tmp_path / "c.crt")
    with pytest.raises(CoordinationError, match="cannot read the etcd CA certificate"):
        EtcdClient(["127.0.0.1:2379"], ca=tmp_path / "missing.crt")


def test_the_lease_ttl_is_whole_seconds_of_at_least_one():
    from ps_server.coordination import ShardCoordinator

    for ttl in (0, 1.5):
        with pytest.raises(ValueError, match="lease_ttl"):
            ShardCoordinator(EtcdClient(["127.0.0.1:2379"]), job="j", shard_index=0, replica_index=0,
                             incarnation=1, address="h:1", lease_ttl=ttl)


def test_outside_the_isr_a_missing_isr_member_must_be_proven_gone():
    follower = _holder(1, 21, 7, 40)
    missing = frozenset()  # isr member (0, 10) has no member key, and nothing proves it dead yet
    assert not eligible((1, 21), ISR_OF_ONE, {1: follower}, True, Position(7, 40), gone=missing)
    assert eligible((1, 21), ISR_OF_ONE, {1: follower}, True, Position(7, 40), gone=frozenset({(0, 10)}))
    # Its slot running another incarnation proves the in-sync process gone: no proof needed.
    restarted = Member(0, "h:0", 11, "starting")
    assert eligible((1, 21), ISR_OF_ONE, {0: restarted, 1: follower}, True, Position(7, 40), gone=missing)


ISR_OF_ONE = InSync(epoch=7, members=((0, 10),))


def test_the_isr_records_where_its_members_were_reached():
    keys = ShardKeys("job", 0)
    written = InSync.from_kv(_kv(keys.isr, InSync.encode([(0, 10), (1, 20)], 42, {0: "h:0", 1: "h:1"}), 5, 50))
    assert written.addresses == ((0, "h:0"), (1, "h:1"))
    assert InSync.from_kv(_kv(keys.isr, InSync.encode([(1, 20)], 42), 5, 50)).addresses == ()
