"""The proxy's /metrics negotiates OpenMetrics, whose TTFT/latency buckets carry the
turn's trace id as exemplar (the dashboards' exemplars link to that trace)."""

from __future__ import annotations

import asyncio
import re

from harness import CLIENT_KEY, Harness
from kvobs import semconv as sc

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def test_openmetrics_exemplars_name_the_turns_trace():
    async def scenario():
        async with Harness() as h:
            async with h.session.post(
                    h.proxy.url + "/v1/chat/completions", headers=CLIENT_KEY,
                    json={"messages": [{"role": "user", "content": "hi"}],
                          "conversation_id": "c", "stream": True}) as response:
                await response.read()
                trace_id = response.headers[sc.TRACE_ID_HEADER]
            await asyncio.sleep(0.05)  # the turn ends just after the client has its answer
            async with h.session.get(h.proxy.url + "/metrics",
                                     headers={"Accept": OPENMETRICS}) as response:
                assert response.headers["Content-Type"].startswith(
                    "application/openmetrics-text")
                open_text = await response.text()
            async with h.session.get(h.proxy.url + "/metrics") as response:
                assert response.headers["Content-Type"].startswith("text/plain")
                plain = await response.text()
            return trace_id, open_text, plain

    trace_id, open_text, plain = asyncio.run(scenario())
    assert open_text.rstrip().endswith("# EOF")
    for metric in (sc.M_PROXY_TTFT, sc.M_PROXY_LATENCY):
        exemplars = re.findall(
            re.escape(metric.name) + r'_bucket\{[^}]*\} \S+ # \{'
            + sc.EXEMPLAR_TRACE_ID + r'="([0-9a-f]{32})"\}',
            open_text)
        assert exemplars and set(exemplars) == {trace_id}, metric.name
    assert "# {" not in plain  # the text format cannot carry exemplars
