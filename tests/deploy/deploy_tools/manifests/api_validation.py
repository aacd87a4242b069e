"""The API server's own validation of the fields the manifests use, beyond their schemas.

A schema says a field is a list of strings; the API server also refuses a
``matchLabelKeys`` key that its ``labelSelector`` already names, a
``maxSkew`` of 0, a probe with two handlers. Those rules live in Go
(Kubernetes' ``pkg/apis/core/validation/validation.go``: topology spread,
affinity, probes; ``pkg/apis/batch/validation``: a Job's podFailurePolicy;
``pkg/apis/policy/validation``: PodDisruptionBudget;
``apimachinery``'s label selector validation), so schema validation and
checkov pass what a real API server rejects. This module restates them for
the fields the manifests use, after Kubernetes' defaulting, and returns
each violation as a message naming the object and the field, in the API
server's words where it has them.

The project's own rule on top: a PodDisruptionBudget's selector is
non-empty (an empty one selects every pod of the namespace) and selects
pods of the render.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from .k8s_objects import namespace_of, ref
from .pod_templates import PodUnit, pod_units

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_IANA_SVC_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")

#: Label selector operators (metav1.LabelSelectorOperator).
_SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
#: Node selector operators (core.NodeSelectorOperator).
_NODE_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")
_WHEN_UNSATISFIABLE = ("DoNotSchedule", "ScheduleAnyway")
_INCLUSION_POLICIES = ("Honor", "Ignore")
_UNHEALTHY_POD_EVICTION = ("IfHealthyBudget", "AlwaysAllow")
_PROBE_HANDLERS = ("exec", "httpGet", "tcpSocket", "grpc")
#: Kubernetes' defaults for a probe's numeric fields (pkg/apis/core/v1/defaults.go).
_PROBE_DEFAULTS = {"timeoutSeconds": 1, "periodSeconds": 10, "successThreshold": 1, "failureThreshold": 3}


def qualified_name_problems(where: str, name: Any) -> list[str]:
    """A label key or topology key: ``[prefix/]name``, prefix a DNS subdomain, name ≤ 63 characters."""
    text = str(name or "")
    if not text:
        return [f"{where}: Required value"]
    prefix, _, last = text.rpartition("/") if "/" in text else ("", "", text)
    problems = []
    if "/" in text and (not prefix or len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix)):
        problems.append(f"{where}: {text!r}: prefix part must be a DNS subdomain")
    if len(last) > 63 or not _QUALIFIED_NAME.match(last):
        problems.append(f"{where}: {text!r}: name part must consist of alphanumeric characters, '-', '_' "
                        "or '.', and must start and end with an alphanumeric character (at most 63)")
    return problems


def label_value_problems(where: str, value: Any) -> list[str]:
    text = str(value) if value is not None else ""
    if len(text) > 63 or not _LABEL_VALUE.match(text):
        return [f"{where}: {text!r}: a valid label value must be at most 63 alphanumeric characters, "
                "'-', '_' or '.', starting and ending with an alphanumeric character"]
    return []


def label_selector_problems(where: str, selector: Any) -> list[str]:
    """metav1.LabelSelector as apimachinery's ValidateLabelSelector checks it."""
    if selector is None:
        return []
    if not isinstance(selector, dict):
        return [f"{where}: a label selector must be an object"]
    problems = []
    for key, value in (selector.get("matchLabels") or {}).items():
        problems += qualified_name_problems(f"{where}.matchLabels", key)
        problems += label_value_problems(f"{where}.matchLabels[{key}]", value)
    for i, expr in enumerate(selector.get("matchExpressions") or []):
        at = f"{where}.matchExpressions[{i}]"
        op, values = expr.get("operator"), expr.get("values") or []
        problems += qualified_name_problems(f"{at}.key", expr.get("key"))
        if op in ("In", "NotIn"):
            if not values:
                problems.append(f"{at}.values: Required value: must be specified when `operator` is 'In' or 'NotIn'")
        elif op in ("Exists", "DoesNotExist"):
            if values:
                problems.append(f"{at}.values: Forbidden: may not be specified when `operator` is "
                                "'Exists' or 'DoesNotExist'")
        else:
            problems.append(f"{at}.operator: Unsupported value: {op!r}: supported values: "
                            f"{', '.join(_SELECTOR_OPERATORS)}")
        for j, value in enumerate(values):
            problems += label_value_problems(f"{at}.values[{j}]", value)
    return problems


def _selector_keys(selector: dict | None) -> set[str]:
    selector = selector or {}
    return set(selector.get("matchLabels") or {}) | {e.get("key") for e in selector.get("matchExpressions") or []}


def _label_keys_problems(where: str, keys: list, selector: dict | None, field: str) -> list[str]:
    """matchLabelKeys (spread, affinity): valid keys, a selector beside them, none of its keys."""
    if not keys:
        return []
    problems = []
    if selector is None:
        problems.append(f"{where}.{field}: Forbidden: must not be specified when labelSelector is not set")
    in_selector = _selector_keys(selector)
    for i, key in enumerate(keys):
        problems += qualified_name_problems(f"{where}.{field}[{i}]", key)
        if key in in_selector:
            problems.append(f"{where}.{field}[{i}]: Invalid value: {key!r}: exists in both {field} "
                            "and labelSelector")
    return problems


def topology_spread_problems(where: str, constraints: list[dict]) -> list[str]:
    """validateTopologySpreadConstraints."""
    problems = []
    seen: set[tuple[Any, Any]] = set()
    for i, c in enumerate(constraints or []):
        at = f"{where}.topologySpreadConstraints[{i}]"
        skew = c.get("maxSkew")
        if not isinstance(skew, int) or skew <= 0:
            problems.append(f"{at}.maxSkew: Invalid value: {skew!r}: must be greater than zero")
        problems += qualified_name_problems(f"{at}.topologyKey", c.get("topologyKey"))
        when = c.get("whenUnsatisfiable")
        if when not in _WHEN_UNSATISFIABLE:
            problems.append(f"{at}.whenUnsatisfiable: Unsupported value: {when!r}: supported values: "
                            f"{', '.join(_WHEN_UNSATISFIABLE)}")
        pair = (c.get("topologyKey"), when)
        if pair in seen:
            problems.append(f"{at}: Duplicate value: {{{pair[0]}, {pair[1]}}}")
        seen.add(pair)
        if "minDomains" in c:
            domains = c["minDomains"]
            if not isinstance(domains, int) or domains <= 0:
                problems.append(f"{at}.minDomains: Invalid value: {domains!r}: must be greater than zero")
            if when != "DoNotSchedule":
                problems.append(f"{at}.minDomains: Invalid value: can only use minDomains if "
                                "whenUnsatisfiable=DoNotSchedule")
        for field in ("nodeAffinityPolicy", "nodeTaintsPolicy"):
            if field in c and c[field] not in _INCLUSION_POLICIES:
                problems.append(f"{at}.{field}: Unsupported value: {c[field]!r}")
        problems += label_selector_problems(f"{at}.labelSelector", c.get("labelSelector"))
        problems += _label_keys_problems(at, c.get("matchLabelKeys") or [], c.get("labelSelector"),
                                         "matchLabelKeys")
    return problems


def _pod_affinity_term_problems(at: str, term: dict) -> list[str]:
    problems = label_selector_problems(f"{at}.labelSelector", term.get("labelSelector"))
    problems += label_selector_problems(f"{at}.namespaceSelector", term.get("namespaceSelector"))
    for i, ns in enumerate(term.get("namespaces") or []):
        if not _DNS1123_LABEL.match(str(ns)):
            problems.append(f"{at}.namespaces[{i}]: Invalid value: {ns!r}")
    problems += qualified_name_problems(f"{at}.topologyKey", term.get("topologyKey"))
    match_keys, mismatch_keys = term.get("matchLabelKeys") or [], term.get("mismatchLabelKeys") or []
    problems += _label_keys_problems(at, match_keys, term.get("labelSelector"), "matchLabelKeys")
    problems += _label_keys_problems(at, mismatch_keys, term.get("labelSelector"), "mismatchLabelKeys")
    for key in sorted(set(match_keys) & set(mismatch_keys)):
        problems.append(f"{at}: Invalid value: {key!r}: exists in both matchLabelKeys and mismatchLabelKeys")
    return problems


def _node_selector_term_problems(at: str, term: dict) -> list[str]:
    problems = []
    for field in ("matchExpressions", "matchFields"):
        for i, req in enumerate(term.get(field) or []):
            where, op, values = f"{at}.{field}[{i}]", req.get("operator"), req.get("values") or []
            if field == "matchExpressions":
                problems += qualified_name_problems(f"{where}.key", req.get("key"))
            if op in ("In", "NotIn") and not values:
                problems.append(f"{where}.values: Required value: must be specified when `operator` is "
                                "'In' or 'NotIn'")
            elif op in ("Exists", "DoesNotExist") and values:
                problems.append(f"{where}.values: Forbidden: may not be specified when `operator` is "
                                "'Exists' or 'DoesNotExist'")
            elif op in ("Gt", "Lt") and len(values) != 1:
                problems.append(f"{where}.values: Required value: must be specified single value when "
                                "`operator` is 'Lt' or 'Gt'")
            elif op not in _NODE_OPERATORS:
                problems.append(f"{where}.operator: Invalid value: {op!r}: not a valid selector operator")
    return problems


def affinity_problems(where: str, affinity: dict | None) -> list[str]:
    """validateAffinity: node, pod and pod anti-affinity terms, weights 1..100."""
    if not affinity:
        return []
    problems = []
    node = affinity.get("nodeAffinity") or {}
    required = node.get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is not None:
        terms = required.get("nodeSelectorTerms") or []
        if not terms:
            problems.append(f"{where}.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
                            ".nodeSelectorTerms: Required value: must have at least one node selector term")
        for i, term in enumerate(terms):
            problems += _node_selector_term_problems(
                f"{where}.affinity.nodeAffinity.required.nodeSelectorTerms[{i}]", term)
    for i, pref in enumerate(node.get("preferredDuringSchedulingIgnoredDuringExecution") or []):
        at = f"{where}.affinity.nodeAffinity.preferred[{i}]"
        problems += _weight_problems(at, pref.get("weight"))
        problems += _node_selector_term_problems(f"{at}.preference", pref.get("preference") or {})
    for kind in ("podAffinity", "podAntiAffinity"):
        pod = affinity.get(kind) or {}
        for i, term in enumerate(pod.get("requiredDuringSchedulingIgnoredDuringExecution") or []):
            problems += _pod_affinity_term_problems(f"{where}.affinity.{kind}.required[{i}]", term)
        for i, pref in enumerate(pod.get("preferredDuringSchedulingIgnoredDuringExecution") or []):
            at = f"{where}.affinity.{kind}.preferred[{i}]"
            problems += _weight_problems(at, pref.get("weight"))
            problems += _pod_affinity_term_problems(f"{at}.podAffinityTerm", pref.get("podAffinityTerm") or {})
    return problems


def _weight_problems(at: str, weight: Any) -> list[str]:
    if not isinstance(weight, int) or not 1 <= weight <= 100:
        return [f"{at}.weight: Invalid value: {weight!r}: must be in the range 1-100"]
    return []


def _port_problems(at: str, port: Any, names: set[str], *, named: bool) -> list[str]:
    if isinstance(port, int):
        return [] if 1 <= port <= 65535 else [f"{at}: Invalid value: {port}: must be between 1 and 65535"]
    if not named:
        return [f"{at}: Invalid value: {port!r}: must be a port number"]
    text = str(port)
    if len(text) > 15 or not _IANA_SVC_NAME.match(text) or "--" in text or not re.search("[a-z]", text):
        return [f"{at}: Invalid value: {text!r}: must be a port number or an IANA_SVC_NAME"]
    if text not in names:
        return [f"{at}: Invalid value: {text!r}: no container port is named so"]
    return []


def probe_problems(at: str, probe: dict | None, container: dict, kind: str) -> list[str]:
    """validateProbe and validateHandler, with the liveness and startup rules of validateContainers."""
    if probe is None:
        return []
    handlers = [h for h in _PROBE_HANDLERS if probe.get(h) is not None]
    problems = []
    if not handlers:
        problems.append(f"{at}: Required value: must specify a handler type")
    elif len(handlers) > 1:
        problems.append(f"{at}.{handlers[1]}: Forbidden: may not specify more than 1 handler type")
    names = {p.get("name") for p in container.get("ports") or [] if p.get("name")}
    for handler in handlers:
        action = probe[handler] or {}
        if handler in ("httpGet", "tcpSocket"):
            problems += _port_problems(f"{at}.{handler}.port", action.get("port"), names, named=True)
        elif handler == "grpc":
            problems += _port_problems(f"{at}.grpc.port", action.get("port"), names, named=False)
        elif handler == "exec" and not action.get("command"):
            problems.append(f"{at}.exec.command: Required value")
    if int(probe.get("initialDelaySeconds") or 0) < 0:
        problems.append(f"{at}.initialDelaySeconds: Invalid value: must be greater than or equal to 0")
    for field, default in _PROBE_DEFAULTS.items():
        value = probe.get(field) or default  # 0 or absent: the API server's default
        if not isinstance(value, int) or value < 1:
            problems.append(f"{at}.{field}: Invalid value: {value!r}: must be greater than or equal to 1")
    if kind in ("livenessProbe", "startupProbe") and (probe.get("successThreshold") or 1) != 1:
        problems.append(f"{at}.successThreshold: Invalid value: {probe.get('successThreshold')}: must be 1")
    grace = probe.get("terminationGracePeriodSeconds")
    if grace is not None:
        if kind == "readinessProbe":
            problems.append(f"{at}.terminationGracePeriodSeconds: Invalid value: must not be set for readinessProbes")
        elif not isinstance(grace, int) or grace <= 0:
            problems.append(f"{at}.terminationGracePeriodSeconds: Invalid value: {grace!r}: must be greater than 0")
    return problems


def pod_spec_problems(where: str, spec: dict) -> list[str]:
    """The rules above for one pod template's spec."""
    problems = topology_spread_problems(where, spec.get("topologySpreadConstraints") or [])
    problems += affinity_problems(where, spec.get("affinity"))
    for group in ("initContainers", "containers"):
        for container in spec.get(group) or []:
            at = f"{where} container {container.get('name')}"
            for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
                problems += probe_problems(f"{at}.{kind}", container.get(kind), container, kind)
    return problems


def pdb_problems(pdb: dict, units: Iterable[PodUnit]) -> list[str]:
    """ValidatePodDisruptionBudgetSpec, and a non-empty selector that selects pods of the render."""
    where, spec = ref(pdb), pdb.get("spec") or {}
    problems = []
    if "minAvailable" in spec and "maxUnavailable" in spec:
        problems.append(f"{where}: spec: Invalid value: minAvailable and maxUnavailable cannot be both set")
    for field in ("minAvailable", "maxUnavailable"):
        if field in spec:
            problems += _int_or_percent_problems(f"{where}: spec.{field}", spec[field])
    policy = spec.get("unhealthyPodEvictionPolicy")
    if policy is not None and policy not in _UNHEALTHY_POD_EVICTION:
        problems.append(f"{where}: spec.unhealthyPodEvictionPolicy: Unsupported value: {policy!r}: supported "
                        f"values: {', '.join(_UNHEALTHY_POD_EVICTION)}")
    selector = spec.get("selector")
    problems += label_selector_problems(f"{where}: spec.selector", selector)
    if not selector or not _selector_keys(selector):
        problems.append(f"{where}: spec.selector is empty: it would select every pod of the namespace")
    elif not any(u.namespace == namespace_of(pdb) and u.selected_by(selector) for u in units):
        problems.append(f"{where}: spec.selector selects no pod of the render")
    return problems


def _int_or_percent_problems(at: str, value: Any) -> list[str]:
    if isinstance(value, int):
        return [] if value >= 0 else [f"{at}: Invalid value: {value}: must be greater than or equal to 0"]
    match = re.fullmatch(r"([0-9]+)%", str(value))
    if not match:
        return [f"{at}: Invalid value: {value!r}: must be an integer or percentage (e.g '5%')"]
    if int(match.group(1)) > 100:
        return [f"{at}: Invalid value: {value!r}: must be no greater than 100%"]
    return []


_FAILURE_ACTIONS = ("FailJob", "FailIndex", "Ignore", "Count")


def job_spec_problems(where: str, job: dict) -> list[str]:
    """validateJobSpec's podFailurePolicy rules, and the deadlines' and TTL's ranges."""
    problems = []
    pod = (job.get("template") or {}).get("spec") or {}
    names = {c.get("name") for c in (pod.get("containers") or []) + (pod.get("initContainers") or [])}
    policy = job.get("podFailurePolicy")
    if policy is not None:
        if pod.get("restartPolicy") != "Never":
            problems.append(f"{where}.template.spec.restartPolicy: Invalid value: "
                            f"{pod.get('restartPolicy')!r}: only \"Never\" is supported when podFailurePolicy is specified")
        for i, rule in enumerate(policy.get("rules") or []):
            at = f"{where}.podFailurePolicy.rules[{i}]"
            if rule.get("action") not in _FAILURE_ACTIONS:
                problems.append(f"{at}.action: Unsupported value: {rule.get('action')!r}")
            if rule.get("action") == "FailIndex" and job.get("completionMode") != "Indexed":
                problems.append(f"{at}.action: Forbidden: FailIndex needs completionMode Indexed")
            codes, conditions = rule.get("onExitCodes"), rule.get("onPodConditions")
            if (codes is None) == (conditions is None):
                problems.append(f"{at}: Invalid value: specify one of onExitCodes and onPodConditions, not both")
            if codes is not None:
                values = codes.get("values") or []
                if codes.get("operator") not in ("In", "NotIn"):
                    problems.append(f"{at}.onExitCodes.operator: Unsupported value: {codes.get('operator')!r}")
                if not values or len(values) > 255:
                    problems.append(f"{at}.onExitCodes.values: Invalid value: between 1 and 255 values")
                if values != sorted(set(values)):
                    problems.append(f"{at}.onExitCodes.values: Invalid value: must be ordered and without duplicates")
                if codes.get("operator") == "In" and 0 in values:
                    problems.append(f"{at}.onExitCodes.values: Invalid value: 0 must not be included for In")
                if codes.get("containerName") is not None and codes["containerName"] not in names:
                    problems.append(f"{at}.onExitCodes.containerName: Invalid value: "
                                    f"{codes['containerName']!r}: no container of the pod template")
            for j, cond in enumerate(conditions or []):
                if not cond.get("type") or cond.get("status", "True") not in ("True", "False", "Unknown"):
                    problems.append(f"{at}.onPodConditions[{j}]: Invalid value: {cond!r}")
    for field, minimum in (("activeDeadlineSeconds", 1), ("ttlSecondsAfterFinished", 0), ("backoffLimit", 0)):
        if field in job and (not isinstance(job[field], int) or job[field] < minimum):
            problems.append(f"{where}.{field}: Invalid value: {job[field]!r}: must be at least {minimum}")
    return problems


def _job_specs(obj: dict) -> list[tuple[str, dict]]:
    """(where, JobSpec) of a Job, a CronJob's job template and a JobSet's replicated Jobs."""
    kind, spec = obj.get("kind"), obj.get("spec") or {}
    if kind == "Job":
        return [(ref(obj), spec)]
    if kind == "CronJob":
        return [(ref(obj), (spec.get("jobTemplate") or {}).get("spec") or {})]
    if kind == "JobSet":
        return [(f"{ref(obj)} replicatedJob {r.get('name')}", (r.get("template") or {}).get("spec") or {})
                for r in spec.get("replicatedJobs") or []]
    return []


def api_validation_problems(objects: list[dict]) -> list[str]:
    """Every pod template (wherever it is templated), Job spec and PodDisruptionBudget of a render."""
    units = pod_units(objects)
    problems = []
    seen: set[int] = set()  # a JobSet's child Jobs share their replicatedJob's template: check it once
    for unit in units:
        if id(unit.spec) not in seen:
            seen.add(id(unit.spec))
            problems += pod_spec_problems(unit.where, unit.spec)
    for obj in objects:
        if obj.get("kind") == "PodDisruptionBudget":
            problems += pdb_problems(obj, units)
        for where, job in _job_specs(obj):
            problems += job_spec_problems(where, job)
    return problems
