"""host-hit: part of the prompt's KV was loaded from an offloading tier (host or peer).

What it means: the engine did not have the conversation's blocks in its own KV cache,
but a copy saved in the host tier (or a peer's, p2p) did, and was loaded instead of
recomputed. The evidence says how many tokens each tier served, bytes and load time
(``kvobs.host.copy_engine`` says what measured it: ``host-memcpy`` is the CPU testbed's
stand-in, not a GPU's DMA). With the copy on D (vLLM's MultiConnector next to the NIXL
connector), it serves D only: P still computed the prompt (``recomputed_tokens``).
What to do: nothing; with the copy on D, a peer tier or a longer D TTL serves P too.
"""

from kvobs.turns import columns as col
from kvobs.semconv import M_OFFLOAD_TIER_READ_TIME, HostTier, Verdict
from kvobs.verdicts import _host
from kvobs.verdicts._base import Context, Finding, Turn

VERDICT = Verdict.HOST_HIT


def applies(turns, context: Context):
    return _host.asked(turns) & (col.num(turns, "host_accepted_tokens") > 0)


def explain(turn: Turn, context: Context) -> Finding:
    tokens, duration = turn.get("host_accepted_tokens"), turn.get("host_load_duration_s")
    tier = turn.get("host_load_tier") or HostTier.HOST.value
    took = f" in {duration * 1000:.1f} ms" if duration is not None else ""
    if tier == HostTier.P2P.value:
        # The load span times the copy from this engine's host tier only: the pull from
        # the peer into it carries no request id upstream (vLLM's tiering counters).
        remedy = (
            f"{tokens} prompt tokens were pulled from a peer's host tier (p2p tier) "
            f"and loaded{took} (the NIXL pull before the load: "
            f"{M_OFFLOAD_TIER_READ_TIME.name}); nothing to do."
        )
    elif _p_computed_them(turn):  # the copy sat on D (MultiConnector): it never serves P
        remedy = (
            f"{tokens} prompt tokens came from the {tier} tier{took}, into the "
            f"engine holding the copy (D); P computed "
            f"{int(turn.get('recomputed_tokens'))} prompt tokens itself, those "
            "among them: a copy on D does not serve P. A peer tier (p2p) or a D TTL "
            "longer than the wait would."
        )
    else:
        remedy = f"{tokens} prompt tokens came from the {tier} tier{took}; nothing to do."
    return Finding(
        VERDICT,
        remedy,
        turn.pick(
            *_host.EVIDENCE,
            "host_load_span_id",
            "host_load_bytes",
            "host_load_blocks",
            "host_load_duration_s",
            "host_load_tier",
            "host_copy_engine",
            "recomputed_tokens",
        ),
    )


def _p_computed_them(turn: Turn) -> bool:
    """P recomputed more than the prompt less the tier's tokens: the tier served another
    engine than P (a host copy on D), not P's own prefill."""
    computed, prompt = turn.get("recomputed_tokens"), turn.get("prompt_tokens")
    tokens = turn.get("host_accepted_tokens") or 0
    return bool(computed and prompt and computed > prompt - tokens)
