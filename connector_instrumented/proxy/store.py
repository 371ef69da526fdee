"""Metadata store: conversation -> D's last params, their expiry, turn counter, digest.

Two backends behind one small protocol, chosen once at start:

- ``MemoryStore`` (default): one process, LRU-capped, idle entries dropped.
- ``RedisStore``: replicas share state and a restart loses nothing; every operation is
  one Lua script (atomic across replicas), the entry cap is a sorted-set index.

Params are single-use: ``begin_turn`` takes them out (D's blocks are released once P has
read them), bumps the turn counter and returns the previous state for the lookup.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol


@dataclass
class Entry:
    """A conversation's state. ``turn`` counts turns begun (1-based)."""

    turn: int = 0
    params: dict[str, Any] | None = None
    expires_at: float | None = None  # wall clock; params unusable after
    stored_at: float | None = None  # wall clock when params were stored
    ended_at: float | None = None  # wall clock when the last turn ended
    digest: dict[str, Any] | None = None
    stored_turn: int = 0  # turn whose D params these are
    touched: float = 0.0


class MetadataStore(Protocol):
    backend: str

    async def begin_turn(self, key: str, now: float) -> tuple[int, Entry | None]:
        """Start a turn: returns (this turn's index, previous state or None); takes params."""

    async def finish_turn(self, key: str, turn: int, now: float,
                          params: dict[str, Any] | None, expires_at: float | None,
                          digest: dict[str, Any] | None) -> None:
        """End a turn; store D's params when there are any."""

    async def size(self) -> int | None: ...

    async def close(self) -> None: ...


EvictCallback = Callable[[int], None]


class MemoryStore:
    backend = "memory"

    def __init__(self, max_entries: int, conversation_ttl_s: float,
                 on_evict: EvictCallback | None = None):
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._max = max_entries
        self._idle = conversation_ttl_s
        self._on_evict = on_evict or (lambda n: None)

    def _live(self, key: str, now: float) -> Entry | None:
        entry = self._entries.get(key)
        if entry is not None and now - entry.touched > self._idle:
            del self._entries[key]
            return None
        return entry

    def _insert(self, key: str, entry: Entry, now: float) -> None:
        self._entries[key] = entry
        self._entries.move_to_end(key)
        evicted = 0
        while len(self._entries) > self._max:
            _, oldest = self._entries.popitem(last=False)
            if now - oldest.touched <= self._idle:
                evicted += 1
        if evicted:
            self._on_evict(evicted)

    async def begin_turn(self, key: str, now: float) -> tuple[int, Entry | None]:
        entry = self._live(key, now)
        previous = replace(entry) if entry is not None else None
        if entry is None:
            entry = Entry()
        entry.turn += 1
        entry.params = None
        entry.touched = now
        self._insert(key, entry, now)
        return entry.turn, previous

    async def finish_turn(self, key, turn, now, params, expires_at, digest) -> None:
        entry = self._live(key, now)
        if entry is None:
            entry = Entry(turn=turn)
        entry.ended_at = now
        entry.touched = now
        if params is not None and turn >= entry.stored_turn:
            entry.params, entry.expires_at, entry.digest = params, expires_at, digest
            entry.stored_at, entry.stored_turn = now, turn
        self._insert(key, entry, now)

    async def size(self) -> int:
        return len(self._entries)

    async def close(self) -> None:
        return None


_BEGIN = """
local t = redis.call('HINCRBY', KEYS[1], 't', 1)
local v = redis.call('HMGET', KEYS[1], 'p', 'x', 's', 'e', 'd', 'st')
redis.call('HDEL', KEYS[1], 'p')
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[2], KEYS[1])
local evicted = 0
if t == 1 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', tonumber(ARGV[2]) - tonumber(ARGV[1]))
  local over = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[3])
  if over > 0 then
    local victims = redis.call('ZPOPMIN', KEYS[2], over)
    for i = 1, #victims, 2 do redis.call('DEL', victims[i]) end
    evicted = over
  end
end
return {t, v[1], v[2], v[3], v[4], v[5], v[6], evicted}
"""

_FINISH = """
redis.call('HSETNX', KEYS[1], 't', ARGV[1])
redis.call('HSET', KEYS[1], 'e', ARGV[2])
if ARGV[3] ~= '' then
  local st = tonumber(redis.call('HGET', KEYS[1], 'st') or '0')
  if tonumber(ARGV[1]) >= st then
    redis.call('HSET', KEYS[1], 'p', ARGV[3], 'x', ARGV[4], 's', ARGV[2], 'd', ARGV[5],
               'st', ARGV[1])
  end
end
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('ZADD', KEYS[2], ARGV[2], KEYS[1])
return 1
"""


def _float(value) -> float | None:
    return float(value) if value not in (None, b"", "") else None


def _json(value) -> Any:
    return json.loads(value) if value not in (None, b"", "") else None


class RedisStore:
    """State in Redis under ``{prefix}conv:<tenant>:<conversation digest>`` hashes."""

    backend = "redis"

    def __init__(self, url: str, max_entries: int, conversation_ttl_s: float,
                 on_evict: EvictCallback | None = None, prefix: str = "kvobs:"):
        import redis.asyncio as aioredis

        self._redis = aioredis.Redis.from_url(url, socket_timeout=2.0,
                                              socket_connect_timeout=2.0)
        self._max = max_entries
        self._idle = max(1, int(conversation_ttl_s))
        self._on_evict = on_evict or (lambda n: None)
        self._prefix = prefix
        self._index = f"{prefix}conv-index"
        self._begin = self._redis.register_script(_BEGIN)
        self._finish = self._redis.register_script(_FINISH)

    def _key(self, key: str) -> str:
        return f"{self._prefix}conv:{key}"

    async def begin_turn(self, key: str, now: float) -> tuple[int, Entry | None]:
        t, p, x, s, e, d, st, evicted = await self._begin(
            keys=[self._key(key), self._index], args=[self._idle, now, self._max])
        if evicted:
            self._on_evict(int(evicted))
        turn = int(t)
        if turn == 1:
            return 1, None
        previous = Entry(turn=turn - 1, params=_json(p), expires_at=_float(x),
                         stored_at=_float(s), ended_at=_float(e), digest=_json(d),
                         stored_turn=int(st or 0), touched=now)
        return turn, previous

    async def finish_turn(self, key, turn, now, params, expires_at, digest) -> None:
        await self._finish(
            keys=[self._key(key), self._index],
            args=[turn, now, json.dumps(params) if params is not None else "",
                  expires_at if expires_at is not None else "",
                  json.dumps(digest) if digest is not None else "", self._idle])

    async def size(self) -> int:
        return int(await self._redis.zcard(self._index))

    async def close(self) -> None:
        await self._redis.aclose()


def now_wall() -> float:
    return time.time()
