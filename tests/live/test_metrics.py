"""The live classifier's turn metrics: a pass's final turns given to their series at once
equal the same turns counted one by one, values and exemplars alike."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.openmetrics.exposition import generate_latest

from kvobs import semconv as sc
from kvobs.live.classifier import Classifier, PassResult
from kvobs.live.metrics import _BOUNDS, TurnMetrics

DEMO = Path(__file__).resolve().parents[1] / "data" / "demo-spans.otlp.jsonl"


def _final_rows() -> list[dict]:
    classifier = Classifier(window_s=600, grace_s=0)
    for line in DEMO.read_text().split("\n"):
        if line.strip():
            classifier.add_request(json.loads(line), now=100.0)
    rows = classifier.run_pass(now=100.0).finalized + classifier.run_pass(now=101.0).finalized
    # Some turns without a trace id: a bucket keeps the latest exemplar given, not the
    # latest observation's absence of one.
    return [{**row, "trace_id": None} if i % 3 == 1 else row for i, row in enumerate(rows)]


def _exposition(metrics: TurnMetrics) -> list[str]:
    """The turn series as Prometheus scrapes them (OpenMetrics: with exemplars), without
    the exemplars' timestamps, the pass histogram (observed once a pass) and the process's
    own series (CPU, memory)."""
    text = generate_latest(metrics.registry).decode()
    return [re.sub(r"( # \{[^}]*\} \S+) \S+$", r"\1", line) for line in text.splitlines()
            if "kvobs_classifier_pass" not in line and not re.search(r"_created[{ ]", line)
            and not re.match(r"(# \w+ )?process_", line)]


def test_a_pass_of_turns_counts_as_the_turns_one_by_one():
    rows = _final_rows()
    assert len(rows) == 25 and sum(r["first_final"] for r in rows) == 25
    at_once, one_by_one = TurnMetrics(), TurnMetrics()
    at_once.observe(PassResult(finalized=rows))
    for row in rows:
        one_by_one.observe(PassResult(finalized=[row]))
    shown = _exposition(at_once)
    assert shown == _exposition(one_by_one)
    exemplars = [line for line in shown if " # {" in line]
    # Several turns share a bucket or a counter: only the latest one's trace is kept.
    assert len(exemplars) > 20
    traces = {r["trace_id"] for r in rows if r["trace_id"]}
    assert {re.search(r'trace_id="(\w+)"', line).group(1) for line in exemplars} <= traces


def test_the_bucket_bounds_are_prometheus_clients():
    metrics = TurnMetrics()
    for metric, family in ((sc.M_TURN_PHASE, metrics.phase), (sc.M_TURN_LATENCY, metrics.latency)):
        child = family.labels(*["x"] * len(metric.labels))
        assert _BOUNDS[metric] == child._upper_bounds
