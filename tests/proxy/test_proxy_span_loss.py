"""Telemetry never stops serving (#10 defect 7): the proxy starts without its span store,
says so in one log line, and counts every span it loses on its own /metrics."""

from __future__ import annotations

import asyncio
import logging

from harness import Harness, ProxyUnderTest
from test_proxy_flow import run

from kvobs.proxy import build_app
from kvobs.proxy.app import PROXY_KEY
from kvobs.emit.setup import flush

DROPPED = "kvobs_telemetry_dropped_spans_total"


class _ConfiguredTracing(ProxyUnderTest):
    """The proxy as `kvobs proxy` builds it: its tracer from configure_tracing."""

    def app(self):
        return build_app(self.config, registry=self.registry)


def test_unwritable_span_store_neither_stops_the_proxy_nor_hides_the_loss(
        tmp_path, monkeypatch, caplog):
    for name in ("OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "KVOBS_STORE"):
        monkeypatch.delenv(name, raising=False)
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    (store_dir / "spans").write_text("a file where the span directory should be")

    async def scenario():
        async with Harness() as h:
            caplog.set_level(logging.WARNING)
            proxy = await _ConfiguredTracing(h.make_config(store_dir=str(store_dir))).start()
            h.proxies.append(proxy)
            warnings = [r for r in caplog.records if "not writable" in r.getMessage()]
            assert len(warnings) == 1  # one line at start
            for i in range(3):
                status, _ = await h.post({"messages": [{"role": "user", "content": "q"}],
                                          "conversation_id": f"c{i}"}, proxy=proxy)
                assert status == 200
            await asyncio.get_running_loop().run_in_executor(
                None, flush, proxy._runner.app[PROXY_KEY].tracer)
            async with h.session.get(proxy.url + "/metrics") as response:
                text = await response.text()
            lost = [line for line in text.splitlines()
                    if line.startswith(DROPPED + '{reason="export-failed"}')]
            assert lost and float(lost[0].split()[-1]) >= 9  # turn, lookup, store x 3
            assert f'{DROPPED}{{reason="queue-full"}} 0.0' in text
    run(scenario())


def test_span_loss_is_zero_on_a_healthy_proxy():
    async def scenario():
        async with Harness() as h:
            status, _ = await h.post({"messages": [{"role": "user", "content": "q"}]})
            assert status == 200
            for reason in ("queue-full", "export-failed"):
                assert h.proxy.metric(DROPPED, {"reason": reason}) == 0
    run(scenario())
