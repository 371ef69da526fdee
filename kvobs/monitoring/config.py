"""Every knob of the monitoring mixin in one place: selectors, windows, thresholds.

Dashboards, recording rules and alerts read only this module for tunables, so a deployment
changes a threshold here (or passes its own :class:`MonitoringConfig`) and regenerates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvobs.semconv import VLLM_DEFAULT_DECODE_TTL_S, ReadDirection


@dataclass(frozen=True)
class Selectors:
    """Label matchers (without braces) that pick kvobs series out of a Prometheus.

    ``engine`` matches the vLLM engines' ``/metrics`` (``vllm:kvobs_*`` and ``vllm:nixl_*``),
    ``proxy`` the kvobs proxy's ``/metrics`` (``kvobs_proxy_*``).
    """

    # The metric names are already unique to kvobs/vLLM, so the defaults only require a job;
    # narrow them (e.g. 'job="vllm-prefill"') when one Prometheus scrapes several fleets.
    engine: str = 'job!=""'
    proxy: str = 'job!=""'
    # Added to ``engine`` where a vLLM metric means different things on P and on D (queue
    # time, prefill time, TTFT): the engines expose no role label, so roles are told apart
    # by how they are scraped. The defaults expect the jobs to name the role
    # (vllm-prefill, vllm-decode); use any label that does (e.g. 'instance=~"p-.*"').
    prefill: str = 'job=~".*prefill.*"'
    decode: str = 'job=~".*decode.*"'


# Matchers the dashboards use: every query is filtered by the template variables. The role
# matchers stay those of the config (``MonitoringConfig.selectors``): the dashboard's own
# selection ($job, $instance, ...) narrows within a role, it does not define one.
DASHBOARD_SELECTORS = Selectors(
    engine='job=~"$job", model_name=~"$model_name", instance=~"$instance", engine=~"$engine"',
    proxy='job=~"$job", instance=~"$instance"',
)


@dataclass(frozen=True)
class Thresholds:
    """Alert thresholds. Ratios are fractions (0.05 = 5 %)."""

    # Share of D->P read attempts P declined because D's blocks were (nearly) expired.
    expired_read_ratio: float = 0.05
    # Share of later turns (turn > 1) whose lookup found no usable metadata.
    missing_metadata_ratio: float = 0.20
    # Share of D->P reads that failed.
    failed_read_ratio: float = 0.01
    # p95 of a D->P read duration (seconds): the read-latency SLO.
    read_p95_seconds: float = 0.5
    # Recompute speed of a prefill engine (tokens/s). Reads that deliver fewer tokens per
    # second of read time than this are slower than recomputing.
    recompute_tokens_per_second: float = 20000.0
    # Proxy fallbacks (P retried without params) per second.
    fallback_rate: float = 0.01
    # Share of P's mean engine TTFT spent waiting in P's queue (not counting the wait for
    # D's KV, which vLLM counts as queue time too): above it P lacks capacity.
    prefill_queue_share: float = 0.5
    # Metadata store (e.g. Redis) errors per second.
    store_error_rate: float = 0.0
    # Spans dropped by a full export queue per second.
    dropped_spans_rate: float = 0.0


@dataclass(frozen=True)
class RateFloors:
    """Below these denominators (events/s) a ratio is noise: ratio alerts stay silent."""

    read_attempts: float = 0.01
    later_turns: float = 0.01
    reads_done: float = 0.01
    prefill_requests: float = 0.01  # requests finished by the prefill engines


@dataclass(frozen=True)
class Windows:
    rate: str = "5m"  # range of rate() in recording rules and alerts
    stuck: str = "10m"  # increase() window for stuck remote waits
    for_ratio: str = "10m"
    for_latency: str = "15m"
    for_config: str = "5m"
    for_absent: str = "15m"
    for_errors: str = "5m"


@dataclass(frozen=True)
class MonitoringConfig:
    selectors: Selectors = field(default_factory=Selectors)
    thresholds: Thresholds = field(default_factory=Thresholds)
    floors: RateFloors = field(default_factory=RateFloors)
    windows: Windows = field(default_factory=Windows)
    # D's decoder_kv_blocks_ttl (s): reference line for gaps and remaining TTL panels.
    decode_ttl_seconds: float = VLLM_DEFAULT_DECODE_TTL_S
    # Proxy metadata lifetime default (s): must stay below decode_ttl_seconds.
    proxy_entry_lifetime_seconds: float = 450.0
    # Prefix of every alert's runbook_url; the default is the repository path. Deployers set
    # the URL where they host docs/runbooks (e.g. their Git web UI) and regenerate.
    runbook_base_url: str = "docs/runbooks"
    dashboard_uid: str = "kvobs-kv-reuse"
    dashboard_title: str = "kvobs / KV reuse across turns"
    dashboard_tags: tuple[str, ...] = ("kvobs", "vllm", "nixl")
    rule_group_prefix: str = "kvobs"


DEFAULT = MonitoringConfig()

# prometheus_client (0.2x, seen with 0.26) answers a Prometheus 2.x scrape, which negotiates
# OpenMetrics without an `escaping` parameter, with `escaping=underscores`: the sample lines
# of `vllm:*` metrics come out as `vllm_*` (prometheus/client_python#1177), so vLLM's and
# kvobs' engine metrics land in Prometheus 2.x under underscore names. Prometheus 3 asks for
# `allow-utf-8` and keeps the colons. This metric relabeling, added to the engines' scrape
# jobs, restores the `vllm:` names the dashboards and rules query (docs/dashboards.md).
COLON_RESTORING_RELABEL = {
    "source_labels": ["__name__"],
    "regex": "vllm_(.+)",
    "target_label": "__name__",
    "replacement": "vllm:${1}",
}

# Label values the rules and panels select on.
DIRECTION_D_TO_P = ReadDirection.D_TO_P.value
DIRECTION_P_TO_D = ReadDirection.P_TO_D.value
WAS_READ_FALSE = "false"  # M_RELEASES label was_read: "true" | "false" (connector _stats)
