"""The always-on turn classifier: the pipeline ``kvobs diagnose`` runs (correlate,
lineage, timeline, verdicts, causes: ``diagnose.classify_turns`` over
``correlate.turns_from_spans``), pass after pass, over the spans of the conversations
that received spans since the last pass.

A turn is classified again only when its correlated row changed (a new span, a
lineage fact): the others of a dirty conversation keep theirs. A turn's classification
is *versioned*: a pass that changes it (a late span, a lineage
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
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import pyarrow as pa

from kvobs.turns import arrays, columns as col
from kvobs.causes import decode_context
from kvobs.turns.correlate import turns_from_spans
from kvobs.diagnose import TurnDiagnosis, classify_turns
from kvobs.live.buffer import IDLESS, SpanBuffer, derived
from kvobs.live.turn_measures import MEASURES_KEY, measures_of
from kvobs.sources._frame import drop_duplicate_span_rows
from kvobs.sources._rows import rows as document_rows
from kvobs.timeline import prefill_rate

TurnKey = tuple[str, str, int]  # tenant, conversation id, turn
# The turn columns the fleet context is measured from (timeline.prefill_rate,
# causes.decode_context): kept for the recent final turns only.
_CONTEXT_COLUMNS = (
    "recomputed_tokens",
    "prompt_tokens",
    "local_hit_tokens",
    "read_outcome",
    "phase_p_compute_s",
    "prefill_leg_s",
    "phase_decode_s",
    "output_tokens",
)


@dataclass
class TurnState:
    row: dict[str, Any]  # the latest classification (turn_row)
    version: int
    changed_at: float
    unit: str
    samples: dict[str, Any]  # its _CONTEXT_COLUMNS, for the fleet context once final
    final: bool = False
    finals: int = 0  # times it was written (first: counted; later: re-classified)
    inputs: int | None = None  # the hash of the correlated row it was classified from


@dataclass
class PassResult:
    classified: int = 0  # turns classified in the pass
    changed: list[TurnKey] = field(default_factory=list)  # new versions
    # rows that became final (written; counted when ``first_final``)
    finalized: list[dict] = field(default_factory=list)
    reclassified: int = 0  # of those, turns that were final before
    seconds: float = 0.0


def turn_row(
    diagnosis: TurnDiagnosis,
    measures: dict[str, Any],
    prefill_tokens_per_s: float | None,
    decode_s_per_token: float | None,
) -> dict[str, Any]:
    """One classified turn as the service keeps, serves and stores it: ``diagnose``'s
    JSON of the turn plus its trace id and the fleet context it was classified with."""
    row = diagnosis.to_dict()
    row["trace_id"] = diagnosis.turn.get("trace_id")
    row["context"] = {
        "prefill_tokens_per_s": prefill_tokens_per_s,
        "decode_s_per_token": decode_s_per_token,
    }
    # The numbers the fleet report aggregates (``measures_of``), stored as typed columns
    # beside the JSON.
    row[MEASURES_KEY] = measures
    return row


def superseded(row: dict[str, Any], version: int) -> dict[str, Any]:
    """The row that retires a stored turn's key: lineage put the turn under another key
    (its ids say which turn it was). Never counted; readers skip the key."""
    return {
        "tenant": row["tenant"],
        "conversation_id": row["conversation_id"],
        "turn": row["turn"],
        **{c: row.get(c) for c in _TURN_IDS},
        "verdict": None,
        "superseded": True,
        "version": version,
        "first_final": False,
    }


def _unchanged(kept: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether a new classification of a turn leaves its kept row as it is: the
    classification and its measures (a late span may change only those, the report's
    numbers), not the fleet context it was priced with (which drifts pass by pass, and
    starts empty after a restart), unless the new one knows a value the kept one lacked:
    a row must name the context its answer holds at. A resumed row has no measures to
    compare (the store's JSON does not carry them). Compared as values; a pair found
    unequal once more as JSON, which spells NaN (unequal to itself), tuples and lists
    alike."""
    priced = kept.get("context") or {}
    if any(priced.get(k) is None and v is not None for k, v in new["context"].items()):
        return False
    skipped = ("context", MEASURES_KEY) if kept.get(MEASURES_KEY) is None else ("context",)
    old = {k: v for k, v in kept.items() if k not in skipped}
    fresh = {k: v for k, v in new.items() if k not in skipped}
    if old == fresh:
        return True
    if old.keys() == fresh.keys() and any(
        _json(old[k]) != _json(fresh[k]) for k in old if old[k] != fresh[k]
    ):
        return False  # a value unequal as JSON too (the usual change): so are the rows
    return _json(old) == _json(fresh)


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _measured(samples: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """P's compute rate and the typical decode time per token over turns' samples."""
    if not samples:
        return None, None
    table = col.Columns(pa.Table.from_pylist(samples))
    return prefill_rate(table), decode_context(table).decode_s_per_token


def _extended(turn: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """The requests of the turn lineage says the turn extends (D's export, and P's
    request), and of those it may extend (equal candidates: D's exports)."""
    parent = [turn.get("extends_request_id"), turn.get("extends_prefill_request_id")]
    candidates = str(turn.get("lineage_candidates") or "").split()
    return [r for r in parent if isinstance(r, str) and r], candidates


def _turn_requests(turn: Mapping[str, Any]) -> tuple[Any, Any]:
    """A turn row's P and D request."""
    return turn.get("prefill_request_id"), turn.get("decode_request_id")


def turn_keys(turns: pa.Table) -> list[TurnKey]:
    """Each turn row's key, as ``TurnDiagnosis`` makes it (tenant, conversation, turn)."""
    return [
        (str(tenant), str(cid), int(turn))
        for tenant, cid, turn in zip(
            arrays.pylist(turns.column("tenant")),
            arrays.pylist(turns.column("conversation_id")),
            turns.column("turn").to_pylist(),
        )
    ]


# What identifies one turn whatever key lineage gives it.
_TURN_IDS = ("trace_id", "prefill_request_id", "decode_request_id")


def _turn_ids(row: dict[str, Any]) -> list[str]:
    """The ids a turn is known by across keys (a partial turn may lack some)."""
    return [i for i in (row.get(column) for column in _TURN_IDS) if isinstance(i, str) and i]


# The unit of turns a restart took from the turn store until a replay of their spans
# finds them again (``Classifier.resume``).
RESUMED = "\x00resumed"


class Classifier:
    def __init__(
        self,
        window_s: float,
        grace_s: float,
        read_slo_s: float | None = None,
        context_turns: int = 10_000,
    ):
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
        self._resumed_until = 0.0
        self._resumed_ids: dict[str, TurnKey] = {}  # a resumed turn's id -> its key
        self._unpriced: set[TurnKey] = set()  # rows priced without a context value
        self._counted: dict[str, float] = {}  # a turn id (_TURN_IDS) -> when counted
        # A key retired from the store -> (the retiring row's version, when): a turn
        # lineage puts under it again is written past that version, or the store's
        # latest-version rule would keep it retired.
        self._retired: dict[TurnKey, tuple[int, float]] = {}
        self._pruned_at = 0.0

    # ------------------------------------------------------------------ input

    def add_request(
        self, request: object, now: float | None = None, received: float | None = None
    ) -> int:
        """One OTLP export request (its JSON form), taken ``now``; ``received``: when the
        service received it, if before (a restart's replay). Returns the spans taken."""
        problems: list[str] = []
        rows = document_rows("otlp", request, problems)
        self.problems.extend(problems)
        self.spans_unreadable += sum(1 for p in problems if "skipped" in p)
        self.buffer.add(rows, time.time() if now is None else now, received)
        self.spans_received += len(rows)
        return len(rows)

    def resume(
        self, stored: Iterable[dict[str, Any]], retired: Iterable[dict[str, Any]], now: float
    ) -> int:
        """Take the turns a previous run finalized (the turn store's latest rows, with
        their version) as final: a replay of their spans that classifies a turn the same
        way (at the fleet context its row names: ``_priced_as_stored``) neither counts
        nor writes it again; one that differs is a new version. And
        the keys it retired (with the retirement's version): a turn lineage puts under
        one again is written past it, as in the run that retired it. Returns the turns
        taken."""
        for retirement in retired:
            retired_key = (
                retirement["tenant"],
                retirement["conversation_id"],
                retirement["turn"],
            )
            self._retired[retired_key] = (int(retirement["version"]), now)
        taken = 0
        for stored_row in stored:
            row = {
                k: v for k, v in stored_row.items() if k not in ("version", "final", "first_final")
            }
            key = (row["tenant"], row["conversation_id"], row["turn"])
            self.turns[key] = TurnState(
                row,
                int(stored_row["version"]),
                now,
                RESUMED,
                {},
                final=True,
                finals=1,
            )
            self._by_unit[RESUMED].add(key)
            self._by_conversation[key[1]].add(key)
            self._count_once(row, now)
            self._resumed_ids.update(dict.fromkeys(_turn_ids(row), key))
            context = row.get("context") or {}
            if self._context == (None, None):  # the latest priced one's, until samples
                self._context = (
                    context.get("prefill_tokens_per_s"),
                    context.get("decode_s_per_token"),
                )
            taken += 1
        self._resumed_until = now + self.buffer.window_s
        return taken

    def revive(
        self,
        recalled: dict[str, list[dict]],
        stored: Iterable[dict[str, Any]],
        retired: Iterable[dict[str, Any]],
        now: float,
        received: float | None = None,
    ) -> None:
        """Conversations that came back after they left the window (id -> their spans
        recalled from the span store): the turns the turn store has final for them, and
        for the conversations the recalled spans also tag, taken as final where none is
        held (as a restart takes them: one classified the same way again is neither
        counted nor written); the spans held again with those that came since
        (``SpanBuffer.revive``)."""

        def free(row: dict[str, Any]) -> bool:
            return (row["tenant"], row["conversation_id"], row["turn"]) not in self.turns

        self.resume([r for r in stored if free(r)], [r for r in retired if free(r)], now)
        for conversation_id, spans in recalled.items():
            self.buffer.revive(conversation_id, spans, now, received)

    # ------------------------------------------------------------------ passes

    def context(self) -> tuple[float | None, float | None]:
        """P's compute rate and the typical decode time per token, over the recent final
        turns (the same measures ``diagnose`` takes over its spans)."""
        if self._context_stale and self._samples:
            self._context = _measured(list(self._samples))
            self._context_stale = False
        if not self._samples and self._context == (None, None):
            # Before any turn is final: over the turns classified so far, so that a
            # turn is priced at values its row can name (a pass measuring over its own
            # few turns may find none, where diagnose over every span finds some).
            return _measured([s.samples for s in self.turns.values() if s.samples])
        return self._context

    def _reprice(self, known: tuple[float | None, float | None]) -> set[TurnKey]:
        """The turns classified once more before they are (or stay) final: those priced
        without a fleet context value known now (``known``: the pass's), final or not.
        Their rows name a context that ``diagnose`` would measure for itself, and the
        first turns of a fleet are final before it knows its typical decode. Their
        units are classified again next pass; returns their keys."""
        if None in known or not self._unpriced:
            return set()
        marked = set()
        for key in self._unpriced:
            state = self.turns.get(key)
            if state is not None and state.unit in self.buffer.units:
                state.inputs = None
                state.final = False  # open (``open_turns``) until written again
                self.buffer.mark_dirty(state.unit)
                marked.add(key)
        self._unpriced.clear()
        return marked

    def run_pass(self, now: float | None = None) -> PassResult:
        now = time.time() if now is None else now
        started = time.perf_counter()
        result = PassResult()
        keys, spans = self.buffer.take_dirty()
        if spans is not None and spans.num_rows:
            result.classified = self._classify(keys, spans, now, result)
            self._retire_moved(result, now)
        repricing = self._reprice(self.context())
        for key, state in self.turns.items():
            if not state.final and now - state.changed_at >= self.grace_s:
                if key in repricing:
                    continue
                state.final = True
                state.finals += 1
                # A turn counted before under another key (lineage re-grouped it) is
                # re-classified, not new: its ids say it is the same turn.
                first = state.finals == 1 and self._count_once(state.row, now)
                result.reclassified += not first
                result.finalized.append(
                    {**state.row, "version": state.version, "first_final": first}
                )
                if state.finals == 1:
                    self._samples.append(state.samples)
                    self._context_stale = True
        if self._context_stale:
            # The turns final just now may have told the fleet context: the turns that
            # wait for it open at once, so that no pass shows every turn final before.
            self._reprice(self.context())
        self._forget(self.buffer.expire(now))
        if now - self._pruned_at >= self.buffer.window_s / 2:
            self._pruned_at = now
            horizon = now - 2 * self.buffer.window_s  # no turn is re-keyed that late
            self._counted = {t: at for t, at in self._counted.items() if at >= horizon}
            self._retired = {k: v for k, v in self._retired.items() if v[1] >= horizon}
        if RESUMED in self._by_unit and now >= self._resumed_until:
            # Stored turns no replayed span touched within a window stay as stored.
            self._forget([RESUMED])
            self._resumed_ids.clear()
        # Id-less turns leave with their spans (the pool's next pass no longer finds
        # them); in a pool that gets no new spans, after twice the window.
        horizon = now - 2 * self.buffer.window_s
        for key in [
            k
            for k in self._by_unit.get(IDLESS, ())
            if self.turns[k].final and self.turns[k].changed_at < horizon
        ]:
            self._drop(key)
        result.seconds = time.perf_counter() - started
        return result

    def _classify(self, units: list[str], spans: pa.Table, now: float, result: PassResult) -> int:
        turns = turns_from_spans(drop_duplicate_span_rows(spans, []), frame=False)
        unit_of = self._unit_lookup(units)
        keys = turn_keys(turns)
        # Clean units' lineage spans came along as context (what a dirty turn's
        # prompt may extend): their turns are correlated, never classified again.
        unit_of_turn = [
            unit_of(key[1], requests)
            for key, requests in zip(
                keys,
                zip(
                    arrays.pylist(turns.column("prefill_request_id")),
                    arrays.pylist(turns.column("decode_request_id")),
                ),
            )
        ]
        if all(unit is None for unit in unit_of_turn):
            return 0
        # A turn whose correlated row is the one it was classified from keeps its
        # classification: a conversation that goes on is not classified whole again.
        # Not while the fleet context is unknown (the first passes): classify_turns then
        # measures it over the turns it is given, which must stay the pass's all.
        rate, per_token = self.context()
        seen: set[TurnKey] = set()
        inputs = arrays.row_hashes(turns)  # a row's own: the same with the context's rows
        again = np.zeros(turns.num_rows, bool)
        priced = rate is not None and per_token is not None
        for i, (key, unit, hashed) in enumerate(zip(keys, unit_of_turn, inputs.tolist())):
            if unit is None:
                continue
            seen.add(key)
            state = self.turns.get(key)
            if priced and state is not None and state.inputs == hashed:
                self._move(key, state, unit)
            else:
                again[i] = True
        if not again.any():
            return 0
        # One filter (a copy of ~200 columns) for both: context turns and kept ones.
        turns, inputs = turns.filter(arrays.array(again)), inputs[again]
        classified = col.Columns(turns)
        diagnoses, used = classify_turns(classified, self.read_slo_s, rate, per_token)
        kept = 0
        extends: dict[TurnKey, tuple[list[str], list[str]]] = {}
        # One diagnosis a row, in row order; a clean unit's partial turn (its lineage
        # spans only) was never classified.
        units_classified = [u for u, taken in zip(unit_of_turn, again) if taken and u is not None]
        rows = [
            turn_row(diagnosis, measures, used.prefill_tokens_per_s, used.decode_s_per_token)
            for diagnosis, measures in zip(diagnoses, measures_of(classified))
        ]
        self._priced_as_stored(turns, rows)
        for diagnosis, row, classified_from, unit in zip(
            diagnoses, rows, inputs.tolist(), units_classified
        ):
            kept += 1
            key = (row["tenant"], row["conversation_id"], row["turn"])
            seen.add(key)
            extends[key] = _extended(diagnosis.turn)
            state = self.turns.get(key)
            self._note_pricing(key, row)
            samples = {c: diagnosis.turn.get(c) for c in _CONTEXT_COLUMNS}
            if state is not None and state.unit == RESUMED:
                # Final before a restart: its measures tell the fleet context again, as
                # they did before it (a restart must not leave the context unknown).
                self._samples.append(samples)
                self._context_stale = True
            if state is not None and _unchanged(state.row, row):
                state.inputs = classified_from
                state.row = row  # the same answer, at the context it names now
                state.samples = samples
                self._move(key, state, unit)
                continue
            if state is None:
                version = self._retired.pop(key, (0, now))[0] + 1
                state = self.turns[key] = TurnState(row, version, now, unit, samples)
            else:
                state.row, state.changed_at = row, now
                state.samples = samples
                state.version += 1
                state.final = False
            state.inputs = classified_from
            self._move(key, state, unit)
            self._by_conversation[key[1]].add(key)
            result.changed.append(key)
        for unit in units:  # turns a unit no longer has (lineage re-grouped them)
            for key in self._by_unit.get(unit, set()) - seen:
                state = self.turns[key]
                if state.finals:  # written under this key: the store must forget it
                    result.finalized.append(self._retire(key, state, now))
                self._drop(key)
        self._adopt(extends)
        return kept

    def _priced_as_stored(self, turns: pa.Table, rows: list[dict[str, Any]]) -> None:
        """A turn final before a restart whose replayed row differs from its stored one
        only because the fleet context moved since that was priced takes its row priced
        at the stored context: one process would not have classified the final turn
        again, so a restart neither writes it again nor counts it reclassified. Rows of
        ``turns`` (in order) are replaced in ``rows``; a turn whose answer differs at the
        stored context too (spans the stop cut short) keeps its new row."""
        if not self._by_unit.get(RESUMED):
            return  # every pass but a restart's replay: nothing to look up a row
        positions: dict[tuple[float, float], list[int]] = collections.defaultdict(list)
        for i, row in enumerate(rows):
            state = self.turns.get((row["tenant"], row["conversation_id"], row["turn"]))
            if state is None or state.unit != RESUMED or _unchanged(state.row, row):
                continue
            stored = state.row.get("context") or {}
            rate, per_token = stored.get("prefill_tokens_per_s"), stored.get("decode_s_per_token")
            if rate is not None and per_token is not None:
                positions[rate, per_token].append(i)
        for (rate, per_token), at in positions.items():
            resumed = col.Columns(turns.take(at))
            diagnoses, used = classify_turns(resumed, self.read_slo_s, rate, per_token)
            for i, diagnosis, measures in zip(at, diagnoses, measures_of(resumed)):
                row = turn_row(
                    diagnosis, measures, used.prefill_tokens_per_s, used.decode_s_per_token
                )
                state = self.turns[(row["tenant"], row["conversation_id"], row["turn"])]
                if _unchanged(state.row, row):
                    rows[i] = row

    def _adopt(self, extends: dict[TurnKey, tuple[list[str], list[str]]]) -> None:
        """The turns the pass classified stay with the turns lineage keyed them by
        (``SpanBuffer.adopt``); each notes the turns it extends or may
        (``SpanBuffer.note_links``)."""
        for key, (parent, candidates) in extends.items():
            state = self.turns[key]
            if state.unit != IDLESS and not derived(state.unit):  # a client's: stays
                self.buffer.note_links(state.unit, [*parent, *candidates])
                if key[2] > 1 and not parent and not candidates:
                    # A later turn that extends nothing seen yet: the turn its history
                    # came from may still arrive, in another unit (sent without an id).
                    self.buffer.index_start(state.unit, state.row.get("prefill_request_id"))
                continue
            unit, merged = self.buffer.adopt(
                state.unit,
                key[1],
                _turn_requests(state.row),
                state.row.get("trace_id"),
                parent,
                candidates,
            )
            for source in merged:
                for other in self._by_unit.pop(source, set()):
                    self._move(other, self.turns[other], unit)
            self._move(key, state, unit)
            self.buffer.note_links(unit, [*parent, *candidates])

    def _retire_moved(self, result: PassResult, now: float) -> None:
        """Retire the stored turns a replay after a restart put under another key: a
        turn the pass classified anew carries one of their ids (as a pass retires the
        keys a unit no longer has; a resumed turn is no unit's)."""
        if not self._resumed_ids:
            return
        for key in result.changed:
            state = self.turns.get(key)
            for turn_id in _turn_ids(state.row) if state is not None else ():
                moved = self._resumed_ids.get(turn_id)
                if moved is None or moved == key:
                    continue
                resumed = self.turns.get(moved)
                if resumed is not None and resumed.unit == RESUMED:
                    result.finalized.append(self._retire(moved, resumed, now))
                    self._drop(moved)

    def _retire(self, key: TurnKey, state: TurnState, now: float) -> dict[str, Any]:
        """The row that retires a written turn's key (``superseded``), noted."""
        self._retired[key] = (state.version + 1, now)
        return superseded(state.row, state.version + 1)

    def _count_once(self, row: dict[str, Any], now: float) -> bool:
        """Whether the turn of ``row`` is counted for the first time (and note it): none
        of its ids (trace, P's and D's request) was counted before. Any one is enough,
        as a partial turn may lack some."""
        ids = _turn_ids(row)
        first = not any(i in self._counted for i in ids)
        self._counted.update(dict.fromkeys(ids, now))
        return first

    def _move(self, key: TurnKey, state: TurnState, unit: str) -> None:
        if state.unit != unit:
            self._by_unit[state.unit].discard(key)
            state.unit = unit
        self._by_unit[unit].add(key)

    def _unit_lookup(self, units: list[str]) -> Callable[[str, tuple], str | None]:
        """The unit a classified turn (its conversation, its P and D request) belongs
        to, among those the pass classified (None: a clean unit's, or the pool's when
        the pool was not classified)."""
        dirty = set(units)

        def unit_of(conversation_id: str, requests: tuple) -> str | None:
            unit = self.buffer.holder(conversation_id, requests)
            return unit if unit in dirty else None

        return unit_of

    def _note_pricing(self, key: TurnKey, row: dict[str, Any]) -> None:
        if None in row["context"].values():
            self._unpriced.add(key)
        else:
            self._unpriced.discard(key)

    def _drop(self, key: TurnKey) -> None:
        self._unpriced.discard(key)
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
        version and whether it is final), as the turn store answers them: without the
        measures the store keeps apart."""
        keys = sorted(self._by_conversation.get(conversation_id, ()), key=lambda k: (k[0], k[2]))
        return [
            {
                **{c: v for c, v in self.turns[k].row.items() if c != MEASURES_KEY},
                "version": self.turns[k].version,
                "final": self.turns[k].final,
            }
            for k in keys
        ]

    def open_turns(self) -> int:
        return sum(1 for state in self.turns.values() if not state.final)
