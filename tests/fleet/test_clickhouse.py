"""ClickHouse source on chdb: the exporter's otel_traces schema, SQL turn table parity."""

import pandas as pd
import pytest

chdb = pytest.importorskip("chdb")

from kvobs.diagnose import diagnose  # noqa: E402
from kvobs.fleet import fleet_turns, label_turns  # noqa: E402
from kvobs.sources import open_source  # noqa: E402
from kvobs.sources.clickhouse import ClickHouseSource  # noqa: E402


@pytest.fixture(scope="module")
def clickhouse(synthetic_store, tmp_path_factory):
    source = ClickHouseSource.chdb(str(tmp_path_factory.mktemp("chdb")))
    source.create_table()
    assert source.load_store(synthetic_store[0]) == synthetic_store[1].spans
    return source


def test_sql_turn_table_equals_store_turn_table(clickhouse, synthetic_store):
    store = fleet_turns(open_source(synthetic_store[0]))
    sql = fleet_turns(clickhouse)
    assert len(sql) == len(store)
    for column in store.columns:
        left = pd.Series(store[column].astype(object)).where(store[column].notna(), None)
        right = pd.Series(sql[column].astype(object)).where(sql[column].notna(), None)
        assert left.astype(str).tolist() == right.astype(str).tolist() or all(
            (a is None and b is None) or (a is not None and b is not None
                                          and abs(float(a) - float(b)) < 1e-6)
            for a, b in zip(left, right)), column
    assert (label_turns(store)[0]["verdict"].to_numpy()
            == label_turns(sql)[0]["verdict"].to_numpy()).all()


def test_diagnose_one_conversation_from_clickhouse(clickhouse, synthetic_store):
    store = open_source(synthetic_store[0])
    cid = store.conversation_ids()[7]
    assert clickhouse.conversation_ids() == store.conversation_ids()
    assert ([t.finding.verdict for t in diagnose(clickhouse, cid).turns]
            == [t.finding.verdict for t in diagnose(store, cid).turns])


def test_url_parsing():
    source = ClickHouseSource.from_url("clickhouse://u:p@ch.example:9000/otel?table=spans")
    assert source.table == "spans" and source.location == "http://ch.example:9000/otel"
