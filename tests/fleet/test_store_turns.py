"""The store's per-turn files give the same turn table as its spans, also when a
conversation (or one turn) is split across compactions and live segments."""

import os
import shutil

from fleet_cases import TENANTS, assert_same_turns
from spanfactory import SECOND, Tracers, TurnSpec, write_conversation

from kvobs import semconv as sc
from kvobs.turns.correlate import turns_from_spans
from kvobs.emit.spans import Correlation, emit
from kvobs.fleet import build_report, fleet_turns
from kvobs.sources import open_source
from kvobs.sources.store import TURNS_DIR, compact, span_files, turns_path

T0 = 1_700_000_000.0


def _release_later(tracers: Tracers, cid: str, turn: int, at_s: float, tenant="tenant0"):
    """D's release of an earlier turn, emitted (and so compacted) after the turn."""
    at = int(at_s * SECOND)
    emit(tracers[sc.Service.DECODE], sc.SPAN_RELEASE, Correlation(cid, turn, tenant),
         {sc.RELEASE_REASON.key: "expired"}, at, at + 1000)
    tracers.flush()


def _split_store(path: str) -> str:
    tracers = Tracers(path)
    write_conversation(tracers, "a", [TurnSpec(), TurnSpec(read="done")], T0)
    write_conversation(tracers, "a", TENANTS["tenant1"], T0 + 1, "tenant1")
    write_conversation(tracers, "whole", [TurnSpec(), TurnSpec(read="done")], T0)
    write_conversation(tracers, "split", [TurnSpec(), TurnSpec(read="done")], T0 + 2)
    compact(path, writers_stopped=True)
    # Releases of turns compacted before: in the second compaction, or still live.
    _release_later(tracers, "a", 2, T0 + 60)
    _release_later(tracers, "split", 2, T0 + 61)
    write_conversation(tracers, "b", [TurnSpec(), TurnSpec(decision="no-params")], T0 + 5)
    compact(path, writers_stopped=True)
    # Still live: conversation a's turn 1 release, and a conversation never compacted.
    _release_later(tracers, "a", 1, T0 + 90)
    write_conversation(tracers, "live-only", [TurnSpec(), TurnSpec(read="done")], T0 + 7)
    return path


def _assert_equals_spans(path: str):
    source = open_source(path)
    turns = fleet_turns(source)
    assert_same_turns(turns, turns_from_spans(source.spans()))
    return turns


def test_split_and_live_conversations_equal_the_span_table(tmp_path):
    path = _split_store(str(tmp_path))
    assert len(span_files(path)) > 2 and os.listdir(os.path.join(path, sc.STORE_LIVE_DIR))
    turns = _assert_equals_spans(path)
    for cid, released in (("a", [True, True]), ("split", [False, True])):
        rows = turns[(turns["conversation_id"] == cid) & (turns["tenant"] == "tenant0")]
        assert rows["release_reason"].notna().tolist() == released, cid
    assert set(turns["conversation_id"]) == {"a", "b", "whole", "split", "live-only"}


def test_report_from_turn_files_equals_report_from_spans(tmp_path):
    from kvobs.turns.correlate import turn_rows, turn_table

    path = _split_store(str(tmp_path))
    source = open_source(path)
    from_spans = turn_table(turn_rows(source.spans()))
    assert (build_report(fleet_turns(source))[0].to_dict()
            == build_report(from_spans)[0].to_dict())


def test_store_without_turn_files_reads_spans_and_compact_writes_them(tmp_path):
    path = _split_store(str(tmp_path))
    compact(path, writers_stopped=True)
    shutil.rmtree(os.path.join(path, TURNS_DIR))
    _assert_equals_spans(path)  # every span file read as spans
    compact(path, writers_stopped=True)
    assert all(os.path.exists(turns_path(path, f)) for f in span_files(path))
    _assert_equals_spans(path)
