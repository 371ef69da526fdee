"""`kvobs whatif` changes the facts a setting decides and lets the verdict decision
`kvobs diagnose` uses decide them (kvobs/fleet/replay.py): replaying the recorded settings
gives back diagnose's verdicts turn for turn, a change to the rules shows in whatif as in
diagnose, and a replayed setting gives the verdicts diagnose gives a recording made with
it."""

from __future__ import annotations

import os

import pytest
from spanfactory import Tracers, TurnSpec, write_conversation

from kvobs.diagnose import all_turns
from kvobs.fleet import fleet_turns, label_turns, tune, whatif
from kvobs.fleet.replay import read_model, replay
from kvobs.settings import entry_lifetime_s, read_declined
from kvobs.sources import open_source
from kvobs.verdicts import Context, slow_transfer

DEMO_SPANS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "data", "demo-spans.otlp.jsonl")


def diagnosed(source) -> dict[tuple, str]:
    return {(d.tenant, d.conversation_id, d.turn.index): d.finding.verdict.value
            for d in all_turns(source)}


def keyed(turns, verdicts) -> dict[tuple, str]:
    return {(str(tenant), str(c), int(t)): str(v) for tenant, c, t, v in
            zip(turns["tenant"], turns["conversation_id"], turns["turn"], verdicts)}


def labelled(source):
    return label_turns(fleet_turns(source))


@pytest.fixture(scope="module")
def demo():
    source = open_source(DEMO_SPANS)
    turns, rate = labelled(source)
    return source, turns, rate


def test_the_recorded_settings_give_back_every_verdict_diagnose_gives_the_demo_run(demo):
    source, turns, rate = demo
    ttl, threshold = float(turns["ttl_s"].mode()[0]), int(turns["threshold"].mode()[0])
    assert (ttl, threshold) == (40.0, 64)  # the demo run DEMO_SPANS recorded
    expected = diagnosed(source)
    assert len(set(expected.values())) >= 8
    # None: as recorded turn by turn; 450: the demo proxy's fixed entry lifetime.
    for settings in ((ttl, threshold, None), (ttl, threshold, 450.0), (None, None, None)):
        result = whatif(turns, *settings, prefill_tokens_per_s=rate)
        assert keyed(turns, result.verdicts) == expected, settings
        assert result.changed_turns == 0
        assert result.predicted["verdicts"] == result.actual["verdicts"]
    # Without the labels, the replay decides every turn itself: the same verdicts.
    unlabelled = turns.drop(columns="verdict")
    replayed = replay(unlabelled, ttl, threshold, None, read_model(turns), Context(rate))
    assert keyed(turns, replayed.verdicts) == expected
    assert len(replayed.facts) == 0


def test_the_recorded_settings_give_back_diagnose_on_the_factory_and_synthetic_stores(
        factory_store, synthetic_store):
    for source in (open_source(factory_store), open_source(synthetic_store[0])):
        turns, rate = labelled(source)
        result = whatif(turns, None, None, prefill_tokens_per_s=rate)
        assert keyed(turns, result.verdicts) == diagnosed(source)
    # The synthetic fleet runs one TTL and one threshold: naming them is the same.
    result = whatif(turns, 480, 64, prefill_tokens_per_s=rate)
    assert result.changed_turns == 0


def test_a_changed_setting_changes_only_the_turns_it_decides(demo):
    _, turns, rate = demo
    changed = {}
    for settings in ((120.0, 64), (40.0, 16), (20.0, 64)):
        result = whatif(turns, *settings, prefill_tokens_per_s=rate)
        changed[settings] = {(c, t): (a, b) for c, t, a, b in zip(
            turns["conversation_id"], turns["turn"], turns["verdict"], result.verdicts)
            if a != b}
    # The long tool call outlived a 40 s TTL (P declined the read); 120 s keeps the KV.
    assert changed[120.0, 64] == {("agent-slow-tool", 2): ("expired", "remote-hit")}
    # 51 tokens were below 64; at 16 P reads them.
    assert changed[40.0, 16] == {("agent-small", 2): ("below-threshold", "remote-hit")}
    # At 20 s the kvobs proxy's entries live 10 s: the turns after 10-14 s gaps lose them.
    assert set(changed[20.0, 64]) == {
        (c, 2) for c in ("agent-shared", "agent-anon", "agent-fork", "agent-proxy-restart",
                         "agent-small")}
    assert {after for _, after in changed[20.0, 64].values()} == {"expired"}


@pytest.mark.parametrize("settings", [(120.0, 16, None), (20.0, 200, None),
                                      (40.0, 64, 60.0), (None, 16, 5.0)])
def test_deciding_only_the_changed_turns_is_deciding_them_all(demo, settings):
    _, turns, rate = demo
    model, context = read_model(turns), Context(rate)
    some = replay(turns, *settings, model, context)
    every = replay(turns.drop(columns="verdict"), *settings, model, context)
    assert list(some.verdicts) == list(every.verdicts)
    assert len(some.facts) > 0


def test_whatif_follows_a_change_to_the_verdict_rules(demo, monkeypatch):
    """With a rule changed (every done read judged slow), whatif's verdicts change as
    diagnose's do: it has no verdict order of its own."""
    source, _, _ = demo
    monkeypatch.setattr(slow_transfer, "applies",
                        lambda turns, context: slow_transfer._done(turns))
    turns, rate = labelled(source)
    expected = diagnosed(source)
    assert "remote-hit" not in expected.values()
    assert keyed(turns, whatif(turns, 40, 64, prefill_tokens_per_s=rate).verdicts) == expected
    longer = whatif(turns, 120, 64, prefill_tokens_per_s=rate)
    slow_tool = [v for c, t, v in zip(turns["conversation_id"], turns["turn"],
                                      longer.verdicts) if (c, t) == ("agent-slow-tool", 2)]
    assert slow_tool == ["slow-transfer"]  # the read it now makes, judged by the rule


# --------------------------------------------------------------------------- re-recorded

# Later turns: (conversation, gap s, P's local prefix L); each prompt N = 1000, D holds
# C = 900 tokens of it, so M = 900 - L.
CASES = (("near", 10.0, 0), ("small", 10.0, 860), ("mid", 10.0, 800), ("late", 38.0, 0))


def recording(ttl_s: float, threshold: int) -> dict[str, list[TurnSpec]]:
    """What the kvobs proxy, P and D record for CASES under D's TTL and P's threshold:
    the proxy's entry ends ``TTL - expiry margin`` after the first turn, P pulls from
    ``M >= threshold`` and declines a read within its decline window of D's expiry, D
    releases unread blocks at its TTL."""
    conversations = {}
    for name, gap, local in CASES:
        m = 900 - local
        fresh = gap < entry_lifetime_s(ttl_s)
        decision = ("no-params" if not fresh else
                    "below-threshold" if m < threshold else "pull")
        read = None
        if decision == "pull":
            read = "declined-expired" if read_declined(gap, ttl_s) else "done"
        first = TurnSpec(ttl_s=ttl_s, threshold=threshold,
                         release="read" if read == "done" else "expired")
        later = TurnSpec(gap_s=gap, ttl_s=ttl_s, threshold=threshold, local=local,
                         lookup="hit" if fresh else "stale", decision=decision, read=read,
                         remote=900 if fresh else 0,
                         fallback="read-declined" if read == "declined-expired" else None)
        conversations[name] = [first, later]
    return conversations


def write(path, conversations) -> str:
    tracers = Tracers(str(path))
    for offset, (name, specs) in enumerate(conversations.items()):
        write_conversation(tracers, name, specs, 1_700_000_000.0 + 1000 * offset)
    return str(path)


@pytest.mark.parametrize("ttl_s, threshold", [(50.0, 16), (15.0, 64), (30.0, 128),
                                              (30.0, 64)])
def test_a_replayed_setting_gives_what_diagnose_says_of_a_run_recorded_with_it(
        tmp_path, ttl_s, threshold):
    recorded = open_source(write(tmp_path / "recorded", recording(30.0, 64)))
    rerun = open_source(write(tmp_path / "rerun", recording(ttl_s, threshold)))
    turns, rate = labelled(recorded)
    result = whatif(turns, ttl_s, threshold, prefill_tokens_per_s=rate)
    assert keyed(turns, result.verdicts) == diagnosed(rerun)


def test_tune_replays_each_candidate_ttl_through_the_same_decision(demo):
    _, turns, rate = demo
    result = tune(turns, prefill_tokens_per_s=rate)
    for row in result.ttl_table:
        replayed = whatif(turns, row["ttl_s"], result.recommended_threshold or 64,
                          prefill_tokens_per_s=rate)
        counts = replayed.predicted["verdicts"]
        assert row["hits"] == counts.get("remote-hit", 0) + counts.get("slow-transfer", 0)
