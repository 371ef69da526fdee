"""Configuration (a) of issue #11 on real engines: D runs vLLM's MultiConnector, a host
copy (``KvobsOffloadingConnector`` with kvobs's CPU stand-in copy engine) before the NIXL
bidirectional connector (``scenarios/host-copy.toml``, started through ``Stack`` like every
scenario). One P/D pair, three turns through the kvobs proxy: D's retained blocks serve
turn 2 over NIXL; after D's TTL released them and background prompts evicted them from
D's cache, D loads turn 3's history from its host copy. ~2.5 min on the 2-core box.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvobs import semconv as sc
from kvobs.testbed.runner import ScenarioClient
from kvobs.testbed.scenario import load
from kvobs.testbed.stack import TELEMETRY_DRAIN_S, Stack

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "scenarios" / "host-copy.toml"
CONVERSATION = "agent-host"


def _counter(metrics: str, name: str, labels: str = "") -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if re.match(re.escape(name) + r"(\{|\s)", line) and labels in line)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The scenario's turns, then turn 3's prompt again straight to D with another
    ``cache_salt`` (other block hashes: nothing to load, all computed) for comparison."""
    scenario = load(str(SCENARIO))
    out = tmp_path_factory.mktemp("host-copy-pd")
    with Stack(scenario.engines, out) as stack:
        client = ScenarioClient(scenario, stack)
        while not client.done:
            client.step()
        (conversation,) = client.conversations
        metrics = stack.pair.decode.metrics()
        answer = conversation.last_response
        body = {"model": "tiny", "prompt": conversation.history[:-len(answer)],
                "max_tokens": scenario.conversations[0].turns[-1].max_tokens,
                "temperature": 0.0, "ignore_eos": True, "cache_salt": "recompute",
                "allowed_token_ids": stack.safe_token_ids}
        request = urllib.request.Request(stack.engine_url("decode") + "/v1/completions",
                                         json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            recompute = json.loads(response.read())["choices"][0]["text"]
        time.sleep(TELEMETRY_DRAIN_S)
    from kvobs.diagnose import diagnose
    from kvobs.sources import open_source

    return SimpleNamespace(results=client.results, answer=answer, recompute=recompute,
                           metrics=metrics,
                           turns=diagnose(open_source(str(out)), CONVERSATION).turns)


def test_each_turn_gets_the_verdict_of_the_path_that_served_it(run):
    assert all(r.ok for r in run.results)
    verdicts = [t.finding.verdict for t in run.turns]
    assert verdicts == [sc.Verdict.FIRST_TURN, sc.Verdict.REMOTE_HIT, sc.Verdict.HOST_HIT]


def test_the_device_path_served_turn_2(run):
    """D still held turn 1's blocks: P read them over NIXL, and D's own cache had them,
    so the host copy (asked first) served nothing."""
    turn = run.turns[1].turn
    assert turn.get("served_by") == sc.ServedBy.DEVICE.value
    assert turn.get("served_device_tokens") > 0
    assert turn.get("served_host_tokens") == 0
    assert run.turns[1].finding.evidence["served_device_tokens"] == turn.get(
        "served_device_tokens")


def test_the_host_copy_served_turn_3_and_its_bytes_are_vllms(run):
    """Past D's TTL and evicted from D's cache: D loaded the history from its host copy
    (the bytes in kvobs's span are vLLM's own offload counter: the run's only load), P
    computed the prompt anyway, and the answer is a recompute's."""
    turn = run.turns[2].turn
    evidence = run.turns[2].finding.evidence
    assert turn.get("served_by") == sc.ServedBy.HOST.value
    assert turn.get("served_device_tokens") == 0
    host_tokens = turn.get("served_host_tokens")
    assert host_tokens > 0
    assert _counter(run.metrics, sc.M_VLLM_PROMPT_CACHED_BY_SOURCE.name,
                    'source="host"') == host_tokens
    assert evidence["host_load_bytes"] == _counter(run.metrics,
                                                   sc.M_OFFLOAD_LOAD_BYTES.name) > 0
    assert evidence["recomputed_tokens"] == turn.get("prompt_tokens")  # P computed it all
    assert run.answer == run.recompute


def test_d_hand_offs_carry_the_workers_bytes_under_multiconnector(run):
    """D's NIXL worker facts arrive inside MultiConnector's per-connector stats: turns 1
    and 2 pulled P's KV (bytes > 0); on turn 3 the host copy was chosen to load, so NIXL
    pulled nothing from P."""
    pulled = [t.turn.get("handoff_bytes") for t in run.turns]
    assert pulled[0] > 0 and pulled[1] > 0
    assert pulled[2] == 0
