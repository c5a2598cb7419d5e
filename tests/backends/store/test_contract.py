"""Every built-in store policy passes the store policy contract, and the contract catches broken ones."""

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from typing_extensions import override

from kvkit.backends.store import EagerStore, LazyStore, NeverStore, SelectiveStore
from kvkit.testing import StorePolicyContract
from kvkit.testing.store_contract import StoreDriver


class TestEager(StorePolicyContract):
    def make_policy(self):
        return EagerStore()


class TestEagerBounded(StorePolicyContract):
    def make_policy(self):
        return EagerStore(flush_limit=2)  # below the driver's histories: the bound is exercised


class TestLazy(StorePolicyContract):
    def make_policy(self):
        return LazyStore(watermark=0.3)


class TestSelective(StorePolicyContract):
    def make_policy(self):
        return SelectiveStore(k=2, max_tracked=8)  # a small table: forgetting is exercised too


class TestNever(StorePolicyContract):
    def make_policy(self):
        return NeverStore()


# --- deliberately broken policies: each must fail the contract ---------------


class FlushesUnconfirmed(EagerStore):
    """Flushes every hashed block on finish, confirmed or not."""

    @override
    def on_finished(self, request):
        return range(len(request.block_hashes))


class ClearsTheRequest(EagerStore):
    """Clears the request's hash list on finish, as if it owned the record."""

    @override
    def on_finished(self, request):
        answer = list(super().on_finished(request))
        request.block_hashes.clear()
        return answer


class DriftingWatermark(LazyStore):
    """A target that creeps up on every call, whatever the pool looks like."""

    calls: int = 0

    @override
    def writeback_target(self, gpu_free, gpu_blocks):
        self.calls += 1
        return min(gpu_blocks, self.calls)


class AnswersABool(NeverStore):
    """Answers ``True`` (meaning block 1) on progress."""

    @override
    def on_computed(self, request, start, stop):
        return (True,) if stop > 1 else ()


# Deterministic (derandomize), so a bug found once is found every run; no
# shrinking, since only the failure matters here, not its minimal form.
HUNT = settings(max_examples=200, stateful_step_count=30, deadline=None, database=None, derandomize=True,
                report_multiple_bugs=False, phases=[Phase.generate], suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize(("policy", "symptom"), [
    (FlushesUnconfirmed, r"on_finished\(.*answered \[\d+"),
    (ClearsTheRequest, "changed a RequestView"),
    (DriftingWatermark, "the same arguments must give the same target"),
    (AnswersABool, r"answered \[True\], not ints"),
])
def test_contract_catches_a_broken_policy(policy, symptom):
    """Each deliberately broken policy fails the contract with the matching symptom."""
    with pytest.raises(AssertionError, match=symptom):
        run_state_machine_as_test(lambda: StoreDriver(policy()), settings=HUNT)


def test_contract_needs_make_policy():
    """The bare contract refuses to run without a policy factory."""
    with pytest.raises(NotImplementedError, match="make_policy"):
        StorePolicyContract().test_answers_as_the_manager_expects()
