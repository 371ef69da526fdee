"""kvobs report / tune / whatif on a small synthetic store."""

import json

import pytest
from click.testing import CliRunner

from kvobs.cli import main
from kvobs.fleet import build_report, fleet_turns, label_turns, tune, whatif
from kvobs.settings import entry_lifetime_s
from kvobs.sources import open_source


@pytest.fixture(scope="module")
def labelled(synthetic_store):
    turns = fleet_turns(open_source(synthetic_store[0]))
    return label_turns(turns)[0]


def test_report_separates_turn_one_and_counts_every_turn(synthetic_store, labelled):
    report, _ = build_report(fleet_turns(open_source(synthetic_store[0])), "x")
    assert report.first_turn["verdicts"] == {"first-turn": report.conversations}
    assert report.first_turn["turns"] + report.later_turns["turns"] == report.turns
    assert sum(r["turns"] for r in report.by_turn) == report.turns
    later = labelled[labelled["turn"] > 1]
    assert sum(r["turns"] for r in report.by_prompt) == later["prompt_tokens"].notna().sum()
    hits = report.later_turns["verdicts"]["remote-hit"]
    assert report.later_turns["remote_hit_ratio"] == hits / report.later_turns["turns"]
    assert report.synthetic
    memory = report.memory
    assert 0 < memory["block_seconds_held_then_read"] < memory["block_seconds_held"]
    assert 0 < memory["read_share_of_blocks"] < 1


def test_since_keeps_only_recent_turns(synthetic_store):
    turns = fleet_turns(open_source(synthetic_store[0]))
    everything, _ = build_report(turns)
    recent, _ = build_report(turns, since="2h")
    assert 0 < recent.turns < everything.turns


def test_report_cli_json_and_html(synthetic_store, tmp_path):
    html = tmp_path / "report.html"
    result = CliRunner().invoke(main, ["report", "--source", synthetic_store[0], "--json",
                                       "--html", str(html)])
    assert result.exit_code == 0  # faults in the fleet, but no --fail-on: runs under set -e
    data = json.loads(result.output)
    assert data["later_turns"]["turns"] > 0 and data["synthetic"] is True
    text = html.read_text()
    # three waterfalls (the worst conversations), phase shares, read time vs tokens
    assert text.count("data:image/png;base64,") == 5 and "SYNTHETIC" in text
    rows = data["drill_down"]["rows"]
    assert data["drill_down"]["fault_turns"] >= len([r for r in rows if r["kind"] == "fault"])
    assert rows and all(r["command"].startswith("kvobs diagnose synthetic-") for r in rows)
    assert "Where the time went" in text


def test_tune_recovers_the_simulated_break_even(labelled):
    result = tune(labelled)
    # Simulated: 2 ms per read + 13.1 us/token (10 GB/s, 128 KiB/token) vs ~7,700 tok/s.
    assert 1.5e-3 < result.read.fixed_s < 3e-3
    assert 10 < result.break_even_tokens < 30
    assert result.recommended_threshold in (16, 32)
    assert result.current_threshold == 64 and result.current_ttl_s == 480
    ratios = [row["hit_ratio"] for row in result.ttl_table]
    memory = [row["block_seconds"] for row in result.ttl_table]
    assert ratios == sorted(ratios) and memory == sorted(memory)
    # The kvobs proxy's own lifetime under that TTL (kvobs.settings), not a second margin.
    assert result.recommended_proxy_lifetime_s == entry_lifetime_s(result.recommended_ttl_s)
    assert any("break-even M*" in line for line in result.arithmetic)


def test_whatif_longer_ttl_and_lower_threshold(labelled):
    same = whatif(labelled, 480, 64)
    more = whatif(labelled, 1800, 16)
    assert same.actual == more.actual
    assert more.predicted["remote_hit_ratio"] > same.predicted["remote_hit_ratio"]
    assert (more.predicted["verdicts"].get("expired", 0)
            < same.predicted["verdicts"].get("expired", 0))
    assert more.predicted["block_seconds_held"] > same.predicted["block_seconds_held"]
    # The recorded settings: what happened, turn for turn (tests/fleet/test_whatif.py).
    assert same.changed_turns == 0 and same.predicted["verdicts"] == same.actual["verdicts"]


def test_tune_and_whatif_cli(synthetic_store):
    runner = CliRunner()
    tuned = runner.invoke(main, ["tune", "--source", synthetic_store[0]])
    assert tuned.exit_code == 0 and "kv_recompute_threshold" in tuned.output
    replay = runner.invoke(main, ["whatif", "--source", synthetic_store[0], "--ttl", "900",
                                  "--threshold", "32", "--json"])
    assert replay.exit_code == 0
    assert json.loads(replay.output)["ttl_s"] == 900


def test_tenants_sharing_an_id_are_separate_conversations(factory_store):
    import pandas as pd
    from fleet_cases import FACTORY_CASES, TENANTS

    from kvobs.fleet.tune import next_turn

    report, _ = build_report(fleet_turns(open_source(factory_store)))
    assert report.conversations == len(FACTORY_CASES) + len(TENANTS)
    # Turn 3 of one tenant right after turn 2 of another is not its next turn.
    turns = pd.DataFrame({"tenant": ["a", "a", "b"], "conversation_id": ["x", "x", "x"],
                          "turn": [1, 2, 3]})
    assert next_turn(turns)[0].tolist() == [True, False, False]


@pytest.mark.parametrize("fail_on, expected", [("never", 0), ("fault", 1),
                                               ("insufficient", 1)])
def test_report_fails_only_when_asked(synthetic_store, fail_on, expected):
    result = CliRunner().invoke(main, ["report", "--source", synthetic_store[0], "--json",
                                       "--fail-on", fail_on])
    assert result.exit_code == expected, result.output
