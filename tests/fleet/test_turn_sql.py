"""The report's tally computed by ClickHouse (``kvobs.fleet.turn_sql``) against the one
the report adds up from the same rows read in batches (``TurnTally.add``): counts,
integer sums and every sketch's buckets equal, float sums within a few ulps; on the
synthetic fleet's turns (every verdict) given missing and older measures, several
hours, NULL tenants, later versions and retired turns."""

from __future__ import annotations

import zlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from kvobs.fleet import fleet_turns
from kvobs.fleet import turn_report as tr
from kvobs.fleet import turn_sql
from kvobs.fleet.report import build_report
from kvobs.fleet.sketch import bucket_key_sql, new_sketch, sketch_state
from kvobs.fleet.turn_tally import TurnTally
from kvobs.live.backfill import turn_rows_table
from kvobs.live.clickhouse_turns import ClickHouseTurns, table_ddl
from kvobs.live.turn_measures import MEASURE_DTYPE
from kvobs.semconv import VERDICT_VALUES
from kvobs.sources import open_source


def _floats_equal(a, b, path="report"):
    """Equal, floats to ~12 significant digits (sums added in another order)."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            _floats_equal(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _floats_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-9, nan_ok=True), path
    else:
        assert a == b, path


@pytest.fixture(scope="module")
def varied(synthetic_store, chdb_path):
    """The synthetic fleet's turn rows in a ClickHouse turn table, made harder: three
    hours, rows without a measures record or with an older (shorter) one, no latency or
    TTFT, NULL tenants, turns given a version 2 or 3 in a later hour, turns retired."""
    source = synthetic_store[0]
    span, labelled = build_report(fleet_turns(open_source(source)), source)
    table = turn_rows_table(labelled, span.prefill_tokens_per_s)
    n = table.num_rows
    at = np.arange(n)
    base = 1_767_225_600.0
    measures = table.column("measures").to_pylist()
    older = MEASURE_DTYPE.itemsize - 8 * 40  # a record before the replay's facts
    measures = [
        None if i % 17 == 5 else (m[:older] if i % 19 == 3 and m else m)
        for i, m in enumerate(measures)
    ]

    def nulled(name, every, phase=0):
        values = table.column(name)
        return pc.if_else(pa.array(at % every == phase), pa.nulls(n, values.type), values)

    table = (
        table.set_column(table.schema.get_field_index("finalized_at"), "finalized_at",
                         pa.array(base + (at % 3) * 3600.0 + 10.0))
        .set_column(table.schema.get_field_index("measures"), "measures",
                    pa.array(measures, pa.binary()))
        .set_column(table.schema.get_field_index("latency_s"), "latency_s",
                    nulled("latency_s", 13, 4))
        .set_column(table.schema.get_field_index("ttft_s"), "ttft_s", nulled("ttft_s", 11, 2))
    )
    cids = table.column("conversation_id").to_pylist()
    tenants = [None if zlib.crc32(c.encode()) % 5 == 0 else t
               for c, t in zip(cids, table.column("tenant").to_pylist())]
    table = table.set_column(table.schema.get_field_index("tenant"), "tenant",
                             pa.array(tenants, pa.string()))
    assert None in tenants
    # every verdict (the synthetic fleet has no host tier): a few turns relabelled
    verdicts = table.column("verdict").to_pylist()
    absent = sorted(set(VERDICT_VALUES) - set(verdicts))
    for k, verdict in enumerate(absent):
        for i in range(7 + k, n, 97):
            verdicts[i] = verdict
    table = table.set_column(table.schema.get_field_index("verdict"), "verdict",
                             pa.array(verdicts, pa.string()))
    later = []
    rows = table.to_pylist()
    for i in range(0, n, max(1, n // 40)):
        row = dict(rows[i], version=2, finalized_at=base + 2 * 3600.0 + 20.0)
        row["verdict"] = "transfer-failed" if i % 3 else None  # None: retired
        later.append(row)
        if i % 4 == 0:
            later.append(dict(row, version=3, verdict="expired", latency_s=9.5))
    table = pa.concat_tables([table, pa.Table.from_pylist(later, schema=table.schema)])
    turns = ClickHouseTurns.from_url(f"chdb:{chdb_path}?turn_table=turns_sql",
                                     retention_s=3650 * 86400.0)
    turns.database.query(table_ddl(turns.table, turns.retention_s))
    turns.database.insert(turns.table, table)
    assert set(table.column("verdict").drop_null().to_pylist()) >= {"transfer-failed",
                                                                     "expired"}
    return turns, source


def _rows_tally(turns, skip=(), cutoff=None) -> TurnTally:
    versions = tr.Versions()
    for batch in turns.batches(tr.KEY_COLUMNS, tr.BATCH_ROWS, later_versions=True):
        versions.add(batch)
    total = TurnTally()
    for batch in tr.newest_batches(turns, tr.AGGREGATED, versions, cutoff, skip):
        total.add(batch)
    return total


def _sketches(tally: TurnTally) -> dict:
    out = {"per_block": sketch_state(tally.per_block)}
    for scope, t in tally.scopes.items():
        out[scope] = (sketch_state(t.ttft), sketch_state(t.latency))
    for name, found in tally.groups.items():
        for group, t in found.items():
            out[(name, group)] = (sketch_state(t.ttft), sketch_state(t.latency))
    for scope, t in tally.phases.items():
        out[("phases", scope)] = {p: sketch_state(s) for p, s in t.sketches.items()}
    return out


@pytest.mark.parametrize("skip, cutoff", [((), None), (("2026010100",), None),
                                          ((), "median")])
def test_the_engines_tally_is_the_rows_tally(varied, skip, cutoff):
    turns, _ = varied
    if cutoff == "median":
        starts = tr._turn_starts(turns.read().combine_chunks().to_batches()[0])
        cutoff = int(np.nanmedian(starts))
    engine = turn_sql.EngineTally(turns, skip, cutoff).tally()
    rows = _rows_tally(turns, skip, cutoff)
    assert engine.turns == rows.turns > 300
    assert _sketches(engine) == _sketches(rows)  # buckets identical: quantiles exact
    state_of = TurnTally.to_bytes.__globals__  # the stored form's own state functions
    for scope in rows.scopes:
        assert state_of["_scope_state"](engine.scopes[scope]) == state_of["_scope_state"](
            rows.scopes[scope])
        assert state_of["_phase_state"](engine.phases[scope]) == state_of["_phase_state"](
            rows.phases[scope])
    for name in rows.groups:
        assert engine.groups[name].keys() == rows.groups[name].keys(), name
        for group in rows.groups[name]:
            assert (state_of["_scope_state"](engine.groups[name][group])
                    == state_of["_scope_state"](rows.groups[name][group]))
    _floats_equal(dict(engine.memory), dict(rows.memory))
    assert [type(v) for v in engine.memory.values()] == [type(v) for v in rows.memory.values()]
    _floats_equal(engine.retained.totals(1.0), rows.retained.totals(1.0))
    assert engine.retained.recording_end_ns == rows.retained.recording_end_ns
    assert engine.faults.rows == rows.faults.rows and engine.fault_count == rows.fault_count
    assert (engine.rate, engine.rate_at, engine.synthetic) == (rows.rate, rows.rate_at,
                                                                rows.synthetic)
    assert (engine.first_start_ns, engine.last_start_ns, engine.unstarted) == (
        rows.first_start_ns, rows.last_start_ns, rows.unstarted)
    from kvobs.fleet.turn_tally import _distinct

    assert np.array_equal(_distinct(engine.conversations), _distinct(rows.conversations))
    verdicts = set().union(*(t.verdicts for t in engine.scopes.values()))
    if not skip and cutoff is None:
        assert verdicts == set(VERDICT_VALUES)


@pytest.mark.parametrize("since", [None, "30m"])
def test_the_report_by_the_engine_is_the_report_by_rows(varied, monkeypatch, since):
    turns, source = varied
    by_engine = tr.turn_row_report(turns, source, since)
    monkeypatch.setattr(turn_sql, "PUSH_DOWN", False)
    by_rows = tr.turn_row_report(turns, source, since)
    _floats_equal({**by_engine.to_dict(), "extras": by_engine.extras},
                  {**by_rows.to_dict(), "extras": by_rows.extras})
    for scope in ("first_turn", "later_turns"):  # sketched quantiles: exact
        for key in ("ttft_p50_s", "ttft_p95_s", "latency_p50_s", "latency_p95_s"):
            assert getattr(by_engine, scope)[key] == getattr(by_rows, scope)[key]
    assert by_engine.turns > 0
    if since is None:
        assert by_engine.extras["drill_down"]["slow_turns"] > 0


def test_sql_bucket_keys_are_numpys_on_bucket_edges(varied):
    """The bucket key by ClickHouse's log2 equals numpy's at every bucket's edges and
    their neighbours, and over magnitudes from 1e-300 to 1e300."""
    turns, _ = varied
    mapping = new_sketch()._mapping
    keys = np.arange(-35000, 35000, 3)  # 2^(+-1010): finite
    edges = 2.0 ** ((keys - mapping._offset) / mapping._multiplier)
    values = np.concatenate([
        edges, np.nextafter(edges, 0), np.nextafter(edges, np.inf),
        [mapping.value(int(k)) for k in keys[::11]],
        10.0 ** np.random.default_rng(0).uniform(-300, 300, 20000), [1.0, 2.0, 0.5],
    ])
    values = values[np.isfinite(values) & (values > mapping.min_possible)]
    expected = np.ceil(np.log2(values) * mapping._multiplier + mapping._offset).astype(np.int64)
    got = turns.database.query(
        f"SELECT {bucket_key_sql('v')} AS k FROM "
        "(SELECT arrayJoin(JSONExtract({v:String}, 'Array(Float64)')) AS v)",
        {"v": "[" + ",".join(repr(float(v)) for v in values) + "]"},
    ).column("k").to_numpy()
    assert np.array_equal(got, expected)


@pytest.mark.parametrize("skip", [(), ("2026010102",)])
def test_the_newest_start_by_the_engine_is_the_rows(varied, skip):
    """``--since`` counts back from the newest turn start of any row, every version."""
    from kvobs.live.turn_measures import MEASURES_COLUMN

    turns, _ = varied
    versions = tr.Versions()
    for batch in turns.batches([MEASURES_COLUMN], 1000, skip=skip):
        versions.add_starts(batch)
    assert versions.latest_start_ns is not None
    assert turn_sql.EngineTally(turns, skip, None).newest_start() == versions.latest_start_ns


def test_an_hours_tally_by_the_engine_is_the_rows(varied, monkeypatch):
    """``summarize`` on ClickHouse: each closed hour's tally made by the engine (at the
    hour's own newest versions) equals the one made from its rows, slow part included,
    and the report merging them equals the report from the rows."""
    from kvobs.fleet.turn_tally import SlowTally

    turns, source = varied
    copy = ClickHouseTurns(turns.database, "turns_sql_tallied", turns.retention_s)
    turns.database.query(f"CREATE TABLE {copy.table} AS {turns.table}")
    turns.database.query(f"INSERT INTO {copy.table} SELECT * FROM {turns.table}")
    from_rows = tr.turn_row_report(copy, source)
    made = {}
    monkeypatch.setattr(turn_sql, "ENGINE_MIN_ROWS", 1)  # every hour by the engine
    for push in (False, True):
        monkeypatch.setattr(turn_sql, "PUSH_DOWN", push)
        turns.database.query(f"DROP TABLE IF EXISTS {copy.tallies}")
        assert sorted(tr.summarize(copy)) == ["2026010100", "2026010101", "2026010102"]
        made[push] = dict(copy.summaries())
        if push:
            _floats_equal({**tr.turn_row_report(copy, source).to_dict()},
                          {**from_rows.to_dict()})
    for hour, data in made[False].items():
        rows, engine = TurnTally.from_bytes(data), TurnTally.from_bytes(made[True][hour])
        assert rows is not None and engine is not None and rows.turns == engine.turns > 0
        assert _sketches(engine) == _sketches(rows)
        assert (engine.own_versions, engine.newest_start_ns) == (rows.own_versions,
                                                                 rows.newest_start_ns)
        slow_rows, slow_engine = SlowTally.from_bytes(data), SlowTally.from_bytes(
            made[True][hour])
        assert slow_rows is not None and slow_engine is not None
        for scope in slow_rows.latencies:
            assert np.array_equal(slow_engine.latencies[scope], slow_rows.latencies[scope])
            assert slow_engine.slowest[scope].rows == slow_rows.slowest[scope].rows
