"""The fleet turn table (column-wise, for scale) labels every turn as kvobs diagnose does."""

import pandas as pd
import pytest

from kvobs.correlate import prefill_rate, turns_from_spans
from kvobs.diagnose import all_turns
from kvobs.fleet import classify_frame, fleet_turns
from kvobs.sources import open_source
from spanfactory import Tracers, TurnSpec, write_conversation

FACTORY_CASES = {
    "hit": [TurnSpec(), TurnSpec(read="done")],
    "declined": [TurnSpec(), TurnSpec(read="declined-expired", fallback="read-declined")],
    "failed": [TurnSpec(), TurnSpec(read="failed", fallback="read-failed")],
    "stuck": [TurnSpec(), TurnSpec(stuck=True, read=None)],
    "no-lookup": [TurnSpec(), TurnSpec(lookup=None)],
    "no-decision": [TurnSpec(), TurnSpec(decision=None, read="done")],
    "pull-no-read": [TurnSpec(), TurnSpec(read=None)],
    "invalid": [TurnSpec(), TurnSpec(decision="invalid")],
    "no-id": [TurnSpec(), TurnSpec(lookup="no-id")],
    "stale": [TurnSpec(), TurnSpec(lookup="stale", decision="no-params")],
    "released": [TurnSpec(release="expired", ttl_s=10), TurnSpec(gap_s=20, decision="local-hit")],
    "slow": [TurnSpec(prefill_leg_s=0.1), TurnSpec(read="done", read_duration_s=5.0)],
    "miss": [TurnSpec(), TurnSpec(decision="no-params")],
    "below": [TurnSpec(), TurnSpec(decision="below-threshold", local=960)],
}


@pytest.fixture(scope="module")
def factory_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("factory")
    tracers = Tracers(str(path))
    for name, specs in FACTORY_CASES.items():
        write_conversation(tracers, name, specs)
    return str(path)


def _compare(source):
    reference = {(d.conversation_id, d.turn.index): d.finding.verdict.value
                 for d in all_turns(source)}
    turns = fleet_turns(source)
    verdicts = classify_frame(turns, prefill_rate(turns))
    fleet = {(str(c), int(t)): v for c, t, v in
             zip(turns["conversation_id"], turns["turn"], verdicts)}
    assert fleet == reference
    return turns


def test_parity_on_factory_spans(factory_store):
    _compare(open_source(factory_store))


def test_parity_on_synthetic_store(synthetic_store):
    _compare(open_source(synthetic_store[0]))


def test_fleet_turn_table_equals_correlate(synthetic_store):
    source = open_source(synthetic_store[0])
    reference = turns_from_spans(source.spans())
    turns = fleet_turns(source)
    assert list(turns["conversation_id"].astype(str)) == list(reference["conversation_id"])
    for column in turns.columns:
        if column in reference.columns and column != "conversation_id":
            left = pd.Series(turns[column].astype(object)).where(turns[column].notna(), None)
            right = pd.Series(reference[column].astype(object)).where(
                reference[column].notna(), None)
            assert all(a == b or (a is not None and b is not None
                                  and abs(float(a) - float(b)) <= 1e-6 * max(1, abs(float(a)) / 1e9))
                       for a, b in zip(left, right)), column
