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

from kvkit.config import DEFAULTS, StackConfig, parse_bytes
from kvkit.errors import ConfigError
from kvkit.interfaces import GroupKind, KVCacheSpec, KVGroupSpec
from kvkit.registry import STORE, did_you_mean
from kvkit.worker.layouts import LAYOUTS

__all__ = ["EXTRA_KEYS", "ConnectorSettings", "kv_spec_from_vllm", "kvkit_window", "parse_extra_config",
           "shared_layout"]

EXTRA_KEYS: tuple[str, ...] = (
    "cpu_bytes", "cpu_blocks", "cpu_eviction", "store", "copy", "allocator", "planner", "options", "layout",
    "cpu_layout",
    "async_load", "layerwise", "shared", "shared_url", "shared_write", "shared_model",
    "cpu_bytes_to_use", "cpu_bytes_to_use_per_rank", "lazy_offload",
)
"""Keys ``kv_connector_extra_config`` may hold (see :func:`parse_extra_config`); the last three are
those of vLLM's ``SimpleCPUOffloadConnector``, with its meaning."""

_BYTE_KEYS = ("cpu_bytes", "cpu_bytes_to_use_per_rank", "cpu_bytes_to_use")
"""Keys that size the CPU tier in bytes: per worker (kvkit's), per rank, and in total over every rank."""

_NAMED_SLOTS = ("cpu_eviction", "store", "copy", "allocator", "planner")


@attrs.frozen
class ConnectorSettings:
    """Everything one connector side needs, validated.

    Attributes:
        stack: the offload stack's configuration (KV shape, CPU capacity,
            component names); ``stack.num_cpu_blocks`` sizes both the
            scheduler's CPU pool and every worker's CPU mirror.
        layout: ``"auto"`` (detected from vLLM's KV tensors) or a name in
            :data:`kvkit.worker.layouts.LAYOUTS`.
        async_load: a CPU hit is loaded while other requests run (vLLM's
            asynchronous-load path), not before the forward pass that reads it.
        layerwise: loads and stores run layer by layer: a layer's forward waits
            (on the device) only for its own blocks, a layer's stores start once
            its KV is written.
        num_cpu_blocks: ``stack.num_cpu_blocks``, computed once.
        shared_layout: with a shared tier, the CPU payload layout its
            namespace names (:func:`shared_layout`); ``None`` without one.
    """

    stack: StackConfig
    layout: str = "auto"
    async_load: bool = False
    layerwise: bool = True
    num_cpu_blocks: int = attrs.field(
        init=False, default=attrs.Factory(lambda self: self.stack.num_cpu_blocks, takes_self=True))
    """Blocks of the CPU tier (the one figure both sides must agree on)."""
    shared_layout: str | None = attrs.field(
        init=False, default=attrs.Factory(lambda self: shared_layout(self.stack, self.layout), takes_self=True))


def shared_layout(stack: StackConfig, layout: str) -> str | None:
    """The CPU payload layout the shared tier's namespace names, from what the scheduler knows too.

    The namespace must be the same on the scheduler (which derives keys for
    ``contains``) and on every worker, but vLLM's KV layout is detected on the
    worker. So it is a deterministic function of the settings both sides
    share: ``cpu_layout`` if given, else ``layout`` if not ``"auto"``, else
    the layout vLLM's default attention backend of that device and cache kind
    uses (``latent`` for MLA, ``vllm-cpu`` on CPU, FlashAttention's
    ``per-layer`` on CUDA). Each worker checks, once its KV is registered,
    that its CPU mirror is in this layout and refuses to start otherwise
    (:meth:`~kvkit.integrations._vllm_worker.WorkerSide.register`).
    """
    if stack.shared is None:
        return None
    if stack.cpu_layout is not None:
        return stack.cpu_layout
    if layout != "auto":
        return layout
    if stack.kv.latent:
        return "latent"
    return "vllm-cpu" if stack.device == "cpu" else "per-layer"


_KINDS = {"FullAttentionSpec": GroupKind.FULL, "SlidingWindowSpec": GroupKind.SLIDING_WINDOW,
          "MLAAttentionSpec": GroupKind.FULL}
"""vLLM KV cache spec classes (by exact name: other subclasses are refused) -> group kind."""

_LATENT = "MLAAttentionSpec"
"""The spec of MLA layers: one latent vector of ``head_size`` per token (``head_size_v=0``), no K and V."""


def kv_spec_from_vllm(kv_cache_config: Any) -> KVCacheSpec:
    """The :class:`KVCacheSpec` of a vLLM ``KVCacheConfig``: one kvkit KV group per vLLM group.

    Reads each of ``kv_cache_groups``: ``layer_names`` (kvkit numbers the layers
    group after group, as the worker registers them) and ``kv_cache_spec``
    (``block_size``, ``num_kv_heads``, ``head_size``, ``head_size_v``, ``dtype``,
    and a sliding window's ``sliding_window`` and ``extra_retained_tokens``).
    MLA layers (``MLAAttentionSpec``: full attention over one latent of
    ``head_size`` per token, ``head_size_v=0``) give a
    :attr:`~kvkit.interfaces.KVCacheSpec.latent` spec.
    A sliding-window group gets the kvkit window whose blocks are exactly
    those vLLM keeps for the next token (:func:`kvkit_window`), so a hit loads
    every block vLLM's attention reads and none it replaced by its null block.

    Raises:
        ConfigError: no groups; a group that is neither full attention, a
            sliding window nor MLA (Mamba, chunked local...), has K and V of
            different sizes (or an MLA latent with a V), or differs from the
            others in block size, heads, head size, dtype or cache kind (latent
            or K/V); a window vLLM keeps in one block.
    """
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        raise ConfigError(f"kvkit's vLLM connector needs at least one KV cache group, got none "
                          f"(kv_cache_config={type(kv_cache_config).__name__})")
    shapes, kv_groups, first = set(), [], 0
    for g, group in enumerate(groups):
        spec = group.kv_cache_spec
        name = type(spec).__name__
        head_size = getattr(spec, "head_size", None)
        latent = name == _LATENT
        if name not in _KINDS or getattr(spec, "head_size_v", head_size) != (0 if latent else head_size):
            raise ConfigError(
                f"kvkit's vLLM connector serves full-attention and sliding-window layers with K and V of "
                f"equal size, and MLA layers of one latent (head_size_v=0); KV cache group {g} is "
                f"{name}(head_size={head_size!r}, head_size_v={getattr(spec, 'head_size_v', None)!r})")
        shapes.add((spec.block_size, spec.num_kv_heads, head_size, str(spec.dtype).removeprefix("torch."),
                    latent))
        layers = range(first, first + len(group.layer_names))
        first += len(layers)
        if _KINDS[name] is GroupKind.FULL:
            kv_groups.append(KVGroupSpec(layers))
        else:
            window = kvkit_window(spec.sliding_window + getattr(spec, "extra_retained_tokens", 0),
                                  spec.block_size)
            kv_groups.append(KVGroupSpec(layers, GroupKind.SLIDING_WINDOW, window))
    if len(shapes) != 1:
        raise ConfigError(f"kvkit's vLLM connector needs one block size, KV head count, head size, dtype and "
                          f"cache kind (MLA latent or K/V) across KV cache groups, got {sorted(shapes)!r}")
    ((block_size, num_kv_heads, head_dim, dtype, latent),) = shapes
    return KVCacheSpec(num_layers=first, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       dtype=dtype, groups=kv_groups, latent=latent)


def kvkit_window(vllm_window: int, block_size: int) -> int:
    """The kvkit window whose :meth:`~kvkit.interfaces.KVGroupSpec.blocks_needed` is what vLLM keeps.

    vLLM keeps, before a block-aligned position ``T``, the blocks holding
    tokens ``[T - vllm_window + 1, T)`` (those the token at ``T`` attends to):
    ``ceil((vllm_window - 1) / block_size)`` blocks. kvkit's window ``w``
    needs ``ceil(w / block_size) + 1``, so ``w`` is one block less.

    Raises:
        ConfigError: vLLM keeps a single block (``vllm_window <= block_size + 1``):
            no kvkit window loads that few.
    """
    kept = -(-(vllm_window - 1) // block_size)
    if kept < 2:
        raise ConfigError(f"sliding_window={vllm_window!r} with block_size={block_size!r}: vLLM keeps one "
                          f"block per window, kvkit loads at least two; use a window above "
                          f"{block_size + 1} tokens or a smaller block size")
    return (kept - 1) * block_size


def parse_extra_config(extra: Mapping[str, Any] | None, *, kv: KVCacheSpec, gpu_blocks: int,
                       world_size: int, device: str, model: str | None = None) -> ConnectorSettings:
    """Validate ``kv_connector_extra_config`` and turn it into settings.

    Keys (all but the capacity optional):

    * the CPU tier's size: ``cpu_bytes`` (``"8GiB"`` or an int; per worker)
      or ``cpu_blocks``, or the keys of vLLM's ``SimpleCPUOffloadConnector``:
      ``cpu_bytes_to_use`` (the total, divided by ``world_size``) and
      ``cpu_bytes_to_use_per_rank``; byte keys given together must agree per
      worker, and ``cpu_blocks`` goes alone;
    * ``cpu_eviction``, ``store``, ``copy``, ``allocator``: registered names,
      as ``kvkit list`` shows them (defaults: :data:`kvkit.config.DEFAULTS`:
      ``lru``, ``eager``, ``torch``, ``pool``); the old key ``eviction``
      still works for one release and warns;
    * ``lazy_offload`` (the seed's, a bool): ``True`` is ``store="lazy"``,
      ``False`` any other store policy; a ``store`` that contradicts it is refused;
    * ``async_load`` (a bool, default ``False``): load CPU hits while other
      requests run, through vLLM's asynchronous-load path;
    * ``layerwise`` (a bool, default ``True``): per-layer loads and stores
      (``wait_for_layer_load`` waits for one layer, ``save_kv_layer`` lets that
      layer's stores start); ``False`` loads everything before the forward pass;
    * ``options``: per-slot constructor kwargs, e.g. ``{"store": {"k": 2}}``;
    * ``layout``: ``"auto"`` (default) or a kvkit layout name.
    * ``cpu_layout``: the CPU tier's layout (default: vLLM's), e.g.
      ``"cross-layer"`` for the ``staged`` copy backend.
    * ``shared`` (or ``shared_url``), ``shared_write``, ``shared_model``: the
      shared tier, as :class:`~kvkit.StackConfig` takes them (a URL string);
      ``shared_model`` defaults to ``model`` (vLLM's model and revision).

    Raises:
        ConfigError: one error listing every problem (unknown keys, names
            that are not registered or not available here, a bad capacity, a
            write-back store policy with several KV groups: it writes back
            single GPU blocks; capacity keys or ``lazy_offload`` and ``store``
            that contradict each other).
    """
    extra = dict(extra or {})
    problems: list[str] = []
    for key in extra:
        if key not in EXTRA_KEYS:
            problems.append(f"kv_connector_extra_config[{key!r}]: unknown key; valid: "
                            f"{', '.join(EXTRA_KEYS)}{did_you_mean(str(key), list(EXTRA_KEYS))}")
    names = {slot: extra.get(slot, getattr(DEFAULTS, slot)) for slot in _NAMED_SLOTS}
    lazy = extra.get("lazy_offload")
    if lazy is not None and not isinstance(lazy, bool):
        problems.append(f"kv_connector_extra_config['lazy_offload']={lazy!r}: must be true or false")
    elif lazy is not None and "store" in extra and (extra["store"] == "lazy") != lazy:
        problems.append(f"kv_connector_extra_config: lazy_offload={lazy!r} contradicts store={extra['store']!r}; "
                        f"give one of them")
    elif lazy:
        names["store"] = "lazy"
    capacity, wrong = _capacity(extra, world_size)
    problems += wrong
    async_load, layerwise = extra.get("async_load", False), extra.get("layerwise", True)
    for key, value in (("async_load", async_load), ("layerwise", layerwise)):
        if not isinstance(value, bool):
            problems.append(f"kv_connector_extra_config[{key!r}]={value!r}: must be true or false")
    for slot, name in names.items():
        if not isinstance(name, str):
            problems.append(
                f"kv_connector_extra_config[{slot!r}]={name!r}: must be a registered name (the "
                f"config crosses process boundaries); register your class in kvkit.registry")
    layout = extra.get("layout", "auto")
    if layout != "auto" and layout not in LAYOUTS:
        problems.append(f"kv_connector_extra_config['layout']={layout!r}: valid: auto, "
                        f"{', '.join(LAYOUTS)}{did_you_mean(str(layout), list(LAYOUTS))}")
    shared = {key: extra[key] for key in ("shared_write", "shared_model") if key in extra}
    if "shared" in extra and "shared_url" in extra and extra["shared"] != extra["shared_url"]:
        problems.append(f"kv_connector_extra_config: shared={extra['shared']!r} and shared_url="
                        f"{extra['shared_url']!r} disagree; give one")
    url = extra.get("shared", extra.get("shared_url"))
    if url is not None:
        shared["shared"] = url
        if not isinstance(url, str):
            problems.append(f"kv_connector_extra_config['shared']={url!r}: must be a URL string (the config "
                            f"crosses process boundaries)")
        if model is not None:
            shared.setdefault("shared_model", model)
    stack = None
    try:
        stack = StackConfig(
            kv=kv, gpu_blocks=gpu_blocks, **capacity, cpu_layout=extra.get("cpu_layout"), world_size=world_size,
            device=device,
            options=extra.get("options", {}), **shared,
            **{slot: name if isinstance(name, str) else getattr(DEFAULTS, slot) for slot, name in names.items()})
    except ConfigError as exc:
        problems += exc.problems
    if stack is not None and len(kv.groups) > 1 and _writes_back(stack):
        problems.append(
            f"store={stack.store!r}: a write-back policy stores single GPU blocks, and this model has "
            f"{len(kv.groups)} KV cache groups; use eager, selective or never")
    if problems:
        raise ConfigError(problems)
    return ConnectorSettings(stack, layout, async_load, layerwise)


def _capacity(extra: Mapping[str, Any], world_size: int) -> tuple[dict[str, Any], list[str]]:
    """``StackConfig``'s ``cpu_bytes``/``cpu_blocks`` from kvkit's or the seed's keys, and their contradictions.

    With a contradiction the capacity is a one-block stand-in, so every other
    key is still checked (and the config is refused anyway).
    """
    given = {key: extra[key] for key in _BYTE_KEYS if extra.get(key) is not None}
    blocks = extra.get("cpu_blocks")
    if set(given) <= {"cpu_bytes"}:  # kvkit's own keys: StackConfig checks them
        return {"cpu_bytes": given.get("cpu_bytes"), "cpu_blocks": blocks}, []
    if blocks is not None:
        return {"cpu_blocks": 1}, [f"kv_connector_extra_config: cpu_blocks={blocks!r} and "
                                   f"{', '.join(f'{k}={v!r}' for k, v in given.items())} all size the CPU "
                                   f"tier; give cpu_blocks or bytes"]
    per_worker, problems = {}, []
    for key, value in given.items():
        try:
            num_bytes = parse_bytes(value)
        except ConfigError as exc:
            problems.append(f"kv_connector_extra_config[{key!r}]={value!r}: {exc}")
            continue
        per_worker[key] = num_bytes // world_size if key == "cpu_bytes_to_use" else num_bytes
    if len(set(per_worker.values())) > 1:
        problems.append(
            "kv_connector_extra_config: " + ", ".join(f"{k}={given[k]!r} ({n} bytes per worker)"
                                                      for k, n in per_worker.items())
            + f" disagree (cpu_bytes_to_use is the total over {world_size} workers); give one of them")
    if problems:
        return {"cpu_blocks": 1}, problems
    return {"cpu_bytes": next(iter(per_worker.values()))}, []


def _writes_back(stack: StackConfig) -> bool:
    store = STORE.create(stack.store, slot="store", **dict(stack.options.get("store", {})))
    return store.writeback_target(0, 1) > 0
