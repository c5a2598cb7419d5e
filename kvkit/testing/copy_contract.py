"""``CopyBackendContract``: the tests every ``CopyBackend`` must pass, built-in or your own.

Join it in three lines (pytest collects the subclass)::

    class TestMyCopy(CopyBackendContract):
        device = "cuda"  # the GPU tier's device; "cpu" (the default) runs anywhere
        def make_backend(self): return MyCopy()

The contract allocates small caches in every ``(GPU layout, CPU layout)``
pair kvkit knows, fills them with random bytes and checks:

* random plans (both directions, any group, runs and scattered ids, repeated
  sources) leave every tensor of both tiers byte-identical to the torch
  reference backend run on clones, and to a block-by-block copy: each
  destination block holds its source block, and nothing else changes;
* every plan of :data:`~kvkit.testing.kvdata.BAD_PLANS`, and a plan before
  any ``register``, raises ``PlanError`` from ``submit`` (matching the
  listed message) and no byte of either tier moves, nor is a handle issued;
* a :class:`~kvkit.interfaces.capabilities.LayeredCopy` backend runs random
  plans in random stages to the same bytes, each load stage's regions
  hold their sources once that stage's events completed, and stages that do
  not partition the group's regions are refused like bad plans;
* handles come back from ``poll`` in submission order, each once;
  ``check_invariants()`` passes if the backend is
  :class:`~kvkit.interfaces.capabilities.SelfChecking`.

A pair whose probe registration (two layers, one group; for the bad plans
:data:`~kvkit.testing.kvdata.TWO_GROUPS`) raises ``SpecMismatchError`` is
skipped, but at least one pair must be accepted. With ``device = "cuda"``
the CPU tier is page-locked, the tests carry the ``gpu`` mark and skip
without a CUDA device. The checks are public functions
(:func:`check_plans`, :func:`check_bad_plans`), so a test can run them on
an example of its own.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol, cast

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typing_extensions import override

from kvkit.backends.copy.torch_copy import TorchCopy
from kvkit.errors import PlanError, SpecMismatchError
from kvkit.interfaces.capabilities import LayeredCopy, SelfChecking
from kvkit.interfaces.copy import CopyBackend, Region
from kvkit.interfaces.types import Direction, KVCacheSpec, Tier, TransferPlan
from kvkit.testing.kvdata import (
    BAD_PLANS,
    TWO_GROUPS,
    fill_random,
    kv_specs,
    pairable_layouts,
    plans,
    reference_copy,
    tensor_bytes,
)
from kvkit.validate import plural
from kvkit.worker.layouts import allocate_kv, kv_nbytes, kv_views, regions_for

__all__ = [
    "CopyBackendContract", "allocate_tiers", "check_bad_plans", "check_bad_stages", "check_plans", "check_stages",
]

Layouts = tuple[str, str]
"""``(GPU layout, CPU layout)``."""


class _Layered(CopyBackend, LayeredCopy, Protocol):
    """A copy backend that is also a ``LayeredCopy``: what the stage checks drive."""

_PROBE = KVCacheSpec(num_layers=2, block_size=2, num_kv_heads=1, head_dim=4, dtype="float16")
_PAIRS = pairable_layouts(_PROBE)
_TWO_GROUP_PAIRS = pairable_layouts(TWO_GROUPS)
_BAD_PLAN_BLOCKS = (4, 3)  # the GPU and CPU block counts BAD_PLANS assume


def _pair_id(layouts: Layouts) -> str:
    return "{}->{}".format(*layouts)


def _regions(spec: KVCacheSpec, layouts: Layouts, gpu: list[torch.Tensor], cpu: list[torch.Tensor]) -> list[Region]:
    return regions_for(spec, layouts[0], gpu, cpu, cpu_layout=layouts[1])


def allocate_tiers(spec: KVCacheSpec, layouts: Layouts, num_gpu: int, num_cpu: int, device: str,
                   seed: int, *, one_buffer: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Both tiers' cache tensors, filled with random bytes from ``seed``.

    The GPU tier lives on ``device``, carved out of one buffer (``one_buffer``)
    or in a tensor per layer; the CPU tier is one host buffer, page-locked
    when ``device`` is ``"cuda"`` (the GPU backends read it directly).
    """
    gpu_layout, cpu_layout = layouts
    if one_buffer:
        buffer = torch.empty(kv_nbytes(spec, gpu_layout, num_gpu), dtype=torch.uint8, device=device)
        gpu = kv_views(spec, gpu_layout, num_gpu, buffer)
    else:
        gpu = allocate_kv(spec, gpu_layout, num_gpu, device)
    host = torch.empty(kv_nbytes(spec, cpu_layout, num_cpu), dtype=torch.uint8, pin_memory=device == "cuda")
    cpu = kv_views(spec, cpu_layout, num_cpu, host)
    fill_random(gpu + cpu, seed)
    return gpu, cpu


def _synchronize(tensors: Sequence[torch.Tensor]) -> None:
    """Wait for every stream of the device, so a stray launch shows in the bytes."""
    if any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()


def check_plans(backend: CopyBackend, spec: KVCacheSpec, layouts: Layouts, gpu: list[torch.Tensor],
                cpu: list[torch.Tensor], plan_list: Sequence[TransferPlan]) -> None:
    """Run ``plan_list`` on ``backend`` (registered on ``gpu`` and ``cpu``), one plan at a time.

    After each ``wait``, every tensor must equal the torch reference
    backend's on clones that ran the same plans, and every region must equal
    :func:`~kvkit.testing.kvdata.reference_copy`'s block-by-block result
    (destination blocks hold their sources; all other bytes are unchanged).
    Finally ``poll`` must report every handle once, in order.

    Raises:
        AssertionError: naming the plan and what differs.
    """
    ref_gpu, ref_cpu = [t.clone() for t in gpu], [t.clone() for t in cpu]
    reference = TorchCopy()
    reference.register(_regions(spec, layouts, ref_gpu, ref_cpu))
    regions = _regions(spec, layouts, gpu, cpu)
    views = [(r, tier, v) for r in regions for tier, v in ((Tier.GPU, r.gpu), (Tier.CPU, r.cpu))]  # every byte
    tiers = ((Tier.GPU, gpu, ref_gpu), (Tier.CPU, cpu, ref_cpu))
    handles = []
    for plan in plan_list:
        before = {id(v): tensor_bytes(v) for _, _, v in views}
        expected = {id(dst): tensor_bytes(want) for dst, want in reference_copy(regions, plan)}
        handles.append(backend.submit(plan))
        backend.wait(handles[-1])
        reference.wait(reference.submit(plan))
        for tier, mine, theirs in tiers:
            for i, (t, ref) in enumerate(zip(mine, theirs, strict=True)):
                assert torch.equal(tensor_bytes(t), tensor_bytes(ref)), (
                    f"{layouts}: after {plan}, {tier} tensor {i} differs from the torch reference's")
        for region, tier, v in views:
            assert torch.equal(tensor_bytes(v), expected.get(id(v), before[id(v)])), (
                f"{layouts}: after {plan}, the {tier} tier of region {region.name!r} "
                + ("differs from the block-by-block copy (destination blocks hold their sources, no other "
                   "block changes)" if id(v) in expected else "changed, though the plan does not write it"))
    reported = backend.poll()
    assert reported == handles, f"poll reported {reported} after waiting for handles {handles}"
    if isinstance(backend, SelfChecking):
        backend.check_invariants()


def check_bad_plans(backend: CopyBackend, gpu: list[torch.Tensor], cpu: list[torch.Tensor]) -> None:
    """Every plan of ``BAD_PLANS`` must raise a matching ``PlanError`` and move no byte.

    ``backend`` is registered on :data:`~kvkit.testing.kvdata.TWO_GROUPS`
    tiers of 4 GPU and 3 CPU blocks. Afterwards ``poll`` must report nothing.

    Raises:
        AssertionError: a plan was accepted, refused with another message,
            or moved bytes before it was refused.
    """
    tensors = gpu + cpu
    for plan, pattern in BAD_PLANS:
        before = [tensor_bytes(t) for t in tensors]
        try:
            backend.submit(plan)
        except PlanError as e:
            if not re.search(pattern, str(e)):
                raise AssertionError(f"{plan} was refused with {str(e)!r}, not matching {pattern!r}") from e
        else:
            raise AssertionError(f"submit accepted the bad plan {plan}; expected a PlanError matching {pattern!r}")
        _synchronize(tensors)
        moved = [i for i, (b, t) in enumerate(zip(before, tensors, strict=True))
                 if not torch.equal(b, tensor_bytes(t))]
        assert not moved, f"refusing {plan} moved bytes of tensors {moved} (GPU tier first)"
    reported = backend.poll()
    assert reported == [], f"refused plans issued handles: poll reported {reported}"


def check_stages(backend: _Layered, regions: Sequence[Region], plan: TransferPlan,
                 stages: Sequence[range]) -> None:
    """Run ``plan`` through ``submit_stages`` (``backend`` registered on ``regions``) and check each stage.

    A load's stage ``k`` must have written its regions' destination blocks
    once its events (and so every earlier stage's) completed; afterwards the
    whole plan must match :func:`~kvkit.testing.kvdata.reference_copy` and
    ``poll`` report the one handle.

    Raises:
        AssertionError: naming the stage or region that differs.
    """
    expected = reference_copy(regions, plan)
    handle, events = backend.submit_stages(plan, stages)
    assert len(events) == len(stages), f"{plural(len(events), 'event tuple')} for {plural(len(stages), 'stage')}"
    for k, stage in enumerate(stages):
        for event in events[k]:
            event.synchronize()
        if plan.direction is Direction.LOAD:
            for i in range(stage.stop):
                dst, want = expected[i]
                assert torch.equal(tensor_bytes(dst), tensor_bytes(want)), (
                    f"after {plan} in stages {stages}: region {i} not written when stage {k}'s events completed")
    backend.wait(handle)
    for i, (dst, want) in enumerate(expected):
        assert torch.equal(tensor_bytes(dst), tensor_bytes(want)), (
            f"after {plan} in stages {stages}: region {i} differs")
    reported = backend.poll()
    assert reported == [handle], f"poll reported {reported} for the one handle {handle} of a staged plan"


def check_bad_stages(backend: _Layered, tensors: Sequence[torch.Tensor], plan: TransferPlan,
                     num_regions: int) -> None:
    """Stages that do not partition ``plan``'s ``num_regions`` regions, or a wrong ``after``, raise ``PlanError``.

    No byte may move and no handle be issued.
    """
    r = num_regions
    bad = [([], None), ([range(r + 1)], None), ([range(1, r)], None), ([range(0), range(r)], None),
           ([range(0, r, 2)], None), (list(range(r)), None), ("all", None), ([range(r)], [None, None])]
    for stages, after in bad:
        before = [tensor_bytes(t) for t in tensors]
        try:
            backend.submit_stages(plan, stages, after=after)
        except PlanError:
            pass
        else:
            raise AssertionError(f"submit_stages accepted stages {stages!r} (after={after!r}) "
                                 f"for {plural(num_regions, 'region')}")
        _synchronize(tensors)
        assert all(torch.equal(b, tensor_bytes(t)) for b, t in zip(before, tensors, strict=True)), (
            f"refusing stages {stages!r} moved bytes")
    reported = backend.poll()
    assert reported == [], f"refused stages issued handles: poll reported {reported}"


def _cut(draw: st.DrawFn, num_regions: int) -> list[range]:
    cuts = sorted(draw(st.sets(st.integers(1, max(1, num_regions - 1)), max_size=num_regions - 1))
                  if num_regions > 1 else set())
    bounds = [0, *cuts, num_regions]
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


class CopyBackendContract:
    """The contract as a pytest test class: subclass it and override :meth:`make_backend`.

    Attributes:
        device: ``"cpu"`` (the GPU tier in host memory, CI's stand-in) or
            ``"cuda"``.
        max_blocks: most blocks per tier in the random caches.
        hypothesis_settings: settings for the random tests (``None``: the
            loaded profile).
    """

    device: ClassVar[str] = "cpu"
    pytestmark: ClassVar[list[Any]]  # a subclass's marks (``gpu`` added for a CUDA backend)
    max_blocks: ClassVar[int] = 6
    hypothesis_settings: ClassVar[settings | None] = None

    @override
    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if cls.device == "cuda":  # deselectable with -m "not gpu", like kvkit's own GPU tests
            marks = cls.__dict__.get("pytestmark", [])
            cls.pytestmark = [*(marks if isinstance(marks, list) else [marks]), pytest.mark.gpu]

    def make_backend(self) -> CopyBackend:
        """A fresh, unregistered backend under test (override this)."""
        raise NotImplementedError("subclass CopyBackendContract and override make_backend()")

    def _require_device(self) -> None:
        if self.device == "cuda" and not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")

    def _refusal(self, backend: CopyBackend, spec: KVCacheSpec, layouts: Layouts, gpu: list[torch.Tensor],
                 cpu: list[torch.Tensor]) -> str | None:
        """Register ``backend`` on ``gpu`` and ``cpu``; why it refused them, or ``None``."""
        try:
            backend.register(_regions(spec, layouts, gpu, cpu))
        except SpecMismatchError as e:
            return f"the backend refuses {_pair_id(layouts)}: {e}"
        return None

    def _probe(self, layouts: Layouts) -> str | None:
        """Why a fresh backend refuses small one-group tiers in ``layouts``, or ``None``."""
        gpu, cpu = allocate_tiers(_PROBE, layouts, 4, 3, self.device, seed=0)
        return self._refusal(self.make_backend(), _PROBE, layouts, gpu, cpu)

    def _run(self, test: Callable[[], None]) -> None:
        """Run a ``@given`` test built for this call (one Hypothesis test per test instance)."""
        (test if self.hypothesis_settings is None else self.hypothesis_settings(test))()

    def test_is_a_copy_backend(self) -> None:
        """The backend implements the ``CopyBackend`` protocol."""
        self._require_device()
        backend = self.make_backend()
        assert isinstance(backend, CopyBackend), f"{type(backend).__name__} does not implement CopyBackend"

    def test_accepts_a_layout_pair(self) -> None:
        """At least one GPU/CPU layout pair registers (the others' tests skip)."""
        self._require_device()
        refusals = [self._probe(p) for p in _PAIRS]
        assert None in refusals, f"every layout pair is refused: {refusals}"

    @pytest.mark.parametrize("layouts", _PAIRS, ids=_pair_id)
    def test_random_plans_match_the_references(self, layouts: Layouts) -> None:
        """Random plans leave both tiers exactly as the torch reference and a block-by-block copy do."""
        self._require_device()
        refusal = self._probe(layouts)
        if refusal is not None:
            pytest.skip(refusal)
        blocks = st.integers(1, self.max_blocks)

        @given(spec=kv_specs(max_groups=1 if "cross-layer" in layouts else 3), num_gpu=blocks, num_cpu=blocks,
               one_buffer=st.booleans(), seed=st.integers(0, 99), data=st.data())
        def random_plans(spec, num_gpu, num_cpu, one_buffer, seed, data):
            gpu, cpu = allocate_tiers(spec, layouts, num_gpu, num_cpu, self.device, seed, one_buffer=one_buffer)
            backend = self.make_backend()
            backend.register(_regions(spec, layouts, gpu, cpu))  # accepted like the probe: must not refuse
            plan_list = data.draw(st.lists(plans(len(spec.groups), num_gpu, num_cpu), min_size=1, max_size=3))
            check_plans(backend, spec, layouts, gpu, cpu, plan_list)

        self._run(random_plans)

    @pytest.mark.parametrize("layouts", _TWO_GROUP_PAIRS, ids=_pair_id)
    def test_bad_plans_are_refused_before_any_byte_moves(self, layouts: Layouts) -> None:
        """Every plan of ``BAD_PLANS`` raises ``PlanError`` and leaves both tiers untouched."""
        self._require_device()
        gpu, cpu = allocate_tiers(TWO_GROUPS, layouts, *_BAD_PLAN_BLOCKS, self.device, seed=5)
        backend = self.make_backend()
        refusal = self._refusal(backend, TWO_GROUPS, layouts, gpu, cpu)
        if refusal is not None:
            pytest.skip(refusal)
        check_bad_plans(backend, gpu, cpu)

    @pytest.mark.parametrize("layouts", _PAIRS, ids=_pair_id)
    def test_layered_plans_land_stage_by_stage(self, layouts: Layouts) -> None:
        """A ``LayeredCopy`` backend copies random plans in random stages exactly, each load stage by its events."""
        self._require_device()
        if not isinstance(self.make_backend(), LayeredCopy):
            pytest.skip("not a LayeredCopy backend")
        refusal = self._probe(layouts)
        if refusal is not None:
            pytest.skip(refusal)
        blocks = st.integers(1, self.max_blocks)

        @given(spec=kv_specs(max_groups=1 if "cross-layer" in layouts else 3), num_gpu=blocks, num_cpu=blocks,
               seed=st.integers(0, 99), data=st.data())
        def layered(spec, num_gpu, num_cpu, seed, data):
            gpu, cpu = allocate_tiers(spec, layouts, num_gpu, num_cpu, self.device, seed)
            backend = self.make_backend()
            regions = _regions(spec, layouts, gpu, cpu)
            backend.register(regions)
            plan = data.draw(plans(len(spec.groups), num_gpu, num_cpu))
            stages = data.draw(st.composite(_cut)(sum(r.group == plan.group for r in regions)))
            check_stages(cast(_Layered, backend), regions, plan, stages)  # the test skipped any other

        self._run(layered)

    def test_bad_stages_are_refused_before_any_byte_moves(self) -> None:
        """A ``LayeredCopy`` backend refuses stages that do not partition the regions, moving nothing."""
        self._require_device()
        backend = self.make_backend()
        if not isinstance(backend, LayeredCopy):
            pytest.skip("not a LayeredCopy backend")
        layouts = next(p for p in _PAIRS if self._probe(p) is None)
        gpu, cpu = allocate_tiers(_PROBE, layouts, 4, 3, self.device, seed=7)
        regions = _regions(_PROBE, layouts, gpu, cpu)
        backend.register(regions)
        check_bad_stages(backend, gpu + cpu, TransferPlan([0, 1], [2, 0], "load"), len(regions))

    def test_submit_before_register_is_refused(self) -> None:
        """A plan submitted before any ``register`` raises ``PlanError``."""
        self._require_device()
        with pytest.raises(PlanError):
            self.make_backend().submit(TransferPlan([0], [0], "store"))
