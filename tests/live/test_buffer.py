"""Turns of several conversations in one client trace (the proxy continues it, #27): the
live classifier's buffer gives each conversation only its own untagged spans (vLLM's
request spans, the proxy's HTTP client spans), whatever order they arrive in, and the
turns it classifies are those of the batch pipeline over the same spans."""

from __future__ import annotations

import json

import pytest
from shared_trace import CONVERSATIONS, expected, observed, shared_trace, span_id

from kvobs.diagnose import classify_turns, diagnose
from kvobs.emit.otlp_json import spans_to_otlp_json
from kvobs.live.classifier import Classifier
from kvobs.sources import open_source
from kvobs.turns import columns as col
from kvobs.turns.correlate import turns_from_spans

def _requests(spans: list, order: str) -> list[dict]:
    """One export request per span, in the export order (children first) or reversed
    (parents first); or all in one request."""
    if order == "one-request":
        return [json.loads(spans_to_otlp_json(spans))]
    ordered = spans if order == "children-first" else spans[::-1]
    return [json.loads(spans_to_otlp_json([span])) for span in ordered]


def _canonical(row: dict) -> str:
    return json.dumps({k: v for k, v in row.items() if k not in ("context", "measures")},
                      sort_keys=True, default=str)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    spans, owned = shared_trace()
    path = tmp_path_factory.mktemp("shared") / "spans.otlp.jsonl"
    path.write_text(spans_to_otlp_json(spans) + "\n")
    return spans, owned, str(path)


def _fed(spans, order) -> Classifier:
    """A classifier given the spans request by request, with a pass between arrivals
    (spans placed early must move when their ancestors come)."""
    classifier = Classifier(window_s=600, grace_s=0)
    for i, request in enumerate(_requests(spans, order)):
        classifier.add_request(request, now=100.0 + i)
        classifier.run_pass(now=100.0 + i)
    return classifier


@pytest.mark.parametrize("order", ["children-first", "parents-first", "one-request"])
def test_each_conversation_holds_only_its_own_spans(recorded, order):
    spans, owned, _ = recorded
    classifier = _fed(spans, order)
    for cid in CONVERSATIONS:
        held = {row["span_id"] for row in classifier.buffer.rows_of(cid)}
        assert held == owned[cid]
    # The server spans and the orphans: several conversations share the trace
    # and their parent (the client's span) is not recorded: in none, as correlate
    # leaves them.
    assert len(classifier.buffer) == len(spans)


@pytest.mark.parametrize("order", ["children-first", "parents-first", "one-request"])
def test_live_turns_equal_the_batch_pipeline_in_a_shared_trace(recorded, order):
    spans, _, path = recorded
    classifier = _fed(spans, order)
    live = {key: state.row for key, state in classifier.turns.items()}
    assert sorted(live) == [("t0", cid, turn) for cid in CONVERSATIONS for turn in (1, 2)]
    turns = turns_from_spans(open_source(path).span_table(), frame=False)
    # Each turn has its own untagged spans, the grandchildren (under POST) included.
    assert observed(turns) == expected()
    for key, row in live.items():
        context = row["context"]
        diagnoses, _ = classify_turns(col.Columns(turns), None, context["prefill_tokens_per_s"],
                                      context["decode_s_per_token"])
        batch = {(d.tenant, d.conversation_id, d.turn.index): d.to_dict() for d in diagnoses}
        assert _canonical(row) == _canonical(batch[key])
        # kvobs diagnose reads the conversation's traces (the other's spans too).
        diagnosis = diagnose(open_source(path), key[1], None, context["prefill_tokens_per_s"],
                             key[0], context["decode_s_per_token"])
        (one,) = [t.to_dict() for t in diagnosis.turns if t.turn.index == key[2]]
        assert _canonical(row) == _canonical(one)


def test_a_conversation_leaving_the_window_takes_its_trace_entries_along(recorded):
    spans, owned, _ = recorded
    classifier = Classifier(window_s=60, grace_s=0)
    alpha = [s for s in spans if span_id(s) in owned["alpha"]]
    rest = [s for s in spans if s not in alpha]
    classifier.add_request(json.loads(spans_to_otlp_json(alpha)), now=100.0)
    classifier.add_request(json.loads(spans_to_otlp_json(rest)), now=150.0)
    classifier.run_pass(now=170.0)  # alpha idle past the window, beta not
    buffer = classifier.buffer
    assert set(buffer.units) == {"beta"}
    (shared,) = buffer._traces.values()
    assert set(shared.tagged.values()) == {"beta"} and shared.owners == {"beta"}
    assert {row["span_id"] for row in buffer.rows_of("beta")} == owned["beta"]
    classifier.run_pass(now=300.0)
    assert buffer._traces == {} and len(buffer) == 0
