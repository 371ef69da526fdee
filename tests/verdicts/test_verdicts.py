"""Every verdict from spans emitted through the real SDK/exporter path and read back."""

import pytest

from kvobs.diagnose import diagnose
from kvobs.semconv import Verdict
from kvobs.sources import open_source
from spanfactory import Tracers, TurnSpec, write_conversation

HIT = TurnSpec(read="done")

CASES = {
    # name: (turn 2 spec, expected verdict of turn 2)
    "remote-hit": (HIT, Verdict.REMOTE_HIT),
    "no-id": (TurnSpec(lookup="no-id", decision="no-params"), Verdict.MISSING_METADATA),
    "proxy-miss": (TurnSpec(lookup="miss", decision="no-params"), Verdict.MISSING_METADATA),
    "params-lost": (TurnSpec(lookup="hit", decision="no-params"), Verdict.MISSING_METADATA),
    "invalid-params": (TurnSpec(lookup="hit", decision="invalid"), Verdict.MISSING_METADATA),
    "stale-entry": (TurnSpec(lookup="stale", decision="no-params", gap_s=40),
                    Verdict.EXPIRED),
    "declined": (TurnSpec(read="declined-expired", fallback="read-declined", gap_s=40),
                 Verdict.EXPIRED),
    "fallback-only": (TurnSpec(read=None, fallback="read-declined"), Verdict.EXPIRED),
    "below-threshold": (TurnSpec(decision="below-threshold", remote=1030, n=1040, local=992),
                        Verdict.BELOW_THRESHOLD),
    "local-hit": (TurnSpec(decision="local-hit", local=992, remote=900), Verdict.LOCAL_HIT),
    "proxy-prefix": (TurnSpec(lookup="prefix-mismatch", decision="no-params"),
                     Verdict.PREFIX_MISMATCH),
    "p-prefix": (TurnSpec(decision="prefix-mismatch"), Verdict.PREFIX_MISMATCH),
    "failed": (TurnSpec(read="failed", fallback="read-failed"), Verdict.TRANSFER_FAILED),
    "stuck": (TurnSpec(read=None, stuck=True), Verdict.TRANSFER_FAILED),
    # 900 tokens at 1000/0.2 = 5000 tok/s recompute in 0.18 s; a 0.5 s read is more than
    # slow_transfer_factor (2) times slower; a 0.3 s read is slower, inside the rate's spread.
    "slow": (TurnSpec(read="done", read_duration_s=0.5), Verdict.SLOW_TRANSFER),
    "break-even": (TurnSpec(read="done", read_duration_s=0.3), Verdict.REMOTE_HIT),
    # The same 0.5 s read, 0.49 s of it after P's worker last saw it in flight (P's own
    # compute step held its completion): 10 ms in flight, not the link's fault.
    "held-by-p-step": (TurnSpec(read="done", read_duration_s=0.5, read_unobserved_s=0.49,
                                phases={"read": 0.5, "decode": 0.1}), Verdict.REMOTE_HIT),
    "slow-though-watched": (TurnSpec(read="done", read_duration_s=0.5,
                                     read_unobserved_s=0.01,
                                     phases={"read": 0.5, "decode": 0.1}),
                            Verdict.SLOW_TRANSFER),
    "miss": (TurnSpec(decision="pull", read=None, extra={}), None),
    "no-decision-span": (TurnSpec(decision=None), Verdict.INSUFFICIENT_EVIDENCE),
    "no-lookup-span": (TurnSpec(lookup=None, decision=None), Verdict.INSUFFICIENT_EVIDENCE),
    "no-proxy-at-all": (TurnSpec(proxy=False), Verdict.INSUFFICIENT_EVIDENCE),
    # A declined read is expiry unless D restarted (then transfer-failed): the restart is
    # known from lineage on P's decision span, so without it the turn is not expired.
    "declined-no-decision-span": (TurnSpec(decision=None, read="declined-expired",
                                           fallback="read-declined", gap_s=40),
                                  Verdict.INSUFFICIENT_EVIDENCE),
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("store"))
    tracers = Tracers(path)
    for name, (spec, _) in CASES.items():
        write_conversation(tracers, name, [TurnSpec(lookup=None, decision="no-params"), spec])
    # expired by D's own release before the turn began, proxy still had the entry
    write_conversation(tracers, "released",
                       [TurnSpec(decision="no-params", release="expired", ttl_s=10),
                        TurnSpec(read="failed", gap_s=30)])
    write_conversation(tracers, "unexplained",
                       [TurnSpec(decision="no-params"),
                        TurnSpec(decision="no-params", params_sent=False)])
    return open_source(path)


@pytest.mark.parametrize("name", [n for n, (_, v) in CASES.items() if v is not None])
def test_turn_two_verdict(store, name):
    spec, expected = CASES[name]
    result = diagnose(store, name)
    assert [t.finding.verdict for t in result.turns] == [Verdict.FIRST_TURN, expected]


def test_pull_without_read_span_is_insufficient(store):
    (first, second) = diagnose(store, "miss").turns
    assert second.finding.verdict is Verdict.INSUFFICIENT_EVIDENCE
    assert second.finding.evidence["missing_span"] == "kvobs.prefill.read"
    assert second.finding.evidence["missing_from"] == "kvobs-prefill"


def test_missing_decision_names_the_span(store):
    second = diagnose(store, "no-decision-span").turns[1]
    assert second.finding.evidence == {
        "missing_span": "kvobs.prefill.pull_decision", "missing_from": "kvobs-prefill",
        "needed_for": "below-threshold", "missing_field": "decision"}


def test_d_released_before_turn_is_expired(store):
    second = diagnose(store, "released").turns[1]
    assert second.finding.verdict is Verdict.EXPIRED
    assert second.finding.evidence["prev_release_reason"] == "expired"


def test_valid_params_nothing_reused_is_miss(store):
    second = diagnose(store, "unexplained").turns[1]
    assert second.finding.verdict is Verdict.MISS


def test_remote_hit_evidence_and_numbers(store):
    result = diagnose(store, "remote-hit")
    second = result.turns[1]
    assert second.finding.evidence["read_bytes"] == 2_000_000
    assert second.finding.evidence["candidate_tokens"] == 900
    assert second.turn.get("gap_s") == pytest.approx(5.0)
    assert second.turn.get("prefill_request_id") == "p-remote-hit-2"
    assert second.turn.get("prev_decode_request_id") == "d-remote-hit-1"
    assert result.context.prefill_tokens_per_s == pytest.approx(1000 / 0.2)


def test_slow_transfer_shows_arithmetic(store):
    second = diagnose(store, "slow").turns[1]
    assert second.finding.evidence["recompute_estimate_s"] == pytest.approx(900 / 5000)
    assert second.finding.evidence["read_duration_s"] == pytest.approx(0.5)


def test_slow_transfer_factor_is_the_line(store):
    """The same 0.3 s read of 900 tokens (estimate 0.18 s) is slow-transfer under a factor
    below 0.3 / 0.18, a remote-hit above it: the factor decides, and the evidence says
    which factor it was."""
    from kvobs.turns.correlate import turns_from_spans
    from kvobs.verdicts import slow_transfer
    from kvobs.verdicts._base import Context

    turns = turns_from_spans(store.spans("break-even"))
    second_turn = list(turns["turn"]).index(2)
    slow = {factor: bool(slow_transfer.applies(turns, Context(5000.0, None, factor))[second_turn])
            for factor in (1.5, 1.7)}
    assert slow == {1.5: True, 1.7: False}
    second = diagnose(store, "slow").turns[1]
    assert second.finding.evidence["slow_transfer_factor"] == 2.0


def test_read_slo_makes_a_fast_read_slow(store):
    assert diagnose(store, "remote-hit", read_slo_s=0.001).turns[1].finding.verdict \
        is Verdict.SLOW_TRANSFER


def test_a_read_held_by_p_s_step_is_named_as_such(store):
    """The held read's latency cause says P's compute held it, not the link."""
    held = diagnose(store, "held-by-p-step").turns[1]
    slow = diagnose(store, "slow-though-watched").turns[1]
    (held_read,) = [c for c in held.causes if c.cause.value == "slow-read"]
    (slow_read,) = [c for c in slow.causes if c.cause.value == "slow-read"]
    assert "P's own compute step" in held_read.remedy
    assert "not the link" in held_read.remedy
    assert "check the P<->D link" in slow_read.remedy
    assert held_read.evidence["read_unobserved_s"] == 0.49
