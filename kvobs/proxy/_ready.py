"""Readiness (``GET /ready``) and the engines' health (``GET /health``, the gauge).

``/ready`` answers "can this proxy serve?": it is up and its metadata store is usable
(Redis answers one call within ``ready_timeout_s``; the in-process store always is). The
engines are not part of it: they are shared by every replica, so an engine's outage would
pull every replica out of a Service at once, and a replica cannot fix it. Their health is
probed (``GET /health``, vLLM's own route) for ``/health``'s detail and
``kvobs_proxy_upstream_up``; ``/health`` waits for a round at most ``HEALTH_WAIT_S`` (a
liveness probe's timeout is short) and says the last answer when it takes longer. Each
answer is reused for ``ready_cache_s``, and concurrent callers share one round of probes,
so a caller polling many times a second costs each engine at most one probe per window.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

import aiohttp

from kvobs.proxy.config import ProxyConfig
from kvobs.proxy.store import MetadataStore

Checks = tuple[bool, list[dict[str, Any]]]
HEALTH_WAIT_S = 0.25


class _Cached:
    """One round of probes at a time, its answer reused for ``cache_s``."""

    def __init__(self, cache_s: float, probe: Callable[[], Awaitable[Checks]]):
        self.cache_s, self.probe = cache_s, probe
        self._answer: tuple[float, Checks] | None = None
        self._round: asyncio.Future | None = None

    async def get(self, max_wait_s: float | None = None) -> Checks | None:
        """The answer; with ``max_wait_s``, the last one when a new round takes longer
        than that (None: no round has finished yet)."""
        answer = self._answer
        if answer is not None and time.monotonic() - answer[0] < self.cache_s:
            return answer[1]
        if self._round is None or self._round.done():
            self._round = asyncio.ensure_future(self._run())
        # shielded: one caller going away does not cancel the round others wait on
        if max_wait_s is None:
            return await asyncio.shield(self._round)
        try:
            return await asyncio.wait_for(asyncio.shield(self._round), max_wait_s)
        except asyncio.TimeoutError:
            return answer[1] if answer is not None else None

    async def _run(self) -> Checks:
        result = await self.probe()
        self._answer = (time.monotonic(), result)
        return result


class Readiness:
    def __init__(self, config: ProxyConfig, store: MetadataStore, on_upstream=None):
        self.config = config
        self.store = store
        self.session: aiohttp.ClientSession | None = None
        # on_upstream(role, endpoint, ok): the gauge
        self._on_upstream = on_upstream or (lambda role, endpoint, ok: None)
        self._store = _Cached(config.ready_cache_s, self._probe_store)
        self._engines = _Cached(config.ready_cache_s, self._probe_engines)

    async def ready(self) -> Checks:
        """Whether this proxy can serve: its store's check."""
        checks = await self._store.get()
        assert checks is not None  # no wait limit: get() waits for the round
        return checks

    async def upstreams(self, max_wait_s: float | None = None) -> Checks | None:
        """Whether every engine answered, and each engine's check (``_Cached.get``)."""
        return await self._engines.get(max_wait_s)

    async def _probe_store(self) -> Checks:
        async def probe() -> str | None:
            await asyncio.wait_for(self.store.size(), self.config.ready_timeout_s)
            return None

        check = await self._outcome("store", self.store.backend, probe())
        return check["ok"], [check]

    async def _probe_engines(self) -> Checks:
        config = self.config
        targets = [
            (role, endpoint)
            for role, endpoints in (("prefill", config.prefill), ("decode", config.decode))
            for endpoint in endpoints
        ]
        checks = list(
            await asyncio.gather(
                *(self._engine(role, endpoint.base_url) for role, endpoint in targets)
            )
        )
        for (role, endpoint), check in zip(targets, checks):
            self._on_upstream(role, f"{endpoint.host}:{endpoint.port}", check["ok"])
        return all(c["ok"] for c in checks), checks

    async def _engine(self, role: str, base_url: str) -> dict[str, Any]:
        headers = {}
        if self.config.engine_api_key:
            headers["Authorization"] = f"Bearer {self.config.engine_api_key}"
        timeout = aiohttp.ClientTimeout(total=self.config.ready_timeout_s)

        session = self.session
        assert session is not None  # the app's start-up sets it before any probe

        async def probe() -> str | None:
            async with session.get(
                base_url + "/health", headers=headers, timeout=timeout
            ) as response:
                await response.read()
                return None if response.status == 200 else f"HTTP {response.status}"

        return await self._outcome(role, base_url, probe())

    @staticmethod
    async def _outcome(check: str, target: str, probe) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            error = await probe
        except asyncio.TimeoutError:
            error = "timeout"
        except Exception as failure:  # noqa: BLE001 - any failure is "not ready"
            error = type(failure).__name__
        result = {
            "check": check,
            "target": target,
            "ok": error is None,
            "latency_s": round(time.perf_counter() - started, 4),
        }
        if error is not None:
            result["error"] = error
        return result
