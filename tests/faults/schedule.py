"""The seeded fault schedule: which fault comes next, and injecting the ones that need no check of their own.

The same seed draws the same kinds, shards, workers and pauses (the
processes' timing still varies). A networked run starts with a round of
every kind once, in a seeded order, then draws kinds by weight: a short run
still has each kind, and one it could not fit in its budget is a failure.
Faults that check a guarantee as they run (token rotation, limits, idle
streams, Checkpoint during a restore) are in ``probes``, the network's in
``nemesis``; the schedule shares its random sequence with them and with the
cluster's setup, so the order of draws is part of what a seed replays.
"""

from __future__ import annotations

import json
import random
import signal
import time

from faults.cluster import Cluster
from faults.layout import NUM_SHARDS, WORKERS
from faults.nemesis import NETWORK_KINDS
from faults.probes import Probes
from faults.replicated import REPLICA_KINDS, ReplicatedCluster
from faults.report import Report, Timeline

KINDS = {  # kind -> weight in the schedule: the quick kinds more often, so a short run still has many events
    "server-kill": 3, "server-term": 1, "drain": 1, "cut": 4, "checkpoint": 3, "ckpt-restore": 1,
    "token": 2, "worker-kill": 3, "limit": 2, "streams": 1,
}


class FaultSchedule:
    """Injects ``target_events`` faults of ``kinds`` into ``cluster``, within ``budget`` seconds."""

    def __init__(self, cluster: Cluster, rng: random.Random, kinds: list[str], target_events: int,
                 budget: float, report: Report, timeline: Timeline) -> None:
        self.cluster = cluster
        self.rng = rng
        self.kinds = kinds
        self.target_events = target_events
        self.budget = budget
        self.report = report
        self.probes = Probes(cluster, rng, report, timeline)

    def run(self) -> None:
        """Draw and inject faults until enough ran or the budget is spent; restart a worker that died."""
        cluster = self.cluster
        deadline = time.monotonic() + self.budget
        weights = [{**KINDS, **REPLICA_KINDS, **NETWORK_KINDS}[k] for k in self.kinds]
        cover = cluster.covers_every_kind
        first_round = self.rng.sample(self.kinds, len(self.kinds)) if cover else []
        time.sleep(self.rng.uniform(0.5, 1.5))
        while sum(self.report.events.values()) < self.target_events and time.monotonic() < deadline:
            for index, popen in cluster.workers.items():
                if popen.poll() is not None and not cluster.stop_file.exists():
                    self.report.fail("worker",
                                     f"worker {index} exited with {popen.returncode} before the end: "
                                     f"{cluster.worker_output[index].read_text(errors='replace')[-600:]!r}")
                    cluster.start_worker(index)
            kind = first_round.pop(0) if first_round else self.rng.choices(self.kinds, weights)[0]
            self.event(kind)
            time.sleep(self.rng.uniform(0.05, 0.8))
        missing = [kind for kind in self.kinds if cover and not self.report.events[kind]]
        if missing:
            self.report.fail("schedule", f"fault kinds that never ran (budget {self.budget:.0f}s, "
                                         f"{sum(self.report.events.values())} events): {', '.join(missing)}")

    def event(self, kind: str) -> None:
        """Inject one fault of ``kind`` (logged to events.log) and count it."""
        cluster = self.cluster
        shard = self.rng.randrange(NUM_SHARDS)
        with open(cluster.workdir / "events.log", "a") as events:
            events.write(json.dumps({"t": time.time(), "kind": kind, "shard": shard}) + "\n")
        if kind in NETWORK_KINDS:
            nemesis = getattr(cluster, "nemesis", None)
            assert nemesis is not None, f"{kind} needs --network"
            what = nemesis.event(kind, shard, self.rng)
            with open(cluster.workdir / "events.log", "a") as events:
                done = {"t": time.time(), "kind": kind, "shard": shard, "done": what}
                events.write(json.dumps(done) + "\n")
        elif kind == "server-kill":
            cluster.stop_server(shard, signal.SIGKILL)
            time.sleep(self.rng.uniform(0, 0.5))  # workers retry against a dead address
            cluster.restart_server(shard)
        elif kind in ("server-term", "drain"):
            cluster.stop_server(shard, signal.SIGTERM)
            cluster.restart_server(shard)
        elif kind == "ckpt-restore":
            if self.rng.random() < 0.5:
                cluster.stop_server(shard, signal.SIGKILL)
            else:
                cluster.stop_server(shard, signal.SIGTERM)
            self.probes.restart_while_checkpointing(shard)
        elif kind == "cut":
            if self.rng.random() < 0.5:
                everywhere = [*cluster.proxies, *cluster.lane_proxies]
                for proxy in (everywhere if self.rng.random() < 0.3 else cluster.shard_proxies(shard)):
                    proxy.cut_open()
            else:  # a burst: every connection for a while is cut at a random byte
                proxies = cluster.shard_proxies(shard)
                for proxy in proxies:
                    proxy.cutting = True
                time.sleep(self.rng.uniform(0.2, 1.0))
                for proxy in proxies:
                    proxy.cutting = False
        elif kind in REPLICA_KINDS:
            assert isinstance(cluster, ReplicatedCluster), f"{kind} needs --replicas 2"
            cluster.replica_event(kind, shard, self.rng)
        elif kind == "checkpoint":
            cluster.call_admin(lambda c: c.checkpoint())
        elif kind == "token":
            self.probes.rotate_token()
        elif kind == "worker-kill":
            index = self.rng.randrange(WORKERS)
            popen = cluster.workers[index]
            if popen.poll() is None:
                popen.kill()
            popen.wait(30)
            time.sleep(self.rng.uniform(0, 0.5))
            cluster.start_worker(index)
        elif kind == "limit":
            self.probes.over_limits(shard)
        elif kind == "streams":
            self.probes.idle_streams()
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
        self.report.events[kind] += 1
