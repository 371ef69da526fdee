"""The always-on turn classifier: the pipeline ``kvobs diagnose`` runs (correlate,
lineage, timeline, verdicts, causes: ``diagnose.classify_turns`` over
``correlate.turns_from_spans``), pass after pass, over the spans of the conversations
that received spans since the last pass.

A turn's classification is *versioned*: a pass that changes it (a late span, a lineage
resolved by a later turn) makes a new version, latest wins. A turn is *final* once no
pass changed it for ``grace_s``: it is then counted in the turn metrics and written to
the turn store; a final turn that changes later is written again (its next version) and
counted as re-classified, never counted twice.

The fleet context: a turn's reuse gain and ``slow-transfer`` are priced at P's compute
rate, and its decode weighed against the typical decode time per token. ``diagnose``
measures both over the spans it reads; the classifier measures them over its recent
final turns (the first passes, before any turn is final, over their own batch) and
records on every row which it used: ``kvobs diagnose ID --prefill-rate R
--decode-token-time T`` on the same spans gives the same answer.
"""

from __future__ import annotations

import collections
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import pyarrow as pa

from kvobs import columns as col
from kvobs.causes import decode_context
from kvobs.correlate import turns_from_spans
from kvobs.diagnose import TurnDiagnosis, classify_turns
from kvobs.live.buffer import IDLESS, SpanBuffer
from kvobs.sources._frame import drop_duplicate_span_rows, table_from_rows
from kvobs.sources._rows import rows as document_rows
from kvobs.timeline import prefill_rate

TurnKey = tuple[str, str, int]  # tenant, conversation id, turn
# The turn columns the fleet context is measured from (timeline.prefill_rate,
# causes.decode_context): kept for the recent final turns only.
_CONTEXT_COLUMNS = ("recomputed_tokens", "prompt_tokens", "local_hit_tokens",
                    "read_outcome", "phase_p_compute_s", "prefill_leg_s",
                    "phase_decode_s", "output_tokens")


@dataclass
class TurnState:
    row: dict[str, Any]  # the latest classification (turn_row)
    signature: str
    version: int
    changed_at: float
    unit: str
    samples: dict[str, Any]  # its _CONTEXT_COLUMNS, for the fleet context once final
    final: bool = False
    finals: int = 0  # times it was written (first: counted; later: re-classified)


@dataclass
class PassResult:
    classified: int = 0  # turns classified in the pass
    changed: list[TurnKey] = field(default_factory=list)  # new versions
    # rows that became final (written; counted when ``first_final``)
    finalized: list[dict] = field(default_factory=list)
    reclassified: int = 0  # of those, turns that were final before
    seconds: float = 0.0


def turn_row(diagnosis: TurnDiagnosis, prefill_tokens_per_s: float | None,
             decode_s_per_token: float | None) -> dict[str, Any]:
    """One classified turn as the service keeps, serves and stores it: ``diagnose``'s
    JSON of the turn plus its trace id and the fleet context it was classified with."""
    row = diagnosis.to_dict()
    row["trace_id"] = diagnosis.turn.get("trace_id")
    row["context"] = {"prefill_tokens_per_s": prefill_tokens_per_s,
                      "decode_s_per_token": decode_s_per_token}
    return row


def _signature(row: dict[str, Any]) -> str:
    return json.dumps(row, sort_keys=True, default=str)


class Classifier:
    def __init__(self, window_s: float, grace_s: float, read_slo_s: float | None = None,
                 context_turns: int = 10_000):
        self.buffer = SpanBuffer(window_s)
        self.grace_s = grace_s
        self.read_slo_s = read_slo_s
        self.turns: dict[TurnKey, TurnState] = {}
        self._by_unit: dict[str, set[TurnKey]] = collections.defaultdict(set)
        self._by_conversation: dict[str, set[TurnKey]] = collections.defaultdict(set)
        self._samples: collections.deque[dict] = collections.deque(maxlen=context_turns)
        self._context: tuple[float | None, float | None] = (None, None)
        self._context_stale = False
        self.problems: collections.deque[str] = collections.deque(maxlen=100)
        self.spans_received = 0
        self.spans_unreadable = 0

    # ------------------------------------------------------------------ input

    def add_request(self, request: object, now: float | None = None) -> int:
        """One OTLP export request (its JSON form); returns the spans taken."""
        problems: list[str] = []
        rows = document_rows("otlp", request, problems)
        self.problems.extend(problems)
        self.spans_unreadable += sum(1 for p in problems if "skipped" in p)
        self.buffer.add(rows, time.time() if now is None else now)
        self.spans_received += len(rows)
        return len(rows)

    # ------------------------------------------------------------------ passes

    def context(self) -> tuple[float | None, float | None]:
        """P's compute rate and the typical decode time per token, over the recent final
        turns (the same measures ``diagnose`` takes over its spans)."""
        if self._context_stale and self._samples:
            table = col.Columns(pa.Table.from_pylist(list(self._samples)))
            self._context = (prefill_rate(table), decode_context(table).decode_s_per_token)
            self._context_stale = False
        return self._context

    def run_pass(self, now: float | None = None) -> PassResult:
        now = time.time() if now is None else now
        started = time.perf_counter()
        result = PassResult()
        keys, rows = self.buffer.take_dirty()
        if rows:
            result.classified = self._classify(keys, rows, now, result)
        for key, state in self.turns.items():
            if not state.final and now - state.changed_at >= self.grace_s:
                state.final = True
                state.finals += 1
                result.reclassified += state.finals > 1
                result.finalized.append({**state.row, "version": state.version,
                                         "first_final": state.finals == 1})
                if state.finals == 1:
                    self._samples.append(state.samples)
                    self._context_stale = True
        self._forget(self.buffer.expire(now))
        # Id-less turns leave with their spans (the pool's next pass no longer finds
        # them); in a pool that gets no new spans, after twice the window.
        horizon = now - 2 * self.buffer.window_s
        for key in [k for k in self._by_unit.get(IDLESS, ()) if
                    self.turns[k].final and self.turns[k].changed_at < horizon]:
            self._drop(key)
        result.seconds = time.perf_counter() - started
        return result

    def _classify(self, units: list[str], rows: list[dict], now: float,
                  result: PassResult) -> int:
        spans = drop_duplicate_span_rows(table_from_rows(rows), [])
        turns = turns_from_spans(spans, frame=False)
        if turns.num_rows == 0:
            return 0
        rate, per_token = self.context()
        diagnoses, used = classify_turns(col.Columns(turns), self.read_slo_s, rate, per_token)
        unit_of = self._unit_lookup(units)
        seen: set[TurnKey] = set()
        kept = 0
        for diagnosis in diagnoses:
            unit = unit_of(diagnosis.conversation_id)
            if unit is None:
                continue  # a clean unit's partial turn (its lineage spans only)
            kept += 1
            row = turn_row(diagnosis, used.prefill_tokens_per_s, used.decode_s_per_token)
            key = (row["tenant"], row["conversation_id"], row["turn"])
            seen.add(key)
            signature = _signature(row)
            state = self.turns.get(key)
            if state is not None and state.signature == signature:
                continue
            samples = {c: diagnosis.turn.get(c) for c in _CONTEXT_COLUMNS}
            if state is None:
                state = self.turns[key] = TurnState(row, signature, 1, now, unit, samples)
            else:
                state.row, state.signature, state.changed_at = row, signature, now
                state.samples = samples
                state.version += 1
                state.final = False
                if state.unit != unit:
                    self._by_unit[state.unit].discard(key)
                    state.unit = unit
            self._by_unit[unit].add(key)
            self._by_conversation[key[1]].add(key)
            result.changed.append(key)
        for unit in units:  # turns a unit no longer has (lineage re-grouped them)
            for key in self._by_unit.get(unit, set()) - seen:
                self._drop(key)
        return kept

    def _unit_lookup(self, units: list[str]) -> Callable[[str], str | None]:
        """The unit a classified turn belongs to, among those the pass classified
        (None: a clean unit's, or the pool's when the pool was not classified)."""
        dirty = set(units)
        pool = IDLESS if IDLESS in dirty else None

        def unit_of(conversation_id: str) -> str | None:
            if conversation_id in dirty:
                return conversation_id
            return None if conversation_id in self.buffer.units else pool
        return unit_of

    def _drop(self, key: TurnKey) -> None:
        state = self.turns.pop(key, None)
        if state is None:
            return
        self._by_unit[state.unit].discard(key)
        keys = self._by_conversation.get(key[1])
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_conversation[key[1]]

    def _forget(self, units: Iterable[str]) -> None:
        for unit in units:
            for key in list(self._by_unit.pop(unit, ())):
                self._drop(key)

    # ------------------------------------------------------------------ reads

    def conversation(self, conversation_id: str) -> list[dict[str, Any]]:
        """The conversation's turns as last classified, in turn order (each with its
        version and whether it is final)."""
        keys = sorted(self._by_conversation.get(conversation_id, ()), key=lambda k: (k[0], k[2]))
        return [{**self.turns[k].row, "version": self.turns[k].version,
                 "final": self.turns[k].final} for k in keys]

    def open_turns(self) -> int:
        return sum(1 for state in self.turns.values() if not state.final)
