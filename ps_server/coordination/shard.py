"""One replica's view of its shard's replica set in etcd: membership, leader election, the in-sync set.

Safety rests on etcd transactions, never on this process's own view:

- a campaign succeeds only if no leader key exists and the isr is unchanged
  since it was read (and, when it counted on no isr member being alive,
  that those members' keys are unchanged too);
- the isr is written only in a transaction fenced on the leader key's
  create_revision (the epoch) and lease, so a deposed leader's write fails;
- the leader key lives on the leader's lease: a leader that stops renewing
  loses it after the TTL, and ``lease_valid_until()`` tells the leader when
  to stop acknowledging before that can happen.

Eligibility (``may_campaign``, :func:`eligible`): each member publishes
whether it holds state (followed from a primary, or led) and that state's
position (``ps_server.coordination.positions``). A replica may lead when it
is in the isr and no other live isr member holds a fresher state (every isr
member holds every acknowledged change, so any of them is safe; the freshest
loses the fewest unacknowledged ones). Outside the isr it may lead only when
no isr member is alive (no ``members/<i>`` key with the isr entry's
incarnation) and each is proven gone: its slot runs another incarnation
(the process restarted), its address refuses connections (the process
died), or it has been missing for ``unclean_after`` seconds (its host may
be lost for good; until then it may be a frozen or cut-off process that
would come back holding acknowledged changes nobody else has). Then the
freshest state left
leads: a replica holding state may lead when no other live member holds a
fresher one, and one holding nothing (it would restore its newest
checkpoint) only while no live member holds state at all. A replica that
lost its etcd lease but kept its state keeps its incarnation, so an isr
entry still names it.

Thread-safety: every method may be called from any thread. Callbacks run on
the keeper's thread (``on_lease_lost``) or a watcher's (``watch_leader``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ps_server.coordination.errors import CoordinationError
from ps_server.coordination.etcd_client import EtcdClient
from ps_server.coordination.etcd_ops import WatchEvent, create_revision_is, delete_op, mod_revision_is, put_op
from ps_server.coordination.etcdpb import etcd_pb2
from ps_server.coordination.lease_keeper import LeaseKeeper
from ps_server.coordination.positions import NO_STATE, Position, fresher
from ps_server.coordination.records import InSync, Leader, Member, ReplicaId, ShardKeys
from ps_server.coordination.watch import Watcher
from wehub_ps.process.logs import Throttled, event

__all__ = ["ShardCoordinator", "ShardState", "eligible"]

_log = logging.getLogger(__name__)

_empty_replica_waits = Throttled(_log, logging.WARNING, "not leading: this replica holds no state and no "
                                 "checkpoint, and the shard was led before; waiting for a replica that holds "
                                 "its state or a checkpoint (to start the shard afresh, delete its etcd keys)")
_waiting_for_in_sync = Throttled(_log, logging.WARNING, "not leading while an in-sync replica may come back: "
                                 "it is missing, not proven gone")

#: ``start``'s retries while etcd is away: the first after 0.1 s, doubling to 2 s, so a replica
#: started just before etcd joins at once and one waiting longer asks once every 2 s.
_START_BACKOFF = 0.1
_START_MAX_BACKOFF = 2.0
#: At most one "waiting for etcd" line per this many seconds.
_START_LOG_SECONDS = 5.0


@dataclass(frozen=True)
class ShardState:
    """One consistent read of the shard's keys (at etcd revision ``revision``)."""

    leader: Leader | None
    in_sync: InSync | None
    members: dict[int, Member]
    member_revisions: dict[int, int]
    revision: int


def eligible(replica: ReplicaId, in_sync: InSync | None, members: dict[int, Member], holds_state: bool,
             position: Position = NO_STATE, gone: frozenset[ReplicaId] | None = None) -> bool:
    """Whether ``replica`` (holding state at ``position``, or none) may campaign: this module's rule.

    ``gone``: isr members without a member key that are proven gone (None: every such member is)."""
    others = [m for r, m in members.items() if r != replica[0]]

    def fresher_holder(candidates: list[Member]) -> bool:
        if not holds_state:
            return any(m.holds_state for m in candidates)
        return any(m.holds_state and fresher(m.position, position) for m in candidates)

    if in_sync is not None:
        live_in_sync = [m for m in others if m.id in in_sync.members]
        if replica in in_sync.members:
            return not fresher_holder(live_in_sync)
        if live_in_sync:
            return False
        missing = [r for r in in_sync.members if r[0] != replica[0] and r[0] not in members]
        if gone is not None and any(r not in gone for r in missing):
            return False  # an isr member may still come back with acknowledged changes
    return not fresher_holder(others)


def _lease_is(key: str, lease: int) -> etcd_pb2.Compare:
    return etcd_pb2.Compare(result=etcd_pb2.Compare.EQUAL, target=etcd_pb2.Compare.LEASE, key=key.encode(),
                            lease=lease)


class ShardCoordinator:
    """Replica ``replica_index`` (process ``incarnation``) of shard ``shard_index`` of job ``job``.

    ``address``: where the other replicas and the clients reach this one;
    ``replication_address``: where backups connect to it while it leads.
    ``lease_ttl``: seconds without renewal after which etcd drops this
    replica (and its leadership); failover takes about this long when a
    process freezes, and immediately when its death is seen (revoke_leader).
    ``on_lease_lost``: called once when etcd reports the lease gone; the
    process must then stop serving as this incarnation.
    The client is shared and stays open after ``close()``.
    """

    def __init__(self, client: EtcdClient, *, job: str, shard_index: int, replica_index: int,
                 incarnation: int, address: str, lease_ttl: int = 2, replication_address: str = "",
                 on_lease_lost: Callable[[], None] | None = None,
                 state: str = "starting", holds_state: bool = False, position: Position = NO_STATE,
                 unclean_after: float = 60.0) -> None:
        if not isinstance(lease_ttl, int) or lease_ttl < 1:
            raise ValueError(f"lease_ttl must be a whole number of seconds >= 1, got {lease_ttl!r}")
        self._client = client
        self.keys = ShardKeys(job, shard_index)
        self.replica_index = replica_index
        self.incarnation = incarnation
        self.address = address
        self.replication_address = replication_address
        self.lease_ttl = lease_ttl
        self._on_lease_lost = on_lease_lost
        self._state = state
        self._holds_state = holds_state
        self._position = position
        #: Seconds an isr member may be missing, without proof of its death, before others may lead.
        self.unclean_after = unclean_after
        #: Whether this replica could restore a checkpoint of its shard if elected without state (its
        #: volume holds one); a replica that could not never leads a shard that was led before.
        self.can_restore: Callable[[], bool] = lambda: True
        #: Replica slots' addresses as last read (to probe a missing isr member's port).
        self._addresses: dict[int, str] = {}
        #: When each missing isr member was first seen missing (monotonic).
        self._missing_since: dict[ReplicaId, float] = {}
        self._lock = threading.Lock()
        self._keeper: LeaseKeeper | None = None
        self._epoch: int | None = None
        self._watchers: list[Watcher] = []
        self._closed = False
        self._name = f"shard-{shard_index}-replica-{replica_index}"

    @property
    def replica_id(self) -> ReplicaId:
        return (self.replica_index, self.incarnation)

    @property
    def epoch(self) -> int | None:
        """The epoch of the term this replica won and still holds as far as it knows, else None."""
        with self._lock:
            return self._epoch

    # --- membership and lease -------------------------------------------------------------------

    def start(self, wait: float = 0.0) -> ShardCoordinator:
        """Take a lease, renew it from a thread, announce this replica; blocks; idempotent.

        ``wait``: seconds to keep trying, with backoff, while no etcd endpoint
        answers (etcd starting after this process, a first connection that
        is slow), logging what it waits for; 0 tries once. Raises
        CoordinationError when etcd refuses, or is still away after ``wait``
        (a call under way may add up to the client's timeout to that).
        """
        deadline = time.monotonic() + wait
        backoff = _START_BACKOFF
        logged_at = -float("inf")
        while True:
            try:
                return self._join()
            except CoordinationError as error:
                now = time.monotonic()
                if not error.unreachable or self._closed or now >= deadline:
                    if wait > 0 and error.unreachable and not self._closed:
                        raise CoordinationError(
                            f"etcd did not answer for {wait:g} s: {error}", unreachable=True) from error
                    raise
                if now - logged_at >= _START_LOG_SECONDS:
                    logged_at = now
                    event(_log, logging.WARNING, "waiting for etcd", endpoints=self._client.endpoints,
                          waited_seconds=round(wait - (deadline - now), 1), gives_up_after=wait,
                          error=str(error))
                time.sleep(min(backoff, deadline - now))
                backoff = min(_START_MAX_BACKOFF, backoff * 2)

    def _join(self) -> ShardCoordinator:
        """One try of ``start``: the lease, its keeper, the member key."""
        with self._lock:
            if self._keeper is not None or self._closed:
                return self
        sent = time.monotonic()
        lease = self._client.lease_grant(self.lease_ttl)
        if lease.ttl > self.lease_ttl:
            event(_log, logging.WARNING, "etcd raised the lease TTL to its minimum (1.5 election timeouts): "
                  "failover after a freeze takes longer; lower etcd's --election-timeout to allow the TTL "
                  "asked",
                  asked=self.lease_ttl, granted=lease.ttl)
        keeper = LeaseKeeper(self._client, lease, granted_at=sent, on_lost=self._lease_lost,
                             name=f"{self._name}-keepalive")
        try:
            self._client.put(self.keys.member(self.replica_index), self._member().encode(), lease=lease.id)
        except CoordinationError:
            self._revoke_quietly(lease.id)
            raise
        with self._lock:
            self._keeper = keeper.start()
        event(_log, logging.INFO, "joined the replica set", shard=self.keys.shard_index,
              replica=self.replica_index, incarnation=self.incarnation, lease=f"{lease.id:x}", ttl=lease.ttl)
        return self

    def lease_valid_until(self) -> float:
        """``time.monotonic()`` until which the lease surely holds: a leader acknowledges only before it."""
        keeper = self._require_keeper()
        return keeper.valid_until()

    @property
    def lease_lost(self) -> bool:
        keeper = self._keeper
        return keeper is not None and keeper.lost

    def set_state(self, state: str, holds_state: bool = False, position: Position = NO_STATE) -> None:
        """Publish this replica's state (e.g. catching-up, backup) in its member key, whether it holds
        state it followed from a primary or led, and that state's position (see the module docstring)."""
        keeper = self._require_keeper()
        self._state = state
        self._holds_state = holds_state
        self._position = position if holds_state else NO_STATE
        self._client.put(self.keys.member(self.replica_index), self._member().encode(), lease=keeper.lease.id)

    def shard_state(self) -> ShardState:
        """Leader, isr and live members in one read."""
        kvs, revision = self._client.range(self.keys.prefix, prefix=True)
        leader = in_sync = None
        members: dict[int, Member] = {}
        member_revisions: dict[int, int] = {}
        for kv in kvs:
            key = kv.key.decode()
            if key == self.keys.leader:
                leader = Leader.from_kv(kv)
            elif key == self.keys.isr:
                in_sync = InSync.from_kv(kv)
            elif key.startswith(self.keys.members_prefix):
                member = Member.from_kv(kv)
                members[member.replica_index] = member
                self._addresses[member.replica_index] = member.address
                member_revisions[member.replica_index] = kv.mod_revision
        return ShardState(leader, in_sync, members, member_revisions, revision)

    # --- leader ---------------------------------------------------------------------------------

    def leader(self) -> Leader | None:
        kv = self._client.get(self.keys.leader)
        leader = Leader.from_kv(kv) if kv is not None else None
        if leader is not None:
            self._addresses[leader.replica_index] = leader.address
        return leader

    def watch_leader(self, callback: Callable[[Leader | None], None]) -> Watcher:
        """Call ``callback`` now with the current leader, then on every change (None: no leader).

        The later calls run on a thread named ``shard-<i>-replica-<r>-leader-watch``; ``close()`` stops it.
        """
        kvs, revision = self._client.range(self.keys.leader)
        callback(Leader.from_kv(kvs[0]) if kvs else None)

        def on_event(change: WatchEvent) -> None:
            callback(Leader.from_kv(change.kv) if change.kind == "put" else None)

        watcher = self._client.watch(self.keys.leader, on_event, start_revision=revision + 1,
                                     name=f"{self._name}-leader-watch")
        with self._lock:
            closed = self._closed
            self._watchers.append(watcher)
        if closed:
            watcher.stop()
        return watcher

    def may_campaign(self, refuses: Callable[[str], bool] = lambda address: False) -> bool:
        """Whether this replica may lead now (see the module docstring); a campaign re-checks atomically.

        ``refuses(address)``: whether a missing isr member's port refuses connections (its process died).
        """
        state = self.shard_state()
        if not self._may_lead_with_what_it_has(state):
            return False
        return eligible(self.replica_id, state.in_sync, state.members, self._holds_state, self._position,
                        self._gone_in_sync(state, refuses))

    def _may_lead_with_what_it_has(self, state: ShardState) -> bool:
        """A replica holding no state and no checkpoint (an empty volume) never leads a shard that was led
        before (etcd holds its isr): its state is elsewhere, and leading would start the shard empty."""
        if self._holds_state or state.in_sync is None or self.can_restore():
            return True
        _empty_replica_waits(shard=self.keys.shard_index, replica=self.replica_index,
                             to_start_afresh=f"etcdctl del --prefix {self.keys.prefix}")
        return False

    def _gone_in_sync(self, state: ShardState, refuses: Callable[[str], bool]) -> frozenset[ReplicaId]:
        """The isr members without a member key that are proven gone (see the module docstring)."""
        if state.in_sync is None:
            return frozenset()
        now = time.monotonic()
        gone = set()
        missing = {r for r in state.in_sync.members if r[0] not in state.members and r[0] != self.replica_index}
        self._missing_since = {r: self._missing_since.get(r, now) for r in missing}
        recorded = dict(state.in_sync.addresses)
        for replica in missing:
            address = recorded.get(replica[0]) or self._addresses.get(replica[0])
            if now - self._missing_since[replica] >= self.unclean_after or (address and refuses(address)):
                gone.add(replica)
        if missing - gone and self.replica_id not in state.in_sync.members:  # an isr member need not wait
            _waiting_for_in_sync(missing=sorted(r[0] for r in missing - gone), unclean_after=self.unclean_after)
        return frozenset(gone)

    def campaign(self, refuses: Callable[[str], bool] = lambda address: False) -> int | None:
        """Try to become leader: the new epoch when won, None when not eligible or someone else leads.

        Winning also writes isr = [this replica]. The transaction holds only if
        the leader key, the isr and every member key read are as they were
        read: the decision counted on who is alive and on what they hold.
        """
        keeper = self._require_keeper()
        state = self.shard_state()
        if state.leader is not None or not self._may_lead_with_what_it_has(state):
            return None
        if not eligible(self.replica_id, state.in_sync, state.members, self._holds_state, self._position,
                        self._gone_in_sync(state, refuses)):
            return None
        compare = [create_revision_is(self.keys.leader, 0),
                   mod_revision_is(self.keys.isr, state.in_sync.mod_revision if state.in_sync else 0)]
        counted = set(state.members) | ({r for r, _ in state.in_sync.members} if state.in_sync else set())
        compare += [mod_revision_is(self.keys.member(r), state.member_revisions.get(r, 0))
                    for r in sorted(counted - {self.replica_index})]
        leader = Leader.encode(self.replica_index, self.address, self.incarnation, self.replication_address)
        success = [put_op(self.keys.leader, leader, lease=keeper.lease.id),
                   put_op(self.keys.isr, InSync.encode([self.replica_id], epoch=None,
                                                       addresses={self.replica_index: self.address}))]
        try:
            result = self._client.txn(compare, success)
        except CoordinationError as error:
            if error.code == "NOT_FOUND":  # our lease is gone; the keeper reports it
                return None
            if not error.unreachable:
                raise
            return self._won_despite_lost_answer(keeper.lease.id)
        if not result.succeeded:
            return None
        with self._lock:
            self._epoch = result.revision
        from_isr = state.in_sync is not None and self.replica_id in state.in_sync.members
        event(_log, logging.WARNING, "won the election", shard=self.keys.shard_index,
              replica=self.replica_index, epoch=result.revision, from_isr=from_isr)
        return result.revision

    def _won_despite_lost_answer(self, lease_id: int) -> int | None:
        """After a campaign whose answer was lost: the epoch if the leader key is ours (None if not).

        Raises CoordinationError again while etcd stays away.
        """
        leader = self.leader()
        if leader is None or leader.lease != lease_id or leader.incarnation != self.incarnation:
            return None
        with self._lock:
            self._epoch = leader.epoch
        return leader.epoch

    def revoke_leader(self, leader: Leader) -> bool:
        """Revoke the lease of ``leader``'s term (its process is seen dead): failover need not wait the TTL.

        False when that term already ended. Only the lease the leader key of
        that epoch is on is revoked, never a later term's.
        """
        kv = self._client.get(self.keys.leader)
        if kv is None or kv.create_revision != leader.epoch:
            return False
        revoked = self._client.lease_revoke(kv.lease)
        if revoked:
            event(_log, logging.WARNING, "revoked the lease of a dead leader", shard=self.keys.shard_index,
                  leader=leader.replica_index, epoch=leader.epoch, by=self.replica_index)
        return revoked

    def end_silent_term(self, epoch: int) -> bool:
        """End term ``epoch``, whose leader this replica no longer hears from, by deleting its leader key;
        only while this replica is in the isr, fenced on the isr as read.

        Safe without any clock: the leader acknowledges nothing without this
        replica's answer until it removed it from the isr in etcd, and that
        write changes the isr this transaction is fenced on. So if the key is
        deleted, everything acknowledged in the term is on this replica; if
        the leader removed it first, nothing happens and it catches up again.
        A leader that still reaches etcd removes a silent backup
        (--replication-timeout) before the backup gives up on it
        (--failover-after, longer), so a backup cut off from its leader alone
        does not depose a leader the workers still reach.
        """
        state = self.shard_state()
        if state.leader is None or state.leader.epoch != epoch:
            return False
        if state.in_sync is None or self.replica_id not in state.in_sync.members:
            return False
        compare = [create_revision_is(self.keys.leader, epoch),
                   mod_revision_is(self.keys.isr, state.in_sync.mod_revision)]
        result = self._client.txn(compare, [delete_op(self.keys.leader)])
        if result.succeeded:
            event(_log, logging.WARNING, "ended the term of a silent leader", shard=self.keys.shard_index,
                  leader=state.leader.replica_index, epoch=epoch, by=self.replica_index)
        return result.succeeded

    def step_down(self, epoch: int) -> bool:
        """End term ``epoch`` by deleting its leader key, if that term still holds it (a deposed leader
        whose lease lives on would otherwise keep the shard without a primary until it dies)."""
        result = self._client.txn([create_revision_is(self.keys.leader, epoch)], [delete_op(self.keys.leader)])
        with self._lock:
            if self._epoch == epoch:
                self._epoch = None
        return result.succeeded

    def resign(self) -> bool:
        """Give up leadership (delete the leader key if this replica's term still holds it)."""
        with self._lock:
            epoch, self._epoch = self._epoch, None
        if epoch is None:
            return False
        fenced = [create_revision_is(self.keys.leader, epoch)]
        result = self._client.txn(fenced, [delete_op(self.keys.leader)])
        return result.succeeded

    # --- in-sync set ----------------------------------------------------------------------------

    def in_sync(self) -> InSync | None:
        """The isr, or None before the first leader was elected."""
        kv = self._client.get(self.keys.isr)
        return InSync.from_kv(kv) if kv is not None else None

    def set_in_sync(self, epoch: int, members: Sequence[ReplicaId],
                    addresses: dict[int, str] | None = None) -> bool:
        """Write the isr as leader of ``epoch``; False when this replica no longer holds that term."""
        keeper = self._require_keeper()
        compare = [create_revision_is(self.keys.leader, epoch), _lease_is(self.keys.leader, keeper.lease.id)]
        isr = InSync.encode(list(members), epoch, addresses)
        result = self._client.txn(compare, [put_op(self.keys.isr, isr)])
        return result.succeeded

    # --- ending ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the watches and the keeper, revoke the lease (leaving the set and the lead); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            watchers, self._watchers = self._watchers, []
            keeper, self._epoch = self._keeper, None
        for watcher in watchers:
            watcher.stop()
        if keeper is not None:
            keeper.stop()
            if not keeper.lost:
                self._revoke_quietly(keeper.lease.id)

    def _revoke_quietly(self, lease_id: int) -> None:
        try:
            self._client.lease_revoke(lease_id)
        except CoordinationError as error:
            event(_log, logging.WARNING, "could not revoke the lease; etcd drops it after its TTL",
                  lease=f"{lease_id:x}", error=str(error))

    def _lease_lost(self) -> None:
        with self._lock:
            self._epoch = None
        if self._on_lease_lost is not None:
            self._on_lease_lost()

    def _member(self) -> Member:
        return Member(self.replica_index, self.address, self.incarnation, self._state, self._holds_state,
                      self._position)

    def _require_keeper(self) -> LeaseKeeper:
        keeper = self._keeper
        if keeper is None:
            raise RuntimeError("ShardCoordinator.start() must run first")
        return keeper
