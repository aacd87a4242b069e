"""A randomized fault test of real ps-servers against a reference model.

Worker processes (``worker_client.PSClient``) push known gradients through
fault proxies to a 2-shard cluster while a seeded schedule injects faults
(``schedule.KINDS``): server SIGKILL and SIGTERM (restarted on the same port and
checkpoint root), SIGTERM with a 0.05 s ``--drain-timeout``, connection cuts,
Checkpoint calls (also while a restarted server restores), token rotation,
worker SIGKILL (restarted: a new incarnation), requests over the table
limits, and idle clients holding streams against ``--max-concurrent-rpcs``.
At the end an oracle compares the servers' values with what the workers'
logs say was acknowledged, under the rules of docs/failure-semantics.md.

**Why the oracle is exact.** Push number ``k`` of worker ``w`` owns slot
``s = w * P + k`` and writes only there: one to four of its four elements
of ``dense`` (two in the part on each shard, see ``layout.dense_positions``),
element ``s`` of ``small`` (whole on one shard), and one row of the hash
tables ``emb`` and ``emb_rows`` on each shard. Its gradient is the integer
``g(s)`` in 1..8 (exact in float32 and bfloat16), SGD with learning rate 1
from zeros (``aggregation="sum"`` in sync mode; ``"row_mean"`` for
``emb_rows``, whose rows each get one push per step, so that a step's sum
restored from a checkpoint must still know which pushes carried each row),
so each element holds ``-count * g(s)``: it tells how many times its push
was applied there.
With top-k an element may ride on a later push of the same worker; every
acknowledged push logs which elements are still owed (the residual), so
the oracle knows which push carried each element. A worker appends (and
fsyncs) a line per acknowledged push before its next push, so a SIGKILL
loses none of its record.

**The rules** (per push, per shard it touches; ``count`` per element):

- never begun: 0.
- acknowledged: exactly 1; except where that shard was SIGKILLed after the
  push started and the push was acknowledged after the shard's newest
  completed checkpoint at the kill (``created_unix`` in the manifest, taken
  inside the snapshot): 0 or 1 (what a crash may lose).
- sync mode, acknowledged as dropped on ``d`` shards: those shards hold
  none of it and the others all of it ("dropped whole, never half-counted").
- ``push()`` raised, or its worker was SIGKILLed during it: 0 or 1 (a
  failed push may be applied partly; never twice); 0 if nothing was sent.
- a push in the background (async: ``push(wait=False)``,
  ``step(overlap=True)``, its arrays cleared once handed off): the rules
  above, acknowledged or raised by its handle's ``wait()``.
- top-k: an element still owed when its client closed: 0; owed when its
  worker was killed or replaced its client: 0 or 1; otherwise the rules of
  the acknowledged push that carried it, over the span from its own push's
  start to that push's acknowledgement.
- failures besides wrong values: a push that raised anything but an
  ``AuthenticationError`` after a token rotation (every fault here is one
  the docs say clients ride out); a call answered with a token rotated out
  ``probes.TOKEN_GRACE`` s before, on a stream opened before; a worker or server that
  hangs; a SIGTERM that does not exit 0; a limit request not refused with
  RESOURCE_EXHAUSTED or one that changed a table (a push message refused
  part way must keep, applied once, the rows of its chunks before the
  refused one, and change the full table not at all); a checkpoint written
  while restoring that lacks variables; ``checkpoint()`` refused while idle
  clients hold streams; a step (pull and push) longer than
  ``oracle.STALL_SECONDS``; a row of ``emb`` for an id workers only read
  with ``lookup_rows`` each step (``layout.serve_ids``: a read-only
  lookup creates nothing, on any replica).

**Replicated** (``--replicas 2``, ``replicated.py``): each shard runs as two
replicas on a real etcd, each behind its own proxy, and the faults are
``replicated.REPLICA_KINDS`` (SIGKILL of the primary or the backup, the
primary frozen with SIGSTOP until the other replica leads, etcd stopped and
restarted, the primary stopped with SIGTERM after it hands its role over,
an operator's switchover) besides connection cuts, Checkpoint calls, worker SIGKILLs and
requests over the table limits (among them a push message refused after
its first chunk applied). One in-sync replica of each shard always
survives, so no loss is allowed: every acknowledged push is in the values
exactly once, in sync mode also in a step whose primary died while it was
open. At the end every shard's replicas must hold the same bits (values,
optimizer slots, rows, versions, ledger, and in sync mode the open step's
sums), and the rows a push
refused part way applied must still hold what they did after the refusal.

**Networked** (``--replicas 2 --network``, ``networked.py`` and ``nemesis.py``):
every replica, every worker and each member of a 3-member etcd cluster
runs on a network host of its own (a network namespace on a bridge,
``tests/host_network.py``; ``tests/etcd_cluster.py``), and workers reach the
replicas directly. Besides the replicated kinds (less the proxies' cuts;
etcd-restart stops every member), the nemesis's ``nemesis.NETWORK_KINDS``
drop packets (never a reset: connections stall) between every pair of
parties: worker and replica, primary and backup, replica and etcd, both
ways or one way; a replica's host lost to every peer; a link down; an etcd
member SIGKILLed and restarted; etcd's leader cut off from the other
members. Each is healed after 1 to 6 s (a lost primary's host once the
other replica leads) and the next fault waits until every shard's replicas
are in sync, so the same no-loss rule and the same bit-for-bit comparison
hold. The run starts with every kind once, in a seeded order
(``schedule``); a kind the budget left out is a failure. The report gives
the failover the workers saw (``report.failover_seconds``): from a
primary's SIGKILL ("process death") or the loss of its host ("lost host")
to each worker's next acknowledged push, p50 and p99. Needs root, network
namespaces and iptables; every process is stopped by PID and every
namespace, veth and bridge deleted at the end.

Run: ``python tests/faults/randomized.py --seed 7`` (``--modes``, ``--kinds``, ``--replicas``,
``--network``, ``--events``, ``--budget``, ``--soak``, ``--workdir`` to keep the logs);
the seed is printed, and the same seed replays the same schedule of faults
(the processes' timing still varies). Every process is stopped by PID.

The parts, one job each, in this package: ``layout`` (slots, elements,
modes), ``worker`` (the worker process), ``cluster`` (servers, proxies,
workers), ``replicated`` (replica sets on etcd, their process faults and
the comparison of replicas), ``networked`` (the same on network hosts),
``schedule``, ``probes`` and ``nemesis`` (the faults; the network's in
``nemesis``), ``oracle`` (the rules above), ``report``; this module runs the
modes and holds the command line.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import random
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

_TESTS = pathlib.Path(__file__).resolve().parents[1]
for _path in (str(_TESTS.parent), str(_TESTS)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from faults import layout
from faults.cluster import Cluster
from faults.layout import MODES, SOAK_SLOTS
from faults.nemesis import NETWORK_KINDS
from faults.networked import NetworkedCluster
from faults.networked import unavailable as network_unavailable
from faults.oracle import Oracle
from faults.replicated import REPLICA_KINDS, SHARED_KINDS, ReplicatedCluster
from faults.report import Report, Timeline, failover_seconds
from faults.schedule import KINDS, FaultSchedule

#: --network: the kinds shared with unreplicated runs, less "cut" (its fault proxies are gone: workers
#: reach the replicas over the network, and the network's faults replace the proxies' cuts).
NETWORK_SHARED_KINDS = tuple(kind for kind in SHARED_KINDS if kind != "cut")


def run_mode(mode: str, seed: int, events: int, kinds: list[str], budget: float, workdir: pathlib.Path,
             pace: float, replicas: int = 1, network: bool = False) -> Report:
    """One mode: set the cluster up, run the fault schedule, stop the workers and run the oracle."""
    workdir.mkdir(parents=True, exist_ok=True)
    report = Report(mode, seed)
    timeline = Timeline()
    rng = random.Random(f"{seed}-{mode}")
    kind_of_cluster = NetworkedCluster if network else ReplicatedCluster if replicas > 1 else Cluster
    cluster = kind_of_cluster(mode, seed, kinds, workdir, pace, rng, report, timeline)
    schedule = FaultSchedule(cluster, rng, kinds, events, budget, report, timeline)

    def finish() -> None:
        schedule.probes.join_checks()
        cluster.stop_workers()
        if cluster.config["consistency"] == "sync":
            cluster.flush_sync_step()
        Oracle(cluster, timeline, report).check()
        report.failovers = failover_seconds(timeline, [cluster.worker_log(i) for i in range(layout.WORKERS)])
        if isinstance(cluster, ReplicatedCluster):
            cluster.check_replicas()

    started = time.monotonic()
    phases = []
    try:
        for name, phase in (("setup", cluster.setup), ("schedule", schedule.run), ("finish", finish)):
            try:
                phase()
            except Exception as error:  # noqa: BLE001 - a crash of the harness is a failure to report
                import traceback

                report.fail("harness error",
                            f"{type(error).__name__}: {error}\n{traceback.format_exc()[-1500:]}")
                if name != "schedule":
                    break
                # The schedule stopped part way: the oracle still checks what was acknowledged until then.
            phases.append(f"{name} {time.monotonic() - started:.1f}s")
    finally:
        cluster.cleanup()
    report.seconds = time.monotonic() - started
    report.notes.append(f"phases ended at: {', '.join(phases)}, cleanup {report.seconds:.1f}s")
    return report


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line; ``--soak`` also sets the slot count the controller and workers use."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=None,
                        help="schedule seed (default: $WEHUB_FAULT_SEED or a random one; always printed)")
    parser.add_argument("--events", type=int, default=None,
                        help="fault events in all, split over the modes (default 60; --soak: 1,000)")
    parser.add_argument("--modes", default=None,
                        help=f"comma-separated, of {', '.join(MODES)} (default: all)")
    parser.add_argument("--kinds", default=None,
                        help=f"comma-separated fault kinds, of {', '.join(KINDS)} (default: all); with "
                             f"--replicas 2, of {', '.join([*REPLICA_KINDS, *SHARED_KINDS])} (default: all); "
                             f"with --network also {', '.join(NETWORK_KINDS)}, without cut")
    parser.add_argument("--replicas", type=int, choices=(1, 2), default=1,
                        help="replicas per shard: 2 runs each shard as a replica set on etcd "
                             "(no loss allowed)")
    parser.add_argument("--network", action="store_true",
                        help="with --replicas 2: every replica, worker and etcd member (3 of them) on a "
                             "network host of its own, and the network's faults "
                             f"({', '.join(NETWORK_KINDS)}); "
                             "needs root, network namespaces and iptables")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds of fault schedule in all, split over the modes (default 160; --soak: "
                             "3,600); setup and checks come on top")
    parser.add_argument("--soak", action="store_true",
                        help=f"long run: more events and time by default, {SOAK_SLOTS:,} push slots")
    parser.add_argument("--pace", type=float, default=0.02,
                        help="longest random pause between a worker's pushes")
    parser.add_argument("--workdir", default=None,
                        help="keep logs and checkpoints here (default: a temporary dir)")
    args = parser.parse_args(argv)
    if args.events is None:
        args.events = 1000 if args.soak else 60
    if args.budget is None:
        args.budget = 3600.0 if args.soak else 160.0
    if args.soak:
        layout.configure(SOAK_SLOTS)
    if args.seed is None:
        args.seed = int(os.environ.get("WEHUB_FAULT_SEED") or random.SystemRandom().randrange(1 << 31))
    args.modes = [m for m in (args.modes or ",".join(MODES)).split(",") if m]
    if args.network and args.replicas < 2:
        parser.error("--network needs --replicas 2")
    if args.network and (why := network_unavailable()):
        parser.error(f"--network cannot run here: {why}")
    allowed = ([*REPLICA_KINDS, *NETWORK_SHARED_KINDS, *NETWORK_KINDS] if args.network
               else [*REPLICA_KINDS, *SHARED_KINDS] if args.replicas > 1 else list(KINDS))
    args.kinds = [k for k in (args.kinds or ",".join(allowed)).split(",") if k]
    for mode in args.modes:
        if mode not in MODES:
            parser.error(f"--modes: mode {mode!r} is not one of {', '.join(MODES)}")
    for kind in args.kinds:
        if kind not in allowed:
            parser.error(f"--kinds: fault kind {kind!r} is not one of {', '.join(allowed)} "
                         f"(with --replicas {args.replicas}{' --network' if args.network else ''})")
    return args


def main(argv: list[str]) -> list[Report]:
    """Run each mode in turn with one seed; the reports, also printed. The CI test calls this."""
    args = parse_args(argv)
    soak = " --soak" if args.soak else ""
    print(f"randomized fault test: seed {args.seed} (reproduce: --seed {args.seed}{soak} "
          f"--budget {args.budget:g} --modes {','.join(args.modes)} --kinds {','.join(args.kinds)} "
          f"--events {args.events} --replicas {args.replicas}{' --network' if args.network else ''})",
          flush=True)
    keep = args.workdir is not None
    root = pathlib.Path(args.workdir) if keep else pathlib.Path(tempfile.mkdtemp(prefix="wehub-faults-"))
    reports = []
    try:
        per_mode_events = math.ceil(args.events / len(args.modes))
        for mode in args.modes:
            report = run_mode(mode, args.seed, per_mode_events, args.kinds, args.budget / len(args.modes),
                              root / mode, args.pace, args.replicas, args.network)
            print(report.summary(), flush=True)
            reports.append(report)
    finally:
        if not keep and not any(r.violations for r in reports):
            shutil.rmtree(root, ignore_errors=True)
        elif reports:
            print(f"logs and checkpoints kept in {root}", flush=True)
    return reports


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(f"randomized fault test: signal {signum}; stopping every process it started")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # run the cleanup: servers and workers stopped by PID
    results = main(sys.argv[1:])
    total = sum(sum(r.events.values()) for r in results)
    failed = sum(len(r.violations) for r in results)
    print(f"fault events {total}, violations {failed}", flush=True)
    sys.exit(1 if failed else 0)
