"""The embedded store's live segments (#14): rotated by size and age, capped in total
size, expired by retention; sealed segments stay readable and compactable; an active
segment is never deleted. Real files, the real exporter and readers."""

from __future__ import annotations

import logging
import os
import time

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from kvobs import semconv as sc
from kvobs.emit.otlp_json import OtlpJsonFileExporter
from kvobs.emit.segments import (ENV_MAX_BYTES, SUFFIX, LiveSegmentWriter, SegmentLimits,
                                 is_sealed, sweep)
from kvobs.sources import open_source
from kvobs.sources.store import compact


class Clock:
    """Starts at the real time (files get real mtimes), then moved by the test."""

    def __init__(self):
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def _tracer(writer: LiveSegmentWriter):
    provider = TracerProvider(resource=Resource.create({"service.name": "kvobs-proxy"}))
    provider.add_span_processor(SimpleSpanProcessor(OtlpJsonFileExporter(writer)))
    return provider.get_tracer("test")


def _emit(tracer, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        span = tracer.start_span(sc.SPAN_PROXY_LOOKUP.name)
        span.set_attribute(sc.CONVERSATION_ID.key, f"c{i}")
        span.set_attribute(sc.TURN_INDEX.key, 1)
        span.end()


def _segments(store) -> tuple[list[str], list[str]]:
    names = sorted(os.listdir(store / sc.STORE_LIVE_DIR))
    return [n for n in names if is_sealed(n)], [n for n in names if not is_sealed(n)]


def test_segments_rotate_by_size_and_stay_readable_and_compactable(tmp_path):
    store = tmp_path / "store"
    writer = LiveSegmentWriter(str(store), "kvobs-proxy",
                               SegmentLimits(segment_bytes=2000, max_bytes=0, retention_s=0))
    _emit(_tracer(writer), 40)
    sealed, active = _segments(store)
    assert active == [os.path.basename(writer.path)] and len(sealed) >= 3
    for name in sealed:  # full segments: at most the size, a line is never split
        assert os.path.getsize(store / sc.STORE_LIVE_DIR / name) <= 2000
        assert (store / sc.STORE_LIVE_DIR / name).read_text().endswith("\n")
    spans = open_source(str(store)).spans()
    assert sorted(spans[sc.CONVERSATION_ID.key]) == sorted(f"c{i}" for i in range(40))
    moved, problems = compact(str(store), quiet_s=0)
    assert (moved, problems) == (40, [])
    _emit(_tracer(writer), 1, start=40)  # the writer goes on after a compaction
    assert len(open_source(str(store)).spans()) == 41


def test_segments_rotate_by_age(tmp_path):
    clock = Clock()
    writer = LiveSegmentWriter(str(tmp_path), "collect",
                               SegmentLimits(segment_age_s=60, max_bytes=0, retention_s=0),
                               clock=clock)
    writer.append("{}\n")
    clock.now += 59
    writer.append("{}\n")
    assert _segments(tmp_path)[0] == []
    clock.now += 2
    writer.append("{}\n")
    sealed, active = _segments(tmp_path)
    assert len(sealed) == 1 and len(active) == 1
    assert (tmp_path / sc.STORE_LIVE_DIR / sealed[0]).read_text() == "{}\n{}\n"
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(clock.now))
    assert sealed[0].endswith(SUFFIX) and stamp in sealed[0]  # the clock's UTC


def test_size_cap_deletes_the_oldest_sealed_segments_never_an_active_one(tmp_path, caplog):
    clock = Clock()
    line = "x" * 99 + "\n"
    other = LiveSegmentWriter(str(tmp_path), "kvobs-prefill", SegmentLimits(
        segment_bytes=10**6, max_bytes=0, retention_s=0), clock=clock)
    other.path = os.path.join(other.directory, "kvobs-prefill-1" + SUFFIX)  # another pid's
    for _ in range(5):
        other.append(line)  # 500 bytes, active, never sealed here
    writer = LiveSegmentWriter(str(tmp_path), "kvobs-proxy", SegmentLimits(
        segment_bytes=300, max_bytes=1500, retention_s=0), clock=clock)
    with caplog.at_level(logging.WARNING, logger="kvobs.emit"):
        for _ in range(30):
            clock.now += 1
            writer.append(line)
    live = tmp_path / sc.STORE_LIVE_DIR
    sealed, active = _segments(tmp_path)
    assert len(active) == 2 and os.path.getsize(other.path) == 500
    total = sum(os.path.getsize(live / name) for name in os.listdir(live))
    # at the last sweep (its rotation) all fit in the cap; the active one grew since
    assert total <= 1500 + os.path.getsize(writer.path)
    # the newest sealed segments are the ones kept: the oldest is gone
    first = time.strftime("%Y%m%dT%H%M%S", time.gmtime(clock.now - 29))
    assert sealed and not any(first in name for name in sealed)
    assert "deleted by retention or size cap" in caplog.text


def test_retention_expires_old_sealed_segments(tmp_path):
    clock = Clock()
    writer = LiveSegmentWriter(str(tmp_path), "kvobs-proxy", SegmentLimits(
        segment_bytes=10, max_bytes=0, retention_s=3600), clock=clock)
    writer.append("a" * 20 + "\n")
    writer.append("b" * 20 + "\n")  # seals the first
    (old,) = _segments(tmp_path)[0]
    path = tmp_path / sc.STORE_LIVE_DIR / old
    os.utime(path, (clock.now - 7200, clock.now - 7200))
    os.utime(writer.path, (clock.now - 7200, clock.now - 7200))  # active: kept whatever
    files, removed = sweep(writer.directory, writer.limits, clock.now)
    sealed, active = _segments(tmp_path)
    assert (files, removed) == (1, 21) and sealed == [] and active
    assert open_source(str(tmp_path)).problems == []


def test_bad_limits_are_said_and_the_defaults_used(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(ENV_MAX_BYTES, "lots")
    with caplog.at_level(logging.ERROR, logger="kvobs.emit"):
        writer = LiveSegmentWriter(str(tmp_path), "kvobs-proxy")
    assert writer.limits == SegmentLimits()
    assert "KVOBS_STORE_MAX_BYTES='lots': not a number" in caplog.text
