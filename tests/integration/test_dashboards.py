"""The monitoring files name only what ``/metrics`` exports.

A real server (tiny model, 127.0.0.1) is scraped after one request per transport and one
failed publish, and its exposition is parsed; every PromQL query of the Grafana dashboard, the
alert rules and the prometheus-adapter rule is parsed with ``promql_parser`` (a real PromQL
parser: a malformed query fails), and the metric and label names they use must be exported.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from oldlogit import Client
from oldlogit.contract.errors import OldLogitError

try:
    import promql_parser as promql
except ImportError:  # pragma: no cover - the dev extra installs it
    if os.environ.get("CI"):
        raise
    pytest.skip("needs promql-parser (the dev extra)", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana-dashboard.json"
ALERTS = MONITORING / "prometheus-rules.yaml"
ADAPTER = MONITORING / "prometheus-adapter-rules.yaml"
HPA = REPO / "deploy" / "k8s" / "base" / "hpa.yaml"

# Labels Prometheus attaches to every scraped series (the target's), not the exporter.
TARGET_LABELS = {"instance", "job", "namespace", "pod"}
# Stand-ins for Grafana variables and prometheus-adapter templates, so the query parses.
_STANDINS = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
    "$instance": ".*",
    "<<.LabelMatchers>>": 'namespace="ns",pod="p"',
    "<<.GroupBy>>": "pod",
}


@dataclass
class Exported:
    names: set[str] = field(default_factory=set)  # sample names: x_total, x_bucket, ...
    labels: set[str] = field(default_factory=set)


@dataclass
class Used:
    names: set[str] = field(default_factory=set)
    labels: set[str] = field(default_factory=set)


def promql_uses(expr: str) -> Used:
    """Metric and label names a query uses, from its parsed syntax tree."""
    for k, v in _STANDINS.items():
        expr = expr.replace(k, v)
    m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\)\s*", expr)  # Grafana's, not PromQL
    if m:
        used = promql_uses(m.group(1))
        used.labels.add(m.group(2))
        return used
    used = Used()

    def visit(node: Any) -> None:
        if isinstance(node, promql.VectorSelector):
            if node.name:
                used.names.add(node.name)
            for matcher in node.matchers.matchers:
                if matcher.name == "__name__":
                    used.names.add(matcher.value)
                else:
                    used.labels.add(matcher.name)
        modifier = getattr(node, "modifier", None)
        if isinstance(node, promql.AggregateExpr) and modifier is not None:
            used.labels.update(modifier.labels)
        matching = getattr(modifier, "matching", None)  # on (...) / ignoring (...)
        if isinstance(node, promql.BinaryExpr) and matching is not None:
            used.labels.update(matching.labels)

    promql.walk(promql.parse(expr), pre_visit=visit)
    return used


def _dashboard_queries(dash: dict[str, Any]) -> Iterator[tuple[str, str]]:
    def panels(ps: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for p in ps:
            yield p
            yield from panels(p.get("panels", []))

    for p in panels(dash["panels"]):
        for t in p.get("targets", []):
            yield p["title"], t["expr"]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]
            yield f"variable {var['name']}", q["query"] if isinstance(q, dict) else q


def _alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def _adapter_rules() -> list[dict[str, Any]]:
    return list(yaml.safe_load(ADAPTER.read_text())["rules"])


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Exported:
    from prometheus_client.parser import text_string_to_metric_families

    from oldlogit_service.config import Settings
    from oldlogit_service.server import ServerThread

    tmp = tmp_path_factory.mktemp("dash")
    settings = Settings(
        model=tiny_model_dir, snapshot_dir=tmp / "snap", http_port=0, grpc_port=0, dtype="float32"
    )
    with ServerThread(settings) as srv:
        for url in (srv.http_url, srv.grpc_url):
            with Client(url) as c:
                c.logprobs(list(range(1, 20)), policy_version=0, score_from=4)
                c.logprobs(list(range(1, 20)), policy_version=0, score_from=4)  # a cache hit
        with Client(srv.http_url) as c, pytest.raises(OldLogitError):
            c.publish(1, {"no.such.weight": np.zeros(2, np.float32)})  # a refused publish
        text = httpx.get(f"{srv.http_url}/metrics").text
    out = Exported()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.names.add(s.name)
            out.labels.update(s.labels)
    return out


def test_the_scrape_is_what_the_checks_compare_against(exported: Exported) -> None:
    # If the scrape were empty every "subset" assertion below would pass vacuously.
    for name in (
        "oldlogit_queue_wait_seconds_bucket",
        "oldlogit_requests_total",
        "oldlogit_tier_bytes",
        "oldlogit_newest_resident_version",
    ):
        assert name in exported.names
    assert {"tier", "code", "route", "le"} <= exported.labels


def test_promql_uses_finds_names_and_labels_and_rejects_typos(exported: Exported) -> None:
    used = promql_uses(
        "histogram_quantile(0.9, sum by (le) (rate(oldlogit_queue_wait_seconds_bucket"
        '{instance=~"$instance"}[$__rate_interval]))) / on (instance) oldlogit_ready{tier!="x"}'
    )
    assert used.names == {"oldlogit_queue_wait_seconds_bucket", "oldlogit_ready"}
    assert used.labels == {"le", "instance", "tier"}
    assert promql_uses("rate(oldlogit_tokenz_total[5m])").names - exported.names == {
        "oldlogit_tokenz_total"
    }
    with pytest.raises(ValueError):
        promql_uses("sum(rate(oldlogit_tokens_total[5m])")  # unbalanced: the parser says so


def test_dashboard_queries_name_only_exported_metrics(exported: Exported) -> None:
    dash = json.loads(DASHBOARD.read_text())
    queries = list(_dashboard_queries(dash))
    assert len(queries) >= 20
    used_everywhere: set[str] = set()
    for where, expr in queries:
        used = promql_uses(expr)
        assert used.names, f"{where}: {expr} names no metric"
        assert used.names <= exported.names, f"{where}: not exported: {used.names - exported.names}"
        unknown_labels = used.labels - exported.labels - TARGET_LABELS
        assert not unknown_labels, f"{where}: labels not exported: {unknown_labels}"
        used_everywhere |= used.names
    # What the issue asks the dashboard to show.
    for name in (
        "oldlogit_queue_wait_seconds_bucket",  # queue wait
        "oldlogit_cache_hits_total",  # cache hit rate
        "oldlogit_cache_misses_total",
        "oldlogit_evictions_total",  # evictions
        "oldlogit_tier_bytes",  # bytes per tier vs budget
        "oldlogit_tier_budget_bytes",
        "oldlogit_publishes_total",  # publish failures
        "oldlogit_newest_version",  # lag: newest published vs newest resident
        "oldlogit_newest_resident_version",
    ):
        assert name in used_everywhere, name


def test_dashboard_layout_is_valid(exported: Exported) -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "oldlogit" and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        covered = {(g["y"] + dy, g["x"] + dx) for dy in range(g["h"]) for dx in range(g["w"])}
        assert not covered & cells, f"{p['title']} overlaps another panel"
        cells |= covered
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]


def test_alert_rules_name_only_exported_metrics(exported: Exported) -> None:
    rules = _alert_rules()
    assert len(rules) >= 8
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for r in rules:
        assert r["labels"]["severity"] in {"page", "warning"}, r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
        used = promql_uses(r["expr"])
        assert used.names and used.names <= exported.names, (r["alert"], used.names)
        assert not used.labels - exported.labels - TARGET_LABELS, (r["alert"], used.labels)


def test_hpa_metric_is_served_by_the_adapter_rule(exported: Exported) -> None:
    hpa = yaml.safe_load(HPA.read_text())
    (metric,) = hpa["spec"]["metrics"]
    served = {r["name"]["as"]: r for r in _adapter_rules()}
    rule = served[metric["pods"]["metric"]["name"]]
    for expr in (rule["seriesQuery"], rule["metricsQuery"]):
        used = promql_uses(expr)
        assert used.names and used.names <= exported.names, used.names
    # The name the rule matches is the series it queries.
    assert re.fullmatch(rule["name"]["matches"], "oldlogit_queue_wait_seconds_count")
