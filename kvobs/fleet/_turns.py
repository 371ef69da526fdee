"""Fleet-scale turn table: the same rows and columns as ``kvobs.correlate`` for the
columns fleet analysis needs, built column-wise (Arrow + numpy) instead of per span name
with pandas groupbys, so millions of spans fit in seconds.

Three steps, shared by every source: ``aggregate`` (spans -> one Arrow row per turn,
before the previous-turn shifts), ``to_frame`` (Arrow turn rows -> the pandas table the
rules read; also used for ClickHouse's SQL result and the store's per-turn files) and
``derive`` (gap and previous-turn facts, never across conversations).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from kvobs import lineage, semconv as sc
from kvobs._correlate_pandas import KEYS, PREVIOUS_PREFIX, TURN_FIELDS, UNKNOWN_TENANT

# Turn columns the fleet uses: name -> (span, source column), a subset of correlate's
# TURN_FIELDS plus two of its own (when D's export ended, how long D held the blocks).
FLEET_FIELDS: dict[str, tuple[sc.SpanName, str]] = {
    column: TURN_FIELDS[column] for column in (
        "turn_start_ns", "turn_end_ns", "proxy_ttft_s", "prefill_leg_s", "lookup",
        "params_sent", "fallback_reason", "prompt_tokens", "local_hit_tokens",
        "remote_tokens", "candidate_tokens", "threshold", "decision", "read_outcome",
        "read_bytes", "read_blocks", "read_duration_s", "stuck_span_id", "export_tokens",
        "export_blocks", "ttl_s", "release_reason", "release_end_ns", "release_read_count",
        # timeline marks (kvobs/timeline.py MARKS) and what decides whether they apply
        "p_sent_at", "p_retry_sent_at", "p_answered_at", "d_sent_at", "d_first_output_at",
        "d_answered_at", "read_span_id", "read_start_ns", "read_setup_s",
        "p_arrived_at", "p_scheduled_at", "p_allocated_at", "p_kv_ready_at",
        "p_first_token_at", "d_request_span_id", "d_arrived_at", "d_scheduled_at",
        "d_kv_ready_at", "d_first_token_at", "output_tokens", "handoff_span_id",
        "handoff_start_ns", "handoff_bytes", "handoff_duration_s", "handoff_setup_s")}
FLEET_FIELDS["recomputed_tokens"] = TURN_FIELDS["recomputed_tokens"]  # summed per turn
FLEET_FIELDS["export_end_ns"] = (sc.SPAN_EXPORT, "end_ns")
FLEET_FIELDS["held_s"] = (sc.SPAN_RELEASE, sc.HELD_DURATION.key)
FLEET_FIELDS["entry_age_s"] = TURN_FIELDS["entry_age_s"]
# The export a prompt extends (kvobs.lineage): what the rules need behind another router.
LINEAGE_FIELDS = ("extends_request_id", "extends_fully", "extends_live",
                  "extends_ttl_left_s", "extends_engine_restarted_at")
FLEET_FIELDS.update({column: TURN_FIELDS[column] for column in LINEAGE_FIELDS})
# Facts of turn k's KV that turn k+1's verdict reads (correlate.PREVIOUS_TURN_FIELDS).
FLEET_PREVIOUS = ("release_reason", "release_end_ns", "ttl_s", "export_tokens")
SUMMED = {"recomputed_tokens"}
# The span's presence is the fact: "yes" or null.
PRESENCE = {"stuck_span_id", "read_span_id", "handoff_span_id", "d_request_span_id"}
STRING_COLUMNS = {"lookup", "fallback_reason", "decision", "read_outcome", "release_reason",
                  "extends_request_id", *PRESENCE}
_TENANT, _CID, _TURN = sc.TENANT_DIGEST.key, sc.CONVERSATION_ID.key, sc.TURN_INDEX.key
KEY_SOURCES = {"tenant": _TENANT, "conversation_id": _CID, "turn": _TURN}
_SPAN_TYPES = {"start_ns": "int", "end_ns": "int", "error": "bool"}


def column_type(column: str) -> str:
    """The semconv type ("int", "float", "bool", "str") of a fleet turn column."""
    if column in STRING_COLUMNS or column in ("tenant", "conversation_id"):
        return "str"
    if column == "turn":
        return "int"
    source = FLEET_FIELDS[column][1]
    return _SPAN_TYPES.get(source) or sc.ATTRIBUTES[source].type


def span_columns() -> list[str]:
    """Span-table columns a fleet turn table needs."""
    needed = {"name", "start_ns", *KEY_SOURCES.values()}
    needed.update(source for column, (_, source) in FLEET_FIELDS.items()
                  if column not in PRESENCE)
    return sorted(needed)


def needs_traces(table: pa.Table) -> bool:
    """Whether some span must take a key from its trace (correlate's ``_keyed``): it
    lacks conversation or turn, or lacks a tenant that other spans carry."""
    tenant = table.column(_TENANT).null_count
    return bool(table.column(_CID).null_count or table.column(_TURN).null_count
                or 0 < tenant < table.num_rows)


def _plain(table: pa.Table) -> pa.Table:
    return table.cast(pa.schema([pa.field(f.name, f.type.value_type)
                                 if pa.types.is_dictionary(f.type) else f
                                 for f in table.schema]))


def _inherit_keys(table: pa.Table) -> pa.Table:
    """Each key a span lacks comes from the first span of its trace that has it."""
    if "trace_id" not in table.column_names or not needs_traces(table):
        return table
    table = _plain(table)
    for key in KEY_SOURCES.values():
        column = table.column(key)
        if column.null_count in (0, table.num_rows):
            continue
        by_trace = table.filter(pc.is_valid(column)).select(["trace_id", key]).group_by(
            "trace_id", use_threads=False).aggregate([(key, "first")])
        index = pc.index_in(table.column("trace_id"), value_set=by_trace.column("trace_id"))
        inherited = by_trace.column(f"{key}_first").take(index)
        table = table.set_column(table.column_names.index(key), key,
                                 pc.coalesce(column, inherited))
    return table


def _dictionary(column: pa.ChunkedArray) -> pa.DictionaryArray:
    """One dictionary array; no re-hashing when every chunk already shares a dictionary
    (``unify_dictionaries`` after a parquet read)."""
    if pa.types.is_dictionary(column.type) and column.num_chunks:
        first = column.chunk(0).dictionary
        if all(_same_buffer(chunk.dictionary, first) for chunk in column.chunks):
            indices = pa.concat_arrays([chunk.indices for chunk in column.chunks])
            return pa.DictionaryArray.from_arrays(indices, first)
        column = column.cast(column.type.value_type)
    if not len(column):
        return pa.DictionaryArray.from_arrays(pa.array([], pa.int32()), pa.array([], pa.string()))
    return column.combine_chunks().dictionary_encode()


def _same_buffer(a: pa.Array, b: pa.Array) -> bool:
    if a is b:
        return True
    x, y = a.buffers()[-1], b.buffers()[-1]
    return x is not None and y is not None and x.address == y.address and len(a) == len(b)


def _ranked(column: pa.ChunkedArray, null_as: str | None = None
            ) -> tuple[np.ndarray, np.ndarray]:
    """Per-row codes in sorted string order, and the sorted distinct strings. Works on
    dictionary codes: the common one-tenant column never becomes 10M strings."""
    encoded = _dictionary(column)
    dictionary = encoded.dictionary.cast(pa.string())
    indices = encoded.indices
    if null_as is not None and indices.null_count:
        indices = pc.fill_null(indices, len(dictionary))
        dictionary = pa.concat_arrays([dictionary, pa.array([null_as], pa.string())])
    # Dense ranks: equal strings (an unmerged dictionary) share one code.
    rank = pc.rank(dictionary, sort_keys="ascending", tiebreaker="dense").to_numpy() - 1
    categories = np.empty(int(rank.max()) + 1 if len(rank) else 0, dtype=object)
    categories[rank] = dictionary.to_numpy(zero_copy_only=False)
    return rank.astype(np.int64)[indices.to_numpy(zero_copy_only=False)], categories


def _firsts(sorted_keys: np.ndarray) -> np.ndarray:
    return np.concatenate([[True], sorted_keys[1:] != sorted_keys[:-1]])[:len(sorted_keys)]


def _turn_order(keys: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Rows sorted by (turn key, start): a stable sort by key is enough unless spans of
    one turn were stored out of start order (then the two-key sort)."""
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    same = sorted_keys[1:] == sorted_keys[:-1]
    if same.any():
        starts = start[order]
        if (starts[1:][same] < starts[:-1][same]).any():
            order = np.lexsort((start, keys))
    return order


def aggregate(table: pa.Table) -> pa.Table:
    """Spans (Arrow, ``span_columns()`` at least; ``trace_id`` when ``needs_traces``) to
    one row per (tenant, conversation_id, turn), sorted by those keys, before
    ``derive``. Each column is the first non-null value of its span by start time
    (pandas' ``groupby.first()``), or the sum for ``SUMMED``."""
    table = _inherit_keys(table)
    if table.column(_CID).null_count or table.column(_TURN).null_count:
        table = table.filter(pc.and_(pc.is_valid(table.column(_CID)),
                                     pc.is_valid(table.column(_TURN))))
    tenant_codes, tenants = _ranked(table.column(_TENANT), UNKNOWN_TENANT)
    cid_codes, cids = _ranked(table.column(_CID))
    conversation = tenant_codes * max(len(cids), 1) + cid_codes
    turn = pc.cast(table.column(_TURN), pa.int64()).to_numpy(zero_copy_only=False)
    # key = conversation << bits | (turn - lowest): as many bits as the turns need, so a
    # stray turn index can never spill into the next conversation's keys.
    lowest = int(turn.min()) if len(turn) else 0
    bits = max(int(turn.max() - lowest).bit_length(), 1) if len(turn) else 1
    key = (conversation << bits) | (turn - lowest)
    start = pc.fill_null(table.column("start_ns"), 0).to_numpy(zero_copy_only=False)
    names = _dictionary(table.column("name"))
    name_codes = names.indices.to_numpy(zero_copy_only=False)
    name_index = {name: i for i, name in enumerate(names.dictionary.to_pylist())}

    # Per span name: its rows in turn order, each row's turn (group) and the turn keys.
    by_name: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for span_name in {span.name for span, _ in FLEET_FIELDS.values()}:
        if span_name not in name_index:
            continue
        rows = np.flatnonzero(name_codes == name_index[span_name])
        rows = rows[_turn_order(key[rows], start[rows])]
        firsts = _firsts(key[rows])
        by_name[span_name] = rows, np.cumsum(firsts) - 1, key[rows][firsts]
    every = np.concatenate([keys for _, _, keys in by_name.values()] or [np.zeros(0, np.int64)])
    turn_keys = np.sort(every, kind="stable")  # sorted runs: a merge
    turn_keys = turn_keys[_firsts(turn_keys)]
    n = len(turn_keys)
    combined: dict[str, pa.Array] = {}

    def source_column(source: str) -> pa.Array:
        # One chunk per column makes the takes fast; only the columns used are copied.
        if source not in combined:
            combined[source] = table.column(source).combine_chunks()
        return combined[source]

    conversation_of = turn_keys >> bits
    columns: dict[str, pa.Array] = {
        "tenant": pa.DictionaryArray.from_arrays(
            pa.array(conversation_of // max(len(cids), 1), pa.int32()),
            pa.array(tenants, pa.string())),
        "conversation_id": pa.DictionaryArray.from_arrays(
            pa.array(conversation_of % max(len(cids), 1), pa.int32()),
            pa.array(cids, pa.string())),
        "turn": pa.array((turn_keys & ((1 << bits) - 1)) + lowest, pa.int64())}
    for column, (span, source) in FLEET_FIELDS.items():
        arrow_type = _ARROW[column_type(column)]
        if span.name not in by_name:
            columns[column] = pa.nulls(n, arrow_type)
            continue
        rows, group, keys = by_name[span.name]
        position = np.searchsorted(turn_keys, keys)
        if column in PRESENCE:
            present = np.zeros(n, bool)
            present[position] = True
            columns[column] = pa.array(np.where(present, "yes", None), pa.string())
            continue
        values = source_column(source).take(pa.array(rows))
        if column in SUMMED:
            columns[column] = _summed(values, group, position, n)
            continue
        valid = np.flatnonzero(values.is_valid().to_numpy(zero_copy_only=False))
        first = valid[_firsts(group[valid])]
        take = np.full(n, -1, np.int64)
        take[position[group[first]]] = first
        columns[column] = values.take(pa.array(take, mask=take < 0)).cast(arrow_type)
    return pa.table(columns)


_ARROW = {"int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(), "str": pa.string()}


def _summed(values: pa.ChunkedArray, group: np.ndarray, position: np.ndarray,
            n: int) -> pa.Array:
    """Sum per turn, null when no span of the turn has a value (``min_count=1``)."""
    numbers = pc.fill_null(pc.cast(values, pa.int64()), 0).to_numpy(zero_copy_only=False)
    valid = values.is_valid().to_numpy(zero_copy_only=False)
    total = np.zeros(n, np.int64)
    counted = np.zeros(n, np.int64)
    np.add.at(total, position[group], numbers)
    np.add.at(counted, position[group], valid)
    return pa.array(total, mask=counted == 0)


def to_frame(table: pa.Table) -> pd.DataFrame:
    """Arrow turn rows (``aggregate``, ClickHouse, the store's turn files) to the pandas
    turn table, typed by semconv: strings categorical, integers nullable ``Int64``.
    Columns this version does not know (turn files written by another kvobs version) are
    left out; columns they lack read as missing downstream."""
    known = set(FLEET_FIELDS) | set(KEYS)
    table = table.select([name for name in table.column_names if name in known])
    columns = []
    for name in table.column_names:
        values = table.column(name)
        kind = column_type(name)
        if kind == "str":
            if not pa.types.is_dictionary(values.type):
                values = values.dictionary_encode()
        else:
            values = pc.cast(values, _ARROW[kind])
        columns.append(values)
    frame = pa.table(columns, names=table.column_names).to_pandas(
        types_mapper=_PANDAS.get, split_blocks=True)
    frame["turn"] = frame["turn"].astype(np.int64)
    return frame


_PANDAS = {pa.int64(): pd.Int64Dtype(), pa.bool_(): pd.BooleanDtype()}


def _codes(values: pd.Series) -> np.ndarray:
    if isinstance(values.dtype, pd.CategoricalDtype):
        return values.cat.codes.to_numpy(np.int64)
    return pd.factorize(values)[0]


def follows(turns: pd.DataFrame) -> np.ndarray:
    """Per row: whether it is the next turn of the row before, in the same (tenant,
    conversation). Rows must be grouped by those keys and sorted by turn."""
    consecutive = np.zeros(len(turns), bool)
    if len(turns) > 1:
        same = np.ones(len(turns) - 1, bool)
        for key in KEYS[:-1]:
            codes = _codes(turns[key])
            same &= codes[1:] == codes[:-1]
        turn = turns["turn"].to_numpy(np.int64)
        consecutive[1:] = same & (turn[1:] == turn[:-1] + 1)
    return consecutive


def derive(turns: pd.DataFrame) -> pd.DataFrame:
    """Gap and previous-turn facts. Rows must be grouped by (tenant, conversation), by
    turn; a shift never crosses a conversation, so never a tenant."""
    consecutive = follows(turns)
    previous = np.concatenate([[0], np.arange(len(turns) - 1)])[:len(turns)]

    def shifted(column):
        out = turns[column].iloc[previous].reset_index(drop=True)
        return out.where(consecutive)

    turns["gap_s"] = ((turns["turn_start_ns"] - shifted("turn_end_ns")) / 1e9).where(
        consecutive)
    for column in FLEET_PREVIOUS:
        turns[PREVIOUS_PREFIX + column] = shifted(column)
    return turns


def turns_from_table(table: pa.Table) -> pd.DataFrame:
    """Spans (Arrow) to the fleet turn table."""
    return derive(to_frame(aggregate(table)))


def fleet_turns(source) -> pd.DataFrame:
    """The fleet turn table of any source (store and ClickHouse take fast paths)."""
    from kvobs.sources.store import StoreSource

    if hasattr(source, "fleet_turns"):
        return source.fleet_turns()
    if isinstance(source, StoreSource):
        from kvobs.fleet._store_turns import store_turns

        return derive(to_frame(store_turns(source)))
    frame = source.spans()
    if lineage.needed(frame):  # id-less turns: conversations from the prefix chains
        frame = lineage.link(frame)
    return turns_from_table(pa.Table.from_pandas(frame[span_columns() + ["trace_id"]],
                                                 preserve_index=False))
