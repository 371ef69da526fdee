"""kvobs multi-turn P/D proxy (flag-compatible with vLLM's disagg_proxy_multiturn example).

Public API::

    from kvobs.proxy import ProxyConfig, Endpoint, build_app, run_proxy

    config = ProxyConfig(prefill=(Endpoint("localhost", 8100),),
                         decode=(Endpoint("localhost", 8200),))
    app = build_app(config)      # aiohttp.web.Application; serve it with
                                 # web.AppRunner(app, **RUNNER_OPTIONS)
    run_proxy(config)            # serve until interrupted

See ``docs/proxy.md``.
"""

from kvobs.proxy.app import RUNNER_OPTIONS, build_app, run_proxy
from kvobs.proxy.config import Endpoint, ProxyConfig
from kvobs.proxy.publisher import NoPublisher, ParamsPublisher, RedisParamsPublisher
from kvobs.proxy.redis_store import RedisStore
from kvobs.proxy.store import Entry, MemoryStore, MetadataStore

__all__ = [
    "RUNNER_OPTIONS",
    "Endpoint",
    "Entry",
    "MemoryStore",
    "MetadataStore",
    "NoPublisher",
    "ParamsPublisher",
    "ProxyConfig",
    "RedisParamsPublisher",
    "RedisStore",
    "build_app",
    "run_proxy",
]
