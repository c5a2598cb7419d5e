"""Hypothesis strategies and a naive reference for testing KV layouts and copy backends.

Small caches (a few layers, blocks of a few tokens) keep examples cheap; the
reference copies one block of one region at a time, the obviously correct way
a backend's vectorised copy is checked against.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch
from hypothesis import strategies as st

from kvkit.errors import ConfigError
from kvkit.interfaces.copy import Region
from kvkit.interfaces.types import Direction, KVCacheSpec, KVGroupSpec, TransferPlan
from kvkit.worker.layouts import LAYOUTS, check_layouts

__all__ = ["BAD_PLANS", "TWO_GROUPS", "fill_random", "kv_specs", "pairable_layouts", "plans", "reference_copy",
           "spec_layouts", "tensor_bytes"]

TWO_GROUPS = KVCacheSpec(num_layers=2, block_size=2, num_kv_heads=1, head_dim=4, dtype="float16",
                         groups=[KVGroupSpec([0]), KVGroupSpec([1])])
"""A two-group spec for plan validation: :data:`BAD_PLANS` assume 4 GPU and 3 CPU blocks."""

BAD_PLANS = [
    (TransferPlan([0, 4, 9], [0, 1, 2], "store"), r"GPU block ids out of range \[0, 4\) in group 0: \[4, 9\]"),
    (TransferPlan([0, 1], [3, 7], "store"), r"CPU block ids out of range \[0, 3\) in group 0: \[3, 7\]"),
    (TransferPlan([5, 0], [0, 1], "load"), r"CPU block ids out of range \[0, 3\) in group 0: \[5\]"),
    (TransferPlan([0, 1], [1, 8], "load"), r"GPU block ids out of range \[0, 4\) in group 0: \[8\]"),
    (TransferPlan([0, 1], [2, 2], "store"), r"destination ids repeat .*: \[2\]"),
    (TransferPlan([0], [0], "store", group=2), r"no region registered for group 2; registered groups: \[0, 1\]"),
]
"""Plans every copy backend must reject with a ``PlanError`` matching the pattern, before launching."""

_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "int8", "uint8")


def pairable_layouts(spec: KVCacheSpec) -> list[tuple[str, str]]:
    """Every ``(GPU layout, CPU layout)`` pair that can hold ``spec``, as :func:`check_layouts` decides."""
    pairs = []
    for gpu in LAYOUTS:
        for cpu in LAYOUTS:
            try:
                check_layouts(spec, gpu, cpu)
            except ConfigError:
                continue
            pairs.append((gpu, cpu))
    return pairs


@st.composite
def kv_specs(draw: st.DrawFn, max_layers: int = 3, max_groups: int = 3) -> KVCacheSpec:
    """Small specs of any dtype whose layers are split at random into one to ``max_groups`` groups."""
    num_layers = draw(st.integers(1, max_layers))
    group_of = draw(st.lists(st.integers(0, max_groups - 1), min_size=num_layers, max_size=num_layers))
    groups = [KVGroupSpec([i for i in range(num_layers) if group_of[i] == g])
              for g in sorted(set(group_of))]
    return KVCacheSpec(num_layers=num_layers, block_size=draw(st.integers(1, 4)),
                       num_kv_heads=draw(st.integers(1, 2)), head_dim=draw(st.integers(1, 4)),
                       dtype=draw(st.sampled_from(_DTYPES)), groups=groups)


@st.composite
def spec_layouts(draw: st.DrawFn) -> tuple[KVCacheSpec, str]:
    """A spec with a layout that can hold it (cross-layer only for single-group specs; some latent, MLA's)."""
    spec = draw(kv_specs())
    if draw(st.booleans()):
        spec = attrs.evolve(spec, num_kv_heads=1, latent=True)
    return spec, draw(st.sampled_from([gpu for gpu, cpu in pairable_layouts(spec) if gpu == cpu]))


def _ids(draw: st.DrawFn, n: int, limit: int, *, unique: bool) -> np.ndarray:
    """``n`` ids below ``limit``: a run of consecutive ids, or scattered (distinct if ``unique``)."""
    if draw(st.booleans()):
        start = draw(st.integers(0, limit - n))
        return np.arange(start, start + n)
    if unique:
        return np.array(draw(st.permutations(range(limit)))[:n], dtype=np.int64)
    return np.array(draw(st.lists(st.integers(0, limit - 1), min_size=n, max_size=n)), dtype=np.int64)


@st.composite
def plans(draw: st.DrawFn, num_groups: int, num_gpu_blocks: int, num_cpu_blocks: int) -> TransferPlan:
    """Valid plans: ids in range, distinct destinations, sources may repeat."""
    direction = draw(st.sampled_from(Direction))
    src_limit, dst_limit = ((num_gpu_blocks, num_cpu_blocks) if direction is Direction.STORE
                            else (num_cpu_blocks, num_gpu_blocks))
    n = draw(st.integers(0, min(src_limit, dst_limit)))
    return TransferPlan(_ids(draw, n, src_limit, unique=False), _ids(draw, n, dst_limit, unique=True),
                        direction, group=draw(st.integers(0, num_groups - 1)))


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s bytes as a flat uint8 tensor on the host (exact comparison, NaNs included).

    Always a copy, never a view of ``t``: a snapshot taken before a copy must not change with it.
    """
    return t.detach().contiguous().view(torch.uint8).flatten().to("cpu", copy=True)


def fill_random(tensors: Sequence[torch.Tensor], seed: int) -> None:
    """Overwrite every tensor with reproducible random bytes."""
    gen = torch.Generator().manual_seed(seed)
    for t in tensors:
        noise = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=gen)
        t.view(torch.uint8).view(-1).copy_(noise.to(t.device))


def reference_copy(regions: Sequence[Region], plan: TransferPlan) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What each destination tensor of ``plan``'s group must hold afterwards, block by block.

    Returns ``(destination, expected)`` pairs; call it before the copy runs.
    """
    expected = []
    for r in regions:
        if r.group != plan.group:
            continue
        src, dst = (r.gpu, r.cpu) if plan.direction is Direction.STORE else (r.cpu, r.gpu)
        want = dst.clone()
        for s, d in zip(plan.src.tolist(), plan.dst.tolist(), strict=True):
            want[d] = src[s]
        expected.append((dst, want))
    return expected
