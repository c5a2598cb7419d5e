"""kvkit as a vLLM KV connector (vLLM's V1 connector API; vLLM :data:`SUPPORTED_VLLM`, tested with 0.32.0).

vLLM finds it by name (kvkit's ``vllm.general_plugins`` entry point registers
it in every vLLM process; ``kv_connector_module_path="kvkit.integrations.vllm"``
also works)::

    from vllm.config import KVTransferConfig

    KVTransferConfig(
        kv_connector="KVKitConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes": "16GiB", "cpu_eviction": "lru",
                                   "store": "eager", "copy": "torch"},
    )

vLLM builds two instances: one in the scheduler (role ``SCHEDULER``), which
drives kvkit's :class:`~kvkit.OffloadManager` over vLLM's GPU block pool
(``bind_kv_cache_manager``), and one per worker (role ``WORKER``), which drives
a :class:`~kvkit.worker.engine.TransferEngine` on that worker's KV tensors.
They may live in different processes: each step's plan travels to the
workers inside :class:`KVKitMetadata`, and the workers' results come back
inside :class:`KVKitWorkerMetadata`. Both sides derive the CPU tier's size
from the same ``kv_connector_extra_config`` (see
:func:`~kvkit.integrations.vllm.settings.parse_extra_config`).

A CPU hit is loaded layer by layer (``"layerwise": true``, the default):
``start_load_kv`` submits the step's loads and each layer's
``wait_for_layer_load`` makes the forward pass wait, on the device, for that
layer's blocks only, so later layers still copy while earlier ones compute;
``save_kv_layer`` marks a layer's KV written, so its stores need not wait for
the whole forward pass. With ``"layerwise": false`` loads land before the
forward pass; with ``"async_load": true`` they go through vLLM's asynchronous-load path: the request
waits (``WAITING_FOR_REMOTE_KVS``) while other requests run, and the workers
report it in ``finished_recving`` once its loads landed. A step's stores
copy the blocks that step's forward pass completes, right after it. The
manager holds a GPU reference on every block a copy touches, so vLLM frees a
finished request's blocks at once (``request_finished -> False``). kvkit's
counters reach vLLM's connector stats and Prometheus (``vllm:kvkit_*``, and the
series of vLLM's own offloading connectors, ``vllm:simple_kv_offload_*`` and
``vllm:kv_offload_*``), and its CPU and shared tiers vLLM's KV events
(:mod:`~kvkit.integrations.vllm.metrics`); shutdown logs a one-line summary.
Every finished request's
``RequestOutput.kv_transfer_params`` holds
``{"kvkit_loaded_tokens": n, "kvkit_reloaded_tokens": m}``: the prompt tokens
kvkit loaded when vLLM first scheduled it (counted in ``num_cached_tokens``)
and when it resumed it after preemptions.

Supported: vLLM's hybrid allocator (``SupportsHMA``) with full-attention and
sliding-window groups (a CPU block holds every group's piece; a hit loads
only the blocks inside each window), MLA (DeepSeek's single latent per
token and layer: one region per layer, no K/V split), tensor parallelism,
the layouts vLLM uses on CPU (``[nb, H, bs, 2*D]`` per layer) and on CUDA
(``[2, nb, bs, H, D]`` K/V split, ``[nb, 2, bs, H, D]`` blocks first), and
MLA's ``[nb, bs, D]`` on both; not pipeline parallelism, Mamba or permuted
(HND) caches.

Its modules: ``connector`` (the class vLLM builds), ``scheduler`` and
``worker`` (the two halves), ``settings`` (the extra config), ``gpu_pool``
(vLLM's GPU pool as a block allocator), ``metrics`` (stats, Prometheus and
KV events), ``version`` (the supported range) and ``plugin`` (the
``vllm.general_plugins`` entry point). Two more plug kvkit into vLLM's own
``OffloadingConnector`` instead: ``cache_policy`` (a kvkit eviction policy as
its ``CachePolicy``) and ``tier`` (a kvkit block store as a secondary tier of
its ``TieringOffloadingSpec``). Importing this package imports no vLLM; the
first public name read imports the module defining it, which checks vLLM's
version before anything else of vLLM's.
"""

from __future__ import annotations

from kvkit._lazy import lazy_exports

# The metrics classes come through the connector, which checks vLLM's version before importing them.
__all__ = [
    "EXTRA_KEYS",
    "SUPPORTED_VLLM",
    "KVKitPromMetrics",
    "KVKitStats",
    "LOADED_TOKENS_KEY",
    "RELOADED_TOKENS_KEY",
    "VLLM_LAYOUTS",
    "ConnectorSettings",
    "KVKitCachePolicy",
    "KVKitConnector",
    "KVKitMetadata",
    "KVKitSecondaryTier",
    "KVKitWorkerMetadata",
    "cache_policy_class",
    "check_vllm_version",
    "connector_settings",
    "tier_key_prefix",
]

__getattr__, __dir__ = lazy_exports(__name__, {
    "EXTRA_KEYS": "kvkit.integrations.vllm.settings:EXTRA_KEYS",
    "SUPPORTED_VLLM": "kvkit.integrations.vllm.version:SUPPORTED_VLLM",
    "KVKitPromMetrics": "kvkit.integrations.vllm.connector:KVKitPromMetrics",
    "KVKitStats": "kvkit.integrations.vllm.connector:KVKitStats",
    "LOADED_TOKENS_KEY": "kvkit.integrations.vllm.scheduler:LOADED_TOKENS_KEY",
    "RELOADED_TOKENS_KEY": "kvkit.integrations.vllm.scheduler:RELOADED_TOKENS_KEY",
    "VLLM_LAYOUTS": "kvkit.integrations.vllm.worker:VLLM_LAYOUTS",
    "ConnectorSettings": "kvkit.integrations.vllm.settings:ConnectorSettings",
    "KVKitConnector": "kvkit.integrations.vllm.connector:KVKitConnector",
    "KVKitMetadata": "kvkit.integrations.vllm.connector:KVKitMetadata",
    "KVKitWorkerMetadata": "kvkit.integrations.vllm.connector:KVKitWorkerMetadata",
    "check_vllm_version": "kvkit.integrations.vllm.version:check_vllm_version",
    "connector_settings": "kvkit.integrations.vllm.connector:connector_settings",
    "KVKitCachePolicy": "kvkit.integrations.vllm.cache_policy:KVKitCachePolicy",
    "cache_policy_class": "kvkit.integrations.vllm.cache_policy:cache_policy_class",
    "KVKitSecondaryTier": "kvkit.integrations.vllm.tier:KVKitSecondaryTier",
    "tier_key_prefix": "kvkit.integrations.vllm.tier:tier_key_prefix",
})
