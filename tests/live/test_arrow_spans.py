"""The live buffer converts each span to Arrow once (``ArrowSpans``): a pass's table is the
span table of exactly the spans it asks for, in arrival order, whatever tables they were
converted in and after merges; spans that left are not held."""

from __future__ import annotations

import numpy as np

from kvobs.live.buffer import ArrowSpans
from kvobs.live.classifier import Classifier
from kvobs.sources._frame import SPAN_SCHEMA, table_from_rows


def _row(i: int) -> dict:
    row = {"trace_id": f"t{i % 7}", "span_id": f"s{i}", "name": "kvobs.proxy.turn",
           "start_ns": 1000 + i, "end_ns": 2000 + i}
    if i % 3 == 0:  # a column only some batches carry
        row["gen_ai.conversation.id"] = f"c{i % 5}"
    if i % 4 == 0:
        row["kvobs.prompt_tokens"] = i
    return row


def _arrive(arrow: ArrowSpans, rows: list[dict], batch: int) -> None:
    for i in range(batch * 10, batch * 10 + 10):
        arrow.add(i, rows[i])


def test_a_take_is_the_span_table_of_the_spans_asked_for():
    arrow = ArrowSpans(merge_at=3)
    rows = [_row(i) for i in range(40)]
    for batch in range(4):
        _arrive(arrow, rows, batch)
        asked = np.array([i for i in range(batch * 10 + 10) if i % 2 == batch % 2], np.int64)
        taken = arrow.take(asked)
        assert taken.schema == SPAN_SCHEMA
        assert taken.equals(table_from_rows([rows[i] for i in asked]))


def test_a_merge_keeps_only_the_spans_still_held():
    arrow = ArrowSpans(merge_at=3)
    rows = [_row(i) for i in range(30)]
    for batch in range(3):
        _arrive(arrow, rows, batch)
        arrow.take(np.array([batch * 10], np.int64))  # a pass: the batch becomes a table
    assert arrow.merge_due(None)
    kept = np.array([1, 12, 13, 29], np.int64)
    arrow.keep_only(kept)
    assert not arrow.merge_due(None)
    assert arrow.take(np.arange(30, dtype=np.int64)).equals(
        table_from_rows([rows[i] for i in kept])
    )
    arrow.keep_only(np.array([], np.int64))
    assert arrow.take(np.arange(30, dtype=np.int64)).num_rows == 0


def test_the_buffer_holds_no_table_of_conversations_that_left():
    classifier = Classifier(window_s=60, grace_s=0)
    rows = [_row(i) | {"gen_ai.conversation.id": f"c{i}"} for i in range(20)]
    for i, row in enumerate(rows):  # a pass per span: a table per pass
        classifier.buffer.add([row], now=100.0 + i)
        classifier.run_pass(now=100.0 + i)
    arrow = classifier.buffer._arrow
    assert 0 < len(arrow._tables) < arrow._merge_at
    held = arrow.take(np.arange(100, dtype=np.int64))
    assert sorted(held.column("span_id").to_pylist()) == sorted(r["span_id"] for r in rows)
    classifier.run_pass(now=300.0)  # every conversation idle past the window
    assert arrow._tables == []
