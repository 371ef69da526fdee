"""Connector options: ``kv_connector_extra_config`` keys first, then environment.

Every option that changes scheduling is named here, documented in ``docs/connector.md``
and tested both ways (``tests/connector/test_options.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from kvobs.semconv import Service

# kv_connector_extra_config keys.
KEY_ROLE = "kvobs_role"
KEY_TELEMETRY = "kvobs_telemetry"
KEY_PREFIX_GUARD = "kvobs_prefix_guard"
KEY_FIX_STUCK = "kvobs_fix_stuck_waits"
KEY_STUCK_AFTER = "kvobs_stuck_after_s"
KEY_STORE = "kvobs_store"
KEY_PARAMS_REDIS = "kvobs_params_redis_url"

# Environment fallbacks (extra config wins).
ENV_ROLE = "KVOBS_ROLE"
ENV_TELEMETRY = "KVOBS_CONNECTOR_TELEMETRY"

ROLES = {"prefill": Service.PREFILL, "decode": Service.DECODE}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"kvobs connector option {key}={value!r} is not a boolean")


@dataclass(frozen=True)
class Options:
    """Parsed connector options (defaults are the documented ones)."""

    role: Service | None = None  # None: each span goes to its semconv service
    telemetry: bool = True  # False: the connector is upstream's, nothing observed
    prefix_guard: bool = True  # cut D's offer to the block-hash-verified prefix
    fix_stuck_waits: bool = True  # recompute instead of waiting forever (DESIGN §6)
    stuck_after_s: float = 30.0  # watchdog: waiting longer than this is reported
    store_dir: str | None = None  # embedded span store (else KVOBS_STORE / OTEL_*)
    params_redis_url: str | None = None  # D publishes its params here (streaming reuse)

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
    ) -> "Options":
        extra = dict(extra or {})
        environ = os.environ if environ is None else environ
        role_name = extra.get(KEY_ROLE, environ.get(ENV_ROLE))
        role = None
        if role_name not in (None, ""):
            role_name = str(role_name).strip().lower()
            if role_name not in ROLES:
                raise ValueError(
                    f"kvobs connector option {KEY_ROLE}={role_name!r}: expected one of "
                    f"{sorted(ROLES)}"
                )
            role = ROLES[role_name]
        telemetry = extra.get(KEY_TELEMETRY, environ.get(ENV_TELEMETRY, True))
        stuck_after = float(extra.get(KEY_STUCK_AFTER, cls.stuck_after_s))
        if stuck_after <= 0:
            raise ValueError(f"kvobs connector option {KEY_STUCK_AFTER} must be > 0")
        return cls(
            role=role,
            telemetry=_as_bool(KEY_TELEMETRY, telemetry),
            prefix_guard=_as_bool(KEY_PREFIX_GUARD, extra.get(KEY_PREFIX_GUARD, True)),
            fix_stuck_waits=_as_bool(KEY_FIX_STUCK, extra.get(KEY_FIX_STUCK, True)),
            stuck_after_s=stuck_after,
            store_dir=extra.get(KEY_STORE) or None,
            params_redis_url=extra.get(KEY_PARAMS_REDIS) or None,
        )

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> "Options":
        """The options of the connector ``vllm_config.kv_transfer_config`` describes."""
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        return cls.from_extra_config(getattr(ktc, "kv_connector_extra_config", None))
