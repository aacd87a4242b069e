"""What a PodDisruptionBudget lets the Eviction API do, as Kubernetes decides it.

Two pieces of Kubernetes, restated for the budgets the manifests declare so a
test can play a drain against them without a cluster:

- the disruption controller (``pkg/controller/disruption``) computes the
  budget's status: ``expectedPods`` (the controller's scale for
  ``maxUnavailable`` and percentages, else the pods selected),
  ``desiredHealthy``, ``currentHealthy`` (Ready pods not being deleted) and
  ``disruptionsAllowed`` = max(0, currentHealthy - desiredHealthy);
- the eviction handler (``pkg/registry/core/pod/storage/eviction.go``)
  evicts a pod that is Pending, finished or already being deleted without
  asking the budget; a Running pod that is not Ready per
  ``unhealthyPodEvictionPolicy`` (``AlwaysAllow``: always;
  ``IfHealthyBudget``, the default: only while currentHealthy ≥
  desiredHealthy); a Ready pod only while disruptionsAllowed > 0, which the
  eviction then uses up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .k8s_objects import label_selector_matches


@dataclass
class Pod:
    """A pod as the budget sees it."""

    name: str
    labels: dict
    phase: str = "Running"  # Pending, Running, Succeeded, Failed
    ready: bool = True
    deleting: bool = False  # metadata.deletionTimestamp is set


@dataclass
class Budget:
    """One PodDisruptionBudget over the pods of a controller with ``scale`` replicas."""

    spec: dict
    scale: int
    pods: list[Pod] = field(default_factory=list)

    def selected(self) -> list[Pod]:
        return [p for p in self.pods if label_selector_matches(self.spec.get("selector"), p.labels)]

    def status(self) -> dict[str, int]:
        """expectedPods, desiredHealthy, currentHealthy, disruptionsAllowed."""
        pods = self.selected()
        healthy = sum(1 for p in pods if p.ready and not p.deleting and p.phase == "Running")
        if "maxUnavailable" in self.spec:
            expected = self.scale
            desired = expected - _scaled(self.spec["maxUnavailable"], expected, round_up=True)
        elif isinstance(self.spec.get("minAvailable"), int):
            expected = len(pods)
            desired = self.spec["minAvailable"]
        else:
            expected = self.scale
            desired = _scaled(self.spec.get("minAvailable", "100%"), expected, round_up=True)
        desired = max(0, desired)
        return {"expectedPods": expected, "desiredHealthy": desired, "currentHealthy": healthy,
                "disruptionsAllowed": max(0, healthy - desired)}

    def evict(self, name: str) -> bool:
        """The Eviction API on pod ``name``: True if it is evicted (then marked deleting)."""
        pod = next(p for p in self.pods if p.name == name)
        status = self.status()
        if pod.phase in ("Pending", "Succeeded", "Failed") or pod.deleting:
            allowed = True
        elif not pod.ready:
            policy = self.spec.get("unhealthyPodEvictionPolicy", "IfHealthyBudget")
            allowed = policy == "AlwaysAllow" or status["currentHealthy"] >= status["desiredHealthy"]
        else:
            allowed = status["disruptionsAllowed"] > 0
        if allowed:
            pod.deleting = True
        return allowed


def _scaled(value: int | str, total: int, *, round_up: bool) -> int:
    """An IntOrString against ``total`` (intstr.GetScaledValueFromIntOrPercent)."""
    if isinstance(value, int):
        return value
    fraction = int(str(value).rstrip("%")) * total / 100
    return math.ceil(fraction) if round_up else math.floor(fraction)
