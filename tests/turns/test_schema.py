"""The turn table's schema (kvobs.turns.schema) is consistent with semconv and the docs."""

from kvobs import semconv as sc
from kvobs.turns import schema as tc
from kvobs.catalogue import turns_md
from kvobs.diagnose import SUMMARY_COLUMNS


def test_every_span_column_reads_a_known_span_and_attribute():
    for column in tc.SPAN_COLUMNS.values():
        assert column.span is not None, column.name
        if column.source in tc.SPAN_FIELDS:
            continue
        attribute = sc.ATTRIBUTES[column.source]
        if column.agg is not tc.Agg.COUNT:
            assert column.type == attribute.type, column.name


def test_fleet_columns_aggregate_like_the_full_table_or_keep_presence():
    for name, fleet in tc.FLEET_COLUMNS.items():
        full = tc.COLUMNS[name]
        assert fleet.agg is full.agg or (fleet.agg is tc.Agg.PRESENCE
                                         and full.source == "span_id"), name


def test_previous_columns_are_derived_from_carried_columns():
    carried = {c.name for c in tc.SPAN_COLUMNS.values() if c.carries}
    assert {n[len(tc.PREVIOUS_PREFIX):] for n in tc.PREVIOUS} == carried
    assert set(tc.DERIVED) == {tc.GAP.name, *tc.RETENTION, *tc.SERVED, *tc.PREVIOUS}


def test_public_columns_are_what_diagnose_shows_and_what_the_docs_list():
    text = turns_md()
    for name in tc.PUBLIC:
        assert f"| `{name}` |" in text
        assert name in SUMMARY_COLUMNS or name in tc.KEYS
    names = set(tc.ALL_COLUMNS)
    assert {c for c in SUMMARY_COLUMNS if c in names} == set(tc.PUBLIC) - set(tc.KEYS)


def test_served_by_names_the_path_that_served_each_token():
    """One rule (kvobs.turns.correlate.with_served_by): P's finished read is the device path,
    the host lookup's accepted tokens the host path; both in one turn say so."""
    import pyarrow as pa

    from kvobs.turns.correlate import with_served_by

    rows = pa.table({
        "decision": ["pull", "pull", "no-params", "pull", None, None],
        "read_outcome": ["done", "done", None, "declined-expired", None, None],
        "candidate_tokens": [899, 640, 0, 512, None, None],
        "host_accepted_tokens": pa.array([0, 256, 1152, 0, 384, None], pa.int64()),
    })
    out = with_served_by(rows)
    assert out.column("served_by").to_pylist() == [
        "device", "device+host", "host", "none", "host", None]
    assert out.column("served_device_tokens").to_pylist() == [899, 640, 0, 0, None, None]
    assert out.column("served_host_tokens").to_pylist() == [0, 256, 1152, 0, 384, None]
    assert {v.value for v in sc.ServedBy} >= set(
        v for v in out.column("served_by").to_pylist() if v)
