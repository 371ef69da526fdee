"""The fleet turn table (column-wise, for scale) labels every turn as kvobs diagnose does,
keyed by (tenant, conversation, turn)."""

from fleet_cases import SHARED_ID, TENANTS

from kvobs.diagnose import all_turns
from kvobs.fleet import classify_frame, fleet_turns
from kvobs.sources import open_source
from kvobs.timeline import add_timeline


def compare_verdicts(source, reference_source=None):
    """Fleet verdicts of ``source`` equal diagnose's (of ``reference_source``)."""
    reference = {(d.tenant, d.conversation_id, d.turn.index): d.finding.verdict.value
                 for d in all_turns(reference_source or source)}
    turns, _, rate = add_timeline(fleet_turns(source))
    verdicts = classify_frame(turns, rate)
    fleet = {(str(tenant), str(c), int(t)): v for tenant, c, t, v in
             zip(turns["tenant"], turns["conversation_id"], turns["turn"], verdicts)}
    assert fleet == reference
    return turns


def test_parity_on_factory_spans(factory_store):
    turns = compare_verdicts(open_source(factory_store))
    shared = turns[turns["conversation_id"] == SHARED_ID]
    assert {t: len(shared[shared["tenant"] == t]) for t in TENANTS} == {
        t: len(specs) for t, specs in TENANTS.items()}


def test_parity_on_synthetic_store(synthetic_store):
    turns = compare_verdicts(open_source(synthetic_store[0]))
    assert turns["tenant"].nunique() > 1


def test_turn_indices_of_any_size_stay_in_their_conversation():
    import pyarrow as pa

    from kvobs import semconv as sc
    from kvobs.turns.correlate import aggregate, span_columns
    from kvobs.sources.store import store_schema

    turns = [("a", 1), ("a", 2_000_000), ("b", -3), ("b", 5)]
    rows = [{"name": sc.SPAN_PROXY_TURN.name, "start_ns": 1, sc.CONVERSATION_ID.key: cid,
             sc.TURN_INDEX.key: turn} for cid, turn in turns]
    schema = pa.schema([store_schema().field(c) for c in span_columns()])
    table = aggregate(pa.Table.from_pylist(rows, schema=schema))
    assert list(zip(table.column("conversation_id").to_pylist(),
                    table.column("turn").to_pylist())) == turns
    assert set(table.column("tenant").to_pylist()) == {""}
