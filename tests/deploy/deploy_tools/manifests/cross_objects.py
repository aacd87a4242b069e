"""Generic cross-object checks of a render: selectors, Services, PodDisruptionBudgets,
NetworkPolicies, probes and references must fit the pods they are about."""

from __future__ import annotations

from .k8s_objects import find, find_secret, label_selector_matches, map_selector_matches, namespace_of, ref
from .pod_templates import PodUnit, container_ports, pod_units, secret_keys, unit_has_port

SCALABLE_CONTROLLERS = {"Deployment", "ReplicaSet", "StatefulSet", "ReplicationController"}


def cross_object_problems(objects: list[dict]) -> list[str]:
    """Selectors, Services, PDBs, NetworkPolicies, probes and references."""
    problems: list[str] = []
    units = pod_units(objects)
    problems += _selector_problems(objects)
    problems += _service_problems(objects, units)
    problems += _pdb_problems(objects, units)
    problems += _network_policy_problems(objects, units)
    problems += _statefulset_service_problems(objects, units)
    for unit in units:
        problems += _probe_problems(unit)
        problems += _reference_problems(unit, objects)
    return problems


def _selector_problems(objects: list[dict]) -> list[str]:
    problems = []
    for obj in objects:
        if obj.get("kind") not in {"Deployment", "ReplicaSet", "StatefulSet", "DaemonSet"}:
            continue
        spec = obj.get("spec") or {}
        selector = spec.get("selector")
        labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
        if not selector or not (selector.get("matchLabels") or selector.get("matchExpressions")):
            problems.append(f"{ref(obj)}: empty selector")
        elif not label_selector_matches(selector, labels):
            problems.append(f"{ref(obj)}: selector {selector} does not match its pod template labels {labels}")
    for obj in objects:
        if obj.get("kind") == "Job" and (obj.get("spec") or {}).get("manualSelector"):
            spec = obj["spec"]
            labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
            if not label_selector_matches(spec.get("selector"), labels):
                problems.append(f"{ref(obj)}: manual selector does not match its pod template labels")
    return problems


def _service_problems(objects: list[dict], units: list[PodUnit]) -> list[str]:
    problems = []
    for svc in (o for o in objects if o.get("kind") == "Service"):
        spec = svc.get("spec") or {}
        if spec.get("type") == "ExternalName" or not spec.get("selector"):
            continue
        selected = [u for u in units
                    if u.namespace == namespace_of(svc) and map_selector_matches(spec["selector"], u.labels)]
        if not selected:
            problems.append(f"{ref(svc)}: selector {spec['selector']} selects no pods")
            continue
        for port in spec.get("ports") or []:
            target = port.get("targetPort", port.get("port"))
            for unit in selected:
                if not unit_has_port(unit, target):
                    problems.append(f"{ref(svc)}: port {port.get('name') or port.get('port')} targets "
                                    f"{target!r}, which {unit.where} does not expose")
    return problems


def _pdb_problems(objects: list[dict], units: list[PodUnit]) -> list[str]:
    problems = []
    for pdb in (o for o in objects if o.get("kind") == "PodDisruptionBudget"):
        spec = pdb.get("spec") or {}
        selected = [u for u in units
                    if u.namespace == namespace_of(pdb) and u.selected_by(spec.get("selector"))]
        if not selected:
            problems.append(f"{ref(pdb)}: selector selects no pods")
        # Eviction refuses maxUnavailable (and percentages) for pods whose
        # controller has no scale subresource (Jobs, operators, bare pods).
        if "maxUnavailable" in spec or "%" in str(spec.get("minAvailable", "")):
            for unit in selected:
                if unit.controller not in SCALABLE_CONTROLLERS:
                    problems.append(f"{ref(pdb)}: maxUnavailable / a percentage cannot protect "
                                    f"{unit.where} ({unit.controller} pods have no scale subresource)")
    return problems


def _peer_units(peer: dict, policy_ns: str | None, units: list[PodUnit]) -> list[PodUnit] | None:
    """Units a NetworkPolicy peer selects in the render; None: outside the render."""
    if "ipBlock" in peer or "namespaceSelector" in peer:
        return None
    return [u for u in units if u.namespace == policy_ns and label_selector_matches(peer.get("podSelector"), u.labels)]


def _network_policy_problems(objects: list[dict], units: list[PodUnit]) -> list[str]:
    problems = []
    for pol in (o for o in objects if o.get("kind") == "NetworkPolicy"):
        spec = pol.get("spec") or {}
        ns = namespace_of(pol)
        selected = [u for u in units if u.namespace == ns and label_selector_matches(spec.get("podSelector"), u.labels)]
        if not selected:
            problems.append(f"{ref(pol)}: podSelector selects no pods")
        for i, rule in enumerate(spec.get("ingress") or []):
            for peer in rule.get("from") or []:
                peers = _peer_units(peer, ns, units)
                if peers is not None and not peers:
                    problems.append(f"{ref(pol)}: ingress[{i}] peer {peer} selects no pods")
            for port in rule.get("ports") or []:
                for unit in selected:
                    if "port" in port and not unit_has_port(unit, port["port"]):
                        problems.append(f"{ref(pol)}: ingress[{i}] allows port {port['port']!r}, "
                                        f"which {unit.where} does not expose")
        for i, rule in enumerate(spec.get("egress") or []):
            for peer in rule.get("to") or []:
                peers = _peer_units(peer, ns, units)
                if peers is None:
                    continue
                if not peers:
                    problems.append(f"{ref(pol)}: egress[{i}] peer {peer} selects no pods")
                for port in rule.get("ports") or []:
                    for unit in peers:
                        if "port" in port and not unit_has_port(unit, port["port"]):
                            problems.append(f"{ref(pol)}: egress[{i}] allows port {port['port']!r}, "
                                            f"which {unit.where} does not expose")
    return problems


def _statefulset_service_problems(objects: list[dict], units: list[PodUnit]) -> list[str]:
    problems = []
    for unit in (u for u in units if u.controller == "StatefulSet"):
        name = (unit.owner.get("spec") or {}).get("serviceName")
        svc = find(objects, "Service", name, unit.namespace) if name else None
        if svc is None:
            problems.append(f"{unit.where}: serviceName {name!r} names no Service")
            continue
        spec = svc.get("spec") or {}
        if spec.get("clusterIP") != "None":
            problems.append(f"{unit.where}: Service {name} is not headless (clusterIP: None), "
                            "so the pods get no stable DNS names")
        if not map_selector_matches(spec.get("selector"), unit.labels):
            problems.append(f"{unit.where}: its governing Service {name} does not select its pods")
    return problems


def _probe_problems(unit: PodUnit) -> list[str]:
    problems = []
    for container in unit.containers():
        names, numbers = container_ports(container)
        for probe_name in ("livenessProbe", "readinessProbe", "startupProbe"):
            probe = container.get(probe_name)
            if not probe:
                continue
            for handler in ("httpGet", "tcpSocket", "grpc"):
                if handler not in probe:
                    continue
                port = probe[handler].get("port")
                if handler == "grpc" and not isinstance(port, int):
                    problems.append(f"{unit.where} container {container.get('name')}: {probe_name} grpc port "
                                    f"must be a number, got {port!r}")
                elif not ((isinstance(port, int) and port in numbers) or (isinstance(port, str) and port in names)):
                    problems.append(f"{unit.where} container {container.get('name')}: {probe_name} "
                                    f"port {port!r} is not a container port")
    return problems


def _reference_problems(unit: PodUnit, objects: list[dict]) -> list[str]:
    problems = []
    ns = unit.namespace
    spec = unit.spec
    where = unit.where

    def need(kind: str, name: str | None, what: str, key: str | None = None, optional: bool = False) -> None:
        if optional:
            return
        if not name:
            obj = None
        elif kind == "Secret":
            obj = find_secret(objects, name, ns)
        else:
            obj = find(objects, kind, name, ns)
        if obj is None:
            problems.append(f"{where}: {what} refers to {kind} {name!r}, which the render does not contain")
            return
        if key is not None:
            keys = secret_keys(obj) if kind == "Secret" else set(obj.get("data") or {}) | set(obj.get("binaryData") or {})
            if key not in keys:
                problems.append(f"{where}: {what} refers to key {key!r} of {kind} {name}, which has {sorted(keys)}")

    for container in list(spec.get("containers") or []) + list(spec.get("initContainers") or []):
        cname = container.get("name")
        for source in container.get("envFrom") or []:
            if "configMapRef" in source:
                sel = source["configMapRef"]
                need("ConfigMap", sel.get("name"), f"container {cname} envFrom", optional=sel.get("optional", False))
            if "secretRef" in source:
                sel = source["secretRef"]
                need("Secret", sel.get("name"), f"container {cname} envFrom", optional=sel.get("optional", False))
        for var in container.get("env") or []:
            source = var.get("valueFrom") or {}
            if "configMapKeyRef" in source:
                sel = source["configMapKeyRef"]
                need("ConfigMap", sel.get("name"), f"container {cname} env {var.get('name')}", sel.get("key"),
                     sel.get("optional", False))
            if "secretKeyRef" in source:
                sel = source["secretKeyRef"]
                need("Secret", sel.get("name"), f"container {cname} env {var.get('name')}", sel.get("key"),
                     sel.get("optional", False))
        volume_names = {v.get("name") for v in spec.get("volumes") or []}
        if unit.controller == "StatefulSet":
            volume_names |= {(t.get("metadata") or {}).get("name")
                             for t in (unit.owner.get("spec") or {}).get("volumeClaimTemplates") or []}
        for mount in container.get("volumeMounts") or []:
            if mount.get("name") not in volume_names:
                problems.append(f"{where}: container {cname} mounts volume {mount.get('name')!r}, which is not defined")
    for volume in spec.get("volumes") or []:
        vname = volume.get("name")
        if "configMap" in volume:
            src = volume["configMap"]
            for item in src.get("items") or [None]:
                need("ConfigMap", src.get("name"), f"volume {vname}", item and item.get("key"), src.get("optional", False))
        if "secret" in volume:
            src = volume["secret"]
            for item in src.get("items") or [None]:
                need("Secret", src.get("secretName"), f"volume {vname}", item and item.get("key"),
                     src.get("optional", False))
        if "persistentVolumeClaim" in volume:
            need("PersistentVolumeClaim", volume["persistentVolumeClaim"].get("claimName"), f"volume {vname}")
        for source in (volume.get("projected") or {}).get("sources") or []:
            if "configMap" in source:
                need("ConfigMap", source["configMap"].get("name"), f"volume {vname}",
                     optional=source["configMap"].get("optional", False))
            if "secret" in source:
                need("Secret", source["secret"].get("name"), f"volume {vname}",
                     optional=source["secret"].get("optional", False))
    return problems
