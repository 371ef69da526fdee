"""kvobs proxy: the multi-turn P/D proxy (flags compatible with vLLM's example proxy)."""

from __future__ import annotations

import click

from kvobs.cli._common import fail_input
from kvobs.settings import DECLINE_WINDOW, DECODE_TTL, PROXY_EXPIRY_MARGIN

ENV_REDIS_URL = "KVOBS_PROXY_REDIS_URL"


def _split(values: tuple[str, ...]) -> list[str]:
    # upstream takes `--prefiller-hosts a b`; click options take one value each, so
    # both repeated flags and comma/space separated lists are accepted.
    out: list[str] = []
    for value in values:
        out.extend(part for part in value.replace(",", " ").split() if part)
    return out


def _endpoints(hosts, ports, role):
    from kvobs.proxy import Endpoint

    hosts, ports = _split(hosts), _split(ports)
    if len(hosts) == 1 and len(ports) > 1:
        hosts = hosts * len(ports)
    if len(hosts) != len(ports):
        fail_input(f"number of {role} hosts must match ports")
    try:
        return tuple(Endpoint(h, int(p)) for h, p in zip(hosts, ports))
    except ValueError:
        fail_input(f"{role} ports must be integers")


_LIST_FLAGS = frozenset(
    {
        "--prefiller-host",
        "--prefiller-hosts",
        "--prefiller-port",
        "--prefiller-ports",
        "--decoder-host",
        "--decoder-hosts",
        "--decoder-port",
        "--decoder-ports",
    }
)


class _UpstreamFlags(click.Command):
    """Accepts upstream's argparse ``nargs='+'`` style: ``--decoder-ports 8200 8201``."""

    def parse_args(self, ctx, args):
        rewritten, flag = [], None
        for arg in args:
            if arg in _LIST_FLAGS:
                flag = arg
                continue
            if flag is not None and not arg.startswith("-"):
                rewritten += [flag, arg]
                continue
            flag = None
            rewritten.append(arg)
        return super().parse_args(ctx, rewritten)


@click.command("proxy", cls=_UpstreamFlags)
@click.option("--host", default="0.0.0.0", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option(
    "--prefiller-host",
    "--prefiller-hosts",
    "prefiller_hosts",
    multiple=True,
    default=("localhost",),
    show_default=True,
)
@click.option(
    "--prefiller-port",
    "--prefiller-ports",
    "prefiller_ports",
    multiple=True,
    default=("8100",),
    show_default=True,
)
@click.option(
    "--decoder-host",
    "--decoder-hosts",
    "decoder_hosts",
    multiple=True,
    default=("localhost",),
    show_default=True,
)
@click.option(
    "--decoder-port",
    "--decoder-ports",
    "decoder_ports",
    multiple=True,
    default=("8200",),
    show_default=True,
)
@click.option(
    "--decode-kv-ttl",
    type=float,
    default=DECODE_TTL.default,
    show_default=True,
    help="decoder_kv_blocks_ttl (s) of the decode engines, when D's params lack it.",
)
@click.option(
    "--expiry-margin",
    type=float,
    default=PROXY_EXPIRY_MARGIN.default,
    show_default=True,
    help=f"End entries this long before D's blocks expire (>= {DECLINE_WINDOW}).",
)
@click.option(
    "--max-entry-lifetime", type=float, default=None, help="Optional cap (s) on an entry's life."
)
@click.option(
    "--fixed-entry-lifetime",
    type=float,
    default=None,
    help="Upstream-compatible fixed entry life (s), ignoring D's expiry. Unsafe "
    "when D's TTL is shorter (reads get declined as expired).",
)
@click.option("--max-entries", type=int, default=100_000, show_default=True)
@click.option(
    "--conversation-ttl",
    type=float,
    default=86400.0,
    show_default=True,
    help="Idle time (s) after which a conversation's turn counter is forgotten.",
)
@click.option(
    "--redis-url",
    envvar=ENV_REDIS_URL,
    show_envvar=True,
    default=None,
    help="Redis for shared state (and the streaming params publisher).",
)
@click.option(
    "--store",
    "store_backend",
    type=click.Choice(["auto", "memory", "redis"]),
    default="auto",
    show_default=True,
    help="auto: redis when --redis-url is given, else in-process.",
)
@click.option(
    "--params-publisher",
    type=click.Choice(["auto", "redis", "none"]),
    default="auto",
    show_default=True,
)
@click.option("--conversation-header", default="X-Session-ID", show_default=True)
@click.option(
    "--tenant-header",
    default=None,
    help="Header naming the tenant (default: the Authorization API key).",
)
@click.option("--max-body-bytes", type=int, default=8 * 1024 * 1024, show_default=True)
@click.option("--max-id-length", type=int, default=256, show_default=True)
@click.option("--store-dir", default=None, help="kvobs span store directory (or KVOBS_STORE).")
@click.option(
    "--infer-conversations/--no-infer-conversations",
    default=None,
    help="A request without a conversation id continues the tenant's "
    "conversation whose history it extends (default: on).",
)
@click.option(
    "--infer-per-tenant",
    type=int,
    default=None,
    help="Conversations indexed for inference per tenant (the oldest go first).",
)
@click.option(
    "--connect-timeout",
    type=float,
    default=None,
    help="Seconds to open a connection to an engine (default 5).",
)
@click.option(
    "--upstream-keepalive",
    type=float,
    default=None,
    help="Seconds an idle connection to an engine is kept for reuse (default 2). "
    "Keep it below the engines' keep-alive (vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, "
    "5 s).",
)
@click.option(
    "--prefill-read-timeout",
    type=float,
    default=None,
    help="Longest wait (s) for P's answer (default 300).",
)
@click.option(
    "--decode-read-timeout",
    type=float,
    default=None,
    help="Longest wait (s) for D's next bytes: its next stream chunk, or its "
    "whole answer when not streaming (default 1800).",
)
@click.option(
    "--body-timeout",
    type=float,
    default=None,
    help="Seconds a client has to send its whole request body (default 60).",
)
@click.option(
    "--max-entries-per-tenant",
    type=int,
    default=None,
    help="Entry quota per tenant next to --max-entries: a tenant over it loses "
    "its own oldest entry first (default 10000).",
)
@click.option(
    "--anonymous-tenant",
    type=click.Choice(["isolated", "shared"]),
    default=None,
    help="Clients without an API key: isolated (default: no reuse, one anonymous "
    "client never reads another's KV) or shared (one tenant; trusted "
    "networks only).",
)
@click.option(
    "--redis-budget",
    type=float,
    default=None,
    help="Seconds of Redis time (request written to reply received, not the "
    "proxy's own lag) a turn may spend in all; then it goes on without "
    "reuse (default 0.5).",
)
@click.option(
    "--redis-pool-size",
    type=int,
    default=None,
    help="Redis connections (callers wait for a free one; default 512).",
)
@click.option(
    "--redis-breaker-failures",
    type=int,
    default=None,
    help="Redis failures in a row that open the circuit breaker (default 5).",
)
@click.option(
    "--redis-breaker-cooldown",
    type=float,
    default=None,
    help="Seconds Redis is skipped once the breaker opens (default 5).",
)
@click.option(
    "--trusted-tenant-header",
    default=None,
    help="Behind a gateway that authenticates clients: the header it sets to the "
    "client's tenant, taken as the tenant when present (else the API key). "
    "Only where no client reaches the proxy but through that gateway.",
)
@click.option(
    "--max-new-tenants",
    type=int,
    default=None,
    help="Tenants new to this proxy admitted per --new-tenant-window; a new "
    "tenant past it is served without reuse (against invented API keys; "
    "default 0: no bound).",
)
@click.option(
    "--new-tenant-window",
    type=float,
    default=None,
    help="Seconds of the --max-new-tenants window (default 60).",
)
@click.option(
    "--access-log/--no-access-log",
    default=False,
    show_default=True,
    help="One logfmt line per request.",
)
@click.option(
    "--workers",
    type=int,
    default=None,
    help="Worker processes on --port (SO_REUSEPORT; default 1). More than one needs "
    "--store redis; each worker's /metrics is on its own port (--metrics-port + index).",
)
@click.option(
    "--metrics-port",
    type=int,
    default=None,
    help="With --workers > 1: the first worker's /metrics port (default --port + 1).",
)
@click.option("--log-level", default="INFO", show_default=True)
def proxy_command(
    host,
    port,
    prefiller_hosts,
    prefiller_ports,
    decoder_hosts,
    decoder_ports,
    decode_kv_ttl,
    expiry_margin,
    max_entry_lifetime,
    fixed_entry_lifetime,
    max_entries,
    conversation_ttl,
    redis_url,
    store_backend,
    params_publisher,
    conversation_header,
    tenant_header,
    max_body_bytes,
    max_id_length,
    store_dir,
    infer_conversations,
    infer_per_tenant,
    connect_timeout,
    upstream_keepalive,
    prefill_read_timeout,
    decode_read_timeout,
    body_timeout,
    max_entries_per_tenant,
    anonymous_tenant,
    redis_budget,
    redis_pool_size,
    redis_breaker_failures,
    redis_breaker_cooldown,
    trusted_tenant_header,
    max_new_tenants,
    new_tenant_window,
    access_log,
    workers,
    metrics_port,
    log_level,
):
    """Serve the multi-turn P/D proxy (/v1/chat/completions, /v1/completions, /health, /metrics)."""
    from kvobs.proxy import ProxyConfig, run_proxy
    from kvobs.proxy._log import configure

    configure(log_level)  # logfmt, every logger
    if store_backend == "auto":
        store_backend = "redis" if redis_url else "memory"
    # Unset: ProxyConfig's own default (one default, in one place).
    optional = {
        name: value
        for name, value in (
            ("infer_conversations", infer_conversations),
            ("infer_per_tenant", infer_per_tenant),
            ("connect_timeout_s", connect_timeout),
            ("upstream_keepalive_s", upstream_keepalive),
            ("prefill_read_timeout_s", prefill_read_timeout),
            ("decode_read_timeout_s", decode_read_timeout),
            ("body_timeout_s", body_timeout),
            ("max_entries_per_tenant", max_entries_per_tenant),
            ("anonymous_tenant", anonymous_tenant),
            ("redis_budget_s", redis_budget),
            ("redis_pool_size", redis_pool_size),
            ("redis_breaker_failures", redis_breaker_failures),
            ("redis_breaker_cooldown_s", redis_breaker_cooldown),
            ("trusted_tenant_header", trusted_tenant_header),
            ("max_new_tenants", max_new_tenants),
            ("new_tenant_window_s", new_tenant_window),
            ("workers", workers),
            ("metrics_port", metrics_port),
        )
        if value is not None
    }
    try:
        config = ProxyConfig(
            prefill=_endpoints(prefiller_hosts, prefiller_ports, "prefiller"),
            decode=_endpoints(decoder_hosts, decoder_ports, "decoder"),
            host=host,
            port=port,
            decode_kv_ttl_s=decode_kv_ttl,
            expiry_margin_s=expiry_margin,
            max_entry_lifetime_s=max_entry_lifetime,
            fixed_entry_lifetime_s=fixed_entry_lifetime,
            max_entries=max_entries,
            conversation_ttl_s=conversation_ttl,
            store_backend=store_backend,
            redis_url=redis_url,
            params_publisher=params_publisher,
            conversation_header=conversation_header,
            tenant_header=tenant_header,
            max_body_bytes=max_body_bytes,
            max_id_length=max_id_length,
            store_dir=store_dir,
            access_log=access_log,
            **optional,
        )
    except ValueError as error:
        fail_input(str(error))
    run_proxy(config)
