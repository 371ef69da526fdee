"""Turns of two conversations in one client trace (the proxy continues it, #27), compacted
into the embedded store: compaction writes into each span without keys those of its
nearest tagged ancestor, and a conversation from its trace only when the trace holds one,
as ``correlate`` reads them. So each conversation is stored with only its own spans, the
spans of no known conversation (the proxy's server spans, the orphans) are stored under
none, and diagnose and the turn pipeline on the compacted store equal those on the raw
spans."""

from __future__ import annotations

import glob
import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from shared_trace import CONVERSATIONS, expected, observed, shared_trace

from kvobs import semconv as sc
from kvobs.diagnose import diagnose
from kvobs.emit.otlp_json import spans_to_otlp_json
from kvobs.sources import open_source
from kvobs.sources.store import NO_CONVERSATION, StoreSource, bucket_of, compact
from kvobs.turns.correlate import turns_from_spans

_CID = sc.CONVERSATION_ID.key


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """The shared trace's spans as one span file (raw) and as a store compacted from
    the same file; the spans, each conversation's span ids, and compaction's problems."""
    spans, owned = shared_trace()
    root = tmp_path_factory.mktemp("shared")
    raw = root / "spans.otlp.jsonl"
    raw.write_text(spans_to_otlp_json(spans) + "\n")
    store = root / "store"
    (store / sc.STORE_LIVE_DIR).mkdir(parents=True)
    (store / sc.STORE_LIVE_DIR / "spans.otlp.jsonl").write_text(raw.read_text())
    moved, problems = compact(str(store), writers_stopped=True)
    assert moved == len(spans)
    assert os.listdir(store / sc.STORE_LIVE_DIR) == []  # every span compacted
    return spans, owned, problems, str(raw), str(store)


def _stored(store: str, bucket: str = "*") -> pa.Table:
    files = glob.glob(os.path.join(store, sc.STORE_COMPACTED_DIR, bucket, "*.parquet"))
    return pa.concat_tables([pq.read_table(path) for path in files])


def test_each_conversation_is_stored_with_only_its_own_spans(stores):
    spans, owned, problems, _, store = stores
    stored = _stored(store)
    assert stored.num_rows == len(spans)  # none lost
    rows = list(zip(stored.column("span_id").to_pylist(), stored.column(_CID).to_pylist()))
    for cid in CONVERSATIONS:
        assert {span for span, stored_cid in rows if stored_cid == cid} == owned[cid]
    # The proxy's server spans (parents of the turn spans) and the two orphans (parent:
    # the client's span, not recorded): no tagged ancestor in a trace of two
    # conversations, so stored under none, in the bucket no conversation's read touches.
    nobody = {span for span, stored_cid in rows if stored_cid is None}
    assert len(nobody) == 6 and not nobody & set.union(*owned.values())
    none_bucket = _stored(store, NO_CONVERSATION)
    assert set(none_bucket.column("span_id").to_pylist()) == nobody
    assert none_bucket.column(_CID).null_count == none_bucket.num_rows
    names = none_bucket.column("name").to_pylist()
    assert sorted(names) == sorted(
        ["POST /v1/chat/completions"] * 4 + [sc.VLLM_REQUEST_SPAN, sc.SPAN_READ.name]
    )
    assert len(problems) == 1 and problems[0].startswith("6 span(s) without conversation id")
    # The orphans are read with the whole store, in no conversation.
    every = StoreSource(store).span_table()
    orphans = every.filter(pa.compute.is_in(every.column("span_id"), pa.array(sorted(nobody))))
    assert orphans.num_rows == 6 and orphans.column(_CID).null_count == 6


def test_turns_of_the_compacted_store_equal_those_of_the_raw_spans(stores):
    _, _, _, raw, store = stores
    assert observed(turns_from_spans(open_source(raw).span_table(), frame=False)) == expected()
    # Every span of the store, the turn pipeline's own correlation on top of compaction's.
    assert observed(turns_from_spans(StoreSource(store).span_table(), frame=False)) == expected()
    # Each conversation's spans alone, as diagnose reads them (one bucket, its own rows).
    for cid in CONVERSATIONS:
        table = StoreSource(store).span_table(cid)
        assert set(table.column(_CID).to_pylist()) == {cid}
        own = {key: values for key, values in expected().items() if key[0] == cid}
        assert observed(turns_from_spans(table, frame=False)) == own
    # The fleet's turn rows, from the turn files written at compaction.
    fleet = ("read_bytes",)  # the fleet's columns of those spans (not vLLM's)
    (rows,) = list(StoreSource(store).turn_row_slices())
    assert observed(rows, fleet) == expected(fleet)


def _canonical(diagnosis) -> list[str]:
    return [json.dumps(turn.to_dict(), sort_keys=True, default=str) for turn in diagnosis.turns]


@pytest.mark.parametrize("cid", CONVERSATIONS)
def test_diagnose_on_the_compacted_store_equals_diagnose_on_the_raw_spans(stores, cid):
    _, _, _, raw, store = stores
    on_raw = diagnose(open_source(raw), cid, None, 10000.0, "t0", 0.01)
    on_store = diagnose(open_source(store), cid, None, 10000.0, "t0", 0.01)
    assert [t.turn.index for t in on_store.turns] == [1, 2]
    assert _canonical(on_store) == _canonical(on_raw)


def test_rebuilt_turns_never_take_spans_of_no_conversation(stores, tmp_path):
    """A span file without turn file is rebuilt from its conversations' spans: the
    spans of no conversation stay out of that read, where their trace would seem to
    hold one conversation (alpha would take the orphan's read)."""
    _, _, _, _, compacted = stores
    store = tmp_path / "store"
    os.makedirs(store)
    for directory in (sc.STORE_COMPACTED_DIR, sc.STORE_TURNS_DIR):
        shutil.copytree(os.path.join(compacted, directory), store / directory)
    for bucket in (NO_CONVERSATION, f"bucket={bucket_of('alpha'):02d}"):
        for path in glob.glob(str(store / sc.STORE_TURNS_DIR / bucket / "*")):
            os.remove(path)
    fleet = ("read_bytes",)
    (rows,) = list(StoreSource(str(store)).turn_row_slices())
    assert observed(rows, fleet) == expected(fleet)
