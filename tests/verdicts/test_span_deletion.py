"""No verdict rests on the absence of a span, on the spans of a real demo run
(tests/data/demo-spans.otlp.jsonl: `kvobs demo`'s spans trimmed to what kvobs reads by
tests/data/trim_spans.py). The testbed checks a fresh run the same way."""

from __future__ import annotations

import os

import pytest

from kvobs.turns.correlate import turns_from_spans
from kvobs.diagnose import classify_turns
from kvobs.semconv import Verdict
from kvobs.sources import open_source
from kvobs.verdicts import _export, missing_metadata
from span_deletion import deletion_violations, diagnosed

DEMO_SPANS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data",
                          "demo-spans.otlp.jsonl")


@pytest.fixture(scope="module")
def spans():
    return open_source(DEMO_SPANS).spans()


def _finding(spans, conversation_id: str, turn: int):
    diagnoses, _ = classify_turns(turns_from_spans(spans))
    (found,) = [d for d in diagnoses
                if (d.conversation_id, d.turn.index) == (conversation_id, turn)]
    return found.finding


def _without(spans, name: str, conversation_id: str, turn: int, first: bool = True):
    mine = spans.index[(spans["name"] == name)
                       & (spans["gen_ai.conversation.id"] == conversation_id)
                       & (spans["kvobs.turn.index"] == turn)]
    return spans.drop(index=mine[:1] if first else mine)


def test_the_recorded_run_has_the_turns_the_known_failures_were_seen_on(spans):
    verdicts = {turn.label: turn.verdict for turn in diagnosed(spans)}
    assert verdicts["agent-d-restart turn 2"] == Verdict.TRANSFER_FAILED.value
    assert verdicts["agent-slow-tool turn 2"] == Verdict.EXPIRED.value
    assert verdicts["agent-rewrite turn 2"] == Verdict.PREFIX_MISMATCH.value
    assert len(set(verdicts.values())) >= 8


def test_deleting_any_one_span_keeps_each_verdict_or_makes_it_insufficient(spans):
    assert deletion_violations(spans) == []


def test_a_lone_retry_decision_after_a_fallback_is_not_missing_metadata(spans):
    """P decided twice (with the proxy's params, then on the retry without): without the
    first decision span, the proxy's lookup still says it found and sent the params."""
    finding = _finding(_without(spans, "kvobs.prefill.pull_decision", "agent-d-restart", 2),
                       "agent-d-restart", 2)
    assert finding.verdict is Verdict.INSUFFICIENT_EVIDENCE
    assert finding.evidence["missing_span"] == "kvobs.prefill.pull_decision"


def test_a_proxied_turn_without_its_lookup_span_is_not_another_router(spans):
    finding = _finding(_without(spans, "kvobs.proxy.lookup", "agent-rewrite", 2),
                       "agent-rewrite", 2)
    assert finding.verdict is Verdict.INSUFFICIENT_EVIDENCE
    assert finding.evidence["missing_span"] == "kvobs.proxy.lookup"


def test_without_any_proxy_span_the_turn_is_still_named_unrouted(spans):
    """The router case stays decided: no proxy turn and no lookup span at all. The
    rewritten history shares 256 tokens with turn 1's export, all of them in P's own
    cache already: params would have brought nothing, so it is not missing-metadata."""
    spans = _without(_without(spans, "kvobs.proxy.lookup", "agent-rewrite", 2),
                     "kvobs.proxy.turn", "agent-rewrite", 2)
    finding = _finding(spans, "agent-rewrite", 2)
    assert finding.verdict is Verdict.LOCAL_HIT
    assert finding.evidence["extends_verified_tokens"] == finding.evidence["local_hit_tokens"]


def test_the_check_finds_a_rule_that_reads_a_lost_span_as_evidence(spans, monkeypatch):
    """With the rules as they were (a lost lookup read as another router, a lone retry
    decision as params lost), the check names the deletions that change a verdict."""
    monkeypatch.setattr(missing_metadata, "missing", lambda turns, context: [])
    monkeypatch.setattr(_export, "unrouted", lambda turns: (
        _export.col.null(turns, "lookup") & _export.col.isin(turns, "decision", _export.LOST)
        & _export.col.present(turns, "extends_request_id")))
    conversation = spans[spans["gen_ai.conversation.id"].isin(["agent-d-restart", "agent-rewrite"])
                         | spans["trace_id"].isin(spans.loc[spans["gen_ai.conversation.id"].isin(
                             ["agent-d-restart", "agent-rewrite"]), "trace_id"])]
    violations = deletion_violations(conversation)
    assert any("kvobs.prefill.pull_decision" in v and "agent-d-restart turn 2" in v
               for v in violations), violations
    assert any("kvobs.proxy.lookup" in v and "agent-rewrite turn 2" in v
               for v in violations), violations
