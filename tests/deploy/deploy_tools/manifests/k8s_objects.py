"""Look up rendered Kubernetes objects and read their generic fields: references,
label selectors, resource quantities."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any


def ref(obj: dict) -> str:
    meta = obj.get("metadata") or {}
    ns = meta.get("namespace")
    return f"{obj.get('kind')}/{meta.get('name')}" + (f" (ns {ns})" if ns else "")


def namespace_of(obj: dict) -> str | None:
    return (obj.get("metadata") or {}).get("namespace")


def find(objects: Iterable[dict], kind: str, name: str, namespace: str | None) -> dict | None:
    for obj in objects:
        meta = obj.get("metadata") or {}
        if obj.get("kind") == kind and meta.get("name") == name and meta.get("namespace") == namespace:
            return obj
    return None


#: The keys of the Secret a cert-manager Certificate writes (the CA and SelfSigned issuers fill ca.crt).
CERTIFICATE_SECRET_KEYS = ("tls.crt", "tls.key", "ca.crt")


def find_secret(objects: Iterable[dict], name: str, namespace: str | None) -> dict | None:
    """The Secret ``name`` as the cluster will hold it: one of the render, or, where a cert-manager
    Certificate of the render writes it (spec.secretName), a stand-in with the keys cert-manager
    gives it and no data (the material exists only once cert-manager has issued it)."""
    objects = list(objects)
    secret = find(objects, "Secret", name, namespace)
    if secret is not None:
        return secret
    for cert in objects:
        if (cert.get("kind") == "Certificate" and str(cert.get("apiVersion", "")).startswith("cert-manager.io/")
                and (cert.get("spec") or {}).get("secretName") == name and namespace_of(cert) == namespace):
            return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                    "metadata": {"name": name, "namespace": namespace,
                                 "annotations": {"cert-manager.io/certificate-name": cert["metadata"]["name"]}},
                    "stringData": dict.fromkeys(CERTIFICATE_SECRET_KEYS, "")}
    return None


def label_selector_matches(selector: dict | None, labels: dict | None) -> bool:
    """A metav1.LabelSelector (matchLabels + matchExpressions) against labels.

    None selects nothing; {} selects everything, as in Kubernetes.
    """
    if selector is None:
        return False
    labels = labels or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            return False
    return True


def map_selector_matches(selector: dict | None, labels: dict | None) -> bool:
    """A Service-style selector (plain map); an empty map selects nothing here."""
    if not selector:
        return False
    labels = labels or {}
    return all(labels.get(k) == v for k, v in selector.items())


_QUANTITY = re.compile(r"^([0-9.]+)([a-zA-Z]*)$")
_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "m": 1e-3}


def quantity(value: Any) -> float:
    match = _QUANTITY.match(str(value).strip())
    if not match or match.group(2) not in _UNITS:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]
