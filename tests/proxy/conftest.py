"""Fixtures: a real redis-server on a free port (stopped by PID), the proxy harness."""

from __future__ import annotations

import pytest

from kvobs.testbed.services import RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server):
    import redis

    client = redis.Redis.from_url(redis_server)
    client.flushall()
    client.close()
    return redis_server
