"""host-hit: part of the prompt's KV was loaded from an offloading tier (host or peer).

What it means: the engine did not have the conversation's blocks in its own KV cache,
but a copy saved in the host tier (or a peer's, p2p) did, and was loaded instead of
recomputed. The evidence says how many tokens each tier served, bytes and load time
(``kvobs.host.copy_engine`` says what measured it: ``host-memcpy`` is the CPU testbed's
stand-in, not a GPU's DMA). With the copy on D (vLLM's MultiConnector next to the NIXL
connector), it serves D only: P still computed the prompt (``recomputed_tokens``).
What to do: nothing; with the copy on D, a peer tier or a longer D TTL serves P too.
"""

from kvobs import columns as col
from kvobs.semconv import Verdict
from kvobs.verdicts import _host
from kvobs.verdicts._base import Context, Finding, Turn

VERDICT = Verdict.HOST_HIT


def applies(turns, context: Context):
    return _host.asked(turns) & (col.num(turns, "host_accepted_tokens") > 0)


def explain(turn: Turn, context: Context) -> Finding:
    tokens, duration = turn.get("host_accepted_tokens"), turn.get("host_load_duration_s")
    took = f" in {duration * 1000:.1f} ms" if duration is not None else ""
    served = (f"{tokens} prompt tokens came from the "
              f"{turn.get('host_load_tier') or 'host'} tier{took}")
    computed = turn.get("recomputed_tokens")
    if computed:  # a P/D pair whose tier sits on D (MultiConnector): it never serves P
        remedy = (f"{served}, into the engine holding the copy (D); P computed {computed} "
                  "prompt tokens itself: a copy on D does not serve P. A peer tier (p2p) "
                  "or a D TTL longer than the wait would.")
    else:
        remedy = f"{served}; nothing to do."
    return Finding(VERDICT, remedy, turn.pick(
        *_host.EVIDENCE, "host_load_span_id", "host_load_bytes", "host_load_blocks",
        "host_load_duration_s", "host_load_tier", "host_copy_engine", "recomputed_tokens"))
