"""`kvobs store compact` next to running writers (#12): only segments no writer appends to
any more are compacted; a span written while compaction runs, or during a compaction
that crashed, is read exactly once. Real writers (the span exporter the components use,
in a thread and in another process), real files, the real readers and CLI."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import threading

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

import kvobs
from kvobs import semconv as sc
from kvobs.cli import main
from kvobs.emit.otlp_json import OtlpJsonFileExporter
from kvobs.emit.segments import SUFFIX, LiveSegmentWriter, SegmentLimits
from kvobs.sources.store import NO_CONVERSATION, StoreSource, compact
from spanfactory import Tracers, TurnSpec, write_conversation

_CID = sc.CONVERSATION_ID.key
_CHECKOUT = os.path.dirname(os.path.dirname(kvobs.__file__))  # the writer imports this kvobs
# Small segments: the writers rotate every few spans, so compaction always has sealed
# segments to take while an active one is being appended to.
_LIMITS = SegmentLimits(segment_bytes=4000, max_bytes=0, retention_s=0)

_WRITER = """
import sys
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
import kvobs
from kvobs import semconv as sc
from kvobs.emit.otlp_json import OtlpJsonFileExporter
from kvobs.emit.segments import LiveSegmentWriter, SegmentLimits

store, prefix, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
writer = LiveSegmentWriter(store, prefix, SegmentLimits(segment_bytes=4000, max_bytes=0,
                                                         retention_s=0))
provider = TracerProvider(resource=Resource.create({"service.name": prefix}))
provider.add_span_processor(SimpleSpanProcessor(OtlpJsonFileExporter(writer)))
tracer = provider.get_tracer("test")
for i in range(n):
    span = tracer.start_span(sc.SPAN_PROXY_LOOKUP.name)
    span.set_attribute(sc.CONVERSATION_ID.key, f"{prefix}{i}")
    span.set_attribute(sc.TURN_INDEX.key, 1)
    span.end()
"""


def _emit_in_thread(store: str, prefix: str, n: int) -> threading.Thread:
    writer = LiveSegmentWriter(store, prefix, _LIMITS)
    provider = TracerProvider(resource=Resource.create({"service.name": prefix}))
    provider.add_span_processor(SimpleSpanProcessor(OtlpJsonFileExporter(writer)))
    tracer = provider.get_tracer("test")

    def run():
        for i in range(n):
            span = tracer.start_span(sc.SPAN_PROXY_LOOKUP.name)
            span.set_attribute(_CID, f"{prefix}{i}")
            span.set_attribute(sc.TURN_INDEX.key, 1)
            span.end()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _stored_rows(store: str) -> list[str]:
    """Conversation ids of every span row stored, compacted or live, duplicates kept."""
    ids = []
    for path in glob.glob(os.path.join(store, sc.STORE_COMPACTED_DIR, "*", "*.parquet")):
        ids += pq.read_table(path, columns=[_CID]).column(_CID).to_pylist()
    live = StoreSource(store)._live
    if os.path.isdir(live.location):
        ids += [cid for cid in live.spans()[_CID]]
    return ids


@pytest.mark.parametrize("quiet_s", [None, 0.0])
def test_compaction_while_writers_append_loses_and_doubles_nothing(tmp_path, quiet_s):
    """A thread and another process append through the span exporter while the store is
    compacted over and over: every span is then stored once and read once. With the
    default settings only sealed segments are taken; with ``quiet_s=0`` every active
    segment is taken too (sealed under its writer's lock)."""
    store = str(tmp_path / "store")
    n = 600
    options = {} if quiet_s is None else {"quiet_s": quiet_s}
    process = subprocess.Popen([sys.executable, "-c", _WRITER, store, "other", str(n)],
                               env={**os.environ, "PYTHONPATH": _CHECKOUT})
    thread = _emit_in_thread(store, "here", n)
    compactions = 0
    while thread.is_alive() or process.poll() is None or compactions < 3:
        if os.path.isdir(os.path.join(store, sc.STORE_LIVE_DIR)):
            compact(store, **options)
            compactions += 1
    thread.join()
    assert process.wait() == 0
    written = sorted(f"{prefix}{i}" for prefix in ("here", "other") for i in range(n))
    assert sorted(_stored_rows(store)) == written
    source = StoreSource(store)
    assert sorted(source.spans()[_CID]) == written and source.problems == []
    # Once the writers are gone, everything can be compacted, still once.
    compact(store, writers_stopped=True)
    assert sorted(_stored_rows(store)) == written
    assert os.listdir(os.path.join(store, sc.STORE_LIVE_DIR)) == []


def test_active_segments_are_left_and_sealed_ones_taken(tmp_path):
    """kvobs' active segment and the Collector file exporter's active file stay where they
    are; sealed segments (kvobs' and the Collector's rotated backups) are compacted."""
    store = tmp_path / "store"
    tracers = Tracers(str(store))
    write_conversation(tracers, "conv-a", [TurnSpec(), TurnSpec()])
    tracers.flush()
    live = store / sc.STORE_LIVE_DIR
    kvobs_active = sorted(os.listdir(live))
    assert kvobs_active and all(name.endswith(SUFFIX) for name in kvobs_active)
    lines = "".join((live / name).read_text() for name in kvobs_active)
    (live / "collector.jsonl").write_text(lines)  # the Collector's open file
    (live / "collector-2026-01-02T03-04-05.678.jsonl").write_text(lines)  # its backup
    moved, problems = compact(str(store))
    assert problems == [] and moved > 0
    assert sorted(os.listdir(live)) == sorted([*kvobs_active, "collector.jsonl"])
    # a kvobs segment quiet for longer than the interval is sealed and compacted: its
    # writer starts a new one at its next append
    moved, problems = compact(str(store), quiet_s=0)
    assert os.listdir(live) == ["collector.jsonl"]
    write_conversation(tracers, "conv-b", [TurnSpec()])
    tracers.flush()
    assert {os.path.basename(p) for p in glob.glob(str(live / "*"))} >= set(kvobs_active)
    source = StoreSource(str(store))
    assert source.conversation_ids() == ["conv-a", "conv-b"]


class Crash(Exception):
    pass


@pytest.mark.parametrize("step", ["write_table", "_remove_sources"])
def test_a_crashed_compaction_loses_nothing_and_counts_nothing_twice(tmp_path, monkeypatch,
                                                                     step):
    """Compaction killed while writing its parquet, or after writing it while deleting
    the live segments: turns and report count every span once, and the next compaction
    finishes the job (no span stored twice)."""
    from kvobs.sources import store as store_module

    tracers = Tracers(str(tmp_path))
    write_conversation(tracers, "conv-a", [TurnSpec(), TurnSpec(read="failed")])
    write_conversation(tracers, "conv-b", [TurnSpec()])
    tracers.flush()
    before = _turns_and_report(tmp_path)
    spans = sorted(_stored_rows(str(tmp_path)))
    real = getattr(store_module, step)

    def crash_half_way(*args, **kwargs):
        if step == "write_table":  # one bucket written, then killed
            table = args[1]
            real(args[0], table.slice(0, table.num_rows // 2), *args[2:], **kwargs)
        else:  # one segment deleted, then killed
            real(args[0], args[1][:1])
        raise Crash()

    monkeypatch.setattr(store_module, step, crash_half_way)
    with pytest.raises(Crash):
        compact(str(tmp_path), writers_stopped=True)
    monkeypatch.undo()
    assert _turns_and_report(tmp_path) == before
    compact(str(tmp_path), writers_stopped=True)
    assert _turns_and_report(tmp_path) == before
    assert sorted(_stored_rows(str(tmp_path))) == spans
    assert compact(str(tmp_path), writers_stopped=True) == (0, [])  # idempotent
    assert sorted(_stored_rows(str(tmp_path))) == spans


def _turns_and_report(store) -> tuple:
    runner = CliRunner()
    turns = runner.invoke(main, ["turns", "--source", str(store), "--json"])
    report = runner.invoke(main, ["report", "--source", str(store), "--json"])
    assert turns.exit_code == 0 and report.exit_code == 0, turns.output + report.output
    rows = json.loads(turns.stdout)
    return ([(t["conversation_id"], t["turn"], t["recomputed_tokens"], t["verdict"])
             for t in rows], json.loads(report.stdout)["later_turns"])


def _otlp_line(*spans: tuple[str, str, str | None, int | None]) -> str:
    """One OTLP JSON line of proxy lookup spans (trace id, span id, conversation, turn)."""
    def attributes(cid, turn):
        return ([{"key": _CID, "value": {"stringValue": cid}}] if cid else []) + (
            [{"key": sc.TURN_INDEX.key, "value": {"intValue": str(turn)}}] if turn else [])
    return json.dumps({"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name",
                                     "value": {"stringValue": "proxy"}}]},
        "scopeSpans": [{"spans": [
            {"traceId": trace, "spanId": span, "name": sc.SPAN_PROXY_LOOKUP.name,
             "startTimeUnixNano": "1000", "endTimeUnixNano": "2000",
             "attributes": attributes(cid, turn)}
            for trace, span, cid, turn in spans]}]}]}) + "\n"


def test_untagged_spans_are_stored_under_their_traces_conversation(tmp_path):
    """A span without conversation id is compacted under the conversation and turn of
    its trace's tagged span, whether that span is compacted with it or left live (the
    Collector's open file); a span in no tagged trace is stored under no conversation
    (its own bucket, which no conversation's read touches), and counted."""
    live = tmp_path / sc.STORE_LIVE_DIR
    live.mkdir()
    a, b, c = "a" * 32, "b" * 32, "c" * 32
    (live / "collector-2026-01-02T03-04-05.678.jsonl").write_text(_otlp_line(  # rotated
        (a, "1" * 16, "conv-a", 2), (a, "2" * 16, None, None), (b, "3" * 16, None, 7),
        (c, "4" * 16, None, None)))
    (live / "collector.jsonl").write_text(_otlp_line((b, "5" * 16, "conv-b", 3)))  # open
    moved, problems = compact(str(tmp_path))
    stored = sorted(
        (row["span_id"], row[_CID], row[sc.TURN_INDEX.key])
        for path in glob.glob(str(tmp_path / sc.STORE_COMPACTED_DIR / "*" / "*.parquet"))
        for row in pq.read_table(path).to_pylist())
    assert stored == [("1" * 16, "conv-a", 2), ("2" * 16, "conv-a", 2),
                      ("3" * 16, "conv-b", 3), ("4" * 16, None, None)]
    (none,) = glob.glob(str(tmp_path / sc.STORE_COMPACTED_DIR / NO_CONVERSATION / "*.parquet"))
    assert pq.read_table(none).column("span_id").to_pylist() == ["4" * 16]
    assert moved == 4
    assert len(problems) == 1 and problems[0].startswith(
        "1 span(s) without conversation id, in no trace with one or with no tagged ancestor")
    assert "stored under no conversation" in problems[0]
    assert os.listdir(live) == ["collector.jsonl"]
