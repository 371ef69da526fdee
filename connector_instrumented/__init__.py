"""Drop-in instrumented NIXL connector for vLLM (see ``docs/connector.md``).

``kv_connector: "KvobsNixlConnector"``, ``kv_connector_module_path:
"connector_instrumented"``.
"""

from .connector import KvobsNixlConnector

__all__ = ["KvobsNixlConnector"]
