"""The generated rule files: promtool-clean, promtool-tested, every alert complete."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from kvobs import semconv
from kvobs.monitoring import rules
from kvobs.monitoring.config import DEFAULT

from dataclasses import replace

ALERTS_DIR = Path(__file__).resolve().parents[2] / "alerts"
RULE_FILES = sorted(p.name for p in ALERTS_DIR.glob("*.rules.yaml"))
TEST_FILES = sorted(p.name for p in (ALERTS_DIR / "tests").glob("*.test.yaml"))
RECORD_NAME = re.compile(r"^[a-z_]+:[a-zA-Z0-9_]+:[a-zA-Z0-9_]+$")


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_rule_files_are_the_generated_ones():
    assert RULE_FILES == sorted(rules.groups(DEFAULT))


def test_one_promtool_test_file_per_rule_file():
    assert TEST_FILES == sorted(n.replace(".rules.yaml", ".test.yaml") for n in RULE_FILES)
    for name in TEST_FILES:
        content = yaml.safe_load((ALERTS_DIR / "tests" / name).read_text())
        assert content["rule_files"] == [f"../{name.replace('.test.yaml', '.rules.yaml')}"]


@pytest.mark.parametrize("name", RULE_FILES)
def test_promtool_check_rules(promtool, name):
    result = _run(promtool, "check", "rules", name, cwd=ALERTS_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_check_rules_on_the_prometheusrule_manifest(promtool, tmp_path):
    from kvobs.monitoring.generate import DEPLOY_MONITORING

    manifest = yaml.safe_load(
        (ALERTS_DIR.parent / DEPLOY_MONITORING / rules.MANIFEST_FILE).read_text())
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
    assert manifest["kind"] == "PrometheusRule"
    # kube-prometheus-stack's default ruleSelector matches its Helm release label
    assert manifest["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    groups = [g for n in RULE_FILES
              for g in yaml.safe_load((ALERTS_DIR / n).read_text())["groups"]]
    by_name = lambda gs: {g["name"]: g for g in gs}  # noqa: E731
    assert by_name(manifest["spec"]["groups"]) == by_name(groups)
    extracted = tmp_path / "manifest.rules.yaml"
    extracted.write_text(yaml.safe_dump({"groups": manifest["spec"]["groups"]}))
    result = _run(promtool, "check", "rules", str(extracted), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", TEST_FILES)
def test_promtool_test_rules(promtool, name):
    result = _run(promtool, "test", "rules", name, cwd=ALERTS_DIR / "tests")
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_test_rules_catches_a_wrong_expectation(promtool, tmp_path):
    """The promtool tests can fail: flip one firing case to silent and expect a failure."""
    content = rules.alert_tests(DEFAULT)
    content["rule_files"] = [str(ALERTS_DIR / rules.ALERTS_FILE)]
    first_firing = next(t for t in content["tests"] if t["alert_rule_test"][0]["exp_alerts"])
    first_firing["alert_rule_test"][0]["exp_alerts"] = []
    content["tests"] = [first_firing]
    path = tmp_path / "broken.test.yaml"
    path.write_text(yaml.safe_dump(content))
    result = _run(promtool, "test", "rules", str(path), cwd=tmp_path)
    assert result.returncode != 0


def test_every_alert_has_a_firing_and_a_silent_case():
    for alert in rules.alerts(DEFAULT):
        outcomes = {case.fires for case in alert.cases}
        assert outcomes == {True, False}, alert.name


def test_generated_alert_tests_cover_every_alert_both_ways():
    tests = rules.alert_tests(DEFAULT)["tests"]
    for alert in rules.alerts(DEFAULT):
        mine = [t["alert_rule_test"][0] for t in tests
                if t["alert_rule_test"][0]["alertname"] == alert.name]
        assert any(t["exp_alerts"] for t in mine), alert.name
        assert any(not t["exp_alerts"] for t in mine), alert.name


def test_alert_fields():
    names = set()
    for alert in rules.alerts(DEFAULT):
        rule = alert.rule()
        assert alert.name not in names
        names.add(alert.name)
        assert re.fullmatch(r"Kvobs[A-Z][A-Za-z]+", alert.name)
        assert rule["labels"]["severity"] in ("critical", "warning", "info")
        assert re.fullmatch(r"\d+[smh]", rule["for"]), alert.name
        assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}
        assert all(rule["annotations"].values())


def test_every_alert_links_an_existing_runbook(repo):
    for alert in rules.alerts(DEFAULT):
        url = alert.rule()["annotations"]["runbook_url"]
        assert url == f"{DEFAULT.runbook_base_url}/{alert.name}.md"
        assert url.startswith("https://")
        page = repo / "docs" / "runbooks" / f"{alert.name}.md"
        assert page.is_file(), page
        text = page.read_text()
        assert text.startswith(f"# {alert.name}\n")
        for section in ("## Meaning", "## Impact", "## Diagnosis", "## Remedy"):
            assert section in text, f"{page.name}: {section}"
        assert "kvobs diagnose" in text, page.name


def test_no_orphan_runbooks(repo):
    pages = {p.stem for p in (repo / "docs" / "runbooks").glob("*.md")}
    assert pages == {a.name for a in rules.alerts(DEFAULT)}


def test_ratio_alerts_have_rate_floors_and_ratios_are_zero_safe():
    for alert in rules.alerts(DEFAULT):
        if "> 0)) " in alert.expr or ") > 0))" in alert.expr:  # a ratio
            assert "\nand (" in alert.expr, f"{alert.name}: ratio without a rate floor"
    for rec in rules.recordings(DEFAULT):
        if rec.record.split(":")[2].startswith("ratio"):
            assert ") > 0)" in rec.expr, f"{rec.record}: denominator not filtered"


def test_recording_rule_names():
    for rec in rules.recordings(DEFAULT):
        assert RECORD_NAME.match(rec.record), rec.record
        level, metric, operation = rec.record.split(":")
        assert level == "namespace_job"
        assert "sum by (namespace, job" in rec.expr or "max by (namespace, job" in rec.expr


def test_alerts_keep_namespace_in_their_aggregation():
    for alert in rules.alerts(DEFAULT):
        for labels in re.findall(r" by \(([^)]*)\)", alert.expr):
            assert labels.startswith("namespace, job"), (alert.name, labels)
        for case in alert.cases:
            if case.fires and case.labels:
                assert case.labels["namespace"] == "serving", alert.name


def test_aggregation_labels_come_from_the_config():
    config = replace(DEFAULT, aggregation_labels=("cluster", "namespace", "job"))
    for alert in rules.alerts(config):
        for labels in re.findall(r" by \(([^)]*)\)", alert.expr):
            assert labels.startswith("cluster, namespace, job"), (alert.name, labels)
    assert all(r.record.startswith("cluster_namespace_job:") for r in rules.recordings(config))


def test_telemetry_absent_alerts_come_from_the_template():
    absent = [a for a in rules.alerts(DEFAULT) if "absent(" in a.expr]
    assert {a.name for a in absent} == {"KvobsEngineTelemetryAbsent",
                                        "KvobsProxyTelemetryAbsent",
                                        "KvobsClassifierTelemetryAbsent"}
    for alert in absent:
        # per job: a scraped job without the metric fires even while another job has it
        assert alert.expr.startswith("(count by (namespace, job) (up{")
        per_job = [c for c in alert.cases if c.name.startswith("one job without it")]
        assert per_job and per_job[0].fires and per_job[0].labels["job"]


def test_entry_lifetime_alert_compares_the_two_gauges():
    (alert,) = [a for a in rules.alerts(DEFAULT) if a.name == "KvobsProxyEntryOutlivesDecodeTTL"]
    assert "kvobs_proxy_entry_lifetime_seconds" in alert.expr
    assert ">= (max by (namespace, job) (kvobs_proxy_decode_ttl_seconds" in alert.expr


def test_prefill_queueing_alert_compares_the_wait_alone_with_p_ttft():
    """vLLM counts the wait for D's KV as queue time: the alert takes it out, on P only."""
    (alert,) = [a for a in rules.alerts(DEFAULT) if a.name == rules.PREFILL_QUEUEING_ALERT]
    for metric in (semconv.M_VLLM_QUEUE_TIME, semconv.M_VLLM_TTFT):
        assert f'{metric.name}_sum{{{DEFAULT.selectors.engine}, {DEFAULT.selectors.prefill}}}' \
            in alert.expr
    for metric in (semconv.M_READ_DURATION, semconv.M_READ_SETUP):
        assert f'{metric.name}_sum{{{DEFAULT.selectors.engine}, direction="d_to_p"}}' in alert.expr
    assert f"> {DEFAULT.thresholds.prefill_queue_share:g}\nand (" in alert.expr
    assert alert.expr.endswith(f"> {DEFAULT.floors.prefill_requests:g}")
    (silent_kv_wait,) = [c for c in alert.cases if "wait for D's KV" in c.name]
    assert not silent_kv_wait.fires
