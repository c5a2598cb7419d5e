"""Turns a :class:`TransferPlan` into flat byte-copy descriptors, vectorised with numpy.

A plan names block pairs; every region of the plan's group holds one piece per
block. The planner expands pairs x regions into ``(source, destination,
bytes)`` descriptors without a per-block Python loop, and *coalesces*: a run
of pairs whose source and destination ids both step by one becomes a single
descriptor in every region whose pieces sit back to back on both tiers (stride
== piece bytes). That holds whenever both tiers use the same kvkit layout
(per-layer: each K/V half is ``[num_blocks, ...]``; blocks-first; cross-layer),
not for a per-layer region against a cross-layer CPU tier (checked per region).

When the regions of a group are evenly spaced on both tiers (per-layer and
blocks-first caches carved out of one buffer, as :func:`kvkit.worker.layouts.kv_views`
does), :meth:`Planner.strided` goes further: one block's pieces in every
region form one 2-D copy (``height`` rows, ``pitch`` apart), which the copy
engine runs as a single operation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from kvkit.errors import PlanError, SpecMismatchError
from kvkit.interfaces.copy import Region
from kvkit.interfaces.types import Direction, Tier, TransferPlan
from kvkit.validate import plural, quote

__all__ = ["CPU", "GPU", "Descriptors", "Planner", "Strided", "registered", "runs"]

GPU, CPU = 0, 1
"""Tier indices into the planner's per-tier arrays."""


def _u64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64).view(np.uint64)


@attrs.frozen(eq=False)
class Descriptors:
    """Independent byte copies: ``size[i]`` bytes from address ``src[i]`` to ``dst[i]``.

    Invariants: three contiguous ``uint64`` arrays of equal length; every size > 0.
    """

    src: np.ndarray
    dst: np.ndarray
    size: np.ndarray

    def __len__(self) -> int:
        return len(self.size)

    @property
    def nbytes(self) -> int:
        """Bytes the copies move together."""
        return int(self.size.sum())


@attrs.frozen(eq=False)
class Strided:
    """2-D copies: copy ``i`` moves ``height`` rows of ``width[i]`` bytes.

    Row ``j`` of copy ``i`` goes from ``src[i] + j * src_pitch`` to
    ``dst[i] + j * dst_pitch``. Invariants: ``width[i] <= min(src_pitch, dst_pitch)``
    (rows never overlap); arrays are contiguous ``uint64`` of equal length.
    """

    src: np.ndarray
    dst: np.ndarray
    width: np.ndarray
    height: int
    src_pitch: int
    dst_pitch: int

    def __len__(self) -> int:
        return len(self.width)

    @property
    def nbytes(self) -> int:
        """Bytes the copies move together."""
        return int(self.width.sum()) * self.height

    def flatten(self) -> Descriptors:
        """The same bytes as one 1-D descriptor per row (row-major: all copies' row 0 first)."""
        rows = np.arange(self.height, dtype=np.int64)[:, None]
        return Descriptors(
            _u64((self.src.view(np.int64)[None, :] + rows * self.src_pitch).ravel()),
            _u64((self.dst.view(np.int64)[None, :] + rows * self.dst_pitch).ravel()),
            _u64(np.broadcast_to(self.width.view(np.int64), (self.height, len(self))).ravel()))


@attrs.frozen(eq=False)
class _Group:
    """The registered regions of one KV group as flat per-tier arrays."""

    names: tuple[str, ...]
    base: np.ndarray  # [2, R] int64 addresses, row GPU then CPU
    stride: np.ndarray  # [2, R] int64 bytes between consecutive blocks
    piece: np.ndarray  # [R] int64 bytes per block piece
    limit: tuple[int, int]  # valid block ids per tier: [0, limit)
    packed: np.ndarray  # [R] bool: pieces back to back on both tiers (runs coalesce)
    pitch: tuple[int, int] | None  # GPU and CPU spacing of evenly spaced regions

    @classmethod
    def of(cls, regions: Sequence[Region], host_address: Callable[[int], int]) -> _Group:
        base = np.array([[r.gpu.data_ptr() for r in regions],
                         [host_address(r.cpu.data_ptr()) for r in regions]], dtype=np.int64)
        stride = np.array([[r.stride_bytes(Tier.GPU) for r in regions],
                           [r.stride_bytes(Tier.CPU) for r in regions]], dtype=np.int64)
        piece = np.array([r.piece_bytes for r in regions], dtype=np.int64)
        limit = (min(r.gpu.shape[0] for r in regions), min(r.cpu.shape[0] for r in regions))
        return cls.of_arrays(tuple(r.name for r in regions), base, stride, piece, limit)

    @classmethod
    def of_arrays(cls, names: tuple[str, ...], base: np.ndarray, stride: np.ndarray, piece: np.ndarray,
                  limit: tuple[int, int]) -> _Group:
        packed = (stride == piece[None, :]).all(axis=0)
        pitch = None
        if len(names) >= 2 and (piece == piece[0]).all() and (stride == stride[:, :1]).all():
            steps = np.diff(base, axis=1)
            if (steps == steps[:, :1]).all() and (steps[:, 0] >= piece[0]).all():
                pitch = (int(steps[GPU, 0]), int(steps[CPU, 0]))
        return cls(names, base, stride, piece, limit, packed, pitch)

    def part(self, regions: range) -> _Group:
        """The regions ``regions`` (indices in registration order) as a group of their own."""
        r = slice(regions.start, regions.stop)
        return _Group.of_arrays(self.names[r], self.base[:, r], self.stride[:, r], self.piece[r], self.limit)


def _tiers(direction: Direction) -> tuple[int, int]:
    return (GPU, CPU) if direction is Direction.STORE else (CPU, GPU)


def runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start positions and lengths of maximal runs where both ids step by +1."""
    n = len(src)
    brk = np.ones(n, dtype=bool)
    if n > 1:
        brk[1:] = (np.diff(src) != 1) | (np.diff(dst) != 1)
    starts = np.flatnonzero(brk)
    return starts, np.diff(np.append(starts, n))


@attrs.define(eq=False)
class Planner:
    """Validates plans against registered regions and expands them into descriptors.

    Invariants: planning never touches tensor data; a plan that fails
    :meth:`validate` yields no descriptors.
    """

    _groups: dict[int, _Group] = attrs.field(factory=dict)
    _parts: dict[tuple[int, int, int], _Group] = attrs.field(factory=dict, init=False)  # (group, start, stop)

    @classmethod
    def of(cls, regions: Sequence[Region], *,
           host_address: Callable[[int], int] | None = None, cpu_device: str = "cpu") -> Planner:
        """A planner over ``regions``.

        Args:
            regions: the registered regions; names unique, CPU tiers in host memory.
            host_address: maps a CPU-tier ``data_ptr()`` to the address copies
                use (the device's view of page-locked memory); identity if ``None``.
            cpu_device: the device type the CPU tiers must be on; ``"cuda"``
                only for a staging buffer standing in for the CPU tier.

        Raises:
            SpecMismatchError: duplicate region names, or a CPU tier not on ``cpu_device``.
        """
        names = [r.name for r in regions]
        if len(set(names)) != len(names):
            raise SpecMismatchError(f"region names must be unique, got {names!r}")
        for r in regions:
            if r.cpu.device.type != cpu_device:
                raise SpecMismatchError(f"region {r.name!r}: CPU tier is on {r.cpu.device}, not host memory")
        by_group: dict[int, list[Region]] = {}
        for r in regions:
            by_group.setdefault(r.group, []).append(r)
        address = host_address or (lambda ptr: ptr)
        return cls({g: _Group.of(rs, address) for g, rs in by_group.items()})

    @property
    def groups(self) -> list[int]:
        """Groups with at least one registered region."""
        return sorted(self._groups)

    def region_names(self, group: int) -> tuple[str, ...]:
        """Names of ``group``'s regions, in descriptor order."""
        return self._groups[group].names

    def region_table(self, group: int) -> np.ndarray:
        """``[regions, 5]`` int64 rows: GPU base, CPU base, GPU stride, CPU stride, piece bytes."""
        g = self._groups[group]
        return np.ascontiguousarray(np.stack([g.base[GPU], g.base[CPU], g.stride[GPU], g.stride[CPU], g.piece], 1))

    def validate(self, plan: TransferPlan) -> None:
        """Check ``plan`` against the registration.

        Raises:
            PlanError: not a ``TransferPlan``, no region registered for its group, ids out of range
                for a tier, or repeated destination ids (their result would
                depend on copy order).
        """
        if not isinstance(plan, TransferPlan):
            raise PlanError(f"plan must be a TransferPlan, got {type(plan).__name__} {quote(plan)}")
        group = self._groups.get(plan.group)
        if group is None:
            raise PlanError(f"no region registered for group {plan.group}; registered groups: {self.groups}")
        src_tier, dst_tier = _tiers(plan.direction)
        for tier, ids in ((src_tier, plan.src), (dst_tier, plan.dst)):
            limit = group.limit[tier]
            if len(ids) and ids.max() >= limit:
                bad = ids[ids >= limit]
                raise PlanError(f"{('GPU', 'CPU')[tier]} block ids out of range [0, {limit}) in group "
                                f"{plan.group}: {bad[:8].tolist()!r}")
        if len(plan.dst) > 1:
            ordered = np.sort(plan.dst)
            repeated = ordered[1:][ordered[1:] == ordered[:-1]]
            if len(repeated):
                raise PlanError(f"destination ids repeat (result would be undefined): "
                                f"{np.unique(repeated)[:8].tolist()!r}")

    def stages(self, plan: TransferPlan, stages: Sequence[range]) -> list[range]:
        """``stages`` checked against ``plan``'s group (``plan`` must have passed :meth:`validate`).

        Raises:
            PlanError: the stages are not consecutive non-empty ``range`` s (step 1)
                covering the group's regions ``0..R`` exactly.
        """
        total = len(self._groups[plan.group].names)
        checked: list[range] = []
        for stage in stages if isinstance(stages, (list, tuple)) else ():
            at = checked[-1].stop if checked else 0
            if not isinstance(stage, range) or stage.step != 1 or stage.start != at or stage.stop <= at:
                break
            checked.append(stage)
        else:
            if checked and checked[-1].stop == total:
                return checked
        raise PlanError(f"stages must be consecutive non-empty ranges covering regions 0..{total} of "
                        f"group {plan.group} exactly, got {quote(stages)}")

    def _group(self, group: int, regions: range | None) -> _Group:
        whole = self._groups[group]
        if regions is None or (regions.start == 0 and regions.stop == len(whole.names)):
            return whole
        key = (group, regions.start, regions.stop)
        part = self._parts.get(key)
        if part is None:
            part = self._parts[key] = whole.part(regions)
        return part

    def count(self, plan: TransferPlan, *, coalesce: bool = True) -> tuple[int, int]:
        """``(descriptors, bytes)`` that :meth:`descriptors` would produce, without building them."""
        group = self._groups[plan.group]
        n = len(plan)
        nruns = len(runs(plan.src, plan.dst)[0]) if coalesce and n else n
        packed = int(group.packed.sum())
        return packed * nruns + (len(group.piece) - packed) * n, n * int(group.piece.sum())

    def descriptors(self, plan: TransferPlan, *, coalesce: bool = True, regions: range | None = None) -> Descriptors:
        """Every byte copy of ``plan`` (in ``regions`` only, if given), region-major; runs merged where packed.

        ``plan`` must have passed :meth:`validate`, ``regions`` :meth:`stages`.
        """
        group = self._group(plan.group, regions)
        s, d = _tiers(plan.direction)
        src, dst = plan.src, plan.dst
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        if coalesce and group.packed.any():
            starts, lengths = runs(src, dst)
            m = group.packed
            parts.append(self._expand(group, m, s, d, src[starts], dst[starts], lengths))
            rest = ~m
        else:
            rest = np.ones(len(group.piece), dtype=bool)
        if rest.any():
            parts.append(self._expand(group, rest, s, d, src, dst, np.ones(len(src), dtype=np.int64)))
        return Descriptors(*(_u64(np.concatenate([p[i] for p in parts])) for i in range(3)))

    @staticmethod
    def _expand(group: _Group, mask: np.ndarray, s: int, d: int, src: np.ndarray, dst: np.ndarray,
                blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``[regions in mask] x [pairs]`` descriptors, flattened region-major."""
        src_addr = group.base[s, mask, None] + src[None, :] * group.stride[s, mask, None]
        dst_addr = group.base[d, mask, None] + dst[None, :] * group.stride[d, mask, None]
        size = blocks[None, :] * group.piece[mask, None]
        return src_addr.ravel(), dst_addr.ravel(), size.ravel()

    def strided(self, plan: TransferPlan, *, coalesce: bool = True, regions: range | None = None) -> Strided | None:
        """``plan`` as 2-D copies spanning every region (of ``regions``), or ``None`` if not evenly spaced.

        ``plan`` must have passed :meth:`validate`, ``regions`` :meth:`stages`.
        """
        group = self._group(plan.group, regions)
        if group.pitch is None:
            return None
        s, d = _tiers(plan.direction)
        src, dst = plan.src, plan.dst
        piece = int(group.piece[0])
        if coalesce and group.packed[0]:
            starts, lengths = runs(src, dst)
            src, dst, width = src[starts], dst[starts], lengths * piece
        else:
            width = np.full(len(src), piece, dtype=np.int64)
        src_pitch, dst_pitch = group.pitch[s], group.pitch[d]
        if len(width) and width.max() > min(src_pitch, dst_pitch):
            return None  # a run longer than the region spacing would overlap the next row
        return Strided(_u64(group.base[s, 0] + src * group.stride[s, 0]),
                       _u64(group.base[d, 0] + dst * group.stride[d, 0]),
                       _u64(width), len(group.piece), src_pitch, dst_pitch)


def stage_waits(after: Any, num_stages: int) -> list[Any]:
    """``after`` as one entry per stage: a single event (or ``None``) gates the first stage only.

    Raises:
        PlanError: a list or tuple ``after`` whose length is not ``num_stages``.
    """
    if isinstance(after, (list, tuple)):
        if len(after) != num_stages:
            raise PlanError(f"after has {plural(len(after), 'event')} for {plural(num_stages, 'stage')}")
        return list(after)
    return [after] + [None] * (num_stages - 1)


def registered(planner: Planner | None, plan: TransferPlan) -> Planner:
    """``planner`` once ``plan`` passed its :meth:`Planner.validate`: what every backend checks first.

    Raises:
        PlanError: nothing registered yet (``planner`` is ``None``), or as :meth:`Planner.validate`.
    """
    if planner is None:
        raise PlanError("no regions registered; call register() before submit()")
    planner.validate(plan)
    return planner
