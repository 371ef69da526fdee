"""``kvobs report`` from classified turn rows against the span path's report on the same
spans: every count and sum equal, every percentile within the sketch's guarantee
(``kvobs.fleet.sketch``), on the demo spans (rows the live classifier wrote) and on the
synthetic fleet (rows backfilled from its labelled turn table)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvobs.causes import causes, decode_context
from kvobs.fleet import fleet_turns
from kvobs.fleet import turn_report as tr
from kvobs.fleet.report import build_report
from kvobs.fleet.sketch import within_sketch_error
from kvobs.live.backfill import turn_rows_table, write_turn_rows
from kvobs.live.classifier import Classifier
from kvobs.live.turnstore import TurnStore
from kvobs.sources import open_source
from kvobs.timeline import PHASES, phase_column
from kvobs.verdicts import Turn

DEMO = Path(__file__).resolve().parents[1] / "data" / "demo-spans.otlp.jsonl"
QUANTILES = {"p50": 0.5, "p95": 0.95}


def _scope_rows(labelled: pd.DataFrame) -> dict[str, np.ndarray]:
    first = (labelled["turn"] == 1).to_numpy(bool)
    return {"first_turn": first, "later_turns": ~first}


def _quantile_ok(estimate, values: np.ndarray, q: float) -> bool:
    values = values[~np.isnan(values)]
    if not len(values):
        return estimate is None
    return estimate is not None and within_sketch_error(estimate, values, q)


def _check_metrics(span: dict, rows: dict, labelled: pd.DataFrame, mask: np.ndarray) -> None:
    for key, value in span.items():
        if key.endswith(("_p50_s", "_p95_s")):
            column, q = key[: -len("_p50_s")] + "_s", QUANTILES[key[-5:-2]]
            values = labelled[column].to_numpy(float, na_value=np.nan)[mask]
            assert _quantile_ok(rows[key], values, q), (key, rows[key], value)
        elif isinstance(value, float):
            assert rows[key] == pytest.approx(value, rel=1e-9), key
        else:
            assert rows[key] == value, key


def _compare(span, span_drill, rows, labelled: pd.DataFrame) -> None:
    assert (rows.conversations, rows.turns) == (span.conversations, span.turns)
    assert rows.synthetic == span.synthetic
    scopes = _scope_rows(labelled)
    for scope, mask in scopes.items():
        _check_metrics(getattr(span, scope), getattr(rows, scope), labelled, mask)
    for section, scope in (("by_turn", None), ("by_prompt", "later_turns"),
                           ("by_turn_and_prompt", None)):
        span_groups, row_groups = getattr(span, section), getattr(rows, section)
        assert len(span_groups) == len(row_groups) > 0, section
        for expected, got in zip(span_groups, row_groups):
            keys = [k for k in ("turn_bucket", "prompt_bucket") if k in expected]
            assert [got[k] for k in keys] == [expected[k] for k in keys]
            mask = np.logical_and.reduce([(labelled[k] == expected[k]).to_numpy(bool)
                                          for k in keys])
            _check_metrics(expected, got, labelled, mask & scopes[scope] if scope else mask)
    for scope, mask in scopes.items():
        expected, got = span.phases[scope], rows.phases[scope]
        for key in ("turns", "timed_turns", "latency_s", "unmeasured_s", "unmeasured_turns"):
            assert got[key] == pytest.approx(expected[key], rel=1e-12), (scope, key)
        by_phase = {row["phase"]: row for row in got["phases"]}
        assert [r["phase"] for r in got["phases"]] == [r["phase"] for r in expected["phases"]]
        for phase in PHASES:
            want = next(r for r in expected["phases"] if r["phase"] == phase.value)
            have = by_phase[phase.value]
            for key in ("total_s", "share", "slowest_turns", "measured_turns"):
                assert have[key] == pytest.approx(want[key], rel=1e-12), (phase, key)
            values = labelled[phase_column(phase)].to_numpy(float)[mask]
            for key, q in (("p50_s", 0.5), ("p95_s", 0.95)):
                assert _quantile_ok(have[key], values, q), (scope, phase, key)
    done = (labelled["read_outcome"] == "done").fillna(False).to_numpy(bool)
    per_block = (labelled["read_bytes"].astype(float) / labelled["read_blocks"].astype(float))
    per_block = per_block.to_numpy(float)[done]
    per_block = per_block[np.isfinite(per_block)]
    for section in (rows.memory, rows.retention["device"]):
        assert _quantile_ok(section["bytes_per_block"], per_block, 0.5)
    for key, value in span.memory.items():
        if key not in ("bytes_per_block", "gib_hours_held"):
            assert rows.memory[key] == pytest.approx(value, rel=1e-9), key
    for place in ("device", "host"):
        for key, value in span.retention[place].items():
            if key in ("bytes_per_block", "gib_hours", "tokens_per_gib_hour") and place == "device":
                # priced at the sketched bytes per block
                assert (rows.retention[place][key] is None) == (value is None), key
                if value is not None:
                    assert rows.retention[place][key] == pytest.approx(value, rel=0.011), key
            elif value is None:
                assert rows.retention[place][key] is None, (place, key)
            else:
                assert rows.retention[place][key] == pytest.approx(value, rel=1e-9), (place, key)
    assert rows.retention["conversations"] == {
        "unavailable": tr.DEGRADED["retention.conversations"]}
    drill = rows.extras["drill_down"]
    assert drill["fault_turns"] == span_drill["fault_turns"]
    listed = ("kind", "conversation_id", "tenant", "turn", "verdict", "latency_s", "top_cause",
              "command")
    faults = [r for r in span_drill["rows"] if r["kind"] == "fault"]
    assert [{k: r[k] for k in listed} for r in drill["rows"] if r["kind"] == "fault"] == \
        [{k: r[k] for k in listed} for r in faults]
    for row in drill["rows"]:
        if row["kind"] == "slow":  # at or above the sketched p95 of its scope
            assert row["verdict"] in tr._NOT_FAULTS


def _details(labelled: pd.DataFrame) -> list[str]:
    """Each turn's stored JSON as far as the report reads it: keys, verdict, causes."""
    context = decode_context(labelled)
    out = []
    for record in labelled.to_dict("records"):
        found = causes(Turn(record).as_dict(), context)
        out.append(json.dumps({
            "tenant": record["tenant"], "conversation_id": record["conversation_id"],
            "turn": int(record["turn"]), "verdict": record["verdict"],
            "trace_id": record.get("trace_id"),
            "causes": [{"cause": c.cause.value, "share": c.share} for c in found],
        }, default=str))
    return out


def _demo_rows() -> list[dict]:
    """The live classifier's final rows of the demo spans, all in one pass."""
    classifier = Classifier(window_s=600, grace_s=0)
    for line in DEMO.read_text().split("\n"):
        if line.strip():
            classifier.add_request(json.loads(line), now=100.0)
    return classifier.run_pass(now=100.0).finalized


def test_report_from_backfilled_turn_rows_equals_the_span_report(synthetic_store, tmp_path):
    source = synthetic_store[0]
    span, labelled = build_report(fleet_turns(open_source(source)), source)
    store_dir = str(tmp_path / "turns")
    write_turn_rows(store_dir, turn_rows_table(labelled, span.prefill_tokens_per_s,
                                               _details(labelled)))
    rows = tr.turn_row_report(TurnStore(store_dir, 0), source)
    assert rows.turns > 500
    _compare(span, span.extras["drill_down"], rows, labelled)
    assert rows.prefill_tokens_per_s == pytest.approx(span.prefill_tokens_per_s)


def test_report_from_the_live_classifiers_rows_equals_the_span_report(tmp_path):
    finalized = _demo_rows()
    assert len(finalized) == 25
    rate = {row["context"]["prefill_tokens_per_s"] for row in finalized}
    assert len(rate) == 1
    store = TurnStore(str(tmp_path), 0)
    store.write(finalized, now=1_767_225_600.0)
    span, labelled = build_report(fleet_turns(open_source(str(DEMO))), str(DEMO), None,
                                  rate.pop())
    rows = tr.turn_row_report(store, str(DEMO))
    _compare(span, span.extras["drill_down"], rows, labelled)


def test_a_later_version_replaces_a_turn_and_a_retired_key_is_left_out(tmp_path):
    finalized = _demo_rows()
    store = TurnStore(str(tmp_path), 0)
    store.write(finalized, now=1_767_225_600.0)
    before = tr.turn_row_report(store)
    changed = dict(finalized[1], version=2, verdict="transfer-failed")
    retired = {**finalized[2], "version": 2, "verdict": None, "superseded": True}
    store.write([changed, retired], now=1_767_229_200.0)  # the next hour's partition
    after = tr.turn_row_report(store)
    assert after.turns == before.turns - 1

    def count(report, verdict: str) -> int:
        return sum(getattr(report, s)["verdicts"].get(verdict, 0)
                   for s in ("first_turn", "later_turns"))

    assert finalized[1]["verdict"] != "transfer-failed"
    assert count(after, "transfer-failed") == count(before, "transfer-failed") + 1
    for verdict in {finalized[1]["verdict"], finalized[2]["verdict"]}:
        gone = [finalized[1]["verdict"], finalized[2]["verdict"]].count(verdict)
        assert count(after, verdict) == count(before, verdict) - gone


def test_rows_an_older_kvobs_wrote_read_as_unmeasured(tmp_path):
    """A part without the measure columns (written before them): its turns count, their
    sums are 0 and their whole latency unmeasured (no phase), nothing fails."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kvobs.live.turnstore import SCHEMA

    old = [f for f in SCHEMA if f.name in (
        "tenant", "conversation_id", "turn", "version", "verdict", "rule", "trace_id",
        "slowest_phase", "latency_s", "ttft_s", "prompt_tokens", "finalized_at", "detail")]
    table = pa.Table.from_pylist([
        {"tenant": "t", "conversation_id": "c", "turn": 1, "version": 1, "verdict": "first-turn",
         "latency_s": 1.5, "ttft_s": 0.5, "finalized_at": 1_767_225_600.0, "detail": "{}"},
    ], schema=pa.schema(old))
    partition = tmp_path / "turns" / "hour=2026010100"
    partition.mkdir(parents=True)
    pq.write_table(table, partition / "part-old.parquet")
    report = tr.turn_row_report(TurnStore(str(tmp_path), 0))
    assert (report.turns, report.conversations) == (1, 1)
    assert report.first_turn["latency_p50_s"] == pytest.approx(1.5, rel=0.01)
    assert report.first_turn["bytes_read"] == 0
    assert math.isclose(report.phases["first_turn"]["unmeasured_s"], 1.5)
    assert report.phases["first_turn"]["unmeasured_turns"] == 1


def test_clickhouse_turn_rows_give_the_stores_report_page_by_page(tmp_path, chdb_path,
                                                                  monkeypatch):
    """The same rows in the ClickHouse turn table, read in pages of 7 rows (keyset
    paging over the table's key), give the embedded store's report."""
    from kvobs.live.clickhouse_turns import ClickHouseTurns

    finalized = _demo_rows()
    store = TurnStore(str(tmp_path), 0)
    # a retention that keeps 2026-01-01 (the TTL drops older rows at insert)
    clickhouse = ClickHouseTurns.from_url(f"chdb:{chdb_path}?turn_table=turns_report",
                                          retention_s=3650 * 86400.0)
    for rows in (store, clickhouse):
        rows.write(finalized, now=1_767_225_600.0)
    clickhouse.write([dict(finalized[1], version=2, verdict="transfer-failed")],
                     now=1_767_225_601.0)
    store.write([dict(finalized[1], version=2, verdict="transfer-failed")], now=1_767_225_601.0)
    monkeypatch.setattr(tr, "BATCH_ROWS", 7)
    expected = tr.turn_row_report(store, "s").to_dict()
    assert tr.turn_row_report(clickhouse, "s").to_dict() == expected
    assert expected["turns"] == 25


@pytest.mark.parametrize("since", ["1h", "2026-01-01"])
def test_a_store_without_turns_reports_none_with_since(tmp_path, since):
    # A duration counts back from the newest turn: with none, there is nothing to cut
    # (it was int(-inf - 1 h), an OverflowError, found by mypy).
    report = tr.turn_row_report(TurnStore(str(tmp_path), 0), "empty", since=since)
    assert report.turns == 0 and report.since == since


def test_files_an_older_kvobs_wrote_still_answer_lookups_and_reports(tmp_path):
    """A store written before the report's columns (``prefill_tokens_per_s``,
    ``measures``): its indexed files still answer a conversation lookup, and the report
    counts their turns."""
    import pyarrow.parquet as pq

    store = TurnStore(str(tmp_path), 0)
    store.write(_demo_rows(), now=1_767_225_600.0)
    for path in tmp_path.glob("turns/*/*.parquet"):
        table = pq.read_table(path)
        pq.write_table(table.drop_columns(["prefill_tokens_per_s", "measures"]), path)
    looked_up = store.latest("agent-happy")
    assert looked_up and all(row["conversation_id"] == "agent-happy" for row in looked_up)
    report = tr.turn_row_report(store, "s")
    assert (report.turns, report.conversations) == (25, 13)
    assert report.later_turns["bytes_read"] == 0  # the measures are not there


def test_kvobs_report_reads_a_turn_store_as_turn_rows(tmp_path):
    """The one selection rule: a --source with turns/hour=* is read as turn rows; what
    they cannot give says so, and options that re-classify exit 2."""
    from click.testing import CliRunner

    from kvobs.cli import main

    TurnStore(str(tmp_path), 0).write(_demo_rows(), now=1_767_225_600.0)
    result = CliRunner().invoke(main, ["report", "--source", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert (out["turns"], out["conversations"]) == (25, 13)
    assert out["degraded"] == tr.DEGRADED
    assert out["drill_down"]["fault_turns"] == 5
    for extra in (["--html", str(tmp_path / "r.html")], ["--prefill-rate", "8000"],
                  ["--read-slo", "0.5"]):
        refused = CliRunner().invoke(main, ["report", "--source", str(tmp_path), *extra])
        assert refused.exit_code == 2, (extra, refused.output)


def test_a_conversation_from_memory_is_answered_as_the_store_answers_it(tmp_path):
    """The measures travel on the classifier's row to the store's packed column; neither
    the in-memory answer nor the stored one shows them."""
    classifier = Classifier(window_s=600, grace_s=0)
    for line in DEMO.read_text().split("\n"):
        if line.strip():
            classifier.add_request(json.loads(line), now=100.0)
    store = TurnStore(str(tmp_path), 0)
    store.write(classifier.run_pass(now=100.0).finalized, now=1_767_225_600.0)
    live, stored = classifier.conversation("agent-happy"), store.latest("agent-happy")
    assert live and all("measures" not in row for row in live + stored)
    assert [(r["turn"], r["verdict"], r["phases"]) for r in live] == \
        [(r["turn"], r["verdict"], r["phases"]) for r in stored]
