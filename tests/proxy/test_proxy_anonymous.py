"""Anonymous clients and tenants (#26 item 4): anonymous isolation is never silent (a
counter, a miss reason on the turn span, a remedy naming the flag), a trusted tenant
header for deployments behind an authenticating gateway, and a bound on new tenants per
window against invented keys."""

from __future__ import annotations

import asyncio

from harness import Harness
from test_proxy_flow import LOOKUP, TURN, run

from kvobs import semconv as sc
from kvobs.proxy.app import PROXY_KEY

NO_KEY = {"Authorization": ""}


def _sent(h: Harness, index: int) -> bool:
    return h.prefill.requests[index]["kv_transfer_params"]["remote_block_ids"] is not None


async def _two_turns(h: Harness, headers: dict, conversation: str | None = "c") -> list:
    messages = [{"role": "user", "content": "q1"}]
    for _ in range(2):
        body = {"messages": messages}
        if conversation is not None:
            body["conversation_id"] = conversation
        status, out = await h.post(body, headers=headers)
        assert status == 200, out
        messages = messages + [out["choices"][0]["message"], {"role": "user", "content": "q"}]
    await asyncio.sleep(0.02)
    return messages


def test_anonymous_turns_are_counted_and_their_miss_says_why():
    async def scenario():
        async with Harness() as h:
            await _two_turns(h, NO_KEY)  # an id, no key
            await _two_turns(h, NO_KEY, conversation=None)  # no id, no key
            await _two_turns(h, {"Authorization": "Bearer sk-a"})
            assert h.proxy.metric("kvobs_proxy_anonymous_turns_total") == 4
            turns = h.proxy.spans(TURN)
            reasons = [s.attributes.get(sc.LOOKUP_MISS_REASON.key) for s in turns]
            outcomes = [s.attributes[sc.LOOKUP_OUTCOME.key] for s in turns]
            assert reasons[:4] == ["anonymous"] * 4
            assert outcomes == ["miss", "miss", "no-id", "no-id", "miss", "hit"]
            assert reasons[4:] == ["never-seen", None]
            assert not _sent(h, 1) and not _sent(h, 3) and _sent(h, 5)
    run(scenario())


def test_diagnose_turns_the_anonymous_miss_into_a_remedy_naming_the_flag():
    from kvobs.verdicts.missing_metadata import _remedy

    for lookup in ("miss", "no-id"):
        remedy = _remedy({"lookup": lookup, "lookup_miss_reason": "anonymous"})
        assert "--anonymous-tenant shared" in remedy and "--trusted-tenant-header" in remedy
    limited = _remedy({"lookup": "miss", "lookup_miss_reason": "tenant-limited"})
    assert "--max-new-tenants" in limited
    # an id-less turn of a client with a key keeps its own remedy
    assert "conversation_id" in _remedy({"lookup": "no-id",
                                         "lookup_miss_reason": "never-seen"})


def test_trusted_tenant_header_is_the_tenant_behind_a_gateway():
    async def scenario():
        async with Harness(trusted_tenant_header="X-Tenant") as h:
            # the gateway authenticated the client and dropped its key: reuse
            await _two_turns(h, {**NO_KEY, "X-Tenant": "acme"})
            assert _sent(h, 1)
            # another tenant's client, same conversation id: never acme's KV
            await _two_turns(h, {**NO_KEY, "X-Tenant": "globex"})
            assert not _sent(h, 2) and _sent(h, 3)
            lookups = h.proxy.spans(LOOKUP)
            tenants = [s.attributes[sc.TENANT_DIGEST.key] for s in lookups]
            assert tenants[0] == tenants[1] != tenants[2] == tenants[3]
            # without the header: the API key, as before
            await _two_turns(h, {"Authorization": "Bearer sk-a"})
            assert _sent(h, 5)
            assert h.proxy.metric("kvobs_proxy_anonymous_turns_total") == 0
    run(scenario())


def test_new_tenants_per_window_are_bounded_against_invented_keys():
    async def scenario():
        async with Harness(max_new_tenants=2, new_tenant_window_s=3600,
                           max_entries=4, max_entries_per_tenant=4) as h:
            victim = {"Authorization": "Bearer sk-victim"}
            history = await _two_turns(h, victim, "victim-chat")
            assert _sent(h, 1)
            # an attacker invents keys: the first is admitted, the rest are not
            for i in range(8):
                status, _ = await h.post({"messages": [{"role": "user", "content": "x"}],
                                          "conversation_id": f"spam-{i}"},
                                         headers={"Authorization": f"Bearer made-up-{i}"})
                assert status == 200
            assert h.proxy.metric("kvobs_proxy_new_tenants_total") == 2
            assert h.proxy.metric("kvobs_proxy_tenant_limited_turns_total") == 7
            store = h.proxy._runner.app[PROXY_KEY].store
            assert await store.size() == 2  # the victim's and one invented key's
            # the victim's conversation survived: its next turn reads its KV
            status, _ = await h.post({"messages": history, "conversation_id": "victim-chat"},
                                     headers=victim)
            assert status == 200 and _sent(h, len(h.prefill.requests) - 1)
            await asyncio.sleep(0.02)
            limited = [s for s in h.proxy.spans(TURN)
                       if s.attributes.get(sc.LOOKUP_MISS_REASON.key) == "tenant-limited"]
            assert len(limited) == 7
    run(scenario())


def test_without_a_bound_invented_keys_evict_the_victim():
    """The threat the bound answers (the default is no bound)."""
    async def scenario():
        async with Harness(max_entries=4, max_entries_per_tenant=4) as h:
            victim = {"Authorization": "Bearer sk-victim"}
            history = await _two_turns(h, victim, "victim-chat")
            for i in range(8):
                await h.post({"messages": [{"role": "user", "content": "x"}],
                              "conversation_id": f"spam-{i}"},
                             headers={"Authorization": f"Bearer made-up-{i}"})
            status, _ = await h.post({"messages": history, "conversation_id": "victim-chat"},
                                     headers=victim)
            assert status == 200 and not _sent(h, len(h.prefill.requests) - 1)
    run(scenario())
