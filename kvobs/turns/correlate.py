"""Join proxy, P and D spans into one row per turn: the one in-process turn-table builder.

Every kvobs span carries the correlation keys (tenant digest, conversation id, turn
index); spans that lack them inherit them from their trace. The tenant is part of the
key because the proxy scopes conversations by tenant: two tenants using one conversation
id are two conversations. Spans recorded without a tenant (no kvobs proxy in front) get
``UNKNOWN_TENANT``. Each column is declared once in ``kvobs.turns.schema`` (span,
attribute, aggregation); facts about the *previous* turn's KV (D's export and release)
are shifted onto the turn that tried to reuse it.

The first stage, ``kvobs.turns.lineage``, gives id-less turns their conversation and turn from
the engines' prefix chains, and P's decision span the facts of the D export its prompt
extends (``semconv.LINEAGE_FACTS``): columns like any other.

Built column-wise (Arrow + numpy), so millions of spans fit in seconds, in three steps
shared by every source: ``aggregate`` (spans -> one Arrow row per turn, before the
previous-turn shifts; what the store's turn files hold and ClickHouse's SQL returns),
``derive`` (gap, retention costs and previous-turn facts, never across conversations)
and ``to_frame`` (Arrow turn rows -> the fleet's pandas table, typed by the schema;
diagnose reads the Arrow rows through ``kvobs.turns.columns.Columns`` instead). Only
``to_frame`` and ``turn_links`` need pandas: each imports it on use. numpy <-> Arrow goes
through ``kvobs.turns.arrays`` (pyarrow's own conversions import pandas), so the stages,
linking included, never load it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvobs import semconv as sc
from kvobs.turns import arrays, columns as col, lineage
from kvobs.turns.schema import (
    ALL_COLUMNS,
    CONVERSATION_KEYS,
    DEVICE_BLOCK_SECONDS,
    FLEET_COLUMNS,
    GAP,
    HOST_BYTE_SECONDS,
    KEY_SOURCES,
    KEYS,
    PREVIOUS,
    PREVIOUS_PREFIX,
    SERVED_BY,
    SERVED_DEVICE_TOKENS,
    SERVED_HOST_TOKENS,
    SPAN_COLUMNS,
    UNKNOWN_TENANT,
    Agg,
    SpanColumn,
)

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "turns_from_spans",
    "turn_rows",
    "turn_table",
    "aggregate",
    "to_frame",
    "derive",
    "span_columns",
    "vllm_roles",
    "engine_http_roles",
    "needs_lineage",
    "nearest_tagged",
    "inherited_rows",
    "KEYS",
    "UNKNOWN_TENANT",
]

_TENANT, _CID, _TURN = KEY_SOURCES["tenant"], KEY_SOURCES["conversation_id"], KEY_SOURCES["turn"]
ARROW_TYPES = arrays.KIND_TYPES
Spans = Union["pd.DataFrame", pa.Table]
# Compute calls' literals, typed (a Python literal would import pandas: kvobs.turns.arrays).
_SECOND_NS = arrays.scalar(1e9, pa.float64())
_ZERO_S = arrays.scalar(0.0, pa.float64())


def _text(value: str) -> pa.Scalar:
    return arrays.scalar(value, pa.string())


def vllm_roles(spans: Spans) -> Spans:
    """vLLM's request spans renamed by role (the span table's type kept). Every engine
    names its span alike; the role comes from the resource attribute ``kvobs.role``
    (``OTEL_RESOURCE_ATTRIBUTES`` of the engine) or from ``service.name`` when it says
    prefill or decode, else from the turn: the turn's last vLLM span is D's (the proxy
    calls P first, D last), earlier ones P's. A turn's vLLM spans are those of one parent
    (the turn span, whose context the proxy sent both engines), else of one trace: a
    client's trace the proxy continues may hold several turns."""
    table = _arrow(spans, set(_ROLE_AND_CHAIN))
    name = arrays.text(table, "name")
    vllm = arrays.equal(name, sc.VLLM_REQUEST_SPAN)
    if not pc.any(vllm).as_py():
        return spans
    service = pc.coalesce(
        pc.utf8_lower(arrays.text(table, sc.ROLE.key)), pc.utf8_lower(arrays.text(table, "service"))
    )
    trace = pc.coalesce(arrays.text(table, "parent_span_id"), arrays.text(table, "trace_id"))
    start = table.column("start_ns")
    # Per row, the latest start of a vLLM span of its turn (null: none has one). By
    # numpy, not Table.group_by, which imports pyarrow.dataset (pandas: kvobs.turns.arrays).
    codes, traces = arrays.codes(trace)
    counted = arrays.booleans(pc.and_(vllm, pc.is_valid(start)))
    starts = arrays.numbers(start, fill=0).astype(np.int64)
    latest = np.full(traces, np.iinfo(np.int64).min)
    np.maximum.at(latest, codes[counted], starts[counted])
    has = np.zeros(traces, bool)
    has[codes[counted]] = True
    latest_start = arrays.array(latest[codes], pa.int64(), mask=~has[codes])
    # A span without trace has no turn to be the last of.
    last = pc.if_else(pc.is_valid(trace), pc.equal(start, latest_start), arrays.FALSE)
    decode = pc.or_kleene(
        pc.fill_null(pc.match_substring(service, "decode"), arrays.FALSE),
        pc.and_kleene(
            pc.invert(pc.fill_null(pc.match_substring(service, "prefill"), arrays.FALSE)), last
        ),
    )
    renamed = pc.if_else(
        vllm,
        pc.if_else(decode, _text(sc.SPAN_VLLM_DECODE.name), _text(sc.SPAN_VLLM_PREFILL.name)),
        name,
    )
    if isinstance(spans, pa.Table):
        return spans.set_column(arrays.column_index(spans, "name"), "name", renamed)
    return spans.assign(name=renamed.to_pylist()).astype({"name": spans["name"].dtype})


# What an engine HTTP span takes from the request span it times, when it has none: the
# keys lineage and aggregation place spans by.
_TAKEN_FROM_REQUEST = (
    sc.REQUEST_ID.key,
    sc.REMOTE_REQUEST_ID.key,
    _TENANT,
    _CID,
    _TURN,
    sc.SHARD.key,
)
# vLLM's internal request id is its external one, "-" and 8 random characters
# (vllm/v1/engine/input_processor.py, assign_request_id).
_INTERNAL_SUFFIX = 9
# The API server's clock is the engine's (one host); a margin for rounding only.
_CONTAINS_S = 0.001


def engine_http_roles(spans: pa.Table) -> pa.Table:
    """Engine HTTP spans (``semconv.ENGINE_HTTP_SPAN``) renamed by the role of the request
    they time, with its request id and keys. A span times the engine request whose
    external id is its ``gen_ai.request.id`` and whose arrival lies inside it; a span with
    no such request, or several, is left as it was (read by nothing): never guessed."""
    name = arrays.text(spans, "name")
    http = np.flatnonzero(arrays.booleans(arrays.equal(name, sc.ENGINE_HTTP_SPAN)))
    if not len(http):
        return spans
    requests = np.flatnonzero(
        arrays.booleans(arrays.equal(name, sc.SPAN_PREFILL_REQUEST.name))
        | arrays.booleans(arrays.equal(name, sc.SPAN_DECODE_REQUEST.name))
    )
    match = _timed_requests(spans, http, requests)
    found = match >= 0
    if not found.any():
        return spans
    position = np.full(spans.num_rows, -1, np.int64)  # in ``requests``
    position[http[found]] = match[found]
    unmatched = position < 0
    taken = arrays.array(requests[position], pa.int64(), mask=unmatched)
    prefill = arrays.equal(
        name.take(arrays.array(requests, pa.int64())), sc.SPAN_PREFILL_REQUEST.name
    )
    role_names = pc.if_else(
        prefill, _text(sc.SPAN_PREFILL_HTTP.name), _text(sc.SPAN_DECODE_HTTP.name)
    )
    renamed = pc.coalesce(role_names.take(arrays.array(position, pa.int64(), mask=unmatched)), name)
    spans = spans.set_column(arrays.column_index(spans, "name"), "name", renamed)
    for column in _TAKEN_FROM_REQUEST:
        if arrays.has_column(spans, column):
            values = spans.column(column)
            spans = spans.set_column(
                arrays.column_index(spans, column), column, pc.coalesce(values, values.take(taken))
            )
    return spans


def _timed_requests(spans: pa.Table, http: np.ndarray, requests: np.ndarray) -> np.ndarray:
    """Per HTTP span (rows ``http``), the position in ``requests`` of the one request it
    times, else -1. A request is timed by the span of its id that started last before it
    arrived and had not ended: a router may send P and D one X-Request-Id, and D's
    request may arrive before P's answer has left (vllm-router reads it as it comes). A
    span two requests choose (an id a client reused) times neither."""
    http_ids = arrays.text(spans, sc.VLLM_REQUEST_ID.key).take(arrays.array(http, pa.int64()))
    request_ids = _external_ids(
        arrays.text(spans, sc.REQUEST_ID.key).take(arrays.array(requests, pa.int64()))
    )
    codes, _ = arrays.codes(pa.chunked_array([*http_ids.chunks, *request_ids.chunks], pa.string()))
    span_code, request_code = codes[: len(http)], codes[len(http) :]
    span_code[~arrays.booleans(pc.is_valid(http_ids))] = -1
    request_code[~arrays.booleans(pc.is_valid(request_ids))] = -2
    start = arrays.numbers(spans.column("start_ns"), fill=-1)[http] / 1e9 - _CONTAINS_S
    end = arrays.numbers(_column(spans, "end_ns", pa.int64()))[http] / 1e9 + _CONTAINS_S
    end = np.where(np.isnan(end), np.inf, end)
    arrived = arrays.numbers(_column(spans, sc.REQUEST_ARRIVED_AT.key, pa.float64()))[requests]
    # Spans by id, then start: each request looks through its id's spans only.
    order = np.lexsort((start, span_code))
    lo = np.searchsorted(span_code[order], request_code, "left")
    hi = np.searchsorted(span_code[order], request_code, "right")
    chosen = np.full(len(requests), -1, np.int64)  # per request, its span (in ``http``)
    for k in range(int((hi - lo).max(initial=0))):
        span = order[np.minimum(lo + k, len(order) - 1)]
        holds = (lo + k < hi) & (start[span] <= arrived) & (arrived <= end[span])
        chosen = np.where(holds, span, chosen)  # later starts come later in ``order``
    choosers = np.bincount(chosen[chosen >= 0], minlength=len(http))
    match = np.full(len(http), -1, np.int64)
    taken = (chosen >= 0) & (choosers[np.maximum(chosen, 0)] == 1)
    match[chosen[taken]] = np.flatnonzero(taken)
    return match


def _external_ids(internal: pa.ChunkedArray) -> pa.ChunkedArray:
    """vLLM's request ids as its API server named them (its HTTP span's
    ``gen_ai.request.id``): the internal id less its random suffix and, for
    /v1/completions, less the prompt's index (``cmpl-ID-0``: one engine request per
    prompt; vllm/entrypoints/openai/completion/serving.py)."""
    cut = pc.utf8_slice_codeunits(internal, 0, -_INTERNAL_SUFFIX)
    suffixed = pc.fill_null(
        pc.equal(
            pc.utf8_slice_codeunits(internal, -_INTERNAL_SUFFIX, 1 - _INTERNAL_SUFFIX),
            arrays.scalar("-", pa.string()),
        ),
        arrays.FALSE,
    )
    external = pc.if_else(suffixed, cut, internal)
    completion = pc.fill_null(pc.starts_with(external, _COMPLETION_PREFIX), arrays.FALSE)
    return pc.if_else(completion, pc.replace_substring_regex(external, r"-[0-9]+$", ""), external)


_COMPLETION_PREFIX = sc.VLLM_REQUEST_ID_PREFIX["/v1/completions"]


def needs_lineage(spans: pa.Table, facts: bool = False) -> bool:
    """Whether ``kvobs.turns.lineage.link`` has work: some P request carries a chain and no id
    a client sent (fleet builders link only then), or, with ``facts`` (diagnose: the
    facts of the export each prompt extends), some P request carries a chain at all."""
    key = sc.PREFIX_LINEAGE.key
    if not arrays.has_column(spans, key) or spans.column(key).null_count == spans.num_rows:
        return False
    decisions = pc.and_(
        arrays.equal(arrays.text(spans, "name"), sc.SPAN_PULL_DECISION.name),
        pc.is_valid(spans.column(key)),
    )
    if not pc.any(decisions).as_py():
        return False
    if facts:
        return True
    cid = arrays.text(spans, sc.CONVERSATION_ID.key).filter(decisions)
    return bool(
        pc.any(
            pc.or_(
                pc.is_null(cid),
                pc.fill_null(pc.starts_with(cid, sc.ANONYMOUS_PREFIX), arrays.FALSE),
            )
        ).as_py()
    )


def span_columns(columns: Mapping[str, SpanColumn] = FLEET_COLUMNS) -> list[str]:
    """Span-table columns ``aggregate`` reads for ``columns`` (``trace_id`` is needed
    too when ``needs_traces``)."""
    needed = {"name", "start_ns", *KEY_SOURCES.values()}
    needed.update(c.source for c in columns.values() if c.agg not in (Agg.PRESENCE, Agg.COUNT))
    return sorted(needed)


def turn_rows(
    spans: Spans, columns: Mapping[str, SpanColumn] = FLEET_COLUMNS, lineage_facts: bool = False
) -> pa.Table:
    """A span table (any source's ``spans()``, or Arrow) to ``aggregate``'s turn
    rows. Lineage links id-less turns always; ``lineage_facts`` also gives id'd turns the
    facts of the export they extend (diagnose: one conversation; the fleet skips that
    cost)."""
    needed = sorted({*span_columns(columns), *_TREE})
    table = _roles(_arrow(spans, {*needed, *_ROLE_AND_CHAIN}))
    if needs_lineage(table, lineage_facts):
        table = lineage.link(_roles(_arrow(spans)))
    present = set(table.column_names)  # a list built anew at each read of the property
    return aggregate(table.select([c for c in needed if c in present]), columns)


def _roles(spans: pa.Table) -> pa.Table:
    """Role-less spans (vLLM's own, the engines' HTTP ones) named by role."""
    return engine_http_roles(vllm_roles(spans))


# What ``_inherit_keys`` reads of the span tree, when a source has it.
_TREE = ("trace_id", "span_id", "parent_span_id")
# What ``vllm_roles``, ``engine_http_roles`` and ``needs_lineage`` read.
_ROLE_AND_CHAIN = (
    "name",
    "service",
    sc.ROLE.key,
    "start_ns",
    "end_ns",
    sc.VLLM_REQUEST_ID.key,
    *_TAKEN_FROM_REQUEST,
    sc.REQUEST_ARRIVED_AT.key,
    "trace_id",
    "parent_span_id",
    sc.PREFIX_LINEAGE.key,
    sc.CONVERSATION_ID.key,
)


def _arrow(spans: Spans, columns: set[str] | None = None) -> pa.Table:
    """An Arrow span table as it is; a pandas one converted (``columns`` of it only)."""
    if isinstance(spans, pa.Table):
        return spans
    if columns is not None:
        spans = spans[[c for c in spans.columns if c in columns]]
    return pa.Table.from_pandas(spans, preserve_index=False)


def turns_from_spans(spans: Spans, frame: bool = True) -> pd.DataFrame | pa.Table:
    """One row per (tenant, conversation_id, turn), ``derive``d: every column of
    ``kvobs.turns.schema`` (diagnose, turns). The pandas turn table, or with ``frame``
    false the Arrow rows (diagnose reads them through ``kvobs.turns.columns.Columns``)."""
    rows = derive(turn_rows(spans, SPAN_COLUMNS, lineage_facts=True))
    return to_frame(rows) if frame else rows


def turn_table(rows: pa.Table | Iterable[pa.Table]) -> pd.DataFrame:
    """Turn rows (``aggregate``; or a source's ``turn_row_slices()``, at least one slice,
    each holding whole conversations) to the table the rules read."""
    # A slice at a time, derived and converted, so that neither's copies ever span a
    # fleet: its Arrow rows are freed before the next slice is read.
    frames = [
        to_frame(derive(_large_chunks(piece)))
        for piece in ([rows] if isinstance(rows, pa.Table) else rows)
    ]
    return frames[0] if len(frames) == 1 else _stacked(frames)


def _large_chunks(rows: pa.Table) -> pa.Table:
    """``rows``, combined into one chunk per column when its chunks are small (a query's
    record batches of a few rows cost per chunk in every later step); large ones (the
    store's turn files, ~21k rows each) are kept: pandas' conversion copies them into
    one array anyway, and combining first cost 0.7 s of 1.35M turns."""
    chunks = rows.column(0).num_chunks if rows.num_columns else 0
    return rows if chunks <= max(1, rows.num_rows // 10_000) else rows.combine_chunks()


def _stacked(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """Turn tables of slices as one, column by column, each column taken out of its
    slice's table once copied: the fleet's table is never in memory twice."""
    import pandas as pd  # a DataFrame's: pandas is loaded already
    from pandas.api.types import union_categoricals

    out = pd.DataFrame(index=pd.RangeIndex(sum(len(frame) for frame in frames)))
    for name in list(frames[0].columns):
        parts = [frame.pop(name) for frame in frames]
        if isinstance(parts[0].dtype, pd.CategoricalDtype):
            # A slice without values has no categories, typed apart (``_all_missing``).
            kinds = [p.cat.categories[:0] for p in parts if len(p.cat.categories)]
            values = union_categoricals(
                [
                    p.cat.set_categories(kinds[0]) if kinds and not len(p.cat.categories) else p
                    for p in parts
                ]
            )
        else:
            values = pd.concat(parts, ignore_index=True).array
        col.assign(out, {name: values})
    return out


def needs_traces(table: pa.Table) -> bool:
    """Whether some span must take a key from its trace: it lacks conversation or turn,
    or lacks a tenant that other spans carry."""
    tenant = table.column(_TENANT).null_count
    return bool(
        table.column(_CID).null_count
        or table.column(_TURN).null_count
        or 0 < tenant < table.num_rows
    )


def plain(table: pa.Table) -> pa.Table:
    """``table`` with dictionary columns decoded."""
    return table.cast(
        pa.schema(
            [
                pa.field(f.name, f.type.value_type) if pa.types.is_dictionary(f.type) else f
                for f in table.schema
            ]
        )
    )


def parent_rows(table: pa.Table) -> np.ndarray | None:
    """Per row, the row of its parent span (-1: not in the table); None without span ids."""
    if not (arrays.has_column(table, "span_id") and arrays.has_column(table, "parent_span_id")):
        return None
    spans = arrays.text(table, "span_id").combine_chunks()
    found = pc.index_in(arrays.text(table, "parent_span_id"), value_set=spans)
    return arrays.numbers(pc.cast(found, pa.int64()), fill=-1)


# How far up the span tree a span without keys looks for a tagged ancestor: the deepest
# chain recorded is 2 (the proxy's HTTP ``POST`` under its ``POST /v1/completions`` under
# the turn span; vLLM's request span is the turn span's child), one more for margin.
# ClickHouse's span SQL joins as many parent levels (``ClickHouseSource.turns_sql``), so
# both paths agree; it also ends a cycle of span ids (a damaged file).
ANCESTRY_DEPTH = 3


def nearest_tagged(parents: np.ndarray, tagged: np.ndarray) -> np.ndarray:
    """Per row, its nearest ancestor row that is ``tagged`` (``parents``: per row its
    parent's row, -1 when not known), -1 when none within ``ANCESTRY_DEPTH``: the one
    rule of which turn a span without keys belongs to, shared by ``_inherit_keys`` and
    the live classifier's buffer (``kvobs.live.buffer``). Pure."""
    found = np.full(len(parents), -1, np.int64)
    up = parents.astype(np.int64, copy=True)
    for _ in range(ANCESTRY_DEPTH):
        walking = np.flatnonzero((found < 0) & (up >= 0))
        if not len(walking):
            break
        hit = tagged[up[walking]]
        found[walking[hit]] = up[walking[hit]]
        up[walking[~hit]] = parents[up[walking[~hit]]]
    return found


def single_valued(groups: np.ndarray, values: np.ndarray, count: int) -> np.ndarray:
    """Per group code (0..count-1): whether its rows hold at most one distinct value code."""
    pairs = np.unique(np.stack([groups, values]), axis=1)
    return np.bincount(pairs[0], minlength=count) <= 1


def inherited_rows(
    column: pa.ChunkedArray,
    trace_codes: np.ndarray,
    traces: int,
    parents: np.ndarray | None,
    one_per_trace: bool,
) -> np.ndarray:
    """Per row, the row whose value of ``column`` (a key) a row lacking it takes, -1 when
    none: its nearest ancestor that has it (``nearest_tagged``), else the first row of
    its trace (``trace_codes``: per row a code of ``traces``) that has it; with
    ``one_per_trace`` (the conversation) only when the trace's rows hold one value. The
    rule of ``_inherit_keys``, shared by the store's compaction
    (``kvobs.sources.store``), which writes the keys into the stored spans."""
    valid = arrays.booleans(pc.is_valid(column))
    has = np.flatnonzero(valid)
    # The first row of each trace that has the key (rows without trace: one trace).
    traced, first = np.unique(trace_codes[has], return_index=True)
    source = np.full(traces, -1, np.int64)
    source[traced] = has[first]
    if one_per_trace:
        values = arrays.codes(column)[0]
        source[~single_valued(trace_codes[has], values[has], traces)] = -1
    index = source[trace_codes]
    if parents is not None:
        ancestor = nearest_tagged(parents, valid)
        index = np.where(ancestor >= 0, ancestor, index)
    return index


def _inherit_keys(table: pa.Table) -> pa.Table:
    """Each key a span lacks comes from its nearest ancestor span (``nearest_tagged``)
    that has it, else from the first span of its trace that has it. The ancestors first:
    several turns may share a trace (a client's, which the proxy continues), and vLLM's
    request span, which carries no key, is the child of its turn's span (the traceparent
    the proxy sent), the proxy's HTTP client spans its grandchildren. A trace holding
    several conversations gives no conversation to a span none of whose ancestors has
    one: which it belongs to is unknown (the first by table order would depend on how
    the source stored them, and the live classifier could not agree)."""
    if not arrays.has_column(table, "trace_id") or not needs_traces(table):
        return table
    table = plain(table)
    codes, traces = arrays.codes(table.column("trace_id"))
    parents = parent_rows(table)
    for key in KEY_SOURCES.values():
        column = table.column(key)
        if column.null_count in (0, table.num_rows):
            continue
        index = inherited_rows(column, codes, traces, parents, one_per_trace=key == _CID)
        inherited = column.take(arrays.array(index, pa.int64(), mask=index < 0))
        table = table.set_column(
            arrays.column_index(table, key), key, pc.coalesce(column, inherited)
        )
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
        return pa.DictionaryArray.from_arrays(
            arrays.array(np.zeros(0, np.int32)), arrays.strings([])
        )
    return column.combine_chunks().dictionary_encode()


def _same_buffer(a: pa.Array, b: pa.Array) -> bool:
    if a is b:
        return True
    x, y = a.buffers()[-1], b.buffers()[-1]
    return x is not None and y is not None and x.address == y.address and len(a) == len(b)


def ranked(column: pa.ChunkedArray, null_as: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-row codes in sorted string order, and the sorted distinct strings. Works on
    dictionary codes: the common one-tenant column never becomes 10M strings."""
    encoded = _dictionary(column)
    dictionary = encoded.dictionary.cast(pa.string())
    indices = encoded.indices
    if null_as is not None and indices.null_count:
        indices = pc.fill_null(indices, arrays.scalar(len(dictionary), indices.type))
        dictionary = pa.concat_arrays([dictionary, arrays.strings([null_as])])
    # Dense ranks: equal strings (an unmerged dictionary) share one code.
    rank = arrays.numbers(pc.rank(dictionary, sort_keys="ascending", tiebreaker="dense")) - 1
    categories = np.empty(int(rank.max()) + 1 if len(rank) else 0, dtype=object)
    categories[rank] = arrays.values(dictionary)
    return rank.astype(np.int64)[arrays.numbers(indices)], categories


def run_starts(sorted_keys: np.ndarray) -> np.ndarray:
    """Per element of sorted keys: whether it starts a run of equal keys."""
    return np.concatenate([[True], sorted_keys[1:] != sorted_keys[:-1]])[: len(sorted_keys)]


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


def aggregate(table: pa.Table, columns: Mapping[str, SpanColumn] = FLEET_COLUMNS) -> pa.Table:
    """Spans (Arrow, ``span_columns(columns)`` at least; ``trace_id`` when
    ``needs_traces``) to one row per (tenant, conversation_id, turn), sorted by those
    keys, before ``derive``. Each column aggregates its span's rows of the turn by start
    time as ``TurnColumn.agg`` says (``FIRST``: the first non-null value)."""
    table = _inherit_keys(table)
    if table.column(_CID).null_count or table.column(_TURN).null_count:
        table = table.filter(
            pc.and_(pc.is_valid(table.column(_CID)), pc.is_valid(table.column(_TURN)))
        )
    tenant_codes, tenants = ranked(table.column(_TENANT), UNKNOWN_TENANT)
    cid_codes, cids = ranked(table.column(_CID))
    conversation = tenant_codes * max(len(cids), 1) + cid_codes
    turn = arrays.numbers(arrays.as_type(table.column(_TURN), pa.int64()))
    # key = conversation << bits | (turn - lowest): as many bits as the turns need, so a
    # stray turn index can never spill into the next conversation's keys.
    lowest = int(turn.min()) if len(turn) else 0
    bits = max(int(turn.max() - lowest).bit_length(), 1) if len(turn) else 1
    key = (conversation << bits) | (turn - lowest)
    start = arrays.numbers(table.column("start_ns"), fill=0)
    names = _dictionary(table.column("name"))
    name_codes = arrays.numbers(names.indices)
    name_index = {name: i for i, name in enumerate(names.dictionary.to_pylist())}

    # Per span name: its rows in turn order, each row's turn (group) and the turn keys.
    by_name: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for span_name in {c.span.name for c in columns.values()}:
        if span_name not in name_index:
            continue
        rows = np.flatnonzero(name_codes == name_index[span_name])
        rows = rows[_turn_order(key[rows], start[rows])]
        firsts = run_starts(key[rows])
        by_name[span_name] = rows, np.cumsum(firsts) - 1, key[rows][firsts]
    every = np.concatenate([keys for _, _, keys in by_name.values()] or [np.zeros(0, np.int64)])
    turn_keys = np.sort(every, kind="stable")  # sorted runs: a merge
    turn_keys = turn_keys[run_starts(turn_keys)]
    n = len(turn_keys)
    combined: dict[str, pa.Array] = {}

    def source_column(source: str) -> pa.Array:
        # One chunk per column makes the takes fast; only the columns used are copied.
        if source not in combined:
            combined[source] = table.column(source).combine_chunks()
        return combined[source]

    position_of = {span: np.searchsorted(turn_keys, keys) for span, (_, _, keys) in by_name.items()}
    # Span names of at most one span per turn (most): a turn's value is its span's, one
    # take a column from rows placed once per name.
    single_rows = {
        span: _placed(rows, position_of[span], n)
        for span, (rows, _, keys) in by_name.items()
        if len(rows) == len(keys)
    }
    conversation_of = turn_keys >> bits
    out: dict[str, pa.Array] = {
        "tenant": pa.DictionaryArray.from_arrays(
            arrays.array(conversation_of // max(len(cids), 1), pa.int32()), arrays.strings(tenants)
        ),
        "conversation_id": pa.DictionaryArray.from_arrays(
            arrays.array(conversation_of % max(len(cids), 1), pa.int32()), arrays.strings(cids)
        ),
        "turn": arrays.array((turn_keys & ((1 << bits) - 1)) + lowest, pa.int64()),
    }
    for name, column in columns.items():
        arrow_type = ARROW_TYPES[column.type]
        if column.span.name not in by_name:
            out[name] = pa.nulls(n, arrow_type)
            continue
        rows, group, keys = by_name[column.span.name]
        position = position_of[column.span.name]
        if column.agg in (Agg.PRESENCE, Agg.COUNT):
            count = np.zeros(n, np.int64)
            count[position] = np.bincount(group, minlength=len(keys))
            out[name] = (
                arrays.strings(arrays.value_where(count > 0, "yes"))
                if column.agg is Agg.PRESENCE
                else arrays.array(count, mask=count == 0)
            )
            continue
        if column.agg is not Agg.SUM and table.column(column.source).null_count == len(table):
            # No span of the table has it (most of a few spans' ~130 columns): what the
            # steps below give, without their per-column work.
            out[name] = pa.nulls(n, arrow_type)
            continue
        if column.agg is not Agg.SUM and column.span.name in single_rows:
            taken = source_column(column.source).take(single_rows[column.span.name])
            out[name] = arrays.as_type(taken, arrow_type)
            continue
        values = source_column(column.source).take(arrays.array(rows))
        if column.agg is Agg.SUM:
            out[name] = _summed(values, group, position, n)
            continue
        valid = np.flatnonzero(arrays.booleans(values.is_valid()))
        first = valid[run_starts(group[valid])]
        take = np.full(n, -1, np.int64)
        take[position[group[first]]] = first
        out[name] = arrays.as_type(values.take(arrays.array(take, mask=take < 0)), arrow_type)
    return pa.table(out)


def _placed(rows: np.ndarray, position: np.ndarray, n: int) -> pa.Array:
    """Indices of ``n`` turns into the span rows: ``rows[i]`` at ``position[i]``, null
    where a turn has no such span."""
    index = np.full(n, -1, np.int64)
    index[position] = rows
    return arrays.array(index, mask=index < 0)


def _summed(values: pa.ChunkedArray, group: np.ndarray, position: np.ndarray, n: int) -> pa.Array:
    """Sum per turn, null when no span of the turn has a value (``min_count=1``)."""
    numbers = arrays.numbers(pc.cast(values, pa.int64()), fill=0)
    valid = arrays.booleans(values.is_valid())
    total = np.zeros(n, np.int64)
    counted = np.zeros(n, np.int64)
    np.add.at(total, position[group], numbers)
    np.add.at(counted, position[group], valid)
    return arrays.array(total, mask=counted == 0)


def to_frame(table: pa.Table) -> pd.DataFrame:
    """Arrow turn rows (``derive``d) to the pandas turn table, typed by the schema: strings
    categorical, integers nullable ``Int64``, the gap ``Float64``. Columns this version
    does not know (turn files written by another kvobs version) are left out; columns they
    lack read as missing downstream."""
    import pandas as pd  # the fleet's table; diagnose reads the Arrow rows

    table = table.select([name for name in table.column_names if name in ALL_COLUMNS])
    columns, names, missing = [], [], {}
    for position, name in enumerate(table.column_names):
        values = table.column(name)
        kind = ALL_COLUMNS[name].type
        if name not in KEYS and 0 < len(values) == values.null_count:
            # No turn has a value (a fleet without host copies or another router: ~35 of
            # 87 columns): made all missing, typed as converted, for a fifth less work.
            missing[position] = (name, kind)
            continue
        names.append(name)
        if kind == "str":
            if not pa.types.is_dictionary(values.type):
                values = values.dictionary_encode()
        else:
            values = pc.cast(values, ARROW_TYPES[kind])
        columns.append(values)
    frame = pa.table(columns, names=names).to_pandas(
        types_mapper={pa.int64(): pd.Int64Dtype(), pa.bool_(): pd.BooleanDtype()}.get,
        split_blocks=True,
    )
    for position, (name, kind) in missing.items():  # in order: each lands at its place
        frame.insert(position, name, _all_missing(kind, len(frame)))
    frame["turn"] = frame["turn"].astype(np.int64)
    if GAP.name in frame:
        frame[GAP.name] = frame[GAP.name].astype("Float64")
    return frame


def _all_missing(kind: str, rows: int):
    """A column of ``rows`` missing values, as ``to_frame`` types a ``kind``."""
    import pandas as pd  # a DataFrame's: pandas is loaded already

    if kind == "str":
        return pd.Categorical.from_codes(np.full(rows, -1, np.int8), [])
    if kind == "float":
        return np.full(rows, np.nan)
    array = pd.arrays.IntegerArray if kind == "int" else pd.arrays.BooleanArray
    return array(np.zeros(rows, np.int64 if kind == "int" else bool), np.ones(rows, bool))


def previous_rows(conversation_codes: list[np.ndarray], turn: np.ndarray) -> np.ndarray:
    """Per row: the row holding turn - 1 of the same conversation, -1 when no row does.
    Rows in any order (sorted by key here only when they are not already: a source's
    rows come grouped by conversation, or as a ClickHouse scan hands them)."""
    n = len(turn)
    key = np.zeros(n, np.int64)
    for codes in conversation_codes:  # a missing value's code, -1, counts as one more
        key = key * (int(codes.max()) + 2 if n else 1) + codes + 1
    order = None if _grouped(key, turn) else np.lexsort((turn, key))
    if order is not None:
        key, turn = key[order], turn[order]
    before = np.arange(n) - 1
    consecutive = np.zeros(n, bool)
    consecutive[1:] = (key[1:] == key[:-1]) & (turn[1:] == turn[:-1] + 1)
    if order is None:
        return np.where(consecutive, before, -1)
    previous = np.empty(n, np.int64)
    previous[order] = np.where(consecutive, order[np.maximum(before, 0)], -1)
    return previous


def _grouped(key: np.ndarray, turn: np.ndarray) -> bool:
    """Whether each key's rows are together (one run) and by rising turn: the store's
    turn files, concatenated, each sorted."""
    if len(key) < 2:
        return True
    change = key[1:] != key[:-1]
    if not np.all(change | (turn[1:] > turn[:-1])):
        return False
    if key.max() > 4 * len(key):  # sparse codes: counted by sorting
        return int(change.sum()) + 1 == len(np.unique(key))
    return int(change.sum()) + 1 == np.count_nonzero(np.bincount(key))


def turn_links(turns: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Per row of a turn table (rows in any order): the row of its conversation's
    previous turn and of its next turn, -1 when there is none."""
    import pandas as pd  # a DataFrame's: pandas is loaded already

    codes = [
        turns[key].cat.codes.to_numpy(np.int64)
        if isinstance(turns[key].dtype, pd.CategoricalDtype)
        else pd.factorize(turns[key])[0]
        for key in CONVERSATION_KEYS
    ]
    previous = previous_rows(codes, turns["turn"].to_numpy(np.int64))
    following = np.full(len(previous), -1, np.int64)
    linked = previous >= 0
    following[previous[linked]] = np.flatnonzero(linked)
    return previous, following


def derive(rows: pa.Table) -> pa.Table:
    """``rows`` (in any order) with the gap, retention costs and previous-turn facts
    (``turn_columns.DERIVED``) of the columns they have: each row's previous turn is
    the row of the same (tenant, conversation) with turn - 1 (``previous_rows``)."""
    turn = arrays.numbers(arrays.as_type(rows.column("turn"), pa.int64()))
    codes = [ranked(rows.column(key), UNKNOWN_TENANT)[0] for key in CONVERSATION_KEYS]
    before = previous_rows(codes, turn)
    previous = arrays.array(np.maximum(before, 0), pa.int64(), mask=before < 0)
    # In float: nanosecond stamps past 2**53 (a clock gone wrong, a fuzzed file) lose
    # precision instead of failing the table.
    start = _column(rows, "turn_start_ns", pa.float64())
    end = _column(rows, "turn_end_ns", pa.float64()).take(previous)
    gap = pc.divide(pc.subtract(start, end), _SECOND_NS)
    rows = rows.append_column(GAP.name, gap)
    rows = with_served_by(with_retention(rows))
    names = rows.column_names  # none of them a previous-turn column
    present = set(names)
    carried = {name: name[len(PREVIOUS_PREFIX) :] for name in PREVIOUS}
    facts = {
        name: _of_previous(rows.column(source), previous)
        for name, source in carried.items()
        if source in present
    }
    # Appended at once: a table a column (~17 us each, 25 of them) cost more than a
    # few turns' takes.
    return pa.Table.from_arrays([*rows.columns, *facts.values()], names=[*names, *facts])


def _of_previous(values: pa.ChunkedArray, previous: pa.Array) -> pa.ChunkedArray:
    """Per row, ``values`` at its previous turn's row (``previous``; null: none)."""
    return values.take(previous) if values.null_count < len(values) else values


def _column(rows: pa.Table, name: str, kind: pa.DataType):
    """``rows``'s column ``name`` as ``kind``, all null where the table lacks it."""
    if not arrays.has_column(rows, name):
        return pa.nulls(rows.num_rows, kind)
    return arrays.as_type(rows.column(name), kind, safe=False)


def with_served_by(rows: pa.Table) -> pa.Table:
    """``rows`` with which retention path served which tokens (``turn_columns.SERVED``):
    the tokens P read from D's device blocks (a finished read's offered, else candidate,
    tokens; 0 when P decided without reading), the tokens an offloading tier loaded (the
    host lookup's accepted tokens), and the path(s) that served any."""
    offered = pc.coalesce(
        _column(rows, "offered_tokens", pa.int64()), _column(rows, "candidate_tokens", pa.int64())
    )
    read = arrays.equal(_column(rows, "read_outcome", pa.string()), sc.ReadOutcome.DONE.value)
    decided = pc.is_valid(_column(rows, "decision", pa.string()))
    zero = arrays.scalar(0, pa.int64())
    device = pc.if_else(
        decided,
        pc.if_else(read, pc.fill_null(offered, zero), zero),
        pa.nulls(rows.num_rows, pa.int64()),
    )
    host = _column(rows, "host_accepted_tokens", pa.int64())
    by_device = pc.greater(pc.fill_null(device, zero), zero)
    by_host = pc.greater(pc.fill_null(host, zero), zero)
    known = pc.or_(pc.is_valid(device), pc.is_valid(host))
    served = pc.if_else(
        by_device,
        pc.if_else(
            by_host, _text(sc.ServedBy.DEVICE_AND_HOST.value), _text(sc.ServedBy.DEVICE.value)
        ),
        pc.if_else(
            by_host,
            _text(sc.ServedBy.HOST.value),
            pc.if_else(known, _text(sc.ServedBy.NONE.value), pa.nulls(1, pa.string())[0]),
        ),
    )
    return (
        rows.append_column(SERVED_DEVICE_TOKENS.name, device)
        .append_column(SERVED_HOST_TOKENS.name, host)
        .append_column(SERVED_BY.name, served)
    )


def with_retention(rows: pa.Table) -> pa.Table:
    """``rows`` with each turn's retention costs (``turn_columns.RETENTION``): D's blocks
    x seconds held, the host copy's bytes x seconds until evicted; null where a fact is
    missing (turn files of an older kvobs lack the host ones) or the hold had not ended."""

    def number(name: str) -> pa.ChunkedArray | pa.Array:
        if not arrays.has_column(rows, name):
            return pa.nulls(rows.num_rows, pa.float64())
        return arrays.as_type(rows.column(name), pa.float64(), safe=False)

    def seconds(end: str, start: str):  # never below 0: the two ends come from two clocks
        elapsed = pc.divide(pc.subtract(number(end), number(start)), _SECOND_NS)
        return pc.max_element_wise(elapsed, _ZERO_S, skip_nulls=False)

    held = pc.coalesce(number("held_s"), seconds("release_end_ns", "export_end_ns"))
    device = pc.multiply(number("export_blocks"), held)
    host = pc.multiply(number("host_saved_bytes"), seconds("host_evict_end_ns", "host_save_end_ns"))
    return rows.append_column(DEVICE_BLOCK_SECONDS.name, device).append_column(
        HOST_BYTE_SECONDS.name, host
    )
