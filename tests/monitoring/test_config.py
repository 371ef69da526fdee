"""One monitoring config file (YAML or TOML) and ``--set`` flags regenerate the mixin."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from kvobs.monitoring import config as settings
from kvobs.monitoring import generate, rules
from kvobs.monitoring.config import DEFAULT, ConfigError


def test_no_file_no_flags_is_the_default():
    assert settings.load() == DEFAULT


def test_example_file_loads_and_documents_every_knob(repo):
    example = repo / "deploy" / "monitoring.example.yaml"
    config = settings.load(example)
    data = yaml.safe_load(example.read_text())
    top = {f.name for f in settings.dataclasses.fields(settings.MonitoringConfig)}
    assert set(data) == top
    assert config == DEFAULT  # the example documents the defaults, and cannot drift


def test_yaml_and_toml_give_the_same_config(tmp_path):
    (tmp_path / "m.yaml").write_text(
        "decode_ttl_seconds: 300\nproxy_entry_lifetime_seconds: 280\n"
        "thresholds:\n  read_p95_seconds: 0.25\n"
        "selectors:\n  proxy: 'job=\"gw\"'\n"
        "aggregation_labels: [cluster, namespace, job]\n"
        "prometheus_rule_labels: {release: prom}\n")
    (tmp_path / "m.toml").write_text(
        "decode_ttl_seconds = 300\nproxy_entry_lifetime_seconds = 280\n"
        "aggregation_labels = ['cluster', 'namespace', 'job']\n"
        "[thresholds]\nread_p95_seconds = 0.25\n"
        "[selectors]\nproxy = 'job=\"gw\"'\n"
        "[prometheus_rule_labels]\nrelease = 'prom'\n")
    from_yaml, from_toml = settings.load(tmp_path / "m.yaml"), settings.load(tmp_path / "m.toml")
    assert from_yaml == from_toml
    assert from_yaml.thresholds.read_p95_seconds == 0.25
    assert from_yaml.thresholds.expired_read_ratio == DEFAULT.thresholds.expired_read_ratio
    assert from_yaml.selectors.proxy == 'job="gw"'
    assert from_yaml.selectors.engine == DEFAULT.selectors.engine
    assert from_yaml.prometheus_rule_labels == {"release": "prom"}


def test_set_flags_override_the_file(tmp_path):
    (tmp_path / "m.yaml").write_text("thresholds:\n  read_p95_seconds: 0.25\n")
    config = settings.load(tmp_path / "m.yaml", ["thresholds.read_p95_seconds=0.75",
                                                 "windows.rate=10m",
                                                 "runbook_base_url=https://x.test/rb"])
    assert config.thresholds.read_p95_seconds == 0.75
    assert config.windows.rate == "10m"
    assert rules.runbook_url("KvobsProxyFallbacks", config) == \
        "https://x.test/rb/KvobsProxyFallbacks.md"


@pytest.mark.parametrize("text, message", [
    ("thresholds:\n  read_p95: 0.3\n", "unknown key thresholds.read_p95"),
    ("decode_tll_seconds: 300\n", "unknown key decode_tll_seconds"),
    ("thresholds:\n  read_p95_seconds: fast\n", "thresholds.read_p95_seconds: expected a number"),
    ("runbook_base_url: docs/runbooks\n", "absolute http(s) URL"),
    ("decode_ttl_seconds: 300\nproxy_entry_lifetime_seconds: 470\n",
     "must be below decode_ttl_seconds"),
    ("selectors: job\n", "selectors: expected a table"),
    ("[1, 2]\n", "expected a table of keys at the top"),
    ("a: [\n", "m.yaml"),
    # durations: Prometheus' syntax only (promtool would refuse `[5 minutes]`)
    ("windows:\n  rate: 5 minutes\n", "windows.rate: expected a Prometheus duration"),
    ("windows:\n  for_latency: 15\n", "windows.for_latency: expected a string"),
    ("windows:\n  stuck: ''\n", "windows.stuck: expected a Prometheus duration"),
    ("windows:\n  for_ratio: 10min\n", "windows.for_ratio: expected a Prometheus duration"),
    # numbers: finite, not negative, fractions at most 1
    ("thresholds:\n  expired_read_ratio: 5\n", "thresholds.expired_read_ratio: is a fraction"),
    ("thresholds:\n  read_p95_seconds: -1\n", "thresholds.read_p95_seconds: must not be negative"),
    ("thresholds:\n  recompute_tokens_per_second: 0\n",
     "recompute_tokens_per_second: must be positive"),
    ("floors:\n  read_attempts: -0.1\n", "floors.read_attempts: must not be negative"),
    ("decode_ttl_seconds: .inf\n", "decode_ttl_seconds: expected a finite number"),
    ("decode_ttl_seconds: true\n", "decode_ttl_seconds: expected a number"),
    ("proxy_expiry_margin_seconds: 1\n", "proxy_expiry_margin_seconds: must be at least"),
    ("decode_ttl_seconds: 8\n", "proxy_entry_lifetime_seconds: must be positive"),
    # matchers, labels, URLs, names
    ("selectors:\n  engine: namespace=serving\n",
     "selectors.engine: expected PromQL label matchers"),
    ("selectors:\n  proxy: '{job=\"p\"}'\n", "selectors.proxy: expected PromQL label matchers"),
    ("aggregation_labels: [namespace, 'pod name']\n", "aggregation_labels: 'pod name'"),
    ("trace_url: jaeger/trace\n", "trace_url: must be empty or an http(s) URL"),
    ("dashboard_uid: 'my dashboard'\n", "dashboard_uid: expected 1 to 40"),
    ("prometheus_rule_labels: {release: 'kube prometheus'}\n", "prometheus_rule_labels.release:"),
    ("dashboard_configmap_labels: {grafana_dashboard: [1]}\n",
     "dashboard_configmap_labels.grafana_dashboard: expected a string"),
])
def test_bad_config_is_a_clear_error(tmp_path, text, message):
    (tmp_path / "m.yaml").write_text(text)
    with pytest.raises(ConfigError, match=pytest.importorskip("re").escape(message)):
        settings.load(tmp_path / "m.yaml")


def test_bad_set_flag_is_a_clear_error():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        settings.load(None, ["thresholds.read_p95_seconds"])


def test_generate_with_a_config_changes_rules_dashboards_and_manifests(tmp_path, sdk):
    (tmp_path / "m.yaml").write_text(
        "decode_ttl_seconds: 300\nproxy_entry_lifetime_seconds: 270\n"
        "thresholds: {read_p95_seconds: 0.25}\n"
        "runbook_base_url: https://wiki.example.test/kvobs\n"
        "prometheus_rule_labels: {release: prom-stack}\n")
    out = tmp_path / "out"
    assert generate.main([str(out), "--config", str(tmp_path / "m.yaml"),
                          "--set", "thresholds.expired_read_ratio=0.1"]) == 0
    alerts = yaml.safe_load((out / "alerts" / rules.ALERTS_FILE).read_text())
    by_name = {r["alert"]: r for r in alerts["groups"][0]["rules"]}
    assert ") > 0.25\n" in by_name["KvobsRemoteReadLatencyHigh"]["expr"]
    assert ") > 0.1\n" in by_name["KvobsRemoteReadsExpired"]["expr"]
    assert by_name["KvobsProxyFallbacks"]["annotations"]["runbook_url"] == \
        "https://wiki.example.test/kvobs/KvobsProxyFallbacks.md"
    manifest = yaml.safe_load(
        (out / generate.DEPLOY_MONITORING / rules.MANIFEST_FILE).read_text())
    assert manifest["metadata"]["labels"]["release"] == "prom-stack"
    board = json.loads((out / "dashboards" / "kvobs-kv-reuse.json").read_text())
    (ttl_panel,) = [p for p in board["panels"] if p.get("title") == "Gaps longer than D's TTL"]
    # the TTL is the proxy's, read at query time: a configured one bakes nothing in
    assert "kvobs_proxy_decode_ttl_seconds" in ttl_panel["targets"][0]["expr"]
    from kvobs.monitoring import dashboards

    (default_panel,) = [p for p in dashboards.build_overview(DEFAULT)["panels"]
                        if p.get("title") == "Gaps longer than D's TTL"]
    assert ttl_panel["targets"] == default_panel["targets"]
    # the check mode sees the same config as fresh, and the defaults as stale
    assert generate.main([str(out), "--check", "--config", str(tmp_path / "m.yaml"),
                          "--set", "thresholds.expired_read_ratio=0.1"]) == 0
    assert generate.main([str(out), "--check"]) == 1


def test_generate_refuses_a_bad_config(tmp_path, capsys):
    (tmp_path / "m.yaml").write_text("thresholds: {read_p95: 1}\n")
    assert generate.main([str(tmp_path), "--config", str(tmp_path / "m.yaml")]) == 2
    assert "unknown key thresholds.read_p95" in capsys.readouterr().err
    assert not (tmp_path / "alerts").exists()  # nothing written


def test_the_entry_lifetime_is_derived_from_the_ttl():
    """D's TTL less the proxy's expiry margin, as the proxy derives it, unless set."""
    from kvobs.settings import PROXY_ENTRY_LIFETIME, entry_lifetime_s

    assert DEFAULT.entry_lifetime_seconds == PROXY_ENTRY_LIFETIME.default
    config = settings.load(None, ["decode_ttl_seconds=300"])
    assert config.entry_lifetime_seconds == entry_lifetime_s(300.0) == 290.0
    config = settings.load(None, ["decode_ttl_seconds=300", "proxy_expiry_margin_seconds=30"])
    assert config.entry_lifetime_seconds == 270.0
    config = settings.load(None, ["decode_ttl_seconds=300", "proxy_entry_lifetime_seconds=200"])
    assert config.entry_lifetime_seconds == 200.0  # a capped proxy, stated
    # A config derived from another in code follows its own TTL, not the other's.
    shorter = dataclasses.replace(DEFAULT, decode_ttl_seconds=300)
    assert shorter.entry_lifetime_seconds == 290.0
    assert settings.check(shorter) is shorter


def test_every_valid_prometheus_duration_is_accepted():
    for duration in ("30s", "5m", "1h30m", "1d", "2w", "500ms", "1y"):
        assert settings.load(None, [f"windows.rate={duration}"]).windows.rate == duration


def test_generate_exits_2_naming_the_key_and_writes_nothing(tmp_path, capsys):
    assert generate.main([str(tmp_path), "--set", "windows.rate=5 minutes"]) == 2
    assert "windows.rate:" in capsys.readouterr().err
    assert not (tmp_path / "alerts").exists()
