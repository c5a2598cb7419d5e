"""The ``CopyBackend`` protocol: asynchronous block copies between registered regions."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

from kvkit.errors import ConfigError, SpecMismatchError
from kvkit.interfaces.types import Tier, TransferPlan
from kvkit.validate import check_int, checked, plural, quote

if TYPE_CHECKING:
    import torch

__all__ = ["CopyBackend", "Region"]


def _name(value: object) -> str:
    """``Region.name``: a non-empty ``str`` (backends key descriptors by it)."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"Region.name={quote(value)}: must be a non-empty str")
    return str(value)


@attrs.frozen(eq=False)
class Region:
    """A pair of block arrays, one per tier, that copies move whole pieces between.

    ``gpu[i]`` and ``cpu[j]`` are one block's piece in this region: for a
    per-layer layout, the K (or V) half of one layer; for blocks-first, one
    layer's K and V; for cross-layer, the whole block. The first dimension
    indexes blocks; each piece must be contiguous, and both tiers' pieces have
    the same size and dtype. ``gpu`` may live on the CPU (CI's stand-in).

    Attributes:
        name: unique within a backend (e.g. ``"layer3.k"``); a non-empty ``str``.
        gpu: the GPU tier's tensor ``[num_gpu_blocks, ...]``.
        cpu: the CPU tier's tensor ``[num_cpu_blocks, ...]``.
        group: the KV group whose plans copy this region (an int >= 0).

    Invariants: both tensors are strided ``torch.Tensor`` objects with memory
    and at least one block of a non-empty contiguous piece, and no two blocks
    of one tensor overlap (a copy into one would overwrite another). A bad
    ``name`` or ``group`` raises ``ConfigError``, a bad tensor
    ``SpecMismatchError``, quoting the value.
    """

    name: str = attrs.field(converter=_name)
    gpu: torch.Tensor
    cpu: torch.Tensor
    group: int = attrs.field(default=0, converter=checked(check_int, minimum=0, label="Region."))  # type: ignore[misc]

    def __attrs_post_init__(self) -> None:
        # A caller with tensors has loaded torch; importing it here would load it for kvkit.
        torch = sys.modules.get("torch")
        for tier, t in ((Tier.GPU, self.gpu), (Tier.CPU, self.cpu)):
            if torch is None or not isinstance(t, torch.Tensor):
                raise SpecMismatchError(f"region {self.name!r}: {tier} must be a torch.Tensor, got {quote(t)}")
            if t.layout != torch.strided or t.device.type == "meta":
                raise SpecMismatchError(f"region {self.name!r}: {tier} tensor has no plain memory "
                                        f"(layout {t.layout}, device {t.device})")
            if t.dim() < 1 or t.shape[0] == 0 or t[0].numel() == 0:
                raise SpecMismatchError(f"region {self.name!r}: {tier} tensor has no blocks: shape {tuple(t.shape)}")
            if not t[0].is_contiguous():
                raise SpecMismatchError(f"region {self.name!r}: {tier} block piece is not contiguous "
                                        f"(strides {t.stride()})")
            if t.shape[0] > 1 and t.stride(0) < t[0].numel():
                raise SpecMismatchError(f"region {self.name!r}: {tier} blocks overlap: block stride {plural(t.stride(0), 'element')} "  # noqa: E501
                                        f"< piece of {t[0].numel()}")
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
        * A handle is reported only once nothing of its copy still runs: after
          the report no byte of either tier is written for it (the caller then
          frees or reuses the blocks).
        * A :meth:`submit` that raises (any error, not only ``PlanError``)
          leaves nothing of the plan running: what it had queued already
          finished before it raised.
        * :meth:`poll` never blocks. If :meth:`poll` or :meth:`wait` raises,
          the backend could not tell what finished: every handle not yet
          reported stays outstanding (its copy may still run), and a later
          call that returns normally reports it once it finished. The caller
          keeps such a copy's memory reserved until then.
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
        """Handles completed since the last call, in submission order (non-blocking).

        Raises (any error) when the backend failed; see the invariants for what stays outstanding.
        """
        ...

    def wait(self, handle: int) -> None:
        """Block until ``handle`` (and every handle before it) completed.

        May block without bound on a copy that never completes; kvkit's
        ``TransferEngine`` never calls it (its waits poll until a deadline).
        """
        ...
