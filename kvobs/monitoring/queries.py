"""All PromQL of the mixin: dashboards, recording rules and alerts call these functions.

Every function takes a :class:`Scope` (which series, which ``rate()`` range, which labels to
keep) and returns a PromQL string. The dashboard passes template-variable selectors and
``$__rate_interval``; rules pass the static selectors of :mod:`kvobs.monitoring.config`.
Metric names come only from :mod:`kvobs.semconv`.

Conventions:
- ratios never evaluate 0/0: the denominator is filtered with ``> 0`` and a missing
  numerator counts as zero (``or den * 0``), so a ratio is either a number or no series;
- counters are always ``rate()``-d, never compared raw;
- the first turn is excluded from every reuse ratio (``turn_bucket != "1"``).

>>> s = Scope('job="p"', 'job="x"', "5m", ("job",))
>>> sum_rate(M_PULL_DECISIONS, s.engine, s.window, ("job", "decision"))
'sum by (job, decision) (rate(vllm:kvobs_pull_decisions_total{job="p"}[5m]))'
>>> ratio("a", "b")
'((a) or ((b) * 0)) / ((b) > 0)'
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvobs.monitoring.config import DIRECTION_D_TO_P, DIRECTION_P_TO_D, WAS_READ_FALSE
from kvobs.semconv import (
    M_CLASSIFIER_HELD_SPANS,
    M_CLASSIFIER_OPEN_TURNS,
    M_CLASSIFIER_SPANS,
    M_CLASSIFIER_WRITE_ERRORS,
    M_PROCESS_CPU,
    M_TURNS_RECLASSIFIED,
    M_TURN_CAUSES,
    M_TURN_LATENCY,
    M_TURN_PHASE,
    M_TURN_SLOWEST_PHASE,
    M_TURNS,
    M_DECLINED_EXPIRED,
    M_NIXL_BYTES,
    M_NIXL_EXPIRED,
    M_NIXL_FAILED,
    M_NIXL_XFER_TIME,
    M_PREFIX_MISMATCH,
    M_PROXY_DECODE_TTL,
    M_PROXY_CLIENT_PARAMS_STRIPPED,
    M_PROXY_ENTRIES,
    M_PROXY_ENTRY_AGE,
    M_PROXY_ENTRY_LIFETIME,
    M_PROXY_EVICTIONS,
    M_PROXY_FALLBACKS,
    M_PROXY_GAP,
    M_PROXY_LATENCY,
    M_PROXY_LOOKUPS,
    M_PROXY_PHASE,
    M_PROXY_REJECTED,
    M_PROXY_STORE_ERRORS,
    M_PROXY_STORES,
    M_PROXY_TTFT,
    M_PROXY_TURNS,
    M_PROXY_UPSTREAM_ERRORS,
    M_PULL_DECISIONS,
    M_READ_BYTES,
    M_READ_DURATION,
    M_READ_SETUP,
    M_READS,
    M_RECOMPUTED_TOKENS,
    M_RELEASES,
    M_REMAINING_TTL,
    M_RETAINED_BLOCK_SECONDS,
    M_RETAINED_BLOCKS,
    M_RETAINED_BYTES,
    M_REUSED_TOKENS,
    M_STUCK_PREVENTED,
    M_STUCK_WAITS,
    M_TELEMETRY_DROPPED,
    M_ENGINE_TELEMETRY_DROPPED,
    M_HOST_EVICTED_AGE,
    M_HOST_EVICTED_BLOCKS,
    M_HOST_LOADED_TOKENS,
    M_HOST_LOADS,
    M_HOST_LOOKUPS,
    M_HOST_SAVE_INCOMPLETE,
    M_HOST_SAVES,
    M_OFFLOAD_LOAD_BYTES,
    M_OFFLOAD_STORE_BYTES,
    M_TELEMETRY_ERRORS,
    M_VLLM_PREFILL_TIME,
    M_VLLM_PROMPT_CACHED_BY_SOURCE,
    M_VLLM_PROMPT_TOKENS_BY_SOURCE,
    M_VLLM_QUEUE_TIME,
    M_VLLM_TTFT,
    PROXY_PHASE_VALUES,
    TURN_BUCKET_LABEL,
    TURN_BUCKET_VALUES,
    HostLookupOutcome,
    LookupOutcome,
    Metric,
    Phase,
    ReadOutcome,
)

# Lookup outcomes that leave a later turn without usable params: the `missing-metadata`
# verdict's metric-side proxy.
MISSING_LOOKUPS = (LookupOutcome.MISS, LookupOutcome.STALE, LookupOutcome.NO_ID)
FIRST_TURN = TURN_BUCKET_VALUES[0]
D_TO_P = f'direction="{DIRECTION_D_TO_P}"'
P_TO_D = f'direction="{DIRECTION_P_TO_D}"'
# The proxy's own phases among M_PROXY_PHASE's labels (the others are the engine legs).
PROXY_OWN_PHASES = tuple(v for v in PROXY_PHASE_VALUES if v in {p.value for p in Phase})


@dataclass(frozen=True)
class Scope:
    """Where queries look and how they aggregate.

    ``engine``/``proxy``: label matchers without braces; ``window``: the ``rate()`` range;
    ``by``: labels every aggregation keeps (extra breakdown labels are appended);
    ``prefill``/``decode``: matchers added to ``engine`` for one role's engines.
    """

    engine: str
    proxy: str
    window: str
    by: tuple[str, ...] = ()
    prefill: str = ""
    decode: str = ""

    def keeping(self, *labels: str) -> "Scope":
        return replace(self, by=self.by + tuple(labels))


# --------------------------------------------------------------------------- helpers


def series(metric: Metric | str, selector: str, *extra: str, suffix: str = "") -> str:
    """``name{matchers}``; ``suffix`` picks a histogram's ``_bucket``/``_sum``/``_count``."""
    name = (metric.name if isinstance(metric, Metric) else metric) + suffix
    matchers = ", ".join(m for m in (selector, *extra) if m)
    return f"{name}{{{matchers}}}"


def _by(labels: tuple[str, ...], op: str = "sum") -> str:
    return f"{op} by ({', '.join(labels)}) " if labels else f"{op} "


def sum_rate(
    metric: Metric,
    selector: str,
    window: str,
    by: tuple[str, ...] = (),
    *extra: str,
    suffix: str = "",
) -> str:
    return f"{_by(by)}(rate({series(metric, selector, *extra, suffix=suffix)}[{window}]))"


def sum_gauge(metric: Metric, selector: str, by: tuple[str, ...] = (), *extra: str) -> str:
    return f"{_by(by)}({series(metric, selector, *extra)})"


def ratio(numerator: str, denominator: str) -> str:
    """0/0-safe ratio: no series while the denominator is 0, 0 while the numerator is absent."""
    return f"(({numerator}) or (({denominator}) * 0)) / (({denominator}) > 0)"


def quantile(
    q: float, metric: Metric, selector: str, window: str, by: tuple[str, ...] = (), *extra: str
) -> str:
    inner = sum_rate(metric, selector, window, tuple(by) + ("le",), *extra, suffix="_bucket")
    return f"histogram_quantile({q}, {inner})"


def mean(metric: Metric, selector: str, window: str, by: tuple[str, ...] = (), *extra: str) -> str:
    """Mean of a histogram's observations: ``rate(_sum) / rate(_count)``."""
    return ratio(
        sum_rate(metric, selector, window, by, *extra, suffix="_sum"),
        sum_rate(metric, selector, window, by, *extra, suffix="_count"),
    )


def minus(total: str, *parts: str) -> str:
    """``total`` less ``parts`` (an absent part counts as 0), never below 0: the parts are
    timed by other clocks and can overshoot a little.

    >>> minus("a", "b")
    'clamp_min((a) - ((b) or ((a) * 0)), 0)'
    """
    terms = "".join(f" - (({part}) or (({total}) * 0))" for part in parts)
    return f"clamp_min(({total}){terms}, 0)"


def le_matcher(bound: float) -> str:
    """Match a bucket bound however the client formatted it ("480" or "480.0")."""
    text = f"{bound:g}"
    return f'le=~"{text}(\\\\.0)?"' if "." not in text else f'le="{text}"'


def _any(values) -> str:
    return "|".join(str(getattr(v, "value", v)) for v in values)


# --------------------------------------------------------------------------- turn outcomes


def turns_rate(s: Scope, *extra: str) -> str:
    """Turns per second from the proxy, by ``s.by`` (e.g. lookup, turn_bucket)."""
    return sum_rate(M_PROXY_TURNS, s.proxy, s.window, s.by, *extra)


def first_turns_rate(s: Scope) -> str:
    return turns_rate(s, f'{TURN_BUCKET_LABEL}="{FIRST_TURN}"')


def later_turns_rate(s: Scope) -> str:
    return turns_rate(s, f'{TURN_BUCKET_LABEL}!="{FIRST_TURN}"')


def missing_metadata_ratio(s: Scope) -> str:
    """Share of later turns whose proxy lookup yielded no usable params."""
    missing = turns_rate(
        s, f'{TURN_BUCKET_LABEL}!="{FIRST_TURN}"', f'lookup=~"{_any(MISSING_LOOKUPS)}"'
    )
    return ratio(missing, later_turns_rate(s))


# ----------------------------------------------------------- true verdicts (live classifier)
# ``kvobs collect``'s /metrics: every final turn's verdict, causes and phases. Its series
# are picked by the same matchers as the proxy's (kvobs's own components).


def verdicts_rate(s: Scope, *extra: str) -> str:
    """Final turns per second by ``s.by`` (e.g. verdict, turn_bucket)."""
    return sum_rate(M_TURNS, s.proxy, s.window, s.by, *extra)


def verdict_share(s: Scope, verdict: str) -> str:
    """Share of later turns (turn 1 apart) that got ``verdict``."""
    later = f'{TURN_BUCKET_LABEL}!="{FIRST_TURN}"'
    return ratio(verdicts_rate(s, later, f'verdict="{verdict}"'), verdicts_rate(s, later))


def classified_later_turns_rate(s: Scope) -> str:
    return verdicts_rate(s, f'{TURN_BUCKET_LABEL}!="{FIRST_TURN}"')


def turn_causes_rate(s: Scope, *extra: str) -> str:
    return sum_rate(M_TURN_CAUSES, s.proxy, s.window, s.by, *extra)


def slowest_phase_rate(s: Scope, *extra: str) -> str:
    return sum_rate(M_TURN_SLOWEST_PHASE, s.proxy, s.window, s.by, *extra)


def turn_phase_quantile(s: Scope, q: float, *extra: str) -> str:
    return quantile(q, M_TURN_PHASE, s.proxy, s.window, s.by, *extra)


def classified_latency_quantile(s: Scope, q: float, *extra: str) -> str:
    return quantile(q, M_TURN_LATENCY, s.proxy, s.window, s.by, *extra)


# ----------------------------------------------------------- the live classifier itself


def classifier_cpu_share(s: Scope, targets: str) -> str:
    """CPU seconds a second of the busiest classifier process by ``s.by`` (``targets``:
    the classifiers' jobs, as every process exposes this name)."""
    return f"{_by(s.by, 'max')}(rate({series(M_PROCESS_CPU, s.proxy, targets)}[{s.window}]))"


def classifier_spans_rate(s: Scope, *extra: str) -> str:
    """Spans the classifiers received per second (outcome: classified, late, unreadable)."""
    return sum_rate(M_CLASSIFIER_SPANS, s.proxy, s.window, s.by, *extra)


def late_span_ratio(s: Scope) -> str:
    """Share of the spans received after their conversation had left the window."""
    return ratio(classifier_spans_rate(s, 'outcome="late"'), classifier_spans_rate(s))


def turn_write_errors_rate(s: Scope) -> str:
    return sum_rate(M_CLASSIFIER_WRITE_ERRORS, s.proxy, s.window, s.by)


def reclassified_turns_rate(s: Scope) -> str:
    return sum_rate(M_TURNS_RECLASSIFIED, s.proxy, s.window, s.by)


def classifier_held_spans(s: Scope) -> str:
    return sum_gauge(M_CLASSIFIER_HELD_SPANS, s.proxy, s.by)


def classifier_open_turns(s: Scope) -> str:
    return sum_gauge(M_CLASSIFIER_OPEN_TURNS, s.proxy, s.by)


def pull_decisions_rate(s: Scope) -> str:
    return sum_rate(M_PULL_DECISIONS, s.engine, s.window, s.by)


def read_outcomes_rate(s: Scope, *extra: str) -> str:
    """D->P read attempts per second (done, declined-expired, failed) by ``s.by``."""
    return sum_rate(M_READS, s.engine, s.window, s.by, D_TO_P, *extra)


# --------------------------------------------------------------------------- D->P reads


def expired_read_ratio(s: Scope) -> str:
    """Share of D->P read attempts P declined because D's blocks were (nearly) expired."""
    expired = read_outcomes_rate(s, f'outcome="{ReadOutcome.DECLINED_EXPIRED.value}"')
    return ratio(expired, read_outcomes_rate(s))


def failed_read_ratio(s: Scope) -> str:
    failed = read_outcomes_rate(s, f'outcome="{ReadOutcome.FAILED.value}"')
    return ratio(failed, read_outcomes_rate(s))


def declined_expired_rate(s: Scope) -> str:
    return sum_rate(M_DECLINED_EXPIRED, s.engine, s.window, s.by)


def read_bytes_rate(s: Scope) -> str:
    return sum_rate(M_READ_BYTES, s.engine, s.window, s.by, D_TO_P, suffix="_sum")


def read_duration_quantile(s: Scope, q: float) -> str:
    return quantile(q, M_READ_DURATION, s.engine, s.window, s.by, D_TO_P)


def reads_timed_rate(s: Scope) -> str:
    """Reads per second that recorded a duration (the rate floor of latency alerts)."""
    return sum_rate(M_READ_DURATION, s.engine, s.window, s.by, D_TO_P, suffix="_count")


def read_throughput(s: Scope) -> str:
    """Bytes per second of read time (total bytes over total read seconds)."""
    seconds = sum_rate(M_READ_DURATION, s.engine, s.window, s.by, D_TO_P, suffix="_sum")
    return ratio(read_bytes_rate(s), seconds)


def reused_tokens_per_read_second(s: Scope) -> str:
    """Tokens obtained by reads per second spent reading: compare with recompute speed."""
    seconds = sum_rate(M_READ_DURATION, s.engine, s.window, s.by, D_TO_P, suffix="_sum")
    return ratio(reused_tokens_rate(s), seconds)


def nixl_transfers_rate(s: Scope) -> str:
    """Upstream cross-check: NIXL transfers per second (count of vllm:nixl_bytes_transferred)."""
    return sum_rate(M_NIXL_BYTES, s.engine, s.window, s.by, suffix="_count")


def nixl_xfer_quantile(s: Scope, q: float) -> str:
    return quantile(q, M_NIXL_XFER_TIME, s.engine, s.window, s.by)


def nixl_failed_rate(s: Scope) -> str:
    return sum_rate(M_NIXL_FAILED, s.engine, s.window, s.by)


def nixl_expired_rate(s: Scope) -> str:
    return sum_rate(M_NIXL_EXPIRED, s.engine, s.window, s.by)


# --------------------------------------------------------------------------- retention


def retained_blocks(s: Scope) -> str:
    return sum_gauge(M_RETAINED_BLOCKS, s.engine, s.by)


def retained_bytes(s: Scope) -> str:
    return sum_gauge(M_RETAINED_BYTES, s.engine, s.by)


def retained_block_seconds_rate(s: Scope) -> str:
    """Block-seconds per second: the average number of blocks D held for reuse."""
    return sum_rate(M_RETAINED_BLOCK_SECONDS, s.engine, s.window, s.by)


def releases_rate(s: Scope) -> str:
    return sum_rate(M_RELEASES, s.engine, s.window, s.by)


def unread_release_ratio(s: Scope) -> str:
    """Share of retained requests D released without anyone reading them (wasted hold)."""
    unread = sum_rate(M_RELEASES, s.engine, s.window, s.by, f'was_read="{WAS_READ_FALSE}"')
    return ratio(unread, releases_rate(s))


def remaining_ttl_quantile(s: Scope, q: float) -> str:
    return quantile(q, M_REMAINING_TTL, s.engine, s.window, s.by)


def gap_quantile(s: Scope, q: float) -> str:
    return quantile(q, M_PROXY_GAP, s.proxy, s.window, s.by)


def share_above(
    metric: Metric,
    selector: str,
    window: str,
    by: tuple[str, ...],
    bound: str,
    buckets: tuple[float, ...],
) -> str:
    """Share of a classic histogram's observations above ``bound``, a PromQL expression
    aggregated ``by`` the same labels, read when the query runs (not when it is written).

    Observations are taken to spread evenly inside a bucket (``histogram_quantile``'s own
    assumption), so the count at or below ``bound`` is each bucket's count weighted by the
    part of it below ``bound``: ``sum_i C(b_i) * (f_i - f_i+1)`` with ``C`` the cumulative
    bucket counts and ``f_i = clamp((bound - b_i-1) / (b_i - b_i-1), 0, 1)`` (``b_0 = 0``:
    observations are >= 0). A bound on a bucket bound reads that bucket exactly; between
    two bounds it interpolates linearly; past the last finite bound nothing is known past
    it, so the share above that bound (an upper bound) is returned.

    >>> print(share_above(M_PROXY_GAP, 'job="x"', "5m", (), "ttl", (240, 360)))
    1 - ((((sum (rate(kvobs_proxy_inter_turn_gap_seconds_bucket{job="x", le=~"240(\\\\.0)?"}[5m]))) * (clamp(((ttl) - 0) / 240, 0, 1) - clamp(((ttl) - 240) / 120, 0, 1)) + (sum (rate(kvobs_proxy_inter_turn_gap_seconds_bucket{job="x", le=~"360(\\\\.0)?"}[5m]))) * clamp(((ttl) - 240) / 120, 0, 1)) or ((sum (rate(kvobs_proxy_inter_turn_gap_seconds_count{job="x"}[5m]))) * 0)) / ((sum (rate(kvobs_proxy_inter_turn_gap_seconds_count{job="x"}[5m]))) > 0))
    """
    finite = sorted(b for b in buckets if b != float("inf"))
    lows = (0, *finite[:-1])

    def below(i: int) -> str:  # the part of bucket i below the bound, 0..1
        return f"clamp((({bound}) - {lows[i]:g}) / {finite[i] - lows[i]:g}, 0, 1)"

    terms = []
    for i, le in enumerate(finite):
        weight = below(i) if i == len(finite) - 1 else f"({below(i)} - {below(i + 1)})"
        terms.append(
            f"({sum_rate(metric, selector, window, by, le_matcher(le), suffix='_bucket')})"
            f" * {weight}"
        )
    total = sum_rate(metric, selector, window, by, suffix="_count")
    return f"1 - ({ratio(' + '.join(terms), total)})"


def gap_over_ttl_ratio(s: Scope) -> str:
    """Share of inter-turn gaps longer than D's TTL as the proxy reports it
    (``kvobs_proxy_decode_ttl_seconds``: its --decode-kv-ttl, then what D's params say), so
    it follows a TTL change without regenerating anything (:func:`share_above`)."""
    return share_above(
        M_PROXY_GAP, s.proxy, s.window, s.by, reported_decode_ttl(s), M_PROXY_GAP.buckets
    )


def reported_decode_ttl(s: Scope) -> str:
    """D's TTL as the proxy reports it, once it has one (0 means none seen yet)."""
    return f"{_by(s.by, 'max')}({series(M_PROXY_DECODE_TTL, s.proxy)} > 0)"


def decode_ttl(s: Scope) -> str:
    return f"{_by(s.by, 'max')}({series(M_PROXY_DECODE_TTL, s.proxy)})"


def entry_lifetime(s: Scope) -> str:
    return f"{_by(s.by, 'max')}({series(M_PROXY_ENTRY_LIFETIME, s.proxy)})"


def entry_lifetime_not_below_decode_ttl(s: Scope) -> str:
    """Proxy entries live at least as long as D keeps the blocks (only once a TTL is seen)."""
    return f"({entry_lifetime(s)}) >= ({decode_ttl(s)}) and ({decode_ttl(s)}) > 0"


# --------------------------------------------------------------------------- proxy


def lookups_rate(s: Scope) -> str:
    return sum_rate(M_PROXY_LOOKUPS, s.proxy, s.window, s.by)


def entry_age_quantile(s: Scope, q: float) -> str:
    return quantile(q, M_PROXY_ENTRY_AGE, s.proxy, s.window, s.by)


def fallbacks_rate(s: Scope) -> str:
    return sum_rate(M_PROXY_FALLBACKS, s.proxy, s.window, s.by)


def store_errors_rate(s: Scope) -> str:
    return sum_rate(M_PROXY_STORE_ERRORS, s.proxy, s.window, s.by)


def stores_rate(s: Scope) -> str:
    return sum_rate(M_PROXY_STORES, s.proxy, s.window, s.by)


def entries(s: Scope) -> str:
    return sum_gauge(M_PROXY_ENTRIES, s.proxy, s.by)


def evictions_rate(s: Scope) -> str:
    return sum_rate(M_PROXY_EVICTIONS, s.proxy, s.window, s.by)


def upstream_errors_rate(s: Scope) -> str:
    return sum_rate(M_PROXY_UPSTREAM_ERRORS, s.proxy, s.window, s.by)


def dropped_spans_rate(s: Scope) -> str:
    return sum_rate(M_TELEMETRY_DROPPED, s.proxy, s.window, s.by)


def engine_dropped_spans_rate(s: Scope) -> str:
    return sum_rate(M_ENGINE_TELEMETRY_DROPPED, s.engine, s.window, s.by)


# --------------------------------------------------------------------------- recompute


def reused_tokens_rate(s: Scope) -> str:
    return sum_rate(M_REUSED_TOKENS, s.engine, s.window, s.by)


def recomputed_tokens_rate(s: Scope) -> str:
    return sum_rate(M_RECOMPUTED_TOKENS, s.engine, s.window, s.by)


def reuse_share(s: Scope) -> str:
    """Share of P's prompt tokens obtained by remote reads rather than computed."""
    return ratio(
        reused_tokens_rate(s), f"({reused_tokens_rate(s)}) + ({recomputed_tokens_rate(s)})"
    )


def prompt_tokens_by_source_rate(s: Scope) -> str:
    """Upstream cross-check: vLLM's own prompt-token split by source."""
    return sum_rate(M_VLLM_PROMPT_TOKENS_BY_SOURCE, s.engine, s.window, s.by)


def prefix_mismatches_rate(s: Scope) -> str:
    return sum_rate(M_PREFIX_MISMATCH, s.engine, s.window, s.by)


def stuck_waits_increase(s: Scope, window: str) -> str:
    return f"{_by(s.by)}(increase({series(M_STUCK_WAITS, s.engine)}[{window}]))"


def stuck_waits_rate(s: Scope) -> str:
    return sum_rate(M_STUCK_WAITS, s.engine, s.window, s.by)


def stuck_prevented_rate(s: Scope) -> str:
    return sum_rate(M_STUCK_PREVENTED, s.engine, s.window, s.by)


def connector_telemetry_errors_rate(s: Scope) -> str:
    return sum_rate(M_TELEMETRY_ERRORS, s.engine, s.window, s.by)


def rejected_requests_rate(s: Scope) -> str:
    return sum_rate(M_PROXY_REJECTED, s.proxy, s.window, s.by)


def client_params_stripped_rate(s: Scope) -> str:
    return sum_rate(M_PROXY_CLIENT_PARAMS_STRIPPED, s.proxy, s.window, s.by)


# --------------------------------------------------------------------------- host copy
#
# The previous turn's KV kept in an offloading tier (host memory, or a peer's over p2p)
# by vLLM's offloading connector, as KvobsOffloadingConnector counts it, next to vLLM's
# own vllm:kv_offload_* byte counters.

# Lookups that found the copy they wanted, or found it evicted (a miss asked for new tokens).
HOST_LOOKUPS_WANTING_A_COPY = (HostLookupOutcome.HIT, HostLookupOutcome.EVICTED)
COVERS_RESPONSE_FALSE = 'covers_response="false"'


def host_lookups_rate(s: Scope, *extra: str) -> str:
    return sum_rate(M_HOST_LOOKUPS, s.engine, s.window, s.by, *extra)


def host_lookups_wanting_a_copy_rate(s: Scope) -> str:
    """Admitted lookups whose tier hit served a copy or stopped at one it had evicted."""
    return host_lookups_rate(s, f'outcome=~"{_any(HOST_LOOKUPS_WANTING_A_COPY)}"')


def host_evicted_lookup_ratio(s: Scope) -> str:
    """Share of lookups wanting a host copy that found it (partly) evicted: copies
    evicted before their reuse."""
    evicted = host_lookups_rate(s, f'outcome="{HostLookupOutcome.EVICTED.value}"')
    return ratio(evicted, host_lookups_wanting_a_copy_rate(s))


def host_saves_rate(s: Scope, *extra: str) -> str:
    return sum_rate(M_HOST_SAVES, s.engine, s.window, s.by, *extra)


def host_prompt_only_ratio(s: Scope) -> str:
    """Share of host copies that stop at the prompt (no generated tokens, R)."""
    return ratio(host_saves_rate(s, COVERS_RESPONSE_FALSE), host_saves_rate(s))


def host_save_incomplete_rate(s: Scope) -> str:
    return sum_rate(M_HOST_SAVE_INCOMPLETE, s.engine, s.window, s.by)


def host_store_bytes_rate(s: Scope) -> str:
    return sum_rate(M_OFFLOAD_STORE_BYTES, s.engine, s.window, s.by)


def host_load_bytes_rate(s: Scope) -> str:
    return sum_rate(M_OFFLOAD_LOAD_BYTES, s.engine, s.window, s.by)


def host_loads_rate(s: Scope) -> str:
    return sum_rate(M_HOST_LOADS, s.engine, s.window, s.by)


def host_loaded_tokens_rate(s: Scope) -> str:
    return sum_rate(M_HOST_LOADED_TOKENS, s.engine, s.window, s.by)


def prompt_tokens_cached_by_source_rate(s: Scope) -> str:
    """Upstream cross-check: vLLM's prompt tokens found cached, by tier (device, host...)."""
    return sum_rate(M_VLLM_PROMPT_CACHED_BY_SOURCE, s.engine, s.window, s.by)


def host_evicted_blocks_rate(s: Scope) -> str:
    return sum_rate(M_HOST_EVICTED_BLOCKS, s.engine, s.window, s.by)


def host_evicted_age_quantile(s: Scope, q: float) -> str:
    return quantile(q, M_HOST_EVICTED_AGE, s.engine, s.window, s.by)


def shared_with_the_proxy(by: tuple[str, ...]) -> str:
    """``on(...)`` joining an engine's series with the proxy's of the same fleet: every
    aggregation label but the scrape job, which differs between them.

    >>> shared_with_the_proxy(("namespace", "job"))
    'on(namespace)'
    """
    return f"on({', '.join(label for label in by if label != 'job')})"


# --------------------------------------------------------------------------- TTFT


def proxy_ttft_quantile(s: Scope, q: float, *extra: str) -> str:
    return quantile(q, M_PROXY_TTFT, s.proxy, s.window, s.by, *extra)


def engine_ttft_quantile(s: Scope, q: float) -> str:
    return quantile(q, M_VLLM_TTFT, s.engine, s.window, s.by)


# --------------------------------------------------------------------------- where TTFT goes
#
# vLLM's queue time runs from the request's arrival at the scheduler to its first
# scheduling into a batch, and a request waiting for remote KV is scheduled only once the
# KV arrived (vllm/v1/core/sched/scheduler.py, WAITING_FOR_REMOTE_KVS): on P the D->P read
# and its set-up sit inside vLLM's queue time, on D the P->D hand-off does. The "waiting"
# figures take them out, so a turn's phases are not counted twice and a slow read does not
# pass for a full queue. vLLM's metrics need the role matchers (same names on P and D);
# kvobs' read metrics do not: the direction names the reader (d_to_p on P, p_to_d on D).


def _role(s: Scope, direction: str) -> str:
    """The role matcher of the engines that read in ``direction``."""
    return s.prefill if direction == D_TO_P else s.decode


def requests_rate(s: Scope, direction: str) -> str:
    """Requests per second the role reading in ``direction`` finished (P: D_TO_P)."""
    return sum_rate(
        M_VLLM_QUEUE_TIME, s.engine, s.window, s.by, _role(s, direction), suffix="_count"
    )


def prefill_requests_rate(s: Scope) -> str:
    return requests_rate(s, D_TO_P)


def transfer_seconds_rate(s: Scope, metric: Metric, direction: str) -> str:
    """Seconds per second spent in reads (M_READ_DURATION) or their set-up (M_READ_SETUP)."""
    return sum_rate(metric, s.engine, s.window, s.by, direction, suffix="_sum")


def transfer_per_request(s: Scope, metric: Metric, direction: str) -> str:
    """Read (or set-up) seconds per request of the reading role: a read's mean weighted
    by how many requests read, so phases of one request add up."""
    return ratio(transfer_seconds_rate(s, metric, direction), requests_rate(s, direction))


def transfer_mean(s: Scope, metric: Metric, direction: str) -> str:
    """Mean seconds per read (or per set-up) in ``direction`` ("": every direction)."""
    return mean(metric, s.engine, s.window, s.by, direction)


def transfer_quantile(s: Scope, q: float, metric: Metric, direction: str) -> str:
    return quantile(q, metric, s.engine, s.window, s.by, direction)


def queue_mean(s: Scope, direction: str) -> str:
    """vLLM's mean queue time on the role reading in ``direction`` (remote-KV wait included)."""
    return mean(M_VLLM_QUEUE_TIME, s.engine, s.window, s.by, _role(s, direction))


def queue_quantile(s: Scope, q: float, direction: str) -> str:
    return quantile(q, M_VLLM_QUEUE_TIME, s.engine, s.window, s.by, _role(s, direction))


def queue_waiting_per_request(s: Scope, direction: str) -> str:
    """Mean seconds a request waited in the queue of the role reading in ``direction``,
    not counting the wait for its remote KV (set-up and read)."""
    queued = sum_rate(
        M_VLLM_QUEUE_TIME, s.engine, s.window, s.by, _role(s, direction), suffix="_sum"
    )
    waiting = minus(
        queued,
        transfer_seconds_rate(s, M_READ_DURATION, direction),
        transfer_seconds_rate(s, M_READ_SETUP, direction),
    )
    return ratio(waiting, requests_rate(s, direction))


def prefill_time_mean(s: Scope) -> str:
    """P's mean time from scheduled (KV in place) to first token: its compute."""
    return mean(M_VLLM_PREFILL_TIME, s.engine, s.window, s.by, s.prefill)


def prefill_time_quantile(s: Scope, q: float) -> str:
    return quantile(q, M_VLLM_PREFILL_TIME, s.engine, s.window, s.by, s.prefill)


def prefill_ttft_mean(s: Scope) -> str:
    """vLLM's mean TTFT on P: arrival at P's API server to P's first token."""
    return mean(M_VLLM_TTFT, s.engine, s.window, s.by, s.prefill)


def prefill_queue_share(s: Scope) -> str:
    """Share of P's mean TTFT spent waiting in P's queue (remote-KV wait excluded)."""
    return ratio(queue_waiting_per_request(s, D_TO_P), prefill_ttft_mean(s))


def _own_phases() -> str:
    return f'phase=~"{_any(PROXY_OWN_PHASES)}"'


def proxy_own_phase_mean(s: Scope) -> str:
    """Mean seconds per turn of the proxy's own phases (each is timed once a turn)."""
    return mean(M_PROXY_PHASE, s.proxy, s.window, s.by, _own_phases())


def proxy_own_phase_quantile(s: Scope, q: float) -> str:
    return quantile(q, M_PROXY_PHASE, s.proxy, s.window, s.by, _own_phases())


def turn_latency_mean(s: Scope) -> str:
    """Whole-turn latency at the proxy (request in to last byte out): not TTFT."""
    return mean(M_PROXY_LATENCY, s.proxy, s.window, s.by)


def turn_latency_quantile(s: Scope, q: float) -> str:
    return quantile(q, M_PROXY_LATENCY, s.proxy, s.window, s.by)


def proxy_ttft_mean(s: Scope) -> str:
    """TTFT at the proxy; streamed turns only (the proxy sees a non-streamed one end)."""
    return mean(M_PROXY_TTFT, s.proxy, s.window, s.by)


# --------------------------------------------------------------------------- absence


def absent_per_job(metric: Metric, selector: str, targets: str, by: tuple[str, ...]) -> str:
    """Scrape jobs ``targets`` names (on ``up``) that expose no ``metric``, by ``by``; and,
    when no such job is scraped at all, ``absent()`` of the metric (one series, no job).

    >>> print(absent_per_job(M_PROXY_LOOKUPS, 'job!=""', 'job=~".*proxy.*"', ("job",)))
    (count by (job) (up{job=~".*proxy.*"}) unless count by (job) (kvobs_proxy_lookups_total{job!=""}))
    or (absent(kvobs_proxy_lookups_total{job!=""}) unless on() count(up{job=~".*proxy.*"}))
    """
    scraped = f"{_by(by, 'count')}({series('up', targets)})"
    exposing = f"{_by(by, 'count')}({series(metric, selector)})"
    return (
        f"({scraped} unless {exposing})\n"
        f"or (absent({series(metric, selector)}) unless on() count({series('up', targets)}))"
    )
