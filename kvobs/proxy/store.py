"""Metadata store: conversation -> D's last params, their expiry, turn counter, digest.

Two backends behind one small protocol, chosen once at start:

- ``MemoryStore`` (default): one process, LRU-capped, idle entries dropped.
- ``RedisStore``: replicas share state and a restart loses nothing; every operation is
  one Lua script (atomic across replicas), the entry cap is a sorted-set index.

Params are single-use: ``begin_turn`` takes them out (D's blocks are released once P has
read them), bumps the turn counter and returns the previous state for the lookup.

Conversation inference: when ``finish_turn`` stores params with a tenant and a
conversation id, it also indexes the conversation under the fingerprint of the history
D's KV covers (``_digest.fingerprint``: kind, count, SHA-256; never text), one fingerprint
per conversation (its latest), at most ``infer_per_tenant`` per tenant (oldest dropped).
``infer`` finds the live conversation whose covered history a request extends, longest
first, within one tenant. An index entry goes with the entry it points to (evicted,
expired or superseded).

Entry caps: a global one (``max_entries``) and a per-tenant quota (``max_per_tenant``). A
new conversation of a tenant at its quota evicts that tenant's least recently used entry
first, so one tenant sending new conversation ids never evicts another tenant's entries
(only the global cap, once the tenants together reach it, evicts across tenants). The
tenant is the store key's part before the first ``:`` (``Identity.store_key``). Recently evicted keys are remembered (``EVICTED_MEMORY`` of them),
so a lookup can tell an evicted conversation from one never seen.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable, NamedTuple, Protocol

from kvobs.proxy._digest import Prefixes, extended, fingerprint

# Recently evicted keys each store remembers (a miss on one of them is "evicted").
EVICTED_MEMORY = 4096
# Fingerprints indexed per tenant for conversation inference (the oldest go first).
INFER_PER_TENANT = 1024


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


class Begun(NamedTuple):
    """What ``begin_turn`` found: this turn's index, the previous state (None: no entry)
    and, when there was no entry, whether the entry cap had pushed it out."""

    turn: int
    previous: Entry | None
    evicted: bool = False


class Inferred(NamedTuple):
    key: str  # store key
    conversation_id: str


class MetadataStore(Protocol):
    backend: str

    async def begin_turn(self, key: str, now: float) -> Begun:
        """Start a turn: this turn's index and the previous state; takes the params."""

    async def finish_turn(self, key: str, turn: int, now: float,
                          params: dict[str, Any] | None, expires_at: float | None,
                          digest: dict[str, Any] | None, tenant: str | None = None,
                          conversation_id: str | None = None) -> None:
        """End a turn; store D's params when there are any (and index the conversation
        by ``digest`` for ``infer`` when ``tenant`` and ``conversation_id`` are given)."""

    async def infer(self, tenant: str, prefixes: Prefixes, now: float) -> Inferred | None:
        """The live conversation of ``tenant`` whose covered history ``prefixes`` extends
        (the longest such), or None."""

    async def size(self) -> int | None: ...

    async def close(self) -> None: ...


EvictCallback = Callable[[int], None]


def tenant_of_key(key: str) -> str:
    """The tenant part of a store key (``Identity.store_key``: ``<tenant>:<digest>``).

    >>> tenant_of_key("0123abcd:ffee"), tenant_of_key("plain")
    ('0123abcd', '')
    """
    tenant, sep, _ = key.partition(":")
    return tenant if sep else ""


class MemoryStore:
    backend = "memory"

    def __init__(self, max_entries: int, conversation_ttl_s: float,
                 on_evict: EvictCallback | None = None,
                 infer_per_tenant: int = INFER_PER_TENANT,
                 max_per_tenant: int | None = None):
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._max = max_entries
        self._quota = max_per_tenant or max_entries
        # tenant -> its keys, least recently used first (the quota's eviction order)
        self._tenants: dict[str, OrderedDict[str, None]] = {}
        self._idle = conversation_ttl_s
        self._on_evict = on_evict or (lambda n: None)
        self._evicted: OrderedDict[str, None] = OrderedDict()
        # tenant -> fingerprint -> (key, conversation id); key -> (tenant, fingerprint)
        self._index: dict[str, OrderedDict[str, Inferred]] = {}
        self._indexed: dict[str, tuple[str, str]] = {}
        self._per_tenant = infer_per_tenant

    def _live(self, key: str, now: float) -> Entry | None:
        entry = self._entries.get(key)
        if entry is not None and now - entry.touched > self._idle:
            self._drop(key)
            return None
        return entry

    def _drop(self, key: str) -> Entry:
        entry = self._entries.pop(key)
        tenant = tenant_of_key(key)
        keys = self._tenants[tenant]
        del keys[key]
        if not keys:
            del self._tenants[tenant]
        self._unindex(key)
        return entry

    def _insert(self, key: str, entry: Entry, now: float) -> None:
        self._entries[key] = entry
        self._entries.move_to_end(key)
        keys = self._tenants.setdefault(tenant_of_key(key), OrderedDict())
        keys[key] = None
        keys.move_to_end(key)
        evicted = 0
        while len(keys) > self._quota:  # the tenant's own oldest first
            evicted += self._evict(next(iter(keys)), now)
        while len(self._entries) > self._max:
            evicted += self._evict(next(iter(self._entries)), now)
        if evicted:
            self._on_evict(evicted)

    def _evict(self, victim: str, now: float) -> int:
        """Drop ``victim`` for a cap; 1 when it was live (an eviction), 0 when idle."""
        if now - self._drop(victim).touched > self._idle:
            return 0
        self._evicted[victim] = None
        if len(self._evicted) > EVICTED_MEMORY:
            self._evicted.popitem(last=False)
        return 1

    def _unindex(self, key: str) -> None:
        tenant, fp = self._indexed.pop(key, (None, None))
        index = self._index.get(tenant)
        if index is not None and fp in index and index[fp].key == key:
            del index[fp]
            if not index:
                del self._index[tenant]

    def _index_as(self, key: str, tenant: str, conversation_id: str, fp: str) -> None:
        self._unindex(key)
        index = self._index.setdefault(tenant, OrderedDict())
        index[fp] = Inferred(key, conversation_id)  # same history: the latest wins
        index.move_to_end(fp)
        self._indexed[key] = (tenant, fp)
        while len(index) > self._per_tenant:
            index.popitem(last=False)

    async def begin_turn(self, key: str, now: float) -> Begun:
        entry = self._live(key, now)
        previous = replace(entry) if entry is not None else None
        evicted = False
        if entry is None:
            entry = Entry()
            evicted = key in self._evicted
            self._evicted.pop(key, None)
        entry.turn += 1
        entry.params = None
        entry.touched = now
        self._insert(key, entry, now)
        return Begun(entry.turn, previous, evicted)

    async def finish_turn(self, key, turn, now, params, expires_at, digest, tenant=None,
                          conversation_id=None) -> None:
        entry = self._live(key, now)
        if entry is None:
            entry = Entry(turn=turn)
            self._evicted.pop(key, None)
        entry.ended_at = now
        entry.touched = now
        if params is not None and turn >= entry.stored_turn:
            entry.params, entry.expires_at, entry.digest = params, expires_at, digest
            entry.stored_at, entry.stored_turn = now, turn
            fp = fingerprint(digest)
            if fp is not None and tenant is not None and conversation_id is not None:
                self._index_as(key, tenant, conversation_id, fp)
        self._insert(key, entry, now)

    async def infer(self, tenant: str, prefixes: Prefixes, now: float) -> Inferred | None:
        index = self._index.get(tenant)
        if not index:
            return None
        for fp in extended(prefixes, list(index)):
            found = index.get(fp)
            if found is not None and self._live(found.key, now) is not None:
                return found
        return None

    async def size(self) -> int:
        return len(self._entries)

    async def close(self) -> None:
        return None


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
_BEGIN = _LIB + """
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

# KEYS[1] conversation; ARGV: prefix, idle, now, max entries, evicted memory, key, turn,
# params, expires at, digest, fingerprint, tenant, conversation id, fingerprints a tenant,
# tenant quota
_FINISH = _LIB + """
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

    def __init__(self, url: str, max_entries: int, conversation_ttl_s: float,
                 on_evict: EvictCallback | None = None, prefix: str = "kvobs:",
                 infer_per_tenant: int = INFER_PER_TENANT,
                 max_per_tenant: int | None = None, pool_size: int = 512):
        self._redis = redis_client(url, pool_size)
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

    def _key(self, key: str) -> str:
        return f"{self._prefix}conv:{key}"

    def _common(self, key: str, now: float) -> list:
        return [self._prefix, self._idle, now, self._max, EVICTED_MEMORY, key]

    async def begin_turn(self, key: str, now: float) -> Begun:
        t, p, x, s, e, d, st, evicted, was_evicted = await self._begin(
            keys=[self._key(key)], args=[*self._common(key, now), self._quota])
        if evicted:
            self._on_evict(int(evicted))
        turn = int(t)
        if turn == 1:
            return Begun(1, None, bool(was_evicted))
        previous = Entry(turn=turn - 1, params=_json(p), expires_at=_float(x),
                         stored_at=_float(s), ended_at=_float(e), digest=_json(d),
                         stored_turn=int(st or 0), touched=now)
        return Begun(turn, previous)

    async def finish_turn(self, key, turn, now, params, expires_at, digest, tenant=None,
                          conversation_id=None) -> None:
        fp = fingerprint(digest) if tenant is not None and conversation_id is not None \
            else None
        evicted = await self._finish(
            keys=[self._key(key)],
            args=[*self._common(key, now), turn,
                  json.dumps(params) if params is not None else "",
                  expires_at if expires_at is not None else "",
                  json.dumps(digest) if digest is not None else "",
                  fp or "", tenant or "", conversation_id or "", self._per_tenant,
                  self._quota])
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
        url, max_connections=pool_size, timeout=None, socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s)
    # The URL chose the class (TCP, TLS, Unix socket); its Redis time goes to the guard.
    pool.connection_class = timed_connection_class(pool.connection_class)
    return aioredis.Redis.from_pool(pool)  # closes the pool with the client


def now_wall() -> float:
    return time.time()
