"""The oracle: after a run, each push's count on each shard against the rules in randomized.py's docstring.

It reads the workers' logs (what was begun, acknowledged, raised, still
owed by top-k), pulls the servers' values through the admin client, and
derives how many times each push was applied from them (each element holds
``-count * g(slot)``). What a fault may excuse comes from the run's
timeline: the loss windows of server SIGKILLs and the token rotations.
"""

from __future__ import annotations

import collections
import json
from typing import Any

import numpy as np

from faults import layout
from faults.cluster import TABLE_MEMORY_ROWS, Cluster
from faults.layout import WORKERS, dense_positions, gradient_value, table_ids
from faults.report import Report, Timeline

# A step (pull and push) waiting longer is a stall. Legitimate waits here: a server's restart (up to 10 s
# on a loaded 2-core machine, and two events may restart both shards in turn), the client's backoff (3 s),
# a dead worker's lease (3 s), a token file re-read (2 s).
STALL_SECONDS = 45.0
#: The hash tables every push writes the same two rows of: "emb" summed in sync mode, "emb_rows" averaged
#: per row (aggregation "row_mean"); one push per row and step, so both hold ``-count * g``.
ROW_TABLES = ("emb", "emb_rows")


class Oracle:
    """Checks one finished run; every violation goes to ``report`` under its category."""

    def __init__(self, cluster: Cluster, timeline: Timeline, report: Report) -> None:
        self.cluster = cluster
        self.config = cluster.config
        self.windows = timeline.windows
        self.rotations = timeline.rotations
        self.report = report

    def _read_logs(self) -> list[dict[str, Any]]:
        entries = []
        for index in range(WORKERS):
            path = self.cluster.worker_log(index)
            for line in path.read_text().splitlines() if path.exists() else []:
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue  # a line cut by SIGKILL (only "begin" lines are written without fsync)
                entry["w"] = index
                entries.append(entry)
        return entries

    def check(self) -> None:
        """Every begun push: its count on each shard within the rules; no element written twice or stray."""
        ids_a, ids_b = table_ids()
        per_worker, small_shard = layout.PER_WORKER, self.cluster.small_shard
        pushes: dict[int, dict[str, Any]] = {}  # slot -> its ack, raise, or (begun, never answered) inflight
        by_incarnation: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
        ended: dict[str, dict[str, Any]] = {}  # incarnations that closed their client (residual dropped)
        for entry in self._read_logs():
            if entry["ev"] == "end":
                ended[entry["inc"]] = entry
            elif entry["ev"] == "begin":
                pushes.setdefault(entry["w"] * per_worker + entry["k"],
                                  {"ev": "inflight", "inc": entry["inc"], "t0": entry["t"]})
            elif entry["ev"] in ("ack", "raise"):
                entry["slot"] = entry["w"] * per_worker + entry["k"]
                entry["began"] = pushes.get(entry["slot"], {}).get("t0", entry["t1"])
                pushes[entry["slot"]] = entry
                by_incarnation[entry["inc"]].append(entry)
        self.report.pushes.update(p["ev"] for p in pushes.values())
        answered = [p for p in pushes.values() if p["ev"] != "inflight"]
        if answered:
            slowest = max(answered, key=lambda p: p["t1"] - p["began"])
            waited = slowest["t1"] - slowest["began"]
            self.report.notes.append(f"slowest push (pull included): {waited:.1f}s, slot {slowest['slot']}")
            for push in answered:
                if push["t1"] - push["began"] > STALL_SECONDS:
                    self.report.fail("stall", f"slot {push['slot']}: the step (pull and push) took "
                                              f"{push['t1'] - push['began']:.1f}s (> {STALL_SECONDS:.0f}s)")

        begun = sorted(pushes)
        final = self.cluster.call_admin(lambda c: c.pull(["dense", "small"]))
        emb_ids = np.concatenate([ids_a[begun], ids_b[begun]])
        # Read only: emb keeps most rows on disk, and a pull of all of them would pass its memory budget.
        tables = {name: (self.cluster.call_admin(
                             lambda c, name=name: c.lookup_rows(name, emb_ids, missing="zeros"))
                         if begun else np.zeros((0, 2), np.float32)) for name in ROW_TABLES}
        row_of = {slot: i for i, slot in enumerate(begun)}
        # emb has a disk tier: with more rows per shard than its memory budget, some must lie on disk.
        if len(begun) > 2 * TABLE_MEMORY_ROWS:
            on_disk = sum(info.variables["emb"]["rows_on_disk"]
                          for info in self.cluster.call_admin(lambda c: c.describe()))
            if not on_disk:
                self.report.fail("disk tier", f"emb holds {len(begun)} rows per shard, more than its memory "
                                              f"budget of {TABLE_MEMORY_ROWS}, and none is on disk")
            else:
                self.report.notes.append(f"emb rows on disk at the end: {on_disk}")
        # Workers read serve_ids() with lookup_rows every step: a read-only lookup never makes a row.
        exported, _ = self.cluster.call_admin(lambda c: c.export_rows("emb"))
        made = np.intersect1d(exported, layout.serve_ids())
        if made.size:
            self.report.fail("lookup changed state", f"emb has rows for ids {made.tolist()}, which workers "
                                                     "only read with lookup_rows (read only)")

        # Elements no begun push writes must be untouched.
        written = np.zeros(layout.DENSE, bool)
        for slot in begun:
            written[[element for _, element in dense_positions(slot)]] = True
        small_written = np.zeros(layout.SLOTS, bool)
        small_written[begun] = True
        for name, values, mask in (("dense", final["dense"], written),
                                   ("small", final["small"], small_written)):
            stray = np.flatnonzero(values[~mask])
            if stray.size:
                self.report.fail("stray write",
                                 f"{name}: {stray.size} elements no push wrote are nonzero, e.g. "
                                 f"{np.flatnonzero(~mask)[stray[:5]].tolist()}")

        topk = self.config["topk_rows"] is not None
        carriers = self._topk_carriers(by_incarnation) if topk else {}
        raised: dict[str, list[str]] = {}  # error type -> the pushes that raised it
        for slot, push in sorted(pushes.items()):
            g = gradient_value(slot)
            i = row_of[slot]
            # shard -> [(variable, element or row id, times applied)]
            elements: dict[int, list[tuple[str, int, float]]] = {
                0: [(name, int(ids_a[slot]), -float(v) / g + 0.0) for name, rows in tables.items()
                    for v in rows[i]],
                1: [(name, int(ids_b[slot]), -float(v) / g + 0.0) for name, rows in tables.items()
                    for v in rows[len(begun) + i]],
            }
            for shard, element in dense_positions(slot):
                elements[shard].append(("dense", element, -float(final["dense"][element]) / g + 0.0))
            elements[small_shard].append(("small", slot, -float(final["small"][slot]) / g + 0.0))
            where = f"slot {slot} (worker {slot // per_worker} push {slot % per_worker}, {push['ev']})"
            for shard, items in elements.items():
                carried = [item for item in items if topk and item[0] not in ROW_TABLES]
                self._check(push, shard, [item for item in items if item not in carried], where)
                for item in carried:
                    self._check_carried(push, shard, item, carriers, ended, where)
            if push["ev"] == "raise" and not self._raise_allowed(push):
                raised.setdefault(push["error"], []).append(f"{where}: {push['message']}")
            if push["ev"] == "ack" and push.get("drop"):
                self._check_sync_drop(push, elements, where)
        for error, which in raised.items():
            self.report.fail("push raised", f"push() raised {error} {len(which)} times (first: {which[0]})")

    def _topk_carriers(self, by_incarnation) -> dict[tuple[str, int], dict[str, Any]]:
        """(variable, element) -> the acknowledged push that sent it: the first after which it is not owed."""
        carriers: dict[tuple[str, int], dict[str, Any]] = {}
        for entries in by_incarnation.values():
            acks = [e for e in entries if e["ev"] == "ack"]
            for push in acks:
                slot = push["slot"]
                for what, element in [*(("dense", e) for _, e in dense_positions(slot)), ("small", slot)]:
                    for ack in (a for a in acks if a["slot"] >= slot):
                        if element not in ack["owed"].get(what, ()):
                            carriers[what, element] = ack
                            break
        return carriers

    def _check_carried(self, push: dict[str, Any], shard: int, item: tuple[str, int, float],
                       carriers: dict[tuple[str, int], dict[str, Any]], ended: dict[str, Any],
                       where: str) -> None:
        """Top-k: an element of a dense gradient counts under the rules of the push that carried it."""
        what, element, times = item
        if push["ev"] != "ack":  # a failed push's gradient is not taken into the residual: its own rules
            self._check(push, shard, [item], where)
            return
        carrier = carriers.get((what, element))
        if carrier is None:  # still owed when its client went away: never sent, or sent by a push that failed
            allowed = (0.0,) if push["inc"] in ended else (0.0, 1.0)
            if times not in allowed:
                self.report.fail("top-k residual",
                                 f"{where}: {what}[{element}] on shard {shard} applied {times:g} times, "
                                 f"but it "
                                 f"was still owed (top-k residual) when its client "
                                 f"{'closed' if push['inc'] in ended else 'was killed or replaced'}")
            return
        # It may have been applied any time from this push's start to the carrier's acknowledgement.
        self._check(dict(carrier, t0=push["t0"]), shard, [item], f"{where}, sent with slot {carrier['slot']}")

    def _lossy(self, push: dict[str, Any], shard: int) -> bool:
        """Whether a SIGKILL of ``shard`` may have lost this acknowledged push (after its last checkpoint)."""
        t0, t1 = push.get("t0"), push.get("t1")
        return any(w.shard == shard and t1 > w.snapshot and t0 < w.killed for w in self.windows)

    def _check(self, push: dict[str, Any], shard: int, items: list[tuple[str, int, float]],
               where: str) -> None:
        counts = [c for _, _, c in items]
        described = ", ".join(f"{what}[{element}]={c:g}" for what, element, c in items)
        if any(c not in (0.0, 1.0) for c in counts):
            self.report.fail("applied twice",
                             f"{where}: shard {shard} applied it {described} times (each must be 0 or 1)")
            return
        if push["ev"] in ("raise", "inflight"):
            if push["ev"] == "raise" and not push["pushed"] and any(counts):
                self.report.fail("applied unsent",
                                 f"{where}: shard {shard} holds a push that was never sent: {described}")
            return  # a failed push may be applied partly
        if self._lossy(push, shard):
            return
        if push.get("drop"):
            return  # checked per push in _check_sync_drop
        if not all(c == 1.0 for c in counts):
            kills = [(round(w.snapshot, 3), round(w.killed, 3)) for w in self.windows
                     if w.shard == shard and abs(w.killed - push["t1"]) < 30]
            self.report.fail("acknowledged push missing",
                             f"{where}: acknowledged (t0 {push['t0']:.3f}, t1 {push['t1']:.3f}) but "
                             f"shard {shard} has {described} (each must be 1; SIGKILLs of shard {shard} "
                             f"near then as (newest checkpoint, kill): {kills})")

    def _check_sync_drop(self, push: dict[str, Any], elements: dict[int, list[tuple[str, int, float]]],
                         where: str) -> None:
        """sync: a push dropped on ``d`` shards holds nothing there and everything elsewhere."""
        if any(self._lossy(push, shard) for shard in elements):
            return
        whole = {shard: {times for _, _, times in items} for shard, items in elements.items()}
        dropped_shards = sum(1 for counts in whole.values() if counts == {0.0})
        if any(len(counts) != 1 for counts in whole.values()) or dropped_shards != push["drop"]:
            self.report.fail("sync drop",
                             f"{where}: acknowledged as dropped on {push['drop']} shard(s), but the shards "
                             f"hold "
                             f"it {whole} times (a late push is dropped whole, never half-counted)")

    def _raise_allowed(self, push: dict[str, Any]) -> bool:
        """An AuthenticationError answers a rotated-out token; nothing else is expected of these faults."""
        return push["error"] == "AuthenticationError" and any(t <= push["t1"] for t in self.rotations)
