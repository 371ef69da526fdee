"""Prefix lineage: conversations and turns rebuilt from engine spans alone.

The spans are what the instrumented engines emit behind a router that sends no
conversation id (vllm-router, llm-d): P's decision span with its prompt's chain, D's
export with the chain of what it retains and the P request it pulled from. The chains
are real digests (``connector_instrumented._digest.encode``) over chained block hashes.
"""

from __future__ import annotations

import hashlib

import pandas as pd
import pytest

from connector_instrumented import _digest
from kvobs import semconv as sc
from kvobs.turns import lineage
from kvobs.turns.correlate import turns_from_spans
from kvobs.sources._frame import frame_from_rows
from kvobs.sources.otlp_json import DocumentSource

BS = 16
SEED = "abcd1234"
SECOND = 1_000_000_000


def block_hashes(tokens: list[int]) -> list[bytes]:
    out, parent = [], b"root"
    for i in range(len(tokens) // BS):
        block = bytes(str(tokens[i * BS:(i + 1) * BS]), "ascii")
        parent = hashlib.sha256(parent + block).digest()
        out.append(parent)
    return out


def chain(tokens: list[int]) -> str:
    return _digest.encode(block_hashes(tokens), len(tokens), BS, SEED, tokens)


def span(name, start_s, trace, **attrs):
    row = {"name": name.name, "trace_id": trace, "span_id": f"{trace}-{name.name}",
           "start_ns": int(start_s * SECOND), "end_ns": int(start_s * SECOND) + 1000,
           "service": name.service.value}
    row.update(attrs)
    return row


def router_turns(conversation: str, turns: int, start_s: float, base: list[int],
                 step_tokens: int = 100, output_tokens: int = 40, tenant=None,
                 client_id: str | None = None, gap_s: float = 2.0,
                 engine="d-engine-1", endpoint="d:5600",
                 same_as: tuple[str, int] = ("", 0)) -> list[dict]:
    """Spans of ``turns`` turns of one agent conversation behind a router: each prompt
    is the previous prompt + the previous output + new input. ``same_as`` (a
    conversation, a turn): the tokens of that conversation's turns before that turn."""
    rows, history, t = [], list(base), start_s
    for k in range(1, turns + 1):
        # Each conversation says something else (but what ``same_as`` says before then).
        salt = sum(map(ord, same_as[0] if k < same_as[1] else conversation))
        history = history + [1000 + salt + k * 7 + i % 5 for i in range(step_tokens)]
        p_id, d_id = f"p-{conversation}-{k}", f"d-{conversation}-{k}"
        trace = f"t-{conversation}-{k}"
        keys = {sc.TENANT_DIGEST.key: tenant}
        if client_id:
            keys.update({sc.CONVERSATION_ID.key: client_id, sc.TURN_INDEX.key: k})
        rows.append(span(sc.SPAN_PULL_DECISION, t, trace, **keys, **{
            sc.REQUEST_ID.key: p_id, sc.ROLE.key: "prefill",
            sc.PULL_DECISION.key: "no-params", sc.PROMPT_TOKENS.key: len(history),
            sc.PREFIX_LINEAGE.key: chain(history)}))
        output = [2000 + salt + k * 13 + i % 7 for i in range(output_tokens)]
        retained = history + output
        rows.append(span(sc.SPAN_EXPORT, t + 0.5, trace + "-d", **keys, **{
            sc.REQUEST_ID.key: d_id, sc.ROLE.key: "decode",
            sc.REMOTE_REQUEST_ID.key: p_id, sc.EXPORT_TOKENS.key: len(retained) - 1,
            sc.EXPORT_EXPIRES_AT.key: t + 0.5 + 30, sc.TTL.key: 30.0,
            sc.PREFIX_LINEAGE.key: chain(retained[:-1]), sc.ENGINE_ID.key: engine,
            sc.ENGINE_ENDPOINT.key: endpoint, sc.ENGINE_STARTED_AT.key: 1.0}))
        history = retained
        t += gap_s
    return rows


def frame(rows):
    return frame_from_rows(rows)


L = lineage.conversation_name


def facts(spans):
    """The lineage facts per P request, as the turn table has them."""
    return turns_from_spans(spans).set_index("prefill_request_id")


def test_conversations_and_turn_order_from_engine_spans_alone():
    base_a, base_b = list(range(50)), list(range(300, 350))
    spans = frame(router_turns("a", 3, 100.0, base_a) + router_turns("b", 4, 100.7, base_b))
    turns = turns_from_spans(spans)
    by = {cid: list(g.sort_values("turn")["prefill_request_id"])
          for cid, g in turns.groupby("conversation_id")}
    assert by == {L("p-a-1"): ["p-a-1", "p-a-2", "p-a-3"],
                  L("p-b-1"): ["p-b-1", "p-b-2", "p-b-3", "p-b-4"]}
    b3 = turns[turns["prefill_request_id"] == "p-b-3"].iloc[0]
    assert (b3["turn"], b3["extends_request_id"], b3["extends_prefill_request_id"]) == (
        3, "d-b-2", "p-b-2")
    assert b3["extends_engine_id"] == "d-engine-1"
    assert 0 < b3["extends_verified_tokens"] <= b3["extends_tokens"]
    first = turns[turns["turn"] == 1]
    assert first["extends_request_id"].isna().all()


def test_a_shared_system_prompt_does_not_join_conversations():
    system = list(range(200))  # 12 full blocks shared by both conversations' first turns
    spans = frame(router_turns("a", 2, 100.0, system) + router_turns("b", 2, 100.2, system))
    turns = turns_from_spans(spans)
    assert sorted(turns["conversation_id"].unique()) == sorted([L("p-a-1"), L("p-b-1")])
    assert turns.set_index("prefill_request_id").loc["p-b-2", "extends_request_id"] == "d-b-1"


def test_matching_is_tenant_scoped_and_time_ordered():
    base = list(range(64))
    same_prompts = router_turns("a", 2, 100.0, base, tenant="t1") + [
        {**row, sc.REQUEST_ID.key: row[sc.REQUEST_ID.key].replace("-a-", "-z-"),
         sc.REMOTE_REQUEST_ID.key: (row.get(sc.REMOTE_REQUEST_ID.key) or "").replace(
             "-a-", "-z-") or None, sc.TENANT_DIGEST.key: "t2",
         "trace_id": row["trace_id"] + "z", "span_id": row["span_id"] + "z",
         "start_ns": row["start_ns"] + 3 * SECOND // 10, "end_ns": row["end_ns"] + 3 * SECOND // 10}
        for row in router_turns("a", 2, 100.0, base, tenant="t1")]
    links = facts(frame(same_prompts))
    assert links.loc["p-a-2", "extends_request_id"] == "d-a-1"
    assert links.loc["p-z-2", "extends_request_id"] == "d-z-1"  # never t1's export
    # An export that ends after the prompt arrived cannot be what it extends: the
    # prompt still extends turn 1's prompt, so it is turn 2, linked not fully.
    rows = router_turns("a", 2, 100.0, base)
    late = [dict(r, start_ns=r["start_ns"] + 10 * SECOND, end_ns=r["end_ns"] + 10 * SECOND)
            if r["name"] == sc.SPAN_EXPORT.name else r for r in rows]
    links = facts(frame(late))
    assert links.loc["p-a-2", ["extends_request_id", "extends_fully"]].tolist() == [
        "d-a-1", False]
    assert links.loc["p-a-2", "lineage_turn"] == 2


def test_a_rewritten_output_links_to_the_previous_prompt_not_fully():
    rows = router_turns("a", 2, 100.0, list(range(40)), output_tokens=40)
    # Turn 2's prompt keeps turn 1's prompt but not D's output (reasoning stripped).
    p1 = next(r for r in rows if r[sc.REQUEST_ID.key] == "p-a-1")
    p2 = next(r for r in rows if r[sc.REQUEST_ID.key] == "p-a-2")
    prompt1 = list(range(40)) + [1000 + 97 + 7 + i % 5 for i in range(100)]
    rewritten = prompt1 + [9] * 10 + [1000 + 97 + 14 + i % 5 for i in range(100)]
    assert p1[sc.PREFIX_LINEAGE.key] == chain(prompt1)
    p2[sc.PREFIX_LINEAGE.key] = chain(rewritten)
    turns = turns_from_spans(frame(rows)).set_index("prefill_request_id")
    assert turns.loc["p-a-2", ["conversation_id", "turn", "extends_request_id"]].tolist() == [
        L("p-a-1"), 2, "d-a-1"]
    assert not turns.loc["p-a-2", "extends_fully"]
    assert turns.loc["p-a-2", "extends_verified_tokens"] == 128  # 8 full blocks of 140


def test_client_ids_win_and_lineage_agrees_with_them():
    rows = (router_turns("a", 3, 100.0, list(range(40)), client_id="conv-A")
            + router_turns("b", 3, 100.3, list(range(500, 540)), client_id="conv-B"))
    turns = turns_from_spans(frame(rows))
    assert sorted(turns["conversation_id"].unique()) == ["conv-A", "conv-B"]
    for _, group in turns.groupby("conversation_id"):
        assert group["lineage_conversation_id"].nunique() == 1
        assert list(group["lineage_turn"]) == list(group["turn"])


def test_a_fork_starts_its_own_conversation_numbered_on():
    rows = router_turns("a", 2, 100.0, list(range(40)))
    fork = [dict(r, **{sc.REQUEST_ID.key: "p-fork", "trace_id": "t-fork", "span_id": "s-fork",
                       "start_ns": r["start_ns"] + SECOND // 2})
            for r in rows if r[sc.REQUEST_ID.key] == "p-a-2"]
    turns = turns_from_spans(frame(rows + fork)).set_index("prefill_request_id")
    assert turns.loc["p-a-2", ["conversation_id", "turn"]].tolist() == [L("p-a-1"), 2]
    assert turns.loc["p-fork", ["conversation_id", "turn"]].tolist() == [L("p-fork"), 2]
    assert turns.loc["p-fork", "extends_request_id"] == "d-a-1"


def test_a_restart_of_the_exporting_engine_is_named():
    rows = router_turns("a", 2, 100.0, list(range(40)), engine="old", gap_s=5.0)
    restarted = dict(rows[-1], **{sc.ENGINE_ID.key: "new", sc.ENGINE_STARTED_AT.key: 103.0,
                                  sc.REQUEST_ID.key: "d-a-2"})
    turns = turns_from_spans(frame(rows[:-1] + [restarted])).set_index("prefill_request_id")
    assert turns.loc["p-a-2", "extends_engine_restarted_at"] == pytest.approx(103.0)
    assert pd.isna(turns_from_spans(frame(rows)).set_index("prefill_request_id").loc[
        "p-a-2", "extends_engine_restarted_at"])
    # A restart after D's blocks had expired took nothing: expiry stays the cause.
    late = dict(restarted, **{sc.ENGINE_STARTED_AT.key: 100.5 + 30 + 1})
    rows = router_turns("a", 2, 100.0, list(range(40)), engine="old", gap_s=40.0)
    turns = turns_from_spans(frame(rows[:-1] + [late])).set_index("prefill_request_id")
    assert pd.isna(turns.loc["p-a-2", "extends_engine_restarted_at"])


def test_spans_without_chains_or_with_bad_ones_link_nothing():
    rows = router_turns("a", 2, 100.0, list(range(40)))
    for r in rows:
        r[sc.PREFIX_LINEAGE.key] = "kvobs4:16:abcd1234:garbage"
    turns = turns_from_spans(frame(rows))
    assert turns["extends_request_id"].isna().all()
    assert sorted(turns["conversation_id"]) == sorted([L("p-a-1"), L("p-a-2")])


def test_a_turn_index_that_goes_back_in_the_chain_is_renumbered():
    """A proxy restarted on the memory store numbers the next turn 1 again: with the
    client's id kept, the chain says it is turn 3, and it no longer merges into turn 1."""
    rows = router_turns("a", 3, 100.0, list(range(40)), client_id="conv-A")
    for row in rows:
        if row[sc.REQUEST_ID.key] in ("p-a-3", "d-a-3"):
            row[sc.TURN_INDEX.key] = 1
    turns = turns_from_spans(frame(rows))
    assert list(turns["turn"]) == [1, 2, 3]
    assert list(turns["prefill_request_id"]) == ["p-a-1", "p-a-2", "p-a-3"]
    assert set(turns["conversation_id"]) == {"conv-A"}


def _copy(rows: list[dict], name: str, shift_s: float) -> list[dict]:
    """``rows`` as another conversation's: other request ids and traces, ``shift_s``
    later, the same tokens (identical prompts, identical greedy outputs)."""
    def renamed(value):
        return value.replace("-a-", f"-{name}-") if isinstance(value, str) else value

    shift = int(shift_s * SECOND)
    return [dict(r, **{sc.REQUEST_ID.key: renamed(r[sc.REQUEST_ID.key]),
                       sc.REMOTE_REQUEST_ID.key: renamed(r.get(sc.REMOTE_REQUEST_ID.key)),
                       "trace_id": r["trace_id"] + name, "span_id": r["span_id"] + name,
                       "start_ns": r["start_ns"] + shift, "end_ns": r["end_ns"] + shift})
            for r in rows]


def _diverged(name: str, turns: int, shift_s: float, at_turn: int) -> list[dict]:
    """Conversation ``name``: conversation a's tokens (``router_turns("a", ...)`` from 100
    s, 3 s apart) until ``at_turn``, its own from there on, ``shift_s`` later."""
    return router_turns(name, turns, 100.0 + shift_s, list(range(40)), gap_s=3.0,
                        same_as=("a", at_turn))


def _findings(rows):
    from kvobs.diagnose import classify_turns

    diagnoses, _ = classify_turns(turns_from_spans(frame(rows)))
    return {d.turn.get("prefill_request_id"): d.finding for d in diagnoses}


def test_identical_first_turns_are_both_first_and_their_next_turns_say_ambiguous():
    """Two conversations start with the same prompt and get the same greedy output:
    content cannot tell which of the two exports each second turn extends. Each first
    turn stays a first turn (a prompt equal to an earlier one is a copy of that turn,
    never its next turn), and each second turn names both candidates."""
    rows = router_turns("a", 3, 100.0, list(range(40)), gap_s=3.0)
    rows += _diverged("b", 3, 1.0, at_turn=2)
    turns = facts(frame(rows))
    assert turns.loc["p-a-1", "turn"] == turns.loc["p-b-1", "turn"] == 1
    assert turns.loc["p-a-1", "conversation_id"] != turns.loc["p-b-1", "conversation_id"]
    for second in ("p-a-2", "p-b-2"):
        assert turns.loc[second, "lineage_gap"] == "ambiguous-lineage"
        assert set(turns.loc[second, "lineage_candidates"].split()) == {"d-a-1", "d-b-1"}
        assert pd.isna(turns.loc[second, "extends_request_id"])  # none is guessed
        assert turns.loc[second, "turn"] == 2
    # Diverged from turn 2 on: each third turn continues its own second turn.
    for name in ("a", "b"):
        assert turns.loc[f"p-{name}-3", ["conversation_id", "turn"]].tolist() == [
            turns.loc[f"p-{name}-2", "conversation_id"], 3]
        assert turns.loc[f"p-{name}-3", "extends_request_id"] == f"d-{name}-2"
        assert pd.isna(turns.loc[f"p-{name}-3", "lineage_gap"])
    findings = _findings(rows)
    ambiguous = findings["p-a-2"]
    assert ambiguous.verdict is sc.Verdict.INSUFFICIENT_EVIDENCE
    assert ambiguous.evidence["reason"] == "ambiguous-lineage"
    assert set(ambiguous.evidence["lineage_candidates"].split()) == {"d-a-1", "d-b-1"}
    assert findings["p-a-1"].verdict is findings["p-b-1"].verdict is sc.Verdict.FIRST_TURN
    assert findings["p-a-3"].verdict is sc.Verdict.MISSING_METADATA  # D held turn 2's KV


def test_histories_that_diverge_at_turn_five_are_grouped_right_from_there():
    rows = router_turns("a", 6, 100.0, list(range(40)), gap_s=3.0)
    rows += _diverged("b", 6, 1.0, at_turn=5)
    turns = facts(frame(rows))
    for k in (2, 3, 4, 5):  # each extends two identical exports: named, never chosen
        for name in ("a", "b"):
            assert turns.loc[f"p-{name}-{k}", "lineage_gap"] == "ambiguous-lineage", k
            assert turns.loc[f"p-{name}-{k}", "turn"] == k
    for name in ("a", "b"):
        assert turns.loc[f"p-{name}-6", ["conversation_id", "turn"]].tolist() == [
            turns.loc[f"p-{name}-5", "conversation_id"], 6]
        assert turns.loc[f"p-{name}-6", "extends_request_id"] == f"d-{name}-5"
    assert turns.loc["p-a-6", "conversation_id"] != turns.loc["p-b-6", "conversation_id"]


def test_three_identical_starts_name_all_three_candidates():
    rows = router_turns("a", 2, 100.0, list(range(40)), gap_s=3.0)
    for name, shift in (("b", 0.6), ("c", 1.2)):
        rows += _copy(router_turns("a", 2, 100.0, list(range(40)), gap_s=3.0), name, shift)
    turns = facts(frame(rows))
    assert (turns.loc[["p-a-1", "p-b-1", "p-c-1"], "turn"] == 1).all()
    assert turns["conversation_id"].nunique() == 6  # nothing merged
    for name in "abc":
        assert set(turns.loc[f"p-{name}-2", "lineage_candidates"].split()) == {
            "d-a-1", "d-b-1", "d-c-1"}


def test_a_retry_of_one_conversation_is_not_ambiguous():
    """Equal matches in one conversation (turn 1 sent twice, two equal exports) are that
    conversation's: turn 2 continues it, from the latest of them."""
    rows = router_turns("a", 2, 100.0, list(range(40)), gap_s=3.0, client_id="conv-A")
    retry = [dict(r, **{sc.REQUEST_ID.key: r[sc.REQUEST_ID.key] + "r",
                        sc.REMOTE_REQUEST_ID.key: (r.get(sc.REMOTE_REQUEST_ID.key) or "") + "r"
                        or None, "span_id": r["span_id"] + "r",
                        "start_ns": r["start_ns"] + SECOND, "end_ns": r["end_ns"] + SECOND})
             for r in rows[:2]]
    turns = facts(frame(rows + retry))
    assert turns.loc["p-a-2", "extends_request_id"] == "d-a-1r"
    assert pd.isna(turns.loc["p-a-2", "lineage_gap"])
    # Without ids, the retry is a copy of turn 1 that starts its own chain: turn 2
    # then has candidates in two conversations, and says so.
    anonymous = [{k: v for k, v in r.items()
                  if k not in (sc.CONVERSATION_ID.key, sc.TURN_INDEX.key)}
                 for r in rows + retry]
    assert facts(frame(anonymous)).loc["p-a-2", "lineage_gap"] == "ambiguous-lineage"


def test_a_missing_export_makes_the_next_turn_insufficient_not_first():
    rows = [r for r in router_turns("a", 3, 100.0, list(range(40)))
            if r[sc.REQUEST_ID.key] != "d-a-2"]
    turns = facts(frame(rows))
    assert turns.loc["p-a-3", ["conversation_id", "turn"]].tolist() == [L("p-a-1"), 3]
    assert turns.loc["p-a-3", "lineage_gap"] == "export-missing"
    assert turns.loc["p-a-3", "extends_prefill_request_id"] == "p-a-2"
    finding = _findings(rows)["p-a-3"]
    assert finding.verdict is sc.Verdict.INSUFFICIENT_EVIDENCE
    assert finding.evidence["missing_span"] == sc.SPAN_EXPORT.name


def test_a_missing_decision_keeps_its_turn_and_the_chain():
    """Without turn 2's decision span (its prompt's chain), turn 2 still has a row from
    its other spans, D's export stands in for its prompt, and turn 3 stays turn 3."""
    rows = router_turns("a", 3, 100.0, list(range(40)))
    rows.append(span(sc.SPAN_PREFILL_REQUEST, 102.0, "t-a-2",
                     **{sc.REQUEST_ID.key: "p-a-2", sc.ROLE.key: "prefill"}))
    rows = [r for r in rows if not (r["name"] == sc.SPAN_PULL_DECISION.name
                                    and r[sc.REQUEST_ID.key] == "p-a-2")]
    turns = turns_from_spans(frame(rows))
    assert list(turns["turn"]) == [1, 2, 3]
    assert set(turns["conversation_id"]) == {L("p-a-1")}
    assert turns.set_index("turn").loc[3, "extends_request_id"] == "d-a-2"
    finding = _findings(rows)
    (second,) = [f for rid, f in finding.items() if rid not in ("p-a-1", "p-a-3")]
    assert second.verdict is sc.Verdict.INSUFFICIENT_EVIDENCE
    assert second.evidence["missing_span"] == sc.SPAN_PULL_DECISION.name


def test_a_prompt_that_adds_less_than_the_threshold_is_not_missing_metadata():
    """Behind a router, a read P would have declined (M, what it would have read beyond
    its own cache, below kv_recompute_threshold) is below-threshold, not the router's
    fault; M = 0 (P's cache had it all) is local-hit."""
    rows = router_turns("a", 2, 100.0, list(range(40)), step_tokens=30)
    for r in rows:
        if r["name"] == sc.SPAN_PULL_DECISION.name:
            r[sc.THRESHOLD.key] = 64
            r[sc.LOCAL_HIT_TOKENS.key] = 64
    turns = facts(frame(rows))
    # The prompt extends all of turn 1's export (its tail too): M = 109 - 64 = 45 < 64.
    assert turns.loc["p-a-2", ["extends_fully", "extends_tokens"]].tolist() == [True, 109]
    assert _findings(rows)["p-a-2"].verdict is sc.Verdict.BELOW_THRESHOLD
    for r in rows:
        if r["name"] == sc.SPAN_PULL_DECISION.name:
            r[sc.LOCAL_HIT_TOKENS.key] = 112
    assert _findings(rows)["p-a-2"].verdict is sc.Verdict.LOCAL_HIT
    for r in rows:
        if r["name"] == sc.SPAN_PULL_DECISION.name:
            r[sc.THRESHOLD.key], r[sc.LOCAL_HIT_TOKENS.key] = 8, 64
    assert _findings(rows)["p-a-2"].verdict is sc.Verdict.MISSING_METADATA


@pytest.mark.parametrize("bad", [None, 2 ** 63 + 5, -1, float("nan"), "soon"])
@pytest.mark.parametrize("field", ["start_ns", "end_ns"])
@pytest.mark.parametrize("kind", [sc.SPAN_EXPORT, sc.SPAN_PULL_DECISION])
def test_a_bad_time_on_any_span_reads_as_missing(kind, field, bad):
    """A missing or out-of-range time never crashes a reader: the span's turn is still
    there, and no other turn changes."""
    rows = router_turns("a", 3, 100.0, list(range(40)))
    for r in rows:
        if r["name"] == kind.name and r[sc.REQUEST_ID.key].endswith("-1"):
            r[field] = bad
    turns = turns_from_spans(frame(rows))
    assert len(turns) == 3
    assert turns.set_index("prefill_request_id").loc["p-a-3", "extends_request_id"] == "d-a-2"
    _findings(rows)


class _RowSource(DocumentSource):
    """A source of the rows given (as the span-file decoders yield them)."""

    location = "rows"

    def __init__(self, given: list[dict]):
        super().__init__()
        self._given = given

    def _rows(self):
        return iter(self._given)


def test_id_less_proxy_turns_join_the_first_turns_anonymous_conversation():
    """Behind the proxy with inference off: each id-less turn is named anonymous:<its
    trace>; the chain puts turn 2 into turn 1's conversation, and diagnosing turn 2's own
    anonymous id leads there."""
    from kvobs.diagnose import diagnose

    rows = router_turns("a", 2, 100.0, list(range(40)))
    for k in (1, 2):  # the proxy's turn span shares P's trace
        rows.append(span(sc.SPAN_PROXY_TURN, 99.9 + 2 * (k - 1), f"t-a-{k}"))
    turns = turns_from_spans(frame(rows)).set_index("prefill_request_id")
    assert turns.loc["p-a-2", ["conversation_id", "turn"]].tolist() == ["anonymous:t-a-1", 2]
    diagnosis = diagnose(_RowSource(rows), "anonymous:t-a-2")
    assert diagnosis.conversation_id == "anonymous:t-a-1"
    assert [t.turn.index for t in diagnosis.turns] == [1, 2]
    assert "prefix lineage" in diagnosis.problems[0]


def test_id_less_conversations_sharing_a_client_trace_stay_apart():
    """The proxy continues a client's trace (#27): two new id-less conversations in it
    are named by their turn spans (anonymous:<trace>.<span>); lineage keeps each prompt's
    own name, not the trace's first."""
    rows = (router_turns("a", 1, 100.0, list(range(40)))
            + router_turns("b", 1, 101.0, list(range(500, 540))))
    names = {"a": "anonymous:t-shared.s1", "b": "anonymous:t-shared.s2"}
    for row in rows:
        conversation = row["trace_id"].split("-")[1]
        row.update({"trace_id": "t-shared", "span_id": f"{row['span_id']}-{conversation}",
                    sc.CONVERSATION_ID.key: names[conversation], sc.TURN_INDEX.key: 1})
    turns = turns_from_spans(frame(rows)).set_index("prefill_request_id")
    assert turns.loc["p-a-1", ["conversation_id", "turn"]].tolist() == [names["a"], 1]
    assert turns.loc["p-b-1", ["conversation_id", "turn"]].tolist() == [names["b"], 1]


def test_a_twin_whose_decision_is_missing_is_no_one_s_previous_turn():
    """Three conversations start alike (the same prompt, the same short greedy output).
    The second's decision span is missing, so nothing tells the third that it copies
    the second; its export (the prompt and 2 tokens, the same whole blocks as the prompt)
    has its key within the third's prompt. An export counts only when the prompt holds
    all its tokens: the third stays a first turn, never the second's next turn
    (missing-metadata). Seen on the real testbed behind vllm-router (block size 128)."""
    rows = router_turns("a", 1, 100.0, list(range(40)), output_tokens=3)
    rows += _copy(rows, "b", 1.0) + _copy(rows, "c", 2.0)
    rows = [r for r in rows if not (r["name"] == sc.SPAN_PULL_DECISION.name
                                    and r[sc.REQUEST_ID.key] == "p-b-1")]
    rows.append(span(sc.SPAN_PREFILL_REQUEST, 101.0, "t-a-1b",
                     **{sc.REQUEST_ID.key: "p-b-1", sc.ROLE.key: "prefill",
                        sc.PROMPT_TOKENS.key: 140}))
    turns = facts(frame(rows))
    assert turns.loc["p-c-1", "turn"] == 1
    assert pd.isna(turns.loc["p-c-1", "extends_request_id"])
    findings = _findings(rows)
    assert findings["p-c-1"].verdict is sc.Verdict.FIRST_TURN
    (twin,) = [f for rid, f in findings.items() if rid not in ("p-a-1", "p-c-1")]
    assert twin.verdict is sc.Verdict.INSUFFICIENT_EVIDENCE
