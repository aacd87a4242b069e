"""Checks of the Grafana dashboard: every series it queries is one ps-server exports,
with the labels it has, and every PromQL expression is well formed."""

from __future__ import annotations

import re
from collections.abc import Iterator

#: The metrics ps-server exports: name -> (type, labels).
METRICS = {
    "wehub_ps_pushes_total": ("counter", {"variable", "outcome"}),
    "wehub_ps_pulls_total": ("counter", {"variable", "outcome"}),
    "wehub_ps_bytes_received_total": ("counter", set()),
    "wehub_ps_bytes_sent_total": ("counter", set()),
    "wehub_ps_apply_seconds": ("histogram", set()),
    "wehub_ps_push_staleness": ("histogram", set()),
    "wehub_ps_live_workers": ("gauge", set()),
    "wehub_ps_checkpoint_seconds": ("histogram", set()),
    "wehub_ps_checkpoint_age_seconds": ("gauge", set()),
    "wehub_ps_restored_version": ("gauge", {"variable"}),
}
#: Labels Prometheus' Kubernetes service discovery adds to every series.
TARGET_LABELS = {"namespace", "pod", "instance", "job", "container", "service", "endpoint"}

_SERIES = re.compile(r"\b(wehub_ps_[a-z0-9_]+)")
_RANGE_FUNCS = ("rate", "irate", "increase")


def _series_base(series: str) -> tuple[str | None, str]:
    """(metric, suffix) for a series name; metric None if unknown."""
    if series in METRICS:
        return series, ""
    for suffix in ("_bucket", "_sum", "_count"):
        if series.endswith(suffix) and METRICS.get(series[: -len(suffix)], ("",))[0] == "histogram":
            return series[: -len(suffix)], suffix
    return None, ""


def iter_panels(panels: list[dict]) -> Iterator[dict]:
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels") or [])


def dashboard_problems(dashboard: dict) -> list[str]:
    problems = []
    if not dashboard.get("title") or not dashboard.get("uid"):
        problems.append("the dashboard needs a title and a uid")
    variables = {v.get("name") for v in (dashboard.get("templating") or {}).get("list") or []}
    if "datasource" not in variables:
        problems.append("no datasource template variable: the dashboard is tied to one Prometheus")
    used: set[str] = set()
    ids = []
    for panel in iter_panels(dashboard.get("panels") or []):
        if panel.get("type") == "row":
            continue
        title = panel.get("title") or f"panel {panel.get('id')}"
        ids.append(panel.get("id"))
        if not panel.get("targets"):
            problems.append(f"{title}: no queries")
        ds = panel.get("datasource") or {}
        if (ds.get("uid") if isinstance(ds, dict) else ds) != "${datasource}":
            problems.append(f"{title}: datasource is not ${{datasource}}")
        for target in panel.get("targets") or []:
            expr = str(target.get("expr") or "")
            problems += [f"{title}: {p}" for p in promql_problems(expr, variables)]
            for series in _SERIES.findall(expr):
                metric, _ = _series_base(series)
                if metric:
                    used.add(metric)
    if len(ids) != len(set(ids)):
        problems.append("panel ids are not unique")
    for metric in METRICS:
        if metric not in used:
            problems.append(f"no panel shows {metric}")
    return problems


def promql_problems(expr: str, variables: set[str]) -> list[str]:
    problems = []
    if not expr.strip():
        return ["empty query"]
    depth = 0
    for ch in expr:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0:
            break
    if depth != 0 or expr.count("{") != expr.count("}") or expr.count("[") != expr.count("]"):
        problems.append(f"unbalanced brackets in {expr!r}")
    for var in re.findall(r"\$\{?(\w+)", expr):
        if var not in variables and not var.startswith("__"):
            problems.append(f"{expr!r} uses ${var}, which is not a template variable")
    for series in _SERIES.findall(expr):
        metric, suffix = _series_base(series)
        if metric is None:
            problems.append(f"{series} is not a metric ps-server exports")
            continue
        kind, labels = METRICS[metric]
        # Functions applied to this series.
        for func in _RANGE_FUNCS:
            if re.search(rf"\b{func}\(\s*{re.escape(series)}\b", expr) and kind == "gauge":
                problems.append(f"{func}() of the gauge {series}")
        if kind == "histogram" and suffix == "" :
            problems.append(f"{series} is a histogram: query {series}_bucket, _sum or _count")
        if kind == "counter" and not re.search(rf"\b({'|'.join(_RANGE_FUNCS)})\(\s*{re.escape(series)}\b", expr):
            problems.append(f"the counter {series} is shown without rate() / increase()")
        if suffix == "_bucket" and "histogram_quantile" not in expr and "le" not in expr:
            problems.append(f"{series} without histogram_quantile or le")
        allowed = labels | TARGET_LABELS | ({"le"} if suffix == "_bucket" else set())
        for match in re.finditer(rf"{re.escape(series)}\s*\{{([^}}]*)\}}", expr):
            for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", match.group(1)):
                if label not in allowed:
                    problems.append(f"{series} has no label {label!r}")
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        for label in (g.strip() for g in group.split(",") if g.strip()):
            known = TARGET_LABELS | {"le"} | set().union(*(m[1] for m in METRICS.values()))
            if label not in known:
                problems.append(f"grouping by unknown label {label!r}")
    return problems
