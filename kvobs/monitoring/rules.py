"""Prometheus recording and alerting rules, with their promtool test cases next to them.

Each alert is an :class:`Alert` whose expression comes from :mod:`~kvobs.monitoring.queries`
with the static selectors and thresholds of :mod:`~kvobs.monitoring.config`. Its test cases
(:class:`Case`) sit beside it: input series, an evaluation time, and whether it fires. The
generator serialises them into one promtool test file per rule file, so rule, fixture and
runbook cannot drift apart (the runbook link is added to every alert by one pass,
:func:`with_runbooks`).

Recording rules are named ``level:metric:operations``
(``namespace_job:vllm_kvobs_remote_reads:rate5m``), the level being the aggregation labels
of the config joined by ``_``; a ``:`` inside a vLLM metric name becomes ``_`` in the
metric part so the three parts stay parseable.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from kvobs.monitoring import queries as q
from kvobs.monitoring.config import DEFAULT, DIRECTION_D_TO_P, MonitoringConfig
from kvobs.semconv import (
    M_CLASSIFIER_HELD_SPANS,
    M_CLASSIFIER_SPANS,
    M_CLASSIFIER_WRITE_ERRORS,
    M_HOST_LOOKUPS,
    M_PROCESS_CPU,
    M_HOST_SAVES,
    M_PROXY_DECODE_TTL,
    M_PROXY_ENTRY_LIFETIME,
    M_PROXY_FALLBACKS,
    M_PROXY_GAP,
    M_PROXY_LOOKUPS,
    M_PROXY_STORE_ERRORS,
    M_PROXY_TTFT,
    M_PROXY_TURNS,
    M_TURNS,
    M_PULL_DECISIONS,
    M_READ_DURATION,
    M_READ_SETUP,
    M_READS,
    M_RECOMPUTED_TOKENS,
    M_RETAINED_BYTES,
    M_REUSED_TOKENS,
    M_STUCK_WAITS,
    M_TELEMETRY_DROPPED,
    M_ENGINE_TELEMETRY_DROPPED,
    M_VLLM_QUEUE_TIME,
    M_VLLM_TTFT,
    HostLookupOutcome,
    LookupOutcome,
    Metric,
    ReadOutcome,
    Verdict,
)

# Named here because the dashboard's panels over the same queries point at their runbooks.
PREFILL_QUEUEING_ALERT = "KvobsPrefillQueueingDominates"
HOST_EVICTED_ALERT = "KvobsHostCopiesEvictedBeforeReuse"
HOST_PROMPT_ONLY_ALERT = "KvobsPromptOnlyHostCopies"
# The true-verdict share alerts (verdict_alerts), by the verdict each watches.
VERDICT_ALERTS = {
    Verdict.EXPIRED: "KvobsTurnsExpired",
    Verdict.MISSING_METADATA: "KvobsTurnsMissingMetadata",
    Verdict.TRANSFER_FAILED: "KvobsTurnsTransferFailed",
    Verdict.SLOW_TRANSFER: "KvobsTurnsSlowTransfer",
}

# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class Case:
    """A promtool alert test case: series (selector -> values), when to evaluate, outcome.

    ``labels`` are the alert's expected labels beyond alertname and severity; ``value`` is
    how ``{{ $value ... }}`` renders at ``eval_time`` (promtool compares text exactly).
    """

    name: str
    series: dict[str, str]
    fires: bool
    eval_time: str = "20m"
    labels: dict[str, str] = field(default_factory=dict)
    value: str = ""


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str  # critical | warning | info
    summary: str
    description: str
    cases: tuple[Case, ...]
    runbook_url: str = ""

    def rule(self) -> dict:
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {
                "summary": self.summary,
                "description": self.description,
                "runbook_url": self.runbook_url,
            },
        }


@dataclass(frozen=True)
class Recording:
    record: str
    expr: str
    # promql_expr_test cases: (series, eval_time, expected samples [(labels text, value)])
    cases: tuple[tuple[dict[str, str], str, tuple[tuple[str, float], ...]], ...] = ()

    def rule(self) -> dict:
        return {"record": self.record, "expr": self.expr}


def record_name(metric: Metric | str, operation: str, config: MonitoringConfig = DEFAULT) -> str:
    """``level:metric:operations`` with ``_total`` dropped and ``:`` made ``_``.

    >>> record_name(M_READS, "rate5m")
    'namespace_job:vllm_kvobs_remote_reads:rate5m'
    """
    name = metric.name if isinstance(metric, Metric) else metric
    name = re.sub(r"_total$", "", name).replace(":", "_")
    return f"{'_'.join(config.aggregation_labels)}:{name}:{operation}"


def runbook_url(alert: str, config: MonitoringConfig = DEFAULT) -> str:
    return f"{config.runbook_base_url.rstrip('/')}/{alert}.md"


def with_runbooks(alerts: list[Alert], config: MonitoringConfig = DEFAULT) -> list[Alert]:
    """The one pass that gives every alert its runbook link."""
    return [replace(a, runbook_url=runbook_url(a.name, config)) for a in alerts]


# --------------------------------------------------------------------------- test fixtures

ENGINE = {
    "namespace": "serving",
    "job": "vllm-prefill",
    "instance": "p0:8000",
    "model_name": "m",
    "engine": "0",
}
DECODE = {**ENGINE, "job": "vllm-decode", "instance": "d0:8000"}
PROXY = {"namespace": "serving", "job": "kvobs-proxy", "instance": "proxy:9000"}
CLASSIFIER = {"namespace": "serving", "job": "kvobs-classifier", "instance": "kvobs:4318"}
D2P = {"direction": DIRECTION_D_TO_P}


def sel(metric: Metric | str, labels: dict[str, str], suffix: str = "") -> str:
    name = (metric.name if isinstance(metric, Metric) else metric) + suffix
    inner = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{name}{{{inner}}}"


def per_minute(n: float, minutes: int = 40) -> str:
    """A counter rising by ``n`` every 1m sample (``n/60`` per second)."""
    return f"0+{n:g}x{minutes}"


def _reads(done: float, declined: float = 0, failed: float = 0) -> dict[str, str]:
    out = {}
    for outcome, n in (
        (ReadOutcome.DONE, done),
        (ReadOutcome.DECLINED_EXPIRED, declined),
        (ReadOutcome.FAILED, failed),
    ):
        out[sel(M_READS, {**ENGINE, **D2P, "outcome": outcome.value})] = per_minute(n)
    return out


def _durations(bucket_counts: Mapping[str, float], total_seconds: float) -> dict[str, str]:
    """Read-duration histogram: per-minute increments per ``le`` (cumulative counts)."""
    out = {}
    for le, n in bucket_counts.items():
        out[sel(M_READ_DURATION, {**ENGINE, **D2P, "le": le}, "_bucket")] = per_minute(n)
    count = bucket_counts["+Inf"]
    out[sel(M_READ_DURATION, {**ENGINE, **D2P}, "_count")] = per_minute(count)
    out[sel(M_READ_DURATION, {**ENGINE, **D2P}, "_sum")] = per_minute(total_seconds)
    return out


def histogram_series(
    metric: Metric, labels: dict[str, str], per_minute_values: dict[float, float]
) -> dict[str, str]:
    """A histogram's series when, every minute, ``n`` observations of value ``v`` arrive
    for each ``v: n`` of ``per_minute_values`` (cumulative buckets over the metric's
    bounds, ``_count`` and ``_sum``)."""
    out = {}
    for le in (*metric.buckets, float("inf")):
        n = sum(count for value, count in per_minute_values.items() if value <= le)
        out[
            sel(metric, {**labels, "le": "+Inf" if le == float("inf") else f"{le:g}"}, "_bucket")
        ] = per_minute(n)
    out[sel(metric, labels, "_count")] = per_minute(sum(per_minute_values.values()))
    out[sel(metric, labels, "_sum")] = per_minute(sum(v * n for v, n in per_minute_values.items()))
    return out


def _turns(turn_bucket: str, lookup: LookupOutcome, n: float) -> dict[str, str]:
    labels = {
        **PROXY,
        "turn_bucket": turn_bucket,
        "prompt_bucket": "512-2k",
        "lookup": lookup.value,
    }
    return {sel(M_PROXY_TURNS, labels): per_minute(n)}


def _verdicts(turn_bucket: str, counts: dict[Verdict, float]) -> dict[str, str]:
    """The live classifier's final turns per minute, by verdict."""
    return {
        sel(
            M_TURNS,
            {
                **CLASSIFIER,
                "verdict": verdict.value,
                "turn_bucket": turn_bucket,
                "prompt_bucket": "512-2k",
            },
        ): per_minute(n)
        for verdict, n in counts.items()
    }


def verdict_alerts(config: MonitoringConfig) -> list[Alert]:
    """True-verdict share alerts: a fault verdict's share of later turns, from the live
    classifier (``kvobs collect``). They stand next to the engine-counter alerts, which
    fleets without the classifier keep."""
    s, th, fl, w = _scope(config), config.thresholds, config.floors, config.windows
    shares = (
        (
            Verdict.EXPIRED,
            th.expired_read_ratio,
            "reached P after D's retained KV had expired (expired)",
        ),
        (
            Verdict.MISSING_METADATA,
            th.missing_metadata_ratio,
            "reached P without usable KV params (missing-metadata)",
        ),
        (
            Verdict.TRANSFER_FAILED,
            th.failed_read_ratio,
            "started a D->P read that failed (transfer-failed)",
        ),
        (
            Verdict.SLOW_TRANSFER,
            th.slow_transfer_turn_ratio,
            "read D's KV slower than P would have recomputed it (slow-transfer)",
        ),
    )
    table = [
        (VERDICT_ALERTS[verdict], verdict, threshold, what) for verdict, threshold, what in shares
    ]
    job = _kept(CLASSIFIER, config)
    return [
        Alert(
            name,
            f"({q.verdict_share(s, verdict.value)}) > {threshold:g}\n"
            f"and ({q.classified_later_turns_rate(s)}) > {fl.later_turns:g}",
            w.for_ratio,
            "warning",
            f"Later turns {what.split(' (')[0]} ({{{{ $labels.job }}}}).",
            f"{{{{ $value | humanizePercentage }}}} of the turns after the first that "
            f"{{{{ $labels.job }}}} classified {what}, above {threshold:g}. `kvobs diagnose` "
            "names each turn's evidence and remedy; the classifier's /conversations/ID page "
            "shows one, and the dashboard's exemplars link to the turns' traces.",
            (
                Case(
                    f"half the later turns {verdict.value}",
                    _verdicts("2", {verdict: 30, Verdict.REMOTE_HIT: 30}),
                    True,
                    labels=job,
                    value="50%",
                ),
                Case(
                    "first turns only", _verdicts("1", {Verdict.FIRST_TURN: 600, verdict: 0}), False
                ),
                Case(
                    "later turns healthy",
                    _verdicts("3-4", {Verdict.REMOTE_HIT: 60, verdict: 0}),
                    False,
                ),
                Case("share high but below the rate floor", _verdicts("2", {verdict: 0.2}), False),
            ),
        )
        for name, verdict, threshold, what in table
    ]


def _classifier_spans(classified: float, late: float) -> dict[str, str]:
    """Spans a classifier received per minute, by outcome."""
    return {
        sel(M_CLASSIFIER_SPANS, {**CLASSIFIER, "outcome": outcome}): per_minute(n)
        for outcome, n in (("classified", classified), ("late", late), ("unreadable", 0))
    }


def classifier_alerts(config: MonitoringConfig) -> list[Alert]:
    """The live classifier's own health: a verdict alert that stays silent because the
    classifier cannot keep up, misses spans or cannot store its turns is no all-clear."""
    s, th, fl, w = _scope(config), config.thresholds, config.floors, config.windows
    job = _kept(CLASSIFIER, config)
    second = {**CLASSIFIER, "instance": "kvobs-1:4319"}
    return [
        Alert(
            "KvobsClassifierSaturated",
            f"({q.classifier_cpu_share(s, config.selectors.classifier_targets)}) "
            f"> {th.classifier_cpu_share:g}",
            w.for_latency,
            "warning",
            "A live classifier of {{ $labels.job }} uses its whole core.",
            "A `kvobs collect` process of {{ $labels.job }} used {{ $value | "
            "humanizePercentage }} of a CPU core over the rate window. It receives, decodes "
            "and classifies on one core: past it, exports wait, the Collector's queue grows "
            "and then drops spans, and turns lose their evidence (insufficient-evidence). "
            "Run several classifiers (deploy/kubernetes/components/sharded-classifiers).",
            (
                Case(
                    "one of two classifiers at 95% of a core",
                    {
                        sel(M_PROCESS_CPU, CLASSIFIER): per_minute(57),
                        sel(M_PROCESS_CPU, second): per_minute(18),
                    },
                    True,
                    labels=job,
                    value="95%",
                ),
                Case(
                    "two classifiers at half a core each",
                    {
                        sel(M_PROCESS_CPU, CLASSIFIER): per_minute(30),
                        sel(M_PROCESS_CPU, second): per_minute(30),
                    },
                    False,
                ),
                Case(
                    "another job's process at a whole core",
                    {sel(M_PROCESS_CPU, PROXY): per_minute(60)},
                    False,
                ),
            ),
        ),
        Alert(
            "KvobsClassifierLateSpans",
            f"({q.late_span_ratio(s)}) > {th.late_span_ratio:g}\n"
            f"and ({q.classifier_spans_rate(s)}) > {fl.classifier_spans:g}",
            w.for_ratio,
            "warning",
            "Spans reach the live classifier {{ $labels.job }} after their conversation left "
            "its window.",
            "{{ $value | humanizePercentage }} of the spans {{ $labels.job }} received came "
            "after their conversation had left its window and could not be recalled from "
            "the span store (a conversation kvobs named, a failed recall, too many waiting): "
            "they are stored, not classified, so their turns were final without them.",
            (
                Case("5% late", _classifier_spans(570, 30), True, labels=job, value="5%"),
                Case("none late", _classifier_spans(600, 0), False),
                Case("late but below the rate floor", _classifier_spans(10, 10), False),
            ),
        ),
        Alert(
            "KvobsClassifierTurnWriteErrors",
            f"({q.turn_write_errors_rate(s)}) > 0",
            w.for_errors,
            "warning",
            "The live classifier {{ $labels.job }} cannot write its final turns.",
            "Writes of final turns to {{ $labels.job }}'s turn store fail (full disk, "
            "unwritable directory, ClickHouse unreachable). The rows wait in memory and go "
            "with the next write: `kvobs report`, `tune` and the stored answers miss them "
            "meanwhile, and memory grows until the store takes them.",
            (
                Case(
                    "writes failing",
                    {sel(M_CLASSIFIER_WRITE_ERRORS, CLASSIFIER): per_minute(6)},
                    True,
                    labels=job,
                ),
                Case(
                    "no failed write",
                    {sel(M_CLASSIFIER_WRITE_ERRORS, CLASSIFIER): per_minute(0)},
                    False,
                ),
            ),
        ),
    ]


def _host_lookups(hit: float, evicted: float, miss: float = 0) -> dict[str, str]:
    """D's host-tier lookups per minute, by outcome."""
    return {
        sel(M_HOST_LOOKUPS, {**DECODE, "outcome": outcome.value}): per_minute(n)
        for outcome, n in (
            (HostLookupOutcome.HIT, hit),
            (HostLookupOutcome.EVICTED, evicted),
            (HostLookupOutcome.MISS, miss),
        )
    }


def _host_saves(covering: float, prompt_only: float) -> dict[str, str]:
    """D's host copies saved per minute, with and without the generated tokens."""
    return {
        sel(M_HOST_SAVES, {**DECODE, "covers_response": covers}): per_minute(n)
        for covers, n in (("true", covering), ("false", prompt_only))
    }


def _prefill_phases(
    requests: float, queued: float, ttft: float, read: float = 0, setup: float = 0
) -> dict[str, str]:
    """P's histograms as the queueing alert reads them (``_sum`` and ``_count`` only):
    per minute, ``requests`` requests with ``queued``/``ttft`` seconds in all, and
    ``read``/``setup`` seconds of D->P reads (one per request)."""
    out = {}
    for metric, seconds, labels in (
        (M_VLLM_QUEUE_TIME, queued, ENGINE),
        (M_VLLM_TTFT, ttft, ENGINE),
        (M_READ_DURATION, read, {**ENGINE, **D2P}),
        (M_READ_SETUP, setup, {**ENGINE, **D2P}),
    ):
        out[sel(metric, labels, "_sum")] = per_minute(seconds)
        out[sel(metric, labels, "_count")] = per_minute(requests)
    return out


SLOW = {"0.01": 0, "0.5": 0, "1": 0, "2.5": 60, "+Inf": 60}
FAST = {"0.01": 60, "0.5": 60, "1": 60, "2.5": 60, "+Inf": 60}

# --------------------------------------------------------------------------- rules


def _scope(config: MonitoringConfig) -> q.Scope:
    selectors = config.selectors
    return q.Scope(
        selectors.engine,
        selectors.proxy,
        config.windows.rate,
        tuple(config.aggregation_labels),
        prefill=selectors.prefill,
        decode=selectors.decode,
    )


def _kept(labels: dict[str, str], config: MonitoringConfig) -> dict[str, str]:
    """The labels of a fixture series an aggregation by the config's labels keeps."""
    return {k: v for k, v in labels.items() if k in config.aggregation_labels}


def _text(labels: dict[str, str]) -> str:
    """A promtool ``exp_samples`` label set: ``{a="1", b="2"}``."""
    return "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def alerts(config: MonitoringConfig = DEFAULT) -> list[Alert]:
    s = _scope(config)
    th, fl, w = config.thresholds, config.floors, config.windows
    job = _kept(ENGINE, config)
    pjob = _kept(PROXY, config)
    out = [
        Alert(
            "KvobsRemoteReadsExpired",
            f"({q.expired_read_ratio(s)}) > {th.expired_read_ratio:g}\n"
            f"and ({q.read_outcomes_rate(s)}) > {fl.read_attempts:g}",
            w.for_ratio,
            "warning",
            "D->P reads are being declined as expired on {{ $labels.job }}.",
            "{{ $value | humanizePercentage }} of D->P read attempts on {{ $labels.job }} "
            "were declined because D's retained blocks were (nearly) past "
            "decoder_kv_blocks_ttl. Those turns recompute; with "
            "kv_load_failure_policy=fail each one is an HTTP 500.",
            (
                Case(
                    "10% of reads declined", _reads(54, declined=6), True, labels=job, value="10%"
                ),
                Case("no declined reads", _reads(60), False),
                Case("ratio high but below the rate floor", _reads(0.2, declined=0.2), False),
            ),
        ),
        Alert(
            "KvobsMissingMetadataHigh",
            f"({q.missing_metadata_ratio(s)}) > {th.missing_metadata_ratio:g}\n"
            f"and ({q.later_turns_rate(s)}) > {fl.later_turns:g}",
            w.for_ratio,
            "warning",
            "Later turns reach prefill without KV metadata on {{ $labels.job }}.",
            "{{ $value | humanizePercentage }} of turns after the first on "
            "{{ $labels.job }} found no usable metadata in the proxy (miss, stale or no "
            "conversation id), so P recomputed their whole history.",
            (
                Case(
                    "half the later turns miss",
                    {**_turns("2", LookupOutcome.HIT, 30), **_turns("2", LookupOutcome.MISS, 30)},
                    True,
                    labels=pjob,
                    value="50%",
                ),
                Case(
                    "first turns miss, later turns hit",
                    {
                        **_turns("1", LookupOutcome.MISS, 600),
                        **_turns("2", LookupOutcome.HIT, 30),
                        **_turns("2", LookupOutcome.MISS, 0),
                    },
                    False,
                ),
            ),
        ),
        Alert(
            "KvobsRemoteReadLatencyHigh",
            f"({q.read_duration_quantile(s, 0.95)}) > {th.read_p95_seconds:g}\n"
            f"and ({q.reads_timed_rate(s)}) > {fl.reads_done:g}",
            w.for_latency,
            "warning",
            "D->P read p95 above the read-latency SLO on {{ $labels.job }}.",
            "The p95 duration of D->P KV reads on {{ $labels.job }} is "
            "{{ $value | humanizeDuration }}, above the "
            f"{th.read_p95_seconds:g} s SLO: turns that read may be slower than recomputing.",
            (
                Case("reads take 1-2.5 s", _durations(SLOW, 90), True, labels=job, value="2.425s"),
                Case("reads under 10 ms", _durations(FAST, 0.3), False),
            ),
        ),
        Alert(
            "KvobsRemoteReadsSlowerThanRecompute",
            f"({q.reused_tokens_per_read_second(s)}) < {th.recompute_tokens_per_second:g}\n"
            f"and ({q.reads_timed_rate(s)}) > {fl.reads_done:g}",
            w.for_latency,
            "warning",
            "D->P reads deliver tokens slower than P recomputes them on {{ $labels.job }}.",
            "Reads on {{ $labels.job }} deliver {{ $value | humanize }} tokens per second "
            "of read time, below the configured recompute speed of "
            f"{th.recompute_tokens_per_second:g} tokens/s: reading costs more than it saves.",
            (
                Case(
                    "200 tokens per read-second",
                    {sel(M_REUSED_TOKENS, ENGINE): per_minute(6000), **_durations(SLOW, 30)},
                    True,
                    labels=job,
                    value="200",
                ),
                Case(
                    "100k tokens per read-second",
                    {sel(M_REUSED_TOKENS, ENGINE): per_minute(6000), **_durations(FAST, 0.06)},
                    False,
                ),
            ),
        ),
        Alert(
            PREFILL_QUEUEING_ALERT,
            f"({q.prefill_queue_share(s)}) > {th.prefill_queue_share:g}\n"
            f"and ({q.prefill_requests_rate(s)}) > {fl.prefill_requests:g}",
            w.for_ratio,
            "warning",
            "Prefill requests spend most of their TTFT queued on {{ $labels.job }}.",
            "Requests on the prefill engines of {{ $labels.job }} spend "
            "{{ $value | humanizePercentage }} of their mean engine TTFT waiting in P's "
            "queue (vLLM's queue time less the wait for D's KV): P lacks capacity and every "
            "turn's TTFT grows with its queue (latency cause queued-at-p).",
            (
                Case(
                    "0.7 s of a 1 s TTFT queued",
                    _prefill_phases(60, 48, 60, read=6),
                    True,
                    labels=job,
                    value="70%",
                ),
                # vLLM counts the wait for D's KV as queue time: slow reads are not queueing.
                Case(
                    "queue time is the wait for D's KV",
                    _prefill_phases(60, 48, 60, read=40, setup=4),
                    False,
                ),
                Case("queued but below the rate floor", _prefill_phases(0.3, 0.24, 0.3), False),
            ),
        ),
        Alert(
            "KvobsProxyEntryOutlivesDecodeTTL",
            q.entry_lifetime_not_below_decode_ttl(s),
            w.for_config,
            "warning",
            "Proxy metadata outlives D's KV retention on {{ $labels.job }}.",
            "The proxy on {{ $labels.job }} keeps metadata entries for "
            "{{ $value | humanizeDuration }}, not below D's decoder_kv_blocks_ttl: it will "
            "hand P params for blocks D already released (expired reads, HTTP 500s under "
            "kv_load_failure_policy=fail).",
            (
                Case(
                    "lifetime 600 s, TTL 480 s",
                    {
                        sel(M_PROXY_ENTRY_LIFETIME, PROXY): "600x40",
                        sel(M_PROXY_DECODE_TTL, PROXY): "480x40",
                    },
                    True,
                    labels=pjob,
                    value="10m 0s",
                ),
                Case(
                    "lifetime 450 s, TTL 480 s",
                    {
                        sel(M_PROXY_ENTRY_LIFETIME, PROXY): "450x40",
                        sel(M_PROXY_DECODE_TTL, PROXY): "480x40",
                    },
                    False,
                ),
                Case(
                    "no TTL seen yet",
                    {
                        sel(M_PROXY_ENTRY_LIFETIME, PROXY): "450x40",
                        sel(M_PROXY_DECODE_TTL, PROXY): "0x40",
                    },
                    False,
                ),
            ),
        ),
        Alert(
            "KvobsRemoteReadsFailing",
            f"({q.failed_read_ratio(s)}) > {th.failed_read_ratio:g}\n"
            f"and ({q.read_outcomes_rate(s)}) > {fl.read_attempts:g}",
            w.for_ratio,
            "warning",
            "D->P KV reads are failing on {{ $labels.job }}.",
            "{{ $value | humanizePercentage }} of D->P read attempts on {{ $labels.job }} "
            "failed (NIXL error, handshake, invalid blocks). Those turns fall back to "
            "recompute or fail.",
            (
                Case("10% of reads fail", _reads(54, failed=6), True, labels=job, value="10%"),
                Case("no failures", _reads(60), False),
            ),
        ),
        Alert(
            "KvobsProxyFallbacks",
            f"({q.fallbacks_rate(s)}) > {th.fallback_rate:g}",
            w.for_ratio,
            "warning",
            "The proxy is retrying prefills without KV params on {{ $labels.job }}.",
            "The proxy on {{ $labels.job }} retried {{ $value | humanize }} prefill "
            "requests per second without D's params (read declined, read failed or "
            "prefill error).",
            (
                Case(
                    "6 fallbacks a minute",
                    {sel(M_PROXY_FALLBACKS, {**PROXY, "reason": "read-declined"}): per_minute(6)},
                    True,
                    labels=pjob,
                    value="100m",
                ),
                Case(
                    "no fallbacks",
                    {sel(M_PROXY_FALLBACKS, {**PROXY, "reason": "read-declined"}): per_minute(0)},
                    False,
                ),
            ),
        ),
        Alert(
            "KvobsRequestsStuckWaitingForRemoteKV",
            f"({q.stuck_waits_increase(s, w.stuck)}) > 0",
            "1m",
            "critical",
            "Requests are stuck waiting for remote KV on {{ $labels.job }}.",
            f"{{{{ $labels.job }}}} found requests waiting for remote KV that will never "
            f"arrive in the last {w.stuck} (a declined read under "
            "kv_load_failure_policy=recompute is never re-queued). They hang until the "
            "client times out.",
            (
                Case(
                    "one stuck request",
                    {sel(M_STUCK_WAITS, ENGINE): "0 0 0 0 1x36"},
                    True,
                    eval_time="8m",
                    labels=job,
                ),
                Case("none stuck", {sel(M_STUCK_WAITS, ENGINE): "0x40"}, False, eval_time="8m"),
            ),
        ),
        Alert(
            "KvobsProxyStoreErrors",
            f"({q.store_errors_rate(s)}) > {th.store_error_rate:g}",
            w.for_errors,
            "warning",
            "The proxy's metadata store is failing on {{ $labels.job }}.",
            "The metadata store backend (e.g. Redis) behind the proxy on {{ $labels.job }} "
            "returns errors: lookups miss and turns recompute their history.",
            (
                Case(
                    "redis errors",
                    {sel(M_PROXY_STORE_ERRORS, {**PROXY, "backend": "redis"}): per_minute(3)},
                    True,
                    labels=pjob,
                ),
                Case(
                    "no errors",
                    {sel(M_PROXY_STORE_ERRORS, {**PROXY, "backend": "redis"}): per_minute(0)},
                    False,
                ),
            ),
        ),
        Alert(
            "KvobsTelemetryDropped",
            f"({q.dropped_spans_rate(s)}) > {th.dropped_spans_rate:g}\n"
            f"or ({q.engine_dropped_spans_rate(s)}) > {th.dropped_spans_rate:g}",
            w.for_absent,
            "info",
            "kvobs is dropping spans on {{ $labels.job }}.",
            "{{ $labels.job }} loses spans: its export queue is full, or exports fail "
            "(collector down, span store not writable); kvobs diagnose will report "
            "insufficient-evidence for the affected turns.",
            (
                Case(
                    "spans dropped",
                    {sel(M_TELEMETRY_DROPPED, {**PROXY, "reason": "queue-full"}): per_minute(10)},
                    True,
                    labels=pjob,
                ),
                Case(
                    "span store not writable",
                    {
                        sel(M_TELEMETRY_DROPPED, {**PROXY, "reason": "export-failed"}): per_minute(
                            30
                        )
                    },
                    True,
                    labels=pjob,
                ),
                Case(
                    "an engine's spans not exported",
                    {
                        sel(
                            M_ENGINE_TELEMETRY_DROPPED, {**ENGINE, "reason": "export-failed"}
                        ): per_minute(30)
                    },
                    True,
                    labels=job,
                ),
                Case(
                    "nothing dropped",
                    {
                        sel(M_TELEMETRY_DROPPED, {**PROXY, "reason": "export-failed"}): per_minute(
                            0
                        ),
                        sel(
                            M_ENGINE_TELEMETRY_DROPPED, {**ENGINE, "reason": "export-failed"}
                        ): per_minute(0),
                    },
                    False,
                ),
            ),
        ),
        Alert(
            HOST_EVICTED_ALERT,
            f"({q.host_evicted_lookup_ratio(s)}) > {th.host_evicted_lookup_ratio:g}\n"
            f"and ({q.host_lookups_wanting_a_copy_rate(s)}) > {fl.host_lookups:g}",
            w.for_ratio,
            "warning",
            "Host copies are evicted before their next turn on {{ $labels.job }}.",
            "{{ $value | humanizePercentage }} of the prompts on {{ $labels.job }} that "
            "wanted a copy in the offloading tier found it (partly) evicted: the tier's LRU "
            "pushed it out before the conversation came back, so those turns recomputed "
            "what had been saved (host-evicted verdict).",
            (
                Case(
                    "a fifth of the lookups find their copy evicted",
                    _host_lookups(48, 12),
                    True,
                    labels=_kept(DECODE, config),
                    value="20%",
                ),
                Case("copies found, misses are new tokens", _host_lookups(60, 0, miss=30), False),
                Case("misses alone", _host_lookups(0, 0, miss=60), False),
                Case("evicted but below the rate floor", _host_lookups(0.2, 0.2), False),
            ),
        ),
        Alert(
            HOST_PROMPT_ONLY_ALERT,
            f"({q.host_prompt_only_ratio(s)}) > {th.host_prompt_only_ratio:g}\n"
            f"and ({q.host_saves_rate(s)}) > {fl.host_saves:g}\n"
            f"and {q.shared_with_the_proxy(s.by)} "
            f"({q.later_turns_rate(s)}) > {fl.later_turns:g}",
            w.for_ratio,
            "warning",
            "Host copies on {{ $labels.job }} stop at the prompt on a multi-turn fleet.",
            "{{ $value | humanizePercentage }} of the copies {{ $labels.job }} saved to its "
            "offloading tier hold the prompt only, not the generated tokens (R), while the "
            "proxy serves later turns: every next turn recomputes the previous answer "
            "(host-copy-lacks-response verdict). Usually offload_prompt_only=true on the "
            "engine's offloading connector.",
            (
                Case(
                    "prompt-only copies, later turns",
                    {**_host_saves(0, 30), **_turns("2", LookupOutcome.HIT, 30)},
                    True,
                    labels=_kept(DECODE, config),
                    value="100%",
                ),
                Case(
                    "prompt-only copies, first turns only",
                    {**_host_saves(0, 30), **_turns("1", LookupOutcome.MISS, 30)},
                    False,
                ),
                Case(
                    "later turns in another namespace only",
                    {
                        **_host_saves(0, 30),
                        sel(
                            M_PROXY_TURNS,
                            {
                                **PROXY,
                                "namespace": "batch",
                                "turn_bucket": "2",
                                "prompt_bucket": "512-2k",
                                "lookup": "hit",
                            },
                        ): per_minute(30),
                    },
                    False,
                ),
                Case(
                    "copies cover the response",
                    {**_host_saves(30, 0), **_turns("2", LookupOutcome.HIT, 30)},
                    False,
                ),
            ),
        ),
    ]
    out += verdict_alerts(config)
    out += classifier_alerts(config)
    out += [
        absent_alert(
            "KvobsEngineTelemetryAbsent",
            M_PULL_DECISIONS,
            config.selectors.engine,
            config.selectors.engine_targets,
            "vLLM engines",
            "the instrumented connector is not loaded (kv_connector / "
            "kv_connector_module_path) or the engines are not scraped",
            config,
            ENGINE,
            "vllm-decode",
        ),
        absent_alert(
            "KvobsProxyTelemetryAbsent",
            M_PROXY_LOOKUPS,
            config.selectors.proxy,
            config.selectors.proxy_targets,
            "kvobs proxy",
            "the proxy is down or its /metrics is not scraped",
            config,
            PROXY,
            "kvobs-proxy-b",
        ),
        absent_alert(
            "KvobsClassifierTelemetryAbsent",
            M_CLASSIFIER_HELD_SPANS,
            config.selectors.proxy,
            config.selectors.classifier_targets,
            "live classifier",
            "`kvobs collect` is down, runs with --no-classify, or its /metrics is not "
            "scraped; the true-verdict alerts (KvobsTurns*) stay silent without it",
            config,
            CLASSIFIER,
            "kvobs-classifier-b",
        ),
    ]
    return with_runbooks(out, config)


def absent_alert(
    name: str,
    metric: Metric,
    selector: str,
    targets: str,
    what: str,
    why: str,
    config: MonitoringConfig,
    present_labels: dict[str, str],
    other_job: str,
) -> Alert:
    """The telemetry-absent template: one per component, same shape, same tests.

    It fires per scrape job (and namespace) that ``targets`` names and that is scraped
    without ``metric`` (a second healthy job does not hide it), and once, without labels,
    when nothing exposes ``metric`` at all."""
    by = tuple(config.aggregation_labels)
    silent_job = _kept(present_labels, config)
    missing = _kept({**present_labels, "job": other_job}, config)
    return Alert(
        name,
        q.absent_per_job(metric, selector, targets, by),
        config.windows.for_absent,
        "warning",
        f"No kvobs telemetry from the {what}{{{{ with $labels.job }}}} (job "
        "{{ . }}){{ end }}.",
        f"{metric.name} has been absent for {config.windows.for_absent}{{{{ with "
        "$labels.job }} from job {{ . }}{{ end }}{{ with $labels.namespace }} in namespace "
        f"{{{{ . }}}}{{{{ end }}}}: {why}. Every kvobs panel and alert for it is blind.",
        (
            Case("metric never scraped", {sel("up", {"job": "other"}): "1x40"}, True),
            Case(
                "metric present",
                {
                    sel(metric, present_labels): "0x40",
                    sel("up", {**silent_job, "instance": "x"}): "1x40",
                },
                False,
            ),
            Case(
                "one job without it while another has it",
                {
                    sel(metric, present_labels): "0x40",
                    sel("up", {**missing, "instance": "y"}): "1x40",
                },
                True,
                labels=missing,
            ),
        ),
    )


def recordings(config: MonitoringConfig = DEFAULT) -> list[Recording]:
    s = _scope(config)
    r = f"rate{config.windows.rate}"
    ratio = f"ratio_{r}"
    return [
        Recording(
            record_name(M_PROXY_TURNS, r, config),
            q.turns_rate(s.keeping("turn_bucket", "prompt_bucket", "lookup")),
            (
                (
                    {**_turns("2", LookupOutcome.HIT, 60)},
                    "10m",
                    (
                        (
                            _text(
                                {
                                    **_kept(PROXY, config),
                                    "turn_bucket": "2",
                                    "prompt_bucket": "512-2k",
                                    "lookup": "hit",
                                }
                            ),
                            1.0,
                        ),
                    ),
                ),
            ),
        ),
        Recording(
            record_name("kvobs_proxy_turns_missing_metadata", ratio, config),
            q.missing_metadata_ratio(s),
            (
                (
                    {
                        **_turns("1", LookupOutcome.MISS, 60),
                        **_turns("3-4", LookupOutcome.HIT, 45),
                        **_turns("3-4", LookupOutcome.STALE, 15),
                    },
                    "10m",
                    ((_text(_kept(PROXY, config)), 0.25),),
                ),
                # Only first turns: no later-turn denominator, so no series (never NaN).
                ({**_turns("1", LookupOutcome.MISS, 60)}, "10m", ()),
            ),
        ),
        Recording(
            record_name(M_PULL_DECISIONS, r, config), q.pull_decisions_rate(s.keeping("decision"))
        ),
        Recording(
            record_name("vllm_kvobs_remote_reads_d_to_p", r, config),
            q.read_outcomes_rate(s.keeping("outcome")),
        ),
        Recording(
            record_name("vllm_kvobs_remote_reads_expired", ratio, config),
            q.expired_read_ratio(s),
            (
                (_reads(45, declined=15), "10m", ((_text(_kept(ENGINE, config)), 0.25),)),
                (_reads(60), "10m", ((_text(_kept(ENGINE, config)), 0.0),)),
                (_reads(0), "10m", ()),
            ),
        ),
        Recording(
            record_name("vllm_kvobs_remote_reads_failed", ratio, config), q.failed_read_ratio(s)
        ),
        Recording(
            record_name(M_READ_DURATION, f"p95_{r}", config),
            q.read_duration_quantile(s, 0.95),
            ((_durations(SLOW, 90), "10m", ((_text(_kept(ENGINE, config)), 2.425),)),),
        ),
        Recording(record_name(M_REUSED_TOKENS, r, config), q.reused_tokens_rate(s)),
        Recording(
            record_name(M_RECOMPUTED_TOKENS, r, config),
            q.recomputed_tokens_rate(s.keeping("reason")),
        ),
        Recording(
            record_name("vllm_kvobs_remote_reuse_share", ratio, config),
            q.reuse_share(s),
            (
                (
                    {
                        sel(M_REUSED_TOKENS, ENGINE): per_minute(600),
                        sel(M_RECOMPUTED_TOKENS, {**ENGINE, "reason": "suffix"}): per_minute(200),
                    },
                    "10m",
                    ((_text(_kept(ENGINE, config)), 0.75),),
                ),
            ),
        ),
        Recording(record_name(M_RETAINED_BYTES, "sum", config), q.retained_bytes(s)),
        Recording(
            record_name(M_PROXY_TTFT, f"p95_{r}", config),
            q.proxy_ttft_quantile(s.keeping("turn_bucket"), 0.95),
        ),
        Recording(record_name(M_PROXY_GAP, f"p95_{r}", config), q.gap_quantile(s, 0.95)),
        Recording(
            record_name("kvobs_proxy_inter_turn_gap_over_decode_ttl", ratio, config),
            q.gap_over_ttl_ratio(s),
            # Whatever the TTL: gaps of 0.5 s are all within it, gaps past the last
            # bucket bound all beyond it (a TTL that is no bucket bound once read 1);
            # at a TTL of 300 s (no bound) half of the gaps spread over 240-360 s.
            (
                (
                    {
                        **histogram_series(M_PROXY_GAP, PROXY, {0.5: 60}),
                        sel(M_PROXY_DECODE_TTL, PROXY): "480x40",
                    },
                    "10m",
                    ((_text(_kept(PROXY, config)), 0.0),),
                ),
                (
                    {
                        **histogram_series(M_PROXY_GAP, PROXY, {1e6: 60}),
                        sel(M_PROXY_DECODE_TTL, PROXY): "480x40",
                    },
                    "10m",
                    ((_text(_kept(PROXY, config)), 1.0),),
                ),
                (
                    {
                        **histogram_series(
                            M_PROXY_GAP, PROXY, {240 + 2 * (i + 1): 1 for i in range(60)}
                        ),
                        sel(M_PROXY_DECODE_TTL, PROXY): "300x40",
                    },
                    "10m",
                    ((_text(_kept(PROXY, config)), 0.5),),
                ),
            ),
        ),
        Recording(record_name(M_PROXY_FALLBACKS, r, config), q.fallbacks_rate(s.keeping("reason"))),
        Recording(
            record_name("vllm_kvobs_host_lookups_evicted", ratio, config),
            q.host_evicted_lookup_ratio(s),
            (
                (_host_lookups(45, 15, miss=60), "10m", ((_text(_kept(DECODE, config)), 0.25),)),
                (_host_lookups(0, 0, miss=60), "10m", ()),
            ),
        ),
        Recording(
            record_name("vllm_kvobs_host_saves_prompt_only", ratio, config),
            q.host_prompt_only_ratio(s),
            ((_host_saves(30, 10), "10m", ((_text(_kept(DECODE, config)), 0.25),)),),
        ),
    ]


# --------------------------------------------------------------------------- files

RECORDING_FILE = "kvobs-recording.rules.yaml"
ALERTS_FILE = "kvobs-alerts.rules.yaml"
MANIFEST_FILE = "kvobs-prometheusrule.yaml"


def groups(config: MonitoringConfig = DEFAULT) -> dict[str, dict]:
    """``{rule file name: rule file content}``."""
    prefix = config.rule_group_prefix
    return {
        RECORDING_FILE: {
            "groups": [{"name": f"{prefix}.rules", "rules": [r.rule() for r in recordings(config)]}]
        },
        ALERTS_FILE: {
            "groups": [{"name": f"{prefix}.alerts", "rules": [a.rule() for a in alerts(config)]}]
        },
    }


def prometheus_rule(config: MonitoringConfig = DEFAULT) -> dict:
    """The same groups as a prometheus-operator ``PrometheusRule`` for Kubernetes users."""
    all_groups = [g for content in groups(config).values() for g in content["groups"]]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "kvobs",
            "labels": {
                "app.kubernetes.io/name": "kvobs",
                "app.kubernetes.io/part-of": "kvobs",
                **config.prometheus_rule_labels,
            },
        },
        "spec": {"groups": all_groups},
    }


def render_template(template: str, labels: dict[str, str], value: str) -> str:
    """Expand the subset of Go templating the annotations use, for expected test output.

    >>> render_template("{{ $value | humanize }} on {{ $labels.job }}", {"job": "x"}, "3")
    '3 on x'
    >>> render_template("a{{ with $labels.job }} job {{ . }}{{ end }}.", {}, "")
    'a.'
    """
    text = re.sub(
        r"\{\{\s*with \$labels\.(\w+)\s*\}\}(.*?)\{\{\s*end\s*\}\}",
        lambda m: (
            re.sub(r"\{\{\s*\.\s*\}\}", labels[m.group(1)], m.group(2))
            if labels.get(m.group(1))
            else ""
        ),
        template,
    )
    text = re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), text)
    return re.sub(r"\{\{\s*\$value[^}]*\}\}", value, text)


def _series_list(series: dict[str, str]) -> list[dict]:
    return [{"series": k, "values": v} for k, v in series.items()]


def alert_tests(config: MonitoringConfig = DEFAULT) -> dict:
    tests = []
    for alert in alerts(config):
        for case in alert.cases:
            expected = []
            if case.fires:
                labels = {"severity": alert.severity, **case.labels}
                expected.append(
                    {
                        "exp_labels": labels,
                        "exp_annotations": {
                            "summary": render_template(alert.summary, labels, case.value),
                            "description": render_template(alert.description, labels, case.value),
                            "runbook_url": alert.runbook_url,
                        },
                    }
                )
            tests.append(
                {
                    "name": f"{alert.name}: {case.name} ({'fires' if case.fires else 'silent'})",
                    "interval": "1m",
                    "input_series": _series_list(case.series),
                    "alert_rule_test": [
                        {
                            "eval_time": case.eval_time,
                            "alertname": alert.name,
                            "exp_alerts": expected,
                        }
                    ],
                }
            )
    return {"rule_files": [f"../{ALERTS_FILE}"], "evaluation_interval": "1m", "tests": tests}


def recording_tests(config: MonitoringConfig = DEFAULT) -> dict:
    tests = []
    for rec in recordings(config):
        for index, (series, eval_time, samples) in enumerate(rec.cases, 1):
            tests.append(
                {
                    "name": f"{rec.record} #{index}",
                    "interval": "1m",
                    "input_series": _series_list(series),
                    "promql_expr_test": [
                        {
                            "expr": rec.record,
                            "eval_time": eval_time,
                            "exp_samples": [
                                {"labels": f"{rec.record}{labels}", "value": value}
                                for labels, value in samples
                            ],
                        }
                    ],
                }
            )
    return {"rule_files": [f"../{RECORDING_FILE}"], "evaluation_interval": "1m", "tests": tests}


def test_files(config: MonitoringConfig = DEFAULT) -> dict[str, dict]:
    """One promtool test file per rule file: ``{test file name: content}``."""
    return {
        RECORDING_FILE.replace(".rules.yaml", ".test.yaml"): recording_tests(config),
        ALERTS_FILE.replace(".rules.yaml", ".test.yaml"): alert_tests(config),
    }
