"""prefix-mismatch: the history changed, D's blocks no longer prefix the prompt.

What it means: the client rewrote history (reasoning stripped, summary, truncation) or
the output did not re-tokenize to the same ids, so the tokens D holds KV for are not
the start of this prompt. Reading them would give wrong KV; kvobs's guards (proxy
history digest, P's block-hash check) refused them and P recomputed.
What to do: keep history append-only across turns (don't strip reasoning before resending)
and resend the exact token sequence; if intended, nothing: recomputing is correct.
"""

from kvobs.semconv import LookupOutcome, PullDecision, Verdict
from kvobs import columns as col
from kvobs.verdicts._base import Context, Finding, Turn

VERDICT = Verdict.PREFIX_MISMATCH


def applies(turns, context: Context):
    return (col.eq(turns, "lookup", LookupOutcome.PREFIX_MISMATCH.value)
            | col.eq(turns, "decision", PullDecision.PREFIX_MISMATCH.value))


def explain(turn: Turn, context: Context) -> Finding:
    proxy_saw = turn.get("lookup") == LookupOutcome.PREFIX_MISMATCH.value
    where = "proxy history digest" if proxy_saw else "P's block-hash check"
    return Finding(
        VERDICT,
        f"History no longer extends the previous turn ({where}): keep history "
        "append-only (don't strip reasoning or re-render earlier messages).",
        turn.pick("lookup_span_id", "lookup", "decision_span_id", "decision",
                  "prefix_matched_tokens", "remote_tokens", "prompt_tokens"))
