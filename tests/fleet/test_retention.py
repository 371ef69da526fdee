"""Retention cost per turn (turn columns), per conversation and fleet-wide (kvobs report),
from spans written through the real SDK/exporter and read back from a store.

Two conversations: ``dev`` keeps its KV on D (the bidirectional NIXL path: export,
release, a done D->P read on turn 2), ``host`` in the host tier of an engine with the
offloading connector (save, eviction, a host hit on turn 2, a copy still held at the end).
"""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from click.testing import CliRunner

from kvobs import semconv as sc
from kvobs.cli import main
from kvobs.turns.correlate import with_retention
from kvobs.emit.spans import Correlation, emit
from kvobs.fleet import build_report, fleet_turns
from kvobs.fleet.retention import GIB_HOUR, by_conversation
from kvobs.sources import open_source
from spanfactory import SECOND, Tracers, TurnSpec, write_conversation

T0 = 1_700_000_000 * SECOND
BLOCK_BYTES = 65536
TTL_S = 30.0
# D: a 1000-token prompt retains (1000 + 10) // 16 blocks; each hold lasts the TTL
# (the release lands TTL after the export ends, 1 us later).
DEVICE_BLOCKS = (1000 + 10) // 16
DEVICE_HELD_S = TTL_S + 1e-6
READ_BYTES_PER_BLOCK = 2_000_000 / 50  # the spanfactory's read: bytes / blocks


def _save(decode, corr, at_ns, blocks):
    emit(decode, sc.SPAN_HOST_SAVE, corr, {
        sc.REQUEST_ID.key: f"r{corr.turn}", sc.HOST_BLOCKS.key: blocks,
        sc.HOST_SAVED_TOKENS.key: blocks * 16, sc.HOST_BYTES.key: blocks * BLOCK_BYTES,
        sc.HOST_DURATION.key: 0.001, sc.HOST_COVERS_RESPONSE.key: True,
        sc.HOST_SAVE_INCOMPLETE.key: False, sc.HOST_REFUSED_BLOCKS.key: 0,
        sc.HOST_PROMPT_TOKENS.key: 60, sc.HOST_OUTPUT_TOKENS.key: 21,
        sc.HOST_COPY_ENGINE.key: sc.CopyEngine.HOST_MEMCPY.value}, at_ns, at_ns)


def _lookup(decode, corr, at_ns, accepted):
    emit(decode, sc.SPAN_HOST_LOOKUP, corr, {
        sc.REQUEST_ID.key: f"r{corr.turn}", sc.PROMPT_TOKENS.key: 140,
        sc.HOST_LOCAL_TOKENS.key: 0, sc.HOST_HIT_TOKENS.key: accepted,
        sc.HOST_ACCEPTED_TOKENS.key: accepted, sc.HOST_HIT_HOST.key: accepted,
        sc.HOST_HIT_P2P.key: 0, sc.HOST_HIT_OTHER.key: 0}, at_ns, at_ns)


def write_host(tracers):
    """Turn 1 saves 5 blocks at 1 s, evicted at 5 s (after turn 2 loaded them at 3 s);
    turn 2 saves 3 more blocks at 4 s, never evicted."""
    decode = tracers[sc.Service.DECODE]
    first, second = Correlation("host", 1), Correlation("host", 2)
    _lookup(decode, first, T0, 0)
    _save(decode, first, T0 + SECOND, 5)
    _lookup(decode, second, T0 + 3 * SECOND, 80)
    _save(decode, second, T0 + 4 * SECOND, 3)
    emit(decode, sc.SPAN_HOST_EVICT, first, {
        sc.HOST_BLOCKS.key: 5, sc.HOST_EVICTED_BY.key: "filler", sc.REQUEST_ID.key: "r1",
        sc.HOST_EVICTED_AGE_MIN.key: 4.0, sc.HOST_EVICTED_AGE_MAX.key: 4.0},
        T0 + 5 * SECOND, T0 + 5 * SECOND)
    tracers.flush()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("retention"))
    tracers = Tracers(path)
    write_conversation(tracers, "dev", [
        TurnSpec(release="read", ttl_s=TTL_S),
        TurnSpec(read="done", release="expired", ttl_s=TTL_S)], start_s=T0 / SECOND)
    write_host(tracers)
    return path


@pytest.fixture(scope="module")
def turns(store):
    return fleet_turns(open_source(store))


def _row(turns, cid, turn):
    (row,) = turns[(turns["conversation_id"] == cid) & (turns["turn"] == turn)].to_dict(
        "records")
    return row


def test_device_cost_is_blocks_times_the_hold(turns):
    for turn in (1, 2):
        row = _row(turns, "dev", turn)
        assert row["device_block_seconds"] == pytest.approx(DEVICE_BLOCKS * DEVICE_HELD_S)
        assert row["host_byte_seconds"] != row["host_byte_seconds"]  # NaN: no host copy


def test_host_cost_is_bytes_times_seconds_until_evicted(turns):
    first, second = _row(turns, "host", 1), _row(turns, "host", 2)
    assert first["host_byte_seconds"] == pytest.approx(5 * BLOCK_BYTES * 4.0)
    # Turn 2's copy was never evicted: its cost is open, not a guess.
    assert second["host_byte_seconds"] != second["host_byte_seconds"]
    assert first["device_block_seconds"] != first["device_block_seconds"]


def test_by_conversation_sums_costs_and_what_they_bought(turns):
    rows = by_conversation(turns).set_index("conversation_id")
    dev, host = rows.loc["dev"], rows.loc["host"]
    assert dev["device_block_seconds"] == pytest.approx(2 * DEVICE_BLOCKS * DEVICE_HELD_S)
    assert dev["device_byte_seconds"] == pytest.approx(
        2 * DEVICE_BLOCKS * DEVICE_HELD_S * READ_BYTES_PER_BLOCK)
    assert dev["device_tokens_served"] == 900 and dev["host_tokens_served"] == 0
    assert host["host_byte_seconds"] == pytest.approx(5 * BLOCK_BYTES * 4.0)
    assert host["host_tokens_served"] == 80 and host["device_tokens_served"] == 0


def test_report_compares_the_two_places(turns):
    report, _ = build_report(turns, "x")
    device, host = report.retention["device"], report.retention["host"]
    assert device["block_seconds"] == pytest.approx(2 * DEVICE_BLOCKS * DEVICE_HELD_S)
    assert device["bytes_per_block"] == READ_BYTES_PER_BLOCK
    device_byte_s = 2 * DEVICE_BLOCKS * DEVICE_HELD_S * READ_BYTES_PER_BLOCK
    assert device["gib_hours"] == pytest.approx(device_byte_s / GIB_HOUR)
    assert device["tokens_per_gib_hour"] == pytest.approx(900 / (device_byte_s / GIB_HOUR))
    assert (device["tokens_served"], device["turns_costed"]) == (900, 2)
    assert host["byte_seconds"] == pytest.approx(5 * BLOCK_BYTES * 4.0)
    assert (host["tokens_served"], host["copies_evicted"], host["copies_still_held"]) == (
        80, 1, 1)
    # Turn 2's copy, saved at 4 s, held at least until the recording's last instant: the
    # dev conversation's last release, long after.
    last = turns[["release_end_ns", "turn_end_ns"]].astype(float).max().max()
    held = (last - (T0 + 4 * SECOND)) / SECOND
    assert host["byte_seconds_still_held_at_least"] == pytest.approx(3 * BLOCK_BYTES * held)
    top = report.retention["conversations"]
    assert [c["conversation_id"] for c in top["costliest_on_device"]] == ["dev"]
    assert [c["conversation_id"] for c in top["costliest_on_host"]] == ["host"]


def test_report_json_carries_the_retention_section(store):
    result = CliRunner().invoke(main, ["report", "--source", store, "--json"])
    data = json.loads(result.output)
    assert data["retention"]["host"]["tokens_served"] == 80
    assert data["retention"]["device"]["tokens_served"] == 900


def test_rows_without_the_facts_have_no_cost():
    """Turn files of an older kvobs lack the host columns: their cost is unknown, not 0."""
    rows = pa.table({"export_blocks": pa.array([10, None], pa.int64()),
                     "held_s": pa.array([2.0, 3.0]),
                     "export_end_ns": pa.array([None, None], pa.int64()),
                     "release_end_ns": pa.array([None, None], pa.int64())})
    out = with_retention(rows)
    assert out.column("device_block_seconds").to_pylist() == [20.0, None]
    assert out.column("host_byte_seconds").to_pylist() == [None, None]


def test_a_release_before_the_export_ends_costs_nothing_rather_than_less():
    rows = pa.table({"export_blocks": pa.array([10], pa.int64()),
                     "held_s": pa.array([None], pa.float64()),
                     "export_end_ns": pa.array([5 * SECOND], pa.int64()),
                     "release_end_ns": pa.array([4 * SECOND], pa.int64())})
    assert with_retention(rows).column("device_block_seconds").to_pylist() == [0.0]


def test_report_terminal_names_both_places(store):
    result = CliRunner().invoke(main, ["report", "--source", store])
    (line,) = [s for s in result.output.splitlines() if s.startswith("retention cost")]
    assert "900 tokens read later" in line and "80 tokens loaded later" in line
    assert "1 host copy still held" in line


def test_a_filtered_table_keeps_each_turn_with_its_conversation(turns):
    """A table filtered by --since keeps its index: rows must not shift between turns."""
    later = turns[turns["turn"] == 2]
    rows = by_conversation(later).set_index("conversation_id")
    assert rows.loc["dev", "device_tokens_served"] == 900
    assert rows.loc["host", "host_tokens_served"] == 80
    assert rows.loc["dev", "device_block_seconds"] == pytest.approx(
        DEVICE_BLOCKS * DEVICE_HELD_S)


def test_html_report_has_the_retention_table(store, tmp_path):
    pytest.importorskip("matplotlib")
    html = tmp_path / "r.html"
    result = CliRunner().invoke(main, ["report", "--source", store, "--html", str(html)])
    assert result.exit_code == 0, result.output
    text = html.read_text()
    section = text.split("Retention cost: D vs the host tier")[1]
    assert "D: tokens later turns took from it</th><td>900" in section
    assert "Host tier: tokens later turns took from it</th><td>80" in section
