"""The Grafana dashboards the chart ships query only metrics and labels that really exist.

Every ``charts/epd-operator/dashboards/*.json`` (the chart renders each one into a ConfigMap
for the Grafana sidecar) is checked against the registries of the real
``epd_engine.metrics.Metrics`` and of the reconcile loop's ``LoopMetrics``: each ``epd_*``
series a query names must be a sample a registry exports (``_total`` of a counter,
``_bucket``/``_sum``/``_count`` of a histogram, ``_info`` of an info metric, a gauge's own
name), and each label in a ``{...}`` selector, a ``by (...)``/``without (...)`` clause or a
``label_values(...)`` variable must be one that series carries, or one Prometheus adds when
it scrapes the target.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.metrics import MetricWrapperBase

from epd_engine.metrics import Metrics
from epd_operator.rollout.loop_metrics import LoopMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "charts" / "epd-operator" / "dashboards"
# Labels Prometheus attaches to every series of a target scraped through the chart's
# ServiceMonitor (Prometheus-Operator), on top of the labels the app exports.
TARGET_LABELS = frozenset(
    {"namespace", "pod", "service", "endpoint", "container", "instance", "job"}
)
# Each ConfigMap holds one dashboard and must stay under 1 MiB; keep room for the metadata.
MAX_BYTES = 900 * 1024
# What the reconcile loop exports only once an Auto re-plan decided: absent in Fixed mode.
AUTO_ONLY = ("epd_loop_rate_", "epd_loop_decisions_")
# Exported metric families no dashboard has to chart (none so far).
UNCHARTED: frozenset[str] = frozenset()

AGGREGATIONS = "sum|avg|min|max|count|group|stddev|stdvar|topk|bottomk|quantile|count_values|limitk"
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_METRIC = re.compile(r"\b(epd_[a-z0-9_]+)\b")
_SELECTOR = re.compile(r"\b(epd_[a-z0-9_]+)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*[\"'`]")
_AGG_PREFIX = re.compile(
    rf"\b(?:{AGGREGATIONS})\s*(?:(?:by|without)\s*\(([^)]*)\)\s*)?\(", re.IGNORECASE
)
_AGG_SUFFIX = re.compile(r"\s*(?:by|without)\s*\(([^)]*)\)", re.IGNORECASE)
_GROUPING = re.compile(r"\b(?:by|without)\s*\(", re.IGNORECASE)
_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*$")


def registries() -> list[Metrics | LoopMetrics]:
    """The engine's and the loop's metrics, each in its own registry."""
    return [Metrics(model="m", role="r", pool="p"), LoopMetrics(CollectorRegistry())]


def exported_series() -> dict[str, frozenset[str]]:
    """Sample name -> its label names, from real registries with one child each."""
    series: dict[str, set[str]] = {}
    for metrics in registries():
        for name, labels in _series(metrics).items():
            series.setdefault(name, set()).update(labels)
    return {name: frozenset(labels) for name, labels in series.items()}


def _series(metrics: Metrics | LoopMetrics) -> dict[str, set[str]]:
    for wrapper in vars(metrics).values():
        if not isinstance(wrapper, MetricWrapperBase):
            continue
        child = wrapper.labels(**{name: "x" for name in wrapper._labelnames})
        if isinstance(child, Histogram):
            child.observe(1.0)
        elif isinstance(child, Counter):
            child.inc()
        elif isinstance(child, Gauge):
            child.set(1.0)
        elif isinstance(child, Info):
            child.info({})
        else:  # a new metric type: teach this helper how to give it a sample
            raise AssertionError(f"unhandled metric type {type(child).__name__}")
    series: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        assert family.samples, f"{family.name} has no sample: not an attribute of Metrics?"
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def family_series() -> dict[str, frozenset[str]]:
    """Family name (as in metrics.py) -> the sample names it exports."""
    families: dict[str, frozenset[str]] = {}
    for family in (f for m in registries() for f in m.registry.collect()):
        suffixes = {
            "counter": ("_total",),
            "histogram": ("_bucket", "_sum", "_count"),
            "info": ("_info",),
            "gauge": ("",),
        }[family.type]
        families[family.name] = frozenset(family.name + s for s in suffixes)
    return families


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


def load(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text(encoding="utf-8"))
    assert isinstance(data, dict), f"{path.name}: a dashboard is a JSON object"
    return data


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target, every query template variable and every
    Prometheus annotation."""
    for panel in all_panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            if "expr" in target:
                yield f"panel {panel.get('title')!r} target {target.get('refId')}", target["expr"]
    for note in dashboard.get("annotations", {}).get("list", []):
        if "expr" in note:
            yield f"annotation {note['name']!r}", note["expr"]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]
            yield f"variable ${var['name']}", query if isinstance(query, str) else query["query"]


def absent_on_cpu(dashboard: dict[str, Any]) -> set[str]:
    """Titles of the panels whose series exist only on a GPU (their description says so)."""
    return {
        panel["title"]
        for panel in all_panels(dashboard.get("panels", []))
        if "absent on cpu" in panel.get("description", "").lower()
    }


def auto_only(expr: str) -> bool:
    """The query names only series the loop exports once an Auto re-plan decided."""
    names = set(_METRIC.findall(_STRING.sub('""', expr)))
    return bool(names) and all(name.startswith(AUTO_ONLY) for name in names)


def matching_paren(text: str, open_at: int) -> int:
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    raise AssertionError(f"unbalanced parentheses in {text!r}")


def label_list(text: str) -> set[str]:
    return {label.strip() for label in text.split(",") if label.strip()}


def problems(expr: str, series: dict[str, frozenset[str]]) -> list[str]:
    """What in one PromQL expression names a series or label that is not exported."""
    found: list[str] = []
    match = _LABEL_VALUES.match(expr)
    if match:  # label_values(<selector>, <label>): the label must be on that selector's series
        inner, label = match.groups()
        for name in set(_METRIC.findall(_STRING.sub('""', inner))):
            if name in series and label not in series[name] | TARGET_LABELS:
                found.append(f"label {label!r} is not a label of {name}")
        expr = inner
    bare = _STRING.sub('""', expr)
    for name in sorted(set(_METRIC.findall(bare))):
        if name not in series:
            found.append(f"{name} is not exported by epd_engine.metrics.Metrics")
    for name, body in _SELECTOR.findall(expr):
        for label in _MATCHER.findall(body):
            if name in series and label not in series[name] | TARGET_LABELS:
                found.append(f"label {label!r} in a selector is not a label of {name}")
    assert not re.search(r"\b(on|ignoring)\s*\(", bare), "vector matching: extend this test"
    groupings = 0
    for agg in _AGG_PREFIX.finditer(bare):
        close = matching_paren(bare, agg.end() - 1)
        argument = bare[agg.end() : close]
        suffix = _AGG_SUFFIX.match(bare, close + 1)
        labels = label_list(agg.group(1) or (suffix.group(1) if suffix else ""))
        groupings += bool(agg.group(1) is not None or suffix)
        names = {n for n in _METRIC.findall(argument) if n in series}
        for name in sorted(names):
            for label in sorted(labels - series[name] - TARGET_LABELS):
                found.append(f"label {label!r} in a grouping is not a label of {name}")
        if names and all(n.endswith("_bucket") for n in names) and "le" not in labels:
            found.append(f"buckets of {sorted(names)} aggregated without keeping 'le'")
    if groupings != len(_GROUPING.findall(bare)):
        found.append("a by/without clause outside an aggregation this test understands")
    return found


def test_there_is_a_dashboard() -> None:
    assert "epd-overview.json" in [p.name for p in dashboard_files()]


@pytest.mark.parametrize("path", dashboard_files(), ids=lambda p: p.name)
def test_dashboard_is_valid_grafana_json(path: Path) -> None:
    assert path.stat().st_size < MAX_BYTES, "the ConfigMap holding it must stay under 1 MiB"
    assert re.fullmatch(r"[-._a-zA-Z0-9]+", path.name), "file name is a ConfigMap data key"
    dashboard = load(path)
    assert dashboard["uid"] and len(dashboard["uid"]) <= 40
    assert dashboard["title"]
    assert "__inputs" not in dashboard, "the sidecar provisions as-is: no import-time inputs"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = list(all_panels(dashboard["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert target["expr"].strip(), panel["title"]
    for var in variables.values():
        if var["type"] == "query":
            assert var["datasource"]["uid"] == "${datasource}", var["name"]


def test_uids_and_titles_are_unique() -> None:
    dashboards = [load(p) for p in dashboard_files()]
    uids = [d["uid"] for d in dashboards]
    titles = [d["title"] for d in dashboards]
    assert len(uids) == len(set(uids))
    assert len(titles) == len(set(titles))


@pytest.mark.parametrize("path", dashboard_files(), ids=lambda p: p.name)
def test_queries_use_only_exported_metrics_and_labels(path: Path) -> None:
    series = exported_series()
    found = [
        f"{where}: {problem}"
        for where, expr in queries(load(path))
        for problem in problems(expr, series)
    ]
    assert not found, "\n".join(found)


def test_every_exported_metric_is_charted() -> None:
    used = {
        name
        for path in dashboard_files()
        for _, expr in queries(load(path))
        for name in _METRIC.findall(_STRING.sub('""', expr))
    }
    uncharted = {
        family
        for family, samples in family_series().items()
        if not samples & used and family not in UNCHARTED
    }
    assert not uncharted, f"no dashboard panel charts {sorted(uncharted)}"


@pytest.mark.parametrize("path", dashboard_files(), ids=lambda p: p.name)
def test_gpu_panels_say_they_are_absent_on_cpu(path: Path) -> None:
    """A GPU series is absent on a CPU deployment: the panel says so in its description and
    shows that text instead of "No data" (the Prometheus live test allows them no data)."""
    dashboard = load(path)
    marked = absent_on_cpu(dashboard)
    for panel in all_panels(dashboard["panels"]):
        exprs = " ".join(t.get("expr", "") for t in panel.get("targets", []))
        if "epd_gpu_" not in exprs:
            assert panel["title"] not in marked, f"{panel['title']!r} charts no GPU series"
            continue
        assert panel["title"] in marked, panel["title"]
        assert "absent on CPU" in panel["fieldConfig"]["defaults"]["noValue"], panel["title"]


def test_checker_catches_wrong_names_and_labels() -> None:
    series = exported_series()
    ok = 'histogram_quantile(0.9, sum by (le, stage) (rate(epd_stage_queue_seconds_bucket{role="router"}[5m])))'  # noqa: E501
    assert problems(ok, series) == []
    assert problems("sum(rate(epd_slo_met[5m]))", series)  # counter without _total
    assert problems("rate(epd_request_ttft_seconds[5m])", series)  # histogram without suffix
    assert problems("sum(rate(epd_requests_total{stage='x'}[5m]))", series)
    assert problems('sum(rate(epd_requests_total{stage="x"}[5m]))', series)
    assert problems("sum by (kind) (rate(epd_requests_total[5m]))", series)
    assert problems("sum(rate(epd_requests_total[5m])) by (cache)", series)
    assert problems("histogram_quantile(0.9, sum(rate(epd_batch_tokens_bucket[5m])))", series)
    assert problems("label_values(epd_requests_running, outcome)", series)
    assert problems("label_values(epd_requests_total, namespace)", series) == []


@pytest.mark.parametrize("path", dashboard_files(), ids=lambda p: p.name)
def test_auto_only_panels_say_they_are_absent_in_fixed_mode(path: Path) -> None:
    """The loop's rates and decisions exist once an Auto re-plan decided: a panel charting
    them says so (the Prometheus live test, a Fixed deployment, requires them absent)."""
    dashboard = load(path)
    for panel in all_panels(dashboard["panels"]):
        exprs = [t["expr"] for t in panel.get("targets", []) if "expr" in t]
        if not any(auto_only(e) for e in exprs):
            assert "fixed mode" not in panel.get("description", "").lower(), panel["title"]
            continue
        assert "Absent in Fixed mode" in panel["description"], panel["title"]
        assert "absent in Fixed mode" in panel["fieldConfig"]["defaults"]["noValue"]
    for note in dashboard.get("annotations", {}).get("list", []):
        if note.get("type") != "dashboard":
            assert note["datasource"]["uid"] == "${datasource}", note["name"]
