"""The real testbed behind vLLM's router (``vllm-router``) instead of the kvobs proxy:
what kvobs sees when nothing in front of the engines knows about it."""

from __future__ import annotations

import pytest

from kvobs import semconv as sc
from kvobs.sources import open_source

pytestmark = pytest.mark.testbed


def test_router_turns_answered_and_engine_spans_readable(router_run):
    """Every turn answered through vllm-router, sent without a conversation id; the
    engines' spans are in the run's store and readable by kvobs; P never got D's
    params (the router keeps none between turns), so every P decision is no-params."""
    results = router_run.results
    assert len(results) == sum(len(c.turns) for c in router_run.scenario.conversations)
    assert [(r.label, r.turn, r.status, r.error) for r in results if not r.ok] == []
    assert not any(r.sent_conversation_id for r in results)
    assert {r.stream for r in results} == {True, False}
    spans = open_source(str(router_run.out)).spans()
    decisions = spans[spans["name"] == sc.SPAN_PULL_DECISION.name]
    exports = spans[spans["name"] == sc.SPAN_EXPORT.name]
    assert len(decisions) == len(results)  # one P request per turn
    assert len(exports) == len(results)  # D kept every turn's KV for a next one
    assert set(decisions[sc.PULL_DECISION.key]) == {sc.PullDecision.NO_PARAMS.value}
    assert set(spans["service"]) == {sc.Service.PREFILL.value, sc.Service.DECODE.value}


def test_router_turns_diagnosed_from_engine_spans_alone(router_run):
    """Behind vllm-router kvobs rebuilds every conversation from the engines' prefix
    chains, in the right turn order; first turns are first-turn and every later turn is
    missing-metadata naming the D export it could have reused (D still held it: the
    gaps are far inside D's TTL), the router named as the cause."""
    from kvobs.diagnose import all_turns, diagnose

    source = open_source(str(router_run.out))
    diagnosed = sorted(all_turns(source), key=lambda d: d.turn.get("p_arrived_at"))
    results = sorted(router_run.results, key=lambda r: r.started_at)
    assert len(diagnosed) == len(results)  # one request at a time: time order pairs them
    conversation_of: dict[str, str] = {}
    previous_export: dict[str, str] = {}
    for result, d in zip(results, diagnosed):
        assert conversation_of.setdefault(result.conversation_id, d.conversation_id) \
            == d.conversation_id
        assert d.conversation_id.startswith(sc.LINEAGE_PREFIX)
        assert d.turn.index == result.turn
        if result.turn == 1:
            assert d.finding.verdict is sc.Verdict.FIRST_TURN
        else:
            assert d.finding.verdict is sc.Verdict.MISSING_METADATA, d.finding
            assert d.finding.evidence["extends_request_id"] == \
                previous_export[result.conversation_id]
            assert d.finding.evidence["extends_ttl_left_s"] > 0
            assert "router did not forward" in d.finding.remedy
        previous_export[result.conversation_id] = d.turn.get("decode_request_id")
    assert len(set(conversation_of.values())) == len(router_run.scenario.conversations)
    # A rebuilt conversation is diagnosed by its id like any other.
    some = next(iter(conversation_of.values()))
    assert [t.turn.index for t in diagnose(source, some).turns] == list(
        range(1, len(diagnose(source, some).turns) + 1))
