"""A slow or hung Redis costs a turn at most its store budget; a circuit breaker skips it
while it is down; the pool is sized for the concurrency (#10 defect 5). Real redis-server."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest
from harness import Harness
from test_proxy_flow import LOOKUP, run

from kvobs import semconv as sc
from kvobs.testbed.services import RedisServer

BUDGET_S = 0.2
SLACK_S = 0.15  # event loop and stand-in engines on a busy 2-core box


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server of this test's own: it gets SIGSTOPped."""
    server = RedisServer(tmp_path / "redis")
    try:
        yield server
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.stop()


async def _timed_turn(h: Harness, conversation: str, messages: list) -> tuple[float, list]:
    started = time.perf_counter()
    status, out = await h.post({"messages": messages, "conversation_id": conversation})
    elapsed = time.perf_counter() - started
    assert status == 200, out
    return elapsed, messages + [out["choices"][0]["message"]]


def _degraded(h: Harness, reason: str) -> float:
    return h.proxy.metric("kvobs_proxy_store_degraded_total", {"reason": reason})


def test_hung_redis_costs_a_turn_at_most_the_budget(own_redis):
    async def scenario():
        async with Harness(store_backend="redis", redis_url=own_redis.url,
                           params_publisher="none", redis_budget_s=BUDGET_S,
                           redis_breaker_failures=3, redis_breaker_cooldown_s=1.0) as h:
            baseline = []
            histories = {}
            for i in range(4):
                elapsed, histories[i] = await _timed_turn(
                    h, f"c{i}", [{"role": "user", "content": f"q{i}"}])
                baseline.append(elapsed)
            base = max(baseline)
            os.kill(own_redis.pid, signal.SIGSTOP)
            try:
                added = []
                for i in range(4):  # 3 failures open the breaker, the 4th is skipped
                    histories[i].append({"role": "user", "content": "next"})
                    elapsed, histories[i] = await _timed_turn(h, f"c{i}", histories[i])
                    added.append(elapsed - base)
                assert max(added) <= BUDGET_S + SLACK_S, added
                assert added[3] < BUDGET_S / 2  # breaker open: Redis not even tried
                # concurrent turns while hung: none waits past the budget either
                started = time.perf_counter()
                results = await asyncio.gather(*(h.post(
                    {"messages": [{"role": "user", "content": "x"}],
                     "conversation_id": f"n{i}"}) for i in range(20)))
                assert all(status == 200 for status, _ in results)
                assert time.perf_counter() - started < base * 20 + BUDGET_S + SLACK_S
            finally:
                os.kill(own_redis.pid, signal.SIGCONT)
            await asyncio.sleep(0.05)
            lookups = h.proxy.spans(LOOKUP)[4:8]
            failures = [s.attributes.get(sc.STORE_FAILURE.key) for s in lookups]
            assert failures == ["timeout"] * 3 + ["circuit-open"]
            assert all(s.attributes[sc.LOOKUP_MISS_REASON.key] == "store-unavailable"
                       for s in lookups)
            assert _degraded(h, "timeout") >= 3 and _degraded(h, "circuit-open") >= 1
            assert h.proxy.metric("kvobs_proxy_store_circuit_opened_total") == 1
            assert h.proxy.metric("kvobs_proxy_store_circuit_open") == 1
            assert h.proxy.metric("kvobs_proxy_store_errors_total", {"backend": "redis"}) >= 3
            # after the cool-down one call probes, succeeds and closes the breaker
            await asyncio.sleep(1.1)
            await _timed_turn(h, "after", [{"role": "user", "content": "a"}])
            assert h.proxy.metric("kvobs_proxy_store_circuit_open") == 0
            history = [{"role": "user", "content": "a"}]
            _, history = await _timed_turn(h, "again", history)
            history.append({"role": "user", "content": "b"})
            await _timed_turn(h, "again", history)
            await asyncio.sleep(0.05)
            assert h.proxy.spans(LOOKUP)[-1].attributes[sc.LOOKUP_OUTCOME.key] == "hit"
    run(scenario())


def test_256_concurrent_clients_get_no_pool_errors(redis_url):
    clients = 256

    async def scenario():
        # What this checks is the pool (no MaxConnectionsError), not the budget: a
        # generous one keeps a loaded CI box's slow round trips from counting as errors.
        async with Harness(store_backend="redis", redis_url=redis_url,
                           params_publisher="none", redis_budget_s=5.0) as h:
            # 256 requests in flight at once (the harness session holds at most 100)
            await h.session.close()
            h.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

            async def converse(i: int) -> str:
                messages = [{"role": "user", "content": f"client {i} " * 20}]
                status, out = await h.post({"messages": messages, "conversation_id": f"k{i}"})
                assert status == 200, out
                messages += [out["choices"][0]["message"], {"role": "user", "content": "n"}]
                status, out = await h.post({"messages": messages, "conversation_id": f"k{i}"})
                assert status == 200, out
                return "ok"

            results = await asyncio.gather(*(converse(i) for i in range(clients)))
            assert results == ["ok"] * clients
            await asyncio.sleep(0.05)
            assert h.proxy.metric("kvobs_proxy_store_errors_total", {"backend": "redis"}) == 0
            assert h.proxy.metric("kvobs_proxy_lookups_total", {"outcome": "hit"}) == clients
            assert h.proxy.metric("kvobs_proxy_stores_total",
                                  {"action": "skipped", "source": "none"}) == 0
    run(scenario())



def _lagging_loop(tasks: int, stall_s: float):
    """Busy tasks that keep the loop's ready queue long: each loop iteration runs every
    one of them for ``stall_s``, as 256 clients do to a saturated proxy."""
    async def busy():
        while True:
            time.sleep(stall_s)
            await asyncio.sleep(0)
    return [asyncio.create_task(busy()) for _ in range(tasks)]


def test_the_loops_lag_is_not_charged_to_redis(redis_url):
    """Defect 5's follow-up: under load a Redis call's wall time is mostly the proxy's own
    event loop (a queue of ready callbacks before each resumption); only the time from
    the command's send to its reply's arrival is Redis's, and only that spends the
    budget. A hung Redis is still bounded (the test above)."""
    from prometheus_client import CollectorRegistry

    from kvobs.proxy._guard import StoreGuard
    from kvobs.proxy._metrics import ProxyMetrics
    from kvobs.proxy.redis_store import redis_client

    budget_s = 0.2

    async def scenario():
        client = redis_client(redis_url, 8)
        guard = StoreGuard(ProxyMetrics(CollectorRegistry()), "redis", True, budget_s,
                           failures=100, cooldown_s=1.0)
        await client.ping()
        busy = _lagging_loop(tasks=10, stall_s=0.01)  # ~0.1 s per loop iteration
        try:
            walls, spent = [], []
            for _ in range(10):
                budget = guard.budget()
                started = time.perf_counter()
                value, failure = await guard.call(budget, client.incr, "kvobs-test:lag")
                walls.append(time.perf_counter() - started)
                spent.append(budget_s - budget.left)
                assert failure is None and value
        finally:
            for task in busy:
                task.cancel()
            await client.aclose()
        # The calls took 4+ loop iterations of wall time each, twice the budget: charged
        # by wall time they would all have timed out. Redis time ends when the reply
        # reached the kernel (TCP_INFO), not when the loop got to it: milliseconds.
        assert sorted(walls)[len(walls) // 2] > budget_s, walls
        assert max(spent) < budget_s / 2, spent
    run(scenario())
