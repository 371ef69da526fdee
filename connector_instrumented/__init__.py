"""Drop-in instrumented NIXL connector for vLLM (see ``docs/connector.md``).

``kv_connector: "KvobsNixlConnector"``, ``kv_connector_module_path:
"connector_instrumented"``.
"""

__all__ = ["KvobsNixlConnector"]


def __getattr__(name: str):
    # Lazy: importing the package must not import vLLM and torch.
    if name == "KvobsNixlConnector":
        from connector_instrumented.connector import KvobsNixlConnector

        return KvobsNixlConnector
    raise AttributeError(name)
