"""KV cache tensor layouts: shapes, allocation, validation and copy regions.

A layout fixes how an engine's paged KV cache sits in tensors, and so which
:class:`~kvkit.interfaces.Region` pieces a copy backend moves per block:

``"per-layer"``
    One tensor per layer ``[2, num_blocks, block_size, H, D]`` (K then V).
    Two regions per layer, ``layer{i}.k`` and ``layer{i}.v``; a piece is one
    block's K (or V) of one layer: ``spec.bytes_per_layer_block`` bytes.
``"blocks-first"``
    One tensor per layer ``[num_blocks, 2, block_size, H, D]``. One region per
    layer, ``layer{i}``; a piece is K and V of that layer.
``"cross-layer"``
    One tensor ``[num_blocks, num_layers, 2, block_size, H, D]``. One region,
    ``kv``; a piece is the whole block (``spec.bytes_per_block``). Needs a
    single KV group, since one piece spans every layer.
``"vllm-cpu"``
    vLLM's CPU attention backend: per layer ``[num_blocks, H, block_size, 2*D]``
    (each token row holds the head's K then its V). One region per layer,
    ``layer{i}``; a piece is one block of that layer.

The CPU mirror of a cache uses the same layout with its own block count, so
both tiers' pieces have equal size and dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvkit.errors import ConfigError, SpecMismatchError
from kvkit.interfaces.copy import Region
from kvkit.interfaces.types import KVCacheSpec

__all__ = [
    "LAYOUTS",
    "allocate_kv",
    "kv_nbytes",
    "kv_shape",
    "kv_views",
    "regions_for",
    "torch_dtype",
    "validate_kv",
]

LAYOUTS: tuple[str, ...] = ("per-layer", "blocks-first", "cross-layer", "vllm-cpu")
"""Every layout name kvkit knows."""

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


def torch_dtype(spec: KVCacheSpec) -> torch.dtype:
    """The torch dtype of ``spec.dtype`` (the one place names map to torch)."""
    return _TORCH_DTYPES[spec.dtype]


def _check_layout(spec: KVCacheSpec, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ConfigError(f"unknown KV layout {layout!r}; valid: {list(LAYOUTS)}")
    if layout == "cross-layer" and len(spec.groups) > 1:
        raise ConfigError(
            f"layout 'cross-layer' needs a single KV group (one piece spans every layer), "
            f"got {len(spec.groups)} groups")


def _block_axis(layout: str) -> int:
    return 1 if layout == "per-layer" else 0


def kv_shape(spec: KVCacheSpec, layout: str, num_blocks: int) -> list[tuple[int, ...]]:
    """Shapes of the tensors holding a cache of ``num_blocks`` blocks in ``layout``.

    Raises:
        ConfigError: unknown layout, or cross-layer with several KV groups.
    """
    _check_layout(spec, layout)
    b, h, d = spec.block_size, spec.num_kv_heads, spec.head_dim
    if layout == "cross-layer":
        return [(num_blocks, spec.num_layers, 2, b, h, d)]
    per_layer = {
        "per-layer": (2, num_blocks, b, h, d),
        "blocks-first": (num_blocks, 2, b, h, d),
        "vllm-cpu": (num_blocks, h, b, 2 * d),
    }[layout]
    return [per_layer] * spec.num_layers


def kv_nbytes(spec: KVCacheSpec, layout: str, num_blocks: int) -> int:
    """Bytes of every tensor of the cache together (exactly ``num_blocks * bytes_per_block``)."""
    kv_shape(spec, layout, num_blocks)
    return num_blocks * spec.bytes_per_block


def allocate_kv(spec: KVCacheSpec, layout: str, num_blocks: int,
                device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Fresh, uninitialised cache tensors of ``num_blocks`` blocks on ``device``."""
    dtype = torch_dtype(spec)
    return [torch.empty(s, dtype=dtype, device=device) for s in kv_shape(spec, layout, num_blocks)]


def kv_views(spec: KVCacheSpec, layout: str, num_blocks: int,
             buffer: torch.Tensor) -> list[torch.Tensor]:
    """Cache tensors carved, back to back, out of a flat ``uint8`` ``buffer``.

    Raises:
        SpecMismatchError: ``buffer`` is not a flat contiguous uint8 tensor of
            exactly :func:`kv_nbytes` bytes.
    """
    need = kv_nbytes(spec, layout, num_blocks)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous() \
            or buffer.numel() != need:
        raise SpecMismatchError(
            f"buffer must be a flat contiguous uint8 tensor of {need} bytes, got "
            f"{buffer.dtype} shape {tuple(buffer.shape)} strides {buffer.stride()}")
    dtype = torch_dtype(spec)
    views, offset = [], 0
    for shape in kv_shape(spec, layout, num_blocks):
        n = math.prod(shape) * spec.dtype_bytes
        views.append(buffer[offset:offset + n].view(dtype).view(shape))
        offset += n
    assert offset == need, (offset, need)
    return views


def validate_kv(spec: KVCacheSpec, layout: str, tensors: Sequence[torch.Tensor]) -> int:
    """Check ``tensors`` hold a cache in ``layout`` for ``spec``; return its block count.

    Raises:
        ConfigError: unknown layout (or cross-layer with several groups).
        SpecMismatchError: wrong number of tensors, or a tensor with the wrong
            shape or dtype, on another device than the first, or not
            contiguous; the message quotes the values that disagree.
    """
    tensors = list(tensors)
    expected_count = len(kv_shape(spec, layout, 1))
    if len(tensors) != expected_count:
        raise SpecMismatchError(
            f"layout {layout!r} needs {expected_count} tensor(s) for {spec.num_layers} layers, "
            f"got {len(tensors)}")
    axis = _block_axis(layout)
    first = tensors[0]
    if first.dim() <= axis:
        raise SpecMismatchError(f"tensor 0 has shape {tuple(first.shape)}, too few dims for {layout!r}")
    num_blocks = first.shape[axis]
    shape = kv_shape(spec, layout, num_blocks)[0]
    dtype = torch_dtype(spec)
    for i, t in enumerate(tensors):
        if tuple(t.shape) != shape:
            raise SpecMismatchError(f"tensor {i} has shape {tuple(t.shape)}, layout {layout!r} expects {shape}")
        if t.dtype != dtype:
            raise SpecMismatchError(f"tensor {i} has dtype {t.dtype}, spec says {spec.dtype!r} ({dtype})")
        if t.device != first.device:
            raise SpecMismatchError(f"tensor {i} is on {t.device}, tensor 0 on {first.device}")
        if not t.is_contiguous():
            raise SpecMismatchError(f"tensor {i} is not contiguous: shape {tuple(t.shape)} strides {t.stride()}")
    if num_blocks == 0:
        raise SpecMismatchError(f"cache has no blocks: shape {tuple(first.shape)}")
    return num_blocks


def regions_for(spec: KVCacheSpec, layout: str, gpu_tensors: Sequence[torch.Tensor],
                cpu_tensors: Sequence[torch.Tensor]) -> list[Region]:
    """The copy regions pairing each tier's tensors in ``layout``, grouped by ``spec.groups``.

    Both lists must be valid caches (checked with :func:`validate_kv`); their
    block counts may differ.
    """
    validate_kv(spec, layout, gpu_tensors)
    validate_kv(spec, layout, cpu_tensors)
    if layout == "cross-layer":
        return [Region("kv", gpu_tensors[0], cpu_tensors[0], group=0)]
    group_of = {layer: g for g, group in enumerate(spec.groups) for layer in group.layers}
    regions = []
    for i, (g, c) in enumerate(zip(gpu_tensors, cpu_tensors, strict=True)):
        if layout == "per-layer":
            regions.append(Region(f"layer{i}.k", g[0], c[0], group=group_of[i]))
            regions.append(Region(f"layer{i}.v", g[1], c[1], group=group_of[i]))
        else:
            regions.append(Region(f"layer{i}", g, c, group=group_of[i]))
    return regions
