"""Sources: OTLP-JSON files (collector format), the embedded store, bad input."""

import json
import os

import pandas as pd
import pytest

from kvobs.sources import SourceError, open_source
from kvobs.sources.store import StoreSource, compact
from spanfactory import Tracers, TurnSpec, write_conversation


@pytest.fixture
def store_dir(tmp_path):
    tracers = Tracers(str(tmp_path))
    write_conversation(tracers, "conv-a", [TurnSpec(), TurnSpec(read="done")])
    write_conversation(tracers, "conv-b", [TurnSpec()])
    return tmp_path


def _live_files(store_dir):
    live = store_dir / "spans"
    return sorted(live / name for name in os.listdir(live))


def test_written_lines_are_collector_otlp_json(store_dir):
    line = _live_files(store_dir)[0].read_text().splitlines()[0]
    request = json.loads(line)
    span = request["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert len(span["traceId"]) == 32 and int(span["traceId"], 16) >= 0
    assert len(span["spanId"]) == 16
    keys = {a["key"] for a in span["attributes"]}
    assert "gen_ai.conversation.id" in keys


def test_otlp_file_source_reads_collector_files(store_dir):
    source = open_source(str(store_dir / "spans"))
    spans = source.spans("conv-a")
    assert set(spans["gen_ai.conversation.id"]) == {"conv-a"}
    assert len(spans) == len(source.spans()) - len(source.spans("conv-b"))
    assert source.conversation_ids() == ["conv-a", "conv-b"]


def test_corrupt_and_truncated_lines_are_reported_and_skipped(store_dir):
    path = _live_files(store_dir)[0]
    good = path.read_text()
    path.write_text("{not json\n" + good + good.splitlines()[0][:40] + "\n")
    source = open_source(str(store_dir))
    assert source.conversation_ids() == ["conv-a", "conv-b"]
    assert len(source.problems) == 2
    assert source.problems[0].startswith(f"{path}:1: skipped corrupt line")
    last_line = len(good.splitlines()) + 2
    assert source.problems[1].startswith(f"{path}:{last_line}: skipped corrupt line")


def test_missing_source_is_a_clear_error(tmp_path):
    with pytest.raises(SourceError, match="source not found"):
        open_source(str(tmp_path / "nope"))


def test_compaction_keeps_every_span(store_dir):
    before = open_source(str(store_dir)).spans().sort_values("span_id").reset_index(drop=True)
    moved, problems = compact(str(store_dir), writers_stopped=True)
    assert (moved, problems) == (len(before), [])
    assert os.listdir(store_dir / "spans") == []
    source = StoreSource(str(store_dir))
    after = source.spans().sort_values("span_id").reset_index(drop=True)
    assert after.equals(before)
    assert source.conversation_ids() == ["conv-a", "conv-b"]
    assert set(source.spans("conv-b")["gen_ai.conversation.id"]) == {"conv-b"}


def test_store_reads_compacted_and_live_together(store_dir):
    compact(str(store_dir), writers_stopped=True)
    write_conversation(Tracers(str(store_dir)), "conv-c", [TurnSpec()])
    source = open_source(str(store_dir))
    assert source.conversation_ids() == ["conv-a", "conv-b", "conv-c"]
    assert len(source.spans("conv-a")) > 0 and len(source.spans("conv-c")) > 0


def test_segments_written_by_an_older_kvobs_still_read(store_dir):
    """A store compacted before some attributes existed (an upgrade): its segments lack
    those columns; they read as null, and diagnose and the fleet report still work."""
    import glob

    import pyarrow as pa
    import pyarrow.parquet as pq

    from kvobs.diagnose import diagnose
    from kvobs.fleet import fleet_turns
    from kvobs.semconv import LINEAGE_FACTS, PREFIX_LINEAGE

    compact(str(store_dir), writers_stopped=True)
    newer = {PREFIX_LINEAGE.key, *(a.key for a in LINEAGE_FACTS.values())}
    for path in glob.glob(str(store_dir / "compacted" / "*" / "*.parquet")):
        table = pq.read_table(path)
        pq.write_table(table.drop([c for c in table.column_names if c in newer]), path)
    # ... and its turn files parquet, without the newer columns.
    turn_files = glob.glob(str(store_dir / "turns" / "*" / "*.arrow"))
    assert turn_files
    for path in turn_files:
        with pa.OSFile(path) as source:
            table = pa.ipc.open_file(source).read_all()
        pq.write_table(table.drop([c for c in table.column_names
                                   if c.startswith("extends_")]),
                       path.removesuffix(".arrow") + ".parquet")
        os.remove(path)
    # ... next to segments and turn files of today's kvobs
    write_conversation(Tracers(str(store_dir)), "conv-c", [TurnSpec(), TurnSpec()])
    compact(str(store_dir), writers_stopped=True)
    source = open_source(str(store_dir))
    assert [t.turn.index for t in diagnose(source, "conv-a").turns] == [1, 2]
    assert [t.turn.index for t in diagnose(source, "conv-c").turns] == [1, 2]
    turns = fleet_turns(source)
    assert len(turns) == 5 and not source.problems  # the parquet turn files were read
    assert turns.get("extends_request_id", pd.Series(dtype=object)).isna().all()


def test_spans_delivered_twice_count_once_and_are_reported(store_dir):
    """An exporter's retry or a copied file: the same spans twice must not double a
    turn's recomputed tokens; the reader says what it dropped."""
    import shutil

    from kvobs.turns.correlate import turns_from_spans

    before = turns_from_spans(open_source(str(store_dir)).spans())
    for path in _live_files(store_dir):
        shutil.copy(path, str(path) + ".copy.jsonl")
    source = open_source(str(store_dir))
    after = turns_from_spans(source.spans())
    assert list(after["recomputed_tokens"]) == list(before["recomputed_tokens"])
    assert any("duplicate span" in p for p in source.problems)
    # ... and once compacted, a copied segment likewise
    compact(str(store_dir), writers_stopped=True)
    import glob
    for path in glob.glob(str(store_dir / "compacted" / "*" / "*.parquet")):
        shutil.copy(path, path.replace(".parquet", "-copy.parquet"))
    source = open_source(str(store_dir))
    assert list(turns_from_spans(source.spans())["recomputed_tokens"]) == list(
        before["recomputed_tokens"])
    assert any("duplicate span" in p for p in source.problems)


def test_a_fifo_named_jsonl_is_skipped_not_waited_on(store_dir):
    fifo = store_dir / "spans" / "stuck.otlp.jsonl"
    os.mkfifo(fifo)
    source = open_source(str(store_dir))
    assert len(source.spans()) > 0  # returns at all: a FIFO would block open() forever
    assert any("not a regular file" in p for p in source.problems)


@pytest.mark.parametrize("location, words", [
    ("chdb:{tmp}/missing", "does not exist"), ("chdb:{file}", "is not a directory"),
    ("chdb:{tmp}?table=x;DROP TABLE y", "not a table name")])
def test_clickhouse_locations_are_checked_before_use(tmp_path, location, words):
    from kvobs.sources import SourceError

    pytest.importorskip("chdb")
    regular = tmp_path / "file"
    regular.write_text("x")
    with pytest.raises(SourceError, match=words):
        open_source(location.format(tmp=tmp_path, file=regular))
    assert not (tmp_path / "missing").exists()


def _mutated(line: str, change) -> str:
    request = json.loads(line)
    span = request["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    span["spanId"] = "ffff" + span["spanId"][4:]
    change(span)
    return json.dumps(request)


def _set_attribute(key, value):
    def change(span):
        span["attributes"] = [a for a in span["attributes"] if a["key"] != key] + [
            {"key": key, "value": value}]
    return change


@pytest.mark.parametrize("name, change", [
    ("start inf", lambda span: span.update(startTimeUnixNano="inf")),
    ("start 1e30", lambda span: span.update(startTimeUnixNano="1e30")),
    ("turn above int64", _set_attribute("kvobs.turn.index", {"intValue": str(2**70)})),
    ("bool as yes", _set_attribute("kvobs.proxy.params_sent", {"stringValue": "yes"})),
    ("lone surrogate", _set_attribute("kvobs.request.id", {"stringValue": "\ud800"})),
])
def test_one_bad_value_nulls_that_value_and_nothing_else(store_dir, name, change):
    """A well-formed line with one out-of-range or ill-typed value: that value reads as
    null, reported with file:line; every other span still reads, diagnose still works."""
    from kvobs.diagnose import diagnose

    live = _live_files(store_dir)[0]
    first = live.read_text().splitlines()[0]
    with open(live, "a") as handle:
        handle.write(_mutated(first, change) + "\n")
    source = open_source(str(store_dir))
    assert diagnose(source, "conv-a").turns
    assert any(f"{live}:" in p and "read as null" in p for p in source.problems), \
        source.problems


def test_json_nested_too_deep_is_a_skipped_line(store_dir):
    live = _live_files(store_dir)[0]
    with open(live, "a") as handle:
        handle.write("[" * 5000 + "]" * 5000 + "\n")
    source = open_source(str(store_dir))
    assert len(source.spans()) > 0
    assert any("skipped corrupt line" in p for p in source.problems)


def test_keys_an_older_kvobs_wrote_read_under_todays_names(store_dir, tmp_path_factory):
    """Spans recorded before a key's rename (``kvobs.prompt.tokens`` became
    ``gen_ai.usage.input_tokens``) keep their facts: in compacted segments and in OTLP
    files alike."""
    import glob

    import pyarrow.parquet as pq

    from kvobs.turns.correlate import turns_from_spans
    from kvobs.semconv import PROMPT_TOKENS, RENAMED_KEYS

    (old_key,) = [old for old, new in RENAMED_KEYS.items() if new == PROMPT_TOKENS.key]
    live = _live_files(store_dir)
    before = turns_from_spans(open_source(str(store_dir)).spans("conv-a"))["prompt_tokens"]
    assert before.notna().all()

    otlp_dir = tmp_path_factory.mktemp("otlp")
    for path in live:
        (otlp_dir / path.name).write_text(path.read_text().replace(
            f'"{PROMPT_TOKENS.key}"', f'"{old_key}"'))
    assert PROMPT_TOKENS.key not in "".join(p.read_text() for p in otlp_dir.iterdir())
    renamed = turns_from_spans(open_source(str(otlp_dir)).spans("conv-a"))["prompt_tokens"]
    assert renamed.tolist() == before.tolist()

    compact(str(store_dir), writers_stopped=True)
    for path in glob.glob(str(store_dir / "compacted" / "*" / "*.parquet")):
        table = pq.read_table(path)
        pq.write_table(table.rename_columns([old_key if c == PROMPT_TOKENS.key else c
                                             for c in table.column_names]), path)
    source = open_source(str(store_dir))
    spans = source.spans("conv-a")
    assert turns_from_spans(spans)["prompt_tokens"].tolist() == before.tolist()


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_one_conversation_read_by_row_group_statistics_equals_a_filtered_scan(tmp_path, order):
    """The store reads one conversation (diagnose) with pyarrow.parquet, skipping row
    groups by the id's statistics, and decoding a group only up to its last row with the
    id (none: only the id column): the rows equal a whole scan's, filtered, for every
    conversation, with the demo spans rewritten in row groups of 5 rows, sorted by id
    (as compaction writes them) or shuffled (groups the statistics pick hold no row of
    the id, or rows of it anywhere)."""
    import random

    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from kvobs import semconv as sc
    from kvobs.sources._frame import ALL_DTYPES
    from kvobs.sources._store_layout import read_conversation, read_spans, span_files

    demo = os.path.join(os.path.dirname(__file__), "..", "data", "demo-spans.otlp.jsonl")
    os.makedirs(tmp_path / "spans")
    with open(demo, "rb") as spans, open(tmp_path / "spans" / "seg.jsonl", "wb") as out:
        out.write(spans.read())
    compact(str(tmp_path), writers_stopped=True)
    files = span_files(str(tmp_path))
    for path in files:
        table = pq.read_table(path)
        if order == "sorted":
            table = table.sort_by(sc.CONVERSATION_ID.key)
        else:
            table = table.take(random.Random(7).sample(range(table.num_rows), table.num_rows))
        pq.write_table(table, path, row_group_size=5)
    assert max(pq.ParquetFile(path).num_row_groups for path in files) > 2
    columns = list(ALL_DTYPES)
    every = read_spans(files, [], columns)
    ids = set(every.column(sc.CONVERSATION_ID.key).to_pylist()) - {None}
    assert len(ids) > 5
    for cid in sorted(ids):
        expected = every.filter(pc.equal(every.column(sc.CONVERSATION_ID.key), cid))
        got = read_conversation(files, [], columns, cid)
        assert got.num_rows == expected.num_rows > 0
        assert got.equals(expected), cid


def test_span_table_from_rows_coerces_each_value_on_its_own():
    """The one builder of the span table from rows: Arrow, typed by the span schema; a
    value it cannot use is null and takes nothing else with it; an id-less proxy turn is
    named by its trace."""
    from kvobs import semconv as sc
    from kvobs.sources._frame import SPAN_SCHEMA, table_from_rows

    good = {"trace_id": "ab", "span_id": "01", "name": sc.SPAN_PROXY_TURN.name,
            "start_ns": 1_700_000_000_123_456_789, "end_ns": "1700000000123456790",
            sc.TURN_INDEX.key: 2.0, sc.STREAM.key: "true", sc.TTFT.key: 1}
    bad = {"trace_id": "cd", "span_id": "\ud800", "name": "x", "start_ns": 2**70,
           "end_ns": 1.5, sc.TURN_INDEX.key: True, sc.STREAM.key: "yes",
           sc.TTFT.key: float("inf"), sc.CONVERSATION_ID.key: 7, "no.such.key": 1}
    table = table_from_rows([good, bad, {"span_id": "02"}])
    assert table.schema == SPAN_SCHEMA
    rows = table.to_pylist()
    assert {k: v for k, v in rows[0].items() if v is not None} == {
        "trace_id": "ab", "span_id": "01", "name": sc.SPAN_PROXY_TURN.name,
        "start_ns": 1_700_000_000_123_456_789, "end_ns": 1_700_000_000_123_456_790,
        sc.TURN_INDEX.key: 2, sc.STREAM.key: True, sc.TTFT.key: 1.0,
        sc.CONVERSATION_ID.key: sc.ANONYMOUS_PREFIX + "ab"}
    assert {k: v for k, v in rows[1].items() if v is not None} == {
        "trace_id": "cd", "name": "x"}
    assert {k: v for k, v in rows[2].items() if v is not None} == {"span_id": "02"}


def test_span_table_columns_with_a_value_on_every_row_on_some_or_on_none():
    """A column with a value on every row and one with none are built without spreading
    the values over the rows: the same table as the general path gives."""
    from kvobs import semconv as sc
    from kvobs.sources._frame import SPAN_SCHEMA, table_from_rows

    rows = [{"trace_id": "t", "span_id": f"{i:02d}", "name": "n", "start_ns": i,
             sc.TTFT.key: i / 4, sc.STREAM.key: i % 2 == 0, "error": i == 1}
            for i in range(4)]
    rows[2][sc.TURN_INDEX.key] = 3
    rows[3]["span_id"] = "\ud800"  # unusable: the column is no longer full
    rows[1]["parent_span_id"], rows[3]["parent_span_id"] = "é", "p"  # not ASCII
    rows[0]["service"], rows[2]["service"] = "", "s"  # ASCII, an empty one
    table = table_from_rows(rows)
    table.validate(full=True)
    assert table.schema == SPAN_SCHEMA
    assert table.column("start_ns").to_pylist() == [0, 1, 2, 3]
    assert table.column(sc.TTFT.key).to_pylist() == [0.0, 0.25, 0.5, 0.75]
    assert table.column(sc.STREAM.key).to_pylist() == [True, False, True, False]
    assert table.column("name").to_pylist() == ["n"] * 4
    assert table.column("span_id").to_pylist() == ["00", "01", "02", None]
    assert table.column(sc.TURN_INDEX.key).to_pylist() == [None, None, 3, None]
    assert table.column("parent_span_id").to_pylist() == [None, "é", None, "p"]
    assert table.column("service").to_pylist() == ["", None, "s", None]
    assert table.column("service").null_count == 2
    assert table.column(sc.CONVERSATION_ID.key).to_pylist() == [None] * 4
    assert table.column(sc.CONVERSATION_ID.key).null_count == 4
    for column in ("start_ns", sc.TTFT.key, sc.STREAM.key, "name"):
        assert table.column(column).null_count == 0, column


def test_coerce_gives_each_value_what_coerced_gives():
    """``coerce`` leaves the values ``coerced`` would return as they are without calling
    it: every other value still goes through it (and is reported when unusable)."""
    from kvobs import semconv as sc
    from kvobs.sources._rows import INT64_MAX, UNUSABLE, _TYPES, coerce, coerced

    cases = {
        "span_id": ["01", "é", "\ud800", 7, None],
        sc.TURN_INDEX.key: [3, INT64_MAX, -INT64_MAX, INT64_MAX + 1, -INT64_MAX - 1, True,
                            2.0, 2.5, "4"],
        sc.TTFT.key: [1.5, float("inf"), float("-inf"), float("nan"), 2, "0.5", False],
        sc.STREAM.key: [True, False, "true", "FALSE", 1, "yes"],
    }
    for key, values in cases.items():
        for value in values:
            row = {key: value}
            bad = coerce(row)
            try:
                expected, unusable = coerced(value, _TYPES[key]), []
            except UNUSABLE:
                expected, unusable = None, [key]
            assert bad == unusable, (key, value)
            assert repr(row[key]) == repr(expected), (key, value)


def test_the_compiled_row_loop_spreads_rows_as_the_python_loop_does(monkeypatch):
    """``_frame._spread``: the compiled loop (built by setup.py) gives each column the
    rows and values the Python loop gives, on rows of random keys and values (None, keys
    of no column, repeated objects); a row that is not a dict leaves every row to the
    Python loop; a generator of rows is taken whole."""
    import random
    from collections import OrderedDict

    from kvobs import semconv as sc
    from kvobs.sources import _frame

    assert _frame._transpose is not None, "kvobs.sources._columns_native was not built"
    rng = random.Random(3)
    keys = [*_frame.ALL_DTYPES][:40] + ["no.such.key", "", sc.ROLE.key]
    values = [None, 0, 1.5, "x", "é", True, 2**70, float("nan"), [1], {"a": 1}]
    for size in (0, 1, 7, 300):
        rows = [{rng.choice(keys): rng.choice(values) for _ in range(rng.randrange(25))}
                for _ in range(size)]
        compiled = _frame._spread(rows)
        with monkeypatch.context() as patch:
            patch.setattr(_frame, "_transpose", None)
            python = _frame._spread(rows)
        assert list(compiled) == list(python) == list(_frame.ALL_DTYPES)
        for column in compiled:
            at, got = compiled[column]
            assert at == python[column][0] and got == python[column][1], column
            assert all(a is b for a, b in zip(got, python[column][1]))  # the same objects
        assert _frame._transpose(rows + [OrderedDict(rows[0] if rows else {})],
                                 _frame._POSITIONS, len(_frame._POSITIONS)) is None
    ordered = [OrderedDict({"span_id": "01"}), {"span_id": "02", "trace_id": None}]
    assert _frame._spread(ordered)["span_id"] == ([0, 1], ["01", "02"])
    table = _frame.table_from_rows(row for row in ordered)
    assert table.column("span_id").to_pylist() == ["01", "02"]
