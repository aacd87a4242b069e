"""ps-server settings (ps_server.ops.config) and cluster specs from the environment (wehub_ps.cluster)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ps_server.ops.config import ConfigError, ServerConfig, build_parser, default_memory_limit, parse_config
from wehub_ps.cluster import (
    WORKER_ENVIRONMENT,
    ClusterConfigError,
    ps_addresses_from_env,
    split_host_port,
    task_from_tf_config,
)
from wehub_ps.kernels.compiled import COMPILED_LOOPS_ENV
from wehub_ps.wire.rpc import DEFAULT_CHUNK_BYTES, MAX_MESSAGE_BYTES


def tf_config(task_type="ps", index=0, ps=("ps0:7001", "ps1:7002", "ps2:7003"), workers=2, chief=True):
    cluster = {"ps": list(ps), "worker": [f"w{i}:8000" for i in range(workers)]}
    if chief:
        cluster["chief"] = ["chief:9000"]
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


# ---- defaults and flags -------------------------------------------------------------------------


def test_defaults():
    config = parse_config([], {})
    assert config == ServerConfig()
    assert (config.host, config.port, config.shard_index, config.num_shards) == ("0.0.0.0", 7001, 0, 1)
    assert config.checkpoint_dir is None and config.port_file is None
    assert config.log_level == "info"
    assert config.chunk_bytes == DEFAULT_CHUNK_BYTES
    assert config.max_message_bytes == MAX_MESSAGE_BYTES
    assert config.memory_limit == default_memory_limit() > 0


def test_flags():
    config = parse_config([
        "--host", "127.0.0.1", "--port", "0", "--shard-index", "2", "--num-shards", "3",
        "--checkpoint-dir", "/ckpt", "--log-level", "debug", "--port-file", "/tmp/p",
        "--max-memory-bytes", "12345", "--chunk-bytes", "8192", "--max-message-bytes", "65536",
        "--max-concurrent-rpcs", "8", "--drain-timeout", "2.5",
    ], {})
    assert config == ServerConfig(
        host="127.0.0.1", port=0, shard_index=2, num_shards=3, checkpoint_dir="/ckpt",
        log_level="debug", port_file="/tmp/p", max_memory_bytes=12345, chunk_bytes=8192,
        max_message_bytes=65536, max_concurrent_rpcs=8, drain_timeout=2.5)
    assert config.memory_limit == 12345
    assert isinstance(config.port, int) and isinstance(config.drain_timeout, float)


def test_environment_variables():
    env = {"PS_HOST": "10.0.0.1", "PS_PORT": "7100", "PS_SHARD_INDEX": "1", "PS_NUM_SHARDS": "4",
           "PS_CHECKPOINT_DIR": "/data", "PS_LOG_LEVEL": "warning", "PS_MAX_MEMORY_BYTES": "999",
           "PS_CHUNK_BYTES": "4096", "PS_DRAIN_TIMEOUT": "0", "PS_MAX_CONCURRENT_RPCS": "16"}
    config = parse_config([], env)
    assert config == ServerConfig(host="10.0.0.1", port=7100, shard_index=1, num_shards=4,
                                  checkpoint_dir="/data", log_level="warning", max_memory_bytes=999,
                                  chunk_bytes=4096, drain_timeout=0.0, max_concurrent_rpcs=16)
    assert type(config.port) is int and type(config.drain_timeout) is float


def test_unrelated_environment_is_ignored():
    assert parse_config([], {"PORT": "1", "SHARD_INDEX": "5", "PS_ADDRESSES": "a:1,b:2"}) == ServerConfig()


# ---- TF_CONFIG ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("index, port", [(0, 7001), (1, 7002), (2, 7003)])
def test_tf_config_ps_task(index, port):
    config = parse_config([], {"TF_CONFIG": tf_config("ps", index)})
    assert (config.shard_index, config.num_shards, config.port) == (index, 3, port)
    assert config.host == "0.0.0.0"


@pytest.mark.parametrize("replica_index, port", [(0, 7003), (1, 7004)])
def test_tf_config_replicated_ps_task_takes_its_replicas_port(replica_index, port):
    raw = json.dumps({"cluster": {"ps": ["h0a:7001|h0b:7002", "h1a:7003|h1b:7004"]},
                      "task": {"type": "ps", "index": 1}})
    config = parse_config(["--replica-index", str(replica_index), "--etcd-endpoints", "etcd:2379"],
                          {"TF_CONFIG": raw})
    assert (config.shard_index, config.num_shards, config.replicas, config.replica_index, config.port) == (
        1, 2, 2, replica_index, port)
    with pytest.raises(ConfigError, match="replica-index 2 has no entry"):
        parse_config(["--replica-index", "2", "--replicas", "3", "--etcd-endpoints", "etcd:2379"],
                     {"TF_CONFIG": raw})


# A TFJob's replicated shards: the operator lists shards x R PS replicas as a flat cluster.ps.
_TFJOB_PS = ("t-ps-0.ns.svc:7001", "t-ps-1.ns.svc:7002", "t-ps-2.ns.svc:7003", "t-ps-3.ns.svc:7004")


def tfjob_ps_env(index, ps=_TFJOB_PS, **extra):
    return {"TF_CONFIG": tf_config("ps", index, ps=ps), "PS_REPLICAS": "2", "PS_ETCD_ENDPOINTS": "etcd:2379",
            **extra}


@pytest.mark.parametrize("index, shard, replica", [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)])
def test_flat_tf_config_is_read_as_shards_of_r_consecutive_replicas(index, shard, replica):
    config = parse_config([], tfjob_ps_env(index))
    assert (config.shard_index, config.replica_index, config.num_shards, config.replicas, config.port) == (
        shard, replica, 2, 2, 7001 + index)


def test_flat_tf_config_grouping_by_the_flag():
    ps = tuple(f"t-ps-{i}.ns.svc:{7001 + i}" for i in range(6))
    config = parse_config(["--replicas", "3", "--etcd-endpoints", "e:1"],
                          {"TF_CONFIG": tf_config("ps", 4, ps=ps)})
    assert (config.shard_index, config.replica_index, config.num_shards, config.replicas, config.port) == (
        1, 1, 2, 3, 7005)


def test_flat_tf_config_grouping_takes_agreeing_settings_and_an_explicit_port():
    env = tfjob_ps_env(3, PS_NUM_SHARDS="2", PS_SHARD_INDEX="1", PS_REPLICA_INDEX="1", PS_PORT="7500")
    config = parse_config([], env)
    assert (config.shard_index, config.replica_index, config.num_shards, config.port) == (1, 1, 2, 7500)


@pytest.mark.parametrize("argv, extra, given", [
    ([], {"PS_REPLICA_INDEX": "0"}, "PS_REPLICA_INDEX 0"),
    (["--replica-index", "0"], {}, "--replica-index 0"),
    ([], {"PS_SHARD_INDEX": "0"}, "PS_SHARD_INDEX 0"),
    ([], {"PS_NUM_SHARDS": "4"}, "PS_NUM_SHARDS 4"),
])
def test_flat_tf_config_grouping_refuses_contradicting_settings(argv, extra, given):
    with pytest.raises(ConfigError) as info:
        parse_config(argv, tfjob_ps_env(3, **extra))
    setting = given.split(" ")[0]
    value = {"PS_REPLICA_INDEX": 1, "--replica-index": 1, "PS_SHARD_INDEX": 1, "PS_NUM_SHARDS": 2}[setting]
    assert str(info.value) == (
        f"{given} contradicts TF_CONFIG: task.index 3 of its 4 cluster.ps entries, read as shards of "
        f"PS_REPLICAS 2 consecutive replicas, is replica 1 of shard 1 of 2 shards; leave {setting} unset "
        f"(TF_CONFIG gives it) or set it to {value}")


@pytest.mark.parametrize("argv, env, setting", [
    ([], {"PS_REPLICAS": "2"}, "PS_REPLICAS 2"),
    (["--replicas", "2"], {}, "--replicas 2"),
])
def test_flat_tf_config_of_no_multiple_of_the_replicas_is_refused(argv, env, setting):
    raw = tf_config("ps", 0, ps=_TFJOB_PS[:3])
    with pytest.raises(ConfigError) as info:
        parse_config([*argv, "--etcd-endpoints", "e:1"], {"TF_CONFIG": raw, **env})
    name = setting.split(" ")[0]
    assert str(info.value) == (
        f"TF_CONFIG cluster.ps lists 3 ps-servers, which is not a multiple of {setting}: a flat list is "
        f"read as shards of 2 consecutive replicas, so it needs shards x 2 entries (a TFJob's PS "
        f"replicas); set {name} to the replicas per shard, or list every replica of every shard")


def test_the_help_says_how_a_flat_cluster_ps_is_grouped():
    epilog = " ".join(build_parser().format_help().split())
    assert "read as shards of R consecutive entries: shard task.index // R, replica index task.index % R." in epilog


def test_one_replica_or_grouped_entries_keep_their_reading():
    # R = 1: each flat entry is a shard.
    config = parse_config([], {"TF_CONFIG": tf_config("ps", 2, ps=_TFJOB_PS), "PS_REPLICAS": "1"})
    assert (config.shard_index, config.replica_index, config.num_shards, config.replicas, config.port) == (
        2, 0, 4, 1, 7003)
    # Entries that name their replicas: the entry is the shard, whatever R says.
    raw = json.dumps({"cluster": {"ps": ["h0a:7001|h0b:7002", "h1a:7003|h1b:7004"]},
                      "task": {"type": "ps", "index": 1}})
    config = parse_config(["--replica-index", "1"],
                          {"TF_CONFIG": raw, "PS_REPLICAS": "2", "PS_ETCD_ENDPOINTS": "e:1"})
    assert (config.shard_index, config.replica_index, config.num_shards, config.port) == (1, 1, 2, 7004)


def test_sync_steps_run_replicated():
    config = parse_config(["--replicas", "2", "--etcd-endpoints", "e:1", "--consistency", "sync"], {})
    assert (config.replicas, config.consistency) == (2, "sync")


def test_replication_settings_are_checked():
    with pytest.raises(ConfigError, match="--etcd-endpoints"):
        parse_config(["--replicas", "2"], {})
    with pytest.raises(ConfigError, match="--replica-index must be in"):
        parse_config(["--replicas", "2", "--replica-index", "2", "--etcd-endpoints", "e:1"], {})
    with pytest.raises(ConfigError, match="--primary-lease-seconds"):
        parse_config(["--replicas", "2", "--etcd-endpoints", "e:1", "--primary-lease-seconds", "0"], {})
    with pytest.raises(ConfigError, match="--role-label must be auto or off, got 'no'"):
        parse_config(["--replicas", "2", "--etcd-endpoints", "e:1"], {"PS_ROLE_LABEL": "no"})


def test_the_role_label_is_on_where_kubernetes_gives_a_token_unless_turned_off():
    replicated = ["--replicas", "2", "--etcd-endpoints", "e:1"]
    config = parse_config(replicated, {})
    assert (config.role_label, config.service_account_dir) == (
        "auto", "/var/run/secrets/kubernetes.io/serviceaccount")
    config = parse_config(replicated, {"PS_ROLE_LABEL": "off", "PS_SERVICE_ACCOUNT_DIR": "/sa"})
    assert (config.role_label, config.service_account_dir, config.unknown_environment) == ("off", "/sa", ())


@pytest.mark.parametrize("task_type", ["worker", "chief", "evaluator", ""])
def test_tf_config_of_another_task_is_refused(task_type):
    with pytest.raises(ConfigError) as info:
        parse_config([], {"TF_CONFIG": tf_config(task_type, 0)})
    assert "TF_CONFIG" in str(info.value) and "'ps'" in str(info.value)


@pytest.mark.parametrize("raw, words", [
    ("{not json", ["TF_CONFIG", "JSON"]),
    ("[]", ["TF_CONFIG", "cluster"]),
    (json.dumps({"task": {"type": "ps"}}), ["TF_CONFIG", "cluster"]),
    (json.dumps({"cluster": {"ps": "a:1"}, "task": {"type": "ps"}}), ["cluster.ps"]),
    (json.dumps({"cluster": {"ps": ["a:1", 5]}, "task": {"type": "ps"}}), ["cluster.ps"]),
    (json.dumps({"cluster": {"ps": ["nohost"]}, "task": {"type": "ps"}}), ["'nohost'"]),
    (json.dumps({"cluster": {"ps": ["a:99999"]}, "task": {"type": "ps"}}), ["'a:99999'"]),
    (json.dumps({"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": "x"}}), ["task.index", "'x'"]),
    (tf_config("ps", 3), ["task.index", "3"]),
    (tf_config("ps", -1), ["task.index", "-1"]),
])
def test_bad_tf_config(raw, words):
    with pytest.raises(ConfigError) as info:
        parse_config([], {"TF_CONFIG": raw})
    for word in words:
        assert word in str(info.value), f"{word!r} missing from {info.value}"


def test_tf_config_without_ps_is_ignored():
    raw = json.dumps({"cluster": {"worker": ["w:1"]}, "task": {"type": "worker", "index": 0}})
    assert parse_config([], {"TF_CONFIG": raw}) == ServerConfig()
    assert parse_config([], {"TF_CONFIG": ""}) == ServerConfig()


# ---- precedence ------------------------------------------------------------------------------------------


def test_precedence_flag_over_env_over_tf_config():
    env = {"TF_CONFIG": tf_config("ps", 1), "PS_SHARD_INDEX": "2", "PS_PORT": "7500"}
    config = parse_config([], env)
    assert (config.shard_index, config.num_shards, config.port) == (2, 3, 7500)

    config = parse_config(["--shard-index", "0", "--port", "7600"], env)
    assert (config.shard_index, config.num_shards, config.port) == (0, 3, 7600)

    config = parse_config(["--num-shards", "5", "--shard-index", "4"], env)
    assert (config.shard_index, config.num_shards, config.port) == (4, 5, 7500)

    # Only TF_CONFIG: its values.
    config = parse_config([], {"TF_CONFIG": tf_config("ps", 1)})
    assert (config.shard_index, config.num_shards, config.port) == (1, 3, 7002)


def test_flag_over_env_for_every_field():
    env = {"PS_HOST": "env-host", "PS_LOG_LEVEL": "error", "PS_DRAIN_TIMEOUT": "9"}
    config = parse_config(["--host", "flag-host", "--log-level", "debug"], env)
    assert config.host == "flag-host" and config.log_level == "debug"
    assert config.drain_timeout == 9.0


# ---- bad values name the flag ------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, env, words", [
    (["--port", "70000"], {}, ["--port", "70000"]),
    (["--port", "-1"], {}, ["--port", "-1"]),
    (["--num-shards", "0"], {}, ["--num-shards", "0"]),
    (["--shard-index", "3", "--num-shards", "3"], {}, ["--shard-index", "3"]),
    (["--shard-index", "-1"], {}, ["--shard-index", "-1"]),
    (["--log-level", "loud"], {}, ["--log-level", "'loud'"]),
    (["--max-memory-bytes", "-5"], {}, ["--max-memory-bytes", "-5"]),
    (["--chunk-bytes", "100"], {}, ["--chunk-bytes", "100"]),
    (["--chunk-bytes", str(MAX_MESSAGE_BYTES)], {}, ["--chunk-bytes", "--max-message-bytes"]),
    (["--max-message-bytes", "8192"], {}, ["--chunk-bytes", "--max-message-bytes"]),
    (["--max-concurrent-rpcs", "3"], {}, ["--max-concurrent-rpcs", "3"]),
    (["--stream-window-bytes", "1000"], {}, ["--stream-window-bytes", "1000"]),
    ([], {"PS_STREAM_WINDOW_BYTES": str(1 << 30)}, ["--stream-window-bytes", str(1 << 30)]),
    (["--keep-freed-bytes", "4096"], {}, ["--keep-freed-bytes", "4096"]),
    (["--malloc-arenas", "-1"], {}, ["--malloc-arenas", "-1"]),
    ([], {"PS_MALLOC_ARENAS": "5000"}, ["--malloc-arenas", "5000"]),
    (["--drain-timeout", "-0.5"], {}, ["--drain-timeout", "-0.5"]),
    ([], {"PS_PORT": "abc"}, ["PS_PORT", "'abc'", "int"]),
    ([], {"PS_SHARD_INDEX": "1.5"}, ["PS_SHARD_INDEX", "'1.5'"]),
    ([], {"PS_DRAIN_TIMEOUT": "soon"}, ["PS_DRAIN_TIMEOUT", "'soon'", "float"]),
    ([], {"PS_NUM_SHARDS": ""}, ["PS_NUM_SHARDS"]),
    ([], {"PS_SHARD_INDEX": "5", "PS_NUM_SHARDS": "2"}, ["--shard-index", "5"]),
])
def test_bad_values_raise_config_error_naming_the_setting(argv, env, words):
    with pytest.raises(ConfigError) as info:
        parse_config(argv, env)
    for word in words:
        assert word in str(info.value), f"{word!r} missing from {info.value}"


def test_flag_of_the_wrong_type_is_an_argparse_usage_error(capsys):
    # argparse converts flags itself: a non-integer flag exits with status 2
    # and names the flag (the same status ps-server uses for ConfigError).
    with pytest.raises(SystemExit) as info:
        parse_config(["--port", "abc"], {})
    assert info.value.code == 2
    assert "--port" in capsys.readouterr().err


def test_unknown_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--no-such-flag", "1"], {})
    assert "--no-such-flag" in capsys.readouterr().err


def test_stream_window_zero_means_grpc_automatic_window():
    assert parse_config(["--stream-window-bytes", "0"], environ={}).stream_window_bytes == 0
    assert parse_config([], environ={}).stream_window_bytes == 2 << 20


def test_keep_freed_bytes_zero_leaves_malloc_alone():
    assert parse_config(["--keep-freed-bytes", "0"], environ={}).keep_freed_bytes == 0
    assert parse_config([], environ={"PS_KEEP_FREED_BYTES": str(8 << 20)}).keep_freed_bytes == 8 << 20
    assert parse_config([], environ={}).keep_freed_bytes == 64 << 20


def test_malloc_arenas_default_and_zero():
    assert parse_config([], environ={}).malloc_arenas == 2
    assert parse_config(["--malloc-arenas", "0"], environ={}).malloc_arenas == 0
    assert parse_config([], environ={"PS_MALLOC_ARENAS": "8"}).malloc_arenas == 8


def test_nan_drain_timeout_is_refused():
    with pytest.raises(ConfigError):
        parse_config(["--drain-timeout", "nan"], {})


# ---- wehub_ps.cluster -----------------------------------------------------------------------------------------


def test_ps_addresses_from_ps_addresses():
    assert ps_addresses_from_env({"PS_ADDRESSES": "a:1,b:2"}) == ("a:1", "b:2")
    assert ps_addresses_from_env({"PS_ADDRESSES": " a:1 , b:2 ,, "}) == ("a:1", "b:2")
    assert ps_addresses_from_env({"PS_ADDRESSES": "[::1]:7001"}) == ("[::1]:7001",)


def test_ps_addresses_take_precedence_over_tf_config():
    env = {"PS_ADDRESSES": "x:1", "TF_CONFIG": tf_config("worker", 0)}
    assert ps_addresses_from_env(env) == ("x:1",)


def test_ps_addresses_from_tf_config_keep_the_order():
    env = {"TF_CONFIG": tf_config("worker", 1, ps=("z:3", "a:1", "m:2"))}
    assert ps_addresses_from_env(env) == ("z:3", "a:1", "m:2")
    # Blank PS_ADDRESSES falls back to TF_CONFIG.
    assert ps_addresses_from_env({**env, "PS_ADDRESSES": "  "}) == ("z:3", "a:1", "m:2")


@pytest.mark.parametrize("env", [
    {},
    {"PS_ADDRESSES": ""},
    {"TF_CONFIG": json.dumps({"cluster": {"worker": ["w:1"]}})},
])
def test_no_ps_configured(env):
    with pytest.raises(ClusterConfigError) as info:
        ps_addresses_from_env(env)
    assert "PS_ADDRESSES" in str(info.value) and "TF_CONFIG" in str(info.value)


@pytest.mark.parametrize("raw", ["a", "a:", ":1", "a:b", "a:0", "a:65536", "a:1,b"])
def test_bad_ps_addresses(raw):
    with pytest.raises(ClusterConfigError) as info:
        ps_addresses_from_env({"PS_ADDRESSES": raw})
    assert "host:port" in str(info.value)


def test_task_from_tf_config():
    assert task_from_tf_config({}) is None
    task = task_from_tf_config({"TF_CONFIG": tf_config("worker", 1, workers=3, chief=True)})
    assert task.task_type == "worker" and task.task_index == 1
    assert task.num_workers == 4  # workers plus the chief
    assert task.ps_addresses == ("ps0:7001", "ps1:7002", "ps2:7003")


@pytest.mark.parametrize("address, expected", [
    ("host:7001", ("host", 7001)),
    ("10.0.0.1:1", ("10.0.0.1", 1)),
    ("[::1]:65535", ("::1", 65535)),
    ("[fe80::1%eth0]:80", ("fe80::1%eth0", 80)),
])
def test_split_host_port(address, expected):
    assert split_host_port(address) == expected


def test_bare_ipv6_without_port_is_refused():
    with pytest.raises(ClusterConfigError):
        split_host_port("fe80::1")


def test_misspelled_environment_settings_are_reported_and_abbreviations_refused():
    config = parse_config([], {"PS_CHECKPOINT_DIRECTORY": "/x", "PS_NUM_SHARDS": "2", "PS_ADDRESSES": "a:1"})
    assert config.unknown_environment == ("PS_CHECKPOINT_DIRECTORY",)
    assert config.checkpoint_dir is None
    with pytest.raises(SystemExit):
        parse_config(["--checkpoint-d", "/x"], {})


def test_the_worker_sides_environment_is_not_reported_as_misspelled():
    server_side = {"PS_" + field.name.upper() for field in dataclasses.fields(ServerConfig)}
    worker_side = {name: "1" for name in WORKER_ENVIRONMENT if name not in server_side}
    assert "PS_ADDRESSES" in worker_side and "PS_WORKER_ID" in worker_side
    config = parse_config([], {**worker_side, COMPILED_LOOPS_ENV: "0", "PS_WORKER_IDS": "w"})
    assert config.unknown_environment == ("PS_WORKER_IDS",)
