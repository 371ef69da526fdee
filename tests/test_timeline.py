"""The turn timeline and latency causes, through the real emit -> store -> read path."""

from __future__ import annotations

import os

import pytest
from spanfactory import Tracers, TurnSpec, write_conversation

from kvobs import semconv as sc
from kvobs.causes import CauseContext, causes
from kvobs.diagnose import all_turns, diagnose
from kvobs.sources import open_source
from kvobs.timeline import PHASES, phase_column

# A streamed turn that read D's KV: every phase named, in milliseconds.
FULL = {"proxy-in": 0.002, "p-frontend": 0.003, "p-queue": 0.040, "p-schedule": 0.001,
        "read-wait": 0.001, "read-setup": 0.004, "read": 0.006, "p-compute": 0.050,
        "p-return": 0.002, "proxy-hop": 0.001, "d-frontend": 0.003, "d-queue": 0.001,
        "handoff-wait": 0.001, "handoff-setup": 0.001, "handoff": 0.010,
        "d-first-token": 0.020, "decode": 0.300, "proxy-out": 0.002}


def _source(tmp_path, turns, cid="c"):
    tracers = Tracers(str(tmp_path))
    write_conversation(tracers, cid, turns)
    return open_source(str(tmp_path))


def _turn(tmp_path, spec, first=None):
    first = first or TurnSpec(phases={"p-compute": 0.1}, decision="no-params")
    source = _source(tmp_path, [first, spec])
    return diagnose(source, "c").turns[1]


def test_phases_of_a_streamed_turn_add_up_to_latency_and_ttft(tmp_path):
    item = _turn(tmp_path, TurnSpec(read="done", phases=FULL, stream=True))
    timeline = item.timeline
    assert list(timeline.phases) == [p for p in FULL]  # time order; p-retry not taken
    assert timeline.phases == pytest.approx(FULL, abs=2e-6)
    assert timeline.latency_s == pytest.approx(sum(FULL.values()), abs=2e-6)
    before_first_token = sum(v for k, v in FULL.items() if k not in ("decode", "proxy-out"))
    assert timeline.ttft_s == pytest.approx(before_first_token, abs=2e-6)
    assert timeline.ttft_source == "proxy-stream"
    assert timeline.unmeasured == {} and timeline.skew == []
    assert timeline.slowest == ("decode", pytest.approx(0.3, abs=2e-6))


def test_non_streamed_ttft_is_the_engine_first_token(tmp_path):
    item = _turn(tmp_path, TurnSpec(read="done", phases=FULL, stream=False))
    assert item.timeline.ttft_source == "engine"
    assert item.timeline.ttft_s == pytest.approx(
        sum(FULL.values()) - FULL["decode"] - FULL["proxy-out"], abs=2e-6)
    assert item.to_dict()["ttft_s"] != item.to_dict()["latency_s"]


def test_missing_decode_span_merges_phases_and_says_why(tmp_path):
    spec = TurnSpec(read="done", phases=FULL, stream=False,
                    omit=(sc.SPAN_DECODE_REQUEST.name,))
    timeline = _turn(tmp_path, spec).timeline
    assert timeline.ttft_s is None  # non-streamed and no D request span: not guessed
    merged = "d-frontend+d-queue+handoff-wait"
    assert timeline.phases[merged] == pytest.approx(0.005, abs=2e-6)
    assert timeline.phases["handoff+d-first-token+decode"] == pytest.approx(0.33, abs=2e-6)
    assert "kvobs.decode.request" in timeline.unmeasured["d-queue"]
    assert "non-streamed turn" in timeline.unmeasured["decode"]
    assert sum(timeline.phases.values()) == pytest.approx(timeline.latency_s, abs=1e-6)


def test_a_turn_without_read_has_no_read_phases(tmp_path):
    phases = {"proxy-in": 0.001, "p-queue": 0.01, "p-compute": 0.2, "decode": 0.1}
    item = _turn(tmp_path, TurnSpec(lookup="miss", decision="no-params", phases=phases))
    assert "read" not in item.timeline.phases and "read-setup" not in item.timeline.phases
    assert item.turn.get(phase_column(sc.Phase.READ)) == 0.0
    assert item.timeline.phases["p-compute"] == pytest.approx(0.2, abs=2e-6)
    assert item.timeline.unmeasured == {}


def test_queued_at_p_is_named_although_the_reuse_verdict_is_healthy(tmp_path):
    phases = {**FULL, "p-queue": 3.0}
    item = _turn(tmp_path, TurnSpec(read="done", phases=phases, stream=True))
    assert item.finding.verdict is sc.Verdict.REMOTE_HIT
    assert item.timeline.slowest[0] == "p-queue"
    assert item.causes[0].cause is sc.LatencyCause.QUEUED_AT_P
    # P's queue and its worker's wait before the read both held the request behind work
    queued = phases["p-queue"] + phases["read-wait"]
    assert item.causes[0].share == pytest.approx(queued / sum(phases.values()), abs=1e-4)
    assert "queue" in item.finding.remedy and "p-queue" in item.finding.remedy


def test_connection_setup_eats_the_gain_of_a_read(tmp_path):
    """The read saved P compute but the handshake cost more: no TTFT gained, said so."""
    first = TurnSpec(phases={"p-compute": 0.1}, n=1000,  # rate: 10,000 tokens/s
                     decision="no-params", lookup=None)
    phases = {**FULL, "read-setup": 0.66}
    item = _turn(tmp_path, TurnSpec(read="done", phases=phases, read_duration_s=0.006,
                                    remote=900, stream=True), first)
    assert item.finding.verdict is sc.Verdict.REMOTE_HIT
    assert item.turn.get("compute_saved_s") == pytest.approx(0.09)
    assert item.turn.get("ttft_gained_s") == pytest.approx(0.09 - 0.66 - 0.006, abs=1e-4)
    assert "gained no TTFT: NIXL connection set-up" in item.finding.remedy
    assert sc.LatencyCause.CONNECTION_SETUP in [c.cause for c in item.causes]


def _row(**phases):
    row = {phase_column(p): 0.0 for p in PHASES}
    row.update({phase_column(sc.Phase(k)): v for k, v in phases.items()})
    row["latency_s"] = sum(phases.values())
    row["slowest_phase"] = max(phases, key=phases.get)
    return row


def test_decode_splits_into_busy_or_long_output_by_its_rate():
    typical = CauseContext(decode_s_per_token=0.01)
    busy = {**_row(decode=1.0, **{"p-compute": 0.1}), "output_tokens": 51}  # 20 ms/token
    normal = {**_row(decode=0.5, **{"p-compute": 0.1}), "output_tokens": 51}  # 10 ms/token
    assert causes(busy, typical)[0].cause is sc.LatencyCause.DECODE_BUSY
    assert causes(normal, typical)[0].cause is sc.LatencyCause.LONG_OUTPUT
    assert "typical for this source" in causes(normal, typical)[0].remedy
    unknown = causes(normal, CauseContext())[0]  # too few turns to know the typical rate
    assert unknown.cause is sc.LatencyCause.LONG_OUTPUT
    assert "(10.0 ms each)" in unknown.remedy and "typical" not in unknown.remedy


def test_small_phases_are_not_causes_unless_slowest():
    row = _row(decode=1.0, **{"proxy-in": 0.01, "p-queue": 0.2})
    assert [c.cause for c in causes(row)] == [sc.LatencyCause.LONG_OUTPUT]
    row = _row(**{"proxy-in": 0.03, "proxy-out": 0.03, "p-compute": 0.02})
    assert causes(row)[0].cause is sc.LatencyCause.PROXY_OVERHEAD
    assert causes(row)[0].seconds == pytest.approx(0.06)


def test_every_phase_has_a_cause_with_a_remedy():
    for phase in PHASES:
        row = _row(**{phase.value: 1.0})
        (finding,) = causes(row)
        assert finding.share == 1.0 and finding.remedy


def test_a_handshake_is_named_at_a_lower_share_than_other_phases():
    """The first-contact turn CI recorded: a 32 ms handshake in a 163 ms TTFT (20 %) is
    named; P's queueing at the same share is not."""
    row = {**_row(decode=0.32, **{"handoff-setup": 0.032, "p-compute": 0.13}),
           "ttft_s": 0.163}
    assert sc.LatencyCause.CONNECTION_SETUP in [c.cause for c in causes(row)]
    row = {**_row(decode=0.32, **{"p-queue": 0.032, "p-compute": 0.13}), "ttft_s": 0.163}
    assert sc.LatencyCause.QUEUED_AT_P not in [c.cause for c in causes(row)]
    row = {**_row(decode=0.32, **{"handoff-setup": 0.012, "p-compute": 0.15}),
           "ttft_s": 0.163}  # 7 %: not
    assert sc.LatencyCause.CONNECTION_SETUP not in [c.cause for c in causes(row)]


def test_queueing_remedies_name_the_signal_that_holds_the_time():
    """vLLM's queue-time histogram starts at the engine core's QUEUED event; the remedy
    names the classifier's phase histogram, which runs from vLLM's arrival time."""
    from kvobs import causes, semconv as sc

    for cause, phase in ((sc.LatencyCause.QUEUED_AT_P, "p-queue"),
                         (sc.LatencyCause.QUEUED_AT_D, "d-queue")):
        remedy, _ = causes.EXPLAIN[cause]({}, 0.3, causes.CauseContext())
        assert f'kvobs_turn_phase_seconds{{phase="{phase}"}}' in remedy
        assert "not vllm:request_queue_time_seconds" in remedy


def test_the_hop_between_the_engines_is_blamed_on_the_proxy_only_when_one_was_there():
    """Behind another router the hop between the engines' front doors is that router's:
    its remedy names the router, not kvobs proxy's lookup and store."""
    from kvobs import causes, semconv as sc

    explain = causes.EXPLAIN[sc.LatencyCause.PROXY_OVERHEAD]
    routed, _ = explain({}, 0.2, causes.CauseContext())
    assert routed.startswith("The router between P and D took 200") and "proxy" not in routed
    proxied, _ = explain({"turn_start_ns": 1}, 0.2, causes.CauseContext())
    assert "kvobs_proxy_phase_seconds" in proxied


def test_without_a_proxy_the_engines_bound_the_turn_and_the_router_share_is_named(tmp_path):
    """Behind another router (no proxy span at all): the turn runs from P's arrival to
    D's last token (its request span's end), decode is measured, and the gap between
    P's answer and D's arrival is named as the router's."""
    spec = TurnSpec(lookup=None, proxy=False, read="done", phases=FULL, stream=False)
    timeline = _turn(tmp_path, spec, first=TurnSpec(lookup=None, proxy=False,
                                                     phases={"p-compute": 0.1},
                                                     decision="no-params")).timeline
    engines = sum(v for k, v in FULL.items() if k not in ("proxy-in", "p-frontend",
                                                          "proxy-out"))
    assert timeline.latency_s == pytest.approx(engines, abs=2e-6)
    assert timeline.phases["decode"] == pytest.approx(FULL["decode"], abs=2e-6)
    assert timeline.slowest_phase == "decode"
    router = "p-return+proxy-hop+d-frontend"
    assert timeline.phases[router] == pytest.approx(
        FULL["p-return"] + FULL["proxy-hop"] + FULL["d-frontend"], abs=2e-6)
    assert "the router's time" in timeline.unmeasured["proxy-hop"]
    assert "client-facing edges" in timeline.unmeasured["latency"]


def test_behind_a_router_the_engines_http_front_doors_bound_the_turn(tmp_path):
    """With the engines' HTTP spans (kvobs.emit.engine_http) and no proxy: the turn runs
    from P's API server receiving the request to D's sending its last byte; P's front
    door, P's answer leaving, the router's hop and D's front door are phases of their
    own; only the router's edges before P and after D are unseen."""
    spec = TurnSpec(lookup=None, proxy=False, read="done", phases=FULL, stream=False,
                    http=True)
    first = TurnSpec(lookup=None, proxy=False, phases={"p-compute": 0.1},
                     decision="no-params", http=True)
    # Over every span: behind a router the HTTP spans are in no trace of the turn's (the
    # spans of a conversation's traces are what a source selects for one conversation).
    turns = all_turns(_source(tmp_path, [first, spec]))
    timeline = next(t for t in turns if t.turn.get("turn") == 2).timeline
    inside = {k: v for k, v in FULL.items() if k not in ("proxy-in", "proxy-out")}
    assert timeline.latency_s == pytest.approx(sum(inside.values()), abs=2e-6)
    assert set(timeline.phases) == set(inside)
    for phase, seconds in inside.items():
        assert timeline.phases[phase] == pytest.approx(seconds, abs=2e-6), phase
    assert set(timeline.unmeasured) == {"proxy-in", "proxy-out", "latency"}
    assert "the router's time" in timeline.unmeasured["proxy-in"]
    assert "P's API server receiving the request" in timeline.unmeasured["latency"]


DEMO_SPANS = os.path.join(os.path.dirname(__file__), "data",
                          "demo-spans.otlp.jsonl")


def test_no_turn_of_the_demo_run_has_a_negative_phase():
    """The real testbed's spans (tests/data/demo-spans.otlp.jsonl): every phase of every
    turn is >= 0 and no clock skew is reported (P, D and the proxy share one host's
    clock). The retried turns (D restarted, the slow tool call past D's TTL) read D's KV
    in their failed first attempt, before the proxy's retry: that read lies inside
    `p-retry`, not after the retry's allocation (it made `read-wait` negative)."""
    diagnoses = all_turns(open_source(DEMO_SPANS))
    retried = [d for d in diagnoses if d.turn.get("p_retry_sent_at") is not None]
    assert {d.conversation_id for d in retried} >= {"agent-d-restart", "agent-slow-tool"}
    for d in diagnoses:
        timeline = d.timeline
        label = f"{d.conversation_id} turn {d.turn.index}"
        assert timeline.skew == [], label
        assert all(seconds >= 0 for seconds in timeline.phases.values()), (label, timeline.phases)
        assert sum(timeline.phases.values()) == pytest.approx(timeline.latency_s, abs=1e-6)
        for phase in PHASES:
            seconds = d.turn.get(phase_column(phase))
            assert seconds is None or not seconds < 0, (label, phase)
    for d in retried:
        assert "p-retry" in d.timeline.phases
        assert not {"read-wait", "read-setup", "read"} & set(d.timeline.phases)
