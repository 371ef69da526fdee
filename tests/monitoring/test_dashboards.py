"""The generated dashboards: fresh, schema-valid, every panel described by its metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from kvobs import semconv
from kvobs.monitoring import dashboards, generate, queries
from kvobs.monitoring.config import DEFAULT

SCHEMA = json.loads((Path(__file__).parent / "grafana_dashboard.schema.json").read_text())
KNOWN = {**semconv.METRICS, **semconv.UPSTREAM_METRICS}
# Labels every series may carry besides the metric's own (scrape and vLLM engine labels).
TARGET_LABELS = {"job", "instance", "le"}
VLLM_LABELS = {"model_name", "engine"}


@pytest.fixture(scope="module")
def boards(sdk):
    return dashboards.build_dashboards(DEFAULT)


@pytest.fixture(scope="module")
def board(boards):
    (only,) = boards.values()
    return only


def _panels(board):
    return [p for p in board["panels"] if p["type"] != "row"]


def test_checked_in_artifacts_are_fresh(repo, sdk):
    stale = generate.stale(repo)
    assert stale == [], (f"stale generated files {stale}: run "
                         "`python -m kvobs.monitoring.generate`")


def test_checked_in_json_is_what_the_builder_renders(repo, boards):
    for name, board in boards.items():
        assert json.loads((repo / "dashboards" / name).read_text()) == board


def test_dashboard_validates_against_schema_subset(board):
    jsonschema.validate(board, SCHEMA)


def test_schema_subset_rejects_broken_dashboards(board):
    broken = json.loads(json.dumps(board))
    broken["panels"][1]["targets"][0].pop("expr")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SCHEMA)
    undescribed = json.loads(json.dumps(board))
    undescribed["panels"][1].pop("description")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(undescribed, SCHEMA)


def test_variables(board):
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert list(variables) == ["datasource", "job", "model_name", "instance", "engine"]
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("job", "model_name", "instance", "engine"):
        variable = variables[name]
        assert variable["type"] == "query"
        assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert variable["query"].startswith("label_values(") and variable["query"].endswith(
            f", {name})")
        assert variable["multi"] and variable["includeAll"] and variable["allValue"] == ".*"


def test_rows(board):
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == [
        "Turn outcomes (metric-side verdict proxies; turn 1 apart)",
        "D->P reads",
        "Retention and expiry (D)",
        "Proxy",
        "Recompute",
        "TTFT by turn",
    ]


def test_panel_ids_unique_and_layout_fits(board):
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24


def test_every_panel_description_names_exactly_the_metrics_it_queries(board):
    for panel in _panels(board):
        used = []
        for target in panel["targets"]:
            found = dashboards.metrics_in(target["expr"])
            assert found, f"{panel['title']}: query reads no known metric: {target['expr']}"
            used += [m for m in found if m not in used]
        named = re.findall(r"`([^`]+)`", panel["description"].split("Metrics:")[-1])
        assert named == used, panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_every_metric_in_a_query_is_a_semconv_name(board):
    for panel in _panels(board):
        for target in panel["targets"]:
            for name in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", target["expr"]):
                base = re.sub(r"_(bucket|sum|count)$", "", name)
                assert name in KNOWN or base in KNOWN, f"{name} not in kvobs.semconv"


def test_queries_filter_by_the_template_variables(board):
    for panel in _panels(board):
        for target in panel["targets"]:
            for name in dashboards.metrics_in(target["expr"]):
                # each series selector of that metric carries the scope's matchers
                for matchers in re.findall(re.escape(name) + r"(?:_bucket|_sum|_count)?\{([^}]*)\}",
                                           target["expr"]):
                    assert 'job=~"$job"' in matchers
                    assert 'instance=~"$instance"' in matchers
                    if name.startswith("vllm:"):
                        assert 'model_name=~"$model_name"' in matchers
                        assert 'engine=~"$engine"' in matchers
            assert "[$__rate_interval]" in target["expr"] or "rate(" not in target["expr"]


def test_aggregation_labels_exist_on_the_metrics(board):
    for panel in _panels(board):
        for target in panel["targets"]:
            for labels, body in re.findall(r"by \(([^)]*)\) \(([^()]*(?:\([^()]*\))?[^()]*)\)",
                                           target["expr"]):
                metrics = dashboards.metrics_in(body)
                for metric in metrics:
                    allowed = set(KNOWN[metric].labels) | TARGET_LABELS
                    if metric.startswith("vllm:"):
                        allowed |= VLLM_LABELS
                    extra = {l.strip() for l in labels.split(",")} - allowed
                    assert not extra, f"{panel['title']}: {metric} has no label {extra}"


def test_first_turn_is_kept_apart_from_reuse_figures(board):
    by_title = {p["title"]: p for p in _panels(board)}
    for title in ("Later turns by proxy lookup outcome",
                  "Missing-metadata share by turn bucket",
                  "Missing-metadata share by prompt-length bucket",
                  "Later-turn TTFT p95 by prompt-length bucket (proxy)"):
        for target in by_title[title]["targets"]:
            assert 'turn_bucket!="1"' in target["expr"], title
    (first,) = by_title["First turns by prompt-length bucket"]["targets"]
    assert 'turn_bucket="1"' in first["expr"]


def test_panel_queries_helper_lists_every_target(board):
    listed = dashboards.panel_queries(board)
    assert len(listed) == sum(len(p["targets"]) for p in _panels(board))
    assert all(expr for _, _, expr in listed)


def test_queries_module_doctests():
    import doctest

    from kvobs.monitoring import generate as gen_module, live, rules

    for module in (queries, dashboards, rules, live, gen_module):
        failures, _ = doctest.testmod(module)
        assert failures == 0, module.__name__
