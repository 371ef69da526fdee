"""What the live classifier holds of the spans it received: each conversation's spans for
as long as a later turn could still link to them, nothing older.

Spans are grouped into *units*, the smallest sets the turn pipeline needs together:

- a conversation (``gen_ai.conversation.id``), with the untagged spans of its traces
  (vLLM's own request spans, HTTP spans), as ``diagnose`` selects them;
- the id-less pool: spans of no known conversation (fleets behind vllm-router or
  llm-d, whose turns ``kvobs.turns.lineage`` links by prefix chains), kept by arrival time.

A unit that received spans since the last pass is *dirty*; a pass re-correlates and
re-classifies the dirty units only. A unit idle for longer than ``window_s`` (D's TTL
plus a margin: no later turn can read its KV any more) is dropped; a span that arrives
for a dropped conversation is *late*: counted, kept in the span store, not classified.
No I/O here.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from kvobs import semconv as sc

_CID = sc.CONVERSATION_ID.key
# What prefix lineage reads of every turn (kvobs.turns.lineage: prompts, D's exports, releases
# and restarts): a pass adds these spans of the clean units to the dirty ones, so a
# prompt is matched against every export in the window, as a batch over all spans is.
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
IDLESS = "\x00idless"  # the id-less pool's unit key (no conversation id can be this)


@dataclass
class Unit:
    rows: list[dict] = field(default_factory=list)
    lineage: list[dict] = field(default_factory=list)  # its rows named in LINEAGE_SPANS
    traces: set[str] = field(default_factory=set)
    last_arrival: float = 0.0
    dirty: bool = False


class SpanBuffer:
    def __init__(self, window_s: float, forget_after: int = 100_000):
        self.window_s = window_s
        self.units: dict[str, Unit] = {}
        self._owner: dict[str, str] = {}  # trace id -> conversation unit
        # id-less spans by trace: moved into a conversation when a tagged span claims it
        self._idless: dict[str | None, list[dict]] = collections.defaultdict(list)
        self._idless_seen: dict[str | None, float] = {}
        self._idless_dirty = False
        # Conversations dropped lately (bounded): their spans are late, not new units.
        self._dropped: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._forget_after = forget_after
        self.late_spans = 0

    def __len__(self) -> int:
        return sum(len(u.rows) for u in self.units.values()) + sum(
            len(r) for r in self._idless.values()
        )

    def add(self, rows: list[dict], now: float) -> None:
        """Spans as ``kvobs.sources._rows`` decodes them (coerced rows)."""
        for row in rows:
            cid = row.get(_CID)
            trace = row.get("trace_id")
            if cid is None:
                cid = self._owner.get(trace) if trace is not None else None
            if cid is None:
                self._idless[trace].append(row)
                self._idless_seen[trace] = now
                self._idless_dirty = True
                continue
            if cid in self._dropped and cid not in self.units:
                self.late_spans += 1
                continue
            unit = self.units.get(cid)
            if unit is None:
                unit = self.units[cid] = Unit()
            self._keep(unit, row)
            unit.last_arrival = now
            unit.dirty = True
            if trace is not None and trace not in unit.traces:
                unit.traces.add(trace)
                self._owner[trace] = cid
                claimed = self._idless.pop(trace, None)
                if claimed:
                    self._idless_seen.pop(trace, None)
                    for moved in claimed:
                        self._keep(unit, moved)
                    self._idless_dirty = True  # the pool changed too

    @staticmethod
    def _keep(unit: Unit, row: dict) -> None:
        unit.rows.append(row)
        if row.get("name") in LINEAGE_SPANS:
            unit.lineage.append(row)

    def take_dirty(self) -> tuple[list[str], list[dict]]:
        """The dirty units' keys and their spans (the id-less pool whole when any of it
        changed: lineage links its turns across the pool), with the lineage spans of
        the clean units; marks them clean. Turns of clean units the pipeline makes of
        those context spans are partial: not the pass's to keep."""
        keys, rows = [], []
        for key, unit in self.units.items():
            if unit.dirty:
                unit.dirty = False
                keys.append(key)
                rows.extend(unit.rows)
            else:
                rows.extend(unit.lineage)
        if not keys and not self._idless_dirty:
            return [], []
        if self._idless_dirty:
            self._idless_dirty = False
            keys.append(IDLESS)
        for pooled in self._idless.values():  # the pool's turns need each other's
            rows.extend(pooled)
        return keys, rows

    def rows_of(self, key: str) -> list[dict]:
        if key == IDLESS:
            return [row for pooled in self._idless.values() for row in pooled]
        unit = self.units.get(key)
        return list(unit.rows) if unit is not None else []

    def expire(self, now: float) -> list[str]:
        """Drops units idle past the window; returns the dropped conversation keys."""
        horizon = now - self.window_s
        gone = [key for key, unit in self.units.items() if unit.last_arrival < horizon]
        for key in gone:
            for trace in self.units.pop(key).traces:
                self._owner.pop(trace, None)
            self._dropped[key] = None
            self._dropped.move_to_end(key)
        while len(self._dropped) > self._forget_after:
            self._dropped.popitem(last=False)
        stale = [t for t, seen in self._idless_seen.items() if seen < horizon]
        for idle in stale:  # its turns are final: the pool is not re-classified for it
            del self._idless[idle]
            del self._idless_seen[idle]
        return gone
