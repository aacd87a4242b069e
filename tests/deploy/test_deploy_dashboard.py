"""The Grafana dashboard queries exactly the metrics ps-server exports, each
in a way that makes sense for its type."""

from __future__ import annotations

import ast
import copy
import json

import pytest
from deploy_tools.availability import require

require("yaml", "PyYAML")

from deploy_tools.manifests.grafana_dashboard import METRICS, dashboard_problems, iter_panels  # noqa: E402
from deploy_tools.manifests.kustomize import DEPLOY, REPO  # noqa: E402

DASHBOARD = DEPLOY / "grafana" / "dashboard.json"


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_queries_every_metric_correctly():
    assert dashboard_problems(dashboard()) == []


METRICS_SOURCE = REPO / "ps_server" / "ops" / "metrics.py"


def declared_metrics(source: str) -> dict[str, tuple[str, set[str]]]:
    """{series name: (type, labels)} as a prometheus_client module declares them."""
    from ps_server.ops.metrics import VariableOutcomeCounter

    found = {}
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "VariableOutcomeCounter" and isinstance(node.args[0], ast.Constant)):
            # Our own collector of counters with fixed labels (ps_server.ops.metrics).
            found[node.args[0].value + "_total"] = ("counter", set(VariableOutcomeCounter.LABELS))
            continue
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "CountHistogram" and isinstance(node.args[0], ast.Constant)):
            found[node.args[0].value] = ("histogram", set())  # our own unlabelled histogram collector
            continue
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("Counter", "Gauge", "Histogram", "Summary")):
            continue
        if not (node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            continue
        name = node.args[0].value
        labels_node = node.args[2] if len(node.args) > 2 else next(
            (k.value for k in node.keywords if k.arg == "labelnames"), None)
        labels = set(ast.literal_eval(labels_node)) if labels_node is not None else set()
        kind = node.func.id.lower()
        if kind == "counter" and not name.endswith("_total"):
            name += "_total"  # prometheus_client exposes counters with _total
        found[name] = (kind, labels)
    return found


def exported_source() -> str:
    assert METRICS_SOURCE.is_file(), f"the server's metrics module is not at {METRICS_SOURCE}"
    return METRICS_SOURCE.read_text()


def test_dashboard_metrics_are_the_ones_the_server_exports():
    assert declared_metrics(exported_source()) == METRICS


# --- the check can fail ----------------------------------------------------


def _first_target(dash):
    for panel in iter_panels(dash["panels"]):
        if panel.get("targets"):
            return panel["targets"][0]
    raise AssertionError("no query")


@pytest.mark.parametrize("expr, expected", [
    ('sum(rate(wehub_ps_push_total[5m]))', "wehub_ps_push_total is not a metric"),
    ('sum(wehub_ps_pushes_total)', "shown without rate()"),
    ('rate(wehub_ps_live_workers[5m])', "rate() of the gauge"),
    ('wehub_ps_apply_seconds', "is a histogram"),
    ('sum by (shard) (rate(wehub_ps_pulls_total[5m]))', "unknown label 'shard'"),
    ('rate(wehub_ps_bytes_sent_total{variable="w"}[5m])', "has no label 'variable'"),
    ('sum(rate(wehub_ps_pushes_total{pod=~"$shard"}[5m]))', "$shard, which is not a template variable"),
    ('sum(rate(wehub_ps_pushes_total[5m])', "unbalanced brackets"),
])
def test_dashboard_check_reports_a_bad_query(expr, expected):
    dash = copy.deepcopy(dashboard())
    _first_target(dash)["expr"] = expr
    problems = dashboard_problems(dash)
    assert any(expected in p for p in problems), problems


def test_dashboard_check_reports_a_missing_metric_and_a_fixed_datasource():
    dash = copy.deepcopy(dashboard())
    dash["panels"] = [p for p in dash["panels"] if "wehub_ps_restored_version" not in json.dumps(p)]
    next(p for p in dash["panels"] if p.get("targets"))["datasource"] = {"type": "prometheus", "uid": "prom-1"}
    problems = dashboard_problems(dash)
    assert "no panel shows wehub_ps_restored_version" in problems, problems
    assert any("datasource is not ${datasource}" in p for p in problems), problems


def test_metric_comparison_reports_a_renamed_or_relabelled_metric():
    source = exported_source()
    renamed = source.replace('"wehub_ps_checkpoint_age_seconds"', '"wehub_ps_checkpoint_age"')
    assert renamed != source
    assert declared_metrics(renamed) != METRICS
    relabelled = source.replace('["variable"]', '["name"]', 1)
    assert relabelled != source
    assert declared_metrics(relabelled) != METRICS
