"""An operator can see what the proxy does (#26 item 3): logfmt logs (start-up with the
effective configuration and no secret, one line per upstream failure, an optional access
log), process_*, python_gc_* and kvobs_build_info on /metrics. /ready and /health:
test_proxy_hardening.py."""

from __future__ import annotations

import logging

from harness import Harness
from test_proxy_flow import run

import kvobs
from kvobs.proxy._log import FIELDS, LogfmtFormatter


def _proxy_records(caplog, name="kvobs.proxy"):
    return [r for r in caplog.records if r.name == name]


def test_startup_line_has_the_effective_configuration_and_no_secret(caplog):
    caplog.set_level(logging.INFO, logger="kvobs.proxy")

    async def scenario():
        async with Harness(engine_api_key="sk-engine-secret", anonymous_tenant="isolated",
                           redis_budget_s=0.25) as h:
            return h.proxy.config.port
    port = run(scenario())
    (start,) = [r for r in _proxy_records(caplog) if r.getMessage() == "kvobs proxy starting"]
    fields = getattr(start, FIELDS)
    assert fields["port"] == port and fields["redis_budget_s"] == 0.25
    assert fields["version"] == kvobs.__version__ and fields["engine_api_key_set"] is True
    line = LogfmtFormatter().format(start)
    assert "sk-engine-secret" not in line and "engine_api_key=" not in line
    assert f" port={port} " in line and line.startswith("time=")
    assert 'msg="kvobs proxy starting"' in line
    # the anonymous default is never silent
    (warning,) = [r for r in _proxy_records(caplog) if r.levelno == logging.WARNING]
    assert getattr(warning, FIELDS)["flag"] == "--anonymous-tenant"


def test_no_anonymous_warning_when_shared(caplog):
    caplog.set_level(logging.INFO, logger="kvobs.proxy")

    async def scenario():
        async with Harness(anonymous_tenant="shared"):
            pass
    run(scenario())
    assert not [r for r in _proxy_records(caplog) if r.levelno >= logging.WARNING]


def test_redis_password_is_masked_in_the_startup_line():
    from kvobs.proxy import Endpoint, ProxyConfig
    from kvobs.proxy._log import effective_config, logfmt

    config = ProxyConfig(prefill=(Endpoint("p", 1),), decode=(Endpoint("d", 2),),
                         store_backend="redis", redis_url="redis://u:hunter2@r:6379/0")
    line = logfmt(effective_config(config))
    assert "hunter2" not in line and "redis_url=redis://u:***@r:6379/0" in line
    assert "prefill=p:1" in line


def test_one_logfmt_line_per_upstream_failure_with_role_and_cause(caplog):
    caplog.set_level(logging.INFO, logger="kvobs.proxy")

    async def scenario():
        async with Harness() as h:
            caplog.clear()
            await h.decode.stop()  # D unreachable: a 502
            status, _ = await h.post({"messages": [{"role": "user", "content": "q"}],
                                      "conversation_id": "c"})
            assert status == 502
    run(scenario())
    failures = [r for r in _proxy_records(caplog) if r.getMessage() == "engine failed a turn"]
    assert len(failures) == 1
    fields = getattr(failures[0], FIELDS)
    assert (fields["role"], fields["cause"], fields["status"]) == ("decode", "unreachable", 502)
    line = LogfmtFormatter().format(failures[0])
    assert "role=decode cause=unreachable status=502" in line and "\n" not in line


def test_access_log_is_optional(caplog):
    caplog.set_level(logging.INFO, logger="kvobs.proxy.access")

    async def scenario(access_log):
        async with Harness(access_log=access_log) as h:
            status, _ = await h.post({"messages": [{"role": "user", "content": "secret"}],
                                      "conversation_id": "c"})
            assert status == 200
            async with h.session.get(h.proxy.url + "/nope") as response:
                assert response.status == 404
    run(scenario(False))
    assert _proxy_records(caplog, "kvobs.proxy.access") == []
    run(scenario(True))
    lines = [LogfmtFormatter().format(r) for r in _proxy_records(caplog, "kvobs.proxy.access")]
    assert len(lines) == 2
    assert "method=POST path=/v1/chat/completions status=200" in lines[0]
    assert "trace_id=" in lines[0] and "secret" not in lines[0]
    assert "path=/nope status=404" in lines[1]


def test_process_gc_and_build_info_series():
    async def scenario():
        async with Harness() as h:
            async with h.session.get(h.proxy.url + "/metrics") as response:
                text = await response.text()
            assert f'kvobs_build_info{{version="{kvobs.__version__}"}} 1.0' in text
            assert h.proxy.metric("process_resident_memory_bytes") > 0
            assert h.proxy.metric("process_cpu_seconds_total") >= 0
            assert "python_gc_collections_total{generation=\"0\"}" in text
    run(scenario())


def test_logfmt_quotes_and_escapes():
    from kvobs.proxy._log import logfmt

    assert logfmt({"a": "x y", "b": 'q"', "c": "l1\nl2", "d": "", "e": True}) == \
        'a="x y" b="q\\"" c="l1\\nl2" d="" e=true'
