"""Grafana dashboards, built with grafana-foundation-sdk from :mod:`~kvobs.monitoring.queries`.

A panel here is a :class:`PanelSpec`: title, what it shows, its queries, a unit. The panel's
description always ends with the metric names its queries read, found by scanning the
PromQL against :mod:`kvobs.semconv`, so it cannot name a metric the query does not use.

``build_dashboards()`` returns ``{file name: dashboard dict}``; ``render()`` turns one into
the checked-in JSON text (``python -m kvobs.monitoring.generate`` writes ``dashboards/``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from kvobs.monitoring import queries as q
from kvobs.monitoring import rules
from kvobs.monitoring.config import (
    DASHBOARD_SELECTORS,
    DEFAULT,
    SCRAPE_MATCHERS,
    MonitoringConfig,
)
from kvobs.settings import DECLINE_WINDOW
from kvobs.semconv import (
    METRICS,
    M_PROXY_GAP,
    M_PROXY_LATENCY,
    M_PROXY_TTFT,
    M_PROXY_TURNS,
    M_TURNS,
    M_TURN_LATENCY,
    M_TURN_PHASE,
    M_PULL_DECISIONS,
    M_READ_DURATION,
    M_READ_SETUP,
    M_READS,
    M_RETAINED_BLOCKS,
    PROMPT_BUCKET_LABEL,
    TURN_BUCKET_LABEL,
    UPSTREAM_METRICS,
)

DATASOURCE_VAR = "datasource"
VARIABLES = ("datasource", "cluster", "namespace", "job", "pod", "instance", "model_name", "engine")
RATE_INTERVAL = "$__rate_interval"
# The oldest Grafana the dashboard is built for and checked against: the models of
# grafana-foundation-sdk 11.6 (pyproject's dashboards extra). Stated in the JSON's
# __requires (what Grafana's own export writes) and in docs/dashboards.md.
GRAFANA_MIN_VERSION = "11.6.0"
# Per-process panels keep one series per pod (per scrape target where there is no pod
# label, e.g. a static scrape), named by job and pod: the engines' jobs are
# <namespace>/vllm-<role> (deploy/'s PodMonitor), so "serving/vllm-decode vllm-decode-7c9"
# instead of an address.
PER_POD = ("namespace", "job", "pod", "instance")
POD = "{{job}} {{pod}}"
LATER_TURNS = f'{TURN_BUCKET_LABEL}!="{q.FIRST_TURN}"'
GAP_METHOD = (
    "The TTL is read when the query runs (`kvobs_proxy_decode_ttl_seconds`: the proxy's "
    "--decode-kv-ttl, then what D's params carry), so a TTL change needs no regenerated "
    "dashboard. The gap histogram's bounds are fixed "
    f"({', '.join(f'{b:g}' for b in M_PROXY_GAP.buckets)} s): a TTL on a bound reads that "
    "bucket; between two bounds the count at the TTL is interpolated linearly; past the "
    f"last bound only the share above {max(M_PROXY_GAP.buckets):g} s is known, an upper "
    "bound."
)


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class PanelSpec:
    title: str
    what: str  # one or two sentences: what it shows and how to read it
    targets: tuple[Target, ...]
    unit: str = "short"
    stacked: bool = False
    threshold: float | None = None  # drawn as a dashed red line (stat: red above it)
    width: int = 8
    kind: str = "timeseries"  # | "stat": one current value


# Panels that show what an alert fires on link to its runbook (panel title -> alerts).
RUNBOOK_LINKS: dict[str, tuple[str, ...]] = {
    "Later turns missing metadata": ("KvobsMissingMetadataHigh",),
    "Expired D->P reads": ("KvobsRemoteReadsExpired",),
    "D->P read p95": ("KvobsRemoteReadLatencyHigh",),
    "Later turns by proxy lookup outcome": ("KvobsMissingMetadataHigh",),
    "Missing-metadata share by turn bucket": ("KvobsMissingMetadataHigh",),
    "D->P read outcomes": ("KvobsRemoteReadsExpired", "KvobsRemoteReadsFailing"),
    "Read duration percentiles": ("KvobsRemoteReadLatencyHigh",),
    "Expired and failed share of read attempts": (
        "KvobsRemoteReadsExpired",
        "KvobsRemoteReadsFailing",
    ),
    "Inter-turn gap against TTLs": ("KvobsProxyEntryOutlivesDecodeTTL",),
    "Lookups by outcome": ("KvobsProxyTelemetryAbsent",),
    "Fallbacks by reason": ("KvobsProxyFallbacks",),
    "Metadata store errors": ("KvobsProxyStoreErrors",),
    "Dropped telemetry": ("KvobsTelemetryDropped",),
    "P pull decisions": ("KvobsEngineTelemetryAbsent",),
    "Reused tokens per second of read time": ("KvobsRemoteReadsSlowerThanRecompute",),
    "Prefix mismatches and stuck waits": ("KvobsRequestsStuckWaitingForRemoteKV",),
    "P queue share of P's TTFT": (rules.PREFILL_QUEUEING_ALERT,),
    "Host copies evicted before reuse": (rules.HOST_EVICTED_ALERT,),
    "Prompt-only share of host copies": (rules.HOST_PROMPT_ONLY_ALERT,),
    "Fault verdict shares of later turns": tuple(rules.VERDICT_ALERTS.values()),
    "Later turns by verdict": tuple(rules.VERDICT_ALERTS.values()),
    "Classifier CPU": ("KvobsClassifierSaturated",),
    "Spans received by outcome": ("KvobsClassifierLateSpans", "KvobsClassifierTelemetryAbsent"),
    "Turn writes failed, turns re-classified": ("KvobsClassifierTurnWriteErrors",),
}
# Histograms the proxy exposes with exemplars (trace_id of the turn): their quantile
# queries ask Grafana for exemplars, which link to the trace (datasource's
# exemplarTraceIdDestinations, see kvobs.monitoring.grafana.datasource_provisioning).
EXEMPLAR_METRICS = (M_PROXY_TTFT, M_PROXY_LATENCY, M_TURN_PHASE, M_TURN_LATENCY)


@dataclass(frozen=True)
class RowSpec:
    title: str
    panels: tuple[PanelSpec, ...] = field(default_factory=tuple)


def metrics_in(expr: str) -> list[str]:
    """Exposed metric names (from semconv) that a PromQL expression reads, in order.

    >>> metrics_in('rate(vllm:kvobs_remote_read_bytes_sum{x="y"}[5m]) / kvobs_proxy_entries')
    ['vllm:kvobs_remote_read_bytes', 'kvobs_proxy_entries']
    """
    known = {m.name: m for m in (*METRICS.values(), *UPSTREAM_METRICS.values())}
    found = []
    for token in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        name = token
        if name not in known:
            for suffix in ("_bucket", "_sum", "_count"):
                if name.endswith(suffix) and name[: -len(suffix)] in known:
                    name = name[: -len(suffix)]
                    break
        if name in known and name not in found:
            found.append(name)
    return found


def description(spec: PanelSpec) -> str:
    names = []
    for target in spec.targets:
        names += [n for n in metrics_in(target.expr) if n not in names]
    return f"{spec.what}\n\nMetrics: {', '.join(f'`{n}`' for n in names)}."


# --------------------------------------------------------------------------- content


def rows(config: MonitoringConfig = DEFAULT) -> tuple[RowSpec, ...]:
    s = q.Scope(
        DASHBOARD_SELECTORS.engine,
        DASHBOARD_SELECTORS.proxy,
        RATE_INTERVAL,
        prefill=config.selectors.prefill,
        decode=config.selectors.decode,
    )
    th = config.thresholds
    T = Target
    return (
        now_row(s, config),
        RowSpec(
            "Turn outcomes (true verdicts, from the live classifier; turn 1 apart)",
            (
                PanelSpec(
                    "Later turns by verdict",
                    "Turns after the first, by the verdict `kvobs collect` gave each when it "
                    "became final (the same rules as `kvobs diagnose`). Exemplars link to "
                    "the turns' traces.",
                    (T(q.verdicts_rate(s.keeping("verdict"), LATER_TURNS), "{{verdict}}"),),
                    "reqps",
                    stacked=True,
                ),
                PanelSpec(
                    "Fault verdict shares of later turns",
                    "Share of later turns that were expired, missing-metadata, transfer-failed "
                    "or slow-transfer; each has its alert (KvobsTurns*).",
                    tuple(
                        T(q.verdict_share(s, verdict), verdict)
                        for verdict in (
                            "expired",
                            "missing-metadata",
                            "transfer-failed",
                            "slow-transfer",
                        )
                    ),
                    "percentunit",
                ),
                PanelSpec(
                    "First turns by verdict",
                    "Turn 1 of each conversation: first-turn, or insufficient-evidence when "
                    "its spans are missing. Kept apart from every reuse figure.",
                    (
                        T(
                            q.verdicts_rate(s.keeping("verdict"), f'{TURN_BUCKET_LABEL}="1"'),
                            "{{verdict}}",
                        ),
                    ),
                    "reqps",
                    stacked=True,
                ),
                PanelSpec(
                    "Latency causes",
                    "Causes named on final turns (a turn may name several): what their time "
                    "went to, independent of the reuse verdict.",
                    (T(q.turn_causes_rate(s.keeping("cause")), "{{cause}}"),),
                    "reqps",
                    stacked=True,
                ),
                PanelSpec(
                    "Slowest phase",
                    "Final turns by the phase that took most of their latency.",
                    (T(q.slowest_phase_rate(s.keeping("phase")), "{{phase}}"),),
                    "reqps",
                    stacked=True,
                ),
                PanelSpec(
                    "Phase p95",
                    "95th percentile of each phase's seconds over final turns.",
                    (T(q.turn_phase_quantile(s.keeping("phase"), 0.95), "{{phase}}"),),
                    "s",
                ),
            ),
        ),
        RowSpec(
            "Turn outcomes, metric side (fleets without the classifier)",
            (
                PanelSpec(
                    "Later turns by proxy lookup outcome",
                    "Turns after the first, by what the proxy's metadata lookup found. hit: "
                    "D's params went to P; miss / stale / no-id: the missing-metadata verdict; "
                    "prefix-mismatch: history rewritten since the last turn.",
                    (T(q.turns_rate(s.keeping("lookup"), LATER_TURNS), "{{lookup}}"),),
                    "reqps",
                    stacked=True,
                ),
                PanelSpec(
                    "First turns by prompt-length bucket",
                    "Turn 1 of each conversation: nothing earlier to reuse (first-turn verdict). "
                    "Kept apart from every reuse figure.",
                    (T(q.first_turns_rate(s.keeping(PROMPT_BUCKET_LABEL)), "{{prompt_bucket}}"),),
                    "reqps",
                    stacked=True,
                ),
                PanelSpec(
                    "Missing-metadata share by turn bucket",
                    "Share of later turns whose lookup was miss, stale or no-id, per turn-index "
                    "bucket. A rise at 3-4 or 5-8 but not at 2 points at the proxy's entry "
                    "lifetime or at long inter-turn gaps.",
                    (
                        T(
                            q.missing_metadata_ratio(s.keeping(TURN_BUCKET_LABEL)),
                            "turn {{turn_bucket}}",
                        ),
                    ),
                    "percentunit",
                    threshold=th.missing_metadata_ratio,
                ),
                PanelSpec(
                    "Missing-metadata share by prompt-length bucket",
                    "Share of later turns without usable params, per prompt-length bucket "
                    "(long prompts lose the most when they recompute).",
                    (
                        T(
                            q.missing_metadata_ratio(s.keeping(PROMPT_BUCKET_LABEL)),
                            "{{prompt_bucket}}",
                        ),
                    ),
                    "percentunit",
                    threshold=th.missing_metadata_ratio,
                ),
                PanelSpec(
                    "P pull decisions",
                    "P's choice per request offered remote KV. pull: read D's KV; "
                    "below-threshold / local-hit: recomputed or served locally by design; "
                    "no-params / invalid: missing-metadata; prefix-mismatch: old blocks no "
                    "longer a prefix of the prompt.",
                    (T(q.pull_decisions_rate(s.keeping("decision")), "{{decision}}"),),
                    "ops",
                    stacked=True,
                ),
                PanelSpec(
                    "D->P read outcomes",
                    "Reads P started: done (remote-hit or slow-transfer), declined-expired "
                    "(expired verdict), failed (transfer-failed verdict).",
                    (T(q.read_outcomes_rate(s.keeping("outcome")), "{{outcome}}"),),
                    "ops",
                    stacked=True,
                ),
            ),
        ),
        RowSpec(
            "D->P reads",
            (
                PanelSpec(
                    "Reads per second: kvobs vs NIXL",
                    "Completed D->P reads counted by kvobs next to vLLM's own NIXL transfer "
                    "count: the two should match on P.",
                    (
                        T(q.read_outcomes_rate(s, 'outcome="done"'), "kvobs reads done"),
                        T(q.nixl_transfers_rate(s), "NIXL transfers"),
                    ),
                    "ops",
                ),
                PanelSpec(
                    "Bytes read per second",
                    "KV bytes P read from D per second.",
                    (T(q.read_bytes_rate(s.keeping(*PER_POD)), POD),),
                    "Bps",
                ),
                PanelSpec(
                    "Read duration percentiles",
                    "D->P read duration p50 / p95 / p99 (kvobs) and NIXL's transfer time p95. "
                    "The dashed line is the read-latency SLO.",
                    (
                        T(q.read_duration_quantile(s, 0.5), "p50"),
                        T(q.read_duration_quantile(s, 0.95), "p95"),
                        T(q.read_duration_quantile(s, 0.99), "p99"),
                        T(q.nixl_xfer_quantile(s, 0.95), "NIXL xfer p95"),
                    ),
                    "s",
                    threshold=th.read_p95_seconds,
                ),
                PanelSpec(
                    "Read throughput",
                    "Bytes moved per second of read time (sum of bytes over sum of read seconds).",
                    (T(q.read_throughput(s.keeping(*PER_POD)), POD),),
                    "Bps",
                ),
                PanelSpec(
                    "Declined (expired) and failed reads",
                    "Reads P declined because D's blocks were (nearly) past TTL, reads that "
                    "failed, and vLLM's own failed-transfer and expired-request counters.",
                    (
                        T(q.declined_expired_rate(s), "declined expired (kvobs)"),
                        T(q.read_outcomes_rate(s, 'outcome="failed"'), "failed (kvobs)"),
                        T(q.nixl_failed_rate(s), "NIXL failed transfers"),
                        T(q.nixl_expired_rate(s), "NIXL expired requests"),
                    ),
                    "ops",
                ),
                PanelSpec(
                    "Expired and failed share of read attempts",
                    "Share of D->P read attempts declined as expired and share that failed. "
                    "The dashed line is the expired-read alert threshold.",
                    (T(q.expired_read_ratio(s), "expired"), T(q.failed_read_ratio(s), "failed")),
                    "percentunit",
                    threshold=th.expired_read_ratio,
                ),
            ),
        ),
        RowSpec(
            "Retention and expiry (D)",
            (
                PanelSpec(
                    "Retained blocks",
                    "Blocks each D engine currently holds for a next turn.",
                    (T(q.retained_blocks(s.keeping(*PER_POD)), POD),),
                    "short",
                ),
                PanelSpec(
                    "Retained bytes",
                    "Bytes each D engine currently holds for a next turn.",
                    (T(q.retained_bytes(s.keeping(*PER_POD)), POD),),
                    "bytes",
                ),
                PanelSpec(
                    "Average blocks held (block-seconds per second)",
                    "Rate of retained block-seconds: the average number of blocks held for "
                    "reuse, i.e. the memory cost of retention (D also keeps stepping while it "
                    "holds any).",
                    (T(q.retained_block_seconds_rate(s.keeping(*PER_POD)), POD),),
                    "short",
                ),
                PanelSpec(
                    "Releases by reason and read",
                    "Retained requests released, by reason (expired | read) and whether any "
                    "remote worker read them.",
                    (
                        T(
                            q.releases_rate(s.keeping("reason", "was_read")),
                            "{{reason}} read={{was_read}}",
                        ),
                    ),
                    "ops",
                    stacked=True,
                ),
                PanelSpec(
                    "Released without a read",
                    "Share of retained requests released without any read: retention that "
                    "cost memory and compute for nothing (conversations that ended, or "
                    "metadata that never reached P).",
                    (T(q.unread_release_ratio(s), "unread share"),),
                    "percentunit",
                ),
                PanelSpec(
                    "Remaining TTL when a read began",
                    "Seconds left before D's expiry when P began a read. A low p05 means reads "
                    f"race the TTL and some get declined; P declines within {DECLINE_WINDOW} of "
                    "expiry.",
                    (
                        T(q.remaining_ttl_quantile(s, 0.05), "p05"),
                        T(q.remaining_ttl_quantile(s, 0.5), "p50"),
                    ),
                    "s",
                    threshold=DECLINE_WINDOW.default,
                ),
                PanelSpec(
                    "Inter-turn gap against TTLs",
                    "Gap between a turn's end and the next turn's start (p50, p95) against D's "
                    "decoder_kv_blocks_ttl and the proxy's entry lifetime, as the proxy reports "
                    "them.",
                    (
                        T(q.gap_quantile(s, 0.5), "gap p50"),
                        T(q.gap_quantile(s, 0.95), "gap p95"),
                        T(q.decode_ttl(s), "decode TTL"),
                        T(q.entry_lifetime(s), "proxy entry lifetime"),
                    ),
                    "s",
                ),
                PanelSpec(
                    "Gaps longer than D's TTL",
                    "Share of inter-turn gaps above D's decoder_kv_blocks_ttl as the proxy "
                    "reports it: those turns cannot reuse D's KV whatever the proxy does. "
                    f"{GAP_METHOD}",
                    (T(q.gap_over_ttl_ratio(s), "gap > D's TTL"),),
                    "percentunit",
                ),
            ),
        ),
        RowSpec(
            "Proxy",
            (
                PanelSpec(
                    "Lookups by outcome",
                    "Metadata lookups: hit, miss (no entry: restart, TTL, other replica, "
                    "stream metadata not captured), stale, no-id, prefix-mismatch.",
                    (T(q.lookups_rate(s.keeping("outcome")), "{{outcome}}"),),
                    "ops",
                    stacked=True,
                ),
                PanelSpec(
                    "Entry age at lookup",
                    "Age of the metadata entry at lookup (p50, p95) against the configured "
                    "entry lifetime.",
                    (
                        T(q.entry_age_quantile(s, 0.5), "p50"),
                        T(q.entry_age_quantile(s, 0.95), "p95"),
                        T(q.entry_lifetime(s), "entry lifetime"),
                    ),
                    "s",
                ),
                PanelSpec(
                    "Fallbacks by reason",
                    "P requests the proxy retried without params (read declined, read failed, "
                    "prefill error).",
                    (T(q.fallbacks_rate(s.keeping("reason")), "{{reason}}"),),
                    "ops",
                    stacked=True,
                ),
                PanelSpec(
                    "Metadata store errors",
                    "Errors from the metadata store backend (memory, Redis).",
                    (T(q.store_errors_rate(s.keeping("backend")), "{{backend}}"),),
                    "ops",
                ),
                PanelSpec(
                    "Stores by action and source",
                    "D params stored / refreshed / skipped, by where they came from (body, "
                    "stream, published). Only skipped stores on streaming traffic mean the "
                    "stream never carried kv_transfer_params.",
                    (T(q.stores_rate(s.keeping("action", "source")), "{{action}} / {{source}}"),),
                    "ops",
                    stacked=True,
                ),
                PanelSpec(
                    "Entries in the store",
                    "Metadata entries currently held by each proxy.",
                    (T(q.entries(s.keeping(*PER_POD)), POD),),
                    "short",
                ),
                PanelSpec(
                    "Evictions and failed engine legs",
                    "Entries evicted by the entry cap, and failed P/D legs by role and kind.",
                    (
                        T(q.evictions_rate(s), "evictions"),
                        T(q.upstream_errors_rate(s.keeping("role", "kind")), "{{role}} {{kind}}"),
                    ),
                    "ops",
                ),
                PanelSpec(
                    "Rejected and sanitised client requests",
                    "Client requests the proxy refused with a 4xx, by reason, and requests whose "
                    "own kv_transfer_params the proxy stripped before forwarding.",
                    (
                        T(q.rejected_requests_rate(s.keeping("reason")), "rejected: {{reason}}"),
                        T(q.client_params_stripped_rate(s), "client params stripped"),
                    ),
                    "ops",
                ),
                PanelSpec(
                    "Dropped telemetry",
                    "Spans the proxy and the engines lost (a full export queue, or failed "
                    "exports: collector down, span store not writable), and telemetry failures "
                    "caught inside the connector (telemetry never blocks serving; gaps make "
                    "kvobs diagnose report insufficient-evidence).",
                    (
                        T(
                            q.dropped_spans_rate(s.keeping(*PER_POD, "reason")),
                            f"dropped spans {POD} ({{{{reason}}}})",
                        ),
                        T(
                            q.engine_dropped_spans_rate(s.keeping(*PER_POD, "reason")),
                            f"engine dropped spans {POD} ({{{{reason}}}})",
                        ),
                        T(
                            q.connector_telemetry_errors_rate(s.keeping(*PER_POD)),
                            f"connector telemetry errors {POD}",
                        ),
                    ),
                    "ops",
                ),
            ),
        ),
        RowSpec(
            "Recompute",
            (
                PanelSpec(
                    "Prompt tokens: reused by reads vs recomputed",
                    "Tokens P obtained by D->P reads against tokens P computed itself, by "
                    "reason (no-params, below-threshold, suffix, prefix-mismatch, fallback).",
                    (
                        T(q.reused_tokens_rate(s), "reused (remote read)"),
                        T(q.recomputed_tokens_rate(s.keeping("reason")), "recomputed: {{reason}}"),
                    ),
                    "short",
                    stacked=True,
                ),
                PanelSpec(
                    "Reuse share",
                    "Share of P's prompt tokens obtained by remote reads rather than computed.",
                    (T(q.reuse_share(s.keeping("model_name")), "{{model_name}}"),),
                    "percentunit",
                ),
                PanelSpec(
                    "vLLM prompt tokens by source",
                    "vLLM's own split of prompt tokens (local_compute, local_cache_hit, "
                    "external_kv_transfer): the upstream cross-check of the panel on the left.",
                    (T(q.prompt_tokens_by_source_rate(s.keeping("source")), "{{source}}"),),
                    "short",
                    stacked=True,
                ),
                PanelSpec(
                    "Reused tokens per second of read time",
                    "Tokens delivered per second spent reading. Below the dashed line (the "
                    "configured recompute speed) reads are slower than recomputing.",
                    (T(q.reused_tokens_per_read_second(s.keeping(*PER_POD)), POD),),
                    "short",
                    threshold=th.recompute_tokens_per_second,
                ),
                PanelSpec(
                    "Prefix mismatches and stuck waits",
                    "Offered remote KV whose block hashes did not match the prompt, requests "
                    "found waiting for remote KV that will never arrive, and would-be stuck "
                    "waits kvobs_fix_stuck_waits turned into recomputes.",
                    (
                        T(q.prefix_mismatches_rate(s), "prefix mismatches"),
                        T(q.stuck_waits_rate(s), "stuck waits"),
                        T(q.stuck_prevented_rate(s), "stuck waits prevented"),
                    ),
                    "ops",
                ),
            ),
        ),
        RowSpec(
            "TTFT by turn",
            (
                PanelSpec(
                    "TTFT p95 by turn bucket (proxy)",
                    "Time to first token seen by the proxy, p95 per turn-index bucket. Turn 1 "
                    "always recomputes; later turns should be faster when reads pay off.",
                    (
                        T(
                            q.proxy_ttft_quantile(s.keeping(TURN_BUCKET_LABEL), 0.95),
                            "turn {{turn_bucket}}",
                        ),
                    ),
                    "s",
                ),
                PanelSpec(
                    "TTFT p50 by turn bucket (proxy)",
                    "Median time to first token per turn-index bucket.",
                    (
                        T(
                            q.proxy_ttft_quantile(s.keeping(TURN_BUCKET_LABEL), 0.5),
                            "turn {{turn_bucket}}",
                        ),
                    ),
                    "s",
                ),
                PanelSpec(
                    "Later-turn TTFT p95 by prompt-length bucket (proxy)",
                    "Time to first token p95 of turns after the first, per prompt-length bucket.",
                    (
                        T(
                            q.proxy_ttft_quantile(
                                s.keeping(PROMPT_BUCKET_LABEL), 0.95, LATER_TURNS
                            ),
                            "{{prompt_bucket}}",
                        ),
                    ),
                    "s",
                ),
                PanelSpec(
                    "Engine TTFT p95 (vLLM)",
                    "vLLM's engine-side time to first token p95, per model and engine.",
                    (
                        T(
                            q.engine_ttft_quantile(s.keeping("model_name", "engine"), 0.95),
                            "{{model_name}} engine {{engine}}",
                        ),
                    ),
                    "s",
                ),
            ),
        ),
        where_ttft_goes(s, config),
        host_copy(s, config),
        classifier_row(s, config),
    )


def classifier_row(s: q.Scope, config: MonitoringConfig) -> RowSpec:
    """The live classifier itself: whether the true verdicts above can be trusted."""
    T = Target
    per_process = s.keeping(*PER_POD)
    return RowSpec(
        "Live classifier (kvobs collect): keeping up",
        (
            PanelSpec(
                "Classifier CPU",
                "CPU seconds a second of each `kvobs collect` process: it receives, decodes "
                "and classifies on one core, so near 100 % it falls behind (the Collector's "
                "queue grows, then drops spans). Run several classifiers past it.",
                (
                    T(
                        q.classifier_cpu_share(per_process, config.selectors.classifier_targets),
                        POD,
                    ),
                ),
                "percentunit",
                threshold=config.thresholds.classifier_cpu_share,
                width=6,
            ),
            PanelSpec(
                "Spans received by outcome",
                "Spans the classifiers received: classified (held for their turn), late "
                "(their conversation had left the window and could not be recalled: "
                "stored, not classified), unreadable.",
                (T(q.classifier_spans_rate(s.keeping("outcome")), "{{outcome}}"),),
                "ops",
                stacked=True,
                width=6,
            ),
            PanelSpec(
                "Held spans and open turns",
                "What each classifier holds in memory: spans of the conversations within "
                "its window, and turns classified but not final yet.",
                (
                    T(q.classifier_held_spans(per_process), f"spans held, {POD}"),
                    T(q.classifier_open_turns(per_process), f"open turns, {POD}"),
                ),
                width=6,
            ),
            PanelSpec(
                "Turn writes failed, turns re-classified",
                "Failed writes of final turns to the turn store (the rows wait in memory), "
                "and final turns written again as a new version (a late span, a lineage "
                "settled by a later turn).",
                (
                    T(q.turn_write_errors_rate(s), "failed writes"),
                    T(q.reclassified_turns_rate(s), "re-classified turns"),
                ),
                "ops",
                width=6,
            ),
        ),
    )


def now_row(s: q.Scope, config: MonitoringConfig) -> RowSpec:
    """The first row: one number each, what an operator looks at first."""
    T = Target
    th = config.thresholds
    return RowSpec(
        "Now",
        (
            PanelSpec(
                "Reuse now",
                "Share of P's prompt tokens obtained by D->P reads rather than computed "
                "(later turns that reused their history).",
                (T(q.reuse_share(s), "reuse"),),
                "percentunit",
                width=4,
                kind="stat",
            ),
            PanelSpec(
                "Later turns missing metadata",
                "Share of turns after the first whose proxy lookup found no usable params.",
                (T(q.missing_metadata_ratio(s), "missing"),),
                "percentunit",
                threshold=th.missing_metadata_ratio,
                width=4,
                kind="stat",
            ),
            PanelSpec(
                "Expired D->P reads",
                "Share of D->P read attempts declined because D's blocks were (nearly) expired.",
                (T(q.expired_read_ratio(s), "expired"),),
                "percentunit",
                threshold=th.expired_read_ratio,
                width=4,
                kind="stat",
            ),
            PanelSpec(
                "D->P read p95",
                "95th percentile of a D->P read's duration against the read-latency SLO.",
                (T(q.read_duration_quantile(s, 0.95), "p95"),),
                "s",
                threshold=th.read_p95_seconds,
                width=4,
                kind="stat",
            ),
            PanelSpec(
                "Later-turn TTFT p95",
                "Time to first token p95 of turns after the first, at the proxy.",
                (T(q.proxy_ttft_quantile(s, 0.95, LATER_TURNS), "p95"),),
                "s",
                width=4,
                kind="stat",
            ),
            PanelSpec(
                "Gaps beyond D's TTL",
                f"Share of inter-turn gaps above D's TTL as the proxy reports it. {GAP_METHOD}",
                (T(q.gap_over_ttl_ratio(s), "gap > TTL"),),
                "percentunit",
                width=4,
                kind="stat",
            ),
        ),
    )


def where_ttft_goes(s: q.Scope, config: MonitoringConfig) -> RowSpec:
    """A turn's latency phase by phase (the metric side of ``kvobs diagnose``'s timeline)."""
    T = Target
    D2P, P2D = q.D_TO_P, q.P_TO_D
    alert = rules.PREFILL_QUEUEING_ALERT
    return RowSpec(
        "Where TTFT goes",
        (
            PanelSpec(
                "Mean seconds per request, by phase",
                "Where a turn's time goes before its first token, in time order: P's queue "
                "(vLLM's queue time less the wait for D's KV, which vLLM counts as queue time), "
                "the NIXL set-up and the D->P read (per P request, so turns without a read count "
                "as 0), P's prefill, D's queue less the hand-off, the P->D set-up and hand-off "
                "(per D request), and the proxy's own phases (per turn). Engine frontends, D's "
                "first token and the decode are not in the stack: compare with the turn latency "
                "and TTFT panel.",
                (
                    T(q.queue_waiting_per_request(s, D2P), "P queue (waiting)"),
                    T(q.transfer_per_request(s, M_READ_SETUP, D2P), "D->P NIXL set-up"),
                    T(q.transfer_per_request(s, M_READ_DURATION, D2P), "D->P read"),
                    T(q.prefill_time_mean(s), "P prefill"),
                    T(q.queue_waiting_per_request(s, P2D), "D queue (waiting)"),
                    T(q.transfer_per_request(s, M_READ_SETUP, P2D), "P->D NIXL set-up"),
                    T(q.transfer_per_request(s, M_READ_DURATION, P2D), "P->D hand-off"),
                    T(q.proxy_own_phase_mean(s.keeping("phase")), "proxy {{phase}}"),
                ),
                "s",
                stacked=True,
                width=16,
            ),
            PanelSpec(
                "Turn latency and TTFT (proxy)",
                "Whole-turn latency (request in to last byte out, every turn) and time to first "
                "token (streamed turns only: the proxy sees a non-streamed answer only at its "
                "end), mean and p95. Latency is not TTFT: a long answer lengthens latency only.",
                (
                    T(q.turn_latency_mean(s), "turn latency mean"),
                    T(q.turn_latency_quantile(s, 0.95), "turn latency p95"),
                    T(q.proxy_ttft_mean(s), "TTFT mean (streamed turns)"),
                    T(q.proxy_ttft_quantile(s, 0.95), "TTFT p95 (streamed turns)"),
                ),
                "s",
            ),
            PanelSpec(
                "P queue share of P's TTFT",
                "Mean time P's requests waited in its queue (wait for D's KV excluded) over P's "
                f"mean engine TTFT. Above the dashed line for {config.windows.for_ratio} {alert} "
                f"fires (runbook: {rules.runbook_url(alert, config)}); `kvobs diagnose` names "
                "the turns' cause queued-at-p.",
                (T(q.prefill_queue_share(s), "P queue / P engine TTFT"),),
                "percentunit",
                threshold=config.thresholds.prefill_queue_share,
            ),
            PanelSpec(
                "P queue (prefill engines)",
                "Seconds P's requests waited before P scheduled them: the wait alone (vLLM's "
                "queue time less the D->P set-up and read), vLLM's own queue time (mean, p95: "
                "the wait for D's KV included), and P's engine TTFT for scale.",
                (
                    T(q.queue_waiting_per_request(s, D2P), "waiting mean"),
                    T(q.queue_mean(s, D2P), "vLLM queue mean (with KV wait)"),
                    T(q.queue_quantile(s, 0.95, D2P), "vLLM queue p95 (with KV wait)"),
                    T(q.prefill_ttft_mean(s), "P engine TTFT mean"),
                ),
                "s",
            ),
            PanelSpec(
                "P prefill time (prefill engines)",
                "vLLM's prefill time on P: scheduled (remote KV in place) to first token, i.e. "
                "computing the tokens not reused.",
                (T(q.prefill_time_mean(s), "mean"), T(q.prefill_time_quantile(s, 0.95), "p95")),
                "s",
            ),
            PanelSpec(
                "D->P read (P reading D's KV)",
                "Duration of P's reads of D's retained KV: mean and p95 per read, and per P "
                "request (what reads add to an average request).",
                (
                    T(q.transfer_mean(s, M_READ_DURATION, D2P), "mean per read"),
                    T(q.transfer_quantile(s, 0.95, M_READ_DURATION, D2P), "p95 per read"),
                    T(q.transfer_per_request(s, M_READ_DURATION, D2P), "per P request"),
                ),
                "s",
            ),
            PanelSpec(
                "NIXL connection set-up by direction",
                "Wait before a read could start, per read: the NIXL handshake the first time a "
                "worker reads from an engine, near 0 after. d_to_p: P reading D; p_to_d: D "
                "pulling P's prefill. A p95 that stays high means engines keep reconnecting.",
                (
                    T(
                        q.transfer_mean(s.keeping("direction"), M_READ_SETUP, ""),
                        "mean {{direction}}",
                    ),
                    T(
                        q.transfer_quantile(s.keeping("direction"), 0.95, M_READ_SETUP, ""),
                        "p95 {{direction}}",
                    ),
                ),
                "s",
            ),
            PanelSpec(
                "P->D hand-off (D reading P's KV)",
                "Duration of D's reads of the KV P just computed (the classic P/D hand-off): "
                "mean and p95 per read.",
                (
                    T(q.transfer_mean(s, M_READ_DURATION, P2D), "mean"),
                    T(q.transfer_quantile(s, 0.95, M_READ_DURATION, P2D), "p95"),
                ),
                "s",
            ),
            PanelSpec(
                "D queue (decode engines)",
                "Seconds D's requests waited before D scheduled them: the wait alone (vLLM's "
                "queue time less the P->D set-up and hand-off) and vLLM's own queue time "
                "(mean, p95: the hand-off included).",
                (
                    T(q.queue_waiting_per_request(s, P2D), "waiting mean"),
                    T(q.queue_mean(s, P2D), "vLLM queue mean (with hand-off)"),
                    T(q.queue_quantile(s, 0.95, P2D), "vLLM queue p95 (with hand-off)"),
                ),
                "s",
            ),
            PanelSpec(
                "Proxy's own time by phase",
                "The proxy's own work per turn: proxy-in (lookup, body rewrite), proxy-hop (P's "
                "answer to the D request) and proxy-out (store, last write); mean and p95.",
                (
                    T(q.proxy_own_phase_mean(s.keeping("phase")), "mean {{phase}}"),
                    T(q.proxy_own_phase_quantile(s.keeping("phase"), 0.95), "p95 {{phase}}"),
                ),
                "s",
            ),
        ),
    )


def host_copy(s: q.Scope, config: MonitoringConfig) -> RowSpec:
    """The previous turn's KV kept in an offloading tier (vLLM's offloading connector):
    what is saved, what comes back, what is lost before it could (docs/host_copy.md)."""
    T = Target
    th = config.thresholds
    return RowSpec(
        "Host copy (offloading tier)",
        (
            PanelSpec(
                "Host tier bytes saved and loaded",
                "Bytes the engines copied to their offloading tier (host memory, or a peer's) "
                "and loaded back, per second, as vLLM counts them. A store rate far above the "
                "load rate: the tier fills with copies nobody asks for again.",
                (
                    T(q.host_store_bytes_rate(s.keeping(*PER_POD)), f"saved {POD}"),
                    T(q.host_load_bytes_rate(s.keeping(*PER_POD)), f"loaded {POD}"),
                ),
                "Bps",
            ),
            PanelSpec(
                "Reused prompt tokens: host tier vs device",
                "Prompt tokens served without computing them, per second: loaded from an "
                "offloading tier (host or p2p, kvobs), read from D's retained KV (the device "
                "path, D->P reads), and vLLM's own split of cached prompt tokens by tier "
                "(device: the engine's prefix cache; host, p2p: the offloading tiers).",
                (
                    T(q.host_loaded_tokens_rate(s.keeping("tier")), "host tier: {{tier}}"),
                    T(q.reused_tokens_rate(s), "device: D->P reads"),
                    T(
                        q.prompt_tokens_cached_by_source_rate(s.keeping("source")),
                        "vLLM cached: {{source}}",
                    ),
                ),
                "short",
            ),
            PanelSpec(
                "Host-tier lookups by outcome",
                "Admitted prompts' lookups in the offloading tiers. hit: the tier served "
                "tokens; evicted: the hit stopped at a block the tier had evicted (the "
                "host-evicted verdict); miss: new tokens the tier never had.",
                (T(q.host_lookups_rate(s.keeping("outcome")), "{{outcome}}"),),
                "ops",
                stacked=True,
            ),
            PanelSpec(
                "Host copies evicted before reuse",
                "Share of the lookups that wanted a host copy (hit or evicted) that found it "
                "(partly) evicted. Above the dashed line for "
                f"{config.windows.for_ratio} {rules.HOST_EVICTED_ALERT} fires.",
                (T(q.host_evicted_lookup_ratio(s.keeping(*PER_POD)), POD),),
                "percentunit",
                threshold=th.host_evicted_lookup_ratio,
            ),
            PanelSpec(
                "Age of evicted host copies",
                "Time an evicted request's oldest block spent in the tier (p50, p95), and "
                "evicted blocks per second: copies evicted younger than the inter-turn gaps "
                "were needed again.",
                (
                    T(q.host_evicted_age_quantile(s, 0.5), "age p50"),
                    T(q.host_evicted_age_quantile(s, 0.95), "age p95"),
                    T(q.gap_quantile(s, 0.95), "inter-turn gap p95"),
                ),
                "s",
            ),
            PanelSpec(
                "Host copies saved, with and without the response",
                "Finished requests whose copy the tier holds, by whether it reaches into the "
                "generated tokens (R), and saves the tier refused in part (no room: "
                "best-effort).",
                (
                    T(
                        q.host_saves_rate(s.keeping("covers_response")),
                        "covers response: {{covers_response}}",
                    ),
                    T(q.host_save_incomplete_rate(s), "incomplete"),
                ),
                "ops",
                stacked=True,
            ),
            PanelSpec(
                "Prompt-only share of host copies",
                "Share of host copies that stop at the prompt (offload_prompt_only=true, "
                "vLLM's default, or a short answer). With later turns at the proxy "
                f"above the dashed line for {config.windows.for_ratio} "
                f"{rules.HOST_PROMPT_ONLY_ALERT} fires.",
                (T(q.host_prompt_only_ratio(s.keeping(*PER_POD)), POD),),
                "percentunit",
                threshold=th.host_prompt_only_ratio,
            ),
            PanelSpec(
                "Host loads and evicted blocks",
                "Loads from an offloading tier per second, by tier (host, p2p), and blocks "
                "the tier evicted per second.",
                (
                    T(q.host_loads_rate(s.keeping("tier")), "loads {{tier}}"),
                    T(q.host_evicted_blocks_rate(s), "evicted blocks"),
                ),
                "ops",
            ),
        ),
    )


# --------------------------------------------------------------------------- SDK assembly


def _variables():
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.models.dashboard import (
        DataSourceRef,
        VariableOption,
        VariableRefresh,
    )

    ds = DataSourceRef(type_val="prometheus", uid=f"${{{DATASOURCE_VAR}}}")
    engine_metrics = (M_PULL_DECISIONS, M_READS, M_RETAINED_BLOCKS)
    any_kvobs = f'__name__=~"{"|".join(m.name for m in (*engine_metrics, M_PROXY_TURNS, M_TURNS))}"'
    engine_any = f'__name__=~"{"|".join(m.name for m in engine_metrics)}"'

    def query_var(name: str, label: str, selector: str):
        # "All" is `.*`: it also matches series without the label (see SCRAPE_MATCHERS),
        # and it is the default, so a Prometheus without the label still shows data.
        return (
            db.QueryVariable(name)
            .label(label)
            .datasource(ds)
            .query(f"label_values({{{selector}}}, {name})")
            .multi(True)
            .include_all(True)
            .all_value(".*")
            .current(VariableOption(selected=True, text="All", value="$__all"))
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        )

    # Each variable's values are those within the selection of the ones before it.
    scope = ""
    variables = [db.DatasourceVariable(DATASOURCE_VAR).label("Data source").type("prometheus")]
    for name, label in (
        ("cluster", "cluster"),
        ("namespace", "namespace"),
        ("job", "job"),
        ("pod", "pod"),
        ("instance", "instance"),
    ):
        variables.append(query_var(name, label, f"{any_kvobs}{scope}"))
        scope += f', {name}=~"${name}"'
    variables.append(query_var("model_name", "model", f"{engine_any}{scope}"))
    variables.append(
        query_var("engine", "engine", f'{engine_any}{scope}, model_name=~"$model_name"')
    )
    return variables


def runbook_links(title: str, config: MonitoringConfig) -> list[tuple[str, str]]:
    """``(link title, url)`` of the runbooks of the alerts a panel shows."""
    return [
        (f"Runbook: {alert}", rules.runbook_url(alert, config))
        for alert in RUNBOOK_LINKS.get(title, ())
    ]


def wants_exemplars(expr: str) -> bool:
    """A quantile over a histogram the proxy exposes with trace-id exemplars."""
    return "histogram_quantile" in expr and any(
        f"{m.name}_bucket{{" in expr for m in EXEMPLAR_METRICS
    )


def _panel(spec: PanelSpec, panel_id: int, config: MonitoringConfig = DEFAULT):
    from grafana_foundation_sdk.builders import common, prometheus, stat, timeseries
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.models.common import (
        BigValueColorMode,
        BigValueGraphMode,
        GraphThresholdsStyleMode,
        LegendDisplayMode,
        LegendPlacement,
        SortOrder,
        StackingMode,
        TooltipDisplayMode,
    )
    from grafana_foundation_sdk.models.dashboard import (
        DashboardLinkType,
        DataSourceRef,
        Threshold,
        ThresholdsMode,
    )

    ds = DataSourceRef(type_val="prometheus", uid=f"${{{DATASOURCE_VAR}}}")
    panel: stat.Panel | timeseries.Panel
    if spec.kind == "stat":
        panel = (
            stat.Panel()
            .id(panel_id)
            .title(spec.title)
            .description(description(spec))
            .datasource(ds)
            .unit(spec.unit)
            .span(spec.width)
            .height(4)
            .graph_mode(BigValueGraphMode.AREA)
            .color_mode(BigValueColorMode.VALUE)
        )
    else:
        series = (
            timeseries.Panel()
            .id(panel_id)
            .title(spec.title)
            .description(description(spec))
            .datasource(ds)
            .unit(spec.unit)
            .span(spec.width)
            .height(8)
            .fill_opacity(10)
            .legend(
                common.VizLegendOptions()
                .display_mode(LegendDisplayMode.LIST)
                .placement(LegendPlacement.BOTTOM)
                .show_legend(True)
            )
            .tooltip(
                common.VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING)
            )
        )
        if spec.stacked:
            series = series.stacking(common.StackingConfig().mode(StackingMode.NORMAL))
            series = series.fill_opacity(40)
        if spec.threshold is not None:
            series = series.thresholds_style(
                common.GraphThresholdsStyleConfig().mode(GraphThresholdsStyleMode.DASHED)
            )
        panel = series
    if spec.threshold is not None:
        panel = panel.thresholds(
            db.ThresholdsConfig()
            .mode(ThresholdsMode.ABSOLUTE)
            .steps(
                [Threshold(value=None, color="green"), Threshold(value=spec.threshold, color="red")]
            )
        )
    links = runbook_links(spec.title, config)
    if links:
        panel = panel.links(
            [
                db.DashboardLink(title).type(DashboardLinkType.LINK).url(url).target_blank(True)
                for title, url in links
            ]
        )
    for index, target in enumerate(spec.targets):
        query = (
            prometheus.Dataquery()
            .expr(target.expr)
            .datasource(ds)
            .legend_format(target.legend or "__auto")
            .ref_id(chr(ord("A") + index))
        )
        if wants_exemplars(target.expr):
            query = query.exemplar(True)
        panel = panel.with_target(query)
    return panel


def build_overview(config: MonitoringConfig = DEFAULT) -> dict:
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import (
        DashboardCursorSync,
        DashboardLinkType,
        DataSourceRef,
    )

    builder = (
        db.Dashboard(config.dashboard_title)
        .uid(config.dashboard_uid)
        .description(
            "KV reuse across turns in vLLM P/D disaggregated serving with "
            "bidirectional KV transfer: turn outcomes, D->P reads, retention, "
            "proxy metadata, recompute, TTFT and where it goes, the host "
            "copy path. Generated by kvobs; edit "
            "kvobs/monitoring/dashboards.py, not this JSON."
        )
        .tags(list(config.dashboard_tags))
        .editable()
        .refresh("30s")
        .time("now-3h", "now")
        .timezone("browser")
        .tooltip(DashboardCursorSync.CROSSHAIR)
    )
    for variable in _variables():
        builder = builder.with_variable(variable)
    builder = builder.link(
        db.DashboardLink("Runbooks")
        .type(DashboardLinkType.LINK)
        .url(config.runbook_base_url)
        .target_blank(True)
        .icon("doc")
        .tooltip("kvobs alert runbooks")
    )
    if config.trace_url:
        base = config.trace_url.split("${")[0]
        builder = builder.link(
            db.DashboardLink("Traces")
            .type(DashboardLinkType.LINK)
            .url(base)
            .target_blank(True)
            .icon("external link")
            .tooltip("Trace view; exemplars on the TTFT and latency panels open the turn's trace")
        )
    panel_id = 1
    for row in rows(config):
        builder = builder.with_row(db.Row(row.title).id(panel_id))
        panel_id += 1
        for spec in row.panels:
            builder = builder.with_panel(_panel(spec, panel_id, config))
            panel_id += 1
    builder = builder.annotation(
        db.AnnotationQuery()
        .name(ENGINE_RESTARTS)
        .enable(True)
        .icon_color("orange")
        .datasource(DataSourceRef(type_val="prometheus", uid=f"${{{DATASOURCE_VAR}}}"))
        .expr(engine_restarts(config))
    )
    # Round-trip through the SDK's encoder so the result is plain JSON data.
    board = json.loads(json.dumps(builder.build(), cls=JSONEncoder))
    # What the SDK's AnnotationQuery has no builder for: the Prometheus annotation's step
    # and texts (one annotation per restarted engine, named by job and pod).
    (restarts,) = [a for a in board["annotations"]["list"] if a["name"] == ENGINE_RESTARTS]
    restarts.update(
        {
            "step": "60s",
            "titleFormat": "Engine restarted",
            "textFormat": POD,
            "tagKeys": "job,pod",
            "useValueForTime": False,
        }
    )
    # Grafana's own export states the oldest Grafana a dashboard needs here.
    board["__requires"] = [
        {"type": "grafana", "id": "grafana", "name": "Grafana", "version": GRAFANA_MIN_VERSION},
        {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
    ]
    return board


ENGINE_RESTARTS = "Engine restarts"


def engine_restarts(config: MonitoringConfig = DEFAULT) -> str:
    """A series for each engine process that started within the last 2 minutes: its
    ``process_start_time_seconds`` (prometheus_client's process collector, on vLLM's
    /metrics) changed. Engines are the scrape jobs of ``selectors.engine_targets``, in the
    dashboard's scope; a restart loses D's retained KV, so later turns recompute."""
    selector = ", ".join(m for m in (SCRAPE_MATCHERS, config.selectors.engine_targets) if m)
    return f"changes(process_start_time_seconds{{{selector}}}[2m]) > 0"


def build_dashboards(config: MonitoringConfig = DEFAULT) -> dict[str, dict]:
    return {f"{config.dashboard_uid}.json": build_overview(config)}


def render(dashboard: dict) -> str:
    return json.dumps(dashboard, indent=2, sort_keys=True) + "\n"


def panel_queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """``(panel title, refId, expr)`` for every query of a dashboard dict (rows included)."""
    out = []

    def walk(panels):
        for panel in panels:
            for target in panel.get("targets", ()):
                out.append((panel.get("title", ""), target.get("refId", ""), target["expr"]))
            walk(panel.get("panels", ()))

    walk(dashboard.get("panels", ()))
    return out
