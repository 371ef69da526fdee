"""The generated dashboards: fresh, schema-valid, every panel described by its metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from dataclasses import replace

from kvobs import semconv
from kvobs.monitoring import dashboards, generate, queries, rules
from kvobs.monitoring.config import DEFAULT, Selectors

SCHEMA = json.loads((Path(__file__).parent / "grafana_dashboard.schema.json").read_text())
KNOWN = {**semconv.METRICS, **semconv.UPSTREAM_METRICS}
# Labels every series may carry besides the metric's own (scrape and vLLM engine labels).
TARGET_LABELS = {"cluster", "namespace", "job", "pod", "instance", "le"}
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
    assert list(variables) == ["datasource", "cluster", "namespace", "job", "pod", "instance",
                               "model_name", "engine"]
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    before = []
    for name in list(variables)[1:]:
        variable = variables[name]
        assert variable["type"] == "query"
        assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert variable["query"].startswith("label_values(") and variable["query"].endswith(
            f", {name})")
        assert variable["multi"] and variable["includeAll"] and variable["allValue"] == ".*"
        # All by default: a Prometheus without the label still shows every series
        assert variable["current"]["value"] == "$__all"
        # its values are those within the selection of the variables before it
        for earlier in before:
            assert f'{earlier}=~"${earlier}"' in variable["query"], (name, earlier)
        if name in ("cluster", "namespace", "job", "pod", "instance"):
            before.append(name)


def test_rows(board):
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == [
        "Now",
        "Turn outcomes (true verdicts, from the live classifier; turn 1 apart)",
        "Turn outcomes, metric side (fleets without the classifier)",
        "D->P reads",
        "Retention and expiry (D)",
        "Proxy",
        "Recompute",
        "TTFT by turn",
        "Where TTFT goes",
        "Host copy (offloading tier)",
        "Live classifier (kvobs collect): keeping up",
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
    """Every series selector of every panel is scoped like the alerts (cluster, namespace)
    and to the dashboard's pods, by regex matchers whose `.*` also matches a series without
    the label."""
    for panel in _panels(board):
        for target in panel["targets"]:
            for name in dashboards.metrics_in(target["expr"]):
                # each series selector of that metric carries the scope's matchers
                found = re.findall(re.escape(name) + r"(?:_bucket|_sum|_count)?\{([^}]*)\}",
                                   target["expr"])
                assert found, (panel["title"], name)
                for matchers in found:
                    for variable in ("cluster", "namespace", "job", "pod", "instance"):
                        assert f'{variable}=~"${variable}"' in matchers, (panel["title"],
                                                                         variable)
                    if name.startswith("vllm:"):
                        assert 'model_name=~"$model_name"' in matchers
                        assert 'engine=~"$engine"' in matchers
            assert "[$__rate_interval]" in target["expr"] or "rate(" not in target["expr"]


def test_legends_are_readable(board):
    """No series is named by its scrape address: per-process panels name job and pod."""
    legends = [t["legendFormat"] for p in _panels(board) for t in p["targets"]]
    assert legends and all(legends)
    assert not [legend for legend in legends if "{{instance}}" in legend]
    assert not [legend for legend in legends if legend == "__auto"]
    per_pod = [t for p in _panels(board) for t in p["targets"]
               if dashboards.POD in t["legendFormat"]]
    assert per_pod
    for target in per_pod:  # what the legend names is what the query keeps
        assert "by (namespace, job, pod, instance" in target["expr"], target["expr"]


def test_engine_restarts_are_annotated(board):
    (restarts,) = board["annotations"]["list"]
    assert restarts["name"] == dashboards.ENGINE_RESTARTS and restarts["enable"]
    assert restarts["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    assert restarts["expr"] == dashboards.engine_restarts(DEFAULT)
    assert "changes(process_start_time_seconds{" in restarts["expr"]
    assert DEFAULT.selectors.engine_targets in restarts["expr"]
    for variable in ("cluster", "namespace", "job", "pod", "instance"):
        assert f'{variable}=~"${variable}"' in restarts["expr"]
    assert restarts["textFormat"] == dashboards.POD and restarts["step"]


def test_minimum_grafana_version_is_stated(board, repo):
    (grafana,) = [r for r in board["__requires"] if r["type"] == "grafana"]
    assert grafana["version"] == dashboards.GRAFANA_MIN_VERSION
    # the SDK the dashboard is built with models that Grafana
    from importlib import metadata

    sdk_version = metadata.version("grafana-foundation-sdk").split("!")[-1]
    assert sdk_version.split(".")[:2] == grafana["version"].split(".")[:2]
    assert f"Grafana {dashboards.GRAFANA_MIN_VERSION}" in (repo / "docs" /
                                                          "dashboards.md").read_text()


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
                    extra = {label.strip() for label in labels.split(",")} - allowed
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


def _row(board, title):
    """The panels under the row titled ``title`` (rows are not collapsed)."""
    panels, inside = [], False
    for panel in board["panels"]:
        if panel["type"] == "row":
            inside = panel["title"] == title
        elif inside:
            panels.append(panel)
    return panels


def _targets(panels):
    return [(p["title"], t) for p in panels for t in p["targets"]]


def test_latency_is_never_labelled_ttft(board):
    latency, ttft = semconv.M_PROXY_LATENCY.name, semconv.M_PROXY_TTFT.name
    for title, target in _targets(_panels(board)):
        if latency in dashboards.metrics_in(target["expr"]):
            assert "TTFT" not in target["legendFormat"], title
    for title, target in _targets(_row(board, "Where TTFT goes")):
        if ttft in dashboards.metrics_in(target["expr"]):
            assert "(streamed turns)" in target["legendFormat"], title


def test_where_ttft_goes_headline_stacks_every_phase_in_time_order(board):
    headline = _row(board, "Where TTFT goes")[0]
    assert headline["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert [t["legendFormat"] for t in headline["targets"]] == [
        "P queue (waiting)", "D->P NIXL set-up", "D->P read", "P prefill",
        "D queue (waiting)", "P->D NIXL set-up", "P->D hand-off", "proxy {{phase}}"]
    proxy = headline["targets"][-1]["expr"]
    assert f'phase=~"{"|".join(queries.PROXY_OWN_PHASES)}"' in proxy
    assert queries.PROXY_OWN_PHASES == ("proxy-in", "proxy-hop", "proxy-out")


def test_vllm_request_histograms_are_split_by_role(board):
    """vLLM's queue/prefill/TTFT histograms mean different things on P and D."""
    roles = (DEFAULT.selectors.prefill, DEFAULT.selectors.decode)
    role_split = (semconv.M_VLLM_QUEUE_TIME, semconv.M_VLLM_PREFILL_TIME)
    for title, target in _targets(_row(board, "Where TTFT goes")):
        for metric in role_split + (semconv.M_VLLM_TTFT,):
            for matchers in re.findall(re.escape(metric.name) + r"_\w+\{([^}]*)\}",
                                       target["expr"]):
                assert any(role in matchers for role in roles), title


def test_queue_wait_excludes_the_remote_kv_wait(board):
    (panel,) = [p for p in _row(board, "Where TTFT goes")
                if p["title"] == "P queue (prefill engines)"]
    waiting = panel["targets"][0]["expr"]
    assert waiting.startswith("((clamp_min(")
    for metric in (semconv.M_READ_DURATION, semconv.M_READ_SETUP):
        assert f'{metric.name}_sum{{' in waiting
    assert 'direction="d_to_p"' in waiting and 'direction="p_to_d"' not in waiting


def test_queueing_panel_names_the_alert_and_its_threshold(board):
    (panel,) = [p for p in _row(board, "Where TTFT goes")
                if p["title"] == "P queue share of P's TTFT"]
    assert rules.PREFILL_QUEUEING_ALERT in panel["description"]
    assert rules.runbook_url(rules.PREFILL_QUEUEING_ALERT) in panel["description"]
    steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert steps[-1]["value"] == DEFAULT.thresholds.prefill_queue_share
    assert dashboards.metrics_in(panel["targets"][0]["expr"]) == [
        semconv.M_VLLM_QUEUE_TIME.name, semconv.M_READ_DURATION.name,
        semconv.M_READ_SETUP.name, semconv.M_VLLM_TTFT.name]


def test_role_selectors_come_from_the_config(sdk):
    config = replace(DEFAULT, selectors=Selectors(prefill='instance=~"p-.*"',
                                                  decode='instance=~"d-.*"'))
    exprs = [e for _, _, e in dashboards.panel_queries(dashboards.build_overview(config))]
    for role in ('instance=~"p-.*"', 'instance=~"d-.*"'):
        assert any(role in e for e in exprs), role
    (alert,) = [a for a in rules.alerts(config) if a.name == rules.PREFILL_QUEUEING_ALERT]
    assert 'instance=~"p-.*"' in alert.expr
    assert DEFAULT.selectors.prefill not in alert.expr


def test_stat_row_comes_first_and_fills_the_width(board):
    now = _row(board, "Now")
    assert board["panels"][0]["title"] == "Now"
    assert {p["type"] for p in now} == {"stat"}
    assert [p["title"] for p in now][:1] == ["Reuse now"]
    assert sum(p["gridPos"]["w"] for p in now) == 24


def test_panels_link_the_runbooks_of_their_alerts(board):
    alert_names = {a.name for a in rules.alerts(DEFAULT)}
    titles = {p["title"] for p in _panels(board)}
    assert set(dashboards.RUNBOOK_LINKS) <= titles  # no link table entry for a lost panel
    linked = set()
    for panel in _panels(board):
        for link in panel.get("links", ()):
            alert = link["title"].removeprefix("Runbook: ")
            assert alert in alert_names, link
            assert link["url"] == rules.runbook_url(alert, DEFAULT)
            assert link["url"].startswith("https://")
            linked.add(alert)
    assert linked == alert_names  # every alert reachable from a panel


def test_runbook_links_follow_the_config(sdk):
    config = replace(DEFAULT, runbook_base_url="https://docs.example.test/kvobs/runbooks/")
    board = dashboards.build_overview(config)
    urls = [link["url"] for p in board["panels"] for link in p.get("links", ())]
    assert urls and all(u.startswith("https://docs.example.test/kvobs/runbooks/Kvobs")
                        for u in urls)
    assert board["links"][0]["url"] == config.runbook_base_url


def test_exemplars_on_the_proxy_latency_histograms(board):
    with_exemplars = [(p["title"], t) for p in _panels(board) for t in p["targets"]
                      if t.get("exemplar")]
    assert with_exemplars
    for title, target in with_exemplars:
        assert "histogram_quantile" in target["expr"], title
        assert any(m.name in target["expr"] for m in dashboards.EXEMPLAR_METRICS), title
    for panel in _panels(board):
        for target in panel["targets"]:
            if not target.get("exemplar"):
                assert not dashboards.wants_exemplars(target["expr"]), panel["title"]


def test_trace_link_only_with_a_trace_url(sdk):
    assert [link["title"] for link in dashboards.build_overview(DEFAULT)["links"]] == [
        "Runbooks"]
    config = replace(DEFAULT, trace_url="http://jaeger:16686/trace/${__value.raw}")
    links = {link["title"]: link for link in dashboards.build_overview(config)["links"]}
    assert links["Traces"]["url"] == "http://jaeger:16686/trace/"


def test_datasource_provisioning_links_exemplars_to_traces():
    import yaml

    from kvobs.monitoring import grafana

    config = replace(DEFAULT, trace_url="http://jaeger:16686/trace/${__value.raw}")
    (source,) = yaml.safe_load(grafana.datasource_provisioning("http://prom:9090",
                                                               config))["datasources"]
    assert source["jsonData"]["exemplarTraceIdDestinations"] == [
        {"name": "trace_id", "url": config.trace_url, "urlDisplayLabel": "Trace"}]
    (plain,) = yaml.safe_load(grafana.datasource_provisioning("http://prom:9090"))["datasources"]
    assert "exemplarTraceIdDestinations" not in plain["jsonData"]


def test_engine_restart_annotation_fires_on_a_restart_only(promtool, tmp_path):
    """promtool evaluates the annotation's query (variables at "All"): an engine whose
    process started again is marked; a steady engine and a restarted proxy are not."""
    import subprocess

    import yaml

    from kvobs.monitoring import live

    expr = live.substitute_variables(dashboards.engine_restarts(DEFAULT))
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(
        {"groups": [{"name": "g", "rules": [{"record": "restarted", "expr": expr}]}]}))
    decode = 'job="serving/vllm-decode", namespace="serving", pod="vllm-decode-0"'
    prefill = 'job="vllm-prefill", instance="127.0.0.1:8100"'  # a static scrape
    proxy = 'job="kvobs-proxy", namespace="serving", pod="kvobs-proxy-0"'
    test = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [
            {"series": f"process_start_time_seconds{{{decode}}}", "values": "100x5 460x5"},
            {"series": f"process_start_time_seconds{{{prefill}}}", "values": "100x10"},
            {"series": f"process_start_time_seconds{{{proxy}}}", "values": "100x5 460x5"}],
        "promql_expr_test": [
            {"expr": "restarted", "eval_time": "4m", "exp_samples": []},
            {"expr": "restarted", "eval_time": "7m",
             "exp_samples": [{"labels": f"restarted{{{decode}}}", "value": 1}]},
            {"expr": "restarted", "eval_time": "10m", "exp_samples": []}]}]}
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test))
    result = subprocess.run([promtool, "test", "rules", "test.yaml"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
