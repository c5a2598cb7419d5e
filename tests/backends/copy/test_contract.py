"""Every built-in copy backend passes the copy backend contract, and the contract catches broken ones."""

import contextlib

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings
from typing_extensions import override

from kvkit.backends.copy import TorchCopy
from kvkit.backends.copy.auto import AutoCopy
from kvkit.errors import PlanError
from kvkit.interfaces import TransferPlan
from kvkit.registry import COPY
from kvkit.testing import CopyBackendContract, ThreadedCopy


class TestTorch(CopyBackendContract):
    def make_backend(self):
        return TorchCopy()


class TestTorchHostThread(CopyBackendContract):
    def make_backend(self): return TorchCopy(host_thread=True)


class TestThreaded(CopyBackendContract):
    def make_backend(self): return ThreadedCopy(threads=2)


class TestTorchCuda(CopyBackendContract):
    device = "cuda"
    def make_backend(self): return TorchCopy()


class TestAutoOnHost(CopyBackendContract):
    def make_backend(self):  # two host backends stand in for the engines and the kernel; plans are split
        return AutoCopy(dma=TorchCopy(), kernel=TorchCopy(), kernel_share=0.5, dma_min_bytes=1 << 40)


class TestCudaDMA(CopyBackendContract):
    device = "cuda"
    def make_backend(self): return COPY.create("cuda-dma")


class TestCupyBatch(CopyBackendContract):
    device = "cuda"
    def make_backend(self): return COPY.create("cupy-batch")


class TestAuto(CopyBackendContract):
    device = "cuda"
    def make_backend(self): return COPY.create("auto")


class TestStaged(CopyBackendContract):
    device = "cuda"  # 2-block chunks through one slot: plans reuse the slot
    def make_backend(self): return COPY.create("staged", chunk_blocks=2, slots=1)


# --- deliberately broken backends: each must fail the contract ---------------


class OffByOne(TorchCopy):
    """Copies from the block before each source block (block 0 stays block 0)."""

    @override
    def submit(self, plan, *, after=None):
        return super().submit(TransferPlan(np.maximum(plan.src - 1, 0), plan.dst, plan.direction, plan.group),
                              after=after)


class ValidatesLate(TorchCopy):
    """Copies the plan's first pair before validating the rest."""

    @override
    def submit(self, plan, *, after=None):
        with contextlib.suppress(PlanError):  # the first pair alone was bad too
            self.wait(super().submit(TransferPlan(plan.src[:1], plan.dst[:1], plan.direction, plan.group)))
        return super().submit(plan, after=after)


# Deterministic (derandomize), so a bug found once is found every run.
HUNT = settings(max_examples=50, deadline=None, database=None, derandomize=True, report_multiple_bugs=False,
                phases=[Phase.generate], suppress_health_check=list(HealthCheck))


def _contract(backend_type):
    class Contract(CopyBackendContract):
        hypothesis_settings = HUNT

        def make_backend(self):
            return backend_type()

    return Contract()


@pytest.mark.parametrize("layouts", [("per-layer", "per-layer"), ("blocks-first", "cross-layer")])
def test_contract_catches_an_off_by_one_copy(layouts):
    """Copying the wrong source blocks differs from the torch reference."""
    with pytest.raises(AssertionError, match="differs from the torch reference"):
        _contract(OffByOne).test_random_plans_match_the_references(layouts)


def test_contract_catches_bytes_moved_before_validation():
    """A backend that launches part of a bad plan before refusing it fails the bad-plan check."""
    with pytest.raises(AssertionError, match="moved bytes"):
        _contract(ValidatesLate).test_bad_plans_are_refused_before_any_byte_moves(("per-layer", "per-layer"))


def test_contract_needs_make_backend():
    """The bare contract refuses to run without a backend factory."""
    with pytest.raises(NotImplementedError, match="make_backend"):
        CopyBackendContract().test_submit_before_register_is_refused()


class FirstStageOnly(TorchCopy):
    """Copies only the first stage's regions of a staged plan."""

    @override
    def submit_stages(self, plan, stages, *, after=None):
        self._planner.validate(plan)
        stages = self._planner.stages(plan, stages)
        self._launch(plan, stages[0], self._index(plan), [], [])
        return self._inflight.issue(), [() for _ in stages]


class TrustsStages(TorchCopy):
    """Takes any stages: a range past the regions is silently cut, a gap skips regions."""

    @override
    def submit_stages(self, plan, stages, *, after=None):
        self._planner.validate(plan)
        for stage in stages if isinstance(stages, list) else []:
            if isinstance(stage, range):
                self._launch(plan, stage, [], [])
        return self._inflight.issue(), [() for _ in stages]


def test_contract_catches_a_staged_copy_that_drops_stages():
    """Copying only the first stage of a staged plan leaves later regions unwritten."""
    with pytest.raises(AssertionError, match=r"region .* (differs|not written)"):
        _contract(FirstStageOnly).test_layered_plans_land_stage_by_stage(("per-layer", "per-layer"))


def test_contract_catches_unchecked_stages():
    """A backend that trusts malformed stages fails the bad-stage check."""
    with pytest.raises(AssertionError, match="accepted stages"):
        _contract(TrustsStages).test_bad_stages_are_refused_before_any_byte_moves()


class DefersStages(TorchCopy):
    """Answers no events for its stages (claims they landed) but copies only when polled or waited for."""

    def __init__(self):
        super().__init__()
        self._deferred = []

    @override
    def submit_stages(self, plan, stages, *, after=None):
        self._planner.validate(plan)
        stages = self._planner.stages(plan, stages)
        self._deferred.append((plan, stages))
        return self._inflight.issue(), [() for _ in stages]

    def _land(self):
        for plan, stages in self._deferred:
            for stage in stages:
                self._launch(plan, stage, self._index(plan), [], [])
        self._deferred.clear()

    @override
    def poll(self):
        self._land()
        return super().poll()

    @override
    def wait(self, handle):
        self._land()
        return super().wait(handle)


def test_contract_catches_stages_answered_without_events():
    """A layered backend whose stages answer no events while their copies still queue fails the stage check."""
    with pytest.raises(AssertionError, match="not written when stage"):
        _contract(DefersStages).test_layered_plans_land_stage_by_stage(("per-layer", "per-layer"))
