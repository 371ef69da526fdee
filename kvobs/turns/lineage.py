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
before the prompt arrives) and longest-first (the export with the most matching blocks).
A prompt that extends no export may still extend an earlier *prompt*: the history went
on from that turn, but its output was rewritten or re-tokenized. It is linked to that
turn's export with ``extends_fully`` false.

The rules where evidence runs out, never guessed (``semconv.LineageGap``):
- equal matches (identical histories) in different conversations: the turn names them
  all (``lineage_candidates``) and starts a chain of its own, which its later turns
  continue once the histories diverge; equal matches within one conversation (a retry)
  are that conversation's, the latest one;
- a prompt equal to an earlier prompt is a copy of that turn (a retry, a fork, two
  conversations that start alike), never that turn's next turn;
- an earlier turn whose prompt this one extends but whose D export is missing is still
  its predecessor (``export-missing``), not the start of a new conversation;
- a P request whose decision span is missing (so no prompt chain) still gets a turn: its
  D export's chain stands in for its prompt.

Arrow in, Arrow out, through ``kvobs.turns.arrays``: real engines' spans all carry chains, so
``kvobs diagnose`` of one conversation links every time, and pyarrow's own numpy and
Python conversions would import pandas (~0.4 s). The matching itself is per prompt, in
Python; the reads and writes of span columns are column-wise.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvobs import semconv as sc
from kvobs.turns import arrays
from kvobs.prefix_chain import HEX_PER_POINT, Chain, grid_points, parse

_CID, _TURN, _TENANT = sc.CONVERSATION_ID.key, sc.TURN_INDEX.key, sc.TENANT_DIGEST.key
_RID, _REMOTE_RID = sc.REQUEST_ID.key, sc.REMOTE_REQUEST_ID.key
_PROMPT_TOKENS = sc.PROMPT_TOKENS.key
_CHAIN = sc.PREFIX_LINEAGE.key
_P_ROLE_SPANS = {
    span.name
    for span in (
        sc.SPAN_PULL_DECISION,
        sc.SPAN_READ,
        sc.SPAN_RECOMPUTE,
        sc.SPAN_STUCK,
        sc.SPAN_PREFILL_REQUEST,
        sc.SPAN_PREFILL_HTTP,
    )
}
_D_ROLE_SPANS = {
    span.name
    for span in (
        sc.SPAN_EXPORT,
        sc.SPAN_RELEASE,
        sc.SPAN_DECODE_REQUEST,
        sc.SPAN_HANDOFF,
        sc.SPAN_DECODE_HTTP,
    )
}
_LAST = np.iinfo(np.int64).max  # a row without start sorts after every other


def _missing(value) -> bool:
    return value is None or value != value  # NaN


def _rows(mask: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Row numbers where ``mask`` holds (null: not)."""
    return np.flatnonzero(arrays.booleans(mask))


def _take(spans: pa.Table, column: str, rows: np.ndarray) -> list:
    """Python values (None: null) of ``column`` at ``rows``; all None when it is absent."""
    if not arrays.has_column(spans, column):
        return [None] * len(rows)
    return spans.column(column).take(arrays.array(rows, pa.int64())).to_pylist()


def _named(spans: pa.Table, names: set[str]) -> pa.ChunkedArray:
    return pc.is_in(arrays.text(spans, "name"), value_set=arrays.strings(sorted(names)))


def _first(spans: pa.Table, names: set[str], by: str, columns: list[str]) -> dict[str, dict]:
    """Per ``by`` value (in sorted order), each column's first non-null value over the
    spans named ``names``, earliest start first: a repeated span (a retry) may lack a value
    an earlier or later one carries."""
    rows = _rows(pc.and_(_named(spans, names), pc.is_valid(arrays.text(spans, by))))
    start = arrays.numbers(spans.column("start_ns"), fill=_LAST)[rows]
    rows = rows[np.argsort(start, kind="stable")]
    values = {column: _take(spans, column, rows) for column in columns}
    first: dict[str, dict] = {}
    for i, key in enumerate(_take(spans, by, rows)):
        record = first.setdefault(key, dict.fromkeys(columns))
        for column in columns:
            if record[column] is None:
                record[column] = values[column][i]
    return dict(sorted(first.items()))


def _in_time(prompts: dict[str, dict]) -> list[str]:
    """P request ids by start (stable: ties in id order; no start last)."""
    return sorted(
        prompts, key=lambda rid: (prompts[rid]["start_ns"] is None, prompts[rid]["start_ns"] or 0)
    )


def _exports(spans: pa.Table) -> dict[str, dict]:
    """Per D request: its export's facts and its release (``released_ns``), if any."""
    exports = _first(
        spans,
        {sc.SPAN_EXPORT.name},
        _RID,
        [
            "span_id",
            "start_ns",
            "end_ns",
            _REMOTE_RID,
            _CHAIN,
            sc.EXPORT_TOKENS.key,
            sc.EXPORT_EXPIRES_AT.key,
            sc.ENGINE_ID.key,
            sc.ENGINE_ENDPOINT.key,
            _TENANT,
        ],
    )
    released = _first(spans, {sc.SPAN_RELEASE.name}, _RID, ["end_ns", sc.RELEASE_REASON.key])
    for d_request, export in exports.items():
        release = released.get(d_request, {})
        export["released_ns"] = release.get("end_ns")
        export[sc.RELEASE_REASON.key] = release.get(sc.RELEASE_REASON.key)
    return exports


def _export_of(exports: dict) -> dict[str, str]:
    """P request id -> the D request that exported its turn."""
    return {e[_REMOTE_RID]: d for d, e in exports.items() if isinstance(e[_REMOTE_RID], str)}


def index_key(chain: Chain) -> tuple[str, int, str]:
    """What an export or a prompt is found under: a prompt that extends it probes this
    key: the (scope, point, hash) of one of its own checkpoints."""
    return (chain.scope, *chain.key())


def _index(
    exports: dict, export_chains: dict, prompts: dict, prompt_chains: dict
) -> dict[tuple, list]:
    """(scope, grid point, hash) -> [(kind, time ns, D request id, tenant, blocks, P
    request id, tokens)].

    Two kinds of entry: an export (kind 1: a prompt that carries its key extends the KV D
    kept) and an earlier prompt (kind 0: a prompt that carries its key extends that
    turn's prompt but not its output: a rewritten or re-tokenized history). Both name
    their turn's P request and its D export (None when that span is missing)."""
    index: dict[tuple, list] = {}

    def add(chain, kind, time_ns, d_request, tenant, p_request):
        if chain is None or _missing(time_ns) or not isinstance(p_request, str):
            return
        index.setdefault(index_key(chain), []).append(
            (kind, int(time_ns), d_request, tenant, chain.blocks, p_request, chain.tokens)
        )

    for d_request, export in exports.items():
        add(
            export_chains.get(d_request),
            1,
            export["end_ns"],
            d_request,
            export[_TENANT],
            export[_REMOTE_RID],
        )
    export_of = _export_of(exports)
    for rid, prompt in prompts.items():
        if not prompt.get("ghost"):
            add(
                prompt_chains.get(rid),
                0,
                prompt["start_ns"],
                export_of.get(rid),
                prompt[_TENANT],
                rid,
            )
    return index


def _extended(
    chain,
    start_ns,
    tenant,
    index,
    points_with_keys,
    exclude: set[str],
    ghost: bool = False,
    ghost_prompt_tokens: int | None = None,
) -> tuple:
    """([(P request, D request or None)] in time order, fully) of the longest match: the
    exports or earlier prompts with the most matching blocks, exports before prompts of
    equal length, never the turns of the P requests in ``exclude`` (the prompt's own, and
    those of earlier prompts it equals). Several are equal histories; ``_walk`` tells
    whether they are one conversation's. No match: an empty list."""
    if chain is None or _missing(start_ns):
        return [], False
    # The prompt's checkpoints as keys (``index_key``'s form), longest first, each built
    # only where some key lies at its point: the longest match is most often the previous
    # turn's export, a few points from the end.
    points, scope, hexed = grid_points(chain.blocks), chain.scope, chain.hexed
    for i in range(len(points) - 1, -1, -1):
        if points[i] not in points_with_keys:
            continue
        at = i * HEX_PER_POINT
        candidates = [
            c
            for c in index.get((scope, points[i], hexed[at : at + HEX_PER_POINT]), ())
            if c[1] < start_ns
            and (tenant is None or c[3] in (None, tenant))
            and _could_precede(c[0] == 1, c[4], c[6], chain, ghost, ghost_prompt_tokens)
            and c[5] not in exclude
        ]
        if candidates:
            kind = max(c[0] for c in candidates)
            same = sorted({(c[1], c[5], c[2] or "") for c in candidates if c[0] == kind})
            return [(p, d or None) for _, p, d in same], kind == 1
    return [], False


def _could_precede(
    is_export: bool, blocks: int, tokens: int, chain, ghost: bool, ghost_prompt_tokens
) -> bool:
    """Whether an export or an earlier prompt (of ``blocks`` whole blocks, ``tokens`` in
    all) can be what a prompt (``chain``) extends, by length. An export only when the
    prompt holds all its tokens: its key lies at its last grid point, which an equal
    prompt (a twin whose own decision span is missing, so not known as a copy) holds
    too. An earlier prompt only when this one has more blocks: an equal prompt is a retry
    or a fork of that turn, not its next turn. A ghost's chain is its whole export
    (prompt and output): both weigh against its prompt's length from P's other spans;
    unknown, against the whole chain, shorter only."""
    if not ghost:
        return tokens <= chain.tokens if is_export else blocks < chain.blocks
    if _missing(ghost_prompt_tokens):
        return blocks < chain.blocks
    prompt_tokens = int(ghost_prompt_tokens)
    if is_export:
        return tokens <= prompt_tokens
    return blocks < prompt_tokens // chain.block_size


def _seconds(ns) -> float | None:
    return None if _missing(ns) else ns / 1e9


def _facts(
    chain, prompt_s: float, d_request: str, fully: bool, export: dict, export_chain, engines
) -> dict:
    """The lineage facts of one prompt that extends ``export``."""
    exported_s = _seconds(export["end_ns"])
    released_s = _seconds(export["released_ns"])
    expires = export[sc.EXPORT_EXPIRES_AT.key]
    endpoint = export[sc.ENGINE_ENDPOINT.key]
    # A restart matters only while D still held the blocks: after they expired or were
    # released, the restart took nothing.
    held_until = min(
        t for t in (prompt_s, expires, released_s) if t is not None and not _missing(t)
    )
    facts = {
        "extends_request_id": d_request,
        "extends_span_id": export["span_id"],
        "extends_prefill_request_id": export[_REMOTE_RID],
        "extends_tokens": export[sc.EXPORT_TOKENS.key],
        "extends_verified_tokens": (
            chain.common_blocks(export_chain) * chain.block_size if export_chain is not None else 0
        ),
        "extends_fully": fully,
        "extends_exported_at": exported_s,
        "extends_expires_at": expires,
        "extends_released_at": released_s,
        "extends_release_reason": export[sc.RELEASE_REASON.key],
        "extends_engine_id": export[sc.ENGINE_ID.key],
        "extends_endpoint": endpoint,
        "extends_engine_restarted_at": _restarted_at(engines, endpoint, exported_s, held_until),
    }
    facts.update(_liveness(facts, prompt_s))
    return facts


def _restarts(spans: pa.Table) -> dict[str, list[tuple[float, str]]]:
    """Per D endpoint: (engine start, engine id) of every engine seen there."""
    endpoint = sc.ENGINE_ENDPOINT.key
    rows = _rows(pc.and_(_named(spans, _D_ROLE_SPANS), pc.is_valid(arrays.text(spans, endpoint))))
    seen = zip(
        *(
            _take(spans, column, rows)
            for column in (endpoint, sc.ENGINE_STARTED_AT.key, sc.ENGINE_ID.key)
        )
    )
    by_endpoint: dict[str, list] = {}
    for at, started, engine in set(seen):
        if not _missing(started):
            by_endpoint.setdefault(at, []).append((float(started), engine))
    return by_endpoint


def _restarted_at(engines, endpoint, after_s, before_s) -> float | None:
    if _missing(endpoint) or _missing(after_s):
        return None
    # An engine that started there after the export cannot hold it, whatever its id
    # (a restart may reuse a configured engine_id).
    starts = [s for s, _ in engines.get(endpoint, ()) if after_s < s <= before_s]
    return min(starts) if starts else None


def _liveness(row: dict, prompt_s: float) -> dict:
    expires = row["extends_expires_at"]
    left = None if _missing(expires) else float(expires) - prompt_s
    released = row["extends_released_at"]
    live = (
        left is not None
        and left > 0
        and row["extends_engine_restarted_at"] is None
        and (released is None or released > prompt_s)
    )
    return {"extends_ttl_left_s": left, "extends_live": live}


def _first_per_trace(spans: pa.Table, rows: np.ndarray) -> dict:
    """Trace id -> the conversation id of its first span among ``rows``."""
    trace = arrays.text(spans, "trace_id").take(arrays.array(rows, pa.int64()))
    _, first = np.unique(arrays.codes(trace)[0], return_index=True)
    chosen = rows[np.sort(first)]
    return dict(zip(_take(spans, "trace_id", chosen), _take(spans, _CID, chosen)))


def _own_id(prompt: dict, anonymous: bool) -> str | None:
    """The conversation id a prompt's own span carries, when it is a client's (or, with
    ``anonymous``, one the proxy named): it wins over its trace's, which a client's trace
    shared by several turns (the proxy continues it) holds more than one of."""
    cid = prompt.get(_CID)
    if not isinstance(cid, str) or cid.startswith(sc.ANONYMOUS_PREFIX) != anonymous:
        return None
    return cid


def _trace_ids(spans: pa.Table) -> tuple[dict, dict]:
    """Per trace: the conversation id a client sent, and the anonymous id the proxy gave
    a turn sent without one."""
    cid = arrays.text(spans, _CID)
    anonymous = arrays.booleans(pc.starts_with(cid, sc.ANONYMOUS_PREFIX))
    sent = arrays.booleans(pc.is_valid(cid)) & ~anonymous
    return (
        _first_per_trace(spans, np.flatnonzero(sent)),
        _first_per_trace(spans, np.flatnonzero(anonymous)),
    )


def link(spans: pa.Table) -> pa.Table:
    """``spans`` (Arrow) with conversation and turn filled for id-less turns and the
    lineage facts (``semconv.LINEAGE_FACTS``) on every P decision span that carries a
    chain. Facts already there (written when a store compacted the spans) are kept."""
    if (
        spans.num_rows == 0
        or not arrays.has_column(spans, _CHAIN)
        or spans.column(_CHAIN).null_count == spans.num_rows
    ):
        return spans
    prompts = _first(
        spans,
        {sc.SPAN_PULL_DECISION.name},
        _RID,
        ["start_ns", "trace_id", _CHAIN, _TENANT, _TURN, _CID],
    )
    if not prompts:
        return spans
    exports = _exports(spans)
    prompts.update(_ghosts(spans, prompts, exports))
    matches = _matches(prompts, exports)
    client_ids, anonymous_ids = _trace_ids(spans)
    order = _in_time(prompts)
    named = {
        rid: _own_id(prompt, anonymous=True) or anonymous_ids.get(prompt["trace_id"])
        for rid, prompt in prompts.items()
    }
    named = {rid: cid for rid, cid in named.items() if isinstance(cid, str)}
    # What the turn table uses: a client's id wins; id-less turns continue the chain.
    fixed = {}
    for rid, prompt in prompts.items():
        cid = _own_id(prompt, anonymous=False) or client_ids.get(prompt["trace_id"])
        if isinstance(cid, str) and not _missing(prompt[_TURN]):
            fixed[rid] = (cid, int(prompt[_TURN]))
    keys, parents = _walk(order, matches, fixed, named)
    chain_keys, chain_parents = _walk(order, matches, {}, named)
    engines = _restarts(spans)
    facts = {}
    for rid, (cid, turn) in chain_keys.items():
        if prompts[rid].get("ghost"):
            continue  # no decision span to carry them
        facts[rid] = {
            **_link_facts(
                rid,
                prompts[rid],
                parents.get(rid),
                matches,
                exports,
                engines,
                keyed_by_chain=rid not in fixed,
            ),
            **_ambiguity(matches.get(rid, ([], False))[0], chain_parents.get(rid)),
            "lineage_conversation_id": cid,
            "lineage_turn": turn,
        }
    rekeyed = {rid: key for rid, key in keys.items() if fixed.get(rid) != key}
    return _assign(_write_facts(spans, facts), prompts, rekeyed)


def _ghosts(spans: pa.Table, prompts: dict, exports: dict) -> dict[str, dict]:
    """P requests that other spans show (P's own, or D's export naming them) but whose
    decision span, and so their prompt's chain, is missing. A ghost's export chain
    starts with its prompt, so it stands in for it: the ghost is matched like a prompt,
    from its first span's start, and keeps a turn of its own."""
    lacking = {p: d for p, d in _export_of(exports).items() if p not in prompts}
    if not lacking:
        return {}
    theirs = spans.filter(
        pc.is_in(arrays.text(spans, _RID), value_set=arrays.strings(sorted(lacking)))
    )
    seen = _first(
        theirs,
        _P_ROLE_SPANS - {sc.SPAN_PULL_DECISION.name},
        _RID,
        ["start_ns", "trace_id", _TENANT, _TURN, _PROMPT_TOKENS],
    )
    ghosts = {}
    for p_request, d_request in lacking.items():
        export, own = exports[d_request], seen.get(p_request, {})
        start = own.get("start_ns")
        ghosts[p_request] = {
            "prompt_tokens": own.get(_PROMPT_TOKENS),
            "start_ns": export["start_ns"] if _missing(start) else start,
            "trace_id": own.get("trace_id"),
            _CHAIN: export[_CHAIN],
            _TENANT: export[_TENANT],
            _TURN: own.get(_TURN),
            "ghost": True,
        }
    return ghosts


def _matches(prompts: dict[str, dict], exports: dict[str, dict]) -> dict[str, tuple]:
    """Per P request: (candidates, fully) from ``_extended``. A prompt equal to an
    earlier one (same chain, same tenant) is a copy of that turn, never its next turn:
    that turn's export is no candidate (with short outputs or large blocks its key lies
    within the copy), so that two conversations that start alike both start."""
    export_chains = {d: parse(e[_CHAIN]) for d, e in exports.items()}
    prompt_chains = {rid: parse(prompt[_CHAIN]) for rid, prompt in prompts.items()}
    index = _index(exports, export_chains, prompts, prompt_chains)
    points_with_keys = {point for _, point, _ in index}
    matches: dict[str, tuple] = {}
    copies: dict[tuple, list[str]] = {}
    for rid in _in_time(prompts):
        prompt, chain = prompts[rid], prompt_chains[rid]
        whole = None
        if chain is not None and not prompt.get("ghost"):
            whole = (chain.scope, chain.blocks, chain.hexed[-HEX_PER_POINT:], prompt[_TENANT])
        twins = copies.setdefault(whole, []) if whole is not None else []
        matches[rid] = _extended(
            chain,
            prompt["start_ns"],
            prompt[_TENANT],
            index,
            points_with_keys,
            {rid, *twins},
            bool(prompt.get("ghost")),
            prompt.get("prompt_tokens"),
        )
        twins.append(rid)
    return matches


def _link_facts(
    rid: str,
    prompt: dict,
    parent: tuple | None,
    matches: dict,
    exports: dict,
    engines,
    keyed_by_chain: bool,
) -> dict:
    """The facts of the export a prompt extends (``parent``: the (P, D) request pair
    ``_walk`` chose), or why there is none (``LineageGap``; only where the chain, not a
    client's id, says which turn this is)."""
    candidates, fully = matches.get(rid, ([], False))
    if parent is None:
        if not _several_turns(candidates) or not keyed_by_chain:
            return {}
        return {"lineage_gap": sc.LineageGap.AMBIGUOUS.value}
    p_request, d_request = parent
    if d_request is None or d_request not in exports:
        return {"extends_prefill_request_id": p_request} | (
            {"lineage_gap": sc.LineageGap.EXPORT_MISSING.value} if keyed_by_chain else {}
        )
    export = exports[d_request]
    return _facts(
        parse(prompt[_CHAIN]),
        prompt["start_ns"] / 1e9,
        d_request,
        fully,
        export,
        parse(export[_CHAIN]),
        engines,
    )


def _several_turns(candidates: list[tuple]) -> bool:
    """Whether equal matches name more than one earlier turn (P request)."""
    return len({p for p, _ in candidates}) > 1


def _ambiguity(candidates: list[tuple], chain_parent: tuple | None) -> dict:
    """``lineage_candidates`` where the chain alone names no single earlier turn (even
    when a client's id then says which)."""
    if chain_parent is not None or not _several_turns(candidates):
        return {}
    return {"lineage_candidates": " ".join(d or p for p, d in candidates)}


def _set(spans: pa.Table, column: str, values) -> pa.Table:
    if arrays.has_column(spans, column):
        return spans.set_column(arrays.column_index(spans, column), column, values)
    return spans.append_column(column, values)


def _lookup(values: pa.ChunkedArray, keys: list[str], rows: np.ndarray | None = None) -> pa.Array:
    """Per row, the position of its value in ``keys`` (null: not there, or not one of
    ``rows`` when given): what a ``take`` maps row by row."""
    position = arrays.numbers(pc.index_in(values, value_set=arrays.strings(keys)), fill=-1)
    if rows is not None:
        outside = np.ones(len(position), bool)
        outside[rows] = False
        position[outside] = -1
    return arrays.array(position, pa.int64(), mask=position < 0)


def _write_facts(spans: pa.Table, facts: dict[str, dict]) -> pa.Table:
    """Each fact on its P request's decision span(s), typed as semconv declares it."""
    decisions = _rows(
        pc.and_(_named(spans, {sc.SPAN_PULL_DECISION.name}), pc.is_valid(arrays.text(spans, _RID)))
    )
    position = _lookup(arrays.text(spans, _RID), list(facts), decisions)
    for column, attribute in sc.LINEAGE_FACTS.items():
        kind = arrays.KIND_TYPES[attribute.type]
        values = arrays.from_values([f.get(column) for f in facts.values()], kind).take(position)
        if arrays.has_column(spans, attribute.key):  # kept where a store wrote it already
            values = pc.coalesce(spans.column(attribute.key).cast(kind), values)
        spans = _set(spans, attribute.key, values)
    return spans


def conversation_name(request_id: str) -> str:
    """``lineage:<12 hex>``: short, stable, from the first turn's P request id."""
    import hashlib  # here: OpenSSL's load (~2 ms) is not needed to diagnose a named id

    return sc.LINEAGE_PREFIX + hashlib.sha256(str(request_id).encode()).hexdigest()[:12]


def _walk(order, matches: dict, fixed: dict, named: dict) -> tuple[dict, dict]:
    """(conversation, turn) of every P request in time order (a parent always starts
    before its children), and the (P, D) pair each one continues.

    A fixed one (a client's id) keeps its key; its parent is the candidate in its own
    conversation when there is one. Else a turn continues the conversation of its
    candidates when they are all one conversation's (the latest of them: a retry), one
    turn on. Candidates in different conversations continue none: the turn starts a
    chain of its own, numbered one after the earliest candidate's turn, and
    ``_link_facts`` names the ambiguity. A first turn is named as given (``named``) or
    ``conversation_name()``. A second request extending the same turn (a fork, a retry)
    starts its own conversation, numbered on from the turn it extends."""
    keys: dict[str, tuple[str, int]] = {}
    parents: dict[str, tuple] = {}
    continued: set[str] = set()
    for rid in order:
        candidates = [c for c in matches.get(rid, ([], False))[0] if c[0] in keys]
        conversations = {keys[p][0] for p, _ in candidates}
        if rid in fixed:
            own = [c for c in candidates if keys[c[0]][0] == fixed[rid][0]]
            candidates = own or (candidates if len(conversations) == 1 else [])
        parent = (
            candidates[-1] if len(conversations) == 1 or (rid in fixed and candidates) else None
        )
        p = parent[0] if parent else None
        if rid in fixed:
            # A client's id wins, but not a turn index that goes back in the chain: a
            # proxy that lost its state (a restart on the memory store) numbers the next
            # turn 1 again; the chain says which turn it is.
            cid, turn = fixed[rid]
            if p in keys and keys[p][0] == cid and keys[p][1] >= turn:
                turn = keys[p][1] + 1
            keys[rid] = (cid, turn)
        elif p is not None and p not in continued:
            keys[rid] = (keys[p][0], keys[p][1] + 1)
        else:
            after = [keys[c][1] for c, _ in candidates]
            keys[rid] = (named.get(rid) or conversation_name(rid), min(after) + 1 if after else 1)
        if parent is not None:
            parents[rid] = parent
            continued.add(parent[0])
    return keys, parents


def _units(spans: pa.Table, prompts: dict[str, dict], keyed: list[str]) -> pa.ChunkedArray:
    """Per span, the P request of its turn: P's spans by request id, D's by the P request
    they pulled from (a D span that does not name it: from its request's other spans),
    the rest by trace (the first of ``keyed`` in that trace)."""
    rid, remote = arrays.text(spans, _RID), arrays.text(spans, _REMOTE_RID)
    d_role = _named(spans, _D_ROLE_SPANS)
    # Each D request's first span that names its P request.
    naming = _rows(pc.and_(d_role, pc.is_valid(remote)))
    _, first = np.unique(
        arrays.codes(rid.take(arrays.array(naming, pa.int64())))[0], return_index=True
    )
    firsts = arrays.array(naming[np.sort(first)], pa.int64())
    # index_in pairs nulls: D spans without a request id take what the first of them
    # names.
    p_of_d = remote.take(firsts).take(pc.index_in(rid, value_set=rid.take(firsts).combine_chunks()))
    unit = pc.if_else(
        _named(spans, _P_ROLE_SPANS),
        rid,
        pc.if_else(d_role, pc.coalesce(remote, p_of_d), pa.nulls(spans.num_rows, pa.string())),
    )
    by_trace: dict[str, str] = {}
    for request in keyed:  # time order: a trace's earliest keyed prompt
        trace = prompts[request]["trace_id"]
        if trace is not None:
            by_trace.setdefault(trace, request)
    traced = arrays.strings(list(by_trace.values())).take(
        _lookup(arrays.text(spans, "trace_id"), list(by_trace))
    )
    return pc.coalesce(unit, traced)


def _assign(
    spans: pa.Table, prompts: dict[str, dict], keys: dict[str, tuple[str, int]]
) -> pa.Table:
    """Write the lineage keys onto every span of the turns they change (id-less ones,
    renumbered ones)."""
    if not keys:
        return spans
    position = _lookup(_units(spans, prompts, list(keys)), list(keys))
    if position.null_count == len(position):
        return spans
    cids = arrays.strings([cid for cid, _ in keys.values()]).take(position)
    turns = arrays.array(np.array([turn for _, turn in keys.values()], np.int64)).take(position)
    spans = _set(spans, _CID, pc.coalesce(cids, arrays.text(spans, _CID)))
    old_turns = (
        spans.column(_TURN).cast(pa.int64())
        if arrays.has_column(spans, _TURN)
        else pa.nulls(spans.num_rows, pa.int64())
    )
    return _set(spans, _TURN, pc.coalesce(turns, old_turns))
