"""Turn verdicts: one small pure rule per module, tried in a fixed order.

The first rule that returns a finding decides the turn. A rule that needs a span the
source lacks raises ``MissingEvidence`` and the turn is ``insufficient-evidence``,
naming the missing span: kvobs never guesses.

Order, and why:
 1. first-turn        nothing earlier exists, whatever else happened
 2. missing-metadata  without params nothing below can apply
 3. prefix-mismatch   guards refused the old KV; expiry would not have mattered
 4. expired           params valid but D's blocks gone or declined
 5. transfer-failed   the read itself broke (or never came)
 6. below-threshold   P chose not to read, by design
 7. local-hit         P did not need to read
 8. slow-transfer     the read worked but did not pay off
 9. remote-hit        the read worked and paid off
10. miss              params valid, nothing reused, nothing above explains it
"""

from __future__ import annotations

from types import ModuleType

from kvobs.semconv import Verdict
from kvobs.verdicts import (below_threshold, expired, first_turn, local_hit, miss,
                            missing_metadata, prefix_mismatch, remote_hit, slow_transfer,
                            transfer_failed)
from kvobs.verdicts._base import Context, Finding, MissingEvidence, Turn

__all__ = ["ORDER", "Context", "Finding", "Turn", "classify", "INSUFFICIENT_REMEDY"]

ORDER: tuple[ModuleType, ...] = (first_turn, missing_metadata, prefix_mismatch, expired,
                                 transfer_failed, below_threshold, local_hit, slow_transfer,
                                 remote_hit, miss)

INSUFFICIENT_REMEDY = ("Spans missing: check that the named component runs with kvobs "
                       "telemetry on and exports to this source.")


def classify(turn: Turn, context: Context = Context()) -> Finding:
    """Exactly one finding for the turn."""
    for rule in ORDER:
        try:
            finding = rule.check(turn, context)
        except MissingEvidence as missing:
            return Finding(Verdict.INSUFFICIENT_EVIDENCE, INSUFFICIENT_REMEDY,
                           {"missing_span": missing.span.name,
                            "missing_from": missing.span.service.value,
                            "needed_for": rule.VERDICT.value, "missing_field": missing.column},
                           rule=rule.__name__.rsplit(".", 1)[-1])
        if finding is not None:
            return Finding(finding.verdict, finding.remedy, finding.evidence,
                           rule=rule.__name__.rsplit(".", 1)[-1])
    raise AssertionError("miss.check always returns a finding or raises")
