"""The Redis store runs its scripts by SHA; a Redis that lost them (restarted, SCRIPT
FLUSH) gets them loaded again, and the turn goes on (a real redis-server)."""

from __future__ import annotations

import asyncio

import redis

from kvobs.proxy.redis_store import RedisStore


def test_scripts_flushed_between_turns_are_loaded_again(redis_url):
    async def scenario():
        store = RedisStore(redis_url, 100, 3600.0)
        try:
            first = await store.begin_turn("tenant:conv", 1000.0)
            await store.finish_turn("tenant:conv", first.turn, 1001.0, {"p": 1}, 2000.0,
                                    {"k": "m", "n": 2, "h": "ab"})
            flush = redis.Redis.from_url(redis_url)
            flush.script_flush()
            assert flush.script_exists(store._begin.sha) == [False]
            flush.close()
            second = await store.begin_turn("tenant:conv", 1002.0)
            assert second.turn == 2 and second.previous.params == {"p": 1}
            await store.finish_turn("tenant:conv", second.turn, 1003.0, {"p": 2}, 2000.0,
                                    {"k": "m", "n": 4, "h": "cd"})
            assert (await store.begin_turn("tenant:conv", 1004.0)).previous.params == {"p": 2}
        finally:
            await store.close()

    asyncio.run(scenario())
