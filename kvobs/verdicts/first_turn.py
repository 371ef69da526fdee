"""first-turn: nothing earlier to reuse.

What it means: turn 1 of a conversation always computes its whole prompt (P may still hit
its own prefix cache for a shared system prompt).
What to do: nothing; judge reuse on turns 2 and later.
"""

from kvobs import columns as col
from kvobs.semconv import Verdict
from kvobs.verdicts._base import Context, Finding, Turn

VERDICT = Verdict.FIRST_TURN


def applies(turns, context: Context):
    return col.num(turns, "turn") == 1


def explain(turn: Turn, context: Context) -> Finding:
    return Finding(VERDICT, "Nothing to reuse on turn 1; judge reuse from turn 2 on.",
                   turn.pick("turn_span_id", "prompt_tokens", "local_hit_tokens", "ttft_s"))
