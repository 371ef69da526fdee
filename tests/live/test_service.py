"""``kvobs collect`` classifying live: OTLP in (JSON and protobuf, as the SDK's and the
Collector's otlphttp exporters send it), true verdicts out on /metrics, one
conversation over HTTP, final turns in the turn store, the same turns as the batch."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from google.protobuf.json_format import ParseDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvobs import semconv as sc
from kvobs.diagnose import all_turns
from kvobs.emit.collect import Stored
from kvobs.live.service import LIVE, LiveSettings, build_app
from kvobs.live.turnstore import TurnStore
from kvobs.sources import open_source

DEMO = Path(__file__).resolve().parents[1] / "data" / "demo-spans.otlp.jsonl"


def _protobuf(request: dict) -> bytes:
    """The request as the protobuf exporters send it (ids are base64 in protobuf JSON)."""
    import base64
    import copy

    request = copy.deepcopy(request)
    for resource_spans in request["resourceSpans"]:
        for scope_spans in resource_spans["scopeSpans"]:
            for span in scope_spans["spans"]:
                for field in ("traceId", "spanId", "parentSpanId"):
                    if span.get(field):
                        span[field] = base64.b64encode(bytes.fromhex(span[field])).decode()
                for link in span.get("links", ()):
                    for field in ("traceId", "spanId"):
                        link[field] = base64.b64encode(bytes.fromhex(link[field])).decode()
    return ParseDict(request, ExportTraceServiceRequest()).SerializeToString()


def _samples(text: str, name: str) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


GRACE_S = 2.0


def test_spans_in_true_verdicts_out(tmp_path):
    lines = [line for line in DEMO.read_text().split("\n") if line.strip()]

    async def scenario():
        # A turn is final once no span of it came for grace_s; the posts below carry a
        # turn's spans apart, and on a loaded box (load average 35) two posts were more
        # than 0.3 s apart: turns went final early as insufficient-evidence, and the
        # count then differs from the batch. 2 s exceeds any gap seen there.
        app = build_app(str(tmp_path), LiveSettings(window_s=600, grace_s=GRACE_S,
                                                    interval_s=0.1))
        async with TestClient(TestServer(app)) as client:
            for i, line in enumerate(lines):
                if i % 2:
                    response = await client.post("/v1/traces", data=line,
                                                 headers={"Content-Type": "application/json"})
                else:
                    response = await client.post(
                        "/v1/traces", data=_protobuf(json.loads(line)),
                        headers={"Content-Type": "application/x-protobuf"})
                assert response.status == 200, await response.text()
            live = app[LIVE]
            # Until every turn is final; the bound only guards against a hang (passes
            # slow down on a loaded box: 10 s was once too short).
            for _ in range(600):
                await asyncio.sleep(0.1)
                if live.classifier.turns and not live.classifier.open_turns():
                    break
            metrics = await (await client.get("/metrics")).text()
            happy = await client.get("/conversations/agent-happy")
            page = await client.get("/conversations/agent-happy/html")
            unknown = await client.get("/conversations/nobody")
            return (metrics, happy.status, await happy.json(), page.status,
                    await page.text(), unknown.status, live)

    metrics, status, happy, page_status, page, unknown, live = asyncio.run(scenario())
    batch = all_turns(open_source(str(tmp_path)))
    expected: dict[str, int] = {}
    for diagnosis in batch:
        expected[diagnosis.finding.verdict.value] = expected.get(
            diagnosis.finding.verdict.value, 0) + 1
    counted: dict[str, float] = {}
    for labels, value in _samples(metrics, "kvobs_turns_total").items():
        counted[dict(labels)["verdict"]] = counted.get(dict(labels)["verdict"], 0) + value
    assert {v: n for v, n in counted.items() if n} == expected
    assert sum(expected.values()) == 25
    # How much of its one core the service uses (KvobsClassifierSaturated reads it).
    assert _samples(metrics, "process_cpu_seconds_total")[()] > 0
    assert "conversation_id" not in metrics and "agent-happy" not in metrics
    assert sum(_samples(metrics, "kvobs_turn_slowest_phase_total").values()) == 25
    assert sum(_samples(metrics, "kvobs_classifier_spans_total").values()) > 300
    assert status == 200 and [t["turn"] for t in happy["turns"]] == [1, 2, 3]
    assert [t["verdict"] for t in happy["turns"]] == ["first-turn", "remote-hit", "remote-hit"]
    assert all(t["final"] for t in happy["turns"])  # versions: spans came in pieces
    assert page_status == 200 and "remote-hit" in page and "<script" not in page
    assert unknown == 404
    # every final turn is in the turn store, as the service serves it
    stored = TurnStore(str(tmp_path), 86400).latest("agent-happy")
    assert [t["verdict"] for t in stored] == ["first-turn", "remote-hit", "remote-hit"]
    assert TurnStore(str(tmp_path), 86400).read().num_rows == 25


def test_turns_leave_memory_for_the_turn_store(tmp_path):
    """A conversation past the window is answered from the stored rows."""
    lines = [json.loads(line) for line in DEMO.read_text().split("\n") if line.strip()]
    app = build_app(str(tmp_path), LiveSettings(window_s=60, grace_s=0))
    live = app[LIVE]
    for request in lines:
        live.classifier.add_request(request, now=1000)
    live.run_pass(now=1000)
    live.run_pass(now=1001)  # final: written
    live.run_pass(now=2000)  # left the window
    assert live.classifier.conversation("agent-happy") == []
    turns = live.conversation("agent-happy", None)
    assert [t["verdict"] for t in turns] == ["first-turn", "remote-hit", "remote-hit"]
    assert sc.EXEMPLAR_TRACE_ID == "trace_id" and all(t["trace_id"] for t in turns)


def test_a_restart_resumes_from_the_stores_and_counts_every_turn_once(tmp_path):
    """The demo's export requests sent half to one classifier process and half to the
    next, on one store (a restart between them, turns split across it). The second
    takes the first's final turns from the turn store and replays the live segments:
    every turn is counted on /metrics once over both runs, and the turn store's latest
    rows give every turn the verdict the batch path gives over all the spans."""
    lines = [line for line in DEMO.read_text().split("\n") if line.strip()]
    halves = (lines[: len(lines) // 2], lines[len(lines) // 2:])

    async def run(part):
        # grace: see test_spans_in_true_verdicts_out
        app = build_app(str(tmp_path), LiveSettings(window_s=600, grace_s=GRACE_S,
                                                    interval_s=0.1))
        async with TestClient(TestServer(app)) as client:
            for line in part:
                response = await client.post("/v1/traces", data=line,
                                             headers={"Content-Type": "application/json"})
                assert response.status == 200
            live = app[LIVE]
            # Until every turn is final; the bound only guards against a hang (passes
            # slow down on a loaded box: 10 s was once too short).
            for _ in range(600):
                await asyncio.sleep(0.1)
                if live.classifier.turns and not live.classifier.open_turns():
                    break
            return await (await client.get("/metrics")).text()

    first = asyncio.run(run(halves[0]))
    second = asyncio.run(run(halves[1]))
    counted = [sum(_samples(text, "kvobs_turns_total").values()) for text in (first, second)]
    batch = all_turns(open_source(str(tmp_path)))
    # The first half's spans make 25 turns, as the batch over them does, but four are
    # partial (two id-less pairs whose trace's tagged spans come in the second half): the
    # second run puts them under their conversations' keys, re-classified, not recounted.
    assert len(batch) == 25 and counted[0] > 0
    assert sum(counted) == 25
    assert sum(_samples(second, "kvobs_turns_reclassified_total").values()) > 0
    store = TurnStore(str(tmp_path), 86400)
    for diagnosis in batch:
        (stored,) = [t for t in store.latest(diagnosis.conversation_id)
                     if (t["tenant"], t["turn"]) == (diagnosis.tenant, diagnosis.turn.index)]
        assert stored["verdict"] == diagnosis.finding.verdict.value, diagnosis.conversation_id


def test_a_stop_writes_every_turn_as_it_stands(tmp_path):
    """Spans that arrived just before SIGTERM, never classified by a pass: the stop
    classifies them and writes every turn (a single last pass classified them too late
    to call any final: nothing was written)."""
    lines = [line for line in DEMO.read_text().split("\n") if line.strip()]
    app = build_app(str(tmp_path), LiveSettings(window_s=600, grace_s=10))
    live = app[LIVE]
    for line in lines:
        live.receive(Stored(line, 0))
    asyncio.run(live.stop(app))
    assert TurnStore(str(tmp_path), 86400).read().num_rows == 25
    assert [t["verdict"] for t in TurnStore(str(tmp_path), 86400).latest("agent-happy")] \
        == ["first-turn", "remote-hit", "remote-hit"]


def test_the_service_upkeep_merges_and_expires_the_turn_store(tmp_path):
    """``Live.maintain`` (run off the event loop every MAINTAIN_S): a closed hour's parts
    merged, with the report's tally of the merged file, partitions past the retention
    dropped."""
    from kvobs.live.turnstore import COMPACT_AFTER_S

    app = build_app(str(tmp_path), LiveSettings(window_s=60, turn_retention_s=2 * 3600.0))
    live = app[LIVE]
    t0 = 1_767_225_600.0
    row = {"tenant": "t", "conversation_id": "c", "verdict": "first-turn", "version": 1}
    for second in range(3):
        live.turns.write([{**row, "turn": second + 1}], now=t0 + second)
    live.turns.write([{**row, "turn": 9}], now=t0 + 5 * 3600)
    live.maintain(now=t0 + 3600 + COMPACT_AFTER_S + 1)
    hour = tmp_path / "turns" / "hour=2026010100"
    assert [p.name.startswith("merged-") for p in hour.glob("*.parquet")] == [True]
    [(merged, tally)] = list(live.turns.summaries())
    assert merged.startswith(str(hour)) and not live.turns.unsummarized()
    from kvobs.fleet.turn_tally import TurnTally
    assert TurnTally.from_bytes(tally).turns == 3
    live.maintain(now=t0 + 5 * 3600 + 60)
    assert not hour.exists()
    assert [t["turn"] for t in live.conversation("c", None)] == [9]


def test_a_restart_replays_from_the_earliest_span_the_buffer_held(tmp_path):
    """A conversation held past the window (it went on) is held whole after a restart:
    each pass notes when the service received the earliest span held, and the restart
    replays the live segments written since then, not only those of the window. On the
    service's clock, not the emitters': here they run an hour ahead (noted by the spans'
    end times, the restart would start after the segment was written and find nothing).
    A replayed span counts as received when its segment was last written, so a second
    restart replays it again."""
    import os
    import time

    from kvobs.emit.segments import SUFFIX
    from kvobs.semconv import STORE_CLASSIFIER_HELD, STORE_LIVE_DIR

    lines = [line for line in DEMO.read_text().split("\n") if line.strip()]
    live = build_app(str(tmp_path), LiveSettings(window_s=60, grace_s=GRACE_S))[LIVE]
    earliest = min(row["end_ns"] for row in open_source(str(DEMO)).span_table().to_pylist())
    received = earliest / 1e9 - 3600  # the emitters' clocks run an hour ahead
    for at, line in enumerate(lines):
        live.receive(Stored(line, 0), now=received + at / 10)
    live.run_pass(received + 30)
    note = json.loads((tmp_path / STORE_CLASSIFIER_HELD).read_text())
    assert note == {"held_since": received}

    # The segment was written as the spans came (receive() is what the HTTP handler
    # calls once it stored them); the restart is long after the window.
    segment = tmp_path / STORE_LIVE_DIR / ("demo" + SUFFIX)
    segment.parent.mkdir(parents=True, exist_ok=True)
    segment.write_text("\n".join(lines) + "\n")
    written = received + len(lines) / 10
    os.utime(segment, (written, written))
    restart = received + 3600

    def replayed(at: float) -> tuple[int, int]:
        again = build_app(str(tmp_path), LiveSettings(window_s=60, grace_s=GRACE_S))[LIVE]
        again.resume(at)
        # Classified before the service listens (no pass of its loop needed): the pass
        # over the window's spans must not hold up /health once it listens.
        return again.classifier.spans_received, len(again.classifier.turns)

    # every span, as received
    assert replayed(restart) == (live.classifier.spans_received, len(live.classifier.turns))
    assert len(live.classifier.turns) > 0
    # The restarted service noted the segment's time, not its own start's: a second
    # restart, another hour on, holds every span again.
    assert json.loads((tmp_path / STORE_CLASSIFIER_HELD).read_text()) == {"held_since": written}
    assert replayed(restart + 3600) == (live.classifier.spans_received, len(live.classifier.turns))
    (tmp_path / STORE_CLASSIFIER_HELD).unlink()
    assert replayed(restart) == (0, 0)  # the window's segments alone: none
    # Once nothing is held (every conversation left), the window is enough.
    later = time.time() + 120
    live.run_pass(later)
    assert len(live.classifier.buffer) == 0
    assert json.loads((tmp_path / STORE_CLASSIFIER_HELD).read_text()) == {"held_since": later}


def test_a_restart_whose_first_pass_fails_still_starts(tmp_path, monkeypatch, caplog):
    """The pass over the replayed spans runs before the service listens: one that fails
    is logged, the service starts, and its loop's next pass classifies them."""
    from kvobs.emit.segments import SUFFIX
    from kvobs.semconv import STORE_LIVE_DIR

    segment = tmp_path / STORE_LIVE_DIR / ("demo" + SUFFIX)
    segment.parent.mkdir(parents=True)
    segment.write_text(DEMO.read_text())
    live = build_app(str(tmp_path), LiveSettings(window_s=600, grace_s=GRACE_S))[LIVE]

    def broken(now=None):
        raise RuntimeError("a pass that fails")

    monkeypatch.setattr(live.classifier, "run_pass", broken)
    live.resume()
    assert "could not classify the replayed spans" in caplog.text
    assert live.classifier.spans_received > 0 and not live.classifier.turns
    monkeypatch.undo()
    live.run_pass()
    assert live.classifier.turns


def _coming_back() -> tuple[list[str], list[str], list[dict]]:
    """The demo's export requests in two parts: those that carry agent-happy's turns 2 and
    3 (with whatever else they carry), and the rest; and the demo's spans."""
    lines = [line for line in DEMO.read_text().split("\n") if line.strip()]
    rows = open_source(str(DEMO)).span_table().to_pylist()
    later_traces = {r["trace_id"] for r in rows
                    if r.get(sc.CONVERSATION_ID.key) == "agent-happy"
                    and (r.get(sc.TURN_INDEX.key) or 0) >= 2}
    later = [line for line in lines if any(trace in line for trace in later_traces)]
    return [line for line in lines if line not in later], later, rows


def test_a_conversation_that_comes_back_after_the_window_is_recalled(tmp_path):
    """The demo's spans in two parts: agent-happy's turns 2 and 3 (and whatever else their
    export requests carry) arrive long after every conversation left the window. The
    service recalls the conversations those spans belong to from the span store: every
    turn is then written as diagnose gives it, none is counted twice, no span is late."""
    import os

    from live.test_classifier import _assert_as_diagnose
    from prometheus_client import generate_latest

    from kvobs.emit.segments import SUFFIX
    from kvobs.semconv import STORE_LIVE_DIR

    first, later, rows = _coming_back()
    assert later and first

    segment = tmp_path / STORE_LIVE_DIR / ("demo" + SUFFIX)
    segment.parent.mkdir(parents=True)
    live = build_app(str(tmp_path), LiveSettings(window_s=60, grace_s=GRACE_S))[LIVE]
    t0 = 1_800_000_000.0
    segment.write_text("\n".join(first) + "\n")  # stored before classified, as the handler does
    os.utime(segment, (t0, t0))
    for line in first:
        live.receive(Stored(line, 0), now=t0)
    for at in (t0 + 1, t0 + 2 + GRACE_S, t0 + 200):  # final, then every conversation left
        live.run_pass(at)
    assert not live.classifier.buffer.units
    written_before = {(t["conversation_id"], t["turn"]) for t in live.turns.latest()}
    assert ("agent-happy", 2) not in written_before

    with open(segment, "a") as handle:
        handle.write("\n".join(later) + "\n")
    os.utime(segment, (t0 + 300, t0 + 300))
    for line in later:
        live.receive(Stored(line, 0), now=t0 + 300)
    assert live.classifier.buffer.late_spans == 0
    assert "agent-happy" in live.classifier.buffer.returning
    live.recall_returning(t0 + 300)
    assert not live.classifier.buffer.returning
    # Each span held once: the recalled copies of spans the pool held already (P's and
    # D's, untagged, which came while the conversation was dropped) are not taken again.
    buffer = live.classifier.buffer
    held = [(r["trace_id"], r["span_id"]) for key in buffer.units for r in buffer.rows_of(key)]
    assert len(held) == len(set(held)) and ("agent-happy" in buffer.units)
    assert len(buffer.rows_of("agent-happy")) == sum(
        1 for r in rows if r["trace_id"] in {r["trace_id"] for r in rows
                                             if r.get(sc.CONVERSATION_ID.key) == "agent-happy"})
    for at in (t0 + 301, t0 + 302 + GRACE_S):
        live.run_pass(at)

    written = {(t["tenant"], t["conversation_id"], t["turn"]): t for t in live.turns.latest()}
    assert len(written) == 25
    assert {("agent-happy", 2), ("agent-happy", 3)} <= {(k[1], k[2]) for k in written}
    # Turns written before from part of their spans (the later requests carried some of
    # theirs) were written again once recalled whole.
    assert any(t["version"] > 1 for t in written.values())
    _assert_as_diagnose({k: {f: v for f, v in t.items() if f != "final"}
                         for k, t in written.items()})
    counted = sum(_samples(generate_latest(live.metrics.registry).decode(),
                           "kvobs_turns_total").values())
    assert counted == 25  # the recalled turns final before were not counted again
    assert live.classifier.buffer.late_spans == 0


def test_the_running_service_recalls_a_conversation_that_came_back(tmp_path):
    """As above through the service's own loop and HTTP handler (which stores every
    request before the classifier takes it): the recall is read off the event loop and
    taken by a later pass."""
    first, later, rows = _coming_back()

    async def scenario():
        app = build_app(str(tmp_path), LiveSettings(window_s=3, grace_s=GRACE_S,
                                                    interval_s=0.1))
        live = app[LIVE]
        async with TestClient(TestServer(app)) as client:
            async def post(part):
                for line in part:
                    response = await client.post("/v1/traces", data=line,
                                                 headers={"Content-Type": "application/json"})
                    assert response.status == 200

            async def until(done):
                for _ in range(600):  # a bound against a hang only
                    await asyncio.sleep(0.1)
                    if done():
                        return
                raise AssertionError("never settled")

            await post(first)
            await until(lambda: not live.classifier.buffer.units)
            await post(later)
            await until(lambda: "agent-happy" in live.classifier.buffer.units)
            await until(lambda: not live.classifier.open_turns()
                        and not live.classifier.buffer.returning and live._recalling is None)
            metrics = await (await client.get("/metrics")).text()
        return metrics, live

    metrics, live = asyncio.run(scenario())
    assert live.classifier.buffer.late_spans == 0
    assert sum(_samples(metrics, "kvobs_turns_total").values()) == 25
    store = TurnStore(str(tmp_path), 86400)
    batch = all_turns(open_source(str(tmp_path)))
    assert len(batch) == 25
    for diagnosis in batch:
        (stored,) = [t for t in store.latest(diagnosis.conversation_id)
                     if (t["tenant"], t["turn"]) == (diagnosis.tenant, diagnosis.turn.index)]
        assert stored["verdict"] == diagnosis.finding.verdict.value, diagnosis.conversation_id


def test_a_defect_in_the_loop_s_recall_step_never_stops_its_passes(tmp_path, caplog):
    """The running loop: its recall step raising (a defect, not a failed read) is logged
    with its traceback, and the pass after it runs: every turn is still classified."""
    lines = [line for line in DEMO.read_text().split("\n") if line.strip()]
    steps = []

    def broken_step():
        steps.append(1)
        raise RuntimeError("a defect in the recall step")

    async def scenario():
        app = build_app(str(tmp_path), LiveSettings(window_s=60, grace_s=GRACE_S,
                                                    interval_s=0.05))
        live = app[LIVE]
        live._step_recall = broken_step
        async with TestClient(TestServer(app)) as client:
            for line in lines:
                response = await client.post("/v1/traces", data=line,
                                             headers={"Content-Type": "application/json"})
                assert response.status == 200
            for _ in range(600):  # a bound against a hang only
                await asyncio.sleep(0.05)
                if len(live.turns.latest()) == 25:
                    break
        return live

    live = asyncio.run(scenario())
    assert len(live.turns.latest()) == 25 and len(steps) > 1
    failures = [r for r in caplog.records if "recall of conversations" in r.getMessage()]
    assert failures and failures[0].exc_info[0] is RuntimeError


@pytest.mark.parametrize("error", [OSError("no such store"), KeyError("no such store")])
def test_a_recall_that_fails_leaves_the_spans_late(tmp_path, monkeypatch, caplog, error):
    """The span store cannot be read, or a defect: the spans held for the conversation
    are late (as without recalls), said in the log; the service goes on."""
    import kvobs.live.service as service

    lines = [line for line in DEMO.read_text().split("\n") if line.strip()]
    live = build_app(str(tmp_path), LiveSettings(window_s=60, grace_s=GRACE_S))[LIVE]
    for line in lines:
        live.receive(Stored(line, 0), now=1000.0)
    live.run_pass(1001.0)
    live.run_pass(1100.0)  # every conversation left
    for line in lines[:3]:
        live.receive(Stored(line, 0), now=1200.0)
    held = sum(len(spans) for spans in live.classifier.buffer.returning.values())
    assert held > 0 and live.classifier.buffer.late_spans == 0

    def unreadable(*_args):
        raise error

    monkeypatch.setattr(service, "recall", unreadable)
    live.recall_returning(1200.0)
    assert live.classifier.buffer.late_spans == held
    assert not live.classifier.buffer.returning
    assert "could not recall" in caplog.text and "no such store" in caplog.text
    live.run_pass(1201.0)


def _release_line(rows: list[dict], conversation_id: str, turn: int, at_ns: int) -> str:
    """An export request holding one span: D's release of ``conversation_id``'s turn
    ``turn`` (its export's D request), tagged with the conversation, in a trace of its
    own, as the connector sends one when D frees the blocks."""
    trace = next(r["trace_id"] for r in rows if r.get(sc.CONVERSATION_ID.key) == conversation_id
                 and r.get(sc.TURN_INDEX.key) == turn)
    export = next(r for r in rows if r["trace_id"] == trace and r["name"] == sc.SPAN_EXPORT.name)

    def attribute(key, value):
        return {"key": key, "value": {"stringValue": value}}

    span = {"traceId": "5e" * 16, "spanId": "5e" * 8, "name": sc.SPAN_RELEASE.name, "kind": 1,
            "startTimeUnixNano": str(at_ns), "endTimeUnixNano": str(at_ns),
            "attributes": [attribute(sc.CONVERSATION_ID.key, conversation_id),
                           attribute(sc.REQUEST_ID.key, export[sc.REQUEST_ID.key]),
                           attribute(sc.ROLE.key, "decode"),
                           attribute(sc.RELEASE_REASON.key, "finished")]}
    return json.dumps({"resourceSpans": [{
        "resource": {"attributes": [attribute("service.name", "kvobs-decode")]},
        "scopeSpans": [{"scope": {"name": "kvobs"}, "spans": [span]}]}]})


def test_a_recall_brings_back_the_turn_another_conversation_s_turn_extends(tmp_path):
    """agent-late-id's turn 2 extends its turn 1, sent without an id (its own conversation,
    ``anonymous:<trace>``, to lineage a turn it extends): its row names turn 1's export.
    D's release of turn 2 arrives after every conversation left the window: the recall
    brings back turn 2's spans and, named by its stored evidence, turn 1's export and its
    trace, so lineage finds the turn it extends again: the row still equals diagnose's
    over the store (without them it was written again without its `extends_*` facts)."""
    import os

    from live.test_classifier import _batch, _canonical

    from kvobs.emit.segments import SUFFIX
    from kvobs.semconv import STORE_LIVE_DIR

    lines = [line for line in DEMO.read_text().split("\n") if line.strip()]
    rows = open_source(str(DEMO)).span_table().to_pylist()
    release = _release_line(rows, "agent-late-id", 2, max(r["end_ns"] for r in rows) + 10**9)
    segment = tmp_path / STORE_LIVE_DIR / ("demo" + SUFFIX)
    segment.parent.mkdir(parents=True)
    live = build_app(str(tmp_path), LiveSettings(window_s=60, grace_s=GRACE_S))[LIVE]
    t0 = 1_800_000_000.0
    segment.write_text("\n".join(lines) + "\n")
    os.utime(segment, (t0, t0))
    for line in lines:
        live.receive(Stored(line, 0), now=t0)
    for at in (t0 + 1, t0 + 2 + GRACE_S, t0 + 200):
        live.run_pass(at)
    assert not live.classifier.buffer.units

    def late_id() -> dict:
        (row,) = [t for t in live.turns.latest("agent-late-id") if t["turn"] == 2]
        return row

    assert late_id()["evidence"].get("extends_span_id")
    with open(segment, "a") as handle:
        handle.write(release + "\n")
    os.utime(segment, (t0 + 300, t0 + 300))
    live.receive(Stored(release, 0), now=t0 + 300)
    live.recall_returning(t0 + 300)
    for at in (t0 + 301, t0 + 302 + GRACE_S):
        live.run_pass(at)
    assert live.classifier.buffer.late_spans == 0
    row = late_id()
    shown = {k: v for k, v in row.items() if k not in ("version", "first_final", "final")}
    batch = _batch(row["context"], segment)[(row["tenant"], "agent-late-id", 2)]
    assert _canonical(shown) == _canonical(batch)
    assert row["evidence"].get("extends_span_id")
    assert sum(_samples(generate_latest(live.metrics.registry).decode(),
                        "kvobs_turns_total").values()) == len(live.turns.latest())
