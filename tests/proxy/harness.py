"""Runs the proxy (build_app) in front of stand-in engines, in one event loop."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import aiohttp
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from kvobs.proxy import RUNNER_OPTIONS, Endpoint, ProxyConfig, build_app
from proxy_standins import (DecodeState, LocalServer, StandInDecode, StandInPrefill,
                            free_port)


class ProxyUnderTest(LocalServer):
    runner_options = RUNNER_OPTIONS  # served as run_proxy serves it

    def __init__(self, config: ProxyConfig, tracer=None):
        super().__init__(config.port)
        self.config = config
        self.registry = CollectorRegistry()
        self.exporter = InMemorySpanExporter()
        if tracer is None:
            provider = TracerProvider()
            provider.add_span_processor(SimpleSpanProcessor(self.exporter))
            tracer = provider.get_tracer("test")
        self.tracer = tracer

    def app(self) -> web.Application:
        return build_app(self.config, tracer=self.tracer, registry=self.registry)

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        return self.registry.get_sample_value(name, labels or {})

    def spans(self, name: str | None = None):
        spans = self.exporter.get_finished_spans()
        return [s for s in spans if name is None or s.name == name]


# Every request the harness sends carries this API key unless the test passes its own
# Authorization: anonymous clients (no key) never share reuse by default.
CLIENT_KEY = {"Authorization": "Bearer sk-harness"}


class Harness:
    """P and D stand-ins plus one proxy; ``extra_proxy`` adds replicas."""

    def __init__(self, decode_kw: dict | None = None, state: DecodeState | None = None,
                 **config_kw):
        self.state = state or DecodeState()
        self.prefill = StandInPrefill(self.state)
        self.decode = StandInDecode(self.state, **(decode_kw or {}))
        self.config_kw = config_kw
        self.proxies: list[ProxyUnderTest] = []
        self.session: aiohttp.ClientSession | None = None

    def make_config(self, **overrides) -> ProxyConfig:
        kw = {"decode_kv_ttl_s": self.state.ttl_s, **self.config_kw, **overrides}
        return ProxyConfig(prefill=(Endpoint("127.0.0.1", self.prefill.port),),
                           decode=(Endpoint("127.0.0.1", self.decode.port),),
                           host="127.0.0.1", port=free_port(), **kw)

    async def __aenter__(self) -> "Harness":
        await self.prefill.start()
        await self.decode.start()
        self.session = aiohttp.ClientSession()
        await self.add_proxy()
        return self

    async def add_proxy(self, **overrides) -> ProxyUnderTest:
        proxy = await ProxyUnderTest(self.make_config(**overrides)).start()
        self.proxies.append(proxy)
        return proxy

    @property
    def proxy(self) -> ProxyUnderTest:
        return self.proxies[0]

    async def __aexit__(self, *exc) -> None:
        for proxy in self.proxies:
            await proxy.stop()
        await self.session.close()
        await self.prefill.stop()
        await self.decode.stop()

    async def post(self, body: Any, path: str = "/v1/chat/completions",
                   proxy: ProxyUnderTest | None = None, headers: dict | None = None,
                   raw: bytes | None = None) -> tuple[int, Any]:
        proxy = proxy or self.proxy
        data = raw if raw is not None else json.dumps(body).encode()
        async with self.session.post(proxy.url + path, data=data,
                                     headers={**CLIENT_KEY, **(headers or {})}) as response:
            text = await response.read()
            if response.headers.get("Content-Type", "").startswith("text/event-stream"):
                return response.status, parse_sse(text)
            return response.status, json.loads(text) if text else None


def parse_sse(raw: bytes) -> list[Any]:
    events = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: "):
            payload = line[6:]
            events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


def stream_text(events: list[Any]) -> str:
    out = []
    for event in events:
        if isinstance(event, dict):
            for choice in event.get("choices", []):
                out.append((choice.get("delta") or {}).get("content") or choice.get("text")
                           or "")
    return "".join(out)


def replace(config: ProxyConfig, **kw) -> ProxyConfig:
    return dataclasses.replace(config, **kw)
