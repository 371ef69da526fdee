"""ClickHouse source on the exporter's JSON-attribute schema (its ``json: true`` option):
the same spans as the Map schema give the same diagnose, turns and report output; values
keep their JSON types and are coerced as the map's text is; a table of neither schema is
an input error."""

import json

import pandas as pd
import pytest
from click.testing import CliRunner

chdb = pytest.importorskip("chdb")

from fleet_cases import assert_same_turns, chdb_table, same_figures  # noqa: E402

from kvobs import semconv as sc  # noqa: E402
from kvobs.cli import main  # noqa: E402
from kvobs.fleet import fleet_turns  # noqa: E402
from kvobs.sources import SourceError, open_source  # noqa: E402
from kvobs.sources._clickhouse_sql import JSON, MAP, dialect_of, quote  # noqa: E402
from kvobs.sources.clickhouse import ClickHouseSource, turns_view_ddl  # noqa: E402


def _run(*args: str) -> tuple[int, object]:
    """A command's exit code and JSON output, without the fields naming the source (the
    report's, and its drill-down's commands)."""
    result = CliRunner().invoke(main, list(args))
    assert result.output.lstrip()[:1] in ("{", "["), (args, result.output)
    output = json.loads(result.output)
    if isinstance(output, dict):
        output.pop("source", None)
        for row in output.get("drill_down", {}).get("rows", ()):
            assert row.pop("command").startswith("kvobs diagnose ")
    return result.exit_code, output


def _one_conversation_per_verdict(location: str) -> list[str]:
    chosen = {}
    for row in _run("turns", "--source", location, "--json")[1]:
        chosen.setdefault(row["verdict"], row["conversation_id"])
    return sorted(set(chosen.values()))


@pytest.mark.parametrize("case", ["synthetic", "factory"])
def test_json_schema_gives_the_map_schemas_output(case, request):
    tables = {"synthetic": ("clickhouse", "json_clickhouse"),
              "factory": ("factory_clickhouse", "factory_json_clickhouse")}[case]
    map_source, json_source = (request.getfixturevalue(name) for name in tables)
    assert (map_source.dialect, json_source.dialect) == (MAP, JSON)
    locations = [f"{s.location}?table={s.table}" for s in (map_source, json_source)]
    turns = [_run("turns", "--source", at, "--json") for at in locations]
    assert turns[0] == turns[1]  # every turn, cell for cell, and the exit code
    assert len({row["verdict"] for row in turns[0][1]}) > 3
    reports = [_run("report", "--source", at, "--json") for at in locations]
    assert same_figures(reports[0], reports[1])  # floats to 1e-12: rows in scan order
    cids = _one_conversation_per_verdict(locations[0])
    assert len(cids) > 3
    for cid in cids:
        diagnosed = [_run("diagnose", cid, "--source", at, "--json") for at in locations]
        assert diagnosed[0] == diagnosed[1], cid
    assert json_source.conversation_ids() == map_source.conversation_ids()
    assert_same_turns(fleet_turns(json_source), fleet_turns(map_source))


def test_json_turn_view_and_single_query_give_the_span_path_table(
        synthetic_store, chdb_path, clickhouse, json_clickhouse):
    from kvobs.turns.correlate import turn_table

    viewed = chdb_table(chdb_path, "json_viewed", synthetic_store[0], "json", view=True)
    assert viewed.view_state() == "turns"
    reference = fleet_turns(clickhouse)
    assert_same_turns(fleet_turns(viewed), reference)
    assert_same_turns(turn_table(json_clickhouse.query(json_clickhouse.turns_sql())),
                      reference)
    # The view's SQL is the JSON dialect's: a Map view over a JSON table would not be read.
    assert "getSubcolumn(SpanAttributes" in turns_view_ddl(viewed.table, JSON)[1]
    assert "getSubcolumn" not in turns_view_ddl(viewed.table, MAP)[1]


# One span's attributes as the exporter writes them in each schema: typed JSON values,
# and the same values as the map's text; what each becomes in kvobs (None: null).
ODD_VALUES = [
    # key, JSON value, map text, read as
    (sc.CONVERSATION_ID.key, "odd", "odd", "odd"),
    (sc.TURN_INDEX.key, 2, "2", 2),
    (sc.CANDIDATE_TOKENS.key, "12", "12", 12),  # an int sent as a string
    (sc.LOCAL_HIT_TOKENS.key, 2.5, "2.5", None),  # not an int
    (sc.REMOTE_TOKENS.key, "x", "x", None),
    (sc.ENTRY_AGE.key, 0.25, "0.25", 0.25),
    (sc.DECODE_TIME.key, 1e-7, "1e-07", 1e-7),
    (sc.TTFT.key, 3, "3", 3.0),  # a float the exporter printed as "3": an Int64 in JSON
    (sc.INTER_TURN_GAP.key, "abc", "abc", None),
    (sc.PREFILL_TIME.key, "inf", "inf", None),  # not finite
    (sc.PARAMS_SENT.key, True, "true", True),
    (sc.STREAM.key, "yes", "yes", None),  # not a bool
    (sc.PREFIX_GUARD.key, 0, "0", False),
    (sc.REQUEST_ID.key, 7, "7", "7"),  # a string sent as a number
    (sc.TENANT_DIGEST.key, {"nested": 1}, None, None),  # an object: no value at the key
]


def test_json_values_are_coerced_as_the_maps_text(chdb_path):
    """Typed JSON values, ill-typed ones, a value where a path has children: each read
    as the Map schema reads the exporter's text, an unusable one null, none an error."""
    attributes = {
        "json": quote(json.dumps({key: value for key, value, _, _ in ODD_VALUES})),
        "map": "map({})".format(", ".join(f"{quote(key)}, {quote(text)}"
                                          for key, _, text, _ in ODD_VALUES
                                          if text is not None))}
    spans = {}
    for dialect, values in attributes.items():
        source = ClickHouseSource.chdb(chdb_path, f"odd_{dialect}")
        source.create_table(dialect)
        source.query(f"INSERT INTO {source.table} (Timestamp, TraceId, SpanId, SpanName, "
                     f"ServiceName, SpanAttributes, Duration, StatusCode) "
                     f"SELECT fromUnixTimestamp64Nano(1700000000000000000), 't1', 's1', "
                     f"{quote(sc.SPAN_PROXY_TURN.name)}, 'kvobs-proxy', {values}, 1000, "
                     f"'Unset'")
        spans[dialect] = source.spans("odd")
        assert len(spans[dialect]) == 1 and source.conversation_ids() == ["odd"]
    read = {key: None if pd.isna(value) else value
            for key, value in spans["json"].iloc[0].items()}
    assert {key: read[key] for key, *_ in ODD_VALUES} == {
        key: expected for key, _, _, expected in ODD_VALUES}
    assert spans["json"].astype(object).equals(spans["map"].astype(object))


@pytest.mark.parametrize("columns, words", [
    ("SpanAttributes String", "SpanAttributes is String"),
    ("SpanAttributes Map(String, UInt64)", "SpanAttributes is Map(String, UInt64)"),
    ("SpanAttributes JSON", "no column Timestamp, TraceId"),
])
def test_a_table_of_neither_schema_is_an_input_error(chdb_path, columns, words):
    table = f"odd_schema_{abs(hash(columns)) % 10_000}"
    source = ClickHouseSource.chdb(chdb_path, table)
    if "Timestamp" in words:
        source.query(f"CREATE TABLE IF NOT EXISTS {table} ({columns}) ENGINE = Memory")
    else:
        source.query(f"CREATE TABLE IF NOT EXISTS {table} (Timestamp DateTime64(9), "
                     f"TraceId String, SpanId String, ParentSpanId String, "
                     f"SpanName String, ServiceName String, Duration UInt64, "
                     f"StatusCode String, {columns}) ENGINE = Memory")
    with pytest.raises(SourceError, match="not the OpenTelemetry Collector ClickHouse"):
        open_source(f"{source.location}?table={table}")
    for command in (["diagnose", "x"], ["turns"], ["report"]):
        result = CliRunner().invoke(main, [*command, "--source",
                                           f"{source.location}?table={table}"])
        assert result.exit_code == 2, result.output
        assert words in " ".join(result.output.split()) and "Traceback" not in result.output


def test_the_attribute_column_type_picks_the_dialect():
    assert dialect_of("Map(LowCardinality(String), String)") is MAP
    assert dialect_of("JSON") is dialect_of("JSON(max_dynamic_paths = 1024)") is JSON
    assert dialect_of("Map(String, String)") is MAP  # a table made by hand, same reads
    assert dialect_of("Map(String, UInt64)") is None
    assert dialect_of("String") is None


def test_clickhouse_init_prints_the_json_view():
    printed = CliRunner().invoke(main, ["clickhouse", "init", "--attributes", "json"])
    assert printed.exit_code == 0
    assert "getSubcolumn(SpanAttributes, 'gen_ai.conversation.id')" in printed.output
    assert printed.output.count("CREATE") == 2
