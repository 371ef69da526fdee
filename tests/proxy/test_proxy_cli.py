"""`kvobs proxy` accepts upstream's flags (both spellings, argparse-style lists)."""

from __future__ import annotations

from click.testing import CliRunner

import kvobs.cli.proxy as cli_proxy
from kvobs.proxy import Endpoint


def _invoke(monkeypatch, args):
    captured = {}
    import kvobs.proxy as package

    monkeypatch.setattr(package, "run_proxy", lambda config: captured.setdefault("c", config))
    result = CliRunner().invoke(cli_proxy.proxy_command, args)
    return result, captured.get("c")


def test_upstream_flags(monkeypatch):
    result, config = _invoke(monkeypatch, [
        "--host", "127.0.0.1", "--port", "9000",
        "--prefiller-hosts", "p1", "p2", "--prefiller-ports", "8100", "8101",
        "--decoder-host", "d1", "--decoder-port", "8200"])
    assert result.exit_code == 0, result.output
    assert config.prefill == (Endpoint("p1", 8100), Endpoint("p2", 8101))
    assert config.decode == (Endpoint("d1", 8200),)
    assert (config.host, config.port, config.store_backend) == ("127.0.0.1", 9000, "memory")


def test_redis_url_selects_shared_store(monkeypatch):
    result, config = _invoke(monkeypatch, ["--redis-url", "redis://x:1/0"])
    assert result.exit_code == 0, result.output
    assert config.store_backend == "redis" and config.publisher_kind == "redis"


def test_bad_flags_exit_2(monkeypatch):
    result, config = _invoke(monkeypatch, ["--prefiller-hosts", "a", "b",
                                           "--prefiller-ports", "1"])
    assert result.exit_code == 2 and config is None
    result, config = _invoke(monkeypatch, ["--expiry-margin", "1"])
    assert result.exit_code == 2 and "expiry_margin_s" in result.output + str(result.stderr_bytes)


def test_registered_in_kvobs_group():
    from kvobs.cli import main

    assert main.get_command(None, "proxy") is cli_proxy.proxy_command


def test_conversation_inference_flag(monkeypatch):
    from kvobs.proxy import ProxyConfig

    result, config = _invoke(monkeypatch, [])
    assert result.exit_code == 0, result.output
    defaults = ProxyConfig(prefill=config.prefill, decode=config.decode)
    assert config.infer_conversations is defaults.infer_conversations is True
    assert config.infer_per_tenant == defaults.infer_per_tenant
    result, config = _invoke(monkeypatch, ["--no-infer-conversations",
                                           "--infer-per-tenant", "5"])
    assert result.exit_code == 0, result.output
    assert config.infer_conversations is False and config.infer_per_tenant == 5
    result, config = _invoke(monkeypatch, ["--infer-per-tenant", "0"])
    assert result.exit_code == 2 and config is None


def test_tenancy_and_redis_flags(monkeypatch):
    from kvobs.proxy import ProxyConfig

    result, config = _invoke(monkeypatch, [])
    assert result.exit_code == 0, result.output
    defaults = ProxyConfig(prefill=config.prefill, decode=config.decode)
    for name in ("max_entries_per_tenant", "anonymous_tenant", "redis_budget_s",
                 "redis_pool_size", "redis_breaker_failures", "redis_breaker_cooldown_s"):
        assert getattr(config, name) == getattr(defaults, name)
    assert config.anonymous_tenant == "isolated"
    result, config = _invoke(monkeypatch, [
        "--max-entries-per-tenant", "7", "--anonymous-tenant", "shared", "--redis-budget",
        "0.1", "--redis-pool-size", "64", "--redis-breaker-failures", "2",
        "--redis-breaker-cooldown", "3"])
    assert result.exit_code == 0, result.output
    assert (config.max_entries_per_tenant, config.anonymous_tenant, config.redis_budget_s,
            config.redis_pool_size, config.redis_breaker_failures,
            config.redis_breaker_cooldown_s) == (7, "shared", 0.1, 64, 2, 3.0)
    result, config = _invoke(monkeypatch, ["--redis-budget", "0"])
    assert result.exit_code == 2 and config is None


def test_tenant_and_log_flags(monkeypatch):
    result, config = _invoke(monkeypatch, [])
    assert result.exit_code == 0, result.output
    assert (config.trusted_tenant_header, config.max_new_tenants, config.access_log) == \
        (None, 0, False)
    result, config = _invoke(monkeypatch, [
        "--trusted-tenant-header", "X-Tenant", "--max-new-tenants", "3",
        "--new-tenant-window", "10", "--access-log"])
    assert result.exit_code == 0, result.output
    assert (config.trusted_tenant_header, config.max_new_tenants,
            config.new_tenant_window_s, config.access_log) == ("X-Tenant", 3, 10.0, True)
    result, config = _invoke(monkeypatch, ["--trusted-tenant-header", "X-T",
                                           "--tenant-header", "X-U"])
    assert result.exit_code == 2 and config is None
