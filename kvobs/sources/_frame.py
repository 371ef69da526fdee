"""The span table every source produces.

pandas is imported where a frame is built: importing a source (or this module's dtypes)
does not load it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvobs import semconv as sc

if TYPE_CHECKING:
    import pandas as pd

SPAN_COLUMNS = ("trace_id", "span_id", "parent_span_id", "name", "service",
                "start_ns", "end_ns", "error")
KIND_DTYPES = {"int": "Int64", "float": "Float64", "bool": "boolean", "str": "string"}
ATTRIBUTE_DTYPES = {a.key: KIND_DTYPES[a.type] for a in sc.ATTRIBUTES.values()}
BASE_DTYPES = {"trace_id": "string", "span_id": "string", "parent_span_id": "string",
               "name": "string", "service": "string", "start_ns": "Int64", "end_ns": "Int64",
               "error": "boolean"}
ALL_DTYPES = {**BASE_DTYPES, **ATTRIBUTE_DTYPES}
# What each dtype is in Arrow (pandas' own mapping, without building a frame to ask it):
# keyed by dtype, strings large, unlike the turn table's kvobs.correlate.ARROW_TYPES.
DTYPE_ARROW_TYPES = {"string": pa.large_string(), "Int64": pa.int64(),
                     "Float64": pa.float64(), "boolean": pa.bool_()}


def empty_spans() -> pd.DataFrame:
    return frame_from_rows([])


def frame_from_rows(rows: list[dict]) -> pd.DataFrame:
    """Rows (dicts keyed by column name) to a typed span table; bad values become null."""
    import pandas as pd  # on use: see the module's doc

    frame = pd.DataFrame.from_records(rows, columns=list(ALL_DTYPES))
    for column, dtype in ALL_DTYPES.items():
        if dtype in ("Int64", "Float64"):
            frame[column] = pd.to_numeric(frame[column], errors="coerce")
            if dtype == "Int64":
                frame[column] = frame[column].round()
        frame[column] = frame[column].astype(dtype)
    return _name_anonymous(frame)


def frame_from_table(table: pa.Table) -> pd.DataFrame:
    """An Arrow span table (``span_table()``, a store's parquet) as ``spans()`` types it."""
    import pandas as pd  # on use: see the module's doc

    # Straight to the span table's dtypes: through pd.ArrowDtype and astype, column by
    # column, it cost ~20 ms of a one-conversation read (~130 columns); 4 ms this way.
    dtypes = {arrow: pd.api.types.pandas_dtype(dtype)
              for dtype, arrow in DTYPE_ARROW_TYPES.items()}
    dtypes[pa.string()] = dtypes[pa.large_string()]
    frame = table.to_pandas(types_mapper=lambda arrow: dtypes.get(arrow, pd.ArrowDtype(arrow)))
    return frame.astype({column: ALL_DTYPES[column] for column in frame.columns
                         if column in ALL_DTYPES and frame[column].dtype != ALL_DTYPES[column]})


def table_from_frame(frame: pd.DataFrame) -> pa.Table:
    """A span frame as an Arrow table (what ``correlate.needs_lineage`` reads)."""
    return pa.Table.from_pandas(frame, preserve_index=False)


def repeated_spans(trace_ids, span_ids) -> np.ndarray:
    """Mask of the rows that repeat an earlier row's (trace id, span id): a span
    delivered twice (an exporter's retry, a copied file) would otherwise count twice
    (recomputed tokens are summed per turn). Rows without span id are never repeats."""
    key = pc.binary_join_element_wise(
        pc.fill_null(pa.chunked_array(trace_ids).cast(pa.string()), ""),
        pa.chunked_array(span_ids).cast(pa.string()), "/")
    codes = pc.fill_null(key.combine_chunks().dictionary_encode().indices, -1)
    codes = codes.to_numpy(zero_copy_only=False)
    order = np.argsort(codes, kind="stable")
    ordered = codes[order]
    repeated = np.zeros(len(codes), dtype=bool)
    repeated[order[1:][(ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)]] = True
    return repeated


def _reported(count: int, problems: list[str]) -> None:
    if count:
        problems.append(f"{count} duplicate span(s) (same trace and span id) read once")


def drop_duplicate_spans(frame: pd.DataFrame, problems: list[str]) -> pd.DataFrame:
    """One row per (trace id, span id) (``repeated_spans``), the repeats reported."""
    if frame.empty:
        return frame
    repeated = repeated_spans(pa.array(frame["trace_id"], pa.string()),
                              pa.array(frame["span_id"], pa.string()))
    _reported(int(repeated.sum()), problems)
    return frame[~repeated].reset_index(drop=True) if repeated.any() else frame


def drop_duplicate_span_rows(table: pa.Table, problems: list[str]) -> pa.Table:
    """``drop_duplicate_spans`` for an Arrow span table (the fleet's path)."""
    if table.num_rows == 0:
        return table
    repeated = repeated_spans(table.column("trace_id"), table.column("span_id"))
    _reported(int(repeated.sum()), problems)
    return table.filter(pa.array(~repeated)) if repeated.any() else table


def _name_anonymous(frame: pd.DataFrame) -> pd.DataFrame:
    """A turn sent without a conversation id is still a turn: its proxy turn span gets
    the conversation id ``anonymous:<trace id>`` (the id the proxy's answer header gave)."""
    cid = sc.CONVERSATION_ID.key
    anonymous = ((frame["name"] == sc.SPAN_PROXY_TURN.name) & frame[cid].isna()).fillna(False)
    if anonymous.any():
        frame.loc[anonymous, cid] = sc.ANONYMOUS_PREFIX + frame.loc[anonymous, "trace_id"]
    return frame


def select_conversation(frame: pd.DataFrame, conversation_id: str) -> pd.DataFrame:
    """Spans tagged with the conversation, plus untagged spans of the same traces."""
    tagged = frame[sc.CONVERSATION_ID.key] == conversation_id
    traces = set(frame.loc[tagged.fillna(False), "trace_id"].dropna())
    in_trace = frame["trace_id"].isin(traces) & frame[sc.CONVERSATION_ID.key].isna()
    return frame[tagged.fillna(False) | in_trace].reset_index(drop=True)
