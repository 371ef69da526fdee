"""host-hit: part of the prompt's KV was loaded from an offloading tier (host or peer).

What it means: the engine did not have the conversation's blocks in its own KV cache,
but a copy saved in the host tier (or a peer's, p2p) did, and was loaded instead of
recomputed. The evidence says how many tokens each tier served, bytes and load time
(``kvobs.host.copy_engine`` says what measured it: ``host-memcpy`` is the CPU testbed's
stand-in, not a GPU's DMA).
What to do: nothing.
"""

from kvobs import columns as col
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
        remedy = (f"{tokens} prompt tokens were pulled from a peer's host tier (p2p tier) "
                  f"and loaded{took} (the NIXL pull before the load: "
                  f"{M_OFFLOAD_TIER_READ_TIME.name}); nothing to do.")
    else:
        remedy = f"{tokens} prompt tokens came from the {tier} tier{took}; nothing to do."
    return Finding(VERDICT, remedy, turn.pick(
        *_host.EVIDENCE, "host_load_span_id", "host_load_bytes", "host_load_blocks",
        "host_load_duration_s", "host_load_tier", "host_copy_engine"))
