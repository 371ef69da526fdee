"""What the live classifier holds of the spans it received: each conversation's spans for
as long as a later turn could still link to them, nothing older.

Spans are grouped into *units*, the smallest sets the turn pipeline needs together:

- a conversation (``gen_ai.conversation.id``), with the untagged spans (vLLM's own request
  spans, HTTP spans) that ``kvobs.turns.correlate`` gives it: a span goes to its nearest
  tagged ancestor's conversation (``correlate.nearest_tagged``), else to its trace's when
  the trace holds one conversation only. Several conversations may share a trace (a
  client's, which the proxy continues); an untagged span of such a trace with no known
  tagged ancestor is in none of them (as correlate leaves it), kept aside until its
  ancestor arrives. Spans arrive in any order: a trace's untagged spans are placed again
  whenever a span of the trace arrives, and move when their place changes;
- the id-less pool: spans of no known conversation (fleets behind vllm-router or
  llm-d, whose turns ``kvobs.turns.lineage`` links by prefix chains), until a pass has
  classified their turn. The turn's spans are then *adopted* (``adopt``): they move into
  the unit of the turn it extends (so a conversation's turns stay together for as long
  as it goes on, as a client's conversation does), else of the turns it may extend
  (equal histories), else into a unit of the conversation lineage named. Later id-less
  spans of an adopted trace or request, and pooled ones whose trace or request has a
  unit by now (``_settle``), go there; so does D's release of a client's turn. A unit
  kvobs named (``derived``: ``lineage:``, or the proxy's ``anonymous:``) whose turn
  lineage puts after another unit's turn merges into that unit, and its name becomes an
  alias of it.

A unit that received spans since the last pass is *dirty*; a pass re-correlates and
re-classifies the dirty units only. Lineage still needs what the clean units hold: a
prompt may extend another conversation's export, equal another's prompt, or share an
export with another's fork. A pass takes along the lineage spans of the clean units
lineage could link the dirty ones to (``SpanBuffer._linkable``: found by the keys
lineage matches under, not by reading the window) and one span per D engine start
(restarts). Classified whole instead: a derived unit it reaches (its keys are lineage's,
which the dirty turns may change: a fork that started earlier), a unit whose turns
extend a dirty turn (a late export or release changes their facts), and a unit whose
chain start a dirty export or prompt may precede (``_starts``: an id-less turn, or a
client's later turn, that came first). Every span is converted to Arrow once
(``ArrowSpans``), not once for every pass it takes part in. A unit idle for longer
than ``window_s`` (D's TTL plus a margin: no later turn can read its KV any more) is
dropped, with every turn it holds (an id-less conversation's too, however long it went
on), unless a unit that stays extends its turns. A span that arrives for a dropped
conversation is *late* (counted, kept in the span store, not classified) or, where the
service recalls (``recalls``), held until the conversation's spans are read back from
the span store (``returning``, ``revive``; kvobs.live.recall). No I/O here.
"""

from __future__ import annotations

import bisect
import collections
import itertools
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import pyarrow as pa

from kvobs import semconv as sc
from kvobs.sources._frame import conformed, table_from_rows
from kvobs.turns import arrays
from kvobs.prefix_chain import parse
from kvobs.turns.correlate import nearest_tagged

_CID = sc.CONVERSATION_ID.key
_CHAIN = sc.PREFIX_LINEAGE.key
_RID = sc.REQUEST_ID.key
_REMOTE_RID = sc.REMOTE_REQUEST_ID.key
_DECISION = sc.SPAN_PULL_DECISION.name
_EXPORT = sc.SPAN_EXPORT.name
_RELEASE = sc.SPAN_RELEASE.name
_ENDPOINT, _STARTED, _ENGINE = (
    sc.ENGINE_ENDPOINT.key,
    sc.ENGINE_STARTED_AT.key,
    sc.ENGINE_ID.key,
)
# What prefix lineage reads of every turn (kvobs.turns.lineage: prompts, D's exports, releases
# and restarts): a pass adds these spans of the clean units it links to the dirty ones, so
# a prompt is matched against every export in the window it could extend, as a batch
# over all spans is.
LINEAGE_SPANS = frozenset(
    span.name
    for span in (
        sc.SPAN_PULL_DECISION,
        sc.SPAN_EXPORT,
        sc.SPAN_RELEASE,
        sc.SPAN_DECODE_REQUEST,
        sc.SPAN_HANDOFF,
    )
)
# D's spans, which show its engine's start (lineage's restarts). An export among them,
# as context, is a candidate only for a prompt that probes its key, whose unit then
# comes along anyway.
_ENGINE_SPANS = LINEAGE_SPANS - {sc.SPAN_PULL_DECISION.name}
IDLESS = "\x00idless"  # the id-less pool's unit key (no conversation id can be this)
# Spans held for dropped conversations until their recall (``SpanBuffer.returning``); past
# it they are late, as without recalls.
MAX_RETURNING = 100_000


def derived(key: str) -> bool:
    """Whether a unit's key is a name kvobs gave (lineage's, or the proxy's for a turn
    sent without an id), which lineage may replace, unlike a client's id."""
    return key.startswith((sc.LINEAGE_PREFIX, sc.ANONYMOUS_PREFIX))


class ArrowSpans:
    """The buffer's spans as the span table, each converted once: the spans that arrived
    since the last pass become one table (one ``table_from_rows`` call), and a pass takes
    its spans from the tables by serial number. When the tables get many, the spans still
    held are merged into one (a long conversation's spans would otherwise keep every
    table since it began)."""

    def __init__(self, merge_at: int = 16):
        self._pending: dict[int, dict] = {}  # serial -> row not converted yet
        self._tables: list[tuple[np.ndarray, pa.Table]] = []  # (sorted serials, their spans)
        self._merge_at = merge_at

    def add(self, serial: int, row: dict) -> None:
        self._pending[serial] = row

    def take(self, serials: np.ndarray) -> pa.Table:
        """The spans of ``serials`` (sorted, distinct, all held), in serial order."""
        if self._pending:
            held = np.fromiter(self._pending, np.int64)
            self._tables.append((held, _without_nulls(table_from_rows(self._pending.values()))))
            self._pending = {}
        parts = []
        for held, table in self._tables:
            at = np.searchsorted(held, serials)
            found = at < len(held)
            found[found] &= held[at[found]] == serials[found]
            taken = int(found.sum())
            if taken == len(held):  # all of it (the spans new since the last pass)
                parts.append(table)
            elif taken:
                parts.append(table.take(arrays.array(at[found])))
        if not parts:
            return table_from_rows([])
        return conformed(pa.concat_tables(parts, promote_options="default"))

    def earliest_serial(self) -> int | None:
        """The lowest serial held (of a few more: a table keeps a span that left until
        the tables are merged)."""
        firsts = [int(serials[0]) for serials, _ in self._tables if len(serials)]
        if self._pending:
            firsts.append(next(iter(self._pending)))  # serials are added in order
        return min(firsts) if firsts else None

    def merge_due(self, held: int | None) -> bool:
        """Whether to merge: the tables are many, or they convert over twice the spans
        still held (``held``, given when conversations left)."""
        if len(self._tables) >= self._merge_at:
            return True
        return held is not None and sum(len(table) for _, table in self._tables) > 2 * held

    def keep_only(self, serials: np.ndarray) -> None:
        """Forget every span but ``serials`` (sorted, distinct): one table of them."""
        self._tables = [(serials, _without_nulls(self.take(serials)))] if len(serials) else []
        self._pending = {}


def _without_nulls(table: pa.Table) -> pa.Table:
    """Most of the ~130 span columns are null in any one batch: not held (``take``
    gives them back)."""
    return table.select([n for n in table.column_names if table.column(n).null_count < len(table)])


def _requests(row: dict) -> list[str]:
    """The request ids a span names: its own, and the P request D pulled from."""
    return [r for r in (row.get(_RID), row.get(_REMOTE_RID)) if isinstance(r, str)]


def _indexed(unit: str, row: dict) -> bool:
    """Whether a span of ``unit`` is found by its requests (``SpanBuffer._request_home``):
    every span of a derived unit and every untagged one; of a client's tagged spans only
    D's export, what a release names (nothing else goes to a client's conversation by
    request)."""
    return derived(unit) or row.get(_CID) is None or row.get("name") == _EXPORT


def _serials(keys: Iterable[int]) -> np.ndarray:
    return np.unique(np.fromiter(keys, np.int64))


@dataclass
class Unit:
    # Keyed by the span's serial number, in arrival order: an untagged span moves out in O(1).
    rows: dict[int, dict] = field(default_factory=dict)
    lineage: dict[int, dict] = field(default_factory=dict)  # its rows named in LINEAGE_SPANS
    traces: set[str] = field(default_factory=set)
    last_arrival: float = 0.0
    began: float = 0.0  # when its first span was received (the service's clock)
    # The hashes its exports and prompts are found under (the hash of lineage.index_key), a
    # superset: a span that moved out leaves its hash behind (the unit then comes along for
    # nothing).
    keys: set[int] = field(default_factory=set)
    # Id-less spans it holds by trace (adopted, or sent after their trace or request
    # was): a tagged span of the trace takes them back.
    homed: dict[str | None, list[int]] = field(default_factory=dict)
    # How many of its spans name each request (SpanBuffer._request_home points here).
    requests: collections.Counter[str] = field(default_factory=collections.Counter)
    aliases: set[str] = field(default_factory=set)  # derived keys merged into it
    starts: set[int] = field(default_factory=set)  # its keys in SpanBuffer._starts
    started: set[str] = field(default_factory=set)  # P requests whose prompts are in it


@dataclass
class _Trace:
    """A trace with some conversation's spans: what places its untagged spans."""

    tagged: dict[str, str] = field(default_factory=dict)  # span id -> conversation
    owners: set[str] = field(default_factory=set)  # conversations in the buffer with spans here
    # Conversations ever seen here: one that left keeps the trace shared (correlate over
    # every span would still see it).
    seen: set[str] = field(default_factory=set)
    untagged: dict[int, dict] = field(default_factory=dict)  # serial -> row
    placed: dict[int, str | None] = field(default_factory=dict)  # serial -> its unit


def places(trace: _Trace) -> list[str | None]:
    """The conversation of each of ``trace``'s untagged spans (in ``untagged`` order) as
    ``correlate._inherit_keys`` gives it: the nearest tagged ancestor's, else the trace's
    when it holds one conversation, else none. Pure."""
    rows = list(trace.untagged.values())
    tagged_ids = list(trace.tagged)
    index: dict[str, int] = {}
    for i, span_id in enumerate([*tagged_ids, *(row.get("span_id") for row in rows)]):
        if span_id is not None:
            index.setdefault(span_id, i)
    parents = np.array(
        [-1] * len(tagged_ids) + [index.get(row.get("parent_span_id") or "", -1) for row in rows],
        np.int64,
    )
    is_tagged = np.arange(len(parents)) < len(tagged_ids)
    ancestors = nearest_tagged(parents, is_tagged)[len(tagged_ids) :]
    only = next(iter(trace.seen)) if len(trace.seen) == 1 else None
    return [trace.tagged[tagged_ids[a]] if a >= 0 else only for a in ancestors.tolist()]


class SpanBuffer:
    def __init__(self, window_s: float, forget_after: int = 100_000):
        self.window_s = window_s
        self.units: dict[str, Unit] = {}
        self._traces: dict[str, _Trace] = {}  # traces holding some unit's tagged spans
        # id-less spans by trace (serial -> row): moved into a conversation when a tagged
        # span claims it
        self._idless: dict[str | None, dict[int, dict]] = collections.defaultdict(dict)
        self._idless_seen: dict[str | None, float] = {}
        self._idless_dirty = False
        self._dirty: set[str] = set()
        # Which units hold an export or a prompt found under a lineage key, by the key's hash
        # alone, as a number: a prompt's probes are then its chain's hashes in one
        # conversion (``Chain.hash_numbers``), not ~90 keys built (a hash names its prefix,
        # so scope and point add nothing but a rare false match, which brings a unit along
        # as context for nothing: lineage.link matches whole keys).
        self._units_by_key: dict[int, set[str]] = collections.defaultdict(set)
        # (D endpoint, engine start, engine id) -> the latest span that shows it: the
        # restarts lineage reads, whichever conversations' spans show them.
        self._engines: dict[tuple, int] = {}
        # D request -> the units whose turns extend its export (or name it among equal
        # candidates), as the last pass that classified them found.
        self._extended_by: dict[str, set[str]] = collections.defaultdict(set)
        # Where id-less spans go once their turn is adopted: by trace, and by request id
        # (the ids a span names, P's and D's: of every span of a derived unit, every
        # untagged span, and a client's D exports).
        self._trace_home: dict[str, str] = {}
        self._request_home: dict[str, str] = {}
        self._pool_requests: dict[str, set[str | None]] = collections.defaultdict(set)
        self._alias: dict[str, str] = {}  # a derived key merged away -> the unit's key
        # Every checkpoint hash of the prompts of turns that extend nothing (chain
        # starts: id-less turns, and clients' turns after their first) -> their units:
        # a turn that arrives after its successor was linked (out of order) brings the
        # successor's unit along by its export's or prompt's key. A later turn is found
        # anyway, through the turn it extends.
        self._starts: dict[int, set[str]] = collections.defaultdict(set)
        # Conversations dropped lately (bounded), with when each began: a span of one is
        # late, or, where ``recalls``, held in ``returning`` until the conversation is
        # recalled from the span store (``revive``).
        self._dropped: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._forget_after = forget_after
        self.late_spans = 0
        self.recalls = False
        self.returning: dict[str, list[dict]] = {}
        self._returning_spans = 0
        self._arrow = ArrowSpans()
        self._next_serial = 0
        # (first serial, when received): the spans from that serial to the next mark's
        # were received then or within a second after (``held_since``).
        self._received: list[tuple[int, float]] = []

    def __len__(self) -> int:
        unplaced = sum(
            1 for trace in self._traces.values() for unit in trace.placed.values() if unit is None
        )
        return (
            sum(len(u.rows) for u in self.units.values())
            + sum(len(r) for r in self._idless.values())
            + unplaced
        )

    def add(self, rows: list[dict], now: float, received: float | None = None) -> None:
        """Spans as ``kvobs.sources._rows`` decodes them (coerced rows), taken ``now``;
        ``received``: when the service received them, if before (a restart's replay)."""
        self._mark_received(now if received is None else received)
        touched: set[str] = set()  # traces whose untagged spans are placed again
        for row in rows:
            cid = row.get(_CID)
            trace = row.get("trace_id")
            if cid is None:
                serial = self._hold(row)
                if trace is not None and trace in self._traces:
                    self._traces[trace].untagged[serial] = row
                    touched.add(trace)
                elif (home := self._home_of(trace, row)) is not None:
                    self._home(home, trace, serial, row)
                    self.units[home].last_arrival = now
                else:
                    self._idless[trace][serial] = row
                    self._idless_seen[trace] = now
                    self._idless_dirty = True
                    for request in _requests(row):
                        self._pool_requests[request].add(trace)
                continue
            cid = self._alias.get(cid, cid)
            if cid in self._dropped and cid not in self.units:
                if self.recalls and not derived(cid) and self._returning_spans < MAX_RETURNING:
                    self.returning.setdefault(cid, []).append(row)
                    self._returning_spans += 1
                else:
                    self.late_spans += 1
                continue
            unit = self.units.get(cid)
            if unit is None:
                unit = self.units[cid] = Unit(began=now if received is None else received)
            self._keep(cid, self._hold(row), row)
            unit.last_arrival = now
            if trace is not None:
                self._claim(trace, cid, row)
                unit.traces.add(trace)
                touched.add(trace)
        for trace in touched:
            self._place(trace, now)

    def returning_since(self, most: int) -> dict[str, float]:
        """Up to ``most`` of the dropped conversations that got spans again
        (``returning``), those that came back first, with when each began: what a recall
        reads from the span store."""
        return {cid: self._dropped.get(cid, 0.0) for cid in itertools.islice(self.returning, most)}

    def revive(
        self, cid: str, recalled: list[dict], now: float, received: float | None = None
    ) -> None:
        """Hold ``cid`` again: its spans ``recalled`` from the span store (received by
        ``received``), then those that came while it was dropped and the store did not
        have yet. A span held already (an untagged one, in the pool) is taken once."""
        for named in {cid} | {r[_CID] for r in recalled if isinstance(r.get(_CID), str)}:
            if named not in self.units:
                self._dropped.pop(named, None)  # held again, not late
        came = self.returning.pop(cid, [])
        self._returning_spans -= len(came)
        held = self._keys_held({r["trace_id"] for r in recalled if r.get("trace_id") is not None})
        recalled = [r for r in recalled if (r.get("trace_id"), r.get("span_id")) not in held]
        have = held | {(r.get("trace_id"), r.get("span_id")) for r in recalled}
        if recalled:
            self.add(recalled, now, received)
        came = [r for r in came if (r.get("trace_id"), r.get("span_id")) not in have]
        if came:
            self.add(came, now)

    def give_up(self, cids: Iterable[str]) -> None:
        """The spans held for ``cids`` are late after all (their recall failed)."""
        for cid in cids:
            came = self.returning.pop(cid, [])
            self._returning_spans -= len(came)
            self.late_spans += len(came)

    def _keys_held(self, traces: set[str]) -> set[tuple]:
        """(trace id, span id) of the spans held in ``traces``: those a held
        conversation's id tags, and the untagged ones (the pool's, a trace's, a unit's
        adopted ones)."""
        keys: set[tuple] = set()
        for trace in traces:
            pools: list[Iterable[dict]] = [self._idless.get(trace, {}).values()]
            if trace in self._traces:
                pools.append(self._traces[trace].untagged.values())
                keys.update((trace, span) for span in self._traces[trace].tagged)
            home = self.units.get(self._trace_home.get(trace, ""))
            if home is not None:
                pools.append(
                    home.rows[serial] for serial in home.homed.get(trace, ()) if serial in home.rows
                )
            for pool in pools:
                keys.update((row.get("trace_id"), row.get("span_id")) for row in pool)
        return keys

    def _mark_received(self, at: float) -> None:
        """Note that the spans from the next serial on were received at ``at`` or later:
        a mark a second at most (and one whenever the clock steps back)."""
        if self._received:
            serial, marked = self._received[-1]
            if serial == self._next_serial:  # no span came under the last mark
                self._received.pop()
            elif 0 <= at - marked < 1.0:
                return
        self._received.append((self._next_serial, at))

    def _hold(self, row: dict) -> int:
        serial = self._next_serial
        self._next_serial += 1
        self._arrow.add(serial, row)
        if row.get("name") in _ENGINE_SPANS and row.get(_STARTED) is not None:
            self._engines[(row.get(_ENDPOINT), row[_STARTED], row.get(_ENGINE))] = serial
        return serial

    def _home_of(self, trace: str | None, row: dict) -> str | None:
        """The unit an id-less span goes to: its trace's, once adopted, or its
        request's. A client's conversation takes by request only D's release (which
        lineage reads, by request, and no turn holds): another untagged span in a trace
        of its own may still be claimed by a tagged span of that trace, as correlate
        places it."""
        home = self._trace_home.get(trace) if trace is not None else None
        if home is None:
            known = (r for r in _requests(row) if r in self._request_home)
            home = next((self._request_home[r] for r in known), None)
            if home is not None and not derived(home) and row.get("name") != _RELEASE:
                return None
        return home if home in self.units else None

    def _home(
        self, key: str, trace: str | None, serial: int, row: dict, dirty: bool = True
    ) -> None:
        self._keep(key, serial, row, dirty)
        self.units[key].homed.setdefault(trace, []).append(serial)
        if trace is not None:
            self._trace_home[trace] = key

    def _claim(self, trace: str, cid: str, row: dict) -> None:
        """Note a tagged span in its trace; the first takes the trace's id-less spans
        (from the pool, or the unit that adopted them)."""
        known = self._traces.get(trace)
        if known is None:
            known = self._traces[trace] = _Trace()
            claimed = self._leave_pool(trace)
            if trace in self._trace_home:
                claimed.update(self._unhome(trace))
            known.untagged.update(claimed)
        if row.get("span_id") is not None:
            known.tagged.setdefault(row["span_id"], cid)
        known.owners.add(cid)
        known.seen.add(cid)

    def _place(self, trace_id: str, now: float) -> None:
        """Put each untagged span of the trace where ``places`` says; a span that moves
        (its ancestor arrived, or a second conversation made the trace shared) leaves
        its former unit, which is re-classified too."""
        trace = self._traces[trace_id]
        if not trace.untagged:  # most traces: every span tagged, nothing to place
            return
        for key, cid in zip(list(trace.untagged), places(trace)):
            if key in trace.placed and trace.placed[key] == cid:
                continue
            row = trace.untagged[key]
            former_key = trace.placed.get(key) or ""
            former = self.units.get(former_key)
            if former is not None:
                former.rows.pop(key, None)
                former.lineage.pop(key, None)
                self._unindex(former_key, row)
                self._dirty.add(former_key)
            trace.placed[key] = cid
            if cid is not None:
                self._keep(cid, key, row)
                self.units[cid].last_arrival = now

    def _leave_pool(self, trace: str | None, changed: bool = True) -> dict[int, dict]:
        """Take a trace's spans out of the id-less pool (``changed``: the pool's turns
        change, it is classified again)."""
        taken = self._idless.pop(trace, None)
        self._idless_seen.pop(trace, None)
        if not taken:
            return {}
        self._idless_dirty |= changed
        for row in taken.values():
            for request in _requests(row):
                traces = self._pool_requests.get(request)
                if traces is not None:
                    traces.discard(trace)
                    if not traces:
                        del self._pool_requests[request]
        return taken

    def _unhome(self, trace: str) -> dict[int, dict]:
        """Take an adopted trace's spans out of their unit (re-classified without them)."""
        key = self._trace_home.pop(trace)
        unit = self.units[key]
        taken = {}
        for serial in unit.homed.pop(trace, ()):
            row = unit.rows.pop(serial, None)
            if row is not None:
                taken[serial] = row
                unit.lineage.pop(serial, None)
                self._unindex(key, row)
        self._dirty.add(key)
        return taken

    def _unindex(self, key: str, row: dict) -> None:
        if not _indexed(key, row):
            return
        counts = self.units[key].requests
        for request in _requests(row):
            if counts[request] > 1:
                counts[request] -= 1
                continue
            counts.pop(request, None)
            if self._request_home.get(request) == key:
                del self._request_home[request]

    def _keep(self, cid: str, serial: int, row: dict, dirty: bool = True) -> None:
        unit = self.units[cid]
        unit.rows[serial] = row
        if dirty:
            self._dirty.add(cid)
        if _indexed(cid, row):
            for request in _requests(row):
                self._request_home[request] = cid
                unit.requests[request] += 1
        if row.get("name") not in LINEAGE_SPANS:
            return
        unit.lineage[serial] = row
        chain = parse(row.get(_CHAIN))
        if chain is not None:
            key = chain.key_number()
            unit.keys.add(key)
            self._units_by_key[key].add(cid)

    def take_dirty(self) -> tuple[list[str], pa.Table | None]:
        """The dirty units' keys and their spans (with the id-less pool's: its turns
        need each other's), as the span table in arrival order (None: nothing is dirty);
        marks them clean. With them, as context, the lineage spans of the clean units
        lineage could link them to (``_linkable``), and the spans that show each D
        engine's start. A derived unit among those is taken whole and classified (the
        pass may change its turns' keys), as is one whose turns extend a dirty turn.
        Turns of clean units the pipeline makes of context spans are partial: not the
        pass's to keep."""
        self._settle()
        keys = [key for key in self._dirty if key in self.units]
        self._dirty.clear()
        if not keys and not self._idless_dirty:
            return [], None
        found, following = self._linkable(keys)
        joined = [key for key in found if key in following or derived(key)]
        keys.extend(joined)
        serials: list[Iterable[int]] = [self.units[key].rows for key in keys]
        serials.extend(self.units[key].lineage for key in found.difference(joined))
        if self._idless_dirty:
            self._idless_dirty = False
            keys.append(IDLESS)
        serials.extend(self._idless.values())
        serials.append(self._engines.values())
        return keys, self._arrow.take(_serials(itertools.chain.from_iterable(serials)))

    def _settle(self) -> None:
        """Move each pooled trace whose trace or request has a unit by now (a D span
        that came before the span naming its request) to that unit."""
        for trace, pooled in list(self._idless.items()):
            home = next(filter(None, (self._home_of(trace, row) for row in pooled.values())), None)
            if home is not None:
                for serial, row in self._leave_pool(trace, changed=False).items():
                    self._home(home, trace, serial, row)

    def mark_dirty(self, unit: str) -> None:
        """Classify ``unit`` again next pass, though it received no span."""
        if unit in self.units:
            self._dirty.add(unit)

    def note_links(self, unit: str, requests: Iterable[str]) -> None:
        """A turn of ``unit`` extends the turns of ``requests`` (P's or D's: lineage
        found): when one of those units is classified again, ``unit`` comes along, as
        lineage numbers a second turn extending the same export as a fork, and a turn
        whose predecessor's export arrives late extends it."""
        if unit in self.units:
            for request in requests:
                self._extended_by[request].add(unit)

    def holder(self, conversation_id: str, requests: tuple) -> str | None:
        """The unit whose spans made a turn of ``conversation_id`` (as the pass keyed it)
        whose spans name ``requests`` (its P and D request): the pool (``IDLESS``) when
        its P request's spans are there (a turn of context spans and a pooled D span is
        not the pool's), a client's conversation, the unit holding those requests'
        spans, or the unit the key names; None: no unit."""
        named = [r for r in requests if isinstance(r, str)]
        if requests and requests[0] in self._pool_requests:
            return IDLESS
        if not derived(conversation_id) and conversation_id in self.units:
            return conversation_id
        for request in named:
            if (home := self._request_home.get(request)) in self.units:
                return home
        key = self._alias.get(conversation_id, conversation_id)
        return key if key in self.units else None

    def adopt(
        self,
        unit: str,
        conversation_id: str,
        requests: Iterable[str | None],
        trace: str | None,
        parent: Iterable[str],
        candidates: Iterable[str] = (),
    ) -> tuple[str, list[str]]:
        """Keep a turn the pass classified from ``unit`` with the turns lineage read to
        key it, as long as it is kept: its ``parent`` (request ids of the turn it
        extends), else its equal ``candidates`` (D requests), else its conversation. A
        pool turn's spans (those of its ``trace`` and those naming its ``requests``)
        move there; a derived unit holding the turn or a candidate merges into it. A
        client's conversation stays where it is. Returns (the turn's unit now, the units
        merged away). Not dirty for it: the pass classified them together."""
        if unit != IDLESS and not derived(unit):
            return unit, []
        homes = [
            self._request_home[r]
            for r in (*parent, *candidates)
            if self._request_home.get(r) in self.units
        ]
        target = homes[0] if homes else self._alias.get(conversation_id, conversation_id)
        if unit == IDLESS:
            traces = {trace}.union(*(self._pool_requests.get(r, ()) for r in requests if r))
            home = self.units.setdefault(target, Unit())
            for pooled in traces:
                home.last_arrival = max(home.last_arrival, self._idless_seen.get(pooled, 0.0))
                for serial, row in self._leave_pool(pooled, changed=False).items():
                    self._home(target, pooled, serial, row, dirty=False)
        elif target not in self.units:
            target = unit
        if not homes:
            self.index_start(target, next(iter(requests), None))
        merged = []
        for other in dict.fromkeys([unit, *homes[1:]]):
            if other != target and other in self.units and derived(other):
                self._merge(other, target)
                merged.append(other)
        return target, merged

    def index_start(self, key: str, p_request: str | None) -> None:
        """Index the prompt of ``key``'s turn ``p_request``, a chain start, at every
        checkpoint (``_starts``): an export that arrives later under one of them brings
        the unit along, classified whole."""
        unit = self.units.get(key)
        if unit is None or p_request is None or p_request in unit.started:
            return
        for row in unit.lineage.values():
            if row.get("name") == _DECISION and row.get(_RID) == p_request:
                if (chain := parse(row.get(_CHAIN))) is not None:
                    unit.started.add(p_request)  # not before: its decision may come later
                    for hashed in chain.hash_numbers():
                        self._starts[hashed].add(key)
                        unit.starts.add(hashed)

    def _merge(self, source: str, target: str) -> None:
        """``source``'s spans, indexes and name go to ``target``."""
        unit, into = self.units.pop(source), self.units[target]
        into.rows.update(unit.rows)
        into.lineage.update(unit.lineage)
        into.last_arrival = max(into.last_arrival, unit.last_arrival)
        into.began = min(filter(None, (into.began, unit.began)), default=0.0)  # 0: not known
        for key in unit.keys:
            self._units_by_key[key].discard(source)
            self._units_by_key[key].add(target)
        into.keys |= unit.keys
        for hashed in unit.starts:
            self._starts[hashed].discard(source)
            self._starts[hashed].add(target)
        into.starts |= unit.starts
        into.started |= unit.started
        for trace, serials in unit.homed.items():
            into.homed.setdefault(trace, []).extend(serials)
            if trace is not None:
                self._trace_home[trace] = target
        into.requests.update(unit.requests)
        for request in unit.requests:
            if self._request_home.get(request) == source:
                self._request_home[request] = target
        for alias in (*unit.aliases, source):
            self._alias[alias] = target
            into.aliases.add(alias)
        for trace_id in unit.traces:
            known = self._traces.get(trace_id)
            if known is None:
                continue
            known.tagged = {s: target if c == source else c for s, c in known.tagged.items()}
            known.placed = {s: target if c == source else c for s, c in known.placed.items()}
            for names in (known.owners, known.seen):
                if source in names:
                    names.discard(source)
                    names.add(target)
        into.traces |= unit.traces
        if source in self._dirty:
            self._dirty.discard(source)
            self._dirty.add(target)

    def _linkable(self, dirty: list[str]) -> tuple[set[str], set[str]]:
        """The clean units lineage may link the dirty units' and the pool's turns to:
        those holding an export or a prompt under a hash of their prompts' chains
        (``Chain.hashes``), those whose turns extend one of their turns
        (``note_links``), and so on from those, as lineage walks on: every candidate
        lineage could match over every span in the window. With them, those of the
        units whose turns extend a dirty unit's or the pool's turn: what changed there
        (an export or a release that came late) changes their lineage facts."""
        taken = set(dirty)
        found: set[str] = set()
        following: set[str] | None = None
        rows: Iterable[dict] = itertools.chain(
            (row for key in dirty for row in self.units[key].lineage.values()),
            (row for pooled in self._idless.values() for row in pooled.values()),
        )
        while True:
            probed: set[int] = set()
            new: set[str] = set()
            for row in rows:
                if (request := row.get(_RID)) in self._extended_by:
                    new.update(self._alias.get(u, u) for u in self._extended_by[request])
                if (chain := parse(row.get(_CHAIN))) is not None:
                    probed.update(chain.hash_numbers())
                    new |= self._starts.get(chain.key_number(), set())
            if following is None:
                following = {unit for unit in new - taken if unit in self.units}
            for key in probed:
                new |= self._units_by_key.get(key, set())
            new = {unit for unit in new - taken if unit in self.units}
            if not new:
                return found, following
            taken |= new
            found |= new
            rows = [row for key in new for row in self.units[key].lineage.values()]

    def held_since(self) -> float | None:
        """When the service received the earliest span the buffer holds (its own clock,
        not the emitters': Unix seconds; None: none held), within a second, never later:
        a restart that replays the live segments written since then holds what this
        buffer does, conversations that went on past the window included."""
        earliest = self._arrow.earliest_serial()
        if earliest is None:
            self._received.clear()
            return None
        # The mark whose range holds the earliest serial, and every later one (a clock
        # stepped back marks later spans earlier); those before it are needed no more.
        first = bisect.bisect_right(self._received, earliest, key=lambda mark: mark[0]) - 1
        del self._received[: max(first, 0)]
        return min(at for _, at in self._received) if self._received else None

    def rows_of(self, key: str) -> list[dict]:
        if key == IDLESS:
            return [row for pooled in self._idless.values() for row in pooled.values()]
        unit = self.units.get(key)
        return list(unit.rows.values()) if unit is not None else []

    def expire(self, now: float) -> list[str]:
        """Drops units idle past the window, but those whose turns a unit kept extends
        (``note_links``: a fork goes on after its parent's conversation went idle, and
        lineage still numbers it from there); returns the dropped keys."""
        horizon = now - self.window_s
        leaving = {key for key, unit in self.units.items() if unit.last_arrival < horizon}
        while needed := {key for key in leaving if self._extended_from_outside(key, leaving)}:
            leaving -= needed
        gone = sorted(leaving)
        for key in gone:
            unit = self.units.pop(key)
            for trace in unit.traces:
                self._leave(trace, key)
            for lineage_key in unit.keys:
                holders = self._units_by_key[lineage_key]
                holders.discard(key)
                if not holders:
                    del self._units_by_key[lineage_key]
            for row in unit.lineage.values():
                self._extended_by.pop(str(row.get(_RID)), None)
            for hashed in unit.starts:
                holders = self._starts[hashed]
                holders.discard(key)
                if not holders:
                    del self._starts[hashed]
            for homed in unit.homed:
                if homed is not None and self._trace_home.get(homed) == key:
                    del self._trace_home[homed]
            for request in unit.requests:
                if self._request_home.get(request) == key:
                    del self._request_home[request]
            for name in (*unit.aliases, key):
                self._alias.pop(name, None)
                self._dropped[name] = unit.began
                self._dropped.move_to_end(name)
        while len(self._dropped) > self._forget_after:
            self._dropped.popitem(last=False)
        stale = [t for t, seen in self._idless_seen.items() if seen < horizon]
        for idle in stale:  # spans no turn took: the pool is not re-classified for them
            self._leave_pool(idle, changed=False)
        if self._arrow.merge_due(len(self) if gone or stale else None):
            held = _serials(self._held())
            self._arrow.keep_only(held)
            kept = set(held.tolist())
            self._engines = {e: serial for e, serial in self._engines.items() if serial in kept}
            for d_request, units in list(self._extended_by.items()):
                units.intersection_update(self.units)  # the pool's exports are no unit's to drop
                if not units:
                    del self._extended_by[d_request]
        return gone

    def _extended_from_outside(self, key: str, leaving: set[str]) -> bool:
        """Whether a unit not ``leaving`` has turns that extend ``key``'s turns."""
        for row in self.units[key].lineage.values():
            for unit in self._extended_by.get(str(row.get(_RID)), ()):
                unit = self._alias.get(unit, unit)
                if unit != key and unit not in leaving and unit in self.units:
                    return True
        return False

    def _held(self) -> Iterable[int]:
        yield from itertools.chain.from_iterable(unit.rows for unit in self.units.values())
        for trace in self._traces.values():  # spans of no unit yet
            yield from (key for key, unit in trace.placed.items() if unit is None)
            yield from (key for key in trace.untagged if key not in trace.placed)
        yield from itertools.chain.from_iterable(self._idless.values())

    def _leave(self, trace_id: str, cid: str) -> None:
        """Forget a dropped conversation in a trace: its tagged span ids and the untagged
        spans placed in it; the whole trace (its unplaced spans too) once no conversation
        in the buffer has spans there."""
        trace = self._traces.get(trace_id)
        if trace is None:
            return
        trace.owners.discard(cid)
        if not trace.owners:
            del self._traces[trace_id]
            return
        trace.tagged = {span: owner for span, owner in trace.tagged.items() if owner != cid}
        for key in [k for k, unit in trace.placed.items() if unit == cid]:
            del trace.placed[key], trace.untagged[key]
