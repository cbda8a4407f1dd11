"""The Grafana dashboard (docs/grafana/llamaswap.json) against a real ``/metrics`` scrape.

The dashboard's JSON is checked for what a Grafana import needs (a ``${DS_PROMETHEUS}``
input, panels with targets, unique ids, a grid without overlaps, defined variables). Then
every metric name its PromQL names, in panel targets and in template variables, must be a
sample name in the scrape of a real server (``manage.py serve`` with one simulated model)
that has served a couple of requests, and every label it matches, groups by or shows in a
legend must be a label of those samples. Histogram queries name the exposed sample names
(``_bucket``, ``_sum``, ``_count``) and those must come from histogram families.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server import Server, chat, fake_model, free_port_block, serve

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD_PATH = ROOT / "docs" / "grafana" / "llamaswap.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}

# What the dashboard has to show: the spec's four scheduler metrics, swaps and load times
# per model, request durations and queue waits (histograms: their bucket series).
REQUIRED = {
    "llamaswap_scheduler_queue_depth",
    "llamaswap_scheduler_queue_oldest_wait_seconds",
    "llamaswap_scheduler_dispatched_total",
    "llamaswap_scheduler_reorders_total",
    "llamaswap_model_swaps_total",
    "llamaswap_model_load_duration_seconds_bucket",
    "llamaswap_request_duration_seconds_bucket",
    "llamaswap_scheduler_queue_wait_seconds_bucket",
}

# PromQL words that look like identifiers but are not metric names (functions are
# recognised by the parenthesis that follows them, aggregation modifiers are cut first).
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "atan2"}

STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
SELECTOR = re.compile(r"([A-Za-z_:][\w:]*)\s*\{([^}]*)\}")
MATCHER_LABEL = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
IDENTIFIER = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(?!\s*\(|[\w:])")
VARIABLE = re.compile(r"\$\{?(\w+)")
LABEL_VALUES = re.compile(r"label_values\(\s*([A-Za-z_:][\w:]*)\s*(?:\{[^}]*\})?\s*,\s*(\w+)\s*\)")
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def load_dashboard() -> dict:
    return json.loads(DASHBOARD_PATH.read_text())


def all_panels(dashboard: dict) -> list[dict]:
    """Every panel, rows' nested (collapsed) panels included."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def query_panels(dashboard: dict) -> list[dict]:
    return [p for p in all_panels(dashboard) if p["type"] != "row"]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects."""
    text = STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges, subqueries
    text = GROUPING.sub("", text)  # by (...), on (...), ...
    return {m for m in IDENTIFIER.findall(text) if m.lower() not in KEYWORDS}


def selector_labels(expr: str) -> dict[str, set[str]]:
    """{metric: label names its matchers use}."""
    out: dict[str, set[str]] = {}
    for name, matchers in SELECTOR.findall(STRING.sub('""', expr)):
        out.setdefault(name, set()).update(MATCHER_LABEL.findall(matchers))
    return out


def grouping_labels(expr: str) -> set[str]:
    labels: set[str] = set()
    for _, inside in GROUPING.findall(STRING.sub('""', expr)):
        labels.update(label.strip() for label in inside.split(",") if label.strip())
    return labels


def targets(dashboard: dict) -> Iterator[tuple[dict, dict]]:
    for panel in query_panels(dashboard):
        for target in panel["targets"]:
            yield panel, target


def variable_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(metric, label) of every ``label_values`` template variable."""
    out = []
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        match = LABEL_VALUES.fullmatch(query.strip())
        assert match, f"variable {var['name']}: not a label_values query: {query}"
        out.append((match[1], match[2]))
    return out


# -- the extraction itself -----------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('sum by (band) (rate(foo_total{band=~"$band"}[5m]))', {"foo_total"}),
        (
            "histogram_quantile(0.95, sum by (le, band) (rate(x_bucket{a='b c'}[$__range])))",
            {"x_bucket"},
        ),
        ("sum(rate(a_sum[5m])) / sum(rate(a_count[5m])) > bool 1e3", {"a_sum", "a_count"}),
        ("a and on (x) b offset 5m or c unless d", {"a", "b", "c", "d"}),
        ('max without (instance) (up{job="x"}) * ignoring (y) group_left (z) info', {"up", "info"}),
    ],
)
def test_metric_name_extraction(expr, names):
    assert metric_names(expr) == names


# -- Grafana import basics -----------------------------------------------------------


def test_dashboard_imports_cleanly():
    dashboard = load_dashboard()
    assert dashboard["title"] and dashboard["uid"]
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert dashboard.get("id") is None  # Grafana assigns it on import
    # One datasource input, and every reference goes through it.
    [ds_input] = dashboard["__inputs"]
    assert ds_input["name"] == "DS_PROMETHEUS"
    assert (ds_input["type"], ds_input["pluginId"]) == ("datasource", "prometheus")
    assert set(re.findall(r"\$\{(DS_\w+)\}", DASHBOARD_PATH.read_text())) == {"DS_PROMETHEUS"}

    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert all(isinstance(i, int) for i in ids) and len(ids) == len(set(ids))

    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:  # top level: the grid Grafana lays out
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["h"] > 0 and pos["x"] + pos["w"] <= 24
        mine = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not cells & mine, f"panel {panel['title']!r} overlaps another"
        cells |= mine

    defined = {var["name"] for var in dashboard["templating"]["list"]}
    used: set[str] = set()
    for panel in query_panels(dashboard):
        assert panel["title"] and panel["type"] in {"timeseries", "bargauge", "stat", "table"}
        assert panel["datasource"] == DATASOURCE
        assert panel["fieldConfig"]["defaults"].get("unit"), panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no targets"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids))
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE
            assert target["expr"].strip()
            assert target["expr"].count("(") == target["expr"].count(")")
            used |= {v for v in VARIABLE.findall(target["expr"]) if not v.startswith("__")}
    for var in dashboard["templating"]["list"]:
        assert var["datasource"] == DATASOURCE
    assert used <= defined, f"undefined variables: {used - defined}"
    assert "band" in defined and used == defined  # no variable left unused

    # Seconds are shown as seconds, rates as per-second values.
    for panel in query_panels(dashboard):
        unit = panel["fieldConfig"]["defaults"]["unit"]
        exprs = [t["expr"] for t in panel["targets"]]
        if all(in_seconds(e) for e in exprs):
            assert unit == "s", panel["title"]
        elif all("rate(" in e and "increase(" not in e for e in exprs):
            assert unit in {"reqps", "ops"}, panel["title"]


def in_seconds(expr: str) -> bool:
    """A quantile of a seconds histogram, a mean (_sum / _count) of one, or a seconds gauge."""
    names = metric_names(expr)
    return (expr.startswith("histogram_quantile(") and any("_seconds_" in n for n in names)) or any(
        n.endswith(("_seconds", "_seconds_sum")) for n in names
    )


def test_dashboard_covers_the_scheduler_metrics():
    dashboard = load_dashboard()
    named = set().union(*(metric_names(t["expr"]) for _, t in targets(dashboard)))
    assert named >= REQUIRED, f"missing: {REQUIRED - named}"
    assert all(name.startswith("llamaswap_") for name in named), named
    # Per band: depth, oldest wait, dispatches, reorders (and by term), durations.
    by_metric: dict[str, set[str]] = {}
    for _, target in targets(dashboard):
        for name in metric_names(target["expr"]):
            by_metric.setdefault(name, set()).update(grouping_labels(target["expr"]))
    for name in (
        "llamaswap_scheduler_queue_depth",
        "llamaswap_scheduler_queue_oldest_wait_seconds",
        "llamaswap_scheduler_dispatched_total",
        "llamaswap_scheduler_queue_wait_seconds_bucket",
        "llamaswap_request_duration_seconds_bucket",
    ):
        assert "band" in by_metric[name], name
    assert {"band", "term"} <= by_metric["llamaswap_scheduler_reorders_total"]
    assert "model" in by_metric["llamaswap_model_swaps_total"]
    assert "model" in by_metric["llamaswap_model_load_duration_seconds_bucket"]


# -- against a real scrape -----------------------------------------------------------


@pytest.fixture(scope="module")
def scrape(tmp_path_factory) -> dict:
    """{sample name: (family type, set of label names)} from a real server's /metrics,
    after two requests (one of them interactive) so every histogram has observations."""
    tmp = tmp_path_factory.mktemp("grafana")
    port = free_port_block(1)
    with serve(tmp, {"m": fake_model(port)}) as server:
        send(server, None)
        send(server, "interactive")
        r = httpx.get(server.url + "/metrics", timeout=5)
    assert r.status_code == 200
    samples: dict[str, tuple[str, set[str]]] = {}
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            _, labels = samples.setdefault(sample.name, (family.type, set()))
            labels.update(sample.labels)
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    # The traffic reached the histograms the dashboard reads.
    for name in (
        "llamaswap_request_duration_seconds_count",
        "llamaswap_scheduler_queue_wait_seconds_count",
        "llamaswap_model_load_duration_seconds_count",
        "llamaswap_scheduler_dispatched_total",
    ):
        assert values.get(name, 0) >= 1, (name, values.get(name))
    return samples


def send(server: Server, priority: str | None) -> None:
    headers = {"X-LlamaSwap-Priority": priority} if priority else {}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat("m"), headers=headers, timeout=20)
    assert r.status_code == 200, r.text


def test_every_dashboard_metric_is_in_a_real_scrape(scrape):
    dashboard = load_dashboard()
    for panel, target in targets(dashboard):
        expr = target["expr"]
        names = metric_names(expr)
        where = f"panel {panel['title']!r} {target['refId']}: {expr}"
        assert names, where
        missing = names - set(scrape)
        assert not missing, f"{where}\n  not in /metrics: {sorted(missing)}"
        for name in names:
            kind, _ = scrape[name]
            if name.endswith("_bucket"):
                assert kind == "histogram", (where, name, kind)
            if name.endswith(("_sum", "_count")):
                assert kind in {"histogram", "summary"}, (where, name, kind)
        if "histogram_quantile(" in expr:
            assert any(name.endswith("_bucket") for name in names), where
            assert "le" in grouping_labels(expr), where
        # Matched, grouped and shown labels are labels those samples have.
        for name, labels in selector_labels(expr).items():
            assert labels <= scrape[name][1], (where, name, labels - scrape[name][1])
        available = set().union(*(scrape[name][1] for name in names))
        grouped = grouping_labels(expr)
        assert grouped <= available, (where, grouped - available)
        shown = set(LEGEND_LABEL.findall(target.get("legendFormat", "")))
        assert shown <= grouped, (where, shown - grouped)
    for name, label in variable_queries(dashboard):
        assert name in scrape, f"template variable metric {name} not in /metrics"
        assert label in scrape[name][1], (name, label)
