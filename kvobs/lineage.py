"""Correlation from engine evidence alone: which earlier D export each prompt extends.

The first correlation stage. Every P request's pull-decision span carries its prompt's
block-hash chain and every D export the chain of the KV it retains
(``kvobs.prefix_chain``; hash prefixes only). A prompt that extends an export shares its
hash at the export's last grid point: one dict probe per checkpoint of the prompt. The
D request of that export names the P request of its own turn (``remote_request_id``),
so prompt -> export -> previous prompt is a chain of turns, whatever routed them.

From the links:
- every P request gets the facts of the export it extends (``semconv.LINEAGE_FACTS``):
  which D engine and request, how many tokens, when it expired or was released, and
  whether that engine restarted since. They are written onto P's decision span as
  derived attributes, so the turn table reads them like any other column, in every
  builder, and a store keeps them;
- requests without a conversation id (behind another router, or id-less clients of the
  proxy, whose turns are named ``anonymous:<trace>``) get a conversation and turn index
  from the chain: the conversation of the turn they extend, one turn later; a chain's
  first turn keeps its anonymous id, or gets ``lineage:<hash of its P request id>``. An
  id the client sent always wins; a turn index that goes back in the chain (a proxy
  that forgot the conversation numbers it 1 again) does not.

Matching is tenant-scoped when spans carry a tenant, time-ordered (an export must end
before the prompt arrives) and longest-first (the export with the most matching blocks;
equal histories pair off in time order). A prompt that extends no export may still
extend an earlier *prompt*: the history went on from that turn, but its output was
rewritten or re-tokenized. It is linked to that turn's export with ``extends_fully``
false.
"""

from __future__ import annotations

import hashlib

import pandas as pd
import pyarrow as pa

from kvobs import semconv as sc
from kvobs.prefix_chain import grid_points, parse
from kvobs.sources._frame import frame_from_table

_CID, _TURN, _TENANT = sc.CONVERSATION_ID.key, sc.TURN_INDEX.key, sc.TENANT_DIGEST.key
_RID, _REMOTE_RID = sc.REQUEST_ID.key, sc.REMOTE_REQUEST_ID.key
_P_ROLE_SPANS = {span.name for span in (
    sc.SPAN_PULL_DECISION, sc.SPAN_READ, sc.SPAN_RECOMPUTE, sc.SPAN_STUCK,
    sc.SPAN_PREFILL_REQUEST)}
_D_ROLE_SPANS = {span.name for span in (
    sc.SPAN_EXPORT, sc.SPAN_RELEASE, sc.SPAN_DECODE_REQUEST, sc.SPAN_HANDOFF)}

_FACTS = {column: attribute.key for column, attribute in sc.LINEAGE_FACTS.items()}


def _first(frame: pd.DataFrame, names: set[str], by: str, columns: list[str]) -> pd.DataFrame:
    rows = frame[frame["name"].isin(names) & frame[by].notna()]
    return rows.sort_values("start_ns", kind="stable").groupby(by)[columns].first()


def _exports(spans: pd.DataFrame) -> pd.DataFrame:
    columns = ["span_id", "end_ns", _REMOTE_RID, sc.PREFIX_LINEAGE.key, sc.EXPORT_TOKENS.key,
               sc.EXPORT_EXPIRES_AT.key, sc.ENGINE_ID.key, sc.ENGINE_ENDPOINT.key, _TENANT]
    exports = _first(spans, {sc.SPAN_EXPORT.name}, _RID, columns)
    released = _first(spans, {sc.SPAN_RELEASE.name}, _RID,
                      ["end_ns", sc.RELEASE_REASON.key]).rename(
        columns={"end_ns": "released_ns"})
    return exports.join(released, how="left")


def _records(frame: pd.DataFrame) -> dict[str, dict]:
    """Rows by index as plain dicts (NA as None): pandas' to_dict is ~8x slower."""
    columns = list(frame.columns)
    values = [frame[c].to_numpy(dtype=object, na_value=None) for c in columns]
    return {i: dict(zip(columns, row)) for i, row in zip(frame.index, zip(*values))}


def _index(exports: dict, export_chains: dict, prompts: pd.DataFrame,
           prompt_chains: dict) -> dict[tuple, list]:
    """(scope, grid point, hash) -> [(kind, time ns, D request id, tenant, blocks)].

    Two kinds of entry: an export (kind 1: a prompt that carries its key extends the KV D
    kept) and an earlier prompt (kind 0: a prompt that carries its key extends that
    turn's prompt but not its output: a rewritten or re-tokenized history). Both name the
    D export of their turn."""
    index: dict[tuple, list] = {}

    def add(chain, kind, time_ns, d_request, tenant):
        if chain is None or pd.isna(time_ns) or d_request is None:
            return
        index.setdefault((chain.scope, *chain.key()), []).append(
            (kind, int(time_ns), d_request, None if pd.isna(tenant) else tenant,
             chain.blocks))

    for d_request, export in exports.items():
        add(export_chains.get(d_request), 1, export["end_ns"], d_request, export[_TENANT])
    export_of = {e[_REMOTE_RID]: d for d, e in exports.items()
                 if isinstance(e[_REMOTE_RID], str)}
    for rid, start_ns, tenant in zip(prompts.index, prompts["start_ns"], prompts[_TENANT]):
        add(prompt_chains.get(rid), 0, start_ns, export_of.get(rid), tenant)
    return index


def _extended(chain, start_ns, tenant, index, points_with_keys,
              continued: set) -> tuple | None:
    """(D request id, fully) of the longest match: the export or earlier prompt with the
    most matching blocks, an export before a prompt of equal length. Equal candidates
    are equal histories (a fork, a copied conversation): the earliest one no prompt has
    continued yet, so that two such histories pair off in time order; when every one
    has been continued, the latest (this prompt forks it)."""
    if chain is None or pd.isna(start_ns):
        return None
    points = grid_points(chain.blocks)
    tenant = None if pd.isna(tenant) else tenant
    for i in range(len(points) - 1, -1, -1):
        point = points[i]
        if point not in points_with_keys:
            continue
        # An earlier prompt counts only when this one is longer: an equal prompt is a
        # retry or a fork of that turn, not its next turn.
        candidates = [c for c in index.get((chain.scope, point, chain.hash_at(i)), ())
                      if c[1] < start_ns and (tenant is None or c[3] in (None, tenant))
                      and (c[0] == 1 or c[4] < chain.blocks)]
        if candidates:
            kind = max(c[0] for c in candidates)
            same = sorted((c[1], c[2]) for c in candidates if c[0] == kind)
            fresh = [d_request for _, d_request in same if d_request not in continued]
            d_request = fresh[0] if fresh else same[-1][1]
            continued.add(d_request)
            return d_request, kind == 1
    return None


def _facts(chain, prompt_s: float, d_request: str, fully: bool, export: dict,
           export_chain, engines) -> dict:
    """The lineage facts of one prompt that extends ``export``."""
    exported_s = export["end_ns"] / 1e9
    released = export["released_ns"]
    released_s = None if pd.isna(released) else released / 1e9
    expires = export[sc.EXPORT_EXPIRES_AT.key]
    endpoint = export[sc.ENGINE_ENDPOINT.key]
    # A restart matters only while D still held the blocks: after they expired or were
    # released, the restart took nothing.
    held_until = min(t for t in (prompt_s, expires, released_s)
                     if t is not None and not pd.isna(t))
    facts = {
        "extends_request_id": d_request, "extends_span_id": export["span_id"],
        "extends_prefill_request_id": export[_REMOTE_RID],
        "extends_tokens": export[sc.EXPORT_TOKENS.key],
        "extends_verified_tokens": (chain.common_blocks(export_chain) * chain.block_size
                                    if export_chain is not None else 0),
        "extends_fully": fully, "extends_exported_at": exported_s,
        "extends_expires_at": expires, "extends_released_at": released_s,
        "extends_release_reason": export[sc.RELEASE_REASON.key],
        "extends_engine_id": export[sc.ENGINE_ID.key], "extends_endpoint": endpoint,
        "extends_engine_restarted_at": _restarted_at(engines, endpoint, exported_s,
                                                     held_until)}
    facts.update(_liveness(facts, prompt_s))
    return facts


def _restarts(spans: pd.DataFrame) -> dict[str, list[tuple[float, str]]]:
    """Per D endpoint: (engine start, engine id) of every engine seen there."""
    rows = spans[spans["name"].isin(_D_ROLE_SPANS) & spans[sc.ENGINE_ENDPOINT.key].notna()]
    seen = rows[[sc.ENGINE_ENDPOINT.key, sc.ENGINE_STARTED_AT.key, sc.ENGINE_ID.key]]
    by_endpoint: dict[str, list] = {}
    for endpoint, started, engine in seen.drop_duplicates().itertuples(index=False):
        if not pd.isna(started):
            by_endpoint.setdefault(endpoint, []).append((float(started), engine))
    return by_endpoint


def _restarted_at(engines, endpoint, after_s, before_s) -> float | None:
    if endpoint is None or pd.isna(endpoint):
        return None
    # An engine that started there after the export cannot hold it, whatever its id
    # (a restart may reuse a configured engine_id).
    starts = [s for s, _ in engines.get(endpoint, ()) if after_s < s <= before_s]
    return min(starts) if starts else None


def _liveness(row: dict, prompt_s: float) -> dict:
    expires = row["extends_expires_at"]
    left = None if expires is None or pd.isna(expires) else float(expires) - prompt_s
    released = row["extends_released_at"]
    live = (left is not None and left > 0 and row["extends_engine_restarted_at"] is None
            and (released is None or released > prompt_s))
    return {"extends_ttl_left_s": left, "extends_live": live}


def _trace_ids(spans: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """Per trace: the conversation id a client sent, and the anonymous id the proxy gave
    a turn sent without one."""
    cid = spans[_CID]
    anonymous = cid.astype("string").str.startswith(sc.ANONYMOUS_PREFIX).fillna(False)

    def per_trace(rows: pd.Series) -> pd.Series:
        return spans[rows.to_numpy(bool)].drop_duplicates("trace_id").set_index(
            "trace_id")[_CID]

    return per_trace(cid.notna() & ~anonymous), per_trace(anonymous)


def link_table(spans: pa.Table) -> pa.Table:
    """``link`` for an Arrow span table (the turn builder's)."""
    return pa.Table.from_pandas(link(frame_from_table(spans)), preserve_index=False)


def link(spans: pd.DataFrame) -> pd.DataFrame:
    """``spans`` with conversation and turn filled for id-less turns and the lineage
    facts (``semconv.LINEAGE_FACTS``) on every P decision span that carries a chain.
    Facts already there (written when a store compacted the spans) are kept."""
    if spans.empty or sc.PREFIX_LINEAGE.key not in spans \
            or not spans[sc.PREFIX_LINEAGE.key].notna().any():
        return spans
    prompts = _first(spans, {sc.SPAN_PULL_DECISION.name}, _RID,
                     ["start_ns", "trace_id", sc.PREFIX_LINEAGE.key, _TENANT, _TURN])
    if prompts.empty:
        return spans
    links = _links(spans, prompts)
    client_ids, anonymous_ids = (series.to_dict() for series in _trace_ids(spans))
    parent = {rid: p for rid, p in links["extends_prefill_request_id"].items()
              if isinstance(p, str) and p in links.index and p != rid}
    order = prompts["start_ns"].sort_values(kind="stable").index
    named = {rid: anonymous_ids.get(trace) for rid, trace in prompts["trace_id"].items()}
    named = {rid: cid for rid, cid in named.items() if isinstance(cid, str)}
    lineage = _walk(order, parent, {}, named)
    links["lineage_conversation_id"] = pd.Series({r: k[0] for r, k in lineage.items()},
                                                 dtype="object")
    links["lineage_turn"] = pd.Series({r: k[1] for r, k in lineage.items()}, dtype="Int64")
    # What the turn table uses: a client's id wins; id-less turns continue the chain.
    fixed = {}
    for rid, trace, turn in zip(prompts.index, prompts["trace_id"], prompts[_TURN]):
        cid = client_ids.get(trace)
        if isinstance(cid, str) and not pd.isna(turn):
            fixed[rid] = (cid, int(turn))
    keys = _walk(order, parent, fixed, named)
    rekeyed = {rid: key for rid, key in keys.items() if fixed.get(rid) != key}
    return _assign(_write_facts(spans, links), prompts, rekeyed)


def _links(spans: pd.DataFrame, prompts: pd.DataFrame) -> pd.DataFrame:
    """Per P request (``prompts``' index), the facts of the export its prompt extends;
    prompts are matched in time order (``_extended`` pairs equal histories off)."""
    exports = _records(_exports(spans))
    export_chains = {d: parse(e[sc.PREFIX_LINEAGE.key]) for d, e in exports.items()}
    prompt_chains = {rid: parse(digest)
                     for rid, digest in prompts[sc.PREFIX_LINEAGE.key].items()}
    index = _index(exports, export_chains, prompts, prompt_chains)
    points_with_keys = {point for _, point, _ in index}
    engines = _restarts(spans)
    rows = {}
    continued: set[str] = set()
    in_time = prompts.sort_values("start_ns", kind="stable")
    for rid, start_ns, tenant in zip(in_time.index, in_time["start_ns"], in_time[_TENANT]):
        chain = prompt_chains[rid]
        hit = _extended(chain, start_ns, tenant, index, points_with_keys, continued)
        if hit is not None:
            d_request, fully = hit
            rows[rid] = _facts(chain, start_ns / 1e9, d_request, fully, exports[d_request],
                               export_chains[d_request], engines)
    links = pd.DataFrame.from_dict(rows, orient="index", columns=list(_FACTS))
    return links.reindex(prompts.index)


def _write_facts(spans: pd.DataFrame, links: pd.DataFrame) -> pd.DataFrame:
    spans = spans.copy()
    decision = (spans["name"] == sc.SPAN_PULL_DECISION.name).fillna(False)  # a nameless span
    decisions = spans.index[decision.to_numpy(bool) & spans[_RID].notna().to_numpy(bool)]
    request_ids = spans.loc[decisions, _RID]
    for column, key in _FACTS.items():
        values = request_ids.map(links[column]).astype(spans[key].dtype) \
            if key in spans else request_ids.map(links[column])
        if key in spans:
            spans.loc[decisions, key] = spans.loc[decisions, key].fillna(values)
        else:
            spans[key] = pd.NA
            spans.loc[decisions, key] = values
    return spans


def conversation_name(request_id: str) -> str:
    """``lineage:<12 hex>``: short, stable, from the first turn's P request id."""
    return sc.LINEAGE_PREFIX + hashlib.sha256(str(request_id).encode()).hexdigest()[:12]


def _walk(order, parent: dict, fixed: dict, named: dict) -> dict[str, tuple[str, int]]:
    """(conversation, turn) of every P request in time order (a parent always starts
    before its children): a fixed one (a client's id) as is; else one turn after the
    turn it extends; a first turn named as given (``named``) or ``conversation_name()``.
    A second request extending the same turn (a fork, a retry) starts its own
    conversation, numbered on from the turn it extends."""
    keys: dict[str, tuple[str, int]] = {}
    continued: set[str] = set()
    for rid in order:
        p = parent.get(rid)
        if rid in fixed:
            # A client's id wins, but not a turn index that goes back in the chain: a
            # proxy that lost its state (a restart on the memory store) numbers the next
            # turn 1 again; the chain says which turn it is.
            cid, turn = fixed[rid]
            if p in keys and keys[p][0] == cid and keys[p][1] >= turn:
                turn = keys[p][1] + 1
            keys[rid] = (cid, turn)
        elif p in keys and p not in continued:
            keys[rid] = (keys[p][0], keys[p][1] + 1)
        else:
            keys[rid] = (named.get(rid) or conversation_name(rid),
                         keys[p][1] + 1 if p in keys else 1)
        if p is not None:
            continued.add(p)
    return keys


def _assign(spans: pd.DataFrame, prompts: pd.DataFrame,
            keys: dict[str, tuple[str, int]]) -> pd.DataFrame:
    """Write the lineage keys onto every span of the turns they change (id-less ones,
    renumbered ones): P's spans by request id, D's by the P request they pulled from,
    the rest by trace."""
    if not keys:
        return spans
    d_spans = spans[spans["name"].isin(_D_ROLE_SPANS) & spans[_REMOTE_RID].notna()]
    p_of_d = d_spans.drop_duplicates(_RID).set_index(_RID)[_REMOTE_RID]
    unit = pd.Series(pd.NA, index=spans.index, dtype="object")
    p_role = spans["name"].isin(_P_ROLE_SPANS).to_numpy(bool)
    unit[p_role] = spans.loc[p_role, _RID]
    d_role = spans["name"].isin(_D_ROLE_SPANS).to_numpy(bool)
    unit[d_role] = spans.loc[d_role, _REMOTE_RID].fillna(spans.loc[d_role, _RID].map(p_of_d))
    traces = prompts.loc[list(keys), "trace_id"].dropna()
    by_trace = pd.Series(traces.index, index=traces.to_numpy())
    unit = unit.fillna(spans["trace_id"].map(by_trace[~by_trace.index.duplicated()]))
    chosen = unit.isin(list(keys)).fillna(False).to_numpy(bool)
    if not chosen.any():
        return spans
    mapped = unit[chosen]
    spans.loc[chosen, _CID] = mapped.map({r: k[0] for r, k in keys.items()}).astype("string")
    spans.loc[chosen, _TURN] = mapped.map({r: k[1] for r, k in keys.items()}).astype("Int64")
    return spans
