"""The docs of the metrics cannot drift from the code: the README's table and the Grafana
dashboard's queries are checked against the catalog (``clusterwire.metrics.catalog``)."""

from __future__ import annotations

import json
import pathlib
import re

from clusterwire.metrics.catalog import CATALOG, markdown_table

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DASHBOARD = ROOT / "examples" / "grafana" / "clusterwire.json"
START, END = "<!-- metrics-table:start -->", "<!-- metrics-table:end -->"

#: Labels Prometheus puts on every scraped series; a metric's own label of one of these names
#: shows as ``exported_<name>``.
TARGET_LABELS = ("job", "instance")


def _series() -> dict[str, tuple[str, ...]]:
    """Every series name a scrape shows, with its labels (a histogram's _bucket, _sum, _count)."""
    series = {}
    for metric in CATALOG:
        if metric.kind == "histogram":
            series[metric.name + "_bucket"] = (*metric.labels, "le")
            series[metric.name + "_sum"] = series[metric.name + "_count"] = metric.labels
        else:
            series[metric.name] = metric.labels
    return series


def dashboard_expressions() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of the dashboard, rows' nested panels included."""
    found = []
    for panel in json.loads(DASHBOARD.read_text(encoding="utf-8"))["panels"]:
        for inner in (panel, *panel.get("panels", ())):
            found += [(inner["title"], target["expr"]) for target in inner.get("targets", ())]
    return found


def test_the_readme_table_is_the_catalog():
    text = README.read_text(encoding="utf-8")
    assert text.count(START) == 1 and text.count(END) == 1, f"README needs one {START}/{END}"
    table = text.split(START, 1)[1].split(END, 1)[0].strip()
    assert table == markdown_table(), (
        "README's metrics table differs from clusterwire.metrics.catalog: run `python -m "
        f"clusterwire.metrics` and paste its output between {START} and {END}")


def test_the_dashboard_uses_only_catalog_metrics_and_labels():
    series = _series()
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["DS_PROMETHEUS"]
    expressions = dashboard_expressions()
    assert len(expressions) >= 15
    for title, expr in expressions:
        names = set(re.findall(r"\bclusterwire_\w+", expr))
        assert names, f"panel {title!r} queries no clusterwire metric: {expr}"
        unknown = names - series.keys()
        assert not unknown, f"panel {title!r} uses {sorted(unknown)}, not in the catalog"
        own = {label for name in names for label in series[name]}
        allowed = own | set(TARGET_LABELS) | {f"exported_{label}" for label in own
                                               if label in TARGET_LABELS}
        used = {label.strip() for group in re.findall(r"\bby \(([^)]*)\)", expr)
                for label in group.split(",")}
        used |= {label for group in re.findall(r"\{([^}]*)\}", expr)
                 for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", group)}
        assert used <= allowed, (
            f"panel {title!r} uses labels {sorted(used - allowed)} that {sorted(names)} lack")
