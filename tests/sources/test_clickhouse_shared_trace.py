"""Turns of two conversations in one client trace (the proxy continues it, #27), read
from ClickHouse: the span SQL gives a span without keys those of its nearest tagged
ancestor, and a conversation from its trace only when the trace holds one, as
``correlate`` does; the turn table equals the batch pipeline's over the same spans."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest
from shared_trace import expected, observed, shared_trace

from kvobs.emit.otlp_json import spans_to_otlp_json
from kvobs.sources import open_source
from kvobs.sources._store_layout import COMPACTED_DIR
from kvobs.turns.correlate import plain, turns_from_spans

pytest.importorskip("chdb")

from kvobs.sources.clickhouse import ClickHouseSource  # noqa: E402


@pytest.mark.parametrize("attributes", ["map", "json"])
def test_sql_turns_of_a_shared_trace_equal_the_batch_turns(chdb_path, tmp_path, attributes):
    spans, _ = shared_trace()
    path = tmp_path / "spans.otlp.jsonl"
    path.write_text(spans_to_otlp_json(spans) + "\n")
    table = open_source(str(path)).span_table()
    # The spans as they arrived (untagged ones untagged), as load_store reads a store's
    # segments: compaction would give them keys before ClickHouse saw them.
    segment = tmp_path / "store" / COMPACTED_DIR / "0"
    os.makedirs(segment)
    pq.write_table(plain(table), segment / "spans.parquet")
    source = ClickHouseSource.chdb(chdb_path, f"shared_trace_{attributes}")
    source.create_table(attributes)
    assert source.load_store(str(tmp_path / "store")) == len(spans)

    assert observed(turns_from_spans(table, frame=False)) == expected()
    fleet = ("read_bytes",)  # the fleet's columns of those spans (not vLLM's)
    # Without a turn view: the per-span-name parts see keyless spans, so the one query
    # that takes keys from the span tree and the trace.
    (rows,) = list(source.turn_row_slices())
    assert observed(rows, fleet) == expected(fleet)
    raw = observed(source.query(source.turns_sql()), fleet)
    # The orphan read span: in a row of no conversation, which readers drop.
    assert {key: values for key, values in raw.items() if key[0]} == expected(fleet)
    assert {values for key, values in raw.items() if not key[0]} == {(999,)}
