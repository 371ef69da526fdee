"""The classified-turn store: hourly partitions, latest version wins, retention by
dropping partitions, nothing lost while the disk cannot be written."""

from __future__ import annotations

import json
import os
import math
import time

import pytest

from kvobs.live.turnstore import TurnStore

HOUR = 3600.0
T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z


def _row(conversation: str, turn: int, verdict: str, version: int = 1, **extra) -> dict:
    return {"tenant": "t", "conversation_id": conversation, "turn": turn,
            "verdict": verdict, "version": version, "rule": verdict, "trace_id": "ab" * 16,
            "latency_s": 0.5, "prompt_tokens": 700, **extra}


def test_latest_version_of_each_turn_in_turn_order(tmp_path):
    store = TurnStore(str(tmp_path), 30 * 86400)
    assert store.write([_row("c", 2, "miss"), _row("c", 1, "first-turn")], now=T0) == 2
    assert store.write([_row("c", 2, "remote-hit", version=2)], now=T0 + 2 * HOUR) == 1
    assert store.partitions() == ["hour=2026010100", "hour=2026010102"]
    turns = store.latest("c")
    assert [(t["turn"], t["verdict"], t["version"]) for t in turns] == [
        (1, "first-turn", 1), (2, "remote-hit", 2)]
    assert store.latest("other") == []
    assert store.read().num_rows == 3


def test_non_finite_numbers_are_stored_as_null(tmp_path):
    store = TurnStore(str(tmp_path), 86400)
    store.write([_row("c", 1, "first-turn", latency_s=math.nan,
                      phases={"decode": math.inf})], now=T0)
    (stored,) = store.read().to_pylist()
    assert stored["latency_s"] is None
    assert json.loads(stored["detail"])["phases"] == {"decode": None}


def test_partitions_past_retention_are_dropped_whole(tmp_path):
    store = TurnStore(str(tmp_path), retention_s=2 * HOUR)
    for hour in range(5):
        store.write([_row(f"c{hour}", 1, "first-turn")], now=T0 + hour * HOUR + 60)
    gone = store.expire(now=T0 + 5 * HOUR + 1)  # hour 02 ended 2 h and 1 s ago
    assert gone == ["hour=2026010100", "hour=2026010101", "hour=2026010102"]
    assert store.partitions() == ["hour=2026010103", "hour=2026010104"]
    assert store.latest("c0") == [] and store.latest("c4")


def test_rows_wait_for_a_writable_disk(tmp_path):
    (tmp_path / "turns").write_text("a file where the directory should be")
    store = TurnStore(str(tmp_path), 86400)
    with pytest.raises(OSError):
        store.write([_row("c", 1, "first-turn")], now=T0)
    assert len(store.pending) == 1
    (tmp_path / "turns").unlink()
    assert store.write([_row("c", 2, "remote-hit")], now=T0) == 2
    assert store.pending == [] and [t["turn"] for t in store.latest("c")] == [1, 2]


# ClickHouse (chdb): the same rows in a ReplacingMergeTree table with a TTL.

def _clickhouse(chdb_path: str, name: str, retention_s: float = 86400.0):
    from kvobs.live.clickhouse_turns import ClickHouseTurns

    return ClickHouseTurns.from_url(f"chdb:{chdb_path}?turn_table=turns_{name}", retention_s)


def test_clickhouse_keeps_the_latest_version_and_skips_superseded_keys(chdb_path):
    from kvobs.live.classifier import superseded

    store = _clickhouse(chdb_path, "latest")
    now = time.time()
    assert store.latest("c") == [] and not store.exists()
    assert store.write([_row("c", 2, "miss"), _row("c", 1, "first-turn")], now=now - 60) == 2
    assert store.write([_row("c", 2, "remote-hit", version=2),
                        superseded(_row("c", 3, "miss"), 2)], now=now) == 2
    turns = store.latest("c")
    assert [(t["turn"], t["verdict"], t["version"]) for t in turns] == [
        (1, "first-turn", 1), (2, "remote-hit", 2)]
    since_turns, since_retired = store.latest_and_retired(since=now - 1)
    assert [t["turn"] for t in since_turns] == [2]
    assert [(k["turn"], k["version"]) for k in since_retired] == [(3, 2)]
    assert store.read().num_rows == 4


def test_clickhouse_table_of_an_older_kvobs_gets_the_new_columns(chdb_path):
    """A turn table created before columns were added (the report's measures, the
    prefill rate) takes today's rows: the missing nullable columns are added."""
    from kvobs.live.clickhouse_turns import SCHEMA, table_ddl

    store = _clickhouse(chdb_path, "older")
    old = table_ddl(store.table, store.retention_s)
    for name in ("measures", "prefill_tokens_per_s"):
        assert name in SCHEMA.names
        old = "\n".join(line for line in old.split("\n") if f"`{name}`" not in line)
    store.database.query(old)

    def columns() -> set[str]:
        described = store.database.query(f"DESCRIBE TABLE {store.table}")
        return set(described.column(0).to_pylist())

    assert "measures" not in columns()
    assert store.write([_row("c", 1, "first-turn")]) == 1
    assert {"measures", "prefill_tokens_per_s"} <= columns()
    assert store.read().num_rows == 1


def _older_table(chdb_path: str, name: str, dropped: tuple[str, ...]):
    """A turn table as an older kvobs made it (today's DDL without ``dropped``) holding
    one row of ``c``; a fresh ``ClickHouseTurns`` over it that has written nothing and
    records every statement it sends, and one that sends them as they are."""
    from kvobs.live.clickhouse_turns import SCHEMA, ClickHouseTurns, table_ddl
    from kvobs.live.turnstore import record
    from kvobs.sources._clickhouse_client import Database

    maker = _clickhouse(chdb_path, name)
    ddl = table_ddl(maker.table, maker.retention_s)
    for column in dropped:
        assert column in SCHEMA.names
        ddl = "\n".join(line for line in ddl.split("\n") if f"`{column}`" not in line)
    maker.database.query(ddl)
    import pyarrow as pa

    row = record(_row("c", 1, "first-turn"), time.time())
    rows = pa.Table.from_pylist([row], schema=SCHEMA).drop_columns(list(dropped))
    maker.database.insert(maker.table, rows)

    sent: list[str] = []

    def query(sql, parameters=None, large=False):
        sent.append(sql)
        return maker.database.query(sql, parameters, large)

    database = Database(query, maker.database.insert, maker.database.location)
    return ClickHouseTurns(database, maker.table), sent, maker


def _described(store) -> list[tuple[str, str]]:
    described = store.database.query(f"DESCRIBE TABLE {store.table}")
    return list(zip(described.column(0).to_pylist(), described.column(1).to_pylist()))


def test_clickhouse_table_of_an_older_kvobs_is_read_before_any_write(chdb_path):
    """A reader (kvobs report, kvobs turns) over a table an older kvobs made, before
    this process wrote anything: the columns the table lacks read as nulls of their
    type, the rows come back whole, and the table is never altered (a read-only user
    may read it)."""
    from kvobs.live.clickhouse_turns import SCHEMA

    dropped = ("measures", "prefill_tokens_per_s", "slowest_phase")
    store, sent, plain = _older_table(chdb_path, "older_read", dropped)
    before = _described(plain)
    table = store.read()
    assert table.schema == SCHEMA and table.num_rows == 1
    (stored,) = table.to_pylist()
    assert all(stored[c] is None for c in dropped)
    assert stored["conversation_id"] == "c" and stored["verdict"] == "first-turn"
    assert store.read(conversation_id="c").num_rows == 1
    assert store.read(since=time.time() - 3600).num_rows == 1
    assert [t["turn"] for t in store.latest("c")] == [1]
    columns = ["conversation_id", "turn", "measures", "prefill_tokens_per_s", "verdict"]
    (batch,) = store.batches(columns, 10)
    assert batch.schema == pa_schema(columns)
    assert batch.to_pylist() == [{"conversation_id": "c", "turn": 1, "measures": None,
                                  "prefill_tokens_per_s": None, "verdict": "first-turn"}]
    assert list(store.batches(columns, 10, later_versions=True)) == []
    assert _described(plain) == before
    assert not [q for q in sent if q.lstrip().upper().startswith(("ALTER", "CREATE", "INSERT"))]
    # learned once: one look at the table's columns for every read above
    assert sum("DESCRIBE" in q.upper() or "SYSTEM.COLUMNS" in q.upper() for q in sent) == 1


def test_a_write_after_reading_an_older_table_reads_the_new_columns(chdb_path):
    """The first write adds the missing columns (as before); the same object's next read
    gives the row just written with its measures, the older row's still null."""
    store, _, _ = _older_table(chdb_path, "older_then_write", ("prefill_tokens_per_s",))
    assert store.read().column("prefill_tokens_per_s").to_pylist() == [None]
    store.write([_row("c", 2, "miss", context={"prefill_tokens_per_s": 9000.0})])
    rates = {r["turn"]: r["prefill_tokens_per_s"] for r in store.read().to_pylist()}
    assert rates == {1: None, 2: 9000.0}


def pa_schema(columns: list[str]):
    from kvobs.live.turnstore import SCHEMA
    import pyarrow as pa

    return pa.schema([SCHEMA.field(c) for c in columns])


def test_a_table_without_a_required_column_is_an_input_error(chdb_path):
    """A table that is not a kvobs turn table (no ``detail``): reading it says which
    table and which column, as a ``SourceError`` (the CLI's exit 2), never a
    ClickHouse error about an unknown identifier; ``kvobs turns`` and ``kvobs report``
    exit 2 saying so."""
    from click.testing import CliRunner

    from kvobs.cli import main
    from kvobs.sources import SourceError

    store, _, _ = _older_table(chdb_path, "not_turns", ("detail",))
    for reading in (store.read, lambda: list(store.batches(["turn"], 10)), store.latest):
        with pytest.raises(SourceError, match=rf"{store.table}.*`detail`") as raised:
            reading()
        assert "Unknown" not in str(raised.value)
    location = f"chdb:{chdb_path}?turn_table={store.table}"
    for command in (["turns", "--json"], ["report", "--json"]):
        result = CliRunner().invoke(main, [*command, "--source", location])
        assert result.exit_code == 2, (command, result.output)
        assert "error:" in result.output and "detail" in result.output, result.output
        assert store.table in result.output


def test_kvobs_turns_and_report_read_an_older_table(chdb_path):
    """The commands over a table an older kvobs made, nothing written since: the turn is
    listed and reported (its measures unknown), and the table is left as it was."""
    from click.testing import CliRunner

    from kvobs.cli import main

    store, _, plain = _older_table(chdb_path, "older_cli", ("measures", "prefill_tokens_per_s"))
    before = _described(plain)
    location = f"chdb:{chdb_path}?turn_table={store.table}"
    listed = CliRunner().invoke(main, ["turns", "--json", "--source", location])
    assert listed.exit_code == 0, listed.output
    assert [(t["conversation_id"], t["turn"]) for t in json.loads(listed.stdout)] == [("c", 1)]
    reported = CliRunner().invoke(main, ["report", "--json", "--source", location])
    assert reported.exit_code == 0, reported.output
    assert json.loads(reported.stdout)["turns"] == 1
    assert _described(plain) == before


def test_clickhouse_stores_non_finite_numbers_as_null(chdb_path):
    store = _clickhouse(chdb_path, "nan")
    store.write([_row("c", 1, "first-turn", latency_s=math.inf, phases={"decode": math.nan})])
    (stored,) = store.read().to_pylist()
    assert stored["latency_s"] is None
    assert json.loads(stored["detail"])["phases"] == {"decode": None}


def test_clickhouse_ttl_drops_rows_past_the_retention(chdb_path):
    store = _clickhouse(chdb_path, "ttl", retention_s=2 * HOUR)
    now = time.time()
    store.write([_row("old", 1, "first-turn")], now=now - 3 * HOUR)
    store.write([_row("new", 1, "first-turn")], now=now)
    assert store.latest("old") == [] and [t["turn"] for t in store.latest("new")] == [1]


def test_rows_wait_for_a_clickhouse_that_answers(tmp_path):
    """A server that is not there: the write raises OSError (what the service logs and
    counts) and keeps the rows for the next pass."""
    pytest.importorskip("clickhouse_connect")
    from kvobs.live.turn_rows import open_turn_rows
    from kvobs._net import free_port

    store = open_turn_rows(f"clickhouse://127.0.0.1:{free_port()}/default")
    with pytest.raises(OSError, match="127.0.0.1"):
        store.write([_row("c", 1, "first-turn")])
    assert len(store.pending) == 1


def test_a_closed_hour_is_merged_into_one_sorted_file(tmp_path):
    """Three passes' parts of one hour become one file sorted by conversation once the
    hour is over (plus the merge delay); the open hour is left as written; every row
    reads the same before and after."""
    from kvobs.live.turnstore import COMPACT_AFTER_S

    store = TurnStore(str(tmp_path), 30 * 86400)
    store.write([_row("b", 1, "first-turn"), _row("a", 1, "first-turn")], now=T0 + 10)
    store.write([_row("b", 2, "miss"), _row("c", 1, "first-turn")], now=T0 + 20)
    store.write([_row("b", 2, "remote-hit", version=2)], now=T0 + 30)
    store.write([_row("d", 1, "first-turn")], now=T0 + HOUR + 10)  # the next hour
    before = {c: store.latest(c) for c in "abcd"}
    assert store.compact(now=T0 + HOUR + COMPACT_AFTER_S - 1) == []  # too soon
    assert store.compact(now=T0 + HOUR + COMPACT_AFTER_S + 1) == ["hour=2026010100"]
    closed = tmp_path / "turns" / "hour=2026010100"
    (merged,) = list(closed.glob("*.parquet"))
    assert merged.name.startswith("merged-")
    assert (closed / (merged.stem + ".cids")).exists()  # its conversation index
    import pyarrow.parquet as pq

    assert pq.read_table(merged).column("conversation_id").to_pylist() == [
        "a", "b", "b", "b", "c"]
    assert len(list((tmp_path / "turns" / "hour=2026010101").glob("*.parquet"))) == 1
    assert {c: store.latest(c) for c in "abcd"} == before
    assert [(t["turn"], t["verdict"]) for t in store.latest("b")] == [
        (1, "first-turn"), (2, "remote-hit")]
    assert store.compact(now=T0 + 2 * HOUR + COMPACT_AFTER_S + 1) == []  # one file each


def test_an_open_hour_s_parts_are_merged_and_lookups_stay_right(tmp_path, monkeypatch):
    """Parts of the hour still written to are merged into files of their own once there
    are enough of them; a conversation spread over merged files, parts and two hours
    reads the same, and a merged file whose index is gone is read whole."""
    from kvobs.live import turnstore

    monkeypatch.setattr(turnstore, "MIN_PARTS_TO_MERGE", 3)
    store = TurnStore(str(tmp_path), 30 * 86400)
    for second in range(4):
        store.write([_row("x", second + 1, "miss"), _row(f"o{second}", 1, "first-turn")],
                    now=T0 + second)
    store.write([_row("x", 2, "remote-hit", version=2)], now=T0 + HOUR + 5)
    expected = [(1, "miss", 1), (2, "remote-hit", 2), (3, "miss", 1), (4, "miss", 1)]

    def seen() -> list[tuple]:
        return [(t["turn"], t["verdict"], t["version"]) for t in store.latest("x")]

    assert seen() == expected
    assert store.compact(now=T0 + 60) == ["hour=2026010100"]  # open, 4 parts >= 3
    assert store.compact(now=T0 + 61) == []  # one merged file, no parts left
    store.write([_row("x", 5, "miss")], now=T0 + 70)  # a part next to the merged file
    expected.append((5, "miss", 1))
    assert seen() == expected and store.latest("nobody") == []
    assert store.latest("o2")[0]["verdict"] == "first-turn"
    hour = tmp_path / "turns" / "hour=2026010100"
    for index in hour.glob("*.cids"):
        index.unlink()
    assert seen() == expected
    assert TurnStore(str(tmp_path), 30 * 86400).latest("x") == store.latest("x")
    # several at once (the report's drill-down): each as its own lookup, none missing
    wanted = ["x", "o2", "nobody", "o0"]
    assert store.latest_of(wanted) == {cid: store.latest(cid) for cid in wanted}


def test_lookups_find_a_conversation_across_row_groups(tmp_path, monkeypatch):
    """A merged file of 2-row groups, sorted by conversation: every conversation (one
    of them spanning three groups) is found by bisection, whole."""
    from kvobs.live import turnstore

    monkeypatch.setattr(turnstore, "ROW_GROUP_ROWS", 2)
    store = TurnStore(str(tmp_path), 30 * 86400)
    rows = [_row(f"c{n:02d}", 1, "first-turn") for n in range(15)]
    rows += [_row("c07", turn, "miss") for turn in range(2, 7)]
    for start in range(0, len(rows), 4):
        store.write(rows[start:start + 4], now=T0 + start)
    store.compact(now=T0 + 2 * HOUR)
    for n in range(15):
        turns = [t["turn"] for t in store.latest(f"c{n:02d}")]
        assert turns == (list(range(1, 7)) if n == 7 else [1]), n
    assert store.latest("c99") == [] and store.latest("a") == []
    wanted = [f"c{n:02d}" for n in range(0, 15, 2)] + ["c07", "c99"]
    together = store.latest_of(wanted)
    assert together == {cid: store.latest(cid) for cid in wanted}
    assert [t["turn"] for t in together["c07"]] == list(range(1, 7))


def test_a_merged_file_is_looked_up_through_its_row_group_sidecar(tmp_path, monkeypatch):
    """A merged file's ``.groups`` names each conversation's row groups and holds the
    footer cut by group: a lookup neither bisects the statistics nor parses the whole
    footer. Without it (a store an older kvobs merged), or with one that is not of the
    file (truncated, another size, garbage), the lookup reads the footer as before."""
    import struct

    import pyarrow.parquet as pq

    from kvobs.live import turnstore

    monkeypatch.setattr(turnstore, "ROW_GROUP_ROWS", 2)
    store = TurnStore(str(tmp_path), 30 * 86400)
    rows = [_row(f"c{n:02d}", 1, "first-turn") for n in range(15)]
    rows += [_row("c07", turn, "miss") for turn in range(2, 7)]
    rows += [_row("c03", 1, "remote-hit", version=2)]
    for start in range(0, len(rows), 4):
        store.write(rows[start:start + 4], now=T0 + start)
    store.compact(now=T0 + 2 * HOUR)
    (merged,) = (tmp_path / "turns" / "hour=2026010100").glob("merged-*.parquet")
    sidecar = merged.with_suffix(".groups")
    assert sidecar.exists()
    expected = {n: (list(range(1, 7)) if n == 7 else [1]) for n in range(15)}
    full_footers = []
    opened = pq.ParquetFile

    def watched(path, *args, metadata=None, **kwargs):
        if metadata is None:
            full_footers.append(path)
        return opened(path, *args, metadata=metadata, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(turnstore, "_groups_holding", None)  # called: a TypeError
        patched.setattr(turnstore.pq, "ParquetFile", watched)
        for n, turns in expected.items():
            assert [t["turn"] for t in store.latest(f"c{n:02d}")] == turns, n
        assert store.latest("c03")[0]["verdict"] == "remote-hit"
        assert store.latest("c99") == []
        wanted = ["c07", "c03", "c99", "c14", "c00"]
        together = store.latest_of(wanted)
    assert full_footers == []
    assert together == {cid: store.latest(cid) for cid in wanted}
    good = sidecar.read_bytes()
    magic, size, *rest = struct.unpack_from("<4sQIIIII", good)
    assert size == merged.stat().st_size and rest[1] == pq.read_metadata(merged).num_row_groups
    for broken in (None, good[:40], b"garbage" * 20,
                   struct.pack("<4sQ", magic, size + 1) + good[12:]):
        if broken is None:
            sidecar.unlink()
        else:
            sidecar.write_bytes(broken)
        for n, turns in expected.items():
            assert [t["turn"] for t in store.latest(f"c{n:02d}")] == turns, (n, broken)
        assert store.latest_of(wanted) == together
    # the upkeep writes it for a file merged without one (by an older kvobs)
    sidecar.unlink()
    assert store.add_group_sidecars(limit=0) == []
    assert store.compact(now=T0 + 3 * HOUR) == [] and sidecar.read_bytes() == good
    assert store.add_group_sidecars() == []
    with monkeypatch.context() as patched:
        patched.setattr(turnstore, "_groups_holding", None)
        assert store.latest_of(wanted) == together
    # an index not of the file: no sidecar, the file read whole, not tried again
    sidecar.unlink()
    index = merged.with_suffix(".cids")
    index.write_bytes(index.read_bytes()[8:])  # one conversation fewer
    read_table = pq.read_table
    reads = []

    def counted(*args, **kwargs):
        reads.append(args)
        return read_table(*args, **kwargs)

    monkeypatch.setattr(turnstore.pq, "read_table", counted)
    assert store.add_group_sidecars() == [] and not sidecar.exists() and len(reads) == 1
    assert store.add_group_sidecars() == [] and len(reads) == 1
    assert TurnStore(str(tmp_path), 30 * 86400).add_group_sidecars() == [] and len(reads) == 2
    assert [t["turn"] for t in store.latest("c07")] == expected[7]


def test_merged_files_keep_statistics_of_the_columns_readers_filter_on(tmp_path):
    """Not of the turn JSON (a few KB a row group, most of the footer then)."""
    import pyarrow.parquet as pq

    store = TurnStore(str(tmp_path), 30 * 86400)
    store.write([_row("a", 1, "first-turn"), _row("b", 1, "miss", version=2)], now=T0)
    store.write([_row("c", 1, "first-turn")], now=T0 + 1)
    store.compact(now=T0 + 2 * HOUR)
    (merged,) = (tmp_path / "turns" / "hour=2026010100").glob("merged-*.parquet")
    group = pq.read_metadata(merged).row_group(0)
    kept = {group.column(i).path_in_schema for i in range(group.num_columns)
            if group.column(i).is_stats_set}
    assert {"conversation_id", "tenant", "turn", "version", "finalized_at"} <= kept
    assert "detail" not in kept and "measures" not in kept
    assert [r for r in store.batches(["conversation_id"], 10, later_versions=True)][0] \
        .column(0).to_pylist() == ["b"]


def test_a_part_merged_away_while_read_is_skipped(tmp_path, monkeypatch):
    """A file listed but gone when opened (merged by the service meanwhile) does not
    fail the read."""
    store = TurnStore(str(tmp_path), 30 * 86400)
    store.write([_row("x", 1, "first-turn")], now=T0)
    listdir = os.listdir

    def with_a_ghost(path):
        names = listdir(path)
        return names + ["part-0-gone.parquet"] if str(path).endswith("hour=2026010100") \
            else names

    monkeypatch.setattr(os, "listdir", with_a_ghost)
    assert [t["turn"] for t in store.latest("x")] == [1]
    assert store.read().num_rows == 1


@pytest.mark.timeout(60)
def test_a_fifo_named_like_a_part_is_skipped_with_one_warning(tmp_path):
    """Opening a FIFO blocks until something writes to it: ``kvobs turns`` and the
    service's merge would hang on one named ``part-*.parquet``."""
    from click.testing import CliRunner

    from kvobs.cli import main

    store = TurnStore(str(tmp_path), 30 * 86400)
    store.write([_row("c", 1, "first-turn")], now=T0)
    store.write([_row("c", 2, "remote-hit")], now=T0 + 1)
    fifo = tmp_path / "turns" / "hour=2026010100" / "part-fifo.parquet"
    os.mkfifo(fifo)
    result = CliRunner().invoke(main, ["turns", "--source", str(tmp_path), "--json"])
    assert [(t["turn"], t["verdict"]) for t in json.loads(result.stdout)] == [
        (1, "first-turn"), (2, "remote-hit")]
    warning = f"{fifo}: skipped (not a regular file: a FIFO)"
    assert result.stderr.count(warning) == 1, result.stderr
    assert store.compact(now=T0 + 2 * HOUR) == ["hour=2026010100"]  # the two parts merged
    assert [t["turn"] for t in store.latest("c")] == [1, 2]
    assert os.path.exists(fifo) and store.problems == [warning]


@pytest.mark.parametrize(
    "value",
    [
        "plain", "ünïcödé ✓", "line\u2028sep", 1.5, -0.0, 2**63 - 1, -(2**63), True, None,
        {"nested": [1, 2.5, "x"]}, math.nan, math.inf, -math.inf,
        2**70,  # past 64 bits: orjson refuses it, json writes it
        "\ud800",  # a lone surrogate: orjson refuses it, json escapes it
        {1: "a key not a string"},
    ],
)
def test_a_row_s_detail_holds_the_values_json_gives(value):
    import numpy as np

    from kvobs.live.turnstore import record

    row = {"tenant": "t", "conversation_id": "c", "turn": 1, "verdict": "first-turn",
           "value": value, "numpy": np.float64(0.25)}
    detail = record(row, 1.0)["detail"]
    expected = json.loads(json.dumps(row, default=str).replace("NaN", "null")
                          .replace("-Infinity", "null").replace("Infinity", "null"))
    assert json.loads(detail) == expected
    assert "NaN" not in detail and "Infinity" not in detail
