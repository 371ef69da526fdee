"""host-copy-lacks-response: the host copy held the previous prompt but not its response.

What it means: the engine saved the previous turn with ``offload_prompt_only=true``
(vLLM's default), so its copy ends at that turn's prompt; the generated response R,
which every next turn of a conversation resends, was never saved and was recomputed.
What to do: set ``offload_prompt_only: false`` in the offloading connector's
``kv_connector_extra_config`` on the engine that decodes (true only suits histories
whose responses are dropped before the next turn, e.g. stripped reasoning).
"""

from kvobs.turns import columns as col
from kvobs.semconv import Verdict
from kvobs.verdicts import _host
from kvobs.verdicts._base import Context, Finding, Turn

VERDICT = Verdict.HOST_COPY_LACKS_RESPONSE


def applies(turns, context: Context):
    prompt = col.num(turns, "prev_host_save_prompt_tokens")
    lacks = col.present(turns, "prev_host_covers_response") & ~col.flag(
        turns, "prev_host_covers_response"
    )
    return (
        _host.asked(turns)
        & lacks
        & (col.num(turns, "prev_host_save_output_tokens") > 0)
        & (_host.reused(turns) <= prompt)
    )


def explain(turn: Turn, context: Context) -> Finding:
    saved, output = turn.get("prev_host_saved_tokens"), turn.get("prev_host_save_output_tokens")
    remedy = (
        f"The previous turn's host copy ended at its prompt ({saved} tokens saved); "
        f"its {output}-token response was not saved and was recomputed: set "
        "offload_prompt_only: false on the engine that decodes."
    )
    return Finding(
        VERDICT,
        remedy,
        turn.pick(
            "prev_host_save_span_id",
            "prev_host_saved_tokens",
            "prev_host_save_prompt_tokens",
            "prev_host_save_output_tokens",
            "prev_host_covers_response",
            *_host.EVIDENCE,
        ),
    )
