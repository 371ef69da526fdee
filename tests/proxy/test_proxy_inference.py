"""Conversation inference: a request without a conversation id continues the tenant's
conversation whose covered history it extends; miss reasons and the proxy's identity on
every lookup span."""

from __future__ import annotations

import asyncio
import time

import pytest
from harness import CLIENT_KEY, Harness
from test_proxy_flow import LOOKUP, TURN, converse, outcomes, run

from kvobs.proxy._digest import Prefixes, history_digest
from kvobs.proxy.app import PROXY_KEY
from kvobs.proxy.redis_store import RedisStore
from kvobs.proxy.store import MemoryStore
from kvobs import semconv as sc

COMPLETIONS = "/v1/completions"
STORE = sc.SPAN_PROXY_STORE.name
ALICE = {"Authorization": "Bearer sk-alice"}
BOB = {"Authorization": "Bearer sk-bob"}


async def post(h: Harness, body: dict, path: str = COMPLETIONS, headers: dict | None = None,
               proxy=None) -> tuple[dict, dict]:
    """One non-streamed turn: its answer and the response headers."""
    proxy = proxy or h.proxy
    async with h.session.post(proxy.url + path, json=body,
                              headers={**CLIENT_KEY, **(headers or {})}) as response:
        assert response.status == 200, await response.text()
        return await response.json(), dict(response.headers)


async def complete(h: Harness, prompt: str, **kw) -> tuple[str, dict]:
    """Sends ``prompt`` without a conversation id; returns prompt + D's completion."""
    out, headers = await post(h, {"model": "m", "prompt": prompt}, **kw)
    return prompt + out["choices"][0]["text"], headers


async def index_size(h: Harness) -> int:
    """Fingerprints the proxy's store holds for inference, all tenants."""
    store = h.proxy._runner.app[PROXY_KEY].store
    if isinstance(store, MemoryStore):
        return sum(len(index) for index in store._index.values())
    total = 0
    async for key in store._redis.scan_iter(match="kvobs:infer:*"):
        total += await store._redis.hlen(key)
    return total


def lookup_attr(proxy, key: str) -> list:
    return [s.attributes.get(key) for s in proxy.spans(LOOKUP)]


def turn_ids(proxy) -> list[tuple[str | None, int | None]]:
    return [(s.attributes.get(sc.CONVERSATION_ID.key), s.attributes.get(sc.TURN_INDEX.key))
            for s in proxy.spans(TURN)]


def trace_of(span) -> str:
    return format(span.context.trace_id, "032x")


def test_idless_completions_conversation_is_inferred_and_reuses_d_kv():
    async def scenario():
        async with Harness() as h:
            text, headers1 = await complete(h, "You are terse. Q1:")
            text, headers2 = await complete(h, text + " Q2:")
            _, headers3 = await complete(h, text + " Q3:")
            await asyncio.sleep(0.02)
            assert outcomes(h.proxy) == ["no-id", "hit", "hit"]
            assert lookup_attr(h.proxy, sc.LOOKUP_INFERRED.key) == [False, True, True]
            # P read D's blocks of the previous turn, exactly as for an id'd request
            assert len(h.prefill.reads) == 2
            assert h.prefill.requests[1]["kv_transfer_params"]["remote_block_ids"] == [[100]]
            assert h.prefill.requests[2]["kv_transfer_params"]["remote_block_ids"] == [[101]]
            # one conversation, named as kvobs names an id-less turn 1, turns 1, 2, 3
            first = h.proxy.spans(TURN)[0]
            conversation = sc.ANONYMOUS_PREFIX + trace_of(first)
            assert turn_ids(h.proxy) == [(conversation, 1), (conversation, 2),
                                         (conversation, 3)]
            for engine in (h.prefill, h.decode):
                keys = [(r["kv_transfer_params"][sc.KTP_CONVERSATION_ID],
                         r["kv_transfer_params"][sc.KTP_TURN_INDEX]) for r in engine.requests]
                assert keys == [(conversation, 1), (conversation, 2), (conversation, 3)]
            # every answer names the conversation in the header a client sends ids in
            for headers in (headers1, headers2, headers3):
                assert headers["X-Session-ID"] == conversation
            assert headers1[sc.TRACE_ID_HEADER] == trace_of(first)
            # hit, not a lucky guess: the store span says D's params were refreshed
            actions = [s.attributes[sc.STORE_ACTION.key] for s in h.proxy.spans(STORE)]
            assert actions == ["stored", "refreshed", "refreshed"]
    run(scenario())


def test_client_can_adopt_the_returned_conversation_id():
    async def scenario():
        async with Harness() as h:
            text, headers = await complete(h, "hello")
            adopted = headers["X-Session-ID"]
            _, headers = await post(h, {"prompt": text + " more", "conversation_id": adopted})
            await asyncio.sleep(0.02)
            assert outcomes(h.proxy) == ["no-id", "hit"]
            # an id'd request: no inference recorded, no id returned
            assert lookup_attr(h.proxy, sc.LOOKUP_INFERRED.key) == [False, None]
            assert "X-Session-ID" not in headers
            assert turn_ids(h.proxy)[1] == (adopted, 2)
    run(scenario())


def test_an_inferred_id_that_is_no_header_value_is_not_returned():
    async def scenario():
        async with Harness() as h:
            out, _ = await post(h, {"prompt": "p", "conversation_id": "a\r\nX-Evil: 1"})
            _, headers = await complete(h, "p" + out["choices"][0]["text"] + "!")
            await asyncio.sleep(0.02)
            assert outcomes(h.proxy) == ["miss", "hit"]
            assert "X-Session-ID" not in headers and "X-Evil" not in headers
    run(scenario())


def test_idless_chat_conversation_is_inferred_streaming():
    async def scenario():
        async with Harness(decode_kw={"stream_params": True}) as h:
            await converse(h, None, 3, stream=True)
            assert outcomes(h.proxy) == ["no-id", "hit", "hit"]
            assert lookup_attr(h.proxy, sc.LOOKUP_INFERRED.key) == [False, True, True]
            assert len(h.prefill.reads) == 2
            conversation = sc.ANONYMOUS_PREFIX + trace_of(h.proxy.spans(TURN)[0])
            assert turn_ids(h.proxy) == [(conversation, 1), (conversation, 2),
                                         (conversation, 3)]
    run(scenario())


def test_chat_inference_takes_the_longest_covered_history():
    """Conversation y began from x's first turn: a request extending y's history extends
    x's too and continues y; one extending only x's continues x."""
    async def scenario():
        async with Harness() as h:
            x, _ = await converse(h, "x", 1)
            y = x + [{"role": "user", "content": "branch"}]
            status, out = await h.post({"messages": y, "conversation_id": "y"})
            assert status == 200
            y.append(out["choices"][0]["message"])
            await h.post({"messages": y + [{"role": "user", "content": "on y"}]})
            await h.post({"messages": x + [{"role": "user", "content": "on x"}]})
            await asyncio.sleep(0.02)
            assert outcomes(h.proxy) == ["miss", "miss", "hit", "hit"]
            assert lookup_attr(h.proxy, sc.LOOKUP_INFERRED.key) == [None, None, True, True]
            assert turn_ids(h.proxy)[2:] == [("y", 3), ("x", 2)]
    run(scenario())


def test_tenants_with_identical_prompts_never_infer_across():
    async def scenario():
        async with Harness() as h:
            text, _ = await complete(h, "shared system prompt:", headers=ALICE)
            follow_up = text + " next"
            _, bob = await complete(h, follow_up, headers=BOB)
            _, alice = await complete(h, follow_up, headers=ALICE)
            await asyncio.sleep(0.02)
            assert outcomes(h.proxy) == ["no-id", "no-id", "hit"]
            assert lookup_attr(h.proxy, sc.LOOKUP_INFERRED.key) == [False, False, True]
            # bob's P request carried no params; alice's second turn read her own KV
            assert h.prefill.requests[1]["kv_transfer_params"]["remote_block_ids"] is None
            assert len(h.prefill.reads) == 1
            ids = turn_ids(h.proxy)
            assert ids[1][1] == 1 and ids[1][0] != ids[0][0]
            assert ids[2] == (ids[0][0], 2)
            assert bob["X-Session-ID"] != alice["X-Session-ID"] == ids[0][0]
    run(scenario())


def test_no_infer_conversations_keeps_no_id():
    async def scenario():
        async with Harness(infer_conversations=False) as h:
            text, headers = await complete(h, "hello")
            await complete(h, text + " more")
            await asyncio.sleep(0.02)
            assert outcomes(h.proxy) == ["no-id", "no-id"]
            assert h.prefill.reads == []
            assert lookup_attr(h.proxy, sc.LOOKUP_INFERRED.key) == [None, None]
            # today's behaviour: no conversation id anywhere, nothing stored
            assert turn_ids(h.proxy) == [(None, 1), (None, 1)]
            assert sc.KTP_CONVERSATION_ID not in h.prefill.requests[1]["kv_transfer_params"]
            assert "X-Session-ID" not in headers
            assert h.proxy.spans(STORE) == []
            await converse(h, "with-id", 1)  # stored, and not indexed: no hashes kept
            assert await index_size(h) == 0
    run(scenario())


def test_a_prompt_extending_nothing_stays_no_id_turn_1():
    async def scenario():
        async with Harness() as h:
            text, _ = await complete(h, "abc")
            await complete(h, "zzz" + text)  # contains it, does not start with it
            await complete(h, text[:-1])  # a prefix of the covered history, not an extension
            await asyncio.sleep(0.02)
            assert outcomes(h.proxy) == ["no-id", "no-id", "no-id"]
            assert lookup_attr(h.proxy, sc.LOOKUP_INFERRED.key) == [False, False, False]
            ids = turn_ids(h.proxy)
            assert [turn for _, turn in ids] == [1, 1, 1]
            assert len({conversation for conversation, _ in ids}) == 3
            assert h.prefill.reads == []
    run(scenario())


def test_inference_survives_a_restart_with_redis_and_keeps_no_text(redis_url):
    async def scenario():
        import redis.asyncio as aioredis

        async with Harness(store_backend="redis", redis_url=redis_url) as h:
            text, headers = await complete(h, "secret prompt:")
            first = h.proxy
            await first.stop()  # the proxy restarts; Redis keeps the index
            second = await h.add_proxy()
            await complete(h, text + " again", proxy=second)
            await asyncio.sleep(0.02)
            assert outcomes(second) == ["hit"]
            assert lookup_attr(second, sc.LOOKUP_INFERRED.key) == [True]
            assert turn_ids(second) == [(headers["X-Session-ID"], 2)]
            assert len(h.prefill.reads) == 1
            (before,) = first.spans(LOOKUP)
            (after,) = second.spans(LOOKUP)
            assert before.attributes[sc.PROXY_INSTANCE.key] != \
                after.attributes[sc.PROXY_INSTANCE.key]
            assert before.attributes[sc.PROXY_STARTED_AT.key] < \
                after.attributes[sc.PROXY_STARTED_AT.key]
            # counts and hashes only: no prompt or completion text in Redis
            client = aioredis.Redis.from_url(redis_url)
            try:
                dump = []
                async for key in client.scan_iter():
                    kind = (await client.type(key)).decode()
                    if kind == "hash":
                        dump.append(repr(await client.hgetall(key)))
                    elif kind == "zset":
                        dump.append(repr(await client.zrange(key, 0, -1)))
                    elif kind == "string":
                        dump.append(repr(await client.get(key)))
                    dump.append(repr(key))
                blob = "\n".join(dump)
                assert any(b"infer:" in key.encode() for key in dump)
                assert "secret" not in blob and "r1." not in blob
            finally:
                await client.aclose()
    run(scenario())


@pytest.fixture(params=["memory", "redis"])
def backend(request) -> dict:
    if request.param == "memory":
        return {}
    return {"store_backend": "redis", "redis_url": request.getfixturevalue("redis_url")}


def test_index_is_capped_per_tenant(backend):
    async def scenario():
        async with Harness(infer_per_tenant=2, **backend) as h:
            a, _ = await complete(h, "A:")
            b, _ = await complete(h, "B:")
            c, _ = await complete(h, "C:")  # pushes A's fingerprint out
            await complete(h, "D:", headers=BOB)  # another tenant's index: no effect
            await complete(h, c + " more")
            await complete(h, b + " more")
            await complete(h, a + " more")
            await asyncio.sleep(0.02)
            assert outcomes(h.proxy)[4:] == ["hit", "hit", "no-id"]
            assert await index_size(h) == 3  # two of the first tenant's, one of bob's
    run(scenario())


def test_index_entry_goes_with_its_evicted_entry(backend):
    async def scenario():
        async with Harness(max_entries=1, **backend) as h:
            a, _ = await complete(h, "A:")
            b, _ = await complete(h, "B:")  # the cap evicts A's entry
            assert await index_size(h) == 1  # B's: A's went with A's entry
            await complete(h, a + " more")
            await asyncio.sleep(0.02)
            assert outcomes(h.proxy) == ["no-id", "no-id", "no-id"]
            assert h.proxy.metric("kvobs_proxy_evictions_total") >= 1
    run(scenario())


# ---------------------------------------------------------------------- miss reasons


def test_miss_reasons_never_seen_and_not_stored():
    async def scenario():
        async with Harness() as h:  # streams carry no params: nothing stored
            await converse(h, "s", 2, stream=True)
            await converse(h, "fresh", 1)
            await complete(h, "no id, nothing to infer")
            await asyncio.sleep(0.02)
            assert outcomes(h.proxy) == ["miss", "miss", "miss", "no-id"]
            assert lookup_attr(h.proxy, sc.LOOKUP_MISS_REASON.key) == [
                "never-seen", "not-stored", "never-seen", "never-seen"]
            # the turn that stored nothing still has its store span
            actions = [s.attributes[sc.STORE_ACTION.key] for s in h.proxy.spans(STORE)]
            assert actions[:2] == ["skipped", "skipped"]
    run(scenario())


def test_miss_reason_evicted(backend):
    async def scenario():
        async with Harness(max_entries=1, **backend) as h:
            a, _ = await converse(h, "a", 1)
            await converse(h, "b", 1)  # pushes a out
            a.append({"role": "user", "content": "back"})
            _, out = await h.post({"messages": a, "conversation_id": "a"})  # evicted
            a += [out["choices"][0]["message"], {"role": "user", "content": "again"}]
            await h.post({"messages": a, "conversation_id": "a"})  # a exists again
            await asyncio.sleep(0.02)
            assert outcomes(h.proxy) == ["miss", "miss", "miss", "hit"]
            assert lookup_attr(h.proxy, sc.LOOKUP_MISS_REASON.key) == [
                "never-seen", "never-seen", "evicted", None]
    run(scenario())


def test_every_lookup_names_the_proxy_instance():
    async def scenario():
        async with Harness() as h:
            started = time.time()
            await converse(h, "x", 2)
            replica = await h.add_proxy()
            await converse(h, "y", 1, proxy=replica)
            spans = h.proxy.spans(LOOKUP) + replica.spans(LOOKUP)
            instances = [s.attributes[sc.PROXY_INSTANCE.key] for s in spans]
            assert instances[0] == instances[1] != instances[2]
            assert all(len(i) == 16 for i in instances)
            for span in spans:
                started_at = span.attributes[sc.PROXY_STARTED_AT.key]
                assert started - 60 < started_at <= span.start_time / 1e9
    run(scenario())


# ---------------------------------------------------------------------- store contract


def _stores(redis_url=None):
    yield MemoryStore(100, 3600.0, infer_per_tenant=8)
    if redis_url:
        yield RedisStore(redis_url, 100, 3600.0, infer_per_tenant=8)


def test_store_index_longest_live_match_tenant_scoped(redis_url):
    params = {"remote_block_ids": [[1]]}

    def covered(prompt: str, reply: str) -> dict:
        return history_digest({"prompt": prompt}, None, reply)

    def prefixes(prompt: str) -> Prefixes:
        return Prefixes.of({"prompt": prompt})

    async def scenario(store):
        now = time.time()
        try:
            await store.finish_turn("t1:a", 1, now, params, now + 60, covered("ab", "cd"),
                                    "t1", "conv-a")
            await store.finish_turn("t1:b", 1, now, params, now + 60, covered("abcdXY", "Z"),
                                    "t1", "conv-b")
            # a turn stored without a tenant/id (inference off) is not indexed
            await store.finish_turn("t1:c", 1, now, params, now + 60, covered("q", "r"))
            assert await store.infer("t1", prefixes("abcdXYZ!"), now) == ("t1:b", "conv-b")
            assert await store.infer("t1", prefixes("abcdX"), now) == ("t1:a", "conv-a")
            assert await store.infer("t1", prefixes("abc"), now) is None
            assert await store.infer("t1", prefixes("qr more"), now) is None
            assert await store.infer("t2", prefixes("abcdXYZ!"), now) is None
            # a conversation's newer turn replaces its fingerprint
            await store.finish_turn("t1:a", 2, now, params, now + 60, covered("abcdQ", "Q"),
                                    "t1", "conv-a")
            assert await store.infer("t1", prefixes("abcdP"), now) is None
            assert await store.infer("t1", prefixes("abcdQQ!"), now) == ("t1:a", "conv-a")
            # a turn that stored nothing keeps the conversation's fingerprint
            await store.finish_turn("t1:a", 3, now, None, None, None, "t1", "conv-a")
            assert await store.infer("t1", prefixes("abcdQQ!"), now) == ("t1:a", "conv-a")
        finally:
            await store.close()

    for store in _stores(redis_url):
        run(scenario(store))


def test_store_never_infers_a_conversation_that_is_gone(redis_url):
    params = {"remote_block_ids": [[1]]}
    digest = history_digest({"prompt": "ab"}, None, "cd")
    body = Prefixes.of({"prompt": "abcd!"})

    async def scenario(store, forget):
        now = time.time()
        try:
            await store.finish_turn("t:a", 1, now, params, now + 60, digest, "t", "a")
            assert await store.infer("t", body, now) == ("t:a", "a")
            later = await forget(store, now)
            assert await store.infer("t", body, later) is None
        finally:
            await store.close()

    async def idle(store, now):  # the memory store drops idle entries when it looks
        return now + 11

    async def expired(store, now):  # Redis expires the hash by itself
        await store._redis.delete("kvobs:conv:t:a")
        assert await store._redis.hlen("kvobs:infer:t") == 1
        return now

    run(scenario(MemoryStore(100, 10.0), idle))
    run(scenario(RedisStore(redis_url, 100, 10.0), expired))


def test_store_remembers_evictions_boundedly(redis_url, monkeypatch):
    from kvobs.proxy import store as store_module

    monkeypatch.setattr(store_module, "EVICTED_MEMORY", 3)

    async def scenario(store):
        now = time.time()
        try:
            for i in range(8):
                await store.begin_turn(f"k{i}", now + i * 1e-3)  # cap 1: k0..k6 evicted
            assert (await store.begin_turn("k6", now + 1)).evicted
            assert not (await store.begin_turn("k0", now + 2)).evicted  # forgotten
            assert not (await store.begin_turn("never", now + 3)).evicted
        finally:
            await store.close()

    run(scenario(MemoryStore(1, 3600.0)))
    run(scenario(RedisStore(redis_url, 1, 3600.0)))
