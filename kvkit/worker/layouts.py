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
``"latent"``
    MLA's single latent vector per token (a :attr:`~kvkit.interfaces.KVCacheSpec.latent`
    spec, one KV head): per layer ``[num_blocks, block_size, head_dim]``, as vLLM's
    MLA backends keep it on CPU and CUDA. One region per layer, ``layer{i}``; a
    piece is one block of that layer. The only layout of a latent spec, and a
    latent spec's only layout.

The CPU mirror of a cache has its own block count and, by default, the GPU
tier's layout. It may use another one (``cpu_layout``): the regions then pair
the largest piece both layouts hold contiguously per block, so both tiers'
pieces still have equal shape and dtype. Per-layer holds a layer's K or V
half, blocks-first one layer's K and V, cross-layer the whole block, so

* per-layer with blocks-first or cross-layer pairs halves: ``layer{i}.k`` and
  ``layer{i}.v`` (the K half of block ``b`` is ``t[b, 0]`` in blocks-first,
  ``t[b, i, 0]`` in cross-layer: contiguous, but strided across blocks);
* blocks-first with cross-layer pairs layers: ``layer{i}``;
* ``"vllm-cpu"`` (pieces ``[H, block_size, 2*D]``) and ``"latent"`` pair only with themselves.

A cross-layer CPU tier lets a copy backend move each CPU block as one
``bytes_per_block`` piece (e.g. staged through GPU memory) while the engine
keeps its per-layer cache.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch

from kvkit.errors import ConfigError, InsufficientMemoryError, SpecMismatchError
from kvkit.interfaces.copy import Region
from kvkit.interfaces.types import KVCacheSpec
from kvkit.validate import check_int, plural, quote
from kvkit.worker.memory import check_fits

__all__ = [
    "LAYOUTS",
    "allocate_kv",
    "check_layouts",
    "kv_device",
    "kv_nbytes",
    "kv_shape",
    "kv_views",
    "layouts_for",
    "regions_for",
    "torch_dtype",
    "validate_kv",
]

LAYOUTS: tuple[str, ...] = ("per-layer", "blocks-first", "cross-layer", "vllm-cpu", "latent")
"""Every layout name kvkit knows."""

_LATENT = "latent"

_DEVICE_TYPES = ("cpu", "cuda")
"""Where a KV cache may live (the GPU tier's stand-in on CPU, or a CUDA device)."""

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


def layouts_for(spec: KVCacheSpec) -> tuple[str, ...]:
    """The layouts that can hold ``spec``: ``"latent"`` alone for a latent (MLA) spec, every other one else."""
    return (_LATENT,) if spec.latent else tuple(layout for layout in LAYOUTS if layout != _LATENT)


def _check_layout(spec: KVCacheSpec, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ConfigError(f"unknown KV layout {layout!r}; valid: {list(LAYOUTS)}")
    if layout not in layouts_for(spec):
        what = ("a latent (MLA) cache has one vector per token, no K and V" if spec.latent
                else "layout 'latent' holds one MLA vector per token, this cache a K and a V (latent=False)")
        raise ConfigError(f"layout {layout!r} cannot hold this KV cache: {what}; valid: {list(layouts_for(spec))}")
    if layout == "cross-layer" and len(spec.groups) > 1:
        raise ConfigError(
            f"layout 'cross-layer' needs a single KV group (one piece spans every layer), "
            f"got {plural(len(spec.groups), 'group')}")


def _block_axis(layout: str) -> int:
    return 1 if layout == "per-layer" else 0


def kv_shape(spec: KVCacheSpec, layout: str, num_blocks: int) -> list[tuple[int, ...]]:
    """Shapes of the tensors holding a cache of ``num_blocks`` blocks in ``layout``.

    Raises:
        ConfigError: unknown layout, cross-layer with several KV groups, or a
            layout that cannot hold ``spec`` (see :func:`layouts_for`).
    """
    _check_layout(spec, layout)
    b, h, d = spec.block_size, spec.num_kv_heads, spec.head_dim
    if layout == "cross-layer":
        return [(num_blocks, spec.num_layers, 2, b, h, d)]
    per_layer = {
        "per-layer": (2, num_blocks, b, h, d),
        "blocks-first": (num_blocks, 2, b, h, d),
        "vllm-cpu": (num_blocks, h, b, 2 * d),
        _LATENT: (num_blocks, b, d),
    }[layout]
    return [per_layer] * spec.num_layers


def kv_nbytes(spec: KVCacheSpec, layout: str, num_blocks: int) -> int:
    """Bytes of every tensor of the cache together (exactly ``num_blocks * bytes_per_block``)."""
    kv_shape(spec, layout, num_blocks)
    return num_blocks * spec.bytes_per_block


def kv_device(device: str | int | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` a KV cache can live on: the host or an available CUDA device.

    Raises:
        ConfigError: not a device, another device type (``"meta"``, ``"mps"``...),
            or a CUDA device this machine does not have.
    """
    try:
        d = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ConfigError(f"device={quote(device)}: not a torch device ({exc})") from None
    if d.type not in _DEVICE_TYPES:
        raise ConfigError(f"device={quote(device)}: a KV cache lives on {' or '.join(_DEVICE_TYPES)}, not {d.type!r}")
    if d.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (d.index or 0) >= count:
            raise ConfigError(f"device={quote(device)}: this machine has {plural(count, 'CUDA device')}")
    return d


def allocate_kv(spec: KVCacheSpec, layout: str, num_blocks: int,
                device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Fresh, uninitialised cache tensors of ``num_blocks`` blocks on ``device``.

    Raises:
        ConfigError: ``num_blocks`` not an int >= 1, a bad ``device`` (see
            :func:`kv_device`) or ``layout`` (see :func:`kv_shape`).
        InsufficientMemoryError: the cache does not fit the device's free memory
            (checked before allocating).
    """
    num_blocks = check_int("num_blocks", num_blocks, 1)
    device = kv_device(device)
    shapes = kv_shape(spec, layout, num_blocks)
    nbytes = num_blocks * spec.bytes_per_block
    check_fits(device, {f"KV cache of {plural(num_blocks, 'block')} ({layout})": nbytes})
    dtype = torch_dtype(spec)
    try:
        return [torch.empty(s, dtype=dtype, device=device) for s in shapes]
    except RuntimeError as exc:  # the allocator refused after all (fragmentation, overcommit limits)
        raise InsufficientMemoryError(
            f"cannot allocate a KV cache of {plural(num_blocks, 'block')} ({nbytes} bytes) on {device}: {exc}") from None  # noqa: E501


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


def validate_kv(spec: KVCacheSpec, layout: str, tensors: Sequence[torch.Tensor], *,
                min_blocks: int = 1) -> int:
    """Check ``tensors`` hold a cache in ``layout`` for ``spec``; return its block count.

    Invariants of a valid cache: a list or tuple of strided ``torch.Tensor`` s
    with memory (not meta), all on one CPU or CUDA device, each of the layout's
    shape for ``spec`` and its dtype, contiguous, holding at least
    ``min_blocks`` blocks, and no two overlapping in memory (a copy into one
    would change another).

    Raises:
        ConfigError: unknown layout (or cross-layer with several groups, or one that
            cannot hold ``spec``).
        SpecMismatchError: any of the above fails; the message quotes the
            values that disagree.
    """
    _check_layout(spec, layout)
    if not isinstance(tensors, (list, tuple)):
        hint = "; hint: wrap one tensor in a list" if isinstance(tensors, torch.Tensor) else ""
        raise SpecMismatchError(f"KV tensors must be a list of torch.Tensor, got {_what(tensors)}{hint}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise SpecMismatchError(f"tensor {i} must be a torch.Tensor, got {_what(t)}")
        if t.layout != torch.strided or t.device.type not in _DEVICE_TYPES:
            raise SpecMismatchError(f"tensor {i} holds no plain memory on {' or '.join(_DEVICE_TYPES)}: "
                                    f"layout {t.layout}, device {t.device}")
    expected_count = len(kv_shape(spec, layout, 1))
    if len(tensors) != expected_count:
        raise SpecMismatchError(
            f"layout {layout!r} needs {plural(expected_count, 'tensor')} for {plural(spec.num_layers, 'layer')}, "
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
    if num_blocks < max(min_blocks, 1):
        raise SpecMismatchError(f"cache holds {plural(num_blocks, 'block')} (shape {tuple(first.shape)}), needs at least "  # noqa: E501
                                f"{max(min_blocks, 1)}")
    _check_disjoint(tensors)
    return num_blocks


def _what(value: object) -> str:
    """A short quote of ``value``: an array by type, shape and dtype, not by its elements."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return f"{type(value).__name__} of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"{type(value).__name__} {quote(value)}"


def _check_disjoint(tensors: Sequence[torch.Tensor]) -> None:
    """Raise if two (contiguous) tensors share a byte of memory."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i) for i, t in enumerate(tensors))
    for (_, end, i), (start, _, j) in itertools.pairwise(spans):
        if start < end:
            a, b = sorted((i, j))
            raise SpecMismatchError(f"tensors {a} and {b} overlap in memory (at {start:#x}); each layer "
                                    f"needs its own memory")


# How much of a block one contiguous piece of a layout holds, finest first.
_HALF, _LAYER, _BLOCK = 0, 1, 2
_PIECE = {"per-layer": _HALF, "blocks-first": _LAYER, "vllm-cpu": _LAYER, _LATENT: _LAYER, "cross-layer": _BLOCK}


def _shared_piece(spec: KVCacheSpec, layout: str, cpu_layout: str) -> int:
    """The largest piece both tiers hold contiguously per block (``_HALF``, ``_LAYER`` or ``_BLOCK``).

    A latent spec has one layout (checked by ``_check_layout``), so ``"latent"`` pairs only with itself.
    """
    _check_layout(spec, layout)
    _check_layout(spec, cpu_layout)
    if layout != cpu_layout and "vllm-cpu" in (layout, cpu_layout):
        raise ConfigError(
            f"layout 'vllm-cpu' (pieces [H, block_size, 2*D]) pairs only with itself, got GPU layout "
            f"{layout!r} with CPU layout {cpu_layout!r}")
    return min(_PIECE[layout], _PIECE[cpu_layout])


def check_layouts(spec: KVCacheSpec, layout: str, cpu_layout: str | None = None) -> None:
    """Check a GPU tier in ``layout`` can pair with a CPU tier in ``cpu_layout`` (default: ``layout``).

    Raises:
        ConfigError: an unknown layout, cross-layer with several KV groups,
            ``"vllm-cpu"`` paired with another layout, or a layout that cannot
            hold ``spec`` (see :func:`layouts_for`).
    """
    _shared_piece(spec, layout, layout if cpu_layout is None else cpu_layout)


def _layer_piece(layout: str, tensors: Sequence[torch.Tensor], layer: int) -> torch.Tensor:
    """``[num_blocks, ...]`` view of one layer's K and V, or its latent.

    For the blocks-first, cross-layer, vllm-cpu and latent layouts.
    """
    return tensors[0][:, layer] if layout == "cross-layer" else tensors[layer]


def _half_piece(layout: str, tensors: Sequence[torch.Tensor], layer: int, half: int) -> torch.Tensor:
    """``[num_blocks, block_size, H, D]`` view of one layer's K (``half`` 0) or V (1)."""
    if layout == "per-layer":
        return tensors[layer][half]
    return _layer_piece(layout, tensors, layer)[:, half]


def regions_for(spec: KVCacheSpec, layout: str, gpu_tensors: Sequence[torch.Tensor],
                cpu_tensors: Sequence[torch.Tensor], *, cpu_layout: str | None = None) -> list[Region]:
    """The copy regions pairing GPU ``layout`` with CPU ``cpu_layout``, grouped by ``spec.groups``.

    ``cpu_layout=None`` means ``layout``. Each region pairs the largest piece
    both layouts hold contiguously per block (see the module docstring), in
    layer order, K before V.

    Both lists must be valid caches (checked with :func:`validate_kv`); their
    block counts may differ.

    Raises:
        ConfigError: as :func:`check_layouts`.
        SpecMismatchError: as :func:`validate_kv`.
    """
    cpu_layout = layout if cpu_layout is None else cpu_layout
    piece = _shared_piece(spec, layout, cpu_layout)
    validate_kv(spec, layout, gpu_tensors)
    validate_kv(spec, cpu_layout, cpu_tensors)
    if piece == _BLOCK:
        return [Region("kv", gpu_tensors[0], cpu_tensors[0], group=0)]
    group_of = {layer: g for g, group in enumerate(spec.groups) for layer in group.layers}
    regions = []
    for i in range(spec.num_layers):
        if piece == _LAYER:
            regions.append(Region(f"layer{i}", _layer_piece(layout, gpu_tensors, i),
                                  _layer_piece(cpu_layout, cpu_tensors, i), group=group_of[i]))
        else:
            regions += [Region(f"layer{i}.{name}", _half_piece(layout, gpu_tensors, i, half),
                               _half_piece(cpu_layout, cpu_tensors, i, half), group=group_of[i])
                        for half, name in enumerate("kv")]
    return regions
