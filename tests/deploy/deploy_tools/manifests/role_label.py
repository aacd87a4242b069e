"""Checks of the replicas' role label (ps-server --role-label): every replicated ps-server pod
can patch its own pod and nothing more. Its token is mounted, it knows its pod's name and
namespace from the downward API, and its service account is bound to a Role that grants patch on
pods, by resourceNames that name every replica's pod, and nothing else."""

from __future__ import annotations

from .k8s_objects import find, namespace_of
from .pod_templates import FieldRef, PodUnit, is_ps_server, resolve_env

#: What a Role for the label may grant: patching pods of the core API group, by name.
_ALLOWED_VERBS = {"patch"}


def role_label_problems(objects: list[dict], units: list[PodUnit]) -> list[str]:
    """For each replicated StatefulSet whose servers keep the label (PS_ROLE_LABEL is not off)."""
    problems = []
    for unit in units:
        container = next(c for c in unit.containers() if is_ps_server(c))
        env = resolve_env(container, objects, unit.namespace)
        if env.get("PS_ROLE_LABEL") == "off":
            continue
        where = unit.where
        for name, path in (("POD_NAME", "metadata.name"), ("POD_NAMESPACE", "metadata.namespace")):
            if env.get(name) != FieldRef(path):
                problems.append(f"{where}: {name} should be the fieldRef {path}: the role label names its pod "
                                f"by it, got {env.get(name)!r}")
        if unit.spec.get("automountServiceAccountToken") is not True:
            problems.append(f"{where}: automountServiceAccountToken is not true: without the token the role "
                            "label is off")
        account = unit.spec.get("serviceAccountName") or "default"
        if find(objects, "ServiceAccount", account, unit.namespace) is None and account != "default":
            problems.append(f"{where}: serviceAccountName {account!r} names no ServiceAccount")
        pods = [pod["metadata.name"] for pod in unit.downward]
        problems += _grant_problems(objects, where, unit.namespace, account, pods)
    return problems


def _grant_problems(objects: list[dict], where: str, namespace: str | None, account: str,
                    pods: list[str]) -> list[str]:
    roles = []
    for binding in objects:
        if binding.get("kind") != "RoleBinding" or namespace_of(binding) != namespace:
            continue
        subjects = binding.get("subjects") or []
        if not any(s.get("kind") == "ServiceAccount" and s.get("name") == account
                   and s.get("namespace", namespace) == namespace for s in subjects):
            continue
        ref = binding.get("roleRef") or {}
        role = find(objects, ref.get("kind", ""), ref.get("name", ""), namespace) if ref.get("kind") == "Role" \
            else None
        if role is None:
            return [f"{where}: RoleBinding {binding['metadata']['name']!r} refers to "
                    f"{ref.get('kind')} {ref.get('name')!r}, not a Role of the render"]
        roles.append(role)
    if not roles:
        return [f"{where}: no RoleBinding binds service account {account!r} to a Role: the role label is off"]
    problems = []
    granted: set[str] = set()
    for role in roles:
        for rule in role.get("rules") or []:
            name = role["metadata"]["name"]
            if (rule.get("apiGroups") != [""] or rule.get("resources") != ["pods"]
                    or not set(rule.get("verbs") or []) <= _ALLOWED_VERBS):
                problems.append(f"{where}: Role {name!r} grants more than patching pods: {rule}")
            elif not rule.get("resourceNames"):
                problems.append(f"{where}: Role {name!r} lets it patch every pod of the namespace: "
                                "name the replicas' pods in resourceNames")
            else:
                granted |= set(rule["resourceNames"])
    missing = [pod for pod in pods if pod not in granted]
    if missing:
        problems.append(f"{where}: the Role bound to {account!r} does not let pods {missing} patch themselves "
                        "(resourceNames): their role label is off")
    return problems
