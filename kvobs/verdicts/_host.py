"""What the host-path rules share: which turns the host tier was asked about."""

from __future__ import annotations

import numpy as np

from kvobs.turns import columns as col
from kvobs.semconv import ReadOutcome

# Evidence every host-path finding carries when present.
EVIDENCE = (
    "host_lookup_span_id",
    "host_lookup_prompt_tokens",
    "host_local_tokens",
    "host_hit_tokens",
    "host_accepted_tokens",
    "host_hit_host_tokens",
    "host_hit_p2p_tokens",
    "served_by",
    "served_device_tokens",
    "served_host_tokens",
)


def asked(turns) -> np.ndarray:
    """Later turns whose prompt was looked up in the offloading tiers, and that the
    device path (D's retained KV over NIXL) did not serve: that one keeps its verdict."""
    return (
        (col.num(turns, "turn") > 1)
        & col.present(turns, "host_lookup_span_id")
        & ~col.eq(turns, "read_outcome", ReadOutcome.DONE.value)
    )


def reused(turns) -> np.ndarray:
    """Tokens the turn had without computing them: its local prefix plus the tier's."""
    return np.nan_to_num(col.num(turns, "host_local_tokens")) + np.nan_to_num(
        col.num(turns, "host_accepted_tokens")
    )
