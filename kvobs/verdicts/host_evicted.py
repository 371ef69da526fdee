"""host-evicted: the previous turn's copy in the host tier was evicted before this turn.

What it means: the previous turn's KV was saved to the offloading tier (host memory, or a
peer's), but the tier's LRU eviction pushed (part of) it out while the conversation
waited, so this turn's lookup found less than was saved and recomputed the rest.
What to do: give the tier more room (``cpu_bytes_to_use``) if such gaps are common, or
keep fewer one-off requests out of it (``store_threshold``); the evidence gives the
copy's age at eviction against the gap it had to survive.
"""

from kvobs.turns import columns as col
from kvobs.semconv import Verdict
from kvobs.verdicts import _host
from kvobs.verdicts._base import Context, Finding, Turn

VERDICT = Verdict.HOST_EVICTED


def applies(turns, context: Context):
    saved = col.num(turns, "prev_host_saved_tokens")
    evicted_before = col.num(turns, "prev_host_evict_end_ns") <= col.num(
        turns, "host_lookup_start_ns"
    )
    return (
        _host.asked(turns)
        & col.present(turns, "prev_host_evict_span_id")
        & evicted_before
        & (saved > 0)
        & (_host.reused(turns) < saved)
    )


def explain(turn: Turn, context: Context) -> Finding:
    saved = turn.get("prev_host_saved_tokens") or 0
    got = (turn.get("host_local_tokens") or 0) + (turn.get("host_accepted_tokens") or 0)
    age = turn.get("prev_host_evicted_age_s")
    aged = f" after {age:.1f}s in the tier" if age is not None else ""
    remedy = (
        f"The previous turn's host copy ({saved} tokens) was evicted{aged}; this turn "
        f"reused {got} of them. Raise cpu_bytes_to_use (the host tier) if such gaps "
        "are common, or set store_threshold so one-off requests do not push "
        "conversations out."
    )
    return Finding(
        VERDICT,
        remedy,
        turn.pick(
            "prev_host_save_span_id",
            "prev_host_saved_tokens",
            "prev_host_evict_span_id",
            "prev_host_evicted_blocks",
            "prev_host_evicted_age_s",
            *_host.EVIDENCE,
        ),
    )
