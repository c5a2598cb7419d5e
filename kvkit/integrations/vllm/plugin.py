"""vLLM's ``vllm.general_plugins`` entry point: makes ``kv_connector="KVKitConnector"`` work without a module path.

vLLM calls ``register`` in every process it starts (engine core, workers)
before it builds connectors, so the name resolves everywhere. Registering
is idempotent: vLLM refuses a second registration of one name, and a process
may load plugins more than once.
"""

from __future__ import annotations

NAME = "KVKitConnector"


def register() -> None:
    """Register ``KVKitConnector`` with vLLM's connector factory (lazily: nothing of kvkit's connector loads yet)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, "kvkit.integrations.vllm", NAME)
