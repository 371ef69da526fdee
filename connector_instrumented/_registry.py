"""Make kvobs's connectors known to vLLM's connector factory by class name.

vLLM loads an out-of-tree connector by ``kv_connector_module_path``, without
registering it; under ``MultiConnector`` the API server rebuilds each sub-connector's
stats by class name (``KVConnectorFactory.get_connector_class_by_name``), which raised
"Connector 'Kvobs...' is not registered" for ours. Importing a kvobs connector module
(which resolving its class does, in every process) registers it.
"""

from __future__ import annotations


def register(cls: type) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    name = cls.__name__
    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, cls.__module__, name)
