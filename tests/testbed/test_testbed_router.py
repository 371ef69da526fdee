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
