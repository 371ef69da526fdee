"""`kvobs tune` says how many reads and gaps each recommendation rests on, how far the
break-even moves with the sample (bootstrap), and warns when the sample is small."""

import json

import pytest
from click.testing import CliRunner

from kvobs.cli import main
from kvobs.fleet import fleet_turns, label_turns, tune
from kvobs.fleet.confidence import FEW_READS, confidence
from kvobs.sources import open_source


@pytest.fixture(scope="module")
def labelled(synthetic_store):
    return label_turns(fleet_turns(open_source(synthetic_store[0])))[0]


def _first_conversations(turns, reads: int):
    """The earliest conversations holding about ``reads`` completed reads."""
    done = (turns["read_outcome"] == "done").fillna(False)
    per_conversation = done.groupby(turns["conversation_id"], sort=False).sum().cumsum()
    keep = per_conversation[per_conversation <= reads].index
    return turns[turns["conversation_id"].isin(keep)].reset_index(drop=True)


def test_a_large_sample_is_trusted_and_its_interval_holds_the_estimate(labelled):
    result = tune(labelled)
    trust = confidence(labelled, result)
    assert trust.reads == result.read.reads >= 100
    assert trust.later_turns == int((labelled["turn"] > 1).sum())
    low, high = trust.break_even_interval
    assert low <= result.break_even_tokens <= high
    assert trust.level in ("medium", "high") and not trust.warnings


def test_few_reads_widen_the_interval_and_warn(labelled):
    full = confidence(labelled, tune(labelled)).break_even_interval
    few = _first_conversations(labelled, 8)
    result = tune(few)
    trust = confidence(few, result)
    assert 2 <= trust.reads < FEW_READS
    low, high = trust.break_even_interval
    assert high is None or high - low > full[1] - full[0]
    assert trust.level == "low"
    assert any(f"rests on {trust.reads} reads" in w for w in trust.warnings)


def test_tune_cli_states_sample_and_confidence(synthetic_store):
    result = CliRunner().invoke(main, ["tune", "--source", synthetic_store[0]])
    assert result.exit_code == 0
    assert "reads (read-cost fit)" in result.output and "confidence " in result.output
    payload = json.loads(CliRunner().invoke(
        main, ["tune", "--source", synthetic_store[0], "--json"]).output)
    assert payload["confidence"]["reads"] == payload["read"]["reads"]
    assert payload["confidence"]["level"] in ("low", "medium", "high")
