"""``kvobs tune`` and ``kvobs whatif`` from classified turn rows against the span path on
the same spans: the same replay (``kvobs.fleet.replay``) and verdict decision, so the same
results (floats to summation order), on the synthetic fleet (rows backfilled from its
labelled table, replayed in several partitions), on the live classifier's rows of the
demo spans (the embedded store and ClickHouse on chdb), with a re-versioned turn."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from kvobs.cli import main
from kvobs.fleet import fleet_turns, label_turns, tune, whatif
from kvobs.fleet import turn_replay as trp
from kvobs.fleet.confidence import confidence
from kvobs.fleet.placement import placement
from kvobs.live.backfill import turn_rows_table, write_turn_rows
from kvobs.live.classifier import Classifier
from kvobs.live import turn_measures as tm
from kvobs.live.turnstore import TurnStore
from kvobs.sources import open_source

DEMO = Path(__file__).resolve().parents[1] / "data" / "demo-spans.otlp.jsonl"
WHATIFS = [(300.0, 64, None), (60.0, 0, None), (3600.0, 1024, 100.0), (None, None, None)]
NOW = 1_767_225_600.0


def _same(got, want, path="result"):
    """Equal, floats within 1e-9 (sums in another order)."""
    if isinstance(want, float) and isinstance(got, float):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), path
    elif isinstance(want, dict):
        assert set(got) == set(want), path
        for key in want:
            _same(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{path}[{i}]")
    else:
        assert got == want, path


def _compare(rows, labelled, rate=None):
    spans = tune(labelled, 0.95, rate)
    trust = confidence(labelled, spans)
    got, got_trust, _ = trp.tune_rows(rows)
    _same(got.to_dict(), spans.to_dict(), "tune")
    _same(got_trust.to_dict(), trust.to_dict(), "confidence")
    for ttl, threshold, lifetime in WHATIFS:
        want = whatif(labelled, ttl, threshold, lifetime, rate).to_dict()
        _same(trp.whatif_rows(rows, ttl, threshold, lifetime).to_dict(), want, f"whatif {ttl}")
    return spans, trust


@pytest.fixture(scope="module")
def synthetic_rows(synthetic_store, tmp_path_factory):
    labelled, rate = label_turns(fleet_turns(open_source(synthetic_store[0])))
    directory = str(tmp_path_factory.mktemp("replay-rows"))
    write_turn_rows(directory, turn_rows_table(labelled, rate))
    return TurnStore(directory, 0), labelled


@pytest.mark.parametrize("partition_rows", [trp.PARTITION_ROWS, 97])
def test_tune_and_whatif_from_turn_rows_equal_the_span_path(synthetic_rows, partition_rows,
                                                            monkeypatch):
    rows, labelled = synthetic_rows
    monkeypatch.setattr(trp, "PARTITION_ROWS", partition_rows)
    monkeypatch.setattr(trp, "BATCH_ROWS", 113)  # several batches a file
    spans, trust = _compare(rows, labelled)
    assert spans.read.reads > 100 and spans.recommended_ttl_s
    assert trust.bootstrap_reads == trust.bootstrap_of > 0  # under the reservoir: all reads
    if partition_rows < 1000:
        assert trp.read_fleet(rows).turns > 10 * partition_rows


def _demo_rows() -> list[dict]:
    classifier = Classifier(window_s=600, grace_s=0)
    for line in DEMO.read_text().split("\n"):
        if line.strip():
            classifier.add_request(json.loads(line), now=100.0)
    return classifier.run_pass(now=100.0).finalized


def _demo_labelled(finalized):
    rate = {row["context"]["prefill_tokens_per_s"] for row in finalized}
    assert len(rate) == 1
    rate = rate.pop()
    labelled, _ = label_turns(fleet_turns(open_source(str(DEMO))), rate)
    return labelled, rate


def test_the_live_classifiers_rows_replay_as_their_spans(tmp_path, chdb_path):
    """The classifier's own rows (its measures, packed as it stores them), in the store
    and in ClickHouse, give the span path's tune and whatif."""
    from kvobs.live.clickhouse_turns import ClickHouseTurns

    finalized = _demo_rows()
    labelled, rate = _demo_labelled(finalized)
    store = TurnStore(str(tmp_path), 0)
    store.write(finalized, now=NOW)
    _compare(store, labelled, rate)
    clickhouse = ClickHouseTurns.from_url(f"chdb:{chdb_path}?turn_table=turns_replay",
                                          retention_s=3650 * 86400.0)
    clickhouse.write(finalized, now=NOW)
    _compare(clickhouse, labelled, rate)


def test_a_later_version_replaces_a_turn_in_the_replay(tmp_path):
    finalized = _demo_rows()
    store = TurnStore(str(tmp_path), 0)
    store.write(finalized, now=NOW)
    before = trp.whatif_rows(store, 300.0, 64).actual
    later = next(row for row in finalized if row["turn"] > 1 and row["verdict"] != "expired")
    store.write([dict(later, version=2, verdict="expired")], now=NOW + 3600)  # next hour
    after = trp.whatif_rows(store, 300.0, 64).actual
    assert after["later_turns"] == before["later_turns"]
    assert after["verdicts"].get("expired", 0) == before["verdicts"].get("expired", 0) + 1
    assert after["verdicts"].get(later["verdict"], 0) == before["verdicts"][later["verdict"]] - 1


class _Tracked(pd.DataFrame):
    """A labelled table that notes every column read of it."""

    seen: set = set()

    @property
    def _constructor(self):
        return _Tracked

    def __getitem__(self, key):
        if isinstance(key, str):
            _Tracked.seen.add(key)
        elif isinstance(key, list):
            _Tracked.seen.update(k for k in key if isinstance(k, str))
        return super().__getitem__(key)

    def __contains__(self, key):
        _Tracked.seen.add(key)
        return super().__contains__(key)


def test_turn_rows_store_every_column_the_replay_and_the_verdicts_read(synthetic_rows):
    """What tune, whatif, their confidence and the verdict decision read of a labelled
    table is stored on each turn row (its own columns, or the packed measures); the
    prefill rate is the stored one, not measured again."""
    from kvobs.verdicts import Context, decide

    labelled = synthetic_rows[1]
    _Tracked.seen = set()
    tracked = _Tracked(labelled)
    rate = 8000.0
    confidence(tracked, tune(tracked, 0.95, rate))
    for ttl, threshold, lifetime in WHATIFS:
        whatif(tracked, ttl, threshold, lifetime, rate)
    decide(tracked, Context(rate))
    stored = set(trp.NEEDED) | {"tenant", "conversation_id", "turn", "verdict", "prompt_tokens"}
    assert _Tracked.seen - stored == set()


def test_placement_needs_the_spans(synthetic_rows):
    """--placement reads the host tier's copies, which turn rows do not store."""
    labelled = synthetic_rows[1]
    _Tracked.seen = set()
    placement(_Tracked(labelled), 256, None, None, None)
    stored = set(trp.NEEDED) | {"tenant", "conversation_id", "turn", "verdict", "prompt_tokens"}
    assert _Tracked.seen - stored  # hence PLACEMENT_UNAVAILABLE


def test_the_reservoir_keeps_a_bounded_uniform_sample():
    reservoir = trp._Reservoir(50, seed=1)
    for start in range(0, 10_000, 300):
        stop = min(start + 300, 10_000)
        reservoir.add(pd.DataFrame({"read_outcome": "done",
                                    "candidate_tokens": np.arange(start, stop, dtype=float),
                                    "read_duration_s": 0.001, "read_bytes": 1.0}))
        assert len(reservoir.reads) <= 50
    assert reservoir.seen == 10_000 and len(reservoir.reads) == 50
    assert reservoir.reads["candidate_tokens"].is_unique
    assert 2_000 < reservoir.reads["candidate_tokens"].mean() < 8_000  # spread over all


def test_the_confidence_says_when_it_bootstrapped_a_sample(synthetic_rows, monkeypatch):
    rows = synthetic_rows[0]
    monkeypatch.setattr(trp, "MAX_RESAMPLED_READS", 40)
    _, trust, fleet = trp.tune_rows(rows)
    assert (trust.bootstrap_reads, trust.bootstrap_of) == (40, fleet.reservoir.seen)
    assert fleet.reservoir.seen > 40
    assert trust.break_even_interval is not None


def test_the_cost_cut_from_a_sketch_past_the_exact_bound(synthetic_rows, monkeypatch):
    rows, labelled = synthetic_rows
    exact = trp.read_fleet(rows)
    monkeypatch.setattr(trp, "EXACT_CUT_READS", 10)
    sketched = trp.read_fleet(rows)
    assert exact.exact_cut and not sketched.exact_cut
    assert sketched.model.reads == exact.model.reads
    assert sketched.model.s_per_token == pytest.approx(exact.model.s_per_token, rel=0.2)


def test_an_older_shorter_record_reads_with_the_facts_it_lacks_null():
    import pyarrow as pa

    full = tm.pack({"read_bytes": 7, "lookup": "hit", "params_sent": True,
                    "turn_span_id": "ab", "gap_s": 1.5})
    older = full[: tm.MEASURE_DTYPE.itemsize - 8 * len(tm.REPLAY_FACTS)]
    out = tm.unpack(pa.array([full, older, None], pa.binary()))
    assert out["read_bytes"].tolist()[:2] == [7.0, 7.0] and math.isnan(out["read_bytes"][2])
    assert out["lookup"].tolist() == ["hit", None, None]
    assert out["params_sent"].tolist() == [True, None, None]
    assert out["turn_span_id"][0] == 1.0 and np.isnan(out["turn_span_id"][1:]).all()
    assert out["gap_s"][0] == 1.5 and np.isnan(out["gap_s"][1:]).all()


def test_kvobs_tune_and_whatif_read_a_turn_store_as_turn_rows(tmp_path):
    finalized = _demo_rows()
    labelled, rate = _demo_labelled(finalized)
    TurnStore(str(tmp_path), 0).write(finalized, now=NOW)
    source = ["--source", str(tmp_path)]
    result = CliRunner().invoke(main, ["tune", *source, "--json"])
    assert result.exit_code == 0, result.output
    _same(json.loads(result.output)["recommended_ttl_s"], tune(labelled, 0.95, rate)
          .recommended_ttl_s)
    result = CliRunner().invoke(main, ["whatif", *source, "--ttl", "60", "--threshold", "0",
                                       "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["changed_turns"] == whatif(labelled, 60.0, 0, None,
                                                                rate).changed_turns
    for refused in (["whatif", *source, "--placement"], ["tune", *source, "--prefill-rate", "9"],
                    ["whatif", *source, "--ttl", "60", "--threshold", "0",
                     "--prefill-rate", "9"]):
        out = CliRunner().invoke(main, refused)
        assert out.exit_code == 2, (refused, out.output)
    assert "host tier" in CliRunner().invoke(main, ["whatif", *source, "--placement"]).output


def test_tiny_partitions_written_over_several_passes_replay_as_one_partition(
        synthetic_rows, monkeypatch, tmp_path):
    """Partitions of a few turns, their files written a few at a time (several passes):
    the tallies of one partition, no read larger than a partition, no more partition
    files at once than ``SPILL_FILES``, none left after."""
    import tempfile

    rows = synthetic_rows[0]
    one = trp.whatif_rows(rows, *WHATIFS[0]).to_dict()
    monkeypatch.setattr(trp, "PARTITION_ROWS", 20)
    monkeypatch.setattr(trp, "SPILL_FILES", 24)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    read_sizes = []
    stored_batches = rows.batches

    def batches(columns, batch_rows, *args, **kwargs):
        for batch in stored_batches(columns, batch_rows, *args, **kwargs):
            read_sizes.append(max(batch_rows, batch.num_rows))
            yield batch

    monkeypatch.setattr(rows, "batches", batches)
    fleet = trp.read_fleet(rows)
    assert fleet.turns > 20 * 24 * 2  # partitions over three passes
    seen, held = set(), 0
    for part in fleet.partitions():
        keys = set(zip(part["tenant"].fillna(""), part["conversation_id"]))
        assert not keys & seen  # a conversation in one partition only
        seen |= keys
        held += len(part)
        (spill,) = os.listdir(tmp_path)
        assert len(os.listdir(tmp_path / spill)) <= 24
    assert held == fleet.turns and os.listdir(tmp_path) == []
    assert read_sizes and max(read_sizes) <= 20
    _same(trp.whatif_rows(rows, *WHATIFS[0]).to_dict(), one)
