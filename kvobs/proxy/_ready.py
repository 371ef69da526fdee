"""Readiness (``GET /ready``): can this proxy serve a turn now?

Every engine answers ``GET /health`` (vLLM's own route) and the metadata store answers
one call (Redis: one round trip), each within ``ready_timeout_s``. The answer is reused
for ``ready_cache_s``, and concurrent callers share one round of probes, so a load
balancer polling many times a second costs the engines at most one probe each per
window. ``/health`` stays liveness: the process is up and serving.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from kvobs.proxy.config import ProxyConfig
from kvobs.proxy.store import MetadataStore


class Readiness:
    def __init__(self, config: ProxyConfig, store: MetadataStore):
        self.config = config
        self.store = store
        self._answer: tuple[float, bool, list[dict[str, Any]]] | None = None
        self._round: asyncio.Task | None = None

    async def check(self, session: aiohttp.ClientSession) -> tuple[bool, list[dict[str, Any]]]:
        """Whether every check passed, and each check's outcome."""
        answer = self._answer
        if answer is not None and time.monotonic() - answer[0] < self.config.ready_cache_s:
            return answer[1], answer[2]
        if self._round is None or self._round.done():
            self._round = asyncio.ensure_future(self._probe_all(session))
        # shielded: one caller going away does not cancel the round others wait on
        return await asyncio.shield(self._round)

    async def _probe_all(self, session) -> tuple[bool, list[dict[str, Any]]]:
        config = self.config
        probes = [self._engine(session, role, endpoint.base_url)
                  for role, endpoints in (("prefill", config.prefill),
                                          ("decode", config.decode))
                  for endpoint in endpoints]
        probes.append(self._store())
        checks = list(await asyncio.gather(*probes))
        ok = all(c["ok"] for c in checks)
        self._answer = (time.monotonic(), ok, checks)
        return ok, checks

    async def _engine(self, session, role: str, base_url: str) -> dict[str, Any]:
        headers = {}
        if self.config.engine_api_key:
            headers["Authorization"] = f"Bearer {self.config.engine_api_key}"
        timeout = aiohttp.ClientTimeout(total=self.config.ready_timeout_s)

        async def probe() -> str | None:
            async with session.get(base_url + "/health", headers=headers,
                                   timeout=timeout) as response:
                await response.read()
                return None if response.status == 200 else f"HTTP {response.status}"
        return await self._outcome(role, base_url, probe())

    async def _store(self) -> dict[str, Any]:
        async def probe() -> str | None:
            await asyncio.wait_for(self.store.size(), self.config.ready_timeout_s)
            return None
        return await self._outcome("store", self.store.backend, probe())

    @staticmethod
    async def _outcome(check: str, target: str, probe) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            error = await probe
        except asyncio.TimeoutError:
            error = "timeout"
        except Exception as failure:  # noqa: BLE001 - any failure is "not ready"
            error = type(failure).__name__
        result = {"check": check, "target": target, "ok": error is None,
                  "latency_s": round(time.perf_counter() - started, 4)}
        if error is not None:
            result["error"] = error
        return result
