"""Every knob of the monitoring mixin in one place: selectors, windows, thresholds.

Dashboards, recording rules and alerts read only this module for tunables. A deployment
writes its own values in one YAML or TOML file (``deploy/monitoring.example.yaml``: the
same keys as these dataclasses, nested) and/or ``--set KEY=VALUE`` flags, and regenerates::

    python -m kvobs.monitoring.generate --config monitoring.yaml --set decode_ttl_seconds=300

:func:`load` reads the file; unknown keys, wrong types and incoherent values (a relative
runbook URL, a proxy entry lifetime not below D's TTL) are a :class:`ConfigError` that
names the key, never a silent default.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from kvobs.semconv import ReadDirection
from kvobs.settings import DECLINE_WINDOW, DECODE_TTL, PROXY_EXPIRY_MARGIN, entry_lifetime_s

RUNBOOK_BASE_URL = "https://github.com/kvobs/kvobs/blob/main/docs/runbooks"


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
    # Matchers on `up` naming the scrape jobs that must expose kvobs metrics: the
    # telemetry-absent alerts fire per job (and namespace) scraped without them, so one
    # healthy fleet cannot hide another's missing connector or proxy.
    engine_targets: str = 'job=~".*(prefill|decode).*"'
    proxy_targets: str = 'job=~".*proxy.*"'
    # The live classifiers' (``kvobs collect``) jobs: deploy/'s monitors name them
    # kvobs-classifier. Their process_cpu_seconds_total is picked by it too (every
    # process exposes that name).
    classifier_targets: str = 'job=~".*classifier.*"'


# Matchers the dashboards use: every query is filtered by the template variables. The role
# matchers stay those of the config (``MonitoringConfig.selectors``): the dashboard's own
# selection ($job, $instance, ...) narrows within a role, it does not define one. Every
# variable is a regex whose "All" is `.*`, which also matches a series without the label
# (a Prometheus without `cluster`, a static scrape without `namespace` or `pod`).
# Where the series come from: the labels every scraped series may carry.
SCRAPE_MATCHERS = (
    'cluster=~"$cluster", namespace=~"$namespace", job=~"$job", pod=~"$pod", instance=~"$instance"'
)
DASHBOARD_SELECTORS = Selectors(
    engine=f'{SCRAPE_MATCHERS}, model_name=~"$model_name", engine=~"$engine"',
    proxy=SCRAPE_MATCHERS,
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
    # Share of later turns the live classifier finds slow-transfer (a read that cost more
    # than recomputing). The expired, missing-metadata and transfer-failed shares of
    # later turns use expired_read_ratio, missing_metadata_ratio and failed_read_ratio.
    slow_transfer_turn_ratio: float = 0.05
    # Proxy fallbacks (P retried without params) per second.
    fallback_rate: float = 0.01
    # Share of P's mean engine TTFT spent waiting in P's queue (not counting the wait for
    # D's KV, which vLLM counts as queue time too): above it P lacks capacity.
    prefill_queue_share: float = 0.5
    # Metadata store (e.g. Redis) errors per second.
    store_error_rate: float = 0.0
    # Spans dropped by a full export queue per second.
    dropped_spans_rate: float = 0.0
    # Share of the host tier's lookups that wanted a copy it had evicted (of those that
    # found a copy or its evicted blocks): the tier is too small for the inter-turn gaps.
    host_evicted_lookup_ratio: float = 0.1
    # Share of host copies that stop at the prompt (not covering the generated tokens)
    # on a fleet with later turns: offload_prompt_only=true on a multi-turn fleet. High
    # by default: a short answer that does not fill its block is prompt-only too.
    host_prompt_only_ratio: float = 0.9
    # CPU seconds a second of one live classifier process: it serves, decodes and
    # classifies on one core; past it the Collector's queue grows, then drops spans.
    classifier_cpu_share: float = 0.8
    # Share of the spans a classifier received after their conversation had left its
    # window (stored, not classified): the window is short for the fleet's delays.
    late_span_ratio: float = 0.01


@dataclass(frozen=True)
class RateFloors:
    """Below these denominators (events/s) a ratio is noise: ratio alerts stay silent."""

    read_attempts: float = 0.01
    later_turns: float = 0.01
    reads_done: float = 0.01
    prefill_requests: float = 0.01  # requests finished by the prefill engines
    host_lookups: float = 0.01  # host-tier lookups that found a copy or its evicted blocks
    host_saves: float = 0.01  # host copies saved
    classifier_spans: float = 1.0  # spans a live classifier received


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
    # D's decoder_kv_blocks_ttl (s), the deployment's: the proxy entry lifetime derives
    # from it. The dashboards and rules need no copy of it: they read the TTL the proxy
    # reports (kvobs_proxy_decode_ttl_seconds), so a TTL change regenerates nothing.
    decode_ttl_seconds: float = DECODE_TTL.default
    # The proxy's --expiry-margin (s): its entries end this long before D's blocks expire.
    proxy_expiry_margin_seconds: float = PROXY_EXPIRY_MARGIN.default
    # The proxy's entry lifetime (s): must stay below decode_ttl_seconds. Unset (None):
    # derived, D's TTL less the expiry margin (kvobs.settings.entry_lifetime_s, as the
    # proxy derives it); set it only for a proxy run with --max-entry-lifetime or
    # --fixed-entry-lifetime.
    proxy_entry_lifetime_seconds: float | None = None
    # Prefix of every alert's runbook_url and of the dashboards' runbook links: absolute
    # (Alertmanager and Grafana cannot resolve a repository path). Point it at the place
    # that serves docs/runbooks for you (your Git web UI, an internal docs site).
    runbook_base_url: str = RUNBOOK_BASE_URL
    # Labels every alert and recording rule aggregates by (the first level of recording
    # rule names): `namespace` keeps two fleets' jobs of the same name apart.
    aggregation_labels: tuple[str, ...] = ("namespace", "job")
    # Trace view for exemplars and the dashboards' trace link: a URL with `${__value.raw}`
    # where the trace id goes (Jaeger: http://jaeger:16686/trace/${__value.raw}); empty:
    # exemplars are shown without a link.
    trace_url: str = ""
    dashboard_uid: str = "kvobs-kv-reuse"
    dashboard_title: str = "kvobs / KV reuse across turns"
    dashboard_tags: tuple[str, ...] = ("kvobs", "vllm", "nixl")
    rule_group_prefix: str = "kvobs"
    # Labels of the PrometheusRule manifest: kube-prometheus-stack's Prometheus selects
    # rules by `release: <its Helm release name>` (ruleSelector); set yours.
    prometheus_rule_labels: dict[str, str] = field(
        default_factory=lambda: {"release": "kube-prometheus-stack"}
    )
    # Labels of the dashboards' ConfigMap: the Grafana sidecar (kube-prometheus-stack's
    # grafana.sidecar.dashboards) loads ConfigMaps labelled `grafana_dashboard`.
    dashboard_configmap_labels: dict[str, str] = field(
        default_factory=lambda: {"grafana_dashboard": "1"}
    )

    @property
    def entry_lifetime_seconds(self) -> float:
        """The proxy's entry lifetime: as set, or derived from D's TTL on every read
        (stored derived, ``dataclasses.replace`` of the TTL would keep the old one)."""
        if self.proxy_entry_lifetime_seconds is not None:
            return self.proxy_entry_lifetime_seconds
        return float(entry_lifetime_s(self.decode_ttl_seconds, self.proxy_expiry_margin_seconds))


DEFAULT = MonitoringConfig()


class ConfigError(ValueError):
    """A monitoring config file or ``--set`` flag that cannot be used as written."""


# Prometheus' duration syntax (model.ParseDuration): units from largest to smallest.
_DURATION = re.compile(r"(?:\d+y)?(?:\d+w)?(?:\d+d)?(?:\d+h)?(?:\d+m)?(?:\d+s)?(?:\d+ms)?")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# One PromQL label matcher: name, operator, double-quoted value (escapes allowed).
_MATCHER = r'\s*[a-zA-Z_][a-zA-Z0-9_]*\s*(?:=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*'
_MATCHERS = re.compile(rf"(?:{_MATCHER}(?:,{_MATCHER})*)?")
# Kubernetes label keys (optional DNS prefix) and values.
_K8S_LABEL_KEY = re.compile(
    r"(?:[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)
_K8S_LABEL_VALUE = re.compile(r"(?:[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
_GRAFANA_UID = re.compile(r"[A-Za-z0-9_-]{1,40}")


def _coerce(value, kind, key: str):
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = [k for k in typing.get_args(kind) if k is not type(None)]
        return None if value is None else _coerce(value, options[0], key)
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table of keys, got {value!r}")
        return _build(kind, value, f"{key}.")
    if origin is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key}: expected a list of strings, got {value!r}")
        return tuple(value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table of labels, got {value!r}")
        for label, text in value.items():
            if isinstance(text, (dict, list)) or text is None:
                raise ConfigError(f"{key}.{label}: expected a string, got {text!r}")
        return {str(k): str(v) for k, v in value.items()}
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            number = float(value)
        except ValueError:
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        if not math.isfinite(number):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return number
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


def _build(cls, values: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(
            f"unknown key {prefix}{unknown[0]} (known: {', '.join(prefix + n for n in names)})"
        )
    return cls(
        **{name: _coerce(value, hints[name], prefix + name) for name, value in values.items()}
    )


def _problems(config: MonitoringConfig):
    """``(key, what is wrong)`` for every value the generated files could not use."""
    for name, value in dataclasses.asdict(config.windows).items():
        if not value or not _DURATION.fullmatch(value):
            yield (
                f"windows.{name}",
                f"expected a Prometheus duration such as 5m or 1h30m, got {value!r}",
            )
    for name, value in dataclasses.asdict(config.selectors).items():
        if not _MATCHERS.fullmatch(value):
            yield (
                f"selectors.{name}",
                "expected PromQL label matchers without braces, "
                f'e.g. \'job=~".*prefill.*", namespace="serving"\', got {value!r}',
            )
    for name, value in dataclasses.asdict(config.thresholds).items():
        if value < 0:
            yield f"thresholds.{name}", f"must not be negative, got {value:g}"
        elif name.endswith(("_ratio", "_share")) and value > 1:
            yield (f"thresholds.{name}", f"is a fraction (0.05 = 5 %), at most 1, got {value:g}")
        elif name in ("read_p95_seconds", "recompute_tokens_per_second") and value == 0:
            yield f"thresholds.{name}", "must be positive"
    for name, value in dataclasses.asdict(config.floors).items():
        if value < 0:
            yield f"floors.{name}", f"must not be negative, got {value:g}"
    if config.decode_ttl_seconds <= 0:
        yield "decode_ttl_seconds", "must be positive"
    lifetime = config.entry_lifetime_seconds
    if config.proxy_expiry_margin_seconds < DECLINE_WINDOW.default:
        yield (
            "proxy_expiry_margin_seconds",
            f"must be at least P's decline window ({DECLINE_WINDOW}), as the proxy requires",
        )
    elif lifetime <= 0:
        yield (
            "proxy_entry_lifetime_seconds",
            f"must be positive (D's TTL "
            f"{config.decode_ttl_seconds:g} s less the expiry margin "
            f"{config.proxy_expiry_margin_seconds:g} s is "
            f"{lifetime:g} s)",
        )
    elif lifetime >= config.decode_ttl_seconds:
        yield (
            "proxy_entry_lifetime_seconds",
            f"({lifetime:g}) must be below decode_ttl_seconds "
            f"({config.decode_ttl_seconds:g}): the proxy would hand out params for blocks "
            "D already released",
        )
    if not config.runbook_base_url.startswith(("https://", "http://")):
        yield (
            "runbook_base_url",
            f"must be an absolute http(s) URL, got "
            f"{config.runbook_base_url!r}: Alertmanager and Grafana cannot open a "
            "repository path",
        )
    if config.trace_url and not config.trace_url.startswith(("https://", "http://")):
        yield "trace_url", f"must be empty or an http(s) URL, got {config.trace_url!r}"
    if not config.aggregation_labels:
        yield "aggregation_labels", "must name at least one label (e.g. job)"
    for label in config.aggregation_labels:
        if not _LABEL_NAME.fullmatch(label):
            yield "aggregation_labels", f"{label!r} is not a Prometheus label name"
    if not _GRAFANA_UID.fullmatch(config.dashboard_uid):
        yield (
            "dashboard_uid",
            f"expected 1 to 40 letters, digits, '-' or '_', got {config.dashboard_uid!r}",
        )
    if not config.dashboard_title.strip():
        yield "dashboard_title", "must not be empty"
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", config.rule_group_prefix):
        yield (
            "rule_group_prefix",
            f"expected letters, digits, '.', '-' or '_', got {config.rule_group_prefix!r}",
        )
    for key in ("prometheus_rule_labels", "dashboard_configmap_labels"):
        for label, value in getattr(config, key).items():
            if not _K8S_LABEL_KEY.fullmatch(label) or len(label.split("/")[-1]) > 63:
                yield f"{key}.{label}", "is not a Kubernetes label key"
            elif len(value) > 63 or not _K8S_LABEL_VALUE.fullmatch(value):
                yield f"{key}.{label}", f"{value!r} is not a Kubernetes label value"


def check(config: MonitoringConfig) -> MonitoringConfig:
    """``config`` if every value is usable, else :class:`ConfigError` naming the key."""
    for key, problem in _problems(config):
        raise ConfigError(f"{key}: {problem}")
    return config


def from_mapping(values: dict) -> MonitoringConfig:
    return check(_build(MonitoringConfig, values))


def _parse_file(path: Path) -> dict:
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as error:  # a parse error of either library: name the file
        raise ConfigError(f"{path}: {error}") from error
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table of keys at the top")
    return data


def _set(values: dict, assignment: str) -> None:
    """Apply one ``a.b=value`` flag to a nested dict (the value parsed as YAML)."""
    import yaml

    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE")
    *parents, leaf = key.strip().split(".")
    node = values
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {assignment!r}: {part} is not a table")
    node[leaf] = yaml.safe_load(raw) if raw.strip() else ""


def load(path: str | Path | None = None, overrides: typing.Iterable[str] = ()) -> MonitoringConfig:
    """The config of ``path`` (YAML, or TOML by its ``.toml`` suffix) with ``overrides``
    (``section.key=value``) applied; the defaults where neither sets a key."""
    values = _parse_file(Path(path)) if path else {}
    for assignment in overrides:
        _set(values, assignment)
    return from_mapping(values)


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
