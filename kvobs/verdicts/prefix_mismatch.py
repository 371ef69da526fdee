"""prefix-mismatch: the history changed, D's blocks no longer prefix the prompt.

What it means: the client rewrote history (reasoning stripped, summary, truncation) or
the output did not re-tokenize to the same ids, so the tokens D holds KV for are not
the start of this prompt. Reading them would give wrong KV; kvobs's guards (proxy
history digest, P's block-hash check) refused them and P recomputed.
What to do: keep history append-only across turns (don't strip reasoning before resending)
and resend the exact token sequence; if intended, nothing: recomputing is correct.

Told apart from the evidence: a *rewritten* history diverges early (the proxy's
text-level digest refused it, or P's block hashes part well before D's end); a
*re-tokenization at the boundary* extends the text (the proxy's digest accepted it) but
its last tokens encode differently, so P's hashes part only in D's last blocks. The
latter is no client fault: P still reads the blocks that match (with the prefix guard).
"""

from kvobs.semconv import LookupOutcome, PullDecision, Verdict
from kvobs.turns import columns as col
from kvobs.verdicts._base import Context, Finding, Turn

VERDICT = Verdict.PREFIX_MISMATCH


def applies(turns, context: Context):
    return col.eq(turns, "lookup", LookupOutcome.PREFIX_MISMATCH.value) | col.eq(
        turns, "decision", PullDecision.PREFIX_MISMATCH.value
    )


# P's hashes parting within this many tokens of D's end: the boundary, not the history.
BOUNDARY_TOKENS = 32


def retokenized(turn: Turn) -> bool:
    """The text extended D's but its tokens did not: the proxy's text digest accepted
    the history (lookup hit), or P's hashes agree up to D's last few tokens."""
    if turn.get("decision") != PullDecision.PREFIX_MISMATCH.value:
        return False
    if turn.get("lookup") == LookupOutcome.HIT.value:
        return True
    matched, remote = turn.get("prefix_matched_tokens"), turn.get("remote_tokens")
    return matched is not None and remote is not None and remote - matched <= BOUNDARY_TOKENS


def explain(turn: Turn, context: Context) -> Finding:
    evidence = turn.pick(
        "lookup_span_id",
        "lookup",
        "decision_span_id",
        "decision",
        "prefix_matched_tokens",
        "remote_tokens",
        "prompt_tokens",
        "read_span_id",
        "read_outcome",
        "read_blocks",
        "read_bytes",
    )
    if retokenized(turn):
        read = turn.get("read_blocks") if turn.get("read_outcome") == "done" else None
        salvaged = (
            f"P still read the {read} matching blocks "
            f"({turn.get('prefix_matched_tokens')} tokens) and recomputed the rest"
            if read
            else f"{turn.get('prefix_matched_tokens')} tokens matched; "
            "enable the prefix guard (kvobs_prefix_guard) so P reads them"
        )
        return Finding(
            VERDICT,
            (
                "The history extends the previous turn's text, but D's last tokens "
                "re-tokenize differently once the next text follows them (the client rewrote "
                f"nothing): {salvaged}. Expected with some tokenizers; ending assistant turns "
                "on a stop token or newline keeps the boundary stable."
            ),
            evidence,
        )
    proxy_saw = turn.get("lookup") == LookupOutcome.PREFIX_MISMATCH.value
    where = "proxy history digest" if proxy_saw else "P's block-hash check"
    return Finding(
        VERDICT,
        f"History no longer extends the previous turn ({where}): keep history "
        "append-only (don't strip reasoning or re-render earlier messages).",
        evidence,
    )
