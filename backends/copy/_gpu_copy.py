"""What the GPU copy backends share: registration checks, side streams, ordering, handles.

A subclass only says how one validated plan is launched on a stream
(:meth:`GPUCopy._launch`); this base validates it first (so a bad plan
launches nothing), orders it after ``after``, and tracks its completion.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
from typing_extensions import override

from kvkit._lazy import lazy_module
from kvkit.backends.copy._driver import driver
from kvkit.backends.copy._inflight import HandleQueue, InFlight, launch_stages
from kvkit.backends.copy.planner import Planner, registered, stage_waits
from kvkit.errors import SpecMismatchError
from kvkit.interfaces.copy import CopyBackend, Region
from kvkit.interfaces.types import Direction, TransferPlan

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())  # torch on first use: listing the backends imports none

__all__ = ["GPUCopy"]


@attrs.define(eq=False)
class GPUCopy(HandleQueue, CopyBackend):
    """Base of the CUDA copy backends: stores and loads each on their own low-priority stream.

    Invariants:
        * Nothing is issued on the legacy default stream; a store reads its
          source only after ``after`` completed.
        * A plan is validated against the registration before anything is
          launched; every handle is reported by :meth:`poll` exactly once, in
          submission order; a ``submit`` that raises leaves nothing running.
        * Every copy is timed (:class:`~kvkit.interfaces.capabilities.TimedCopy`)
          by timing events around its work on the stream (waits on ``after``
          not counted).
    """

    _cpu_tier_device: ClassVar[str] = "cpu"  # "cuda" for a GPU staging buffer in the CPU tier's place
    _planner: Planner | None = attrs.field(default=None, init=False)
    _device: torch.device | None = attrs.field(default=None, init=False)
    _context: int = attrs.field(default=0, init=False)
    _streams: dict[Direction, torch.cuda.Stream] = attrs.field(factory=dict, init=False)
    _inflight: InFlight = attrs.field(factory=InFlight, init=False)

    def stream(self, direction: Direction) -> torch.cuda.Stream | None:
        """The stream copies in ``direction`` run on (``None`` before :meth:`register`)."""
        return self._streams.get(Direction(direction))

    @property
    def planner(self) -> Planner | None:
        """The planner of the current registration."""
        return self._planner

    @override
    def register(self, regions: Sequence[Region]) -> None:
        """Register the regions plans copy; replaces any earlier registration.

        Raises:
            SpecMismatchError: duplicate names, GPU tiers not on one CUDA
                device, or a CPU tier that is not page-locked host memory.
        """
        devices = {r.gpu.device for r in regions}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise SpecMismatchError(
                f"GPU tiers must all be on one CUDA device, got {sorted(map(str, devices))}")
        device = devices.pop()
        lib = driver()
        with torch.cuda.device(device):
            torch.cuda.current_stream(device).synchronize()  # makes the primary context current here
            self._context = lib.current_context()

            def host_address(ptr: int) -> int:
                address = lib.device_address(ptr)
                if address is None:
                    name = next(r.name for r in regions if r.cpu.data_ptr() == ptr)
                    raise SpecMismatchError(
                        f"region {name!r}: CPU tier at {ptr:#x} is not page-locked; allocate it with "
                        f"pin_memory=True or register it with cudaHostRegister")
                return address

            self._planner = Planner.of(regions, host_address=host_address, cpu_device=self._cpu_tier_device)
            if self._device != device:
                # Priority 0 is CUDA's least: copy kernels yield to the model's pending blocks.
                self._streams = {d: torch.cuda.Stream(device, priority=0) for d in Direction}
                self._device = device
            self._registered(regions)

    def _registered(self, regions: Sequence[Region]) -> None:
        """Hook: per-registration state of a subclass (called with the device current)."""

    @override
    def submit(self, plan: TransferPlan, *, after: Any = None) -> int:
        """Validate ``plan``, order it after ``after`` and launch it; returns its handle.

        Raises:
            PlanError: nothing registered, unknown group, ids out of range or
                repeated destination ids; nothing was launched.
        """
        planner = registered(self._planner, plan)
        return self._start(plan, [range(len(planner.region_names(plan.group)))], [after])[0]

    def submit_stages(self, plan: TransferPlan, stages: Sequence[range], *,
                      after: Any = None) -> tuple[int, list[tuple[Any, ...]]]:
        """:class:`~kvkit.interfaces.capabilities.LayeredCopy`: ``plan`` stage by stage, one event per stage.

        Raises:
            PlanError: as :meth:`submit`, or stages that do not partition the
                group's regions, or an ``after`` list of another length; nothing was launched.
        """
        stages = registered(self._planner, plan).stages(plan, stages)
        return self._start(plan, stages, stage_waits(after, len(stages)))

    def _start(self, plan: TransferPlan, stages: list[range], waits: list[Any]) -> tuple[int, list[tuple[Any, ...]]]:
        stream = self._streams[plan.direction]
        keep_alive: list[Any] = []
        with torch.cuda.device(self._device):
            try:
                prepared = self._prepare(plan, stream) if len(plan) else None
                keep_alive.append(prepared)

                def launch(stage: range) -> None:
                    if len(plan):
                        keep_alive.append(self._launch(plan, stream, stage, prepared))

                events, clock = launch_stages(stream, stages, waits, launch)
            except Exception:
                stream.synchronize()  # a raising submit leaves nothing running (part of a launch may have been queued)
                raise
        return self._inflight.issue(events[-1][0], keep_alive, clock=clock), events

    def _prepare(self, plan: TransferPlan, stream: torch.cuda.Stream) -> Any:
        """Hook: what every stage of validated, non-empty ``plan`` shares (kept alive until it completed)."""
        return None

    def _launch(self, plan: TransferPlan, stream: torch.cuda.Stream, regions: range, prepared: Any) -> Any:
        """Enqueue every copy of validated, non-empty ``plan`` in the group's ``regions`` on ``stream``.

        ``prepared`` is what :meth:`_prepare` answered for the plan. Returns
        what must stay alive until the copy completed.
        """
        raise NotImplementedError

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if handle bookkeeping is inconsistent."""
        self._inflight.check_invariants()
        assert self._planner is None or set(self._streams) == set(Direction), self._streams
