"""A replica's role in its shard: backup, candidate, primary, and the moves between them.

Coordination is etcd's (``ps_server.coordination``): the primary holds the
shard's leader key on its lease; the key's creation revision is the term's
epoch; the in-sync set (``isr``) lists the replicas that hold every
acknowledged change, and only they may be elected.

Safety rests on two rules. (1) A change is acknowledged to a worker only
once every in-sync backup applied it, and the primary shrinks the in-sync
set in etcd (a transaction fenced on its own leader key) before it stops
waiting for a backup; so whoever is elected holds every acknowledged
change. (2) A primary acknowledges only while it can prove no other replica
can have been elected: its etcd lease is valid (last confirmed keepalive's
send time + TTL), or every in-sync backup answered a message sent less than
a TTL ago — a backup promises not to campaign for a TTL after it answered
its primary, unless the primary's process is gone (its port refuses
connections), when the backup revokes the primary's lease and campaigns at
once. So training goes on while etcd is down as long as the backups answer,
and a primary that was frozen or cut off acknowledges nothing once its
proof lapsed.

A replica that starts following a primary (at start, after its stream
broke, or deposed) is sent a snapshot that replaces its whole state, then
the changes after it. Records and answers carry (epoch, sequence), checked
by the rules of ``ps_server.coordination.positions``.

A replica keeps the state it holds across everything but a snapshot that
replaces it or a change it could not apply: deposed, or cut off from etcd
past its lease, it still holds every change it applied, so it rejoins with
its state (and its incarnation, which the isr names) and an election
prefers the freshest state alive; a restore from disk happens only when no
live replica holds state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ps_server.coordination import CoordinationError
from ps_server.coordination.positions import NO_STATE, Position
from ps_server.coordination.records import InSync
from ps_server.core.errors import RequestError
from ps_server.replication import records
from ps_server.replication.log import BackupLink, UpdateLog
from wehub_ps.errors import Reason
from wehub_ps.process.logs import Throttled, event
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.rpc import PRIMARY_METADATA_KEY

__all__ = ["Coordination", "LeaderInfo", "ReplicaRole", "ReplicaSettings"]

log = logging.getLogger("ps_server.replication")


class LeaderInfo(Protocol):
    replica_index: int
    address: str
    incarnation: int
    epoch: int
    replication_address: str


class Coordination(Protocol):
    """What the role needs of etcd (ps_server.coordination.ShardCoordinator)."""

    def start(self) -> object: ...
    def lease_valid_until(self) -> float: ...
    def leader(self) -> LeaderInfo | None: ...
    def watch_leader(self, callback: Callable[[LeaderInfo | None], None]) -> None: ...
    def may_campaign(self, refuses: Callable[[str], bool]) -> bool: ...
    def campaign(self, refuses: Callable[[str], bool]) -> int | None: ...
    def set_state(self, state: str, holds_state: bool = False, position: Position = NO_STATE) -> None: ...
    def set_in_sync(self, epoch: int, members: list[tuple[int, int]],
                    addresses: dict[int, str] | None = None) -> bool: ...
    def in_sync(self) -> InSync | None: ...
    def revoke_leader(self, leader: LeaderInfo) -> None: ...
    def step_down(self, epoch: int) -> bool: ...
    def end_silent_term(self, epoch: int) -> bool: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class ReplicaSettings:
    replica_index: int
    replicas: int
    #: How other replicas reach this one ('host:port').
    address: str
    #: This process (drawn at its start): a restarted replica is a new member.
    incarnation: int
    lease_seconds: float
    #: A backup that leaves a message unanswered this long is dropped from the in-sync set.
    replication_timeout: float
    #: An in-sync backup that hears nothing from its primary this long ends the primary's term.
    failover_after: float
    #: A backup whose host still acknowledges at the TCP level may leave a message unanswered this long.
    backup_stall_timeout: float
    #: Changes queued for one backup at most before it is cut off (it catches up again).
    max_backup_bytes: int
    #: The shard's consistency mode (sync pushes are staged until they end; see records.OpenPushes).
    consistency: str = "async"
    #: SIGTERM on a primary: how long an in-sync backup may take to confirm every change before the role
    #: is handed to it (0: no handover; the backup takes over when the lease runs out).
    handover_timeout: float = 5.0


#: Roles, as Describe and ps-admin show them.
STARTING, CATCHING_UP, BACKUP, CANDIDATE, PRIMARY, DEPOSED, STOPPING = (
    "starting", "catching-up", "backup", "candidate", "primary", "deposed", "stopping")

# A primary's proof of its lease ends this much before the TTL does (clock rates, scheduling).
_PROOF_MARGIN = 0.1

# A backup handed the term holds calls this long at most for its election (then refuses them as usual).
_TAKE_OVER_WAIT = 1.0

# A catch-up snapshot waits at most this long for an instant with no staged push open (sync pushes end
# within a step); past it, it is taken anyway and the backup starts over when such a push's record comes.
_SNAPSHOT_WAIT = 2.0

_cannot_update_in_sync = Throttled(log, logging.WARNING, "cannot update the in-sync set while etcd is unreachable")


class ReplicaRole:
    """One replica's state machine: a ps_server.service.roles.ShardRole and a core.ordering.ChangeLog."""

    replicated = True

    def __init__(self, settings: ReplicaSettings, become_primary: Callable[[bool], None]) -> None:
        """``become_primary(has_state)`` readies the store to serve (restoring from disk when it holds
        nothing). Before ``start``: ``follow`` runs a backup's stream until it ends and says why, and
        ``connect`` gives the address others reach this replica at and its etcd coordination."""
        self.settings = settings
        self._coordination: Coordination | None = None
        self._become_primary = become_primary
        self.follow: Callable[[LeaderInfo], str] | None = None
        #: Ends the stream ``follow`` runs (the primary's term ended while it was silent).
        self.interrupt_follow: Callable[[], None] = lambda: None
        #: A coordination with a new lease for an incarnation: a replica that lost its etcd lease rejoins.
        self.new_coordination: Callable[[int], Coordination] | None = None
        self._rejoin = False
        self._state = STARTING
        #: Called with the new state on every change (health, metrics, the member key).
        self.on_state: Callable[[str], None] = lambda state: None
        #: Primary: called when whether it can prove its term changes (the primary-only health).
        self.on_proof: Callable[[bool], None] = lambda proven: None
        self._proven = False
        self._epoch = 0
        self._leader: LeaderInfo | None = None
        self._log: UpdateLog | None = None
        #: Per thread: whether it holds the log's order through ``ordered`` (a sync step applied by the push
        #: that finished it is logged in the same hold).
        self._holding = threading.local()
        self._streams = itertools.count(1)
        #: Primary: push streams of its log that have not ended (a catch-up snapshot reopens them).
        self._open_pushes = records.OpenPushes(sync=settings.consistency == "sync")
        #: Primary: backups attached to the log, and those of them in the in-sync set.
        self._links: dict[tuple[int, int], BackupLink] = {}
        self._in_sync: set[tuple[int, int]] = set()
        #: Primary: backups acknowledgements wait for that are not yet in etcd's isr, each with the log's
        #: sequence when they joined: written once they acknowledged it (they then hold everything
        #: acknowledged without them).
        self._joining: dict[tuple[int, int], int] = {}
        self._acks = threading.Condition()
        #: The state held: the newest sequence applied (a primary's log goes on from it) and the epoch of
        #: the term whose log that is; has_state is False while it holds nothing followed or led.
        self.applied = 0
        self.state_epoch = 0
        self.has_state = False
        #: Backup: whether the stream being followed has installed its snapshot.
        self._installed = False
        #: Backup: streams followed so far (numbers the current one); the one whose term's in-sync set in
        #: etcd names this replica (Ready from then on), and the one whose wait for that was started.
        self._follows = 0
        self._joined_isr = 0
        self._isr_watched = 0
        #: Backup: the stream followed ended because the primary fell silent (not refused or closed).
        self._silent = False
        self._answered_at = 0.0
        self._primary_gone = False
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._monitor: threading.Thread | None = None
        #: ssp, sync: the consistency controller's state (steps, clocks, workers), logged whenever it changed.
        self.consistency_state: Callable[[], dict] | None = None
        self._logged_consistency: dict | None = None
        #: ssp, sync: the membership's generation (it moves when workers join, restart, leave or expire);
        #: the consistency state is logged before the next ordered change whenever it moved.
        self.membership_generation: Callable[[], int] | None = None
        self._logged_generation = -1
        #: Planned switchovers: one at a time; the address of the replica this one handed its term to
        #: (refusals name it until the next primary is known); no campaign of its own until then.
        self._handover_lock = threading.Lock()
        self._handed_to: str | None = None
        self._no_campaign_until = 0.0
        #: Backup: its primary handed it the term (a planned switchover): end the term and campaign at once;
        #: calls wait for its election until then (monotonic; see _await_leading). Notified on state changes.
        self._taking_over = False
        self._leading_soon_until = 0.0
        self._state_changed = threading.Condition()
        #: Held while a primary is deposed: the one way out of PRIMARY besides stop() (see _deposed).
        self._deposing = threading.Lock()
        self.failovers = 0
        self.last_election_seconds = 0.0
        self.last_failover_seconds = 0.0
        #: When this backup lost its primary's stream (monotonic; 0: following, or never had one).
        self._lost_at = 0.0

    # ---- lifecycle ----

    def connect(self, address: str, coordination: Coordination) -> None:
        self.settings = dataclasses.replace(self.settings, address=address)
        self._coordination = coordination

    def start(self) -> None:
        assert self._coordination is not None and self.follow is not None, "connect() and follow first"
        self._coordination.start()
        self.on_state(self._state)  # published once the coordination can
        self._coordination.watch_leader(self._leader_changed)
        self._thread = threading.Thread(target=self._run, name="ps-replica", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """SIGTERM: a primary with an in-sync backup first hands the role over (``hand_over``: workers
        wait for the backup's election only); then refuse work at once (NOT_PRIMARY: workers move to the
        replica elected next) and leave the replica set; pushes in flight are refused rather than
        acknowledged unconfirmed. A backup closes its stream from the primary at once."""
        if self._state == PRIMARY and self.settings.handover_timeout > 0:
            try:
                self.hand_over(timeout=self.settings.handover_timeout)
            except RequestError as error:
                event(log, logging.WARNING, "stopping without handing the primary role over",
                      why=error.message)
        self._set_state(STOPPING)
        self._stopping.set()
        self._wake.set()
        # A backup leaves its stream at once: its primary then drops it from the in-sync set within a
        # check instead of waiting --backup-stall-timeout for answers a draining process never sends.
        self.interrupt_follow()
        with self._acks:
            self._acks.notify_all()
        if self._monitor is not None:
            self._monitor.join()  # before the links close: a stopping primary never shrinks the in-sync set
        for link in list(self._links.values()):
            link.close("the primary is stopping")
        self._coordination.close()

    def _set_state(self, state: str) -> None:
        if state != self._state:
            with self._state_changed:
                if self._state == STOPPING:
                    return  # final: the role's thread, deposed just before, must not start following now
                self._state = state
                if state == PRIMARY:
                    self._leading_soon_until = 0.0
                self._state_changed.notify_all()
            self.on_state(state)

    def _await_leading(self) -> None:
        """A backup that was handed the term: a call waits for its election (bounded) instead of being
        refused, so the workers that the old primary sent here are served as soon as it leads."""
        if self._state == PRIMARY or time.monotonic() >= self._leading_soon_until:
            return
        with self._state_changed:
            while self._state != PRIMARY and (remaining := self._leading_soon_until - time.monotonic()) > 0:
                self._state_changed.wait(remaining)

    @property
    def coordination(self) -> Coordination | None:
        return self._coordination

    @property
    def state(self) -> str:
        return self._state

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def leader(self) -> LeaderInfo | None:
        return self._leader

    def _leader_changed(self, leader: LeaderInfo | None) -> None:
        following = self._leader
        following_epoch = following.epoch if following is not None else self._epoch
        if self._state in (CATCHING_UP, BACKUP) and following is not None and (
                leader is None or leader.epoch != following.epoch):
            self.interrupt_follow()  # the term ended: a frozen or cut-off primary sends nothing more
        if leader is not None and leader.epoch > self._epoch and self._state == PRIMARY:
            self._deposed(f"replica {leader.replica_index} was elected (epoch {leader.epoch})")
        elif leader is None and self._state == PRIMARY:
            self._deposed("its term ended in etcd (its leader key is gone)")
        self._leader = leader  # None: the term ended; refusals name no primary until the next is known
        if leader is not None:
            self._epoch = max(self._epoch, leader.epoch)
            if leader.incarnation != self.settings.incarnation:
                self._handed_to = None
                if leader.epoch > following_epoch:
                    self._leading_soon_until = 0.0  # another replica won: calls wait no longer
        self._wake.set()

    # ---- the backup / candidate loop ----

    def _run(self) -> None:
        """The role's loop; it must outlive anything one turn of it meets (a replica whose loop died
        would never follow or lead again), so an unexpected error is logged and the turn tried again."""
        while not self._stopping.is_set():
            try:
                self._turn()
            except Exception:  # noqa: BLE001 - logged with its stack; the next turn starts afresh
                log.exception("the replica's role loop failed; trying again", extra={"fields": {
                    "state": self._state}})
                self._wake.wait(0.5)

    def _turn(self) -> None:
        """One turn of ``_run``: rejoin, follow, campaign or wait, as the shard's state says."""
        self._wake.clear()
        if self._rejoin:
            self._rejoin_with_a_new_lease()
            return
        if self._state == PRIMARY:
            self._wake.wait(1.0)
            return
        try:
            leader = self._coordination.leader()
        except CoordinationError as error:
            # etcd away: a backup keeps following the primary it knows (elections wait for etcd).
            leader = self._leader if self._leader is not None and not self._primary_gone else None
            if leader is None:
                event(log, logging.DEBUG, "etcd unreachable; waiting to learn the primary",
                      error=str(error))
                self._wake.wait(0.2)
                return
        if leader is not None:
            self._leader = leader
            self._epoch = max(self._epoch, leader.epoch)
        if (leader is not None and leader.replica_index == self.settings.replica_index
                and leader.incarnation != self.settings.incarnation):
            self._revoke(leader, "the leader key belongs to this replica's previous process")
            return
        if leader is not None and leader.incarnation == self.settings.incarnation:
            self._step_down(leader)  # deposed, yet its term's key lives on: end the term
            return
        if leader is not None and leader.incarnation != self.settings.incarnation:
            self._follow_leader(leader)
            return
        if leader is None and self._may_campaign():
            self._campaign()
            return
        self._wake.wait(0.05)

    def _follow_leader(self, leader: LeaderInfo) -> None:
        if self._rejoin:
            return  # a replica without its lease first rejoins as a new member, then follows
        self._installed = False
        self._silent = False
        self._follows += 1
        self._set_state(CATCHING_UP)
        self._primary_gone = False
        self._taking_over = False
        assert self.follow is not None
        started = time.monotonic()
        try:
            why = self.follow(leader)
        except Exception as error:  # noqa: BLE001 - this thread must live on: follow again, or lead
            log.exception("following the primary failed", extra={"fields": {"primary": leader.address}})
            why = f"following failed: {error}"
        if self._stopping.is_set():
            return
        self._lost_at = time.monotonic()
        event(log, logging.WARNING, "stream from the primary ended", primary=leader.address,
              epoch=leader.epoch, why=why, applied=self.applied)
        if self._taking_over:
            self._taking_over = False
            self._take_over(leader)
            return
        if self._silent and self._installed:
            self._end_silent_term(leader)  # its host is silent too: no port there would refuse
        elif _refuses_connections(leader.address):
            # The primary's process is gone: nothing can be acknowledged there any more.
            self._primary_gone = True
            self._revoke(leader, "the primary's port refuses connections")
        self._set_state(CANDIDATE if self.has_state else STARTING)
        if not self._primary_gone and time.monotonic() - started < 1.0:
            self._wake.wait(0.25)  # a primary that refuses at once (still starting): not a busy loop

    def stream_ended(self, leader: LeaderInfo) -> str | None:
        """Why a stream from ``leader`` must end now (None: it may go on); what ``interrupt_follow``
        asks, for a stream that had no connection yet when it was asked."""
        if self._stopping.is_set():
            return "this replica is stopping"
        if self._rejoin:
            return "this replica lost its etcd lease and rejoins the replica set first"
        current = self._leader
        if current is None or current.epoch != leader.epoch:
            return f"the primary's term {leader.epoch} ended"
        return None

    def primary_silent(self, host_alive: bool | None) -> None:
        """The follower heard nothing from its primary for --failover-after while in sync; ``host_alive``:
        whether the primary's host still acknowledged at the TCP level (None: not known). A live host
        means a slow or frozen process: its lease, not this replica, ends its term."""
        self._silent = host_alive is not True

    def _end_silent_term(self, leader: LeaderInfo) -> None:
        """An in-sync backup whose primary fell silent (its host lost, or cut off) ends the primary's term
        in etcd (fenced on the isr, see ShardCoordinator.end_silent_term) and campaigns at once."""
        try:
            ended = self._coordination.end_silent_term(leader.epoch)
        except CoordinationError as error:
            event(log, logging.WARNING, "could not end a silent primary's term", error=str(error))
            return
        if ended:
            self._primary_gone = True  # the term is over: nothing can be acknowledged in it any more
            event(log, logging.WARNING, "ended the term of a silent primary", primary=leader.address,
                  epoch=leader.epoch, silent_for=self.settings.failover_after)

    def _take_over(self, leader: LeaderInfo) -> None:
        """The primary handed this in-sync backup its term (it ordered nothing after the last record,
        which this replica applied): end the term in etcd, fenced on its epoch alone, and campaign at
        once, with no lease to run out and no promise to wait for."""
        self._set_state(CANDIDATE if self.has_state else STARTING)
        try:
            ended = self._coordination.step_down(leader.epoch)
        except CoordinationError as error:  # the lease ends it instead; the campaign below then waits
            event(log, logging.WARNING, "could not end the term handed over", error=str(error))
            ended = False
        event(log, logging.WARNING, "taking over the primary role", primary=leader.address,
              epoch=leader.epoch, ended=ended)
        if self.has_state:
            self._campaign()

    def _step_down(self, leader: LeaderInfo) -> None:
        event(log, logging.WARNING, "ending the term this replica no longer leads", epoch=leader.epoch,
              state=self._state)
        try:
            self._coordination.step_down(leader.epoch)
        except CoordinationError as error:  # etcd unreachable: the lease's TTL ends it instead
            event(log, logging.DEBUG, "could not end the term", error=str(error))
        self._wake.wait(0.1)

    def _revoke(self, leader: LeaderInfo, why: str) -> None:
        event(log, logging.WARNING, "revoking a gone primary's lease", primary=leader.address,
              epoch=leader.epoch, why=why)
        try:
            self._coordination.revoke_leader(leader)
        except CoordinationError as error:  # etcd unreachable: the lease's TTL ends it instead
            event(log, logging.WARNING, "could not revoke the primary's lease", error=str(error))
            self._wake.wait(0.1)

    def install(self, install: Callable[[], None], position: Position) -> None:
        """Replace the state with a snapshot's at ``position``; a deposed primary's calls still in flight
        are shut out."""
        log_ = self._log
        with log_.ordered() if log_ is not None else contextlib.nullcontext():
            self.has_state = False  # until the install is whole
            install()
            self._log = None
            self.applied, self.state_epoch = position.sequence, position.epoch
            self.has_state = True
            self._installed = True

    def lost_state(self) -> None:
        """A change could not be applied: what this replica holds is no state to lead with."""
        self.has_state = False
        self.applied, self.state_epoch = 0, 0

    def position(self) -> Position:
        """Where the state held stands (NO_STATE when it holds none)."""
        if not self.has_state:
            return NO_STATE
        return Position(self.state_epoch, self.last_sequence())

    def answered_primary(self, installed: bool, epoch: int = 0) -> None:
        """The follower answered a message of its primary of term ``epoch`` (the promise not to
        campaign starts anew); ``installed``: this stream's snapshot is in place, so the answer
        acknowledged changes. The backup turns Ready (BACKUP) once etcd's in-sync set of that term
        names it, not before: a disruption budget counts Ready pods as in-sync replicas, and only
        those can be elected or handed the term."""
        self._answered_at = time.monotonic()
        if self._state != CATCHING_UP or not installed:
            return
        follows = self._follows
        if self._joined_isr == follows:
            self._set_state(BACKUP)
        elif self._isr_watched != follows:
            self._isr_watched = follows
            threading.Thread(target=self._await_in_sync_set, args=(follows, epoch), name="ps-replica-isr",
                             daemon=True).start()

    def _await_in_sync_set(self, follows: int, epoch: int) -> None:
        """Backup: poll etcd until the in-sync set of term ``epoch`` names this replica, while stream
        ``follows`` lasts; the follower's next answer then makes it BACKUP (the follower's thread
        alone moves a backup's state)."""
        me = (self.settings.replica_index, self.settings.incarnation)
        coordination = self._coordination
        while follows == self._follows and not self._stopping.is_set():
            try:
                isr = coordination.in_sync() if coordination is not None else None
            except CoordinationError as error:
                event(log, logging.DEBUG, "cannot read the in-sync set", error=str(error))
                isr = None
            if isr is not None and isr.epoch == epoch and me in isr.members:
                self._joined_isr = follows
                return
            self._stopping.wait(0.05)

    def _may_campaign(self) -> bool:
        if time.monotonic() < self._no_campaign_until:
            return False  # it handed its term over: the backup it chose campaigns
        promised_until = self._answered_at + self.settings.lease_seconds
        if not self._primary_gone and time.monotonic() < promised_until:
            return False
        try:
            # Outside the in-sync set a replica may lead only when no in-sync replica is alive; then
            # what it holds is the best there is: state it followed, or else (while no live replica
            # holds followed state) its newest checkpoint.
            return self._coordination.may_campaign(_refuses_connections)
        except CoordinationError as error:
            event(log, logging.DEBUG, "cannot campaign while etcd is unreachable", error=str(error))
            return False

    def _campaign(self) -> None:
        started = time.monotonic()
        self._set_state(CANDIDATE)
        try:
            epoch = self._coordination.campaign(_refuses_connections)
        except CoordinationError as error:
            event(log, logging.WARNING, "campaign failed", error=str(error))
            return
        if epoch is None:
            return
        held = self.position()
        self._become_primary(self.has_state)
        # The term's log goes on from the state it was elected with; after a restore from disk it starts
        # at 0, so (epoch, sequence) tells a reset from a continuation.
        start = held.sequence if self.has_state else 0
        self._log = UpdateLog(start)
        self._logged_consistency, self._logged_generation = None, -1  # this term logs its own
        self._open_pushes.clear()
        self._handed_to = None
        self.applied, self.state_epoch = start, epoch
        self._epoch = epoch
        self._in_sync = set()
        self._joining = {}
        self.has_state = True
        self._proven = self.proves_lease()  # just won on a lease etcd confirmed
        self._set_state(PRIMARY)
        now = time.monotonic()
        self.last_election_seconds = now - started
        if self._answered_at and self._lost_at:
            self.failovers += 1
            self.last_failover_seconds = now - self._lost_at
        self._monitor = threading.Thread(target=self._watch_backups, name="ps-replica-monitor", daemon=True)
        self._monitor.start()
        # Apart from the monitor, which may wait seconds on an unreachable etcd.
        threading.Thread(target=self._watch_proof, name="ps-replica-proof", daemon=True).start()
        event(log, logging.WARNING if self._answered_at else logging.INFO, "elected primary", epoch=epoch,
              sequence=start, held=str(held), restored=held == NO_STATE,
              replica_index=self.settings.replica_index,
              election_seconds=round(self.last_election_seconds, 3),
              failover_seconds=round(self.last_failover_seconds, 3) if self._lost_at else None)

    # ---- ShardRole: what the RPC methods ask ----

    def check_primary(self) -> None:
        self._await_leading()
        if self._state != PRIMARY:
            raise self._not_primary(f"this replica is {self._state}, not the shard's primary")

    def _not_primary(self, why: str) -> RequestError:
        leader = self._leader
        if leader is not None and leader.incarnation != self.settings.incarnation:
            return RequestError(Reason.NOT_PRIMARY, f"{why}; the primary is {leader.address}",
                                ((PRIMARY_METADATA_KEY, leader.address),))
        handed_to = self._handed_to
        if handed_to is not None:
            return RequestError(Reason.NOT_PRIMARY, f"{why}; the primary role was handed to {handed_to}",
                                ((PRIMARY_METADATA_KEY, handed_to),))
        return RequestError(Reason.NOT_PRIMARY, f"{why}; no primary is known yet (an election is under way)")

    @contextlib.contextmanager
    def ordered(self) -> Iterator[None]:
        if getattr(self._holding, "order", False):
            yield  # this thread holds the order already
            return
        self._await_leading()
        log_ = self._log
        if log_ is None or self._state != PRIMARY:  # also on a thread installing a snapshot under the lock
            raise self._not_primary(f"this replica is {self._state}")
        with log_.ordered():
            if self._state != PRIMARY:  # deposed while this call waited for the order
                raise self._not_primary(f"this replica is {self._state}")
            self._holding.order = True
            try:
                self._log_membership()
                yield
            finally:
                self._holding.order = False

    def next_stream(self) -> int:
        return next(self._streams)

    def push_applied(self, stream: int, begin: ps_pb2.PushBegin | None, message: bytes | memoryview,
                     completed: bool = False) -> int:
        sequence = self._append(*records.push_applied(stream, begin, message, completed))
        self._open_pushes.logged(stream, begin, completed)
        return sequence

    def push_ended(self, stream: int, begin: ps_pb2.PushBegin | None, completed: bool) -> int:
        sequence = self._append(*records.push_ended(stream, begin, completed))
        self._open_pushes.logged(stream, begin, True)
        return sequence

    def variable_created(self, spec: ps_pb2.VariableSpec) -> int:
        return self._append(*records.variable_created(spec))

    def push_decided(self, stream: int, step: int, accumulate: bool, tables: list) -> int:
        return self._append(*records.push_decided(stream, step, accumulate, tables))

    def sync_step(self, step: int, applied: bool) -> None:
        self._append(*records.sync_step(step, applied))

    def finishing(self) -> int:
        return self._append(*records.finish())

    def checkpointed(self) -> int:
        return self._append(*records.checkpoint())

    def table_rows_read(self, reads: list[tuple[str, np.ndarray]]) -> None:
        self._append(*records.rows_read(reads))

    def rows_expired(self, now: float, tables: list[tuple[str, np.ndarray]]) -> None:
        self._append(*records.rows_expired(now, tables))

    def _append(self, op: list, nbytes: int) -> int:
        assert self._log is not None
        return self._log.append(op, nbytes)

    def last_sequence(self) -> int:
        return self._log.sequence if self._log is not None else self.applied

    def acknowledge(self, sequence: int, timeout: float | None) -> None:
        """Return once every in-sync backup applied ``sequence`` and this replica can prove it leads."""
        deadline = time.monotonic() + (timeout if timeout is not None else 3600.0)
        with self._acks:
            while True:
                if self._state != PRIMARY:
                    raise self._not_primary("this replica stopped being the primary before the change "
                                            "was confirmed; retry it (it is applied at most once)")
                pending = [key for key in self._in_sync
                           if key in self._links and self._links[key].acknowledged < sequence]
                if not pending:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._not_primary(f"backups {sorted(k[0] for k in pending)} did not confirm the "
                                            "change in time; retry it (it is applied at most once)")
                self._acks.wait(min(remaining, 0.1))
        if not self.proves_lease():
            raise self._not_primary("this replica cannot prove it is still the primary (neither etcd nor "
                                    "every in-sync backup confirmed it within the lease)")

    def lease_proven(self) -> bool:
        """Whether etcd confirmed this replica's lease within its TTL."""
        try:
            coordination = self._coordination
            return coordination is not None and coordination.lease_valid_until() > time.monotonic()
        except RuntimeError:  # not started yet
            return False

    def proves_lease(self) -> bool:
        now = time.monotonic()
        if self._coordination.lease_valid_until() > now:
            return True
        links = [self._links[key] for key in self._in_sync if key in self._links]
        if not links:
            return False
        valid_for = self.settings.lease_seconds * (1 - _PROOF_MARGIN)
        return min(link.proof for link in links) + valid_for > now

    # ---- the primary's backups ----

    def attach(self, start: ps_pb2.FollowStart,
               snapshot: Callable[[], object]) -> tuple[BackupLink, object, list[ps_pb2.OpenPush]]:
        """A backup asks to follow: refuse unless primary; else its link, a snapshot and the push streams
        open then, in one instant (one with no staged push open, if one comes within a bound)."""
        if start.epoch > self._epoch and self._state == PRIMARY:
            self._newer_term_claimed(start.epoch)
        link = BackupLink(start.replica_index, start.incarnation, start.address,
                          self.settings.max_backup_bytes, self._notify, self._epoch)
        deadline = time.monotonic() + _SNAPSHOT_WAIT
        while True:
            self.check_primary()
            log_ = self._log
            assert log_ is not None
            with log_.ordered():
                if not self._open_pushes.staged() or time.monotonic() >= deadline:
                    taken = snapshot()
                    opened = self._open_pushes.resumable()
                    log_.attach(link)
                    break
            self._open_pushes.wait_unstaged(deadline - time.monotonic())
        old = self._links.get(link.key)
        if old is not None:
            old.close("replaced by a new stream of the same backup")
        self._links[link.key] = link
        event(log, logging.INFO, "backup attached", replica_index=start.replica_index, address=start.address,
              sequence=link.start_sequence, open_pushes=len(opened))
        return link, taken, opened

    def hand_over(self, to_replica: int | None = None, timeout: float = 5.0) -> BackupLink:
        """A planned switchover (Kafka's controlled shutdown, Patroni's switchover): hand the primary role
        to an in-sync backup without losing or repeating anything; returns the backup's link.

        Holding the log's order (changes wait), it waits until the backup
        applied the last record, then queues the take-over message behind it
        and stops leading: calls waiting for the order are refused with
        NOT_PRIMARY naming the backup, which ends the term in etcd and
        campaigns at once. This replica makes no campaign of its own for a
        lease. RequestError when it is not the primary, when no in-sync
        backup (or not ``to_replica``) is there, or when the backup did not
        confirm within ``timeout``; it then goes on leading.
        """
        started = time.monotonic()
        with self._handover_lock:
            self.check_primary()
            log_ = self._log
            assert log_ is not None
            target = self._handover_target(to_replica, started + timeout)
            with log_.ordered():
                self.check_primary()
                last = log_.sequence
                with self._acks:
                    while target.acknowledged < last:
                        remaining = started + timeout - time.monotonic()
                        if target.closed is not None or remaining <= 0 or self._state != PRIMARY:
                            raise RequestError(
                                Reason.SWITCHOVER_REFUSED,
                                f"replica {target.replica_index} did not confirm change {last} within "
                                f"{timeout:g}s ({target.closed or 'still catching up'}); this replica "
                                "goes on as the primary")
                        self._acks.wait(min(remaining, 0.05))
                # Named first: the monitor leaves the in-sync set alone from here on (the target closes
                # its stream once it took the term; it must stay in the set it is elected from).
                self._handed_to = target.address
                target.hand_over()
                self._no_campaign_until = time.monotonic() + 2 * self.settings.lease_seconds
                # Written before anything more could be ordered (the order is held): wait for it, bounded.
                written = target.handed_over.wait(max(0.1, started + timeout - time.monotonic()))
                # The backup ends its stream once it took the message in (taking_over): from then on it
                # holds the calls sent to it until it leads. Only then do refusals name it; before, a
                # worker sent there would be refused back here and retry with a growing backoff.
                taken = written and target.wait_closed(
                    min(_TAKE_OVER_WAIT, max(0.1, started + timeout - time.monotonic())))
                self._deposed(f"handed the primary role to replica {target.replica_index}")
        event(log, logging.WARNING, "handed over the primary role", replica_index=target.replica_index,
              address=target.address, sequence=last, take_over_sent=written, take_over_taken=taken,
              seconds=round(time.monotonic() - started, 3))
        return target

    def _handover_target(self, to_replica: int | None, deadline: float) -> BackupLink:
        """The in-sync backup to hand over to: only a member of etcd's in-sync set can be elected. One
        that installed its snapshot and is joining (a replica just restarted, Ready already) is waited
        for until ``deadline``, as a rolling restart stops the primary right after its backup came back."""
        while True:
            candidates = [(key, link) for key, link in self._links.items() if link.closed is None
                          and (to_replica is None or link.replica_index == to_replica)]
            links = [link for key, link in candidates if key in self._in_sync and key not in self._joining]
            joining = [link for key, link in candidates if link.installed_at]
            if links or not joining or time.monotonic() >= deadline or self._state != PRIMARY:
                break
            with self._acks:
                self._acks.wait(min(0.05, max(0.0, deadline - time.monotonic())))
        if not links:
            which = f"replica {to_replica}" if to_replica is not None else "any backup"
            raise RequestError(Reason.SWITCHOVER_REFUSED,
                               f"cannot hand the primary role over: {which} is not in the in-sync set "
                               f"(in sync: {sorted(k[0] for k in self._in_sync) or 'none'})")
        return max(links, key=lambda link: link.acknowledged)

    def switch_over(self, to_replica: int | None, timeout: float) -> tuple[int, str]:
        """ShardRole.switch_over: ``hand_over`` for an operator's request. Asked to hand the role to
        itself, a primary answers at once: a client whose first request was cut off by the handover it
        asked for (it left the old primary mid-call) asks the replica it named again, and is answered."""
        if to_replica == self.settings.replica_index:
            self.check_primary()
            return self.settings.replica_index, self.settings.address
        target = self.hand_over(to_replica, timeout)
        return target.replica_index, target.address

    def taking_over(self) -> None:
        """Backup: its primary handed it the term (it applied every record): once the stream ends, end
        the term in etcd and campaign without waiting out the promise to the old primary."""
        self._taking_over = True
        self._primary_gone = True
        self._no_campaign_until = 0.0  # it may have handed a term over itself before
        self._leading_soon_until = time.monotonic() + _TAKE_OVER_WAIT
        self._leader = None  # refusals meanwhile name no old primary to go back to

    def _newer_term_claimed(self, claimed: int) -> None:
        """A backup says a newer term began: etcd decides (a peer's word alone deposes no primary)."""
        try:
            leader = self._coordination.leader()
        except CoordinationError as error:
            raise RequestError(Reason.NOT_PRIMARY, f"a backup claims term {claimed}, newer than {self._epoch}, "
                               f"and etcd cannot confirm it: {error}") from None
        if leader is None or leader.epoch != self._epoch or leader.incarnation != self.settings.incarnation:
            self._deposed(f"a backup knows a newer term ({claimed} > {self._epoch}), and etcd agrees")
            return
        raise RequestError(Reason.INVALID_REQUEST,
                           f"the backup claims term {claimed}, but etcd says term {self._epoch} goes on")

    def detach(self, link: BackupLink) -> None:
        if self._log is not None:
            self._log.detach(link)
        self._notify()

    def _notify(self) -> None:
        with self._acks:
            self._acks.notify_all()

    def _watch_backups(self) -> None:
        """Primary: grow the in-sync set with caught-up backups, shrink it by failed ones (etcd first)."""
        while not self._stopping.is_set() and self._state == PRIMARY:
            self._stopping.wait(0.05)
            log_ = self._log
            if log_ is None or self._state != PRIMARY:
                return  # deposed meanwhile
            now = time.monotonic()
            for key, link in list(self._links.items()):
                if link.closed is None and key in self._in_sync and link.waiting_since:
                    self._check_silence(link, now - link.waiting_since)
            failed = {key for key in self._in_sync if key not in self._links or self._links[key].closed}
            self._join(log_)
            caught_up = {key for key, since in self._joining.items() if key not in failed
                         and key in self._links and self._links[key].acknowledged >= since}
            if (failed or caught_up) and self._handed_to is None:
                self._change_in_sync(failed, caught_up)
            self._log_consistency()
            for key, link in list(self._links.items()):
                if link.closed is not None and key not in self._in_sync:
                    del self._links[key]

    def _watch_proof(self) -> None:
        """Primary: every 50 ms, whether it can still prove its term (for the primary-only health)."""
        while not self._stopping.is_set() and self._state == PRIMARY:
            self._publish_proof()
            self._stopping.wait(0.05)
        self._publish_proof()

    def _check_silence(self, link: BackupLink, unanswered: float) -> None:
        """Drop an in-sync backup that left a message unanswered for --replication-timeout when its host
        or link is silent too (no TCP acknowledgement meanwhile), or for --backup-stall-timeout when
        only its process is slow (compiling, paused, loaded): a busy backup stalls acknowledgements for
        a while rather than leave the in-sync set, where one more fault would lose what only the
        primary then holds."""
        timeout = self.settings.replication_timeout
        if unanswered <= timeout:
            return
        host_alive = link.transport_alive(timeout)
        if host_alive is False:
            link.close(f"no answer for {timeout:g}s, nor a TCP acknowledgement")
        elif unanswered > self.settings.backup_stall_timeout:
            link.close(f"no answer for {self.settings.backup_stall_timeout:g}s")

    def _publish_proof(self) -> None:
        """Tell the health service whether this primary can prove its term (it acknowledges nothing
        without the proof, so probes and clients must not take it for the primary meanwhile)."""
        proven = self._state == PRIMARY and self.proves_lease()
        if proven != self._proven:
            self._proven = proven
            if not proven:
                event(log, logging.WARNING, "cannot prove this replica still leads: not serving until it can",
                      epoch=self._epoch)
            self.on_proof(proven)

    @property
    def proven(self) -> bool:
        """Primary: whether the last check proved its term (see proves_lease)."""
        return self._proven

    def _log_membership(self) -> None:
        """Under the order, before the change about to be ordered: when workers joined, restarted, left
        or expired since the consistency state was last logged, log it now. A sync step decided with a
        worker live is then never acknowledged before the backups know that worker, and the replica
        elected next waits for it as this one would (the loop's logging every 50 ms may come too late:
        a stalled loop, a kill in between)."""
        if self.membership_generation is None or self.consistency_state is None:
            return
        generation = self.membership_generation()  # read before the state: a later move logs again
        if generation == self._logged_generation:
            return
        self._log_state_if_changed()
        self._logged_generation = generation

    def _log_consistency(self) -> None:
        if self.consistency_state is None:
            return
        try:
            with self.ordered():  # read in the order: a sync step moves only under it
                self._log_state_if_changed()
        except RequestError:
            return  # deposed meanwhile

    def _log_state_if_changed(self) -> None:
        """Under the order: log the consistency state unless it is the one logged last."""
        assert self.consistency_state is not None
        state = self.consistency_state()
        if state != self._logged_consistency:
            self._append(*records.consistency_state(state))
            self._logged_consistency = state

    def _join(self, log_: UpdateLog) -> None:
        """Backups join at a fixed sequence (as Kafka's in-sync replicas do), not at "every change so far",
        which a busy log keeps out of reach: one that installed its snapshot is given the log's sequence
        then; once it acknowledged that, acknowledgements wait for it from now on (grown locally), and it
        goes into etcd's isr once it acknowledged the sequence of that moment too."""
        for key, link in self._links.items():
            if key in self._in_sync or link.closed is not None or not link.installed_at:
                continue
            if link.join_at is None:
                link.join_at = log_.sequence
            if link.acknowledged >= link.join_at:
                with self._acks:
                    self._in_sync.add(key)
                link.joined_at = time.monotonic()
                self._joining[key] = log_.sequence  # read after the grow: every later append waits for it

    def _change_in_sync(self, failed: set[tuple[int, int]], caught_up: set[tuple[int, int]]) -> None:
        if self._state != PRIMARY or self._stopping.is_set():
            return
        epoch = self._epoch
        # Grown locally before (_join); written to etcd once caught up; shrunk locally after etcd agreed.
        me = (self.settings.replica_index, self.settings.incarnation)
        members = sorted((self._in_sync - failed - (set(self._joining) - caught_up)) | {me})
        try:
            addresses = {key[0]: self._links[key].address for key in members if key in self._links}
            addresses[me[0]] = self.settings.address
            written = self._coordination.set_in_sync(epoch, members, addresses)
        except CoordinationError as error:
            _cannot_update_in_sync(failed=sorted(k[0] for k in failed),
                                   caught_up=sorted(k[0] for k in caught_up), error=str(error))
            return
        if not written:
            self._deposed("the in-sync set could not be written: another replica leads", epoch)
            return
        with self._acks:
            self._in_sync -= failed
            self._acks.notify_all()
        for key in failed | caught_up:
            self._joining.pop(key, None)
        for key in failed:
            event(log, logging.WARNING, "backup left the in-sync set", replica_index=key[0],
                  why=self._links[key].closed if key in self._links else "detached")
        now = time.monotonic()
        for key in caught_up:
            link = self._links.get(key)
            event(log, logging.INFO, "backup in sync", replica_index=key[0],
                  after_snapshot_seconds=round(now - link.installed_at, 3) if link is not None else None,
                  waited_for_after_seconds=round(link.joined_at - link.installed_at, 3)
                  if link is not None and link.joined_at else None)

    def lease_lost(self) -> None:
        """The coordinator found this replica's etcd lease gone: it rejoins with a new lease (keeping
        its state, if it holds any) before it follows or campaigns again."""
        self._rejoin = True  # first: the loop must rejoin before it follows anyone
        if self._state == PRIMARY:
            self._deposed("its etcd lease expired")
        self.interrupt_follow()
        self._wake.set()

    def _rejoin_with_a_new_lease(self) -> None:
        """Rejoin the replica set with a new lease. A replica holding state keeps its incarnation: the
        isr may name it, and it still holds every change it applied, so it may still be elected from
        the isr (the primary, if any, drops it from the isr first if it stops waiting for it). One
        holding nothing is a new member and catches up from a snapshot like a restarted replica."""
        assert self.new_coordination is not None and self._coordination is not None
        self._coordination.close()
        incarnation = self.settings.incarnation if self.has_state else random.getrandbits(48)
        coordination = self.new_coordination(incarnation)
        try:
            coordination.start()
            coordination.watch_leader(self._leader_changed)  # its first read may fail too: etcd may go again
        except CoordinationError as error:
            coordination.close()
            event(log, logging.WARNING, "cannot rejoin the replica set while etcd is unreachable",
                  error=str(error))
            self._wake.wait(0.5)
            return
        self.settings = dataclasses.replace(self.settings, incarnation=incarnation)
        self._coordination = coordination
        self._rejoin = False
        self._answered_at = 0.0
        self._set_state(CANDIDATE if self.has_state else STARTING)
        self.on_state(self._state)
        event(log, logging.WARNING, "rejoined the replica set with a new lease", incarnation=incarnation,
              holds_state=self.has_state, position=str(self.position()))

    def _deposed(self, why: str, epoch: int | None = None) -> None:
        """End this primary's term here (``epoch``: only that term's). Several threads may find the term
        over at once, and a finding may arrive after the replica already follows the next primary: only
        the first, while it still leads, acts; a later one must not touch the backup it has become."""
        with self._deposing:
            if self._state != PRIMARY or (epoch is not None and epoch != self._epoch):
                return
            if not self.lease_proven():
                # Its lease is gone too (frozen past it): rejoin as a new member before following anyone,
                # so the in-sync set never names a process etcd has already dropped.
                self._rejoin = True
            self._set_state(DEPOSED)  # calls waiting for the order see it and apply nothing more
        event(log, logging.ERROR, "no longer the primary; following the new one", why=why, epoch=self._epoch,
              position=str(self.position()))
        with self._acks:
            self._acks.notify_all()
        for link in list(self._links.values()):
            link.close("this replica is no longer the primary")
        self._links = {}
        self._in_sync = set()
        self._joining = {}
        self._publish_proof()
        self._wake.set()

    # ---- status ----

    def status(self) -> ps_pb2.ReplicaStatus:
        leader = self._leader
        status = ps_pb2.ReplicaStatus(
            replica_index=self.settings.replica_index, replicas=self.settings.replicas, role=self._state,
            epoch=self._epoch, applied_sequence=self.last_sequence(),
            etcd_reachable=self.lease_proven())
        if self._state == PRIMARY:
            status.primary_address = self.settings.address
            now = time.monotonic()
            sequence = self.last_sequence()
            for key, link in sorted(self._links.items()):
                status.backups.append(ps_pb2.BackupStatus(
                    replica_index=link.replica_index, address=link.address,
                    in_sync=key in self._in_sync and key not in self._joining,
                    acknowledged_sequence=link.acknowledged, lag_records=max(0, sequence - link.acknowledged),
                    lag_bytes=link.queued_bytes,
                    lag_seconds=now - link.waiting_since if link.waiting_since else 0.0))
        elif leader is not None:
            status.primary_address = leader.address
        return status


def _refuses_connections(address: str, timeout: float = 0.3) -> bool:
    """True when nothing listens at ``address`` any more (its host answered with a refusal)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False  # unreachable or slow: not proof; the lease decides
