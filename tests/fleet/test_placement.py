"""``kvobs whatif --placement``: the same later turns had their KV been kept on D, in the
host tier, or both, from spans written through the real SDK/exporter and read back.

``dev``: conversations on the bidirectional NIXL path (D's export, P's read), gaps of 5 s
and one of 40 s (past D's 30 s TTL); ``host``: an engine with only the offloading
connector (``tests/verdicts/test_verdicts_host.py``'s conversations: hits, evictions, a
prompt-only copy, refused saves).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from verdicts.test_verdicts_host import CASES, write_cases
from fleet_cases import same_figures
from kvobs.cli import main
from kvobs.fleet import fleet_turns, label_turns
from kvobs.fleet.placement import placement
from kvobs.settings import MIN_CACHED_TOKEN_DELTA
from kvobs.sources import open_source
from spanfactory import Tracers, TurnSpec, write_conversation

TTL_S = 30.0


@pytest.fixture(scope="module")
def device_turns(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("placement-device"))
    tracers = Tracers(path)
    for i, gap in enumerate((5.0, 5.0, 40.0)):
        write_conversation(tracers, f"dev{i}", [
            TurnSpec(release="read", ttl_s=TTL_S),
            TurnSpec(read="done", gap_s=gap, release="expired", ttl_s=TTL_S,
                     remote=1010, n=3000)], start_s=1_700_000_000 + 100 * i)
    tracers.flush()
    return label_turns(fleet_turns(open_source(path)))[0]


@pytest.fixture(scope="module")
def host_store(tmp_path_factory):
    return write_cases(str(tmp_path_factory.mktemp("placement-host")))


def test_device_recording_kept_on_d_reads_as_recorded_where_d_held(device_turns):
    """Kept on D, as recorded: the two short gaps read D's KV, the long one finds D's
    blocks expired; D's cost is each export's blocks until the read or for the TTL."""
    result = placement(device_turns, ttl_s=TTL_S)
    device = result.places["device"]
    assert result.later_turns == 3
    assert device["verdicts"] == {"remote-hit": 2, "expired": 1}
    assert device["turns_served_by_device"] == 2 and device["host_byte_seconds"] == 0
    # M = min(kept, N) - L: each turn 1 exported 1000 + 16 tokens
    exported = device_turns.loc[device_turns["turn"] == 1, "export_tokens"].astype(float)
    assert device["tokens_served_by_device"] == 2 * int(exported.iloc[0])
    per_block = result.tokens_per_block
    held = (2 * 5.0 + 1 * TTL_S) * exported.iloc[0] + 3 * 3016 * TTL_S  # turn 2s: TTL
    assert device["device_block_seconds"] == pytest.approx(held / per_block, rel=0.01)


def test_device_recording_kept_in_the_host_tier(device_turns):
    """The same turns with the KV in the host tier: with no gate every turn is served,
    the 40 s gap too (no TTL there); the cost is bytes until the next turn only."""
    result = placement(device_turns, min_cached_token_delta=0, ttl_s=TTL_S)
    host = result.places["host"]
    assert host["verdicts"] == {"host-hit": 3} and host["turns_served_by_host"] == 3
    assert host["device_block_seconds"] == 0
    assert result.host_evictions == "none recorded"
    exported = float(device_turns.loc[device_turns["turn"] == 1, "export_tokens"].iloc[0])
    assert host["host_byte_seconds"] == pytest.approx(
        (5.0 + 5.0 + 40.0) * exported * result.bytes_per_token, rel=0.01)
    both = result.places["both"]
    assert (both["turns_served_by_device"], both["turns_served_by_host"]) == (2, 1)
    assert both["verdicts"] == {"remote-hit": 2, "host-hit": 1}


def test_the_gate_turns_small_remainders_away(device_turns):
    """minCachedTokenDelta above M: the router never sends P to the host copy."""
    result = placement(device_turns, min_cached_token_delta=5000, ttl_s=TTL_S)
    host = result.places["host"]
    assert host["turns_served_by_host"] == 0
    assert host["verdicts"] == {"below-threshold": 3}
    assert result.min_cached_token_delta == 5000


def test_host_recording_keeps_its_evictions(host_store):
    turns = label_turns(fleet_turns(open_source(host_store)))[0]
    result = placement(turns, min_cached_token_delta=0)
    evicted = sum(1 for _, v in CASES.values() if v.value == "host-evicted")
    assert result.recorded["verdicts"]["host-evicted"] == evicted
    assert result.places["host"]["verdicts"]["host-evicted"] == evicted
    assert result.places["host"]["turns_served_by_host"] == len(CASES) - evicted
    assert result.host_evictions == "as recorded"
    # kept on D (480 s TTL, 9 s gaps): every turn reads, evicted or not
    assert result.places["device"]["verdicts"] == {"remote-hit": len(CASES)}
    # the whole previous turn (60 + 21 tokens) less nothing local: what the tier serves
    served = result.places["host"]["tokens_served_by_host"]
    assert served == (len(CASES) - evicted) * 81
    assert np.isclose(result.bytes_per_token, 65536 / 16)


def test_cli_text_and_json(host_store):
    runner = CliRunner()
    data = json.loads(runner.invoke(main, ["whatif", "-s", host_store, "--placement",
                                           "--json"]).output)
    assert data["min_cached_token_delta"] == MIN_CACHED_TOKEN_DELTA.default
    assert set(data["places"]) == {"device", "host", "both"}
    text = runner.invoke(main, ["whatif", "-s", host_store, "--placement"],
                         terminal_width=200).output
    assert "keep on host" in text and "host byte-s held" in text
    missing = runner.invoke(main, ["whatif", "-s", host_store, "--ttl", "30"])
    assert missing.exit_code == 2 and "--threshold" in missing.output


@pytest.mark.parametrize("fixture", ["device_turns", "host_store"])
def test_placement_and_tuning_do_not_depend_on_row_order(fixture, request):
    """A turn table in a scan's order (ClickHouse's turn view) gives the same placement,
    what-if and TTL replay as one sorted by conversation and turn: next turns are found
    by key, not as the row below."""
    from kvobs.fleet import tune, whatif

    value = request.getfixturevalue(fixture)
    turns = value if fixture == "device_turns" else label_turns(
        fleet_turns(open_source(value)))[0]
    shuffled = turns.sample(frac=1, random_state=3).reset_index(drop=True)
    assert not shuffled["turn"].equals(turns["turn"])  # the order did change
    for place in ("device", "host", "both"):
        assert same_figures(placement(shuffled, ttl_s=TTL_S).places[place],
                      placement(turns, ttl_s=TTL_S).places[place]), place
    assert same_figures(whatif(shuffled, TTL_S / 2, None).to_dict(),
                  whatif(turns, TTL_S / 2, None).to_dict())
    assert same_figures(tune(shuffled).to_dict(), tune(turns).to_dict())
