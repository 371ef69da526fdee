"""The Redis metadata store: replicas share state and a restart loses nothing; every
operation is one Lua script (atomic across replicas), the entry cap a sorted-set index.
The protocol and the in-process store are in ``store``."""

from __future__ import annotations

import json
from typing import Any

from kvobs.proxy import store as _store
from kvobs.proxy._digest import Prefixes, extended, fingerprint
from kvobs.proxy.store import INFER_PER_TENANT, Begun, EvictCallback, Entry, Inferred


# Redis layout under the prefix (``kvobs:``): ``conv:<key>`` one hash a conversation
# (t turn, p params, x expiry, s stored at, e ended at, d digest, st stored turn, f its
# indexed fingerprint, tn its tenant); ``conv-index`` a sorted set of the conversations by
# last use (the entry cap); ``conv-tenant:<tenant>`` the tenant's keys by last use (its
# quota); ``conv-evicted`` the keys the cap pushed out (by time, at most
# EVICTED_MEMORY, none older than the idle TTL); per tenant ``infer:<tenant>`` fingerprint
# -> "<key>\n<conversation id>" and ``infer-order:<tenant>`` its fingerprints by time.
_LIB = r"""
local function unindex(p, tn, fp, key)
  local idx = p .. 'infer:' .. tn
  local v = redis.call('HGET', idx, fp)
  if v and string.sub(v, 1, #key + 1) == key .. '\n' then
    redis.call('HDEL', idx, fp)
    redis.call('ZREM', p .. 'infer-order:' .. tn, fp)
  end
end

local function tenant_index(p, key)
  return p .. 'conv-tenant:' .. (string.match(key, '^([^:]*):') or '')
end

-- Records a use of the conversation in both caps' orders (global and its tenant's).
local function touch(p, full, key, now, idle)
  redis.call('ZADD', p .. 'conv-index', now, full)
  local tidx = tenant_index(p, key)
  redis.call('ZADD', tidx, now, key)
  redis.call('EXPIRE', tidx, idle)
end

local function evict(p, key, now)
  local full = p .. 'conv:' .. key
  local ref = redis.call('HMGET', full, 'f', 'tn')
  if ref[1] and ref[2] then unindex(p, ref[2], ref[1], key) end
  redis.call('DEL', full)
  redis.call('ZREM', p .. 'conv-index', full)
  redis.call('ZREM', tenant_index(p, key), key)
  redis.call('ZADD', p .. 'conv-evicted', now, key)
end

-- The tenant's quota first (its own oldest go), then the global cap.
local function enforce_cap(p, now, idle, cap, keep, key, quota)
  local tidx = tenant_index(p, key)
  redis.call('ZREMRANGEBYSCORE', tidx, '-inf', now - idle)
  local over = redis.call('ZCARD', tidx) - quota
  if over > 0 then
    local victims = redis.call('ZPOPMIN', tidx, over)
    for i = 1, #victims, 2 do evict(p, victims[i], now) end
  else
    over = 0
  end
  local index = p .. 'conv-index'
  redis.call('ZREMRANGEBYSCORE', index, '-inf', now - idle)
  local gover = redis.call('ZCARD', index) - cap
  if gover > 0 then
    local victims = redis.call('ZPOPMIN', index, gover)
    local skip = #p + 5
    for i = 1, #victims, 2 do evict(p, string.sub(victims[i], skip + 1), now) end
    over = over + gover
  end
  if over > 0 then
    local evicted = p .. 'conv-evicted'
    redis.call('ZREMRANGEBYSCORE', evicted, '-inf', now - idle)
    redis.call('ZREMRANGEBYRANK', evicted, 0, -(keep + 1))
  end
  return over
end

local function index_as(p, key, tn, conv, fp, now, idle, cap)
  local full = p .. 'conv:' .. key
  local idx, order = p .. 'infer:' .. tn, p .. 'infer-order:' .. tn
  local old = redis.call('HGET', full, 'f')
  if old and old ~= fp then unindex(p, tn, old, key) end
  redis.call('HSET', idx, fp, key .. '\n' .. conv)
  redis.call('ZADD', order, now, fp)
  redis.call('HSET', full, 'f', fp, 'tn', tn)
  local over = redis.call('ZCARD', order) - cap
  if over > 0 then
    local gone = redis.call('ZPOPMIN', order, over)
    for i = 1, #gone, 2 do redis.call('HDEL', idx, gone[i]) end
  end
  redis.call('EXPIRE', idx, idle)
  redis.call('EXPIRE', order, idle)
end
"""

# KEYS[1] conversation; ARGV: prefix, idle, now, max entries, evicted memory, key,
# tenant quota
_BEGIN = (
    _LIB
    + """
local p, idle, now = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('HINCRBY', KEYS[1], 't', 1)
local v = redis.call('HMGET', KEYS[1], 'p', 'x', 's', 'e', 'd', 'st')
redis.call('HDEL', KEYS[1], 'p')
redis.call('EXPIRE', KEYS[1], idle)
touch(p, KEYS[1], ARGV[6], now, idle)
local evicted, was_evicted = 0, 0
if t == 1 then
  was_evicted = redis.call('ZREM', p .. 'conv-evicted', ARGV[6])
  evicted = enforce_cap(p, now, idle, tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6],
                        tonumber(ARGV[7]))
end
return {t, v[1], v[2], v[3], v[4], v[5], v[6], evicted, was_evicted}
"""
)

# KEYS[1] conversation; ARGV: prefix, idle, now, max entries, evicted memory, key, turn,
# params, expires at, digest, fingerprint, tenant, conversation id, fingerprints a tenant,
# tenant quota
_FINISH = (
    _LIB
    + """
local p, idle, now = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local created = redis.call('HSETNX', KEYS[1], 't', ARGV[7])
redis.call('HSET', KEYS[1], 'e', ARGV[3])
if ARGV[8] ~= '' then
  local st = tonumber(redis.call('HGET', KEYS[1], 'st') or '0')
  if tonumber(ARGV[7]) >= st then
    redis.call('HSET', KEYS[1], 'p', ARGV[8], 'x', ARGV[9], 's', ARGV[3], 'd', ARGV[10],
               'st', ARGV[7])
    if ARGV[11] ~= '' then
      index_as(p, ARGV[6], ARGV[12], ARGV[13], ARGV[11], now, idle, tonumber(ARGV[14]))
    end
  end
end
redis.call('EXPIRE', KEYS[1], idle)
touch(p, KEYS[1], ARGV[6], now, idle)
local evicted = 0
if created == 1 then
  redis.call('ZREM', p .. 'conv-evicted', ARGV[6])
  evicted = enforce_cap(p, now, idle, tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6],
                        tonumber(ARGV[15]))
end
return evicted
"""
)

# ARGV: prefix, tenant, candidate fingerprints longest first. The first whose conversation
# still exists; index entries of conversations that are gone are dropped on the way.
_RESOLVE = r"""
local p = ARGV[1]
local idx, order = p .. 'infer:' .. ARGV[2], p .. 'infer-order:' .. ARGV[2]
for i = 3, #ARGV do
  local v = redis.call('HGET', idx, ARGV[i])
  if v then
    local cut = string.find(v, '\n', 1, true)
    if cut and redis.call('EXISTS', p .. 'conv:' .. string.sub(v, 1, cut - 1)) == 1 then
      return v
    end
    redis.call('HDEL', idx, ARGV[i])
    redis.call('ZREM', order, ARGV[i])
  end
end
return false
"""


def _float(value) -> float | None:
    return float(value) if value not in (None, b"", "") else None


def _json(value) -> Any:
    return json.loads(value) if value not in (None, b"", "") else None


class RedisStore:
    """State in Redis under ``{prefix}conv:<tenant>:<conversation digest>`` hashes."""

    backend = "redis"

    def __init__(
        self,
        url: str,
        max_entries: int,
        conversation_ttl_s: float,
        on_evict: EvictCallback | None = None,
        prefix: str = "kvobs:",
        infer_per_tenant: int = INFER_PER_TENANT,
        max_per_tenant: int | None = None,
        pool_size: int = 512,
    ):
        from redis.exceptions import NoScriptError

        self._redis = redis_client(url, pool_size)
        self._no_script = NoScriptError
        self._max = max_entries
        self._quota = max_per_tenant or max_entries
        self._idle = max(1, int(conversation_ttl_s))
        self._on_evict = on_evict or (lambda n: None)
        self._prefix = prefix
        self._index = f"{prefix}conv-index"
        self._per_tenant = infer_per_tenant
        self._begin = self._redis.register_script(_BEGIN)
        self._finish = self._redis.register_script(_FINISH)
        self._resolve = self._redis.register_script(_RESOLVE)

    async def _run(self, script, keys: list, args: list):
        """``script`` by its SHA: redis-py's script wrapper costs more than the call
        (pipeline checks by isinstance, imports) on each of a turn's two scripts."""
        try:
            return await self._redis.evalsha(script.sha, len(keys), *keys, *args)
        except self._no_script:  # Redis restarted or flushed its scripts: the wrapper loads it
            return await script(keys=keys, args=args)

    def _key(self, key: str) -> str:
        return f"{self._prefix}conv:{key}"

    def _common(self, key: str, now: float) -> list:
        return [self._prefix, self._idle, now, self._max, _store.EVICTED_MEMORY, key]

    async def begin_turn(self, key: str, now: float) -> Begun:
        t, p, x, s, e, d, st, evicted, was_evicted = await self._run(
            self._begin, [self._key(key)], [*self._common(key, now), self._quota]
        )
        if evicted:
            self._on_evict(int(evicted))
        turn = int(t)
        if turn == 1:
            return Begun(1, None, bool(was_evicted))
        previous = Entry(
            turn=turn - 1,
            params=_json(p),
            expires_at=_float(x),
            stored_at=_float(s),
            ended_at=_float(e),
            digest=_json(d),
            stored_turn=int(st or 0),
            touched=now,
        )
        return Begun(turn, previous)

    async def finish_turn(
        self, key, turn, now, params, expires_at, digest, tenant=None, conversation_id=None
    ) -> None:
        fp = fingerprint(digest) if tenant is not None and conversation_id is not None else None
        evicted = await self._run(
            self._finish,
            [self._key(key)],
            [
                *self._common(key, now),
                turn,
                json.dumps(params) if params is not None else "",
                expires_at if expires_at is not None else "",
                json.dumps(digest) if digest is not None else "",
                fp or "",
                tenant or "",
                conversation_id or "",
                self._per_tenant,
                self._quota,
            ],
        )
        if evicted:
            self._on_evict(int(evicted))

    async def infer(self, tenant: str, prefixes: Prefixes, now: float) -> Inferred | None:
        candidates = await self._redis.zrange(f"{self._prefix}infer-order:{tenant}", 0, -1)
        found = extended(prefixes, [fp.decode() for fp in candidates])
        if not found:
            return None
        value = await self._resolve(keys=[], args=[self._prefix, tenant, *found])
        if not value:
            return None
        key, _, conversation_id = value.decode().partition("\n")
        return Inferred(key, conversation_id)

    async def size(self) -> int:
        return int(await self._redis.zcard(self._index))

    async def close(self) -> None:
        await self._redis.aclose()


def redis_client(url: str, pool_size: int, socket_timeout_s: float = 30.0):
    """An asyncio Redis client whose pool holds ``pool_size`` connections and makes
    callers wait for a free one (redis-py's default pool raises MaxConnectionsError past
    100); callers bound the wait with their own deadline (``StoreGuard``), which its
    connections feed with the Redis time of each command (``_store_clock``). redis-py's
    own socket timeouts are wall time, the loop's lag included: only a last resort here
    (a saturated proxy took over 2 s to open 256 connections at once)."""
    import redis.asyncio as aioredis

    from kvobs.proxy._store_clock import timed_connection_class

    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=pool_size,
        timeout=None,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
    )
    # The URL chose the class (TCP, TLS, Unix socket); its Redis time goes to the guard.
    # (A class is hashable; mypy checks the Hashable protocol against the instances' __hash__.)
    pool.connection_class = timed_connection_class(pool.connection_class)  # type: ignore[arg-type]
    return aioredis.Redis.from_pool(pool)  # closes the pool with the client
