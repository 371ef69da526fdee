"""One implementation of the timeline, the verdict rules and the causes, two turn-table
types: diagnose's Arrow rows (``kvobs.turns.columns.Columns``) and the fleet's pandas table.
Every column test and every diagnosis agrees on both; the stages import no pandas."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvobs.turns import columns as col
from kvobs import synth
from kvobs.turns.correlate import to_frame, turns_from_spans
from kvobs.turns.schema import ALL_COLUMNS
from kvobs.diagnose import classify_turns
from kvobs.sources import open_source

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO_SPANS = os.path.join(ROOT, "tests", "data", "demo-spans.otlp.jsonl")


@pytest.fixture(scope="module")
def span_sets(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("synthetic"))
    synth.write_store(store, synth.small(60))
    return {"demo": open_source(DEMO_SPANS).spans(), "synthetic": open_source(store).spans()}


def _both(spans):
    rows = turns_from_spans(spans, frame=False)
    return col.Columns(rows), to_frame(rows)


def test_every_column_test_agrees_on_both_table_types(span_sets):
    for spans in span_sets.values():
        arrow, frame = _both(spans)
        assert len(arrow) == len(frame) > 0
        for column in frame.columns:
            assert column in arrow
            np.testing.assert_array_equal(col.null(arrow, column), col.null(frame, column))
            if frame[column].dtype != "category":  # num() reads numbers, not ids
                np.testing.assert_array_equal(col.num(arrow, column),
                                              col.num(frame, column))
            if frame[column].dtype == "boolean":
                np.testing.assert_array_equal(col.flag(arrow, column),
                                              col.flag(frame, column))
            for value in {str(v) for v in frame[column].dropna().unique()[:3]}:
                np.testing.assert_array_equal(col.eq(arrow, column, value),
                                              col.eq(frame, column, value))
        assert not col.present(arrow, "no-such-column").any()


def test_diagnoses_are_identical_on_both_table_types(span_sets):
    for name, spans in span_sets.items():
        arrow, frame = _both(spans)
        from_arrow, arrow_context = classify_turns(arrow)
        from_frame, frame_context = classify_turns(frame)
        assert arrow_context == frame_context
        assert len(from_arrow) == len(from_frame) > 0
        for a, f in zip(from_arrow, from_frame):
            assert json.dumps(a.to_dict(), sort_keys=True) == json.dumps(
                f.to_dict(), sort_keys=True), (name, a.conversation_id, a.turn.index)
        verdicts = {d.finding.verdict.value for d in from_arrow}
        assert len(verdicts) > 2, verdicts  # the sets exercise several rules


_PROBE = """
import sys
import kvobs.cli.diagnose, kvobs.diagnose, kvobs.render
print(" ".join(sorted({m.split('.')[0] for m in sys.modules})))
"""


def test_the_diagnose_stages_import_no_pandas():
    """Correlation, timeline, verdicts, causes and rendering load pandas only on use
    (the fleet's table, linking prefix chains, a source's span frame)."""
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120,
                          check=True)
    packages = set(done.stdout.split())
    assert "kvobs" in packages and "pyarrow" in packages
    assert "pandas" not in packages


def test_columns_no_turn_has_are_typed_as_converted_ones_and_stay_in_place(span_sets):
    """``to_frame`` makes a column no turn has a value in all missing without converting
    it: same place, and the dtype the column gets when a turn has a value (categorical for
    strings)."""
    import pyarrow as pa

    from kvobs.turns.correlate import derive, turn_rows

    for name, spans in span_sets.items():
        rows = derive(turn_rows(spans))
        frame = to_frame(rows)
        assert list(frame.columns) == rows.column_names, name
        empty = [c for c in rows.column_names if rows.column(c).null_count == rows.num_rows]
        assert any(c.startswith("host_") for c in empty), name  # the case is exercised
        for column in empty:
            assert frame[column].isna().all(), (name, column)
            valued = pa.array([{"str": "x", "int": 1, "float": 0.5, "bool": True}[
                ALL_COLUMNS[column].type]]).cast(rows.schema.field(column).type)
            one = to_frame(rows.slice(0, 1).set_column(
                rows.column_names.index(column), column, valued))
            got, want = frame[column].dtype, one[column].dtype
            if want.name == "category":  # categories differ: none vs the value
                assert got.name == "category", (name, column)
            else:
                assert got == want, (name, column)


def test_turns_are_linked_to_their_previous_turn_in_any_row_order(span_sets):
    """``derive`` (and ``turn_links``) find each turn's previous turn by key: rows in a
    scan's order (a ClickHouse turn view read without ``ORDER BY``) derive the same
    previous-turn facts as rows sorted by key."""
    from kvobs.turns.correlate import derive, turn_links, turn_rows

    for name, spans in span_sets.items():
        rows = turn_rows(spans)
        assert rows.num_rows > 3, name
        shuffled = np.random.default_rng(7).permutation(rows.num_rows)
        sorted_frame = to_frame(derive(rows))
        frame = to_frame(derive(rows.take(shuffled)))
        linked = [c for c in frame.columns if c.startswith("prev_") or c == "gap_s"]
        assert sorted_frame["prev_turn_end_ns"].notna().sum() > 1, name  # exercised
        for column in linked:
            got = frame[column].astype(object).where(frame[column].notna(), None).tolist()
            want = sorted_frame[column].astype(object).where(
                sorted_frame[column].notna(), None).take(shuffled).tolist()
            assert got == want, (name, column)
        previous, following = turn_links(frame)
        for row, before in enumerate(previous):
            if before >= 0:
                assert following[before] == row
                assert (frame["conversation_id"].iloc[before],
                        frame["turn"].iloc[before] + 1) == (
                    frame["conversation_id"].iloc[row], frame["turn"].iloc[row])
            else:
                assert not ((frame["conversation_id"] == frame["conversation_id"].iloc[row])
                            & (frame["tenant"] == frame["tenant"].iloc[row])
                            & (frame["turn"] == frame["turn"].iloc[row] - 1)).any()


def test_previous_rows_of_runs_of_conversations_and_of_scattered_rows():
    from kvobs.turns.correlate import previous_rows

    def previous(conversations, turns):
        return previous_rows([np.array(conversations)], np.array(turns)).tolist()

    # Each conversation in one run, runs in any order (the store's turn files).
    assert previous([2, 2, 0, 0, 1], [1, 2, 1, 2, 1]) == [-1, 0, -1, 2, -1]
    # Conversation 2 in two runs; a gap in conversation 0's turns.
    assert previous([2, 0, 2, 0, 0], [1, 1, 2, 2, 4]) == [-1, -1, 0, 1, -1]
    # Two keys (tenant, conversation): the same conversation code under two tenants.
    assert previous_rows([np.array([0, 1, 0]), np.array([5, 5, 5])],
                         np.array([1, 2, 2])).tolist() == [-1, -1, 0]
    assert previous([], []) == [] and previous([3], [1]) == [-1]
    # A missing key (code -1, as pandas codes it) is one more conversation.
    assert previous([-1, 0, -1], [1, 2, 2]) == [-1, -1, 0]
