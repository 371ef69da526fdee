"""``kvobs report`` from classified turn rows against the span path's report on the same
spans: every count and sum equal, every percentile within the sketch's guarantee
(``kvobs.fleet.sketch``), on the demo spans (rows the live classifier wrote) and on the
synthetic fleet (rows backfilled from its labelled turn table)."""

from __future__ import annotations

import json
import os
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvobs.causes import causes, decode_context
from kvobs.fleet import fleet_turns
from kvobs.fleet import turn_report as tr
from kvobs.fleet.report import build_report
from kvobs.semconv import NOT_FAULT_VALUES
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
            assert row["verdict"] in NOT_FAULT_VALUES


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


@pytest.fixture
def backfilled(synthetic_store, tmp_path):
    """The synthetic store's turns as turn rows (one merged file an hour), its source,
    and the span path's report and labelled turns."""
    source = synthetic_store[0]
    span, labelled = build_report(fleet_turns(open_source(source)), source)
    store_dir = str(tmp_path / "turns")
    write_turn_rows(store_dir, turn_rows_table(labelled, span.prefill_tokens_per_s,
                                               _details(labelled)))
    return TurnStore(store_dir, 0), source, span, labelled


def test_report_from_backfilled_turn_rows_equals_the_span_report(backfilled):
    store, source, span, labelled = backfilled
    rows = tr.turn_row_report(store, source)
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


# --------------------------------------------------------------------------- stored tallies


def _same(a, b, path="report"):
    """Two reports' dicts equal; floats within a few ulps (sums added in another order)."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            _same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-9), path
    else:
        assert a == b, path


def _full(report) -> dict:
    return {**report.to_dict(), "extras": report.extras}


def _scanned(monkeypatch) -> list[str]:
    """The files a report reads rows of (not the keys of later versions)."""
    import kvobs.live.turnstore as ts

    seen: list[str] = []
    scan = ts._scan

    def spy(path, columns, batch_rows, later_versions):
        if not later_versions:
            seen.append(path)
        return scan(path, columns, batch_rows, later_versions)

    monkeypatch.setattr(ts, "_scan", spy)
    return seen


def test_a_report_from_stored_tallies_equals_one_from_the_rows(backfilled, monkeypatch):
    store, source, _, _ = backfilled
    rows_only = _full(tr.turn_row_report(store, source))
    files = store.unsummarized()
    assert len(files) > 1
    assert sorted(tr.summarize(store)) == sorted(files) and not store.unsummarized()
    scanned = _scanned(monkeypatch)
    _same(_full(tr.turn_row_report(store, source)), rows_only)
    assert scanned == []  # every file's tally stood for its rows
    # The conversation count with a few hashes in memory at a time: the same.
    monkeypatch.setattr("kvobs.fleet.turn_tally.PARTITION_HASHES", 7)
    assert tr.turn_row_report(store, source).conversations == rows_only["conversations"] > 7


@pytest.mark.parametrize("since", ["30m", "2h", "1d"])
def test_since_uses_a_tally_only_for_a_file_wholly_inside(backfilled, since, monkeypatch):
    store, source, _, _ = backfilled
    rows_only = _full(tr.turn_row_report(store, source, since))
    tr.summarize(store)
    scanned = _scanned(monkeypatch)
    _same(_full(tr.turn_row_report(store, source, since)), rows_only)
    assert len(set(scanned)) < len(store._paths())


def test_a_turn_with_a_newer_version_elsewhere_has_its_files_read(tmp_path, monkeypatch):
    """A later version (and a retirement) in the next hour's file: the older file's
    tally counts the replaced turns, so that file is read; the newer file's tally holds
    the newest versions and stands."""
    finalized = _demo_rows()
    store = TurnStore(str(tmp_path), 0)
    store.write(finalized[:10], now=1_767_225_600.0)
    store.write(finalized[10:20], now=1_767_225_601.0)  # a second part: the hour merges
    store.compact(now=1_767_240_000.0)
    tr.summarize(store)
    changed = dict(finalized[1], version=2, verdict="transfer-failed")
    retired = {**finalized[2], "version": 2, "verdict": None, "superseded": True}
    store.write([changed, retired, *finalized[20:22]], now=1_767_229_200.0)
    store.write(finalized[22:], now=1_767_229_201.0)
    store.compact(now=1_767_250_000.0)
    tr.summarize(store)
    first, second = sorted(store._paths())
    scanned = _scanned(monkeypatch)
    with_tallies = _full(tr.turn_row_report(store, "s"))
    assert set(scanned) == {first}
    for path in (first, second):
        os.remove(path[: -len(".parquet")] + ".tally")
    _same(with_tallies, _full(tr.turn_row_report(store, "s")))
    assert with_tallies["turns"] == 24


def test_a_stale_or_damaged_tally_is_never_used(backfilled, monkeypatch):
    """A file rewritten in place after its tally (another size), a truncated tally and
    one of a format this kvobs does not read: the file's rows are read instead."""
    import pyarrow.parquet as pq

    store, source, _, _ = backfilled
    tr.summarize(store)
    paths = sorted(store._paths())[:3]
    table = pq.read_table(paths[0])
    pq.write_table(table.slice(0, table.num_rows // 2), paths[0])
    tally = paths[1][: -len(".parquet")] + ".tally"
    data = open(tally, "rb").read()
    open(tally, "wb").write(data[: len(data) // 2])
    from kvobs.fleet.turn_tally import TurnTally
    stored = TurnTally.from_bytes(dict(store.summaries())[paths[2]])
    assert stored is not None
    state = stored.to_bytes().replace(b'"format": 1', b'"format": 99')
    store.write_summary(paths[2], state)
    scanned = _scanned(monkeypatch)
    report = tr.turn_row_report(store, source)
    assert set(scanned) == set(paths)
    for path in paths:
        os.remove(path[: -len(".parquet")] + ".tally")
    _same(_full(report), _full(tr.turn_row_report(store, source)))


def test_a_sketch_rebuilt_from_its_stored_state_gives_the_same_quantiles():
    """Both sides, zeros and one value; merged after the round trip as before it."""
    from kvobs.fleet.sketch import add_values, new_sketch, sketch_from_state, sketch_state

    rng = np.random.default_rng(7)
    samples = [rng.lognormal(0, 2, 10_000), -rng.lognormal(0, 1, 500),
               np.concatenate([rng.lognormal(-3, 1, 1000), -rng.lognormal(0, 1, 300),
                               np.zeros(20)]),
               np.array([5.0]), np.array([])]
    for values in samples:
        sketch = new_sketch()
        add_values(sketch, values)
        rebuilt = sketch_from_state(json.loads(json.dumps(sketch_state(sketch))))
        both, twice = new_sketch(), new_sketch()
        both.merge(rebuilt)
        both.merge(sketch)
        add_values(twice, np.concatenate([values, values]))
        for q in np.linspace(0, 1, 101):
            assert rebuilt.get_quantile_value(q) == sketch.get_quantile_value(q), q
            assert both.get_quantile_value(q) == twice.get_quantile_value(q), q
        assert rebuilt.count == sketch.count


def test_tallies_corrected_for_turns_re_classified_in_a_later_hour(backfilled, monkeypatch):
    """Turns of many conversations get a later version (another verdict and latency, or
    a retirement) in a file of a later hour, as a late span or a lineage resolved by a
    later turn writes them: each older file's tally is corrected through its index for
    those conversations (or, when one of them is listed among its slowest or faults,
    the file is read), and the report equals the one from rows."""
    import pyarrow as pa
    import pyarrow.compute as pc

    store, source, _, _ = backfilled
    tr.summarize(store)
    table = store.read()
    rng = np.random.default_rng(3)
    picked = table.take(rng.choice(table.num_rows, 60, replace=False))
    later = float(pc.max(table["finalized_at"]).as_py()) + 7200
    n = picked.num_rows
    verdicts = pa.array(["transfer-failed" if i % 3 else None for i in range(n)], pa.string())
    for name, column in (("version", pa.array(np.full(n, 2))), ("verdict", verdicts),
                         ("latency_s", pc.multiply(picked["latency_s"], 3.0)),
                         ("finalized_at", pa.array(np.full(n, later)))):
        picked = picked.set_column(picked.schema.get_field_index(name), name, column)
    write_turn_rows(store.directory[: -len("/turns")], picked, stamp="later")
    tr.summarize(store)
    held = store.lookup(picked["conversation_id"].to_pylist())
    dirty = [path for path in store._paths() if held(path)]
    scanned = _scanned(monkeypatch)
    with_tallies = _full(tr.turn_row_report(store, source))
    assert 0 < len(set(scanned)) < len(dirty) - 1  # most dirty files corrected, not read
    for path in store._paths():
        os.remove(path[: -len(".parquet")] + ".tally")
    from_rows = _full(tr.turn_row_report(store, source))
    _same(with_tallies, from_rows)
    assert from_rows["turns"] == table.num_rows - n // 3


def test_clickhouse_tallies_of_closed_hours_give_the_rows_report(tmp_path, chdb_path):
    """The classifier's rows in ClickHouse over three closed hours, one turn given a
    later version in the last: ``summarize`` keeps a tally per closed hour in a table of
    its own, and the report from them equals the one from rows; a row that comes late
    into a tallied hour makes that hour's tally stale (its rows are read)."""
    from kvobs.live.clickhouse_turns import ClickHouseTurns

    finalized = _demo_rows()
    turns = ClickHouseTurns.from_url(f"chdb:{chdb_path}?turn_table=turns_tallied",
                                     retention_s=3650 * 86400.0)
    hour = 1_767_225_600.0
    turns.write(finalized[:10], now=hour)
    turns.write(finalized[10:20], now=hour + 3600)
    turns.write([*finalized[20:], dict(finalized[1], version=2, verdict="transfer-failed")],
                now=hour + 7200)
    from_rows = _full(tr.turn_row_report(turns, "s"))
    assert sorted(tr.summarize(turns)) == ["2026010100", "2026010101", "2026010102"]
    assert turns.unsummarized() == []
    assert [h for h, _ in turns.summaries()] == ["2026010100", "2026010101", "2026010102"]
    skipped: list[set] = []
    batches = turns.batches

    def spy(columns, batch_rows, later_versions=False, skip=(), only=None):
        if not later_versions:
            skipped.append(set(skip))
        return batches(columns, batch_rows, later_versions, skip, only)

    turns.batches = spy  # type: ignore[method-assign]
    engine_tally = tr.engine_tally

    def engine_spy(rows, skip, cutoff):
        skipped.append(set(skip))
        return engine_tally(rows, skip, cutoff)

    tr.engine_tally = engine_spy
    try:
        _same(_full(tr.turn_row_report(turns, "s")), from_rows)
    finally:
        tr.engine_tally = engine_tally
    del turns.batches
    # The later hours' tallies stood for their rows (the first hour's holds the turn
    # the later version replaces: corrected, or read when that turn is listed).
    assert skipped and all({"2026010101", "2026010102"} <= s for s in skipped)
    turns.write([dict(finalized[3], turn=99)], now=hour + 60)  # late, into a tallied hour
    assert [h for h, _ in turns.summaries()] == ["2026010101", "2026010102"]
    assert tr.turn_row_report(turns, "s").turns == from_rows["turns"] + 1
    assert turns.unsummarized() == ["2026010100"]


# --------------------------------------------------------------------------- several stores


def test_several_classifiers_stores_report_as_one(synthetic_store, tmp_path, monkeypatch):
    """A sharded tier's classifiers each keep their conversations' rows: the report over
    their stores together (TurnRowsUnion) is the one store's, by rows and by tallies; a
    turn re-versioned on another replica (its conversation re-routed) counts once, at
    its latest version. The CLI takes --source more than once, for turn rows only."""
    import zlib

    import pyarrow as pa
    import pyarrow.compute as pc
    from click.testing import CliRunner

    from kvobs.cli import main
    from kvobs.live.turn_rows import TurnRowsUnion

    source = synthetic_store[0]
    span, labelled = build_report(fleet_turns(open_source(source)), source)
    table = turn_rows_table(labelled, span.prefill_tokens_per_s, _details(labelled))
    write_turn_rows(str(tmp_path / "one"), table)
    # split by conversation, as the Collector's loadbalancing exporter would
    shard = pa.array([zlib.crc32(cid.encode()) % 2 == 0
                      for cid in table["conversation_id"].to_pylist()])
    write_turn_rows(str(tmp_path / "a"), table.filter(shard))
    write_turn_rows(str(tmp_path / "b"), table.filter(pc.invert(shard)))
    one = TurnStore(str(tmp_path / "one"), 0)
    parts = [TurnStore(str(tmp_path / name), 0) for name in ("a", "b")]
    assert all(p.unsummarized() for p in parts)
    def uncommanded(report) -> dict:
        full = _full(report)
        for row in full["extras"]["drill_down"]["rows"]:
            row.pop("command")
        return full

    expected = uncommanded(tr.turn_row_report(one, source))
    _same(uncommanded(tr.turn_row_report(TurnRowsUnion(parts), source)), expected)
    for store in parts:
        tr.summarize(store)
    scanned = _scanned(monkeypatch)
    _same(uncommanded(tr.turn_row_report(TurnRowsUnion(parts), source)), expected)
    assert scanned == []  # every file's tally stood for its rows, in both stores
    runner = CliRunner()
    both = runner.invoke(main, ["report", "--json", "--source", str(tmp_path / "a"),
                                "--source", str(tmp_path / "b")])
    alone = runner.invoke(main, ["report", "--json", "--source", str(tmp_path / "one")])
    assert both.exit_code == alone.exit_code, both.output
    got, want = json.loads(both.output), json.loads(alone.output)
    assert got.pop("source") == f"{tmp_path / 'a'} + {tmp_path / 'b'}"
    want.pop("source")
    # each listed turn's command reads the store that holds its conversation
    stores = {"a": str(tmp_path / "a"), "b": str(tmp_path / "b")}
    for row in got["drill_down"]["rows"]:
        holder = "a" if zlib.crc32(row["conversation_id"].encode()) % 2 == 0 else "b"
        assert f"--source {stores[holder]}" in row["command"], row["command"]
    for row in got["drill_down"]["rows"] + want["drill_down"]["rows"]:
        row.pop("command")
    assert got["drill_down"]["rows"]
    _same(got, want)
    mixed = runner.invoke(main, ["report", "--source", source, "--source", str(tmp_path / "a")])
    assert mixed.exit_code == 2 and "classified turn rows" in mixed.output


def test_a_turn_re_versioned_on_another_classifier_counts_once_at_its_latest(tmp_path):
    from kvobs.live.turn_rows import TurnRowsUnion

    finalized = _demo_rows()
    first, second = TurnStore(str(tmp_path / "a"), 0), TurnStore(str(tmp_path / "b"), 0)
    first.write(finalized, now=1_767_225_600.0)
    moved = {**finalized[3], "version": finalized[3].get("version", 1) + 1,
             "verdict": "insufficient-evidence"}
    second.write([moved], now=1_767_229_200.0)
    union = TurnRowsUnion([first, second])
    report = tr.turn_row_report(union)
    assert report.turns == len(finalized)
    key = (moved["tenant"], moved["conversation_id"], moved["turn"])
    latest = union.latest_of([moved["conversation_id"]])[moved["conversation_id"]]
    (turn,) = [t for t in latest if (t.get("tenant"), t["conversation_id"], t["turn"]) == key]
    assert turn["verdict"] == "insufficient-evidence"
    verdicts = {**report.first_turn["verdicts"]}
    for name, count in report.later_turns["verdicts"].items():
        verdicts[name] = verdicts.get(name, 0) + count
    assert verdicts.get("insufficient-evidence", 0) >= 1


def test_a_turn_retired_on_another_classifier_is_left_out_of_its_conversation(tmp_path):
    """A turn lineage re-keyed (a retirement row, version 2) on one store, its first
    version on another: the conversation read over both has no such turn, as one store
    holding both rows gives; the drill-down reads the spans of the store with the
    conversation's last turn at its newest version."""
    from kvobs.live.turn_rows import TurnRowsUnion

    finalized = _demo_rows()
    first, second = TurnStore(str(tmp_path / "a"), 0), TurnStore(str(tmp_path / "b"), 0)
    first.write(finalized, now=1_767_225_600.0)
    gone = finalized[2]
    retired = {**gone, "version": gone.get("version", 1) + 1, "verdict": None,
               "superseded": True}
    second.write([retired], now=1_767_229_200.0)
    cid, key = gone["conversation_id"], (gone.get("tenant"), gone["conversation_id"], gone["turn"])
    keys = lambda turns: {(t.get("tenant"), t["conversation_id"], t["turn"]) for t in turns}  # noqa: E731
    assert key in keys(first.latest_of([cid])[cid])
    union = TurnRowsUnion([first, second], ["a", "b"])
    held = union.latest_of([cid])[cid]
    assert key not in keys(held)
    both = TurnStore(str(tmp_path / "both"), 0)
    both.write(finalized, now=1_767_225_600.0)
    both.write([retired], now=1_767_229_200.0)
    assert held == both.latest_of([cid])[cid]
    last = max(t["turn"] for t in finalized if t["conversation_id"] == cid)
    assert union.source_of(cid, "a + b") == ("b" if last == gone["turn"] else "a")
