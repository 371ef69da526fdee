"""remote-hit: P read D's KV instead of recomputing it.

What it means: the feature worked: M tokens came over NIXL instead of being computed.
It *paid off* only when TTFT gained something: the P-seconds the read saved (M tokens at
this source's measured prefill rate) exceed what the read cost (connection set-up and
the read itself). Otherwise the finding says what ate the gain.
What to do: nothing when it paid off; when connection set-up ate it, warm P/D pairs at
start-up; when the turn was slow anyway, follow its latency causes.
"""

from kvobs import semconv as sc
from kvobs.semconv import PullDecision, ReadOutcome, Verdict
from kvobs.timeline import REUSE_PATH, phase_column
from kvobs.turns import columns as col
from kvobs.verdicts._base import Context, Finding, Needs, Turn

VERDICT = Verdict.REMOTE_HIT


def missing(turns, context: Context):
    pulled = col.eq(turns, "decision", PullDecision.PULL.value)
    return [Needs(pulled & col.null(turns, "read_outcome"), "read_outcome", sc.SPAN_READ)]


def applies(turns, context: Context):
    return col.eq(turns, "read_outcome", ReadOutcome.DONE.value)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def explain(turn: Turn, context: Context) -> Finding:
    evidence = turn.pick(
        "read_span_id",
        "read_bytes",
        "read_blocks",
        "read_duration_s",
        "read_setup_s",
        "candidate_tokens",
        "remaining_ttl_s",
        "ttft_s",
        "compute_saved_tokens",
        "compute_saved_s",
        "ttft_gained_s",
        "served_by",
        "served_device_tokens",
        "served_host_tokens",
    )
    gained = turn.get("ttft_gained_s")
    saved = turn.get("compute_saved_s")
    tokens = turn.get("compute_saved_tokens")
    tokens = int(tokens) if tokens is not None else None
    if gained is None or saved is None:
        return Finding(
            VERDICT,
            f"Remote KV read brought {tokens} tokens; whether it paid "
            "off is unknown (no measured prefill rate or read time).",
            evidence,
        )
    setup = turn.get(phase_column(sc.Phase.READ_SETUP)) or turn.get("read_setup_s") or 0.0
    if gained <= 0:
        eater = (
            f"NIXL connection set-up (the first read from this D) cost {_ms(setup)}"
            if setup >= saved / 2
            else f"the read cost {_ms(saved - gained - setup)}"
        )
        return Finding(
            VERDICT,
            f"The read saved P {tokens} tokens ({_ms(saved)} of compute) "
            f"but gained no TTFT: {eater}.",
            evidence,
        )
    remedy = (
        f"Remote KV read paid off: {tokens} tokens ({_ms(saved)} of P compute) saved, "
        f"TTFT {_ms(gained)} better than recomputing."
    )
    slowest = turn.get("slowest_phase")
    if slowest and sc.Phase(slowest) not in REUSE_PATH:
        remedy += f" The turn's time went to {slowest}: see its causes."
    return Finding(VERDICT, remedy, evidence)
