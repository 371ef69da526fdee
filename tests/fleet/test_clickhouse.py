"""ClickHouse source on chdb: the exporter's otel_traces schema, SQL turn table parity,
and the same --source strings for every command."""

import json
import shlex
import shutil

import pytest
from click.testing import CliRunner

chdb = pytest.importorskip("chdb")

from fleet_cases import (SHARED_ID, assert_same_turns, by_key, chdb_table,  # noqa: E402
                         same_figures)
from test_classify_parity import compare_verdicts  # noqa: E402

from kvobs import semconv as sc  # noqa: E402
from kvobs.cli import main  # noqa: E402
from kvobs.diagnose import diagnose  # noqa: E402
from kvobs.fleet import fleet_turns, label_turns  # noqa: E402
from kvobs.sources import open_source  # noqa: E402
from kvobs.sources import clickhouse as clickhouse_module  # noqa: E402
from kvobs.sources.clickhouse import TURNS_SUFFIX, ClickHouseSource  # noqa: E402
from kvobs.sources.store import compact  # noqa: E402


@pytest.fixture(scope="module")
def viewed(synthetic_store, chdb_path):
    return chdb_table(chdb_path, "viewed_traces", synthetic_store[0], view=True)


@pytest.fixture(scope="module")
def factory_viewed(factory_clickhouse, chdb_path):
    source = ClickHouseSource.chdb(chdb_path, "factory_viewed")
    source.create_table()
    source.create_turns_view()
    # One insert per span name: each turn's view rows are merged at read time.
    for name in factory_clickhouse.query(f"SELECT DISTINCT SpanName AS name FROM "
                                         f"{factory_clickhouse.table}").column("name"):
        source.query(f"INSERT INTO {source.table} SELECT * FROM {factory_clickhouse.table} "
                     f"WHERE SpanName = '{name}'")
    return source


def test_turn_view_gives_the_span_path_turn_table(viewed, clickhouse, synthetic_store):
    assert viewed.view_state() == "turns" and clickhouse.view_state() == ""
    # Fewer rows than spans: the view aggregated as spans arrived.
    rows = viewed.query(f"SELECT count() AS n FROM {viewed.table}{TURNS_SUFFIX}")
    assert rows.column("n")[0].as_py() < synthetic_store[1].spans
    view = fleet_turns(viewed)
    assert_same_turns(view, fleet_turns(clickhouse))
    assert_same_turns(view, fleet_turns(open_source(synthetic_store[0])))


def test_turn_view_keeps_tenants_sharing_an_id_apart(factory_viewed, factory_clickhouse,
                                                      factory_store):
    assert factory_viewed.view_state() == "turns"
    rows = factory_viewed.query(f"SELECT count() AS n FROM {factory_viewed.table}{TURNS_SUFFIX}")
    assert rows.column("n")[0].as_py() > len(fleet_turns(factory_viewed))
    turns = compare_verdicts(factory_viewed, open_source(factory_store))
    assert turns[turns["conversation_id"] == SHARED_ID]["tenant"].nunique() == 2
    assert_same_turns(turns, fleet_turns(factory_clickhouse))


def test_turn_view_is_read_in_slices_of_whole_conversations(viewed, factory_viewed,
                                                             factory_clickhouse, monkeypatch):
    whole = fleet_turns(viewed)
    monkeypatch.setattr(clickhouse_module, "VIEW_SLICE_TURNS", len(whole) // 5)
    slices = list(viewed.turn_row_slices())
    assert len(slices) >= 4 and all(piece.num_rows for piece in slices)
    ids = [set(piece.column("conversation_id").to_pylist()) for piece in slices]
    assert sum(map(len, ids)) == len(set().union(*ids))  # no conversation in two slices
    sliced = fleet_turns(viewed)  # slice by slice, stacked column by column
    assert_same_turns(sliced, whole)
    assert list(sliced.columns) == list(whole.columns)
    assert (sliced.dtypes == whole.dtypes).all()
    # Turns merged at read time, and two tenants sharing an id, a slice at a time.
    reference = fleet_turns(factory_clickhouse)
    monkeypatch.setattr(clickhouse_module, "VIEW_SLICE_TURNS", len(reference) // 3)
    assert len(list(factory_viewed.turn_row_slices())) > 1
    assert_same_turns(fleet_turns(factory_viewed), reference)


def test_turn_view_created_after_spans_is_used_once_backfilled(clickhouse, chdb_path):
    source = ClickHouseSource.chdb(chdb_path, "late_view")
    source.create_table()
    source.query(f"INSERT INTO {source.table} SELECT * FROM {clickhouse.table}")
    source.create_turns_view()
    assert source.view_state() == "incomplete"  # spans the view never saw: read spans
    assert_same_turns(fleet_turns(source), fleet_turns(clickhouse))
    source.create_turns_view(backfill=True)
    assert source.view_state() == "turns"
    assert_same_turns(fleet_turns(source), fleet_turns(clickhouse))
    # A backfill overlapping the view's own rows counts spans twice: spans again.
    source.create_turns_view(backfill=True)
    assert source.view_state() == "incomplete"


def test_turn_view_of_another_version_is_not_read(clickhouse, chdb_path):
    from kvobs.sources.clickhouse import turns_view_ddl

    source = ClickHouseSource.chdb(chdb_path, "old_view")
    source.create_table()
    target, view = turns_view_ddl(source.table)
    source.query(target.replace("kvobs turn view ", "kvobs turn view 0"))
    source.query(view)
    source.query(f"INSERT INTO {source.table} SELECT * FROM {clickhouse.table}")
    assert source.view_state() == "stale"
    assert_same_turns(fleet_turns(source), fleet_turns(clickhouse))


def test_sql_turn_table_equals_store_turn_table(clickhouse, synthetic_store):
    store = fleet_turns(open_source(synthetic_store[0]))
    sql = fleet_turns(clickhouse)
    assert_same_turns(sql, store)
    assert set(store.columns) <= set(sql.columns)
    assert (by_key(label_turns(store)[0])["verdict"].to_numpy()
            == by_key(label_turns(sql)[0])["verdict"].to_numpy()).all()


def test_sql_keeps_tenants_sharing_an_id_apart(factory_clickhouse, factory_store):
    turns = compare_verdicts(factory_clickhouse, open_source(factory_store))
    assert turns[turns["conversation_id"] == SHARED_ID]["tenant"].nunique() == 2


KEYLESS = {"reads": {sc.SPAN_READ.name: (sc.CONVERSATION_ID.key, sc.TURN_INDEX.key),
                     sc.SPAN_EXPORT.name: (sc.TENANT_DIGEST.key,)},
           "tenant": {sc.SPAN_EXPORT.name: (sc.TENANT_DIGEST.key,)}}


@pytest.mark.parametrize("case", list(KEYLESS))
def test_spans_lacking_keys_take_them_from_their_trace(clickhouse, chdb_path, case):
    """P's reads without conversation and turn, D's exports without tenant: the keys
    come from the trace, as correlate does it."""
    from kvobs.turns.correlate import turns_from_spans

    source = ClickHouseSource.chdb(chdb_path, f"keyless_{case}")
    source.create_table()
    source.create_turns_view()  # it cannot place these spans: must not be used
    keys = KEYLESS[case]
    attributes = "SpanAttributes"
    for name, dropped in keys.items():
        quoted = ", ".join(f"'{key}'" for key in dropped)
        attributes = (f"if(SpanName = '{name}', mapFilter((k, v) -> k NOT IN ({quoted}), "
                      f"SpanAttributes), {attributes})")
    source.query(f"INSERT INTO {source.table} SELECT * REPLACE ({attributes} AS "
                 f"SpanAttributes) FROM {clickhouse.table}")
    assert source.view_state() == "traces"
    turns = compare_verdicts(source)
    assert_same_turns(turns, turns_from_spans(source.spans()))
    assert turns["read_outcome"].notna().any() and turns["export_tokens"].notna().any()


def test_single_query_sql_equals_the_per_span_parts(clickhouse, factory_clickhouse):
    from kvobs.turns.correlate import turn_table

    for source in (clickhouse, factory_clickhouse):
        single = turn_table(source.query(source.turns_sql()))
        assert_same_turns(fleet_turns(source), single)


def test_diagnose_one_conversation_from_clickhouse(clickhouse, synthetic_store):
    store = open_source(synthetic_store[0])
    cid = store.conversation_ids()[7]
    assert clickhouse.conversation_ids() == store.conversation_ids()
    assert ([t.finding.verdict for t in diagnose(clickhouse, cid).turns]
            == [t.finding.verdict for t in diagnose(store, cid).turns])


def test_every_command_takes_a_chdb_source(clickhouse, factory_clickhouse, synthetic_store):
    location = clickhouse.location
    assert (open_source(f"{factory_clickhouse.location}?table=factory_traces").table
            == "factory_traces")
    assert location.startswith("chdb:") and isinstance(open_source(location),
                                                       ClickHouseSource)
    cid = open_source(synthetic_store[0]).conversation_ids()[3]
    runner = CliRunner()
    diagnosed = runner.invoke(main, ["diagnose", cid, "--source", location, "--json"])
    expected = runner.invoke(main, ["diagnose", cid, "--source", synthetic_store[0], "--json"])
    assert diagnosed.exit_code == expected.exit_code
    assert ([t["verdict"] for t in json.loads(diagnosed.output)["turns"]]
            == [t["verdict"] for t in json.loads(expected.output)["turns"]])
    report = runner.invoke(main, ["report", "--source", location, "--json"])
    assert json.loads(report.output)["turns"] == json.loads(runner.invoke(
        main, ["report", "--source", synthetic_store[0], "--json"]).output)["turns"]


def test_url_parsing():
    source = ClickHouseSource.from_url("clickhouse://u:p@ch.example:9000/otel?table=spans")
    assert source.table == "spans" and source.location == "http://ch.example:9000/otel"


def test_unreadable_clickhouse_source_is_an_input_error(clickhouse):
    runner = CliRunner()
    for location in (f"{clickhouse.location}?table=no_such_table",
                     "clickhouse://127.0.0.1:9/otel"):
        result = runner.invoke(main, ["diagnose", "x", "--source", location])
        assert result.exit_code == 2 and "error:" in result.output, location


def test_clickhouse_init_prints_or_creates_the_turn_view(clickhouse, chdb_path):
    runner = CliRunner()
    printed = runner.invoke(main, ["clickhouse", "init", "--table", "spans", "--backfill"])
    assert printed.exit_code == 0
    assert "CREATE MATERIALIZED VIEW IF NOT EXISTS spans_kvobs_turns_mv" in printed.output
    assert "INSERT INTO spans_kvobs_turns" in printed.output
    source = ClickHouseSource.chdb(chdb_path, "cli_traces")
    source.create_table()
    source.query(f"INSERT INTO {source.table} SELECT * FROM {clickhouse.table}")
    location = f"{clickhouse.location}?table=cli_traces"
    created = runner.invoke(main, ["clickhouse", "init", "--source", location, "--backfill"])
    assert created.exit_code == 0 and "complete; reports read it" in created.output
    reports = [json.loads(runner.invoke(main, ["report", "--source", at, "--json"]).output)
               for at in (location, clickhouse.location)]
    assert reports[0].pop("source") != reports[1].pop("source")
    commands = [[row.pop("command") for row in report["drill_down"]["rows"]]
                for report in reports]
    assert commands[0] == [c.replace(shlex.quote(clickhouse.location), shlex.quote(location))
                           for c in commands[1]]
    # The view's report is the spans' (floats to 1e-12: each reads rows in scan order).
    assert same_figures(reports[0], reports[1])


def test_view_rows_repeating_a_turn_are_caught_in_any_order():
    import pyarrow as pa

    from kvobs.sources.clickhouse import KEY_HASH, _repeats_a_turn

    def rows(*hashes):
        return pa.table({KEY_HASH: pa.array(hashes, pa.uint64())})

    assert _repeats_a_turn(rows(7, 1, 7)) and _repeats_a_turn(rows(2**64 - 1, 0, 2**64 - 1))
    assert not _repeats_a_turn(rows(7, 1, 2)) and not _repeats_a_turn(rows(7))


def test_a_key_hash_collision_is_told_from_a_repeated_turn():
    import pyarrow as pa

    from kvobs.sources.clickhouse import _repeats_a_key

    def rows(*keys):
        tenants, cids, turns = zip(*keys)
        return pa.table({"tenant": pa.array(tenants).dictionary_encode(),
                         "conversation_id": cids, "turn": turns})

    # Distinct keys (what two keys sharing a hash are): not repeated; in any order.
    assert not _repeats_a_key(rows(("t", "a", 2), ("u", "a", 1), ("t", "a", 1)))
    assert _repeats_a_key(rows(("t", "a", 1), ("u", "a", 1), ("t", "a", 1)))


@pytest.mark.parametrize("view", [False, True])
def test_spans_inserted_twice_count_once(clickhouse, chdb_path, view):
    """An exporter's retry or a load run twice: the sums and counts of the turn table
    (recomputed tokens, P's decisions) must not double, with or without the turn view."""
    source = ClickHouseSource.chdb(chdb_path, f"twice_{int(view)}")
    source.create_table()
    if view:
        source.create_turns_view()
    source.query(f"INSERT INTO {source.table} SELECT * FROM {clickhouse.table}")
    repeated = ", ".join(f"'{span.name}'" for span in (sc.SPAN_RECOMPUTE,
                                                        sc.SPAN_PULL_DECISION))
    source.query(f"INSERT INTO {source.table} SELECT * FROM {clickhouse.table} "
                 f"WHERE SpanName IN ({repeated})")
    once = fleet_turns(clickhouse)
    assert once["recomputed_tokens"].notna().any()
    assert_same_turns(fleet_turns(source), once)
    if view:
        assert source.view_state() == "incomplete"


def test_a_store_an_older_kvobs_wrote_loads(clickhouse, factory_store, chdb_path, tmp_path):
    """Segments without an attribute a newer kvobs added (here gen_ai.request.model and
    the host columns) load, the missing values NULL."""
    import glob

    import pyarrow.parquet as pq

    store = str(tmp_path / "store")
    shutil.copytree(factory_store, store)
    compact(store, writers_stopped=True)
    for path in glob.glob(f"{store}/compacted/*/*.parquet"):
        table = pq.read_table(path)
        old = [c for c in table.column_names
               if c != "gen_ai.request.model" and not c.startswith("kvobs.host.")]
        pq.write_table(table.select(old), path)
    newer = ClickHouseSource.chdb(chdb_path, "older_store_traces")
    newer.create_table()
    spans = newer.load_store(store)
    assert spans == len(open_source(store).spans())
    model = newer.query(f"SELECT count() FROM {newer.table} WHERE "
                        "mapContains(SpanAttributes, 'gen_ai.request.model')")
    assert model.column(0)[0].as_py() == 0


def _by_span(table):
    return table.sort_by([("trace_id", "ascending"), ("span_id", "ascending")])


def test_span_table_equals_the_stores_and_reads_a_repeated_span_once(
        factory_clickhouse, compacted_factory_store, chdb_path):
    """The span table from ClickHouse is the store's it was loaded from, typed alike
    (``SPAN_SCHEMA``), cell for cell (an unset status reads as no error), for every span
    and one conversation; spans inserted twice are read once, and said so."""
    import pyarrow.compute as pc

    from kvobs.sources._frame import SPAN_SCHEMA
    from kvobs.sources.store import StoreSource

    store = StoreSource(compacted_factory_store)
    for conversation in (None, SHARED_ID):
        ours = _by_span(factory_clickhouse.span_table(conversation))
        expected = _by_span(store.span_table(conversation))
        assert ours.schema == SPAN_SCHEMA and ours.num_rows == expected.num_rows > 0
        for name in SPAN_SCHEMA.names:
            column = expected.column(name)
            if name == "error":
                column = pc.fill_null(column, False)
            assert ours.column(name).equals(column), name
    twice = ClickHouseSource.chdb(chdb_path, "factory_twice")
    twice.create_table()
    for _ in range(2):
        twice.query(f"INSERT INTO {twice.table} SELECT * FROM {factory_clickhouse.table}")
    assert _by_span(twice.span_table()).equals(_by_span(factory_clickhouse.span_table()))
    assert any("duplicate span" in problem for problem in twice.problems)


def test_a_chdb_result_outlives_the_queries_after_it(clickhouse):
    """chdb reuses its result buffer: a table still pointing into it would change under
    the next query (it did, once the result came back uncompressed)."""
    for rows in (200_000, 10):  # many batches (concatenated), one (copied as bytes)
        numbers = f"SELECT number AS n, toString(number * 3) AS s FROM numbers({rows})"
        first = clickhouse.query(numbers)
        clickhouse.query(numbers.replace("number AS n", "number * 7 AS n"))
        clickhouse.query(f"SELECT * FROM {clickhouse.table} LIMIT 5000")
        assert first.column("n").to_pylist() == list(range(rows))
        assert first.column("s").to_pylist()[-1] == str((rows - 1) * 3)


@pytest.mark.parametrize("spill", ["room", "no file system", "a file, not a directory",
                                   "chdb refuses"])
def test_large_chdb_reads_map_a_file_or_fall_back_to_memory(clickhouse, viewed, spill,
                                                             monkeypatch, tmp_path):
    """A fleet read (``large``) is written by chdb to a file in SPILL_DIR and mapped, in
    blocks of up to 256k rows, the file gone once mapped; without such a file system,
    where no file can be made, or when chdb cannot write it, the same rows come from
    memory."""
    from kvobs.sources import _clickhouse_client as client

    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    monkeypatch.setattr(client, "SPILL_DIR", str(spill_dir))
    monkeypatch.setattr(client, "_SPILL_ROOM", 0)
    mapped = []
    real = client._mapped_result
    monkeypatch.setattr(client, "_mapped_result",
                        lambda *args: mapped.append(real(*args)) or mapped[-1])
    if spill == "no file system":
        monkeypatch.setattr(client, "SPILL_DIR", str(tmp_path / "absent"))
    elif spill == "a file, not a directory":
        (tmp_path / "plain").write_text("")
        monkeypatch.setattr(client, "SPILL_DIR", str(tmp_path / "plain"))
    elif spill == "chdb refuses":  # the statement fails; the rows must come all the same
        monkeypatch.setattr(client, "_LARGE_BLOCKS", "SETTINGS no_such_setting = 1")
    sql = viewed.view_sql(merge=False)
    rows = viewed.query(sql, large=True)
    assert mapped and (mapped[-1] is None) == (spill != "room")
    assert not list(spill_dir.iterdir())
    in_memory = viewed.query(sql)
    key = [("conversation_id", "ascending"), ("tenant", "ascending"), ("turn", "ascending")]
    assert rows.sort_by(key).equals(in_memory.sort_by(key))
    if spill == "room":  # the turn view's rows: a few large chunks, not ~1k-row ones
        assert rows.num_rows > 1000
        assert rows.column(0).num_chunks <= 1 + rows.num_rows // 100_000
        turns = clickhouse.query(clickhouse.turns_sql(), large=True)  # its own SETTINGS too
        assert mapped[-1] is not None and turns.num_rows == rows.num_rows
