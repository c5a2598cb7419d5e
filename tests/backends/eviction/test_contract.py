"""The eviction-policy contract on every built-in policy, and proof that it catches bugs."""

from __future__ import annotations

import random
import sys
from collections import OrderedDict
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import precondition, rule, run_state_machine_as_test

from kvkit.backends.eviction.arc import ARCPolicy
from kvkit.backends.eviction.fifo import FIFOPolicy
from kvkit.backends.eviction.hinted import HintedPolicy
from kvkit.backends.eviction.lfu import LFUPolicy
from kvkit.backends.eviction.lirs import LIRSPolicy
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.backends.eviction.opt import OptimalPolicy
from kvkit.backends.eviction.s3fifo import S3FIFOPolicy
from kvkit.errors import PoolUsageError
from kvkit.interfaces.types import BlockHash, BlockId
from kvkit.sim.policy_study import TraceClock
from kvkit.testing import EvictionPolicyContract, FIFOContract, LRUContract

# --- every built-in joins the contract in three lines ------------------------


class LRUPolicyContract(LRUContract):
    checks_refusals = True

    def make_policy(self):
        return LRUPolicy()


TestLRU = LRUPolicyContract.TestCase


class FIFOPolicyContract(FIFOContract):
    checks_refusals = True

    def make_policy(self):
        return FIFOPolicy()


TestFIFO = FIFOPolicyContract.TestCase


class LFUPolicyContract(EvictionPolicyContract):
    checks_refusals = True

    def make_policy(self):
        return LFUPolicy()

    def reference_order(self):
        """Fewest uses first; the stable sort keeps least recent first among equals."""
        return sorted(self.recency, key=self.uses.__getitem__)


TestLFU = LFUPolicyContract.TestCase


class ARCPolicyContract(EvictionPolicyContract):
    checks_refusals = True

    def make_policy(self):
        return ARCPolicy()


TestARC = ARCPolicyContract.TestCase


class FixedARCPolicyContract(EvictionPolicyContract):
    checks_refusals = True

    def make_policy(self):
        return ARCPolicy(capacity=6)  # smaller than the modelled pool: ghosts stay tight


TestFixedARC = FixedARCPolicyContract.TestCase


class LIRSPolicyContract(EvictionPolicyContract):
    checks_refusals = True

    def make_policy(self):
        return LIRSPolicy(hir_ratio=0.25)  # an HIR share of 3 in a pool of 12


TestLIRS = LIRSPolicyContract.TestCase


class FixedLIRSPolicyContract(EvictionPolicyContract):
    checks_refusals = True

    def make_policy(self):
        return LIRSPolicy(capacity=5, hir_ratio=0.4)  # smaller than the modelled pool: S stays tight


TestFixedLIRS = FixedLIRSPolicyContract.TestCase


class LIRSWithoutPinHooksContract(LIRSPolicyContract):
    drive_pin_hooks = False  # a driver that never pins: LIRS must skip pinned blocks itself


TestLIRSWithoutPinHooks = LIRSWithoutPinHooksContract.TestCase


class S3FIFOPolicyContract(EvictionPolicyContract):
    checks_refusals = True

    def make_policy(self):
        return S3FIFOPolicy(small_ratio=0.25)  # a small queue of 3 in a pool of 12


TestS3FIFO = S3FIFOPolicyContract.TestCase


class S3FIFOWithoutPinHooksContract(S3FIFOPolicyContract):
    drive_pin_hooks = False  # a driver that never pins: S3-FIFO must skip pinned blocks itself


TestS3FIFOWithoutPinHooks = S3FIFOWithoutPinHooksContract.TestCase


def _without_hooks(contract: type) -> type:
    """``contract`` for a driver that never pins: the policy must skip in-use blocks by ``is_evictable``."""
    return type(contract.__name__.replace("Contract", "WithoutPinHooks"), (contract,), {"drive_pin_hooks": False})


TestLRUWithoutPinHooks = _without_hooks(LRUPolicyContract).TestCase
TestFIFOWithoutPinHooks = _without_hooks(FIFOPolicyContract).TestCase
TestLFUWithoutPinHooks = _without_hooks(LFUPolicyContract).TestCase
TestARCWithoutPinHooks = _without_hooks(ARCPolicyContract).TestCase


class OptimalPolicyContract(EvictionPolicyContract):
    """OPT's future is a fixed random string over the contract's hashes, observed by a rule."""

    checks_refusals = True

    references = tuple(EvictionPolicyContract.hash_for(k) for k in
                       random.Random(0).choices(range(EvictionPolicyContract.hash_space), k=200))

    def make_policy(self):
        return OptimalPolicy(self.references)

    @precondition(lambda self: self.policy.clock < len(self.references))
    @rule()
    def observe(self) -> None:
        """Advance every policy's clock past the next reference."""
        block_hash = self.references[self.policy.clock]
        for policy in self.policies():
            policy.observe(block_hash)


TestOptimal = OptimalPolicyContract.TestCase
TestOptimalWithoutPinHooks = _without_hooks(OptimalPolicyContract).TestCase


# --- deliberately broken policies --------------------------------------------


class _RecencyList:
    """A minimal correct LRU on one OrderedDict; the broken variants override one decision."""

    def __init__(self) -> None:
        self.order: OrderedDict[BlockId, None] = OrderedDict()

    def on_insert(self, block: BlockId, block_hash: BlockHash, parent: BlockHash | None) -> None:
        self.order[block] = None

    def on_access(self, block: BlockId) -> None:
        self.order.move_to_end(block)

    def on_remove(self, block: BlockId) -> None:
        del self.order[block]

    def select_victims(self, n: int,
                       is_evictable: Callable[[BlockId], bool]) -> list[BlockId] | None:
        victims = [b for b in self.order if is_evictable(b)][:n]
        return victims if len(victims) == n else None

    def __len__(self) -> int:
        return len(self.order)

    def check_invariants(self) -> None:
        pass


class _EvictsPinned(_RecencyList):
    """Counts evictable blocks correctly but returns the coldest blocks, pinned or not."""

    def select_victims(self, n, is_evictable):
        if sum(map(is_evictable, self.order)) < n:
            return None
        return list(self.order)[:n]


class _EvictsMostRecent(_RecencyList):
    """A correct policy, but MRU: the hottest evictable blocks go first."""

    def select_victims(self, n, is_evictable):
        victims = [b for b in reversed(self.order) if is_evictable(b)][:n]
        return victims if len(victims) == n else None


class _GivesUpAtPinned(_RecencyList):
    """Scans from the cold end but stops at the first pinned block instead of skipping it."""

    def select_victims(self, n, is_evictable):
        victims = []
        for block in self.order:
            if len(victims) == n:
                break
            if not is_evictable(block):
                return None
            victims.append(block)
        return victims if len(victims) == n else None


class _MutatesOnFailure(_RecencyList):
    """Pops candidates off the cold end and, on failure, puts them back at the hot end."""

    def select_victims(self, n, is_evictable):
        taken = []
        for block in list(self.order):
            if len(taken) == n:
                break
            if is_evictable(block):
                del self.order[block]
                taken.append(block)
        if len(taken) < n:
            self.order.update(dict.fromkeys(taken))
            return None
        self.order.update(dict.fromkeys(taken))  # victims stay tracked until removed
        for block in taken:
            self.order.move_to_end(block, last=False)
        return taken


class _SetsPinsAside(_RecencyList):
    """A correct policy with pin hooks: pinned blocks leave the order and return at its hot end."""

    def __init__(self) -> None:
        super().__init__()
        self.aside: dict[BlockId, None] = {}

    def on_pin(self, block: BlockId) -> None:
        del self.order[block]
        self.aside[block] = None

    def on_unpin(self, block: BlockId) -> None:
        del self.aside[block]
        self.order[block] = None

    def on_access(self, block: BlockId) -> None:
        if block in self.order:
            self.order.move_to_end(block)

    def on_remove(self, block: BlockId) -> None:
        if self.aside.pop(block, False) is False:
            del self.order[block]

    def __len__(self) -> int:
        return len(self.order) + len(self.aside)


class _LosesUnpinned(_SetsPinsAside):
    """Counts an unpinned block but never puts it back where selection looks."""

    def on_unpin(self, block: BlockId) -> None:
        del self.aside[block]
        self.aside[-1 - block] = None  # still counted, never selectable

    def on_remove(self, block: BlockId) -> None:
        if self.aside.pop(block, False) is False and self.aside.pop(-1 - block, False) is False:
            del self.order[block]


class _TrustsThePins(_SetsPinsAside):
    """Relies on the hooks alone: picks the coldest blocks of its order without asking."""

    def select_victims(self, n, is_evictable):
        if sum(map(is_evictable, self.order)) < n:
            return None
        return list(self.order)[:n]


class _Refusing(_RecencyList):
    """The minimal LRU, refusing every call the protocol forbids before it changes anything."""

    def on_insert(self, block, block_hash, parent):
        if block in self.order:
            raise PoolUsageError(f"block {block} is already tracked")
        super().on_insert(block, block_hash, parent)

    def on_access(self, block):
        if block not in self.order:
            raise PoolUsageError(f"block {block} is not tracked")
        super().on_access(block)

    def on_remove(self, block):
        if block not in self.order:
            raise PoolUsageError(f"block {block} is not tracked")
        super().on_remove(block)

    def select_victims(self, n, is_evictable):
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= sys.maxsize:
            raise PoolUsageError(f"n={n!r}")
        return super().select_victims(n, is_evictable)


class _AcceptsANegativeCount(_Refusing):
    """Answers ``select_victims(-1)`` with no victims instead of refusing it."""

    def select_victims(self, n, is_evictable):
        return [] if n == -1 else super().select_victims(n, is_evictable)


class _TouchesBeforeRefusing(_Refusing):
    """Refuses an insert of a tracked block, but only after making it the most recent."""

    def on_insert(self, block, block_hash, parent):
        if block in self.order:
            self.order.move_to_end(block)
        super().on_insert(block, block_hash, parent)


class _HintsHalfway(HintedPolicy):
    """Hears each hash's hints before checking the next one, so a refusal keeps the earlier ones."""

    def on_hints(self, hashes, hints):
        for block_hash in list(hashes):
            super().on_hints([block_hash], hints)


def _contract_for(policy_type: type, base: type = EvictionPolicyContract,
                  drive_pin_hooks: bool = True, checks_refusals: bool = False) -> type:
    """The contract for ``policy_type``, its refusal rule off unless asked (the minimal policies trust their pool)."""
    class Contract(base):
        def make_policy(self):
            return policy_type()

    Contract.drive_pin_hooks = drive_pin_hooks
    Contract.checks_refusals = checks_refusals

    Contract.__name__ = f"{policy_type.__name__.strip('_')}Contract"
    return Contract


# Deterministic (derandomize) so a bug found once is found every run; no
# shrinking, since only the failure matters here, not its minimal form.
_HUNT = settings(max_examples=300, stateful_step_count=40, deadline=None, database=None,
                 derandomize=True, report_multiple_bugs=False, phases=[Phase.generate],
                 suppress_health_check=list(HealthCheck))


def _hunt(contract: type) -> None:
    run_state_machine_as_test(contract, settings=_HUNT)


def test_catches_a_pinned_victim():
    """A policy that returns a pinned block as a victim fails the contract."""
    with pytest.raises(AssertionError, match="is pinned"):
        _hunt(_contract_for(_EvictsPinned))


def test_catches_mru_posing_as_lru():
    """MRU satisfies the generic contract but fails the exact LRU order check."""
    run_state_machine_as_test(_contract_for(_EvictsMostRecent))
    with pytest.raises(AssertionError, match="reference order"):
        _hunt(_contract_for(_EvictsMostRecent, LRUContract))


def test_catches_giving_up_while_victims_exist():
    """A policy that returns None although enough blocks are evictable fails the contract."""
    with pytest.raises(AssertionError, match="returned None, yet"):
        _hunt(_contract_for(_GivesUpAtPinned))


def test_catches_a_failed_selection_that_mutates():
    """A policy whose failed select_victims reorders its state fails the contract."""
    with pytest.raises(AssertionError, match="changed state"):
        _hunt(_contract_for(_MutatesOnFailure))


def test_exact_order_contracts_accept_the_reference_policies():
    """The LRU and FIFO order checks accept the minimal reference implementations they model."""

    class _Fifo(_RecencyList):
        def on_access(self, block: BlockId) -> None:
            pass

    run_state_machine_as_test(_contract_for(_RecencyList, LRUContract))
    run_state_machine_as_test(_contract_for(_Fifo, FIFOContract))


def test_pin_hooks_are_driven_and_checked():
    """A policy that sets pinned blocks aside passes with and without its hooks driven."""
    run_state_machine_as_test(_contract_for(_SetsPinsAside))
    run_state_machine_as_test(_contract_for(_SetsPinsAside, drive_pin_hooks=False))


def test_refusals_pass_for_a_policy_that_refuses_before_it_changes():
    """The refusal rule accepts the minimal LRU that checks every call first."""
    run_state_machine_as_test(_contract_for(_Refusing, LRUContract, checks_refusals=True))


def test_catches_a_bad_count_that_is_accepted():
    """A policy that answers a negative count instead of refusing it fails the contract."""
    with pytest.raises(AssertionError, match=r"select_victims\(-1\): accepted"):
        _hunt(_contract_for(_AcceptsANegativeCount, checks_refusals=True))


def test_catches_a_refusal_that_changes_state():
    """A policy that reorders a block before refusing its second insert fails the contract."""
    with pytest.raises(AssertionError, match=r"on_insert of a tracked block.*changed state"):
        _hunt(_contract_for(_TouchesBeforeRefusing, checks_refusals=True))


def test_catches_hints_heard_before_a_refusal():
    """A hint-aware policy that keeps the hints of hashes before a bad one fails the contract."""

    class Contract(EvictionPolicyContract):
        checks_refusals = True

        def make_policy(self):
            return _HintsHalfway(base=LRUPolicy, clock=TraceClock())

    with pytest.raises(AssertionError, match=r"on_hints of a (nested list|float hash).*changed state"):
        _hunt(Contract)


def test_catches_a_block_lost_on_unpin():
    """A policy whose on_unpin loses the block (it is never selectable again) fails."""
    symptom = "block was lost|draining chose None|returned None, yet"
    with pytest.raises(AssertionError, match=symptom):
        _hunt(_contract_for(_LosesUnpinned))


def test_catches_a_policy_that_needs_its_pin_hooks():
    """Ignoring is_evictable passes while hooks are driven, fails for a driver that never pins."""
    run_state_machine_as_test(_contract_for(_TrustsThePins))
    with pytest.raises(AssertionError, match="is pinned"):
        _hunt(_contract_for(_TrustsThePins, drive_pin_hooks=False))
