"""host-save-incomplete: the tier refused part of the previous turn's copy when it was saved.

What it means: the offloading connector's saves are best effort. When the host tier
cannot free room for a store (every chunk it could evict is still being written or
loaded), vLLM's manager refuses it (``prepare_store`` returns nothing, vLLM counts an
allocation failure and logs "cannot store chunks") and those blocks are never saved,
so the copy has a hole or ends early, and this turn recomputed what was missing.
(vLLM 0.32.0 never fails a copy job once started, and an aborted request's computed
blocks are still stored: a refusal is the one way a save ends incomplete.)
What to do: give the tier room for more than the KV in flight at once (its pending
writes and loads, bounded by the engine's own KV cache): raise ``cpu_bytes_to_use``.
"""

from kvobs.turns import columns as col
from kvobs.semconv import Verdict
from kvobs.verdicts import _host
from kvobs.verdicts._base import Context, Finding, Turn

VERDICT = Verdict.HOST_SAVE_INCOMPLETE


def _previous_tokens(turns):
    """The previous turn's prompt and output: what a complete copy would reach (to its
    last full block)."""
    return col.num(turns, "prev_host_save_prompt_tokens") + col.num(
        turns, "prev_host_save_output_tokens"
    )


def applies(turns, context: Context):
    return (
        _host.asked(turns)
        & col.flag(turns, "prev_host_save_incomplete")
        & (_host.reused(turns) < _previous_tokens(turns))
    )


def explain(turn: Turn, context: Context) -> Finding:
    refused, saved = turn.get("prev_host_refused_blocks"), turn.get("prev_host_saved_tokens")
    got = (turn.get("host_local_tokens") or 0) + (turn.get("host_accepted_tokens") or 0)
    blocks = f"{refused} blocks" if refused is not None else "blocks"
    remedy = (
        f"The host tier refused {blocks} of the previous turn's copy when it was "
        f"saved (no room: what it could evict was still being written or loaded); "
        f"the copy reached {saved or 0} tokens and this turn reused {got}. Raise "
        "cpu_bytes_to_use above the KV the engine moves to and from the tier at once."
    )
    return Finding(
        VERDICT,
        remedy,
        turn.pick(
            "prev_host_save_span_id",
            "prev_host_save_incomplete",
            "prev_host_refused_blocks",
            "prev_host_saved_tokens",
            "prev_host_save_prompt_tokens",
            "prev_host_save_output_tokens",
            *_host.EVIDENCE,
        ),
    )
