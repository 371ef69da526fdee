"""`--since`: durations in pandas' Timedelta syntax or ISO-8601 instants; bad input is an
input error (exit 2) that says what is accepted, never a traceback."""

import doctest
import json

import pandas as pd
import pytest
from click.testing import CliRunner

from kvobs.cli import main
from kvobs.fleet import build_report, fleet_turns
from kvobs.fleet import since as since_module
from kvobs.fleet.since import parse_since, since_cutoff_ns
from kvobs.sources import open_source


def test_docstring_examples():
    assert doctest.testmod(since_module).failed == 0


@pytest.mark.parametrize("text, seconds", [
    ("30min", 1800), ("30m", 1800), ("1h30m", 5400), ("1h 30min", 5400), ("90s", 90),
    ("7d", 7 * 86400), ("2 days", 2 * 86400), ("1.5h", 5400), ("PT1H30M", 5400),
    ("2w", 14 * 86400)])
def test_durations(text, seconds):
    assert parse_since(text) == pd.Timedelta(seconds=seconds)


def test_instants_are_utc_unless_they_say():
    assert parse_since("2026-12-01T08:00") == pd.Timestamp("2026-12-01T08:00Z")
    assert parse_since("2026-12-01T09:00+01:00") == pd.Timestamp("2026-12-01T08:00Z")


@pytest.mark.parametrize("text, says", [
    ("30", "has no unit"), ("-5m", "not a positive duration"),
    ("0s", "not a positive duration"), ("abc", "is not a duration"),
    ("5 min ago", "is not a duration"), ("NaT", "is not a duration")])
def test_bad_input_says_what_is_accepted(text, says):
    with pytest.raises(ValueError, match=says) as error:
        parse_since(text)
    assert "1h30m" in str(error.value) and "ISO-8601" in str(error.value)


def test_cutoff_counts_back_from_the_newest_turn():
    newest = 1_700_000_000 * 10**9
    assert since_cutoff_ns(newest, "1h30m") == newest - 5400 * 10**9
    assert since_cutoff_ns(newest, None) is None
    assert since_cutoff_ns(newest, "2023-11-14T22:13:20Z") == newest


def test_equal_durations_keep_the_same_turns(synthetic_store):
    turns = fleet_turns(open_source(synthetic_store[0]))
    everything, _ = build_report(turns)
    counts = {text: build_report(turns, since=text)[0].turns
              for text in ("1h30m", "90min", "5400s")}
    assert len(set(counts.values())) == 1
    assert 0 < counts["1h30m"] < everything.turns


@pytest.mark.parametrize("since", ["30min", "1h30m"])
def test_report_cli_accepts_pandas_durations(synthetic_store, since):
    result = CliRunner().invoke(main, ["report", "--source", synthetic_store[0], "--json",
                                       "--since", since])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["since"] == since


def test_report_cli_bad_since_is_an_input_error(synthetic_store):
    result = CliRunner().invoke(main, ["report", "--source", synthetic_store[0],
                                       "--since", "half an hour"])
    assert result.exit_code == 2
    assert "Invalid value for '--since'" in result.output
    assert "Traceback" not in result.output
