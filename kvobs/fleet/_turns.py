"""Fleet-scale turn table: the same rows and columns as ``kvobs.correlate`` for the
columns fleet analysis needs, built column-wise (Arrow + numpy) instead of per span name
with pandas groupbys, so millions of spans fit in seconds.

Sources: the embedded store (parquet, projected columns only), any other ``SpanSource``
(through its pandas span table), and ClickHouse (``kvobs.sources.clickhouse``, which
builds the same table in SQL).
"""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from kvobs import semconv as sc
from kvobs.correlate import PREVIOUS_PREFIX, TURN_FIELDS

# Turn columns the fleet uses: name -> (span, source column), a subset of correlate's
# TURN_FIELDS plus two of its own (when D's export ended, how long D held the blocks).
FLEET_FIELDS: dict[str, tuple[sc.SpanName, str]] = {
    column: TURN_FIELDS[column] for column in (
        "turn_start_ns", "turn_end_ns", "ttft_s", "prefill_leg_s", "lookup", "params_sent",
        "fallback_reason", "prompt_tokens", "local_hit_tokens", "remote_tokens",
        "candidate_tokens", "threshold", "decision", "read_outcome", "read_bytes",
        "read_blocks", "read_duration_s", "stuck_span_id", "export_tokens", "export_blocks",
        "ttl_s", "release_reason", "release_end_ns", "release_read_count")}
FLEET_FIELDS["recomputed_tokens"] = TURN_FIELDS["recomputed_tokens"]  # summed per turn
FLEET_FIELDS["export_end_ns"] = (sc.SPAN_EXPORT, "end_ns")
FLEET_FIELDS["held_s"] = (sc.SPAN_RELEASE, sc.HELD_DURATION.key)
FLEET_FIELDS["entry_age_s"] = TURN_FIELDS["entry_age_s"]
# Facts of turn k's KV that turn k+1's verdict reads (correlate.PREVIOUS_TURN_FIELDS).
FLEET_PREVIOUS = ("release_reason", "release_end_ns", "ttl_s", "export_tokens")
SUMMED = {"recomputed_tokens"}
STRING_COLUMNS = {"lookup", "fallback_reason", "decision", "read_outcome", "release_reason",
                  "stuck_span_id"}
_CID, _TURN = sc.CONVERSATION_ID.key, sc.TURN_INDEX.key
_TURN_BITS = 20  # key = conversation code << 20 | turn


def span_columns() -> list[str]:
    """Span-table columns a fleet turn table needs."""
    needed = {"name", "start_ns", _CID, _TURN}
    needed.update(source for column, (_, source) in FLEET_FIELDS.items()
                  if column != "stuck_span_id")
    return sorted(needed)


def _numpy(array: pa.ChunkedArray | pa.Array) -> np.ndarray:
    if pa.types.is_boolean(array.type):
        return np.asarray(array.to_pandas(types_mapper=pd.ArrowDtype).astype("boolean"))
    if pa.types.is_integer(array.type):
        array = pc.cast(array, pa.int64())
        if array.null_count == 0:
            return array.to_numpy(zero_copy_only=False)
        mask = array.is_null().to_numpy(zero_copy_only=False)
        values = pc.fill_null(array, 0).to_numpy(zero_copy_only=False)
        return pd.arrays.IntegerArray(values, mask)
    if pa.types.is_floating(array.type):
        return pc.cast(array, pa.float64()).to_numpy(zero_copy_only=False)
    return array


def _dictionary(column: pa.ChunkedArray) -> pa.DictionaryArray:
    """One dictionary array; no re-hashing when every chunk already shares a dictionary
    (``_store_table`` unifies them once)."""
    if pa.types.is_dictionary(column.type) and column.num_chunks:
        first = column.chunk(0).dictionary
        address = first.buffers()[-1].address if first.buffers()[-1] else None
        if all(chunk.dictionary.buffers()[-1] is not None
               and chunk.dictionary.buffers()[-1].address == address
               and len(chunk.dictionary) == len(first) for chunk in column.chunks):
            indices = pa.concat_arrays([chunk.indices for chunk in column.chunks])
            return pa.DictionaryArray.from_arrays(indices, first)
        column = column.cast(column.type.value_type)
    return column.combine_chunks().dictionary_encode()


def _untagged(table: pa.Table):
    return pc.or_(pc.is_null(table.column(_CID)), pc.is_null(table.column(_TURN)))


def _inherit_keys(table: pa.Table) -> pa.Table:
    """Spans without conversation/turn take them from a tagged span of their trace."""
    untagged = _untagged(table)
    if not pc.any(untagged).as_py() or "trace_id" not in table.column_names:
        return table
    plain = pa.schema([pa.field(f.name, f.type.value_type) if pa.types.is_dictionary(f.type)
                       else f for f in table.schema])
    table = table.cast(plain)
    tagged = table.filter(pc.invert(untagged)).select(["trace_id", _CID, _TURN])
    by_trace = tagged.group_by("trace_id", use_threads=False).aggregate(
        [(_CID, "first"), (_TURN, "first")]).rename_columns(["trace_id", "_cid", "_turn"])
    rest = table.filter(untagged).drop_columns([_CID, _TURN]).join(
        by_trace, "trace_id", join_type="inner").rename_columns(
        {"_cid": _CID, "_turn": _TURN})
    rest = rest.select(table.column_names).cast(table.schema)
    return pa.concat_tables([table.filter(pc.invert(untagged)), rest])


def turns_from_table(table: pa.Table) -> pd.DataFrame:
    """Spans (Arrow, ``span_columns()`` at least) to the fleet turn table."""
    table = _inherit_keys(table)
    if table.column(_CID).null_count or table.column(_TURN).null_count:
        table = table.filter(pc.invert(_untagged(table)))
    ids = _dictionary(table.column(_CID))
    # Codes in conversation id order, so rows come out sorted like correlate's.
    rank = pc.rank(ids.dictionary, sort_keys="ascending", tiebreaker="first").to_numpy()
    codes = (rank.astype(np.int64) - 1)[ids.indices.to_numpy(zero_copy_only=False)]
    categories = np.empty(len(rank), dtype=object)
    categories[rank - 1] = ids.dictionary.to_pylist()
    turn = pc.cast(table.column(_TURN), pa.int64()).to_numpy(zero_copy_only=False)
    key = (codes << _TURN_BITS) | turn
    start = pc.fill_null(table.column("start_ns"), 0).to_numpy(zero_copy_only=False)
    names = _dictionary(table.column("name"))
    name_codes = names.indices.to_numpy(zero_copy_only=False)
    name_index = {name: i for i, name in enumerate(names.dictionary.to_pylist())}

    # One sort by (span name, turn, start): each span name is then a contiguous slice and,
    # within it, the first span of a turn comes first.
    order = np.lexsort((start, key, name_codes))
    sorted_names = name_codes[order]
    sorted_keys_all = key[order]
    valid_cache: dict[str, np.ndarray] = {}
    # Single-chunk value columns make the takes below fast (the dictionary-encoded key
    # columns are left alone: combining them would merge their dictionaries).
    values_table = table.drop_columns([_CID, "name"]).combine_chunks()

    def valid_sorted(source: str) -> np.ndarray:
        if source not in valid_cache:
            valid_cache[source] = table.column(source).is_valid().to_numpy(
                zero_copy_only=False)[order]
        return valid_cache[source]

    parts: list[pd.DataFrame] = [pd.DataFrame(index=pd.Index(np.unique(key), name="key"))]
    by_span: dict[str, list[tuple[str, str]]] = {}
    for column, (span, source) in FLEET_FIELDS.items():
        by_span.setdefault(span.name, []).append((column, source))
    for span_name, columns in by_span.items():
        code = name_index.get(span_name)
        if code is None:
            parts.append(pd.DataFrame(columns=[c for c, _ in columns], dtype=float))
            continue
        lo, hi = np.searchsorted(sorted_names, np.array([code, code + 1], sorted_names.dtype))
        sorted_keys = sorted_keys_all[lo:hi]
        firsts = np.concatenate([[True], sorted_keys[1:] != sorted_keys[:-1]])[:hi - lo]
        for column, source in columns:
            if column == "stuck_span_id":  # presence of the span is the fact
                parts.append(pd.DataFrame({column: np.full(firsts.sum(), True, object)},
                                          index=pd.Index(sorted_keys[firsts], name="key")))
                continue
            values = values_table.column(source)
            if column in SUMMED:
                summed = pd.Series(_numpy(values.take(pa.array(order[lo:hi])))).groupby(
                    sorted_keys).sum(min_count=1)
                parts.append(pd.DataFrame({column: summed.to_numpy()},
                                          index=pd.Index(summed.index, name="key")))
                continue
            # pandas' groupby.first(): the first non-null value of each turn.
            positions = np.flatnonzero(valid_sorted(source)[lo:hi])
            valid_keys = sorted_keys[positions]
            starts = np.concatenate([[True], valid_keys[1:] != valid_keys[:-1]]
                                    )[:len(valid_keys)]
            chosen_positions = positions[starts]
            chosen = values.take(pa.array(order[lo + chosen_positions]))
            if column in STRING_COLUMNS:
                data = pd.Categorical(chosen.to_pandas())
            else:
                data = _numpy(chosen)
            parts.append(pd.DataFrame({column: data},
                                      index=pd.Index(sorted_keys[chosen_positions], name="key")))
    turns = pd.concat(parts, axis=1).sort_index()
    keys = turns.index.to_numpy()
    turns.insert(0, "turn", (keys & ((1 << _TURN_BITS) - 1)).astype(np.int64))
    turns.insert(0, "conversation_id", pd.Categorical.from_codes(
        keys >> _TURN_BITS, categories=pd.Index(categories)))
    turns = turns.reset_index(drop=True)
    return derive(turns, keys)


def derive(turns: pd.DataFrame, keys: np.ndarray | None = None) -> pd.DataFrame:
    """Gap and previous-turn facts; rows must be grouped by conversation, by turn."""
    if keys is None:
        codes = turns["conversation_id"].astype("category").cat.codes.to_numpy(np.int64)
        keys = (codes << _TURN_BITS) | turns["turn"].to_numpy(np.int64)
    consecutive = np.zeros(len(turns), bool)
    consecutive[1:] = keys[1:] == keys[:-1] + 1
    previous = np.concatenate([[0], np.arange(len(turns) - 1)])

    def shifted(column):
        values = turns[column]
        out = values.iloc[previous].reset_index(drop=True)
        return out.where(consecutive)

    turns["gap_s"] = ((turns["turn_start_ns"] - shifted("turn_end_ns")) / 1e9).where(
        consecutive)
    for column in FLEET_PREVIOUS:
        turns[PREVIOUS_PREFIX + column] = shifted(column)
    return turns


def _store_table(store_dir: str, columns: list[str], since_ns: int | None) -> pa.Table:
    import pyarrow.dataset as ds

    from kvobs.sources.store import COMPACTED_DIR, store_schema

    schema = store_schema()
    compacted = os.path.join(store_dir, COMPACTED_DIR)
    tables = []
    if os.path.isdir(compacted):
        # Strings as dictionaries straight from parquet: no 10M-string materialisation.
        dictionary_columns = {_CID, "name"}
        file_format = ds.ParquetFileFormat(
            read_options=ds.ParquetReadOptions(dictionary_columns=dictionary_columns))
        dataset = ds.dataset(compacted, format=file_format, partitioning="hive")
        present = [c for c in columns if c in dataset.schema.names]
        table = dataset.to_table(columns=present)
        for column in columns:
            if column not in present:
                table = table.append_column(column, pa.nulls(table.num_rows,
                                                             schema.field(column).type))
        tables.append(table.select(columns).unify_dictionaries())
    from kvobs.sources.store import StoreSource

    live = StoreSource(store_dir)._live
    if os.path.isdir(live.location):
        frame = live.spans()
        if not frame.empty:
            tables.append(pa.Table.from_pandas(frame[columns], preserve_index=False).cast(
                pa.schema([schema.field(c) for c in columns])))
    if not tables:
        return pa.Table.from_pylist([], schema=pa.schema([schema.field(c) for c in columns]))
    if len(tables) == 1:
        return tables[0]
    plain = pa.schema([schema.field(c) for c in columns])
    return pa.concat_tables([t.cast(plain) for t in tables])


def fleet_turns(source) -> pd.DataFrame:
    """The fleet turn table of any source (store and ClickHouse take fast paths)."""
    from kvobs.sources.store import StoreSource

    if hasattr(source, "fleet_turns"):
        return source.fleet_turns()
    columns = span_columns()
    if isinstance(source, StoreSource):
        table = _store_table(source.store_dir, columns, None)
        if pc.any(_untagged(table)).as_py():  # rare: inherit keys through trace ids
            table = _store_table(source.store_dir, columns + ["trace_id"], None)
        return turns_from_table(table)
    frame = source.spans()
    return turns_from_table(pa.Table.from_pandas(frame[columns + ["trace_id"]],
                                                 preserve_index=False))
