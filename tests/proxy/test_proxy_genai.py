"""OpenTelemetry's GenAI attributes on the proxy's spans (#27): the operation by route,
the provider, vLLM's request id; never prompt or completion text."""

from __future__ import annotations

import asyncio
import json

from harness import Harness
from opentelemetry.trace import SpanKind
from test_proxy_flow import run

from kvobs import semconv as sc

SECRET = "the-prompt-must-never-be-in-a-span"


def test_operation_and_provider_by_route():
    async def scenario():
        async with Harness() as h:
            asked = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}
            for path in asked:
                body = ({"messages": [{"role": "user", "content": SECRET}]}
                        if path.endswith("chat/completions") else {"prompt": SECRET})
                status, _ = await h.post(body, path=path)
                assert status == 200
            await asyncio.sleep(0.02)
            http = [s for s in h.proxy.spans() if s.kind in (SpanKind.SERVER, SpanKind.CLIENT)]
            assert len(http) == 6
            for span in http:
                route = span.attributes.get(sc.HTTP_ROUTE) or span.attributes[sc.URL_FULL]
                operation = next(op for path, op in asked.items() if route.endswith(path))
                assert span.attributes[sc.GENAI_OPERATION.key] == operation
                assert span.attributes[sc.GENAI_PROVIDER.key] == "vllm"
            # the turn too, and vLLM's id of the request on the turn and its legs
            turns = h.proxy.spans(sc.SPAN_PROXY_TURN.name)
            for turn, operation in zip(turns, asked.values()):
                a = turn.attributes
                assert a[sc.GENAI_OPERATION.key] == operation
                assert a[sc.GENAI_PROVIDER.key] == "vllm"
                prefix = "chatcmpl-" if operation == "chat" else "cmpl-"
                vllm_id = prefix + a[sc.REQUEST_ID.key]  # the X-Request-Id vLLM prefixes
                assert a[sc.VLLM_REQUEST_ID.key] == vllm_id
                legs = [s for s in http if s.kind is SpanKind.CLIENT
                        and s.context.trace_id == turn.context.trace_id]
                assert [leg.attributes[sc.VLLM_REQUEST_ID.key] for leg in legs] == [vllm_id] * 2
            dumped = json.dumps([dict(s.attributes) for s in h.proxy.spans()])
            assert SECRET not in dumped
    run(scenario())
