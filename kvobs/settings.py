"""The settings kvobs reasons with: each one's name, default and meaning, in one place.

Whether a later turn can reuse D's KV turns on D's TTL, P's recompute threshold, P's
decline window and the proxy's entry lifetime (D's TTL less the proxy's expiry margin,
unless capped or fixed). Every part of kvobs that needs one of them takes it from
`kvobs/settings.py`: the proxy and its CLI, the verdict remedies, `kvobs tune` and
`kvobs whatif`, the simulation, the testbed and the monitoring config.
`tests/test_settings.py` fails when a default is written out anywhere else in code,
or stated differently in the docs.

A setting goes by the name of whoever applies it; ``spellings`` (the last column of
`docs/settings.md`) lists where else it is set or reported, under the name each of those
surfaces uses (CLI flags, config keys, span attributes and metrics are contracts, so they
keep their names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = [
    "Setting",
    "SETTINGS",
    "DECODE_TTL",
    "RECOMPUTE_THRESHOLD",
    "DECLINE_WINDOW",
    "PROXY_EXPIRY_MARGIN",
    "PROXY_ENTRY_LIFETIME",
    "UPSTREAM_ENTRY_LIFETIME",
    "MIN_CACHED_TOKEN_DELTA",
    "SLOW_TRANSFER_FACTOR",
    "entry_lifetime_s",
    "read_declined",
]

# A count (tokens) or a quantity (seconds, a factor): an int setting's default stays int.
_Number = TypeVar("_Number", int, float)


@dataclass(frozen=True)
class Setting(Generic[_Number]):
    name: str  # what whoever applies it calls it
    default: _Number
    unit: str
    owner: str  # who applies it
    doc: str
    spellings: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.default:g} {self.unit}"


DECODE_TTL = Setting(
    "decoder_kv_blocks_ttl",
    480.0,
    "s",
    "vLLM, decode engine (kv_transfer_config extra config)",
    "How long D keeps a finished request's KV blocks for the next turn to read, counted "
    "from the end of that request and not renewed. vLLM's default.",
    (
        "`kvobs proxy --decode-kv-ttl` (used when D's params do not carry it)",
        "`kvobs whatif --ttl`",
        "monitoring config `decode_ttl_seconds`",
        "testbed scenario `[engines] ttl_s` (30 s unless set, so that blocks expire within a run)",
        "span attribute `kvobs.ttl`, `kv_transfer_params` key `kvobs_decode_ttl`",
        "metric `kvobs_proxy_decode_ttl_seconds`",
        "turn columns `ttl_s`, `prev_ttl_s`",
    ),
)

RECOMPUTE_THRESHOLD = Setting(
    "kv_recompute_threshold",
    64,
    "tokens",
    "vLLM, prefill engine (kv_transfer_config extra config)",
    "P reads D's KV only when the reusable remainder M (tokens D holds beyond P's own "
    "prefix cache) is at least this; below it P recomputes them. vLLM's default.",
    (
        "`kvobs whatif --threshold`",
        "testbed scenario `[engines] threshold`",
        "span attribute `kvobs.recompute_threshold`",
        "turn column `threshold`",
    ),
)

DECLINE_WINDOW = Setting(
    "decline window",
    5.0,
    "s",
    "vLLM, prefill engine (fixed, not configurable)",
    "P declines a read of D's blocks that expire within this many seconds.",
    ("read outcome `declined-expired`",),
)

PROXY_EXPIRY_MARGIN = Setting(
    "expiry margin",
    10.0,
    "s",
    "kvobs proxy",
    "The proxy ends an entry for D's params this long before D's own expiry of the "
    "blocks; at least the decline window, or P would decline reads the proxy sent.",
    ("`kvobs proxy --expiry-margin`", "`ProxyConfig.expiry_margin_s`"),
)

PROXY_ENTRY_LIFETIME = Setting(
    "proxy entry lifetime",
    DECODE_TTL.default - PROXY_EXPIRY_MARGIN.default,
    "s",
    "kvobs proxy (derived)",
    "How long the proxy hands out D's params after storing them: D's TTL less the expiry "
    "margin (``entry_lifetime_s``); `--max-entry-lifetime` caps it, "
    "`--fixed-entry-lifetime` replaces it (upstream's behaviour). Must stay below D's TTL.",
    (
        "`kvobs whatif --proxy-lifetime`",
        "`kvobs tune` (recommended lifetime)",
        "monitoring config `proxy_entry_lifetime_seconds`",
        "metric `kvobs_proxy_entry_lifetime_seconds`",
    ),
)

UPSTREAM_ENTRY_LIFETIME = Setting(
    "upstream fixed entry lifetime",
    450.0,
    "s",
    "vLLM's example P/D proxy",
    "Upstream's example proxy keeps D's params this long whatever D's TTL. Not a kvobs "
    "default: `kvobs proxy --fixed-entry-lifetime` reproduces it (off by default), the "
    "simulation's capped proxies use it.",
    (
        "`kvobs proxy --fixed-entry-lifetime`",
        "testbed scenario `proxy_fixed_lifetime_s`",
        "`SyntheticConfig.proxy_lifetime_s`",
    ),
)

MIN_CACHED_TOKEN_DELTA = Setting(
    "minCachedTokenDelta",
    2048,
    "tokens",
    "llm-d router (CPU peer-to-peer host path)",
    "The router sends P to a peer's host copy only when that copy holds at least this "
    "many more of the prompt's tokens than P has itself; below it P recomputes. The "
    "value of llm-d's calibration guide.",
    ("`kvobs whatif --placement --min-cached-token-delta`",),
)

SLOW_TRANSFER_FACTOR = Setting(
    "slow_transfer_factor",
    2.0,
    "x",
    "kvobs (the slow-transfer verdict)",
    "A read that succeeded is slow-transfer when it took more than this many times the "
    "recompute estimate (its tokens at P's measured compute rate). The rate is a median "
    "of per-turn rates that spread about fourfold on a busy engine (1,451 to 6,936 "
    "tokens/s in one CI demo run), so a read within twice the estimate is inside that "
    "spread: a remote-hit, whose `ttft_gained_s` says what it gained or lost.",
    (
        "evidence key `slow_transfer_factor` of a slow-transfer finding",
        "`kvobs.verdicts.Context.slow_transfer_factor`",
    ),
)

SETTINGS: tuple[Setting, ...] = (
    DECODE_TTL,
    RECOMPUTE_THRESHOLD,
    DECLINE_WINDOW,
    PROXY_EXPIRY_MARGIN,
    PROXY_ENTRY_LIFETIME,
    UPSTREAM_ENTRY_LIFETIME,
    MIN_CACHED_TOKEN_DELTA,
    SLOW_TRANSFER_FACTOR,
)


def entry_lifetime_s(ttl_s, expiry_margin_s: float = PROXY_EXPIRY_MARGIN.default):
    """The kvobs proxy's entry lifetime under D's TTL ``ttl_s`` (no cap, not fixed;
    scalars or numpy arrays)."""
    return ttl_s - expiry_margin_s


def read_declined(age_s, ttl_s):
    """Whether P declines a read of blocks D exported ``age_s`` seconds earlier under
    the TTL ``ttl_s``: they expire within the decline window (scalars or numpy arrays;
    NaN compares False)."""
    return age_s >= ttl_s - DECLINE_WINDOW.default
