"""A pass classifies the conversations that received spans; lineage still sees every
export and prompt they could extend, held by conversations that did not (the clean
ones): only those, not the whole window (``SpanBuffer._linkable``)."""

from __future__ import annotations

import json

from turns.test_lineage import router_turns

from kvobs import semconv as sc
from kvobs.diagnose import classify_turns
from kvobs.live.classifier import Classifier
from kvobs.sources._frame import table_from_rows
from kvobs.turns import columns as col
from kvobs.turns.correlate import turns_from_spans

START = list(range(40))


def _canonical(row: dict) -> str:
    return json.dumps({k: v for k, v in row.items() if k not in ("context", "measures")},
                      sort_keys=True, default=str)


def _fleet() -> tuple[list[dict], list[dict]]:
    """Conversation A and four others, then B, behind a router that sends no id: B
    starts as A did (the same prompt and output), so its second turn extends either
    first turn."""
    early = router_turns("a", 2, 100.0, START, gap_s=3.0, client_id="A")
    for n in range(4):
        early += router_turns(f"u{n}", 2, 100.0 + n, [500 + n] * 40, gap_s=3.0,
                              client_id=f"U{n}")
    late = router_turns("b", 2, 101.0, START, gap_s=3.0, same_as=("a", 2))
    return early, late


def _live(early: list[dict], late: list[dict], monkeypatch=None) -> dict[str, dict]:
    """B's turns (by P request) once A and the others are classified and clean."""
    classifier = Classifier(window_s=600, grace_s=0)
    classifier.buffer.add(early, now=200.0)
    classifier.run_pass(now=200.0)
    classifier.buffer.add(late, now=201.0)
    assert classifier.buffer._linkable([])[0] == {"A"}  # B's prompts, in the id-less pool
    if monkeypatch is not None:  # as if the pass took no clean conversation along
        monkeypatch.setattr(classifier.buffer, "_linkable", lambda dirty: (set(), set()))
    classifier.run_pass(now=201.0)
    return {state.row["prefill_request_id"]: state.row for state in classifier.turns.values()
            if state.row["prefill_request_id"].startswith("p-b-")}


def test_a_pass_links_to_the_clean_conversations_it_can_extend_and_no_other(monkeypatch):
    early, late = _fleet()
    live = _live(early, late)
    turns = turns_from_spans(table_from_rows(early + late), frame=False)
    assert sorted(live) == ["p-b-1", "p-b-2"]
    for rid, row in live.items():
        context = row["context"]
        diagnoses, _ = classify_turns(col.Columns(turns), None, context["prefill_tokens_per_s"],
                                      context["decode_s_per_token"])
        (batch,) = [d.to_dict() for d in diagnoses if d.turn.get("prefill_request_id") == rid]
        assert _canonical(row) == _canonical(batch)
    # The clean conversation A decides B's second turn: without it, lineage would guess.
    assert live["p-b-2"]["verdict"] == "insufficient-evidence"
    assert live["p-b-2"]["evidence"]["reason"] == "ambiguous-lineage"
    assert _live(early, late, monkeypatch)["p-b-2"]["verdict"] != "insufficient-evidence"


def test_a_restart_shown_only_by_a_clean_conversation_s_spans_is_seen():
    """D restarts between A's turns; only U's spans, on the same endpoint, show the new
    engine. A's turn 2 must still say that its export did not survive."""
    first = router_turns("a", 2, 100.0, START, gap_s=10.0, client_id="A")
    restarted = router_turns("u", 1, 104.0, [7] * 40, engine="d-engine-2", client_id="U")
    for row in restarted:
        if "kvobs.engine.started_at" in row or row["name"] == "kvobs.decode.export":
            row["kvobs.engine.started_at"] = 105.0
    early = [r for r in first if r["start_ns"] < 105 * 1_000_000_000] + restarted
    late = [r for r in first if r not in early]
    turns = turns_from_spans(table_from_rows(early + late), frame=False)

    def second_turn(forget_engines: bool) -> dict:
        classifier = Classifier(window_s=600, grace_s=0)
        classifier.buffer.add(early, now=200.0)
        classifier.run_pass(now=200.0)
        if forget_engines:  # as if the pass took no span of the restarted engine along
            classifier.buffer._engines.clear()
        classifier.buffer.add(late, now=201.0)
        classifier.run_pass(now=201.0)
        (row,) = [s.row for k, s in classifier.turns.items() if k[1:] == ("A", 2)]
        return row

    live = second_turn(False)
    context = live["context"]
    diagnoses, _ = classify_turns(col.Columns(turns), None, context["prefill_tokens_per_s"],
                                  context["decode_s_per_token"])
    (batch,) = [d.to_dict() for d in diagnoses if (d.conversation_id, d.turn.index) == ("A", 2)]
    assert _canonical(live) == _canonical(batch)
    assert _canonical(second_turn(True)) != _canonical(live)


def _forked() -> tuple[list[dict], list[dict]]:
    """Conversation a behind a router, and X's turn that forks from a's turn 1 (first,
    with a's turn 1), then a's later turns."""
    rows = router_turns("a", 3, 100.0, START)
    history = START + [1000 + 97 + 7 + i % 5 for i in range(100)]  # a's turn 1, as made
    retained = history + [2000 + 97 + 13 + i % 7 for i in range(40)]
    fork = [{**row, **{sc.CONVERSATION_ID.key: "X", sc.TURN_INDEX.key: 2}} for row in router_turns(
        "x", 1, 101.0, retained + [5000 + i for i in range(60)], step_tokens=40)
        if row["name"] == sc.SPAN_PULL_DECISION.name]
    early = [r for r in rows if r.get(sc.REQUEST_ID.key) == "p-a-1"
             or r.get(sc.REMOTE_REQUEST_ID.key) == "p-a-1"] + fork
    return early, [r for r in rows if r not in early]


def test_a_clean_fork_of_a_turn_comes_along_when_that_turn_s_conversation_goes_on():
    """Behind a router, conversation a; X (with its own id) forks from a's turn 1 before
    a's turn 2 comes: lineage then makes a's turn 2 start a conversation of its own (a
    second turn extending the same export). X is clean when a's turn 2 arrives, and its
    prompt probes nothing of a's second turn: it comes along because its turn extends
    a's export."""
    early, late = _forked()
    turns = turns_from_spans(table_from_rows(early + late), frame=False)

    def live(note_links: bool) -> dict[str, dict]:
        classifier = Classifier(window_s=600, grace_s=0)
        if not note_links:
            classifier.buffer.note_links = lambda unit, d_requests: None
        classifier.buffer.add(early, now=200.0)
        classifier.run_pass(now=200.0)
        classifier.buffer.add(late, now=201.0)
        classifier.run_pass(now=201.0)
        return {s.row["prefill_request_id"]: s.row for s in classifier.turns.values()}

    rows_live = live(True)
    context = rows_live["p-a-2"]["context"]
    diagnoses, _ = classify_turns(col.Columns(turns), None, context["prefill_tokens_per_s"],
                                  context["decode_s_per_token"])
    batch = {d.turn.get("prefill_request_id"): d.to_dict() for d in diagnoses}
    assert batch["p-x-1"]["turn"] == 2 and batch["p-x-1"]["conversation_id"] == "X"
    for rid in ("p-a-1", "p-a-2", "p-a-3"):
        assert _canonical(rows_live[rid]) == _canonical(batch[rid]), rid
    assert batch["p-a-2"]["conversation_id"] != batch["p-a-1"]["conversation_id"]
    assert _canonical(live(False)["p-a-2"]) != _canonical(batch["p-a-2"])


def test_what_links_conversations_leaves_with_them():
    classifier = Classifier(window_s=600, grace_s=0)
    early, late = _fleet()
    forked_early, forked_late = _forked()
    for now, rows in enumerate((early, forked_early, late, forked_late)):
        classifier.buffer.add(rows, now=200.0 + now)
        classifier.run_pass(now=200.0 + now)
    buffer = classifier.buffer
    assert buffer._units_by_key and buffer._extended_by and buffer._engines
    assert buffer._request_home and buffer._starts  # B's id-less turns were adopted
    classifier.run_pass(now=10_000.0)  # every conversation idle past the window
    assert buffer.units == {}
    assert not buffer._units_by_key and not buffer._extended_by and not buffer._engines
    assert not (buffer._request_home or buffer._trace_home or buffer._starts
                or buffer._alias or buffer._pool_requests or buffer._idless)


def test_a_turn_whose_predecessor_s_export_comes_late_is_classified_again():
    """X (its own id) extends A's first turn, whose D export reaches the classifier
    only after X was classified: A's pass takes X along to classify it again, as X's
    turn extends A's (``note_links`` by P's request), and X then says what the batch
    says."""
    rows = router_turns("a", 1, 100.0, START, client_id="A")
    history = START + [1000 + 97 + 7 + i % 5 for i in range(100)]  # A's turn 1, as made
    retained = history + [2000 + 97 + 13 + i % 7 for i in range(40)]
    fork = [{**row, sc.CONVERSATION_ID.key: "X", sc.TURN_INDEX.key: 2} for row in router_turns(
        "x", 1, 101.0, retained + [5000 + i for i in range(60)], step_tokens=40)
        if row["name"] == sc.SPAN_PULL_DECISION.name]
    export = [row for row in rows if row["name"] == sc.SPAN_EXPORT.name]
    early = [row for row in rows if row not in export] + fork
    classifier = Classifier(window_s=600, grace_s=0)
    classifier.buffer.add(early, now=200.0)
    classifier.run_pass(now=200.0)
    before = [s.row for k, s in classifier.turns.items() if k[1] == "X"]
    classifier.buffer.add(export, now=201.0)
    classifier.run_pass(now=201.0)
    (after,) = [s.row for k, s in classifier.turns.items() if k[1] == "X"]
    context = after["context"]
    turns = turns_from_spans(table_from_rows(early + export), frame=False)
    diagnoses, _ = classify_turns(col.Columns(turns), None, context["prefill_tokens_per_s"],
                                  context["decode_s_per_token"])
    (batch,) = [d.to_dict() for d in diagnoses if d.conversation_id == "X"]
    assert _canonical(after) == _canonical(batch)
    assert [_canonical(row) for row in before] != [_canonical(after)]
