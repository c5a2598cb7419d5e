"""Settings of kvkit's vLLM connector: the KV shape and ``kv_connector_extra_config``, validated.

vLLM-free (vLLM's config objects are read by attribute), so both connector
sides and the tests share one parser. The scheduler side and every worker
build their settings from the same ``extra_config`` and KV cache config, so
the CPU tier's size has one source of truth: :attr:`ConnectorSettings.stack`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvkit._renamed import rename_keywords
from kvkit.config import DEFAULTS, StackConfig
from kvkit.errors import ConfigError
from kvkit.interfaces import KVCacheSpec
from kvkit.registry import STORE, did_you_mean
from kvkit.worker.layouts import LAYOUTS

__all__ = ["EXTRA_KEYS", "ConnectorSettings", "kv_spec_from_vllm", "parse_extra_config"]

EXTRA_KEYS: tuple[str, ...] = (
    "cpu_bytes", "cpu_blocks", "cpu_eviction", "store", "copy", "allocator", "options", "layout", "cpu_layout",
)
"""Keys ``kv_connector_extra_config`` may hold (see :func:`parse_extra_config`)."""

_NAMED_SLOTS = ("cpu_eviction", "store", "copy", "allocator")
_RENAMED_KEYS = {"eviction": "cpu_eviction"}  # old key -> new key; the old one warns (one release)


@attrs.frozen
class ConnectorSettings:
    """Everything one connector side needs, validated.

    Attributes:
        stack: the offload stack's configuration (KV shape, CPU capacity,
            component names); ``stack.num_cpu_blocks`` sizes both the
            scheduler's CPU pool and every worker's CPU mirror.
        layout: ``"auto"`` (detected from vLLM's KV tensors) or a name in
            :data:`kvkit.worker.layouts.LAYOUTS`.
        num_cpu_blocks: ``stack.num_cpu_blocks``, computed once.
    """

    stack: StackConfig
    layout: str = "auto"
    num_cpu_blocks: int = attrs.field(
        init=False, default=attrs.Factory(lambda self: self.stack.num_cpu_blocks, takes_self=True))
    """Blocks of the CPU tier (the one figure both sides must agree on)."""


def kv_spec_from_vllm(kv_cache_config: Any) -> KVCacheSpec:
    """The :class:`KVCacheSpec` of a vLLM ``KVCacheConfig`` with one attention group.

    Reads ``kv_cache_groups[0].layer_names`` and its ``kv_cache_spec``
    (``block_size``, ``num_kv_heads``, ``head_size``, ``head_size_v``, ``dtype``).

    Raises:
        ConfigError: no config, several KV cache groups (hybrid models), or a
            spec without separate K and V of equal size (MLA, Mamba).
    """
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups or len(groups) != 1:
        count = "no" if not groups else len(groups)
        raise ConfigError(
            f"kvkit's vLLM connector needs exactly one KV cache group, got {count} "
            f"(kv_cache_config={type(kv_cache_config).__name__}); hybrid models are not supported")
    group = groups[0]
    spec = group.kv_cache_spec
    head_size = getattr(spec, "head_size", None)
    head_size_v = getattr(spec, "head_size_v", head_size)
    if head_size is None or head_size_v != head_size or not hasattr(spec, "num_kv_heads"):
        raise ConfigError(
            f"kvkit's vLLM connector needs attention layers with K and V of equal head size, got "
            f"{type(spec).__name__}(head_size={head_size!r}, head_size_v={head_size_v!r})")
    return KVCacheSpec(
        num_layers=len(group.layer_names),
        block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads,
        head_dim=head_size,
        dtype=str(spec.dtype).removeprefix("torch."),
    )


def parse_extra_config(extra: Mapping[str, Any] | None, *, kv: KVCacheSpec, gpu_blocks: int,
                       world_size: int, device: str) -> ConnectorSettings:
    """Validate ``kv_connector_extra_config`` and turn it into settings.

    Keys (all but the capacity optional):

    * ``cpu_bytes`` (``"8GiB"`` or an int; per worker) or ``cpu_blocks``:
      the CPU tier's size, exactly one of them;
    * ``cpu_eviction``, ``store``, ``copy``, ``allocator``: registered names,
      as ``kvkit list`` shows them (defaults: :data:`kvkit.config.DEFAULTS`:
      ``lru``, ``eager``, ``torch``, ``pool``); the old key ``eviction``
      still works for one release and warns;
    * ``options``: per-slot constructor kwargs, e.g. ``{"store": {"k": 2}}``;
    * ``layout``: ``"auto"`` (default) or a kvkit layout name.
    * ``cpu_layout``: the CPU tier's layout (default: vLLM's), e.g.
      ``"cross-layer"`` for the ``staged`` copy backend.

    Raises:
        ConfigError: one error listing every problem (unknown keys, names
            that are not registered or not available here, a bad capacity, a
            write-back store policy, which needs the GPU pool's eviction
            order that vLLM does not expose).
    """
    extra = dict(extra or {})
    problems: list[str] = []
    try:
        rename_keywords(extra, _RENAMED_KEYS, where="kv_connector_extra_config")
    except ConfigError as exc:  # both keys, different values: one more problem to list
        problems += exc.problems
    for key in extra:
        if key not in EXTRA_KEYS:
            problems.append(f"kv_connector_extra_config[{key!r}]: unknown key; valid: "
                            f"{', '.join(EXTRA_KEYS)}{did_you_mean(str(key), list(EXTRA_KEYS))}")
    names = {slot: extra.get(slot, getattr(DEFAULTS, slot)) for slot in _NAMED_SLOTS}
    for slot, name in names.items():
        if not isinstance(name, str):
            problems.append(
                f"kv_connector_extra_config[{slot!r}]={name!r}: must be a registered name (the "
                f"config crosses process boundaries); register your class in kvkit.registry")
    layout = extra.get("layout", "auto")
    if layout != "auto" and layout not in LAYOUTS:
        problems.append(f"kv_connector_extra_config['layout']={layout!r}: valid: auto, "
                        f"{', '.join(LAYOUTS)}{did_you_mean(str(layout), list(LAYOUTS))}")
    stack = None
    try:
        stack = StackConfig(
            kv=kv, gpu_blocks=gpu_blocks, cpu_bytes=extra.get("cpu_bytes"),
            cpu_blocks=extra.get("cpu_blocks"), cpu_layout=extra.get("cpu_layout"), world_size=world_size,
            device=device,
            options=extra.get("options", {}),
            **{slot: name if isinstance(name, str) else getattr(DEFAULTS, slot) for slot, name in names.items()})
    except ConfigError as exc:
        problems += exc.problems
    if stack is not None and _writes_back(stack):
        problems.append(
            f"store={stack.store!r}: a write-back policy stores the GPU pool's next eviction "
            f"candidates, which vLLM's connector API does not expose; use eager, selective or never")
    if problems:
        raise ConfigError(problems)
    return ConnectorSettings(stack, layout)


def _writes_back(stack: StackConfig) -> bool:
    store = STORE.create(stack.store, slot="store", **dict(stack.options.get("store", {})))
    return store.writeback_target(0, 1) > 0
