"""ProxyConfig: everything the proxy is told, in one frozen dataclass."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvobs.settings import DECLINE_WINDOW, DECODE_TTL, PROXY_EXPIRY_MARGIN

from kvobs.proxy.store import INFER_PER_TENANT


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class ProxyConfig:
    """Proxy settings. Only ``prefill`` and ``decode`` are required.

    Entry life: an entry for D's params ends at D's own expiry of the blocks (derived
    from ``remote_blocks_expiry_time`` and the decode TTL, see ``_clock.DecodeClock``)
    minus ``expiry_margin_s``, optionally capped by ``max_entry_lifetime_s``.
    """

    prefill: tuple[Endpoint, ...]
    decode: tuple[Endpoint, ...]
    host: str = "0.0.0.0"
    port: int = 8000
    # decoder_kv_blocks_ttl of the decode engines, used when D's params do not carry it.
    decode_kv_ttl_s: float = DECODE_TTL.default
    # End entries this long before D's blocks expire (>= P's fixed decline window).
    expiry_margin_s: float = PROXY_EXPIRY_MARGIN.default
    max_entry_lifetime_s: float | None = None
    # Upstream-compatible fixed entry life (settings.UPSTREAM_ENTRY_LIFETIME), ignoring D's
    # own expiry. Unsafe when D's TTL is shorter: P then declines the reads (kvobs shows
    # `expired` turns and the lifetime-above-TTL alert fires). None: derive from D.
    fixed_entry_lifetime_s: float | None = None
    # How long a conversation's turn counter and digest survive without a turn.
    conversation_ttl_s: float = 24 * 3600.0
    max_entries: int = 100_000
    # Per-tenant quota next to the global cap: a tenant over it loses its own least
    # recently used entry first, so one tenant's new conversations never evict another's
    # (until the tenants together reach max_entries). Single-tenant deployments: raise it.
    max_entries_per_tenant: int = 10_000
    # Clients without a credential (no API key, an empty one): "isolated" (no lookup,
    # no store, no inference: one anonymous client never reads another's KV) or
    # "shared" (all anonymous clients are one tenant; only for trusted networks).
    anonymous_tenant: str = "isolated"
    store_backend: str = "memory"  # memory | redis
    redis_url: str | None = None
    # Where streaming turns get D's params when the stream does not carry them.
    params_publisher: str = "auto"  # auto (redis when redis_url is set) | redis | none
    publisher_wait_s: float = 0.25
    conversation_header: str = "X-Session-ID"
    tenant_header: str | None = None  # default: the Authorization header's API key
    # Behind a gateway that authenticates clients and sets this header: its value is the
    # tenant when present (else the API key, as without it). Trusted: never bounded by
    # max_new_tenants. Only safe when no client reaches the proxy but through the gateway.
    trusted_tenant_header: str | None = None
    # Against invented keys: at most this many tenants new to this process per window
    # may use the store; a new tenant past it is served without reuse (0: no bound).
    max_new_tenants: int = 0
    new_tenant_window_s: float = 60.0
    access_log: bool = False  # one logfmt line per request
    max_body_bytes: int = 8 * 1024 * 1024
    max_id_length: int = 256
    # Upstream legs: time to open a connection to an engine, and the longest wait for
    # the engine's next bytes (P answers once, after the prefill; D streams, or answers
    # once after the whole decode when the client does not stream).
    connect_timeout_s: float = 5.0
    # Idle pooled connections to the engines are closed after this long. It must stay
    # below the engines' own keep-alive (vLLM's API server closes an idle connection after
    # VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s): a request sent on a connection the server is
    # closing fails (a leg that fails so, before any response byte, is retried once).
    upstream_keepalive_s: float = 2.0
    prefill_read_timeout_s: float = 300.0
    decode_read_timeout_s: float = 1800.0
    # A client must have sent its whole body within this time (slow clients: 408).
    body_timeout_s: float = 60.0
    # /ready: how long each probe may take, and how long its answer is reused.
    ready_timeout_s: float = 1.0
    ready_cache_s: float = 1.0
    # Engines' own API key (upstream's proxy reads OPENAI_API_KEY the same way).
    engine_api_key: str | None = field(
        default_factory=lambda: os.environ.get("OPENAI_API_KEY"), repr=False
    )
    # Upstream rewrites remote_host in P's and D's params to the engine's HTTP host.
    rewrite_remote_host: bool = True
    store_dir: str | None = None  # kvobs span store (else KVOBS_STORE / OTEL_* env)
    # A request without a conversation id continues the tenant's conversation whose
    # covered history its own extends (docs/proxy.md, "Conversation inference").
    infer_conversations: bool = True
    # Conversations indexed for inference per tenant (the oldest are dropped first).
    infer_per_tenant: int = INFER_PER_TENANT
    # Redis: Redis time a turn may spend on store calls in all (a slow or hung Redis costs
    # at most this, then the turn goes on without reuse; the proxy's own lag is not
    # counted: _store_clock), connections in the pool (callers wait for one), and the
    # circuit breaker (after this many failures in a row Redis is skipped for the
    # cool-down, then one call probes it).
    redis_budget_s: float = 0.5
    redis_pool_size: int = 512
    redis_breaker_failures: int = 5
    redis_breaker_cooldown_s: float = 5.0
    # Worker processes on one port (SO_REUSEPORT: the kernel spreads connections over
    # them). More than one needs the Redis store: a conversation's turns land on any
    # worker (_workers). Each worker's /metrics is on its own port, metrics_port + its
    # index (default port + 1): a scrape of the shared port would read whichever worker
    # the kernel picked.
    workers: int = 1
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("at least one prefill and one decode endpoint are required")
        if self.expiry_margin_s < DECLINE_WINDOW.default:
            raise ValueError(
                f"expiry_margin_s must be >= {DECLINE_WINDOW} (P declines reads "
                "that close to D's expiry)"
            )
        if self.decode_kv_ttl_s <= self.expiry_margin_s:
            raise ValueError("decode_kv_ttl_s must exceed expiry_margin_s")
        if self.store_backend not in ("memory", "redis"):
            raise ValueError("store_backend must be 'memory' or 'redis'")
        if self.store_backend == "redis" and not self.redis_url:
            raise ValueError("the redis store needs redis_url")
        if self.params_publisher not in ("auto", "redis", "none"):
            raise ValueError("params_publisher must be auto, redis or none")
        if self.params_publisher == "redis" and not self.redis_url:
            raise ValueError("the redis params publisher needs redis_url")
        if (
            min(self.max_entries, self.max_id_length, self.max_body_bytes, self.infer_per_tenant)
            < 1
        ):
            raise ValueError(
                "max_entries, max_id_length, max_body_bytes and infer_per_tenant must be positive"
            )
        if (
            min(self.max_entries_per_tenant, self.redis_pool_size, self.redis_breaker_failures) < 1
            or min(self.redis_budget_s, self.redis_breaker_cooldown_s) <= 0
        ):
            raise ValueError(
                "max_entries_per_tenant, redis_pool_size, "
                "redis_breaker_failures, redis_budget_s and "
                "redis_breaker_cooldown_s must be positive"
            )
        if (
            min(
                self.connect_timeout_s,
                self.upstream_keepalive_s,
                self.prefill_read_timeout_s,
                self.decode_read_timeout_s,
                self.body_timeout_s,
                self.ready_timeout_s,
            )
            <= 0
            or self.ready_cache_s < 0
        ):
            raise ValueError("timeouts must be positive")
        if self.max_new_tenants < 0 or self.new_tenant_window_s <= 0:
            raise ValueError("max_new_tenants must be >= 0 and new_tenant_window_s positive")
        if self.tenant_header and self.trusted_tenant_header:
            raise ValueError("tenant_header and trusted_tenant_header exclude each other")
        if self.workers < 1:
            raise ValueError("workers must be positive")
        if self.workers > 1 and self.store_backend != "redis":
            raise ValueError(
                "several workers need the redis store: the in-memory store is one per "
                "process, and a conversation's turns reach any worker, so each worker "
                "would miss the turns the others served"
            )
        if self.anonymous_tenant not in ("isolated", "shared"):
            raise ValueError("anonymous_tenant must be 'isolated' or 'shared'")

    @property
    def publisher_kind(self) -> str:
        if self.params_publisher == "auto":
            return "redis" if self.redis_url else "none"
        return self.params_publisher
