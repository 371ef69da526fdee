"""Turn verdicts: one small pure rule per module, tried in a fixed order.

The first rule that applies decides the turn. A rule that needs a span the source lacks
makes the turn ``insufficient-evidence``, naming the missing span: kvobs never guesses.

Each rule module has ``applies(turns, context)``, deciding over a whole turn table at
once (one definition for one conversation and for a million turns), optionally
``missing(turns, context)`` naming the evidence it needs, and ``explain(turn, context)``
giving the finding (evidence and remedy) for a turn it decided.

Order, and why:
 1. first-turn        nothing earlier exists, whatever else happened
 2. host-evicted      host path: the copy asked about was evicted while the turn waited
 3. host-save-incomplete  host path: the tier refused part of the copy when it was saved
                      (before lacks-response: a refused tail also ends the copy early)
 4. host-copy-lacks-response  host path: the copy ended at the prompt, R never saved
 5. host-hit          host path: an offloading tier served part of the prompt
 6. missing-metadata  without params nothing below can apply
 7. prefix-mismatch   guards refused the old KV; expiry would not have mattered
 8. expired           params valid but D's blocks gone or declined
 9. transfer-failed   the read itself broke (or never came)
10. below-threshold   P chose not to read, by design
11. local-hit         P did not need to read
12. slow-transfer     the read worked but did not pay off
13. remote-hit        the read worked and paid off
14. miss              params valid, nothing reused, nothing above explains it

Host-path rules (2-5) apply only to later turns looked up in an offloading tier that D's
retained KV did not serve (``verdicts/_host.py``): a turn D's KV served keeps its verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from typing import TYPE_CHECKING, Sequence

import numpy as np

from kvobs.turns import columns as col
from kvobs.semconv import VERDICT_VALUES, Verdict
from kvobs.verdicts import (
    below_threshold,
    expired,
    first_turn,
    host_copy_lacks_response,
    host_evicted,
    host_hit,
    host_save_incomplete,
    local_hit,
    miss,
    missing_metadata,
    prefix_mismatch,
    remote_hit,
    slow_transfer,
    transfer_failed,
)
from kvobs.verdicts._base import Context, Finding, Needs, Turn

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "ORDER",
    "Context",
    "Finding",
    "Turn",
    "decide",
    "classify_frame",
    "findings",
    "INSUFFICIENT_REMEDY",
    "AMBIGUOUS_REMEDY",
    "meaning",
]

# The host-path rules apply only to turns looked up in an offloading tier that D's
# retained KV did not serve (verdicts/_host.py); they come before missing-metadata because
# a host-only engine has no proxy params to miss.
ORDER: tuple[ModuleType, ...] = (
    first_turn,
    host_evicted,
    host_save_incomplete,
    host_copy_lacks_response,
    host_hit,
    missing_metadata,
    prefix_mismatch,
    expired,
    transfer_failed,
    below_threshold,
    local_hit,
    slow_transfer,
    remote_hit,
    miss,
)
# Each rule's name as findings give it (its module's last name), in ORDER.
_RULE_NAMES = tuple(module.__name__.rsplit(".", 1)[-1] for module in ORDER)


def meaning(rule: ModuleType) -> str:
    """A rule's one-line meaning: its docstring's title, less the verdict's name (the
    verdict guide's heading; the fleet views' legend)."""
    title = (rule.__doc__ or "").strip().partition("\n")[0]
    return title.removeprefix(f"{rule.VERDICT.value}:").strip()


INSUFFICIENT_REMEDY = (
    "Spans missing: check that the named component runs with kvobs "
    "telemetry on and exports to this source."
)
AMBIGUOUS_REMEDY = (
    "Identical histories in different conversations: the engines' spans "
    "cannot say which one this turn continues. Send a conversation id "
    "(or route through kvobs proxy) so that kvobs need not tell them apart "
    "by content."
)


def _insufficient(needs: Needs, module: ModuleType, turn: Turn, rule: str) -> Finding:
    evidence = {
        "missing_span": needs.span.name,
        "missing_from": needs.span.service.value,
        "needed_for": module.VERDICT.value,
        "missing_field": needs.column,
    }
    if not needs.reason:
        return Finding(Verdict.INSUFFICIENT_EVIDENCE, INSUFFICIENT_REMEDY, evidence, rule=rule)
    evidence = {
        "reason": needs.reason,
        "needed_for": module.VERDICT.value,
        needs.column: turn.get(needs.column),
    }
    return Finding(Verdict.INSUFFICIENT_EVIDENCE, AMBIGUOUS_REMEDY, evidence, rule=rule)


_INSUFFICIENT = Verdict.INSUFFICIENT_EVIDENCE.value


@dataclass
class Decisions:
    """Per row of a turn table: the verdict (its position in ``VERDICT_VALUES``), the
    deciding rule's position in ORDER and, for insufficient-evidence rows, what was
    missing (``Needs``)."""

    code: np.ndarray
    rule: np.ndarray
    missing: dict[int, Needs]

    @property
    def verdict(self) -> np.ndarray:
        """Per row, the verdict value."""
        return np.array(VERDICT_VALUES, dtype=object)[self.code]


def decide(turns: col.Table, context: Context = Context()) -> Decisions:
    """Exactly one verdict per row: the first rule in ORDER that applies, unless a rule
    before it lacks the evidence it needs on that row."""
    rows = len(turns)
    code = np.full(rows, -1, np.int8)
    rule = np.full(rows, -1)
    missing: dict[int, Needs] = {}
    undecided = np.ones(rows, bool)
    insufficient = VERDICT_VALUES.index(_INSUFFICIENT)
    for position, module in enumerate(ORDER):
        for needs in getattr(module, "missing", lambda *_: ())(turns, context):
            chosen = undecided & needs.where
            code[chosen], rule[chosen] = insufficient, position
            missing.update((int(i), needs) for i in np.flatnonzero(chosen))
            undecided &= ~chosen
        chosen = undecided & module.applies(turns, context)
        code[chosen] = VERDICT_VALUES.index(module.VERDICT.value)
        rule[chosen] = position
        undecided &= ~chosen
    assert not undecided.any(), "miss applies to every row"
    return Decisions(code, rule, missing)


def classify_frame(
    turns: pd.DataFrame, prefill_tokens_per_s: float | None = None, read_slo_s: float | None = None
) -> pd.Series:
    """The verdict value of every row of a turn table (fleet scale)."""
    import pandas as pd  # a DataFrame's: pandas is loaded already

    decisions = decide(turns, Context(prefill_tokens_per_s, read_slo_s))
    # Categorical, from the codes: as strings, pandas stores 1.35M of them as Arrow and
    # converts them back at every comparison (0.5 s of a fleet report), and coding them
    # again costs as much.
    return pd.Series(
        pd.Categorical.from_codes(decisions.code, categories=list(VERDICT_VALUES)),
        index=turns.index,
        name="verdict",
    )


def findings(
    turns: col.Table, context: Context = Context(), rows: Sequence[Turn] | None = None
) -> list[Finding]:
    """The finding (verdict, evidence, remedy, rule) of every row of a turn table
    (``rows``: the table's rows as turns, when the caller has them already)."""
    decisions = decide(turns, context)
    out = []
    for i, (turn, position) in enumerate(
        zip(
            [Turn(row) for row in col.records(turns)] if rows is None else rows,
            decisions.rule.tolist(),
        )
    ):
        module, name = ORDER[position], _RULE_NAMES[position]
        if i in decisions.missing:
            out.append(_insufficient(decisions.missing[i], module, turn, name))
            continue
        finding = module.explain(turn, context)
        out.append(Finding(finding.verdict, finding.remedy, finding.evidence, rule=name))
    return out
