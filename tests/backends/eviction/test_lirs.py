"""LIRS: the same victims as the textbook algorithm on lists, scan resistance, bad input."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvkit.backends.eviction._common import any_block
from kvkit.backends.eviction.lirs import LIRSPolicy
from kvkit.errors import ConfigError, PoolUsageError


class TextbookLIRS:
    """LIRS on plain lists (O(cache) a step): stack ``S`` bottom first, queue ``Q`` oldest first."""

    def __init__(self, c: int, hir_ratio: float) -> None:
        self.c, self.hir_ratio = c, hir_ratio
        self.S: list[int] = []
        self.Q: list[int] = []
        self.lir: list[int] = []  # least recent first
        self.ghosts: list[int] = []  # in the order they left the cache

    @property
    def limit(self) -> int:
        return max(0, self.c - max(1, round(self.hir_ratio * self.c)))

    def resident(self) -> set[int]:
        return set(self.lir) | set(self.Q)

    def prune(self) -> None:
        while self.S and self.S[0] not in self.lir:
            x = self.S.pop(0)
            if x in self.ghosts:
                self.ghosts.remove(x)

    def top(self, x: int) -> None:
        if x in self.S:
            self.S.remove(x)
        self.S.append(x)
        self.prune()
        while self.ghosts and len(self.S) > 2 * self.c:
            self.S.remove(self.ghosts.pop(0))
        while len(self.lir) > self.limit:  # demote the bottom LIR block
            x = self.S.pop(0)
            self.lir.remove(x)
            self.Q.append(x)
            self.prune()

    def reference(self, x: int) -> tuple[bool, int | None]:
        """Reference ``x``; return whether it hit and the block it evicted."""
        if x in self.lir:
            self.lir.remove(x)
            self.lir.append(x)
            self.top(x)
            return True, None
        if x in self.Q:
            self.Q.remove(x)
            (self.lir if x in self.S else self.Q).append(x)
            self.top(x)
            return True, None
        victim = None
        if len(self.resident()) == self.c:
            victim = self.Q.pop(0) if self.Q else self.lir.pop(0)
            if victim in self.S:
                self.ghosts.append(victim)
                self.prune()
                while self.ghosts and len(self.S) > 2 * self.c:
                    self.S.remove(self.ghosts.pop(0))
        if x in self.ghosts:
            self.ghosts.remove(x)
            self.lir.append(x)
        elif len(self.lir) < self.limit:
            self.lir.append(x)
        else:
            self.Q.append(x)
        self.top(x)
        return False, victim


@given(st.integers(1, 8), st.sampled_from([0.01, 0.25, 0.5]), st.lists(st.integers(0, 15), max_size=300),
       st.booleans())
def test_lirs_evicts_as_the_textbook_algorithm(c, hir_ratio, stream, given_capacity):
    """Driven as a cache of ``c`` blocks, the policy's hits and victims are the textbook LIRS's.

    A policy that learns its capacity is equivalent once the pool has filled without a hit
    (its provisional LIR blocks then stand for the textbook's first HIR ones), so its stream
    starts with ``c`` distinct blocks."""
    policy = LIRSPolicy(capacity=c if given_capacity else None, hir_ratio=hir_ratio)
    textbook = TextbookLIRS(c, hir_ratio)
    block_of: dict[int, int] = {}
    fill = [] if given_capacity else [100 + k for k in range(c)]
    for step, x in enumerate(fill + stream):
        hit, victim = textbook.reference(x)
        assert (x in block_of) == hit
        if hit:
            policy.on_access(block_of[x])
        else:
            if len(block_of) == c:
                (chosen,) = policy.select_victims(1, any_block)
                policy.on_remove(chosen)
                assert [k for k, b in block_of.items() if b == chosen] == [victim], f"step {step}"
                del block_of[victim]
            block_of[x] = step
            policy.on_insert(step, x, None)
        policy.check_invariants()
        if step >= len(fill):
            assert {block_of[k] for k in textbook.lir} == policy.lir


def test_lirs_learning_its_capacity_keeps_the_first_blocks_admitted():
    """A chain longer than the pool: the learned policy keeps its head, as LIRS told the size does."""
    for capacity in (None, 100):
        policy = LIRSPolicy(capacity=capacity)
        for b in range(1000):
            if len(policy) == 100:
                (victim,) = policy.select_victims(1, any_block)
                policy.on_remove(victim)
            policy.on_insert(b, 5000 + b, 5000 + b - 1 if b else None)
            policy.check_invariants()
        assert policy.lir == frozenset(range(99)), capacity


def test_lirs_keeps_its_lir_set_through_a_scan():
    """Blocks reused within the LIR span survive any number of blocks that are never reused."""
    policy = LIRSPolicy(capacity=10, hir_ratio=0.2)  # 8 LIR, 2 HIR
    for b in range(8):
        policy.on_insert(b, 100 + b, None)
    for b in range(8):
        policy.on_access(b)
    for b in range(8, 1000):
        if len(policy) == 10:
            (victim,) = policy.select_victims(1, any_block)
            assert victim >= 8, f"scan block evicted LIR block {victim}"
            policy.on_remove(victim)
        policy.on_insert(b, 100 + b, None)
    assert policy.lir == frozenset(range(8))


def test_lirs_a_returning_ghost_becomes_lir():
    """A hash evicted while in S and inserted again was re-referenced within the LIR span: it enters as LIR."""
    policy = LIRSPolicy(capacity=4, hir_ratio=0.25)  # 3 LIR, 1 HIR
    for b in range(4):
        policy.on_insert(b, 100 + b, None)  # 0-2 LIR, 3 HIR in S
    (victim,) = policy.select_victims(1, any_block)
    assert victim == 3
    policy.on_remove(3)
    policy.on_insert(9, 103, None)
    assert 9 in policy.lir and len(policy.lir) == 3  # the bottom LIR block (0) was demoted
    assert 0 not in policy.lir
    policy.check_invariants()


def test_lirs_falls_back_to_lir_blocks_when_no_hir_block_may_go():
    """With every HIR block in use, victims come from the LIR blocks, least recent first; none if all are in use."""
    policy = LIRSPolicy(capacity=4, hir_ratio=0.25)
    for b in range(4):
        policy.on_insert(b, 100 + b, None)
    policy.on_pin(3)
    assert policy.select_victims(2, any_block) == [0, 1]
    for b in range(3):
        policy.on_pin(b)
    assert policy.select_victims(1, any_block) is None
    policy.check_invariants()


@pytest.mark.parametrize("bad", [0, 1, -0.5, 1.5, float("nan")])
def test_lirs_bad_hir_ratio_is_a_config_error(bad):
    """The HIR share must lie strictly between 0 and 1, quoted."""
    with pytest.raises(ConfigError, match="hir_ratio"):
        LIRSPolicy(hir_ratio=bad)


def test_lirs_refuses_a_hash_another_block_holds_and_changes_nothing():
    """LIRS indexes blocks by hash: a second block under a tracked hash is refused, the index intact."""
    policy = LIRSPolicy(capacity=4)
    policy.on_insert(0, 11, None)
    with pytest.raises(PoolUsageError, match="hash 11 of block 1 is already tracked by block 0"):
        policy.on_insert(1, 11, None)
    policy.check_invariants()
    assert len(policy) == 1 and policy.select_victims(1, lambda b: True) == [0]
