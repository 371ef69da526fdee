"""ClickHouse source on chdb: the exporter's otel_traces schema, SQL turn table parity,
and the same --source strings for every command."""

import json
import shutil

import pytest
from click.testing import CliRunner

chdb = pytest.importorskip("chdb")

from conftest import SHARED_ID, assert_same_turns  # noqa: E402
from test_classify_parity import compare_verdicts  # noqa: E402

from kvobs import semconv as sc  # noqa: E402
from kvobs.cli import main  # noqa: E402
from kvobs.diagnose import diagnose  # noqa: E402
from kvobs.fleet import fleet_turns, label_turns  # noqa: E402
from kvobs.sources import open_source  # noqa: E402
from kvobs.sources.clickhouse import ClickHouseSource  # noqa: E402
from kvobs.sources.store import compact  # noqa: E402


@pytest.fixture(scope="session")
def chdb_path(tmp_path_factory):
    """One path: chdb runs one embedded server per process."""
    return str(tmp_path_factory.mktemp("chdb"))


@pytest.fixture(scope="module")
def clickhouse(synthetic_store, chdb_path):
    source = ClickHouseSource.chdb(chdb_path)
    source.create_table()
    assert source.load_store(synthetic_store[0]) == synthetic_store[1].spans
    return source


@pytest.fixture(scope="module")
def factory_clickhouse(factory_store, chdb_path, tmp_path_factory):
    """The factory's spans (two tenants sharing an id) through the exporter's schema."""
    store = str(tmp_path_factory.mktemp("factory-compacted") / "store")
    shutil.copytree(factory_store, store)
    compact(store)
    source = ClickHouseSource.chdb(chdb_path, "factory_traces")
    source.create_table()
    source.load_store(store)
    return source


def test_sql_turn_table_equals_store_turn_table(clickhouse, synthetic_store):
    store = fleet_turns(open_source(synthetic_store[0]))
    sql = fleet_turns(clickhouse)
    assert_same_turns(sql, store)
    assert set(store.columns) <= set(sql.columns)
    assert (label_turns(store)[0]["verdict"].to_numpy()
            == label_turns(sql)[0]["verdict"].to_numpy()).all()


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
    from kvobs.correlate import turns_from_spans

    source = ClickHouseSource.chdb(chdb_path, f"keyless_{case}")
    source.create_table()
    keys = KEYLESS[case]
    attributes = "SpanAttributes"
    for name, dropped in keys.items():
        quoted = ", ".join(f"'{key}'" for key in dropped)
        attributes = (f"if(SpanName = '{name}', mapFilter((k, v) -> k NOT IN ({quoted}), "
                      f"SpanAttributes), {attributes})")
    source.query(f"INSERT INTO {source.table} SELECT * REPLACE ({attributes} AS "
                 f"SpanAttributes) FROM {clickhouse.table}")
    turns = compare_verdicts(source)
    assert_same_turns(turns, turns_from_spans(source.spans()))
    assert turns["read_outcome"].notna().any() and turns["export_tokens"].notna().any()


def test_single_query_sql_equals_the_per_span_parts(clickhouse, factory_clickhouse):
    from kvobs.fleet._turns import derive, to_frame

    for source in (clickhouse, factory_clickhouse):
        single = derive(to_frame(source.query(source.turns_sql())))
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
