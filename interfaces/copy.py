"""The ``CopyBackend`` protocol: asynchronous block copies between registered regions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

from kvkit.errors import SpecMismatchError
from kvkit.interfaces.types import Tier, TransferPlan

if TYPE_CHECKING:
    import torch

__all__ = ["CopyBackend", "Region"]


@attrs.frozen(eq=False)
class Region:
    """A pair of block arrays, one per tier, that copies move whole pieces between.

    ``gpu[i]`` and ``cpu[j]`` are one block's piece in this region: for a
    per-layer layout, the K (or V) half of one layer; for blocks-first, one
    layer's K and V; for cross-layer, the whole block. The first dimension
    indexes blocks; each piece must be contiguous, and both tiers' pieces have
    the same size and dtype. ``gpu`` may live on the CPU (CI's stand-in).

    Attributes:
        name: unique within a backend (e.g. ``"layer3.k"``).
        gpu: the GPU tier's tensor ``[num_gpu_blocks, ...]``.
        cpu: the CPU tier's tensor ``[num_cpu_blocks, ...]``.
        group: the KV group whose plans copy this region.
    """

    name: str
    gpu: torch.Tensor
    cpu: torch.Tensor
    group: int = 0

    def __attrs_post_init__(self) -> None:
        for tier, t in ((Tier.GPU, self.gpu), (Tier.CPU, self.cpu)):
            if t.dim() < 1 or t.shape[0] == 0:
                raise SpecMismatchError(f"region {self.name!r}: {tier} tensor has no blocks: shape {tuple(t.shape)}")
            if not t[0].is_contiguous():
                raise SpecMismatchError(f"region {self.name!r}: {tier} block piece is not contiguous (strides {t.stride()})")
        if self.gpu.dtype != self.cpu.dtype or self.gpu.shape[1:] != self.cpu.shape[1:]:
            raise SpecMismatchError(
                f"region {self.name!r}: pieces differ: gpu {self.gpu.dtype} {tuple(self.gpu.shape[1:])} "
                f"vs cpu {self.cpu.dtype} {tuple(self.cpu.shape[1:])}")

    @property
    def piece_bytes(self) -> int:
        """Bytes of one block's piece."""
        return self.gpu[0].numel() * self.gpu.element_size()

    def stride_bytes(self, tier: Tier) -> int:
        """Bytes between consecutive blocks of ``tier`` (a :class:`Tier` or its value)."""
        t = self.gpu if tier == Tier.GPU else self.cpu
        return t.stride(0) * t.element_size()


@runtime_checkable
class CopyBackend(Protocol):
    """Moves block pieces between the tiers of registered regions, asynchronously.

    Invariants:
        * :meth:`submit` validates the plan (ids in range for every region of
          the plan's group, equal lengths) and raises ``PlanError`` before
          anything is launched.
        * A store waits for ``after`` (the compute that wrote its source) before
          reading; nothing is ever issued on the legacy default stream.
        * Every submitted handle is reported by :meth:`poll` exactly once, in
          submission order; bytes at the destination equal the source's bytes
          at the time the copy ran.
    """

    @classmethod
    def is_available(cls) -> bool:
        """Whether this backend can run on this machine (libraries, device)."""
        ...

    def register(self, regions: Sequence[Region]) -> None:
        """Register the regions plans will copy; replaces any earlier registration."""
        ...

    def submit(self, plan: TransferPlan, *, after: Any = None) -> int:
        """Start copying every block of ``plan`` in every region of its group; returns a handle."""
        ...

    def poll(self) -> list[int]:
        """Handles completed since the last call, in submission order (non-blocking)."""
        ...

    def wait(self, handle: int) -> None:
        """Block until ``handle`` (and every handle before it) completed."""
        ...
