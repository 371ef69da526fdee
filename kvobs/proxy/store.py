"""Metadata store: conversation -> D's last params, their expiry, turn counter, digest.

Two backends behind one small protocol, chosen once at start:

- ``MemoryStore`` (default): one process, LRU-capped, idle entries dropped.
- ``RedisStore`` (``redis_store``): replicas share state and a restart loses nothing;
  every operation is one Lua script (atomic across replicas), the entry cap is a
  sorted-set index.

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
tenant is the store key's part before the first ``:`` (``Identity.store_key``). Recently
evicted keys are remembered (``EVICTED_MEMORY`` of them), so a lookup can tell an
evicted conversation from one never seen.
"""

from __future__ import annotations

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

    async def finish_turn(
        self,
        key: str,
        turn: int,
        now: float,
        params: dict[str, Any] | None,
        expires_at: float | None,
        digest: dict[str, Any] | None,
        tenant: str | None = None,
        conversation_id: str | None = None,
    ) -> None:
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

    def __init__(
        self,
        max_entries: int,
        conversation_ttl_s: float,
        on_evict: EvictCallback | None = None,
        infer_per_tenant: int = INFER_PER_TENANT,
        max_per_tenant: int | None = None,
    ):
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
        indexed = self._indexed.pop(key, None)
        if indexed is None:
            return
        tenant, fp = indexed
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

    async def finish_turn(
        self, key, turn, now, params, expires_at, digest, tenant=None, conversation_id=None
    ) -> None:
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
