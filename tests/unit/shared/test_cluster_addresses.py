"""The one parser of a cluster's addresses (wehub_ps.cluster.parse_shard_replicas) in every form it is given:
PS_ADDRESSES, TF_CONFIG's cluster.ps, and PSClient's ``addresses`` (through check_addresses)."""

from __future__ import annotations

import argparse
import json

import pytest

from ps_local.worker import _resolve
from wehub_ps.cluster import (
    CLUSTER_ENVIRONMENT,
    ClusterConfigError,
    group_flat_replicas,
    parse_shard_replicas,
    ps_addresses_from_env,
    shard_spec,
    task_from_tf_config,
)
from worker_client import PSClient
from worker_client.session import check_addresses


def _tf_config(ps: list) -> dict[str, str]:
    return {"TF_CONFIG": json.dumps({"cluster": {"ps": ps, "worker": ["w:1"]}, "task": {"type": "worker"}})}


@pytest.mark.parametrize("value, expected", [
    ("a:1", (("a:1",),)),
    ("a:1,b:2", (("a:1",), ("b:2",))),
    (" a:1 , b:2 ,, ", (("a:1",), ("b:2",))),
    ("a:1|a:2,b:1|b:2", (("a:1", "a:2"), ("b:1", "b:2"))),
    ("a:1 | a:2 | a:3", (("a:1", "a:2", "a:3"),)),
    ("[::1]:7001|[::1]:7002", (("[::1]:7001", "[::1]:7002"),)),
    (["a:1", "b:2"], (("a:1",), ("b:2",))),
    (["a:1|a:2", "b:1"], (("a:1", "a:2"), ("b:1",))),
    ([["a:1", "a:2"], ("b:1", "b:2")], (("a:1", "a:2"), ("b:1", "b:2"))),
    ((("a:1",), "b:1|b:2"), (("a:1",), ("b:1", "b:2"))),
])
def test_every_form_gives_each_shards_replicas(value, expected):
    assert parse_shard_replicas(value) == expected
    # What the client hands on (ps-local's workers, PSClient.addresses) parses back to the same.
    assert parse_shard_replicas(",".join(shard_spec(r) for r in expected)) == expected


@pytest.mark.parametrize("value, words", [
    ("", "at least one"),
    ([], "at least one"),
    ("a:1||a:2", "shard 0 has an empty replica"),
    ("a:1,b:1|", "shard 1 has an empty replica"),
    ("|a:1", "shard 0 has an empty replica"),
    ([["a:1", ""]], "shard 0 has an empty replica"),
    ([[]], "shard 0 has an empty replica"),
    ("a:1,a:1", "'a:1' is listed for shard 0 and shard 1"),
    ("a:1|b:1,c:1|b:1", "'b:1' is listed for shard 0 and shard 1"),
    ("a:1|a:1", "'a:1' is listed twice in shard 0"),
    ([["a:1"], ["b:1", "a:1"]], "'a:1' is listed for shard 0 and shard 1"),
    ("a:1|b", "shard 0: address must look like host:port"),
    ("a:1,b:1|c:0", "shard 1: address must look like host:port"),
    ([["a:1,b:1"]], "must be one 'host:port'"),
    ([3], "shard 0 must be 'host:port'"),
    ([["a:1", 2]], "shard 0 must be 'host:port'"),
])
def test_errors_name_what_is_wrong(value, words):
    with pytest.raises(ClusterConfigError) as info:
        parse_shard_replicas(value)
    assert words in str(info.value)


def test_a_non_list_is_refused():
    with pytest.raises(ClusterConfigError, match="a string or a list of shards"):
        parse_shard_replicas(7)  # type: ignore[arg-type]


def test_ps_addresses_keep_one_entry_per_shard_with_its_replicas():
    assert ps_addresses_from_env({"PS_ADDRESSES": "a:1|a:2, b:1|b:2"}) == ("a:1|a:2", "b:1|b:2")
    with pytest.raises(ClusterConfigError, match="PS_ADDRESSES: shard 1 has an empty replica"):
        ps_addresses_from_env({"PS_ADDRESSES": "a:1|a:2,b:1||b:2"})
    with pytest.raises(ClusterConfigError, match="PS_ADDRESSES: 'a:2' is listed"):
        ps_addresses_from_env({"PS_ADDRESSES": "a:1|a:2,a:2"})


def test_tf_config_ps_entries_may_be_joined_strings_or_lists():
    env = _tf_config(["a:1|a:2", ["b:1", "b:2"], "c:1"])
    task = task_from_tf_config(env)
    assert task.ps_addresses == ("a:1|a:2", "b:1|b:2", "c:1")
    assert task.ps_replicas == (("a:1", "a:2"), ("b:1", "b:2"), ("c:1",))
    assert ps_addresses_from_env(env) == ("a:1|a:2", "b:1|b:2", "c:1")


@pytest.mark.parametrize("ps, words", [
    ("a:1", "must be a list"),
    (["a:1", ["b:1", 3]], "TF_CONFIG cluster.ps: shard 1 must be"),
    (["a:1", "a:1|b:1"], "TF_CONFIG cluster.ps: 'a:1' is listed"),
    ([["a:1", " "]], "TF_CONFIG cluster.ps: shard 0 has an empty replica"),
])
def test_tf_config_errors_name_it(ps, words):
    with pytest.raises(ClusterConfigError) as info:
        task_from_tf_config(_tf_config(ps))
    assert words in str(info.value)


def test_psclient_addresses_take_every_form_and_errors_are_value_errors():
    assert check_addresses("a:1|a:2,b:1") == (("a:1", "a:2"), ("b:1",))
    assert check_addresses(["a:1|a:2", ["b:1", "b:2"]]) == (("a:1", "a:2"), ("b:1", "b:2"))
    assert check_addresses(check_addresses("a:1|a:2,b:1")) == (("a:1", "a:2"), ("b:1",))
    with pytest.raises(ValueError, match="'a:1' is listed"):
        check_addresses(["a:1", "b:1|a:1"])
    with pytest.raises(ValueError, match="at least one"):
        check_addresses([])


def test_the_help_text_shows_the_replicated_form():
    meaning = {s.name: s.meaning for s in CLUSTER_ENVIRONMENT}["PS_ADDRESSES"]
    assert "'|'" in meaning and "h0a:p|h0b:p" in meaning


# --- a flat TF_CONFIG cluster.ps (a TFJob's PS replicas) grouped by PS_REPLICAS ---------------------

_FLAT = ["t-ps-0.ns.svc:7001", "t-ps-1.ns.svc:7001", "t-ps-2.ns.svc:7001", "t-ps-3.ns.svc:7001"]


@pytest.mark.parametrize("replicas, expected", [
    ({"PS_REPLICAS": "2"}, ("|".join(_FLAT[:2]), "|".join(_FLAT[2:]))),
    ({"PS_REPLICAS": "4"}, ("|".join(_FLAT),)),
    ({"PS_REPLICAS": " 1 "}, tuple(_FLAT)),
    ({}, tuple(_FLAT)),
])
def test_a_flat_tf_config_is_grouped_into_shards_of_ps_replicas(replicas, expected):
    assert ps_addresses_from_env({**_tf_config(_FLAT), **replicas}) == expected


def test_ps_replicas_leaves_replicated_entries_and_ps_addresses_as_written():
    grouped = {**_tf_config(["a:1|a:2", "b:1|b:2"]), "PS_REPLICAS": "2"}
    assert ps_addresses_from_env(grouped) == ("a:1|a:2", "b:1|b:2")
    assert ps_addresses_from_env({"PS_ADDRESSES": "a:1,b:1", "PS_REPLICAS": "2"}) == ("a:1", "b:1")
    # PS_ADDRESSES wins, so a PS_REPLICAS meant for TF_CONFIG is not even read.
    assert ps_addresses_from_env({"PS_ADDRESSES": "a:1", "PS_REPLICAS": "x"}) == ("a:1",)


@pytest.mark.parametrize("replicas, message", [
    ("3", "TF_CONFIG cluster.ps lists 4 ps-servers, which is not a multiple of PS_REPLICAS 3: a flat list "
          "is read as shards of 3 consecutive replicas, so it needs shards x 3 entries (a TFJob's PS "
          "replicas); set PS_REPLICAS to the replicas per shard, or list every replica of every shard"),
    ("0", "PS_REPLICAS must be a whole number >= 1 (the replicas per shard), got '0'"),
    ("-2", "PS_REPLICAS must be a whole number >= 1 (the replicas per shard), got '-2'"),
    ("two", "PS_REPLICAS must be a whole number >= 1 (the replicas per shard), got 'two'"),
])
def test_a_flat_tf_config_with_bad_ps_replicas_is_refused(replicas, message):
    with pytest.raises(ClusterConfigError) as info:
        ps_addresses_from_env({**_tf_config(_FLAT), "PS_REPLICAS": replicas})
    assert str(info.value) == message


def test_group_flat_replicas_names_the_setting_it_was_given():
    flat = (("a:1",), ("b:1",), ("c:1",), ("d:1",))
    assert group_flat_replicas(flat, 2) == (("a:1", "b:1"), ("c:1", "d:1"))
    assert group_flat_replicas(flat, 1) == flat
    assert group_flat_replicas((("a:1", "a:2"), ("b:1",)), 2) == (("a:1", "a:2"), ("b:1",))
    with pytest.raises(ClusterConfigError,
                       match=r"^the list lists 4 ps-servers, which is not a multiple of --replicas 3:"):
        group_flat_replicas(flat, 3, "the list", "--replicas")


def test_psclient_from_env_and_ps_worker_get_each_shards_replicas():
    env = {**_tf_config(_FLAT), "PS_REPLICAS": "2"}
    client = PSClient.from_env(env, connect=False, register=False)
    try:
        assert client.replicas == (tuple(_FLAT[:2]), tuple(_FLAT[2:]))
    finally:
        client.close()
    args = argparse.Namespace(addresses=None, worker_index=None, num_workers=None)
    addresses, index, count = _resolve(args, env)
    assert (addresses, index, count) == (["|".join(_FLAT[:2]), "|".join(_FLAT[2:])], 0, 1)
    with pytest.raises(ValueError, match="not a multiple of PS_REPLICAS 3"):
        PSClient.from_env({**env, "PS_REPLICAS": "3"}, connect=False, register=False)


def test_the_help_text_explains_ps_replicas():
    meaning = {s.name: s.meaning for s in CLUSTER_ENVIRONMENT}["PS_REPLICAS"]
    assert "consecutive" in meaning and "cluster.ps" in meaning
