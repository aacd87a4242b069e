"""``ps-admin``: the whole cluster as a readable table, and operator actions.

    ps-admin status                 # each shard: health, variables known and held, bytes, versions,
                                    # workers, checkpoint; in ssp/sync mode also each shard's step,
                                    # dropped gradients and largest staleness admitted;
                                    # a shard that does not answer is shown UNREACHABLE (exit status 3);
                                    # replicated shards: each replica's role, health, epoch, applied
                                    # sequence, in-sync state, lag and etcd lease, and each shard's primary
    ps-admin checkpoint             # every shard writes a checkpoint now
    ps-admin finish                 # run-to-completion jobs: servers checkpoint and exit 0

Addresses, TLS and token come from flags or from the same environment as the
workers; ``--help`` lists those variables, taken from the tables in
wehub_ps.cluster by which PSClient.from_env reads them. ps-admin connects as
an observer: it never counts as a worker.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import ChainMap
from collections.abc import Mapping, Sequence
from typing import Any

from wehub_ps.cluster import ADDRESSES_ENV, CLUSTER_ENVIRONMENT, CONNECTION_ENVIRONMENT, EnvSetting
from worker_client.client import PSClient
from worker_client.errors import PSError, PSUnavailableError
from worker_client.shard_info import BackupInfo, ReplicaInfo, ShardInfo

__all__ = ["ENVIRONMENT", "main", "replicas_table", "status_table"]

#: The environment variables ps-admin reads (through PSClient.from_env); it is
#: always the observer "ps-admin", so no variable naming a worker is among them.
ENVIRONMENT: tuple[EnvSetting, ...] = tuple(
    setting for setting in CLUSTER_ENVIRONMENT + CONNECTION_ENVIRONMENT if setting.argument != "worker_id")


def _age(created_unix: float) -> str:
    seconds = max(0.0, time.time() - created_unix)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


#: ps-admin status: some shard did not answer (its row says why); the others are shown.
EXIT_SHARD_DOWN = 3


def status_table(infos: Sequence[ShardInfo | PSError], health: Sequence[str],
                 addresses: Sequence[str] = ()) -> str:
    """Shards, then workers, as aligned text tables.

    ``infos[i]`` is shard i's state, or the error it answered Describe with
    (its row then shows only its address and ``health``); ``addresses``
    names those shards. "variables" counts the variables a shard knows,
    "held" those it holds a part of. In ssp and sync mode a second table
    gives each shard's step and what its mode decided, and a line the
    cluster's step, dropped gradients and largest staleness.
    """
    shards = [["shard", "address", "health", "variables", "held", "stored MB", "limit MB", "versions",
               "live workers", "last checkpoint", "restored from"]]
    workers: dict[str, dict] = {}
    answered = [info for info in infos if isinstance(info, ShardInfo)]
    for i, (info, state) in enumerate(zip(infos, health)):
        if not isinstance(info, ShardInfo):
            shards.append([f"{i}/{len(infos)}", addresses[i] if i < len(addresses) else "?", state,
                           *["-"] * 8])
            continue
        versions = [v["version"] for v in info.variables.values() if v["row_end"] or v["num_rows"]]
        checkpoint = info.last_checkpoint
        restored = info.restored_from
        shards.append([
            f"{info.shard_index}/{info.num_shards}", info.address, state, str(len(info.variables)),
            str(sum(1 for v in info.variables.values() if _held(v))), f"{info.stored_bytes / 1e6:.1f}",
            f"{info.memory_limit_bytes / 1e6:.0f}",
            f"{min(versions)}..{max(versions)}" if versions else "-",
            str(sum(1 for w in info.workers.values() if w["live"])),
            f"{checkpoint['checkpoint_id']} ({_age(checkpoint['created_unix'])})" if checkpoint else "none",
            f"{restored['checkpoint_id']} of {restored['num_shards']} shards" if restored else "-",
        ])
        for worker_id, record in info.workers.items():
            seen = workers.setdefault(worker_id, dict(record))
            seen["live"] = seen["live"] or record["live"]
            seen["step"] = max(seen["step"], record["step"])
            seen["seconds_since_seen"] = min(seen["seconds_since_seen"], record["seconds_since_seen"])
    text = _table(shards)
    tables = _tables_table(answered)
    if tables:
        text += "\n\n" + tables
    if workers:
        rows = [["worker", "live", "step", "pushes (shard 0)", "last seen"]]
        for worker_id, record in sorted(workers.items()):
            rows.append([worker_id, "yes" if record["live"] else "no", str(record["step"]),
                         str(infos[0].workers.get(worker_id, {}).get("pushes", 0))
                         if isinstance(infos[0], ShardInfo) else "-",
                         f"{record['seconds_since_seen']:.1f}s ago"])
        text += "\n\n" + _table(rows)
    mode = answered[0].consistency.get("mode", "async") if answered else "unknown"
    if mode in ("ssp", "sync"):
        return text + "\n\n" + _steps_table(answered) + "\n\n" + _steps_summary(mode, answered)
    return text + f"\n\nconsistency: {mode}"


def replicas_table(replicas: Sequence[Mapping[str, ReplicaInfo | PSError | None]],
                   health: Sequence[Mapping[str, str]], in_use: Sequence[str],
                   infos: Sequence[ShardInfo | PSError]) -> str:
    """Each replica of each shard: its role, health, epoch, applied sequence, in-sync state, lag and
    etcd lease; then a line per shard naming its primary.

    ``replicas[i]`` maps shard i's replica addresses to the replica's own
    Describe (asked with ``any_replica``): its :class:`ReplicaInfo`, None for
    a server that runs unreplicated, or the error it failed with (role
    "unreachable", or "refused" with the server's reason). In-sync state and
    lag are the shard primary's view of each backup (its BackupStatus).
    ``health[i]`` is each replica's gRPC health of the ParameterServer
    service, ``in_use[i]`` the replica shard i's Describe went to and
    ``infos[i]`` what it answered: an unreplicated server is the primary
    when it is the one that answered.
    """
    rows = [["shard", "replica", "index", "role", "health", "epoch", "applied seq", "in sync", "lag records",
             "lag bytes", "lag s", "etcd lease"]]
    summaries = []
    for i, statuses in enumerate(replicas):
        shard = f"{i}/{len(replicas)}"
        answered = i < len(infos) and isinstance(infos[i], ShardInfo)
        primary = _shard_primary(statuses)
        # By replica index: a backup's address as the primary knows it may be another name for it.
        backups = {b.replica_index: b for b in primary.backups} if primary is not None else {}
        for address, status in statuses.items():
            state = health[i].get(address, "?") if i < len(health) else "?"
            if isinstance(status, ReplicaInfo):
                rows.append([shard, address, str(status.replica_index), status.role, state, str(status.epoch),
                             str(status.applied_sequence),
                             *_lag_cells(status, primary, backups.get(status.replica_index)),
                             "proven" if status.lease_proven else "not proven"])
            elif status is None:
                role = "primary" if answered and address == in_use[i] else "unreplicated"
                rows.append([shard, address, "-", role, state, *["-"] * 8])
            else:
                rows.append([shard, address, "-", _failure(status), state, *["-"] * 8])
        summaries.append(_primary_summary(shard, statuses, primary, answered,
                                          in_use[i] if answered else None))
    return _table(rows) + "\n\n" + "\n".join(summaries)


def _shard_primary(statuses: Mapping[str, ReplicaInfo | PSError | None]) -> ReplicaInfo | None:
    """The replica that reports itself primary, of the newest epoch if several do (a deposed primary
    that has not noticed yet reports an older one)."""
    primaries = [s for s in statuses.values() if isinstance(s, ReplicaInfo) and s.role == "primary"]
    return max(primaries, key=lambda s: s.epoch) if primaries else None


def _lag_cells(status: ReplicaInfo, primary: ReplicaInfo | None, backup: BackupInfo | None) -> list[str]:
    """In sync, lag in records, bytes and seconds: the primary's view of this backup ("-" on the primary;
    "no" and "-" for a replica the primary does not stream to)."""
    if status is primary:
        return ["-"] * 4
    if backup is None:
        return ["no" if primary is not None else "?", *["-"] * 3]
    return ["yes" if backup.in_sync else "no", str(backup.lag_records), str(backup.lag_bytes),
            f"{backup.lag_seconds:.2f}"]


def _failure(error: PSError) -> str:
    """The role cell of a replica whose Describe failed: unreachable (no answer), or what it refused with."""
    if isinstance(error, PSUnavailableError) and error.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED") \
            and error.reason is None:
        return "unreachable"
    return f"refused ({error.reason or error.code or type(error).__name__})"


def _primary_summary(shard: str, statuses: Mapping[str, ReplicaInfo | PSError | None],
                     primary: ReplicaInfo | None, answered: bool, in_use: str | None) -> str:
    """One line: the shard's primary, its epoch and how many of its backups are in sync."""
    if primary is not None:
        in_sync = sum(1 for b in primary.backups if b.in_sync)
        return (f"shard {shard}: primary {primary.address} (replica {primary.replica_index}, epoch "
                f"{primary.epoch}), {in_sync} of {len(statuses) - 1} backups in sync")
    if answered and in_use is not None and statuses.get(in_use) is None:
        return f"shard {shard}: primary {in_use} (unreplicated)"
    named = {s.primary_address for s in statuses.values() if isinstance(s, ReplicaInfo) and s.primary_address}
    if named:
        return f"shard {shard}: NO PRIMARY ANSWERED; the backups name {', '.join(sorted(named))}"
    return f"shard {shard}: NO PRIMARY (an election may be under way)"


def _tables_table(infos: Sequence[ShardInfo]) -> str:
    """Each hash table on each shard: rows held (on disk too), what eviction, expiry and admission did,
    and the disk tier's hit rate (rows found in memory among the rows touched)."""
    rows = [["table", "shard", "rows", "on disk", "disk MB", "hit rate", "evicted", "expired", "admitted",
             "reads not admitted", "gradient rows dropped"]]
    for info in infos:
        for name, v in sorted(info.variables.items()):
            if v.get("hash_table"):
                hits, misses = v.get("memory_hits", 0), v.get("cold_reads", 0)
                rows.append([name, f"{info.shard_index}/{info.num_shards}", str(v["num_rows"]),
                             str(v.get("rows_on_disk", 0)), f"{v.get('disk_bytes', 0) / 1e6:.1f}",
                             f"{hits / (hits + misses):.3f}" if hits + misses else "-",
                             str(v["evicted_rows"]), str(v.get("expired_rows", 0)), str(v.get("admitted_rows", 0)),
                             str(v.get("unadmitted_reads", 0)), str(v.get("dropped_gradient_rows", 0))])
    return _table(rows) if len(rows) > 1 else ""


def _held(variable: dict[str, Any]) -> bool:
    """Whether a shard holds part of this variable: rows of a dense one, or a hash table (every shard has
    a part of each table, its ids spread over the shards)."""
    return bool(variable.get("hash_table")) or variable["row_end"] > variable["row_start"]


def _steps_table(infos: Sequence[ShardInfo]) -> str:
    """Each shard's step and what its consistency mode decided (ssp and sync)."""
    rows = [["shard", "step", "steps applied", "dropped gradients", "largest staleness", "pulls blocked"]]
    for info in infos:
        c = info.consistency
        rows.append([f"{info.shard_index}/{info.num_shards}", str(c["step"]), str(c["steps_applied"]),
                     str(c["dropped_gradients"]), str(c["max_staleness_admitted"]),
                     f"{c['pulls_blocked']} of {c['pulls']}"])
    return _table(rows)


def _steps_summary(mode: str, infos: Sequence[ShardInfo]) -> str:
    """The cluster's step, the gradients dropped and the largest staleness admitted, each with its meaning."""
    steps = [info.consistency["step"] for info in infos]
    step = str(steps[0]) if min(steps) == max(steps) else f"{min(steps)}..{max(steps)}"
    first = infos[0].consistency
    if mode == "sync":
        setting = f"sync (backup workers {first['backup_workers']})"
        step_meaning = "the step being accumulated"
    else:
        setting = f"ssp (staleness bound {first['staleness']})"
        step_meaning = "the slowest live worker's clock"
    if min(steps) != max(steps):
        step_meaning += "; the shards differ"
    rows = [
        ("cluster step", step, step_meaning),
        ("dropped gradients", str(sum(info.consistency["dropped_gradients"] for info in infos)),
         "pushes that came after their step was applied, summed over shards"),
        ("largest staleness", str(max(info.consistency["max_staleness_admitted"] for info in infos)),
         "steps a pull was admitted ahead of the slowest live worker"),
    ]
    width = max(len(value) for _, value, _ in rows)
    return f"consistency: {setting}\n" + "\n".join(
        f"  {name:<17}  {value.rjust(width)}  ({meaning})" for name, value, meaning in rows)


def _environment_help() -> str:
    width = max(len(setting.name) for setting in ENVIRONMENT)
    lines = [f"  {setting.name.ljust(width)}  {setting.meaning}" for setting in ENVIRONMENT]
    return "Environment (a flag wins over its variable):\n" + "\n".join(lines)


def _await_primary(client: PSClient, shard: int, address: str, timeout: float) -> str:
    """After a switchover: a line saying when ``address`` leads (elected within ``timeout``) or that it
    does not yet (the old primary makes no campaign of its own for a lease, so another one means a
    failure meanwhile)."""
    deadline = time.monotonic() + timeout
    while True:
        statuses = client.replica_status(timeout)[shard]
        status = statuses.get(address)
        if isinstance(status, ReplicaInfo) and status.role == "primary":
            return f"shard {shard}: {address} leads (term {status.epoch})"
        if time.monotonic() > deadline:
            roles = {a: (s.role if isinstance(s, ReplicaInfo) else "unreachable") for a, s in statuses.items()}
            return f"shard {shard}: {address} does not lead yet after {timeout:g}s: {roles}"
        time.sleep(0.05)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ps-admin", description="Inspect and operate a wehub-ps cluster.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_environment_help() + "\n\n"
               f"Exit status: 0 done; 1 error; {EXIT_SHARD_DOWN} (status) a shard did not answer: the\n"
               "others are shown, its row says UNREACHABLE (or its health).")
    parser.add_argument("command", choices=("status", "checkpoint", "finish", "switchover"))
    parser.add_argument("--shard", type=int, help="switchover: the shard whose primary hands its role over")
    parser.add_argument("--to", type=int, dest="to_replica",
                        help="switchover: the replica index to hand over to (default: the in-sync backup "
                             "furthest along)")
    parser.add_argument("--addresses", help="comma-separated host:port of the ps-servers, a shard's replicas "
                                            "joined by '|' (else PS_ADDRESSES)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the servers")
    args = parser.parse_args(argv)
    if args.command == "switchover" and args.shard is None:
        parser.error("switchover needs --shard")
    environ: Mapping[str, str] = os.environ
    if args.addresses:
        environ = ChainMap({ADDRESSES_ENV: args.addresses}, environ)
    try:
        # status reads each shard on its own (connect=False), so a shard that is down hides no other.
        # keep_freed_buffers=False: ps-admin moves no large arrays, so malloc stays as it is.
        with PSClient.from_env(environ, worker_id="ps-admin", register=False, connect_timeout=args.timeout,
                               retry_timeout=args.timeout, connect=args.command != "status",
                               keep_freed_buffers=False) as client:
            if args.command == "status":
                infos = client.describe_each(args.timeout)
                health = client.health(args.timeout)
                print(status_table(infos, health, client.addresses))
                if any(len(replicas) > 1 for replicas in client.replicas):
                    replicas = client.replica_status(args.timeout)
                    print("\n" + replicas_table(replicas, client.replica_health(args.timeout),
                                                client.primaries, infos))
                    silent = [f"{address}: {status}" for statuses in replicas
                              for address, status in statuses.items() if isinstance(status, PSError)]
                    if silent:
                        print("ps-admin: replicas not answering: " + "; ".join(silent), file=sys.stderr)
                down = [f"{address}: {info}" for address, info in zip(client.addresses, infos)
                        if not isinstance(info, ShardInfo)]
                if down:
                    print("ps-admin: shards not answering: " + "; ".join(down), file=sys.stderr)
                    return EXIT_SHARD_DOWN
            elif args.command == "checkpoint":
                for result in client.checkpoint():
                    print(f"{result['address']}: checkpoint {result['checkpoint_id']} at {result['path']}, "
                          f"{result['bytes'] / 1e6:.1f} MB in {result['write_seconds']:.2f}s "
                          f"(pushes paused {result['pause_seconds'] * 1000:.0f} ms)")
            elif args.command == "switchover":
                done = client.switchover(args.shard, args.to_replica, args.timeout)
                print(f"shard {done['shard']}: {done['from']} handed the primary role to replica "
                      f"{done['replica_index']} ({done['address']}) in {done['seconds'] * 1000:.0f} ms")
                print(_await_primary(client, args.shard, done["address"], args.timeout))
            else:
                client.finish(wait_for_workers=False)
                print("every server is writing its final checkpoint and exiting")
    except (PSError, ValueError) as exc:
        print(f"ps-admin: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
