"""ps-admin's help and status tables, from hand-made shard states (no servers)."""

from __future__ import annotations

import re

import pytest

from wehub_ps.cluster import CLUSTER_ENVIRONMENT, CONNECTION_ENVIRONMENT, WORKER_ID_ENV
from worker_client.admin import ENVIRONMENT, main, replicas_table, status_table
from worker_client.errors import NotPrimaryError, PSUnavailableError
from worker_client.shard_info import BackupInfo, ReplicaInfo, ShardInfo


def _help(capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def test_help_lists_the_variables_of_the_shared_tables(capsys):
    text = _help(capsys)
    names = {s.name for s in CLUSTER_ENVIRONMENT + CONNECTION_ENVIRONMENT} - {WORKER_ID_ENV}
    assert names == {s.name for s in ENVIRONMENT}
    for setting in ENVIRONMENT:
        line = next(line for line in text.splitlines() if line.split()[:1] == [setting.name])
        assert setting.meaning in line
    for name in ("PS_TLS_CA", "PS_TLS_CERT", "PS_TLS_KEY", "PS_AUTH_TOKEN_FILE", "PS_ADDRESSES", "TF_CONFIG"):
        assert name in text


def _variable(rows: tuple[int, int], hash_table: bool = False, version: int = 0) -> dict:
    return {"row_start": rows[0], "row_end": rows[1], "version": version, "initialized": True,
            "optimizer_steps": 0, "num_rows": 0, "evicted_rows": 0, "hash_table": hash_table}


def _shard(index: int, variables: dict, consistency: dict, num_shards: int = 2) -> ShardInfo:
    return ShardInfo(f"ps-{index}:7000", index, num_shards, "id", "0", variables, consistency=consistency,
                     stored_bytes=10**6, memory_limit_bytes=10**9)


def _sync(step: int, dropped: int, staleness: int = 0, mode: str = "sync") -> dict:
    return {"mode": mode, "staleness": 2, "backup_workers": 1, "step": step, "pulls": 5, "pulls_blocked": 1,
            "blocked_seconds": 0.1, "max_staleness_admitted": staleness, "dropped_gradients": dropped,
            "steps_applied": step}


def _cell(text: str, row_start: str, header: str) -> str:
    """The cell of column ``header`` in the row starting with ``row_start`` of the table that has that
    column (columns are 2+ spaces apart)."""
    for table in text.split("\n\n"):
        lines = table.splitlines()
        columns = re.split(r"\s{2,}", lines[0])
        if header in columns:
            row = next(line for line in lines[2:] if line.startswith(row_start))
            return dict(zip(columns, re.split(r"\s{2,}", row)))[header]
    raise AssertionError(f"no column {header!r} in\n{text}")


def test_variables_known_and_held():
    """Shard 1 knows the small dense variable but holds no part of it; every shard holds a table's part."""
    variables = [{"big": _variable((0, 500)), "small": _variable((0, 8)), "emb": _variable((0, 0), True)},
                 {"big": _variable((500, 1000)), "small": _variable((0, 0)), "emb": _variable((0, 0), True)}]
    text = status_table([_shard(i, v, {"mode": "async"}) for i, v in enumerate(variables)],
                        ["SERVING", "SERVING"])
    assert [(_cell(text, f"{i}/2", "variables"), _cell(text, f"{i}/2", "held")) for i in (0, 1)] == \
        [("3", "3"), ("3", "2")]
    assert text.endswith("consistency: async")


def test_sync_status_shows_the_step_drops_and_staleness():
    infos = [_shard(0, {}, _sync(7, 2)), _shard(1, {}, _sync(7, 3))]
    text = status_table(infos, ["SERVING", "SERVING"])
    assert _cell(text, "0/2", "dropped gradients") == "2" and _cell(text, "1/2", "dropped gradients") == "3"
    assert _cell(text, "1/2", "steps applied") == "7" and _cell(text, "0/2", "pulls blocked") == "1 of 5"
    summary = text[text.index("consistency: "):].splitlines()
    assert summary[0] == "consistency: sync (backup workers 1)"
    assert summary[1].split()[:3] == ["cluster", "step", "7"]
    assert summary[2].split()[:3] == ["dropped", "gradients", "5"]
    assert summary[3].split()[:3] == ["largest", "staleness", "0"]


def test_ssp_status_with_shards_at_different_steps_and_one_down():
    infos = [_shard(0, {}, _sync(3, 0, 2, "ssp"), 3), _shard(1, {}, _sync(4, 0, 1, "ssp"), 3),
             PSUnavailableError("down", address="ps-2:7000")]
    text = status_table(infos, ["SERVING", "SERVING", "UNREACHABLE"], ["ps-0:7000", "ps-1:7000", "ps-2:7000"])
    assert _cell(text, "2/3", "health") == "UNREACHABLE" and _cell(text, "2/3", "held") == "-"
    assert [_cell(text, f"{i}/3", "largest staleness") for i in (0, 1)] == ["2", "1"]
    assert "2/3" not in text[text.index("steps applied"):]  # a shard that did not answer has no step
    summary = text[text.index("consistency: "):].splitlines()
    assert summary[0] == "consistency: ssp (staleness bound 2)"
    assert summary[1].split()[:3] == ["cluster", "step", "3..4"] and "shards differ" in summary[1]
    assert summary[3].split()[:3] == ["largest", "staleness", "2"]


def _replica_row(text: str, address: str) -> dict[str, str]:
    """The replicas table's row of ``address``, by column header."""
    lines = text.split("\n\n")[0].splitlines()
    columns = re.split(r"\s{2,}", lines[0])
    row = next(line for line in lines[2:] if line.split()[1] == address)
    return dict(zip(columns, re.split(r"\s{2,}", row)))


def _replica(address: str, index: int, role: str, epoch: int, sequence: int,
             backups: tuple[BackupInfo, ...] = (), lease: bool = True) -> ReplicaInfo:
    return ReplicaInfo(address, index, 3, role, epoch, "", sequence, lease, backups)


_UNREACHABLE = PSUnavailableError("describe: ps-server r2:7000 is unavailable", address="r2:7000",
                                  code="UNAVAILABLE")


def test_replicas_show_role_epoch_sequence_and_the_primarys_view_of_each_backup():
    """Lag and in-sync state come from the primary's BackupStatus; a replica that does not answer is
    unreachable; a backup the primary does not stream to is not in sync."""
    primary = _replica("r0:7000", 0, "primary", 12, 500, (
        BackupInfo(1, "r1-advertised:7000", True, 498, 2, 4096, 0.25),))
    statuses = [{"r0:7000": primary, "r1:7000": _replica("r1:7000", 1, "backup", 12, 498),
                 "r2:7000": _UNREACHABLE}]
    health = [{"r0:7000": "SERVING", "r1:7000": "NOT_SERVING", "r2:7000": "UNREACHABLE"}]
    text = replicas_table(statuses, health, ["r0:7000"], [_shard(0, {}, {"mode": "async"}, 1)])
    assert _replica_row(text, "r0:7000") == {
        "shard": "0/1", "replica": "r0:7000", "index": "0", "role": "primary", "health": "SERVING",
        "epoch": "12", "applied seq": "500", "in sync": "-", "lag records": "-", "lag bytes": "-",
        "lag s": "-", "etcd lease": "proven"}
    backup = _replica_row(text, "r1:7000")
    assert (backup["role"], backup["epoch"], backup["applied seq"], backup["in sync"]) == (
        "backup", "12", "498", "yes")
    assert (backup["lag records"], backup["lag bytes"], backup["lag s"]) == ("2", "4096", "0.25")
    dead = _replica_row(text, "r2:7000")
    assert (dead["role"], dead["health"], dead["epoch"], dead["in sync"]) == (
        "unreachable", "UNREACHABLE", "-", "-")
    assert text.splitlines()[-1] == "shard 0/1: primary r0:7000 (replica 0, epoch 12), 1 of 2 backups in sync"


def test_the_primary_of_the_newest_epoch_is_the_shards_primary():
    """A deposed primary that has not noticed yet still says "primary", with the older epoch; a backup
    still catching up is not in sync; a lease etcd did not confirm shows as not proven."""
    old = _replica("r0:7000", 0, "primary", 5, 90, (BackupInfo(1, "r1:7000", True, 90, 0, 0, 0.0),),
                   lease=False)
    new = _replica("r1:7000", 1, "primary", 9, 120, (BackupInfo(2, "r2:7000", False, 60, 60, 10**6, 1.5),))
    statuses = [{"r0:7000": old, "r1:7000": new, "r2:7000": _replica("r2:7000", 2, "catching-up", 9, 60)}]
    text = replicas_table(statuses, [{}], ["r1:7000"], [_shard(0, {}, {"mode": "async"}, 1)])
    assert text.splitlines()[-1] == "shard 0/1: primary r1:7000 (replica 1, epoch 9), 0 of 2 backups in sync"
    stale = _replica_row(text, "r0:7000")
    assert (stale["role"], stale["epoch"], stale["in sync"], stale["etcd lease"]) == (
        "primary", "5", "no", "not proven")
    behind = _replica_row(text, "r2:7000")
    assert (behind["role"], behind["in sync"], behind["lag records"], behind["lag s"]) == (
        "catching-up", "no", "60", "1.50")
    assert _replica_row(text, "r1:7000")["health"] == "?"


def test_a_shard_without_a_primary_and_unreplicated_servers():
    """Backups that name a primary nobody reached; a server that runs unreplicated is the primary when it
    answered the shard's Describe; a replica that refuses is shown with its reason."""
    backup = ReplicaInfo("a1:7000", 1, 2, "backup", 4, "a0:7000", 30, True)
    refusing = NotPrimaryError("not the primary", address="b1:7000", reason="NOT_PRIMARY", code="UNAVAILABLE")
    statuses = [{"a0:7000": _UNREACHABLE, "a1:7000": backup}, {"b0:7000": None, "b1:7000": refusing}]
    infos = [PSUnavailableError("down", address="a0:7000"), _shard(1, {}, {"mode": "async"})]
    text = replicas_table(statuses, [{}, {}], ["a0:7000", "b0:7000"], infos)
    summary = text.split("\n\n")[1].splitlines()
    assert summary == ["shard 0/2: NO PRIMARY ANSWERED; the backups name a0:7000",
                       "shard 1/2: primary b0:7000 (unreplicated)"]
    assert _replica_row(text, "a1:7000")["in sync"] == "?"
    assert _replica_row(text, "b0:7000")["role"] == "primary"
    assert _replica_row(text, "b1:7000")["role"] == "refused (NOT_PRIMARY)"
