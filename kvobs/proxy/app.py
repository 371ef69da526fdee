"""The proxy as an aiohttp application: it only wires the parts together.

A turn is ``turn.Turns`` (identity, lookup, store, telemetry) around ``legs.Legs`` (P's
prefill, D's decode, streaming), whose choices are ``decide``'s pure functions. Here: the
routes, the store and publisher chosen from the config, start-up and shutdown (with the
start-up log lines), ``/health``, ``/ready`` and ``/metrics``, the optional access log.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import time
from typing import Any

from aiohttp import web
from opentelemetry import trace
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from kvobs import __version__
from kvobs import semconv as sc
from kvobs.settings import entry_lifetime_s

from kvobs.proxy._guard import StoreGuard
from kvobs.proxy._log import effective_config, log
from kvobs.proxy._metrics import ProxyMetrics
from kvobs.proxy._ready import HEALTH_WAIT_S, Readiness
from kvobs.proxy._workers import run_workers, worker_metrics_port
from kvobs.proxy.config import ProxyConfig
from kvobs.proxy.publisher import NoPublisher, ParamsPublisher, RedisParamsPublisher
from kvobs.proxy.store import MemoryStore, MetadataStore
from kvobs.proxy.turn import ASSIGNED_ID_KEY, TRACE_ID_KEY, Turns

_LOG = logging.getLogger("kvobs.proxy")
_ACCESS = logging.getLogger("kvobs.proxy.access")
TRACE_ID_HEADER = sc.TRACE_ID_HEADER
# How the proxy must be served (run_proxy does; embedders pass these to web.AppRunner or
# web.run_app): a client that disconnects cancels its turn, so no engine keeps working for
# a client that left (no decode request after a client gave up during the prefill).
# A body refused unread (too large, too slow) is drained for at most lingering_time, then
# the connection closes (aiohttp's default waits 10 s on a client that stalls).
# Request bodies are decoded by the proxy (_input: gzip, deflate; 415 for others, 400 for
# a broken one), not by aiohttp, which answers those in plain text and logs tracebacks.
RUNNER_OPTIONS: dict[str, Any] = {
    "handler_cancellation": True,
    "lingering_time": 1.0,
    "auto_decompress": False,
}


class _Proxy(Turns):
    """The turns, plus what the routes and the application's life need."""

    def __init__(self, config, tracer, metrics, store, publisher):
        # Redis (store and publisher) is bounded per turn and behind one breaker.
        guard = StoreGuard(
            metrics,
            store.backend,
            store.backend == "redis" or publisher.name == "redis",
            config.redis_budget_s,
            config.redis_breaker_failures,
            config.redis_breaker_cooldown_s,
        )
        super().__init__(config, tracer, metrics, store, publisher, guard)
        self.readiness = Readiness(
            config,
            store,
            lambda role, endpoint, ok: metrics.upstream_up.labels(role, endpoint).set(
                1 if ok else 0
            ),
        )
        lifetime = (
            config.fixed_entry_lifetime_s
            or config.max_entry_lifetime_s
            or entry_lifetime_s(config.decode_kv_ttl_s, config.expiry_margin_s)
        )
        metrics.entry_lifetime.set(lifetime)
        metrics.decode_ttl.set(config.decode_kv_ttl_s)

    async def start(self, _app: web.Application) -> None:
        await self.legs.start()
        self.readiness.session = self.legs.session
        config = self.config
        log(
            _LOG,
            logging.INFO,
            "kvobs proxy starting",
            version=__version__,
            instance=self.steps.instance,
            store=self.store.backend,
            publisher=self.publisher.name,
            **effective_config(config),
        )
        if config.anonymous_tenant == "isolated":
            log(
                _LOG,
                logging.WARNING,
                "requests without an API key get no KV reuse "
                "(anonymous clients are isolated); behind a gateway that authenticates, "
                "set --trusted-tenant-header, or on a trusted network "
                "--anonymous-tenant shared",
                flag="--anonymous-tenant",
                anonymous_tenant="isolated",
                counter=sc.M_PROXY_ANONYMOUS_TURNS.name,
            )

    async def stop(self, _app: web.Application) -> None:
        await self.legs.stop()
        for closer in (self.store.close, self.publisher.close):
            try:
                await closer()
            except Exception:  # noqa: BLE001
                _LOG.debug("close failed", exc_info=True)

    async def health(self, _request: web.Request) -> web.Response:
        """Liveness (always 200 while serving), with the engines' health as detail."""
        engines = await self.readiness.upstreams(HEALTH_WAIT_S)
        state = "unknown" if engines is None else "ok" if engines[0] else "degraded"
        return web.json_response(
            {
                "status": "ok",
                "store": self.store.backend,
                "publisher": self.publisher.name,
                "upstreams": state,
                "checks": engines[1] if engines is not None else [],
            }
        )

    async def ready(self, _request: web.Request) -> web.Response:
        ok, checks = await self.readiness.ready()
        return web.json_response(
            {"status": "ready" if ok else "not-ready", "checks": checks}, status=200 if ok else 503
        )

    async def metrics_view(self, request: web.Request) -> web.Response:
        size, _failure = await self.guard.call(self.guard.budget(), self.store.size)
        if size is not None:
            self.metrics.entries.set(size)
        await self.readiness.upstreams()  # kvobs_proxy_upstream_up (cached round)
        # OpenMetrics when the scraper asks for it (Prometheus does): only that format
        # carries the exemplars (trace_id) of the TTFT and latency histograms.
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        # Rendering every series takes milliseconds (tens on a busy box): off the event
        # loop, so a scrape never holds back the turns being relayed.
        body = await asyncio.get_running_loop().run_in_executor(
            None, encoder, self.metrics.registry
        )
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def metrics_elsewhere(self, _request: web.Request) -> web.Response:
        ports = [worker_metrics_port(self.config, i) for i in range(self.config.workers)]
        message = f"{self.config.workers} workers: each one's /metrics is on its own port"
        return web.json_response({"error": message, "metrics_ports": ports}, status=404)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.handle(request, "/v1/chat/completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.handle(request, "/v1/completions")


PROXY_KEY = web.AppKey("kvobs_proxy", _Proxy)


async def _id_headers(request: web.Request, response: web.StreamResponse) -> None:
    # Lets a client (or an operator reading a client log) name the turn to kvobs.
    trace_id = request.get(TRACE_ID_KEY)
    if trace_id:
        response.headers[TRACE_ID_HEADER] = trace_id
    # A request without a conversation id gets the one the proxy gave it (inferred, or
    # new) in the header a client sends ids in, so the client can adopt it.
    # (An inferred id is some client's: only one that is a valid header value.)
    assigned = request.get(ASSIGNED_ID_KEY)
    if assigned and assigned.isascii() and assigned.isprintable():
        response.headers[request.app[PROXY_KEY].config.conversation_header] = assigned


@web.middleware
async def _access_log(request: web.Request, handler):
    """One logfmt line per request (``--access-log``); no header value but the trace id
    the client got, no body."""
    started = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as error:
        status = error.status
        raise
    except asyncio.CancelledError:
        status = 499  # the client left
        raise
    finally:
        log(
            _ACCESS,
            logging.INFO,
            "request",
            method=request.method,
            path=request.path,
            status=status,
            duration_ms=round((time.perf_counter() - started) * 1e3, 3),
            client=request.remote,
            trace_id=request.get(TRACE_ID_KEY),
        )


def _make_store(config: ProxyConfig, metrics: ProxyMetrics) -> MetadataStore:
    on_evict = metrics.evictions.inc
    if config.store_backend == "redis":
        from kvobs.proxy.redis_store import RedisStore

        assert config.redis_url is not None  # ProxyConfig refuses a redis store without

        return RedisStore(
            config.redis_url,
            config.max_entries,
            config.conversation_ttl_s,
            on_evict,
            infer_per_tenant=config.infer_per_tenant,
            max_per_tenant=config.max_entries_per_tenant,
            pool_size=config.redis_pool_size,
        )
    return MemoryStore(
        config.max_entries,
        config.conversation_ttl_s,
        on_evict,
        infer_per_tenant=config.infer_per_tenant,
        max_per_tenant=config.max_entries_per_tenant,
    )


def _make_publisher(config: ProxyConfig) -> ParamsPublisher:
    if config.publisher_kind == "redis":
        assert config.redis_url is not None  # ProxyConfig refuses it without one
        return RedisParamsPublisher(config.redis_url, pool_size=config.redis_pool_size)
    return NoPublisher()


def build_app(
    config: ProxyConfig,
    *,
    tracer: trace.Tracer | None = None,
    registry: CollectorRegistry | None = None,
    store: MetadataStore | None = None,
    publisher: ParamsPublisher | None = None,
) -> web.Application:
    """The proxy as an aiohttp application (tests and embedders pass their own sinks)."""
    if tracer is None:
        from kvobs.emit.setup import configure_tracing

        tracer = configure_tracing(sc.Service.PROXY, store_dir=config.store_dir)
    metrics = ProxyMetrics(registry)
    metrics.watch_spans(tracer)
    proxy = _Proxy(
        config,
        tracer,
        metrics,
        store or _make_store(config, metrics),
        publisher or _make_publisher(config),
    )
    app = web.Application(
        client_max_size=config.max_body_bytes + 1,
        middlewares=[_access_log] if config.access_log else [],
    )
    app[PROXY_KEY] = proxy
    app.on_response_prepare.append(_id_headers)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/chat/completions", proxy.chat)
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/ready", proxy.ready)
    if config.workers > 1:  # each worker's own port (_workers), never a random one's
        app.router.add_get("/metrics", proxy.metrics_elsewhere)
    else:
        app.router.add_get("/metrics", proxy.metrics_view)
    return app


def _worker_apps(config: ProxyConfig) -> tuple[web.Application, web.Application]:
    """A worker's proxy, and its metrics alone (served at the worker's own port)."""
    app = build_app(config)
    metrics = web.Application()
    metrics.router.add_get("/metrics", app[PROXY_KEY].metrics_view)
    return app, metrics


def run_proxy(config: ProxyConfig) -> None:
    """Serve until interrupted."""
    if config.workers > 1:
        sys.exit(run_workers(config, _worker_apps, RUNNER_OPTIONS))
    app = build_app(config)
    # What start-up allocated (modules, the app, OpenTelemetry's SDK: ~80,000 objects)
    # lives as long as the process. Frozen out of the collector's sight, it no longer
    # makes each full collection stall the event loop (49 ms on a quiet 2-core box).
    gc.collect()
    gc.freeze()
    web.run_app(
        app,
        host=config.host,
        port=config.port,
        access_log=None,
        **RUNNER_OPTIONS,
        print=lambda *_: None,
    )
