"""Tenancy (#10 defects 2 and 3): anonymous clients never share reuse unless the operator
opts in; one tenant's new conversations never evict another tenant's entries."""

from __future__ import annotations

import asyncio

import pytest
from harness import Harness
from test_proxy_flow import LOOKUP, outcomes, run

from kvobs.proxy.app import PROXY_KEY
from kvobs.proxy.redis_store import RedisStore
from kvobs.proxy.store import MemoryStore
from kvobs import semconv as sc

ALICE = {"Authorization": "Bearer sk-alice"}
BOB = {"Authorization": "Bearer sk-bob"}
# No key, an empty header, and an empty Bearer key (HTTP strips it to "Bearer").
ANONYMOUS = ({"Authorization": ""}, {"Authorization": "Bearer "}, {"Authorization": "Bearer"})
_NO_KEY = {"Authorization": ""}


def _sent(h: Harness, index: int) -> bool:
    """P's request ``index`` carried D's params (a read of someone's KV)."""
    return h.prefill.requests[index]["kv_transfer_params"]["remote_block_ids"] is not None


async def _chat(h: Harness, headers: dict, conversation: str | None, messages: list):
    body = {"messages": messages}
    if conversation is not None:
        body["conversation_id"] = conversation
    status, out = await h.post(body, headers=headers)
    assert status == 200, out
    return messages + [out["choices"][0]["message"]]


@pytest.mark.parametrize("victim", ANONYMOUS)
def test_anonymous_clients_never_read_each_others_kv(victim):
    async def scenario():
        async with Harness() as h:
            first = [{"role": "user", "content": "my secret plan"}]
            history = await _chat(h, _NO_KEY, "chat-1", first)
            # another client without a key, same (guessable) conversation id, turn 2
            history.append({"role": "user", "content": "go on"})
            await _chat(h, victim, "chat-1", history)
            assert not _sent(h, 1)
            await asyncio.sleep(0.02)
            lookups = h.proxy.spans(LOOKUP)
            assert [s.attributes[sc.LOOKUP_OUTCOME.key] for s in lookups] == ["miss", "miss"]
            assert lookups[1].attributes[sc.LOOKUP_MISS_REASON.key] == "anonymous"
            # no entries: nothing of an anonymous client is kept
            assert await h.proxy._runner.app[PROXY_KEY].store.size() == 0
    run(scenario())


def test_anonymous_idless_requests_are_never_inferred_across_clients():
    async def scenario():
        async with Harness() as h:
            status, out = await h.post({"prompt": "system: be terse. Q1:"},
                                       path="/v1/completions", headers=_NO_KEY)
            assert status == 200
            text = "system: be terse. Q1:" + out["choices"][0]["text"]
            status, _ = await h.post({"prompt": text + " Q2:"}, path="/v1/completions",
                                     headers=_NO_KEY)
            assert status == 200 and not _sent(h, 1)
            assert outcomes(h.proxy) == ["no-id", "no-id"]
    run(scenario())


def test_anonymous_shared_is_an_operator_opt_in():
    async def scenario():
        async with Harness(anonymous_tenant="shared") as h:
            history = await _chat(h, _NO_KEY, "chat-1", [{"role": "user", "content": "a"}])
            history.append({"role": "user", "content": "b"})
            await _chat(h, {"Authorization": "Bearer"}, "chat-1", history)
            assert _sent(h, 1) and outcomes(h.proxy) == ["miss", "hit"]
    run(scenario())


def test_keyed_tenants_still_reuse_their_own_kv():
    async def scenario():
        async with Harness() as h:
            history = await _chat(h, ALICE, "c", [{"role": "user", "content": "a"}])
            history.append({"role": "user", "content": "b"})
            await _chat(h, ALICE, "c", history)
            assert _sent(h, 1)
    run(scenario())


# --------------------------------------------------------------------------- quotas


@pytest.fixture(params=["memory", "redis"])
def capped_store(request):
    def make(max_entries: int, quota: int, evictions: list):
        if request.param == "memory":
            return MemoryStore(max_entries, 3600.0, evictions.append, max_per_tenant=quota)
        url = request.getfixturevalue("redis_url")
        return RedisStore(url, max_entries, 3600.0, evictions.append, max_per_tenant=quota)
    return make


def test_one_tenant_flooding_new_ids_evicts_only_its_own(capped_store):
    async def scenario():
        evictions: list[int] = []
        store = capped_store(20, 10, evictions)
        now = 1000.0
        try:
            for i in range(3):
                await store.begin_turn(f"alice:c{i}", now)
                await store.finish_turn(f"alice:c{i}", 1, now, {"p": i}, now + 60, None)
            for i in range(50):  # bob sends 50 new conversation ids
                now += 0.01
                await store.begin_turn(f"bob:n{i}", now)
            assert sum(evictions) == 40  # bob's own oldest, beyond its quota of 10
            for i in range(3):
                begun = await store.begin_turn(f"alice:c{i}", now + 1)
                assert begun.previous is not None and begun.previous.params == {"p": i}
            begun = await store.begin_turn("bob:n0", now + 2)
            assert begun.previous is None and begun.evicted  # bob's oldest went first
            assert await store.size() == 13  # 3 + bob at its quota (n0 again pushed n40)
            # the global cap still holds across tenants
            for i in range(30):
                await store.begin_turn(f"t{i}:x", now + 3 + i * 0.01)
            assert await store.size() == 20
        finally:
            await store.close()
    asyncio.run(scenario())


def test_quota_through_the_proxy():
    async def scenario():
        async with Harness(max_entries=20, max_entries_per_tenant=5) as h:
            history = await _chat(h, ALICE, "keep", [{"role": "user", "content": "a"}])
            for i in range(30):
                await _chat(h, BOB, f"flood-{i}", [{"role": "user", "content": "x"}])
            history.append({"role": "user", "content": "b"})
            await _chat(h, ALICE, "keep", history)
            assert _sent(h, 31) and outcomes(h.proxy)[-1] == "hit"
            assert h.proxy.metric("kvobs_proxy_evictions_total") == 25
    run(scenario())
