"""Contract suite every ``EvictionPolicy`` must pass, built-in or your own.

Three lines make a pytest test class of it::

    class MyPolicyContract(EvictionPolicyContract):
        def make_policy(self): return MyPolicy()
    TestMyPolicy = MyPolicyContract.TestCase

A policy claiming LRU or FIFO order joins :class:`LRUContract` or
:class:`FIFOContract` instead, which also check the exact victims. A policy
with the optional pin hooks is driven through them, every pin reported (as a
pool does); set ``drive_pin_hooks = False`` in a second class to prove it also
works for drivers that never pin.
"""

from __future__ import annotations

import copy
import functools
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, TypeGuard

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from typing_extensions import override

from kvkit.errors import KVKitError
from kvkit.interfaces.capabilities import PinAwarePolicy, pin_hooks
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.hints import HintAwarePolicy, WorkloadHints
from kvkit.interfaces.types import BlockHash, BlockId
from kvkit.validate import plural

__all__ = ["EvictionPolicyContract", "FIFOContract", "LRUContract"]

_PICK = st.integers(0, 63)  # reduced modulo the live choices, so it shrinks towards the first


def _select(policy: Any, n: object, is_evictable: Callable[[BlockId], bool]) -> object:
    """``policy.select_victims(n, is_evictable)`` for any ``n``, valid or not."""
    return policy.select_victims(n, is_evictable)


def _hash(k: int) -> BlockHash:
    """A 64-bit hash for hash number ``k``, far from any block id (catches id/hash mix-ups)."""
    return BlockHash((k + 1) * 0x9E3779B97F4A7C15 % 2**64)


class EvictionPolicyContract(RuleBasedStateMachine):
    """Drives a policy the way a pool does and checks it against a trivial model.

    The model is the set of tracked blocks (with hashes, insertion order,
    recency and use counts) and the set of pinned ones; ``is_evictable`` is
    "tracked and not pinned". Rules insert chains of blocks (each block's
    parent is the hash before it; a hash keeps its parent for the whole run,
    as content hashes do), access, pin, unpin and remove blocks (pinned or
    not), and select victims, which are then removed as a pool would. Block
    ids and hashes come from small spaces, so ids are reused for other
    content and evicted hashes return. If the policy has the optional pin
    hooks (and :attr:`drive_pin_hooks` is true), pinning and unpinning call
    ``on_pin`` and ``on_unpin``; otherwise the policy learns of pins only
    through ``is_evictable``.

    Checked after every step, for every policy:

    * ``len(policy)`` equals the model's count; ``check_invariants()`` passes.
    * With at least ``n`` evictable blocks, ``select_victims(n)`` returns a
      list of exactly ``n`` distinct, tracked, evictable blocks. It must
      succeed then: a policy that cannot find victims that exist would make
      its pool fail allocations it could serve.
    * With fewer, it returns ``None`` and changes nothing. This is checked by
      behaviour: a clone taken just before the call must drain (evict
      everything, one victim at a time) in the same order as a clone taken
      just after; and the pre-call clone lives on as a *twin* that receives
      every later call except failed selections, and must choose the same
      victims as the policy ever after.
    * A pinned block is never a victim (with or without hooks), and a block
      just unpinned is eligible again: selecting every evictable block (on a
      clone) returns it too.

    The policy must be deterministic (seed any randomness in
    :meth:`make_policy`) and copyable by :meth:`clone_policy`.
    """

    max_blocks = 12
    """Most blocks tracked at once (the pool size being modelled)."""
    hash_space = 24
    """Distinct hashes in play; more than ``max_blocks``, so hashes leave and return."""
    drive_pin_hooks = True
    """Whether pin and unpin call the policy's pin hooks, if it has them (``False``: never)."""
    checks_refusals = False
    """Whether calls that break the protocol must be refused (kvkit's built-in policies set it).

    A refused call (a victim count that is not an int in ``[0, sys.maxsize]``,
    a tracked block inserted again, an untracked block accessed or removed,
    for a :class:`~kvkit.interfaces.hints.HintAwarePolicy` hints that are not
    a ``WorkloadHints`` or hashes that are not all ints) raises a
    :class:`~kvkit.errors.KVKitError` and changes nothing: the policy evicts
    what it would have evicted, and hears the next hints as it would have.
    """

    def __init__(self) -> None:
        super().__init__()
        self.policy = self.make_policy()
        assert isinstance(self.policy, EvictionPolicy), \
            f"{type(self.policy).__name__} does not implement EvictionPolicy"
        self.twin: EvictionPolicy | None = None
        self.tracked: OrderedDict[BlockId, BlockHash] = OrderedDict()  # insertion order
        self.recency: OrderedDict[BlockId, None] = OrderedDict()  # least recent first
        self.uses: dict[BlockId, int] = {}  # 1 for the insert plus 1 per hit
        self.pinned: set[BlockId] = set()
        self.parents: dict[BlockHash, BlockHash | None] = {}
        self.hooks = self.drive_pin_hooks and pin_hooks(self.policy) is not None

    def make_policy(self) -> EvictionPolicy:
        """Return a fresh policy under test (override this)."""
        raise NotImplementedError("subclass EvictionPolicyContract and override make_policy()")

    def clone_policy(self, policy: EvictionPolicy) -> EvictionPolicy:
        """An independent copy of ``policy`` in its current state (override if deepcopy fails)."""
        return copy.deepcopy(policy)

    def reference_order(self) -> Iterable[BlockId] | None:
        """Tracked blocks in the exact order the policy claims to evict them, or ``None``.

        When not ``None``, every successful selection must return the first
        ``n`` evictable blocks of this order (as a set). Build it from the
        model: ``self.tracked`` (insertion order), ``self.recency`` (least
        recent first), ``self.uses`` (1 per insert and hit).
        """
        return None

    @staticmethod
    def hash_for(k: int) -> BlockHash:
        """The block hash the contract uses for hash number ``k`` in ``range(hash_space)``."""
        return _hash(k)

    def policies(self) -> list[EvictionPolicy]:
        """The policy and, once a selection failed, its twin: the calls every one receives."""
        return [self.policy] if self.twin is None else [self.policy, self.twin]

    def hears_pins(self, policy: EvictionPolicy) -> TypeGuard[PinAwarePolicy]:
        """Whether ``policy`` is told of pins and releases (it has the hooks, and the contract drives them)."""
        return self.hooks

    def is_evictable(self, block: BlockId) -> bool:
        """The model's predicate: tracked and not pinned."""
        return block in self.tracked and block not in self.pinned


    @precondition(lambda self: len(self.tracked) < self.max_blocks)
    @rule(block=_PICK, k=_PICK, parent=st.none() | _PICK, length=st.integers(1, 3))
    def insert(self, block: int, k: int, parent: int | None, length: int) -> None:
        """Insert a chain of up to ``length`` blocks under free ids and untracked hashes."""
        hashes = list(self.tracked.values())
        previous = None if parent is None or not hashes else hashes[parent % len(hashes)]
        for _ in range(min(length, self.max_blocks - len(self.tracked))):
            block_id = BlockId(self._first_free(block, self.max_blocks, self.tracked.__contains__))
            in_use = set(self.tracked.values())
            block_hash = _hash(self._first_free(k, self.hash_space,
                                                lambda x: _hash(x) in in_use))  # noqa: B023 - used at once
            parent_hash = self.parents.setdefault(block_hash, previous)
            for policy in self.policies():
                policy.on_insert(block_id, block_hash, parent_hash)
            self.tracked[block_id] = block_hash
            self.recency[block_id] = None
            self.uses[block_id] = 1
            previous = block_hash

    @precondition(lambda self: self.tracked)
    @rule(pick=_PICK)
    def access(self, pick: int) -> None:
        """Hit a tracked block, pinned or not."""
        block = self._pick(self.tracked, pick)
        for policy in self.policies():
            policy.on_access(block)
        self.recency.move_to_end(block)
        self.uses[block] += 1

    @precondition(lambda self: len(self.pinned) < len(self.tracked))
    @rule(pick=_PICK)
    def pin(self, pick: int) -> None:
        """Reference an evictable block, so it may not be evicted."""
        block = self._pick(self.tracked.keys() - self.pinned, pick)
        for policy in self.policies():
            if self.hears_pins(policy):
                policy.on_pin(block)
        self.pinned.add(block)

    @precondition(lambda self: self.pinned)
    @rule(pick=_PICK)
    def unpin(self, pick: int) -> None:
        """Drop the reference on a pinned block; it must be selectable again."""
        block = self._pick(self.pinned, pick)
        for policy in self.policies():
            if self.hears_pins(policy):
                policy.on_unpin(block)
        self.pinned.discard(block)
        available = [b for b in self.tracked if b not in self.pinned]
        victims = self.clone_policy(self.policy).select_victims(len(available), self.is_evictable)
        assert victims is not None and block in victims, (
            f"after unpinning block {block!r}, selecting all {plural(len(available), 'evictable block')} "
            f"{available} returned {victims}: the unpinned block was lost")

    @precondition(lambda self: self.pinned)
    @rule(pick=_PICK)
    def remove_pinned(self, pick: int) -> None:
        """Remove a pinned block (``on_remove`` may follow ``on_pin`` without ``on_unpin``)."""
        self._forget(self._pick(self.pinned, pick))

    @precondition(lambda self: len(self.pinned) < len(self.tracked))
    @rule(pick=_PICK)
    def remove(self, pick: int) -> None:
        """Remove an evictable block that was not chosen as a victim (as a reset does)."""
        self._forget(self._pick(self.tracked.keys() - self.pinned, pick))

    @rule(k=st.integers(0, 3), too_many=st.sampled_from([False, False, False, True]))
    def select(self, k: int, too_many: bool) -> None:
        """Ask for up to ``k`` victims (or ``k`` more than exist); remove them as a pool would."""
        available = [b for b in self.tracked if b not in self.pinned]
        n = len(available) + 1 + k if too_many else min(k, len(available))
        if len(available) >= n:
            self._select_succeeds(n, available)
        else:
            self._select_fails(n, available)

    @precondition(lambda self: self.checks_refusals)
    @rule(data=st.data())
    def refused_call(self, data: st.DataObject) -> None:
        """A call that breaks the protocol raises a kvkit error and changes nothing."""
        calls = self._bad_calls()
        name = data.draw(st.sampled_from(sorted(calls)), label="bad call")
        call, later_hashes = calls[name]
        for policy in self.policies():
            before = self.clone_policy(policy)
            try:
                call(policy)
            except KVKitError:
                pass
            else:
                raise AssertionError(f"{name}: accepted, not refused with a KVKitError")
            self._assert_drain_alike(before, policy, name, later_hashes)

    def _bad_calls(self) -> dict[str, tuple[Callable[[Any], object], list[BlockHash]]]:
        """Calls the model state makes invalid: name -> (call on a policy, hashes later inserted to compare)."""
        free = BlockId(self._first_free(0, self.max_blocks + 1, self.tracked.__contains__))
        in_use = set(self.tracked.values())
        untracked = [h for h in map(self.hash_for, range(self.hash_space)) if h not in in_use]
        is_evictable = self.is_evictable
        calls: dict[str, tuple[Callable[[Any], object], list[BlockHash]]] = {
            f"select_victims({n!r})": (functools.partial(_select, n=n, is_evictable=is_evictable), [])
            for n in (-1, 1.5, True, "2", 2**64)
        }
        calls["on_access of an untracked block"] = (lambda p: p.on_access(free), [])
        calls["on_remove of an untracked block"] = (lambda p: p.on_remove(free), [])
        if self.tracked:
            block = next(iter(self.tracked))
            calls["on_insert of a tracked block"] = (lambda p: p.on_insert(block, untracked[0], None), [])
        if isinstance(self.policy, HintAwarePolicy):
            hints = WorkloadHints(priority=2, ttl_s=60.0)
            good = untracked[:2]
            calls["on_hints of a str"] = (lambda p: p.on_hints("12", hints), [])
            calls["on_hints of a nested list"] = (lambda p: p.on_hints([*good, [good[0]]], hints), good)
            calls["on_hints of a float hash"] = (lambda p: p.on_hints([*good, 1.5], hints), good)
            calls["on_hints of a dict for hints"] = (lambda p: p.on_hints(good, {"priority": 2}), good)
        return calls

    @invariant()
    def tracks_the_model(self) -> None:
        """Every policy tracks exactly the model's blocks and keeps its invariants."""
        for policy in self.policies():
            assert len(policy) == len(self.tracked), \
                f"len(policy) is {len(policy)}, but {plural(len(self.tracked), 'block')} tracked"
            policy.check_invariants()

    def _select_succeeds(self, n: int, available: list[BlockId]) -> None:
        victims = self.policy.select_victims(n, self.is_evictable)
        assert victims is not None, \
            f"select_victims({n}) returned None, yet blocks {available} are evictable"
        assert isinstance(victims, list), \
            f"select_victims returned a {type(victims).__name__}, not a list"
        assert len(victims) == n, f"select_victims({n}) returned {len(victims)} victims: {victims}"
        assert len(set(victims)) == n, f"select_victims({n}) repeated a victim: {victims}"
        for victim in victims:
            assert victim in self.tracked, \
                f"victim {victim!r} is not tracked (tracked: {list(self.tracked)})"
            assert victim not in self.pinned, \
                f"victim {victim!r} is pinned (pinned: {sorted(self.pinned)})"
        order = self.reference_order()
        if order is not None:
            expected = [b for b in order if b not in self.pinned][:n]
            assert set(victims) == set(expected), \
                f"select_victims({n}) chose {victims}, the reference order chooses {expected}"
        if self.twin is not None:
            twin_victims = self.twin.select_victims(n, self.is_evictable)
            assert twin_victims == victims, (
                f"select_victims({n}) chose {victims}, but a twin that never saw the failed "
                f"selections chose {twin_victims}: a select_victims that returned None "
                f"changed state")
        for victim in victims:
            self._forget(victim)

    def _select_fails(self, n: int, available: list[BlockId]) -> None:
        before = self.clone_policy(self.policy)
        result = self.policy.select_victims(n, self.is_evictable)
        assert result is None, \
            f"select_victims({n}) returned {result!r} with only {plural(len(available), 'evictable block')}"
        self._assert_drain_alike(before, self.policy, f"select_victims({n}) returned None")
        if self.twin is None:
            self.twin = before  # never saw the failed call: the policy must keep behaving like it

    def _assert_drain_alike(self, before: EvictionPolicy, after: EvictionPolicy, what: str,
                            later_hashes: Iterable[BlockHash] = ()) -> None:
        """Clones of ``before`` and ``after``, given blocks of ``later_hashes``, evict every block in the same order."""
        left = set(self.tracked)
        first, second = self.clone_policy(before), self.clone_policy(after)
        for i, block_hash in enumerate(later_hashes):  # new ids past the modelled pool
            block = BlockId(self.max_blocks + 1 + i)
            for clone in (first, second):
                clone.on_insert(block, block_hash, None)
            left.add(block)
        for block in sorted(self.pinned):  # pinned blocks may be set aside: release them to drain everything
            for clone in (first, second):
                if self.hears_pins(clone):
                    clone.on_unpin(block)
        while left:
            a = first.select_victims(1, left.__contains__)
            b = second.select_victims(1, left.__contains__)
            assert a == b, (
                f"after {what} the policy evicts {b} next, "
                f"but before that call it would have evicted {a}: the failed call changed state")
            assert a is not None and a[0] in left, f"draining chose {a}, not one of {sorted(left)}"
            first.on_remove(a[0])
            second.on_remove(a[0])
            left.discard(a[0])

    def _forget(self, block: BlockId) -> None:
        for policy in self.policies():
            policy.on_remove(block)
        del self.tracked[block], self.recency[block], self.uses[block]
        self.pinned.discard(block)

    @staticmethod
    def _pick(choices: Iterable[BlockId], pick: int) -> BlockId:
        ordered = sorted(choices)
        return ordered[pick % len(ordered)]

    @staticmethod
    def _first_free(start: int, size: int, taken: Callable[[int], bool]) -> int:
        """The first number of ``range(size)`` not ``taken``, cyclically from ``start``."""
        return next(x for x in ((start + i) % size for i in range(size)) if not taken(x))


class LRUContract(EvictionPolicyContract):
    """The contract plus exact LRU order: victims are the least recently inserted or hit."""

    @override
    def reference_order(self) -> Iterable[BlockId]:
        return self.recency


class FIFOContract(EvictionPolicyContract):
    """The contract plus exact FIFO order: victims are the earliest inserted; hits don't count."""

    @override
    def reference_order(self) -> Iterable[BlockId]:
        return self.tracked
