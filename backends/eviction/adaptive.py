"""An adaptive policy: evicts by whichever expert rule its shadow caches show winning now."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import attrs
from typing_extensions import override

from kvkit.backends.eviction._common import (
    LearnsCapacity,
    already_tracked,
    any_block,
    check_count,
    define_policy,
    hash_already_tracked,
    not_tracked,
)
from kvkit.backends.eviction.arc import ARCPolicy
from kvkit.backends.eviction.hit_density import HitDensityPolicy
from kvkit.backends.eviction.lfu import LFUPolicy
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.backends.eviction.s3fifo import S3FIFOPolicy
from kvkit.errors import ConfigError
from kvkit.interfaces.capabilities import pin_hooks
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.types import BlockHash, BlockId
from kvkit.validate import quote, real_in

__all__ = ["DEFAULT_EXPERTS", "AdaptivePolicy", "Shadow"]

DEFAULT_EXPERTS: tuple[Callable[[], EvictionPolicy], ...] = (
    HitDensityPolicy, ARCPolicy, S3FIFOPolicy, LRUPolicy, LFUPolicy)
"""The experts of :class:`AdaptivePolicy` unless told otherwise: prefix-aware, adaptive
recency/frequency, probationary FIFO, plain recency, plain frequency."""


@attrs.define
class Shadow:
    """A simulated cache run by one expert alone, over the references its owner sees.

    It holds hashes only (no KV) and replays what a pool of ``capacity``
    blocks would do with the expert, request by request: a *request* is a run
    of references each of whose chain parent is the reference before it (a
    reference that does not continue the run starts the next one). The
    longest prefix of the request that is cached hits and is touched; then
    each later hash not cached is inserted, in order, one at a time, evicting
    by the expert whenever the shadow is full (cached ones after the first
    miss stay untouched). These are the rules of
    :func:`kvkit.sim.policy_study.replay` with its default per-block stores,
    so a shadow fed a whole trace scores the expert's own replay. A run is
    replayed when the next one starts (or at :meth:`flush`): scores lag one request.

    Invariants: the expert tracks exactly the cached hashes, under private
    ids; at most ``capacity`` of them after each replayed request.
    """

    expert: EvictionPolicy
    _id_of: dict[BlockHash, BlockId] = attrs.field(factory=dict, init=False)
    _hash_of: dict[BlockId, BlockHash] = attrs.field(factory=dict, init=False)
    _next_id: int = attrs.field(default=0, init=False)
    _run: list[BlockHash] = attrs.field(factory=list, init=False)
    _run_parent: BlockHash | None = attrs.field(default=None, init=False)

    def reference(self, block_hash: BlockHash, parent: BlockHash | None, capacity: int) -> int:
        """Note one reference; return the hits of the run it ended (0 if it continues one)."""
        run = self._run
        if run and parent is not None and parent == run[-1]:
            run.append(block_hash)
            return 0
        hits = self.flush(capacity)
        run.append(block_hash)
        self._run_parent = parent
        return hits

    def flush(self, capacity: int) -> int:
        """Replay the pending run in a pool of ``capacity`` blocks; return its hits."""
        run, id_of, expert = self._run, self._id_of, self.expert
        if not run:
            return 0
        hits = 0
        for block_hash in run:
            if block_hash not in id_of:
                break
            hits += 1
        for block_hash in run[:hits]:
            expert.on_access(id_of[block_hash])
        parent = run[hits - 1] if hits else self._run_parent
        for block_hash in run[hits:]:
            if block_hash not in id_of:
                if len(id_of) >= capacity:
                    for victim in expert.select_victims(len(id_of) - capacity + 1, any_block) or ():
                        expert.on_remove(victim)
                        del id_of[self._hash_of.pop(victim)]
                block = BlockId(self._next_id)
                self._next_id += 1
                id_of[block_hash] = block
                self._hash_of[block] = block_hash
                expert.on_insert(block, block_hash, parent)
            parent = block_hash
        run.clear()
        return hits

    def __len__(self) -> int:
        return len(self._id_of)

    def check_invariants(self) -> None:
        """The expert tracks the cached hashes, and the two maps are inverse."""
        assert len(self.expert) == len(self._id_of) == len(self._hash_of), "shadow maps differ"
        for block_hash, block in self._id_of.items():
            assert self._hash_of[block] == block_hash, f"shadow id {block} maps back wrongly"
        self.expert.check_invariants()


def _experts_check(inst: object, attribute: attrs.Attribute, value: Sequence) -> None:
    if not value or not all(callable(v) for v in value):
        raise ConfigError(f"AdaptivePolicy.experts must be a non-empty sequence of policy "
                          f"factories, got {value!r}")


@define_policy
class AdaptivePolicy(LearnsCapacity, EvictionPolicy):
    """Evicts by the expert whose shadow cache is significantly winning on the recent stream.

    Why: no fixed rule wins on every workload. Prefix-aware hit density leads
    on multi-turn chat; S3-FIFO, ARC and LIRS lead on some frequency-skewed
    or template-heavy streams (held-out traces, the ``few-shot`` shape at
    mid-size pools). This policy runs several and follows the one that is
    significantly winning on the recent stream.

    Mechanism:

    * **Mirrors.** Each expert has an instance that tracks the real blocks
      (every notification, pin hooks included, goes to all of them), so any
      of them can name victims among the blocks really cached, at once.
      :meth:`select_victims` asks the *leader's* mirror; the pool's
      :meth:`on_remove` then reaches every mirror.
    * **Shadows.** Each expert also runs alone in a :class:`Shadow`: a cache of
      hashes of the real pool's size (``capacity`` or the learned one) that
      replays the references the pool reports (each insert and hit, with its
      chain parent), request by request, with the replay's prefix-hit rules.
      A shadow's hits are what the expert would have scored had it run the
      cache alone: a counterfactual per expert, unlike regret schemes
      (LeCaR, Cacheus) that only learn from the real cache's misses. Shadows
      are full size, not spatially sampled (SHARDS): sampling single hashes
      cuts the prefix chains that prefix-aware experts and prefix hits
      depend on.
    * **Evidence.** For every pair of experts, the differences of their
      shadow hits per replayed request are summed, with their squares, both
      decaying with a half-life of ``half_life`` pools' worth of references
      (halved in one pass every half-life: O(1) amortised).
    * **Leader.** The first expert leads at the start (hit density: the best
      rule on conversation traces). At each selection the expert with the
      largest lead over the leader takes over (if the selection succeeds: a
      failed one changes nothing) only if that lead exceeds
      ``switch_sigmas`` standard deviations of the paired sum (the root of
      the summed squares): a paired significance test, so correlated experts
      and noise do not make it flap. A switch is not free (the new leader
      inherits a cache the old one shaped, so a switch between experts of
      nearly equal merit costs hits), hence the long memory and the 3-sigma bar.

    Costs: each notification is forwarded to ``2 * len(experts)`` policies,
    each O(1) amortised, so the policy keeps the protocol's costs with a
    constant factor (about 3.5x hit density's time per reference); selections
    are one expert's (atomic: a ``None`` from the leader changes nothing);
    pinned blocks are set aside by every mirror.

    Args:
        experts: policy factories (classes), each called twice with no
            arguments: one mirror, one shadow; the first leads at the start.
        capacity: the pool's size in blocks (sizes the shadows), or ``None``
            to learn it.
        half_life: the evidence's half-life, in pools' worth of references.
        switch_sigmas: how many standard deviations a challenger's lead
            must reach to take over.

    Invariants:
        * Every mirror tracks exactly the blocks this policy tracks, with the
          same pins; a hash is tracked in at most one block. An insert of a
          block or hash already tracked is refused before any mirror hears it.
        * Each shadow holds at most ``c`` hashes; the lead matrix is antisymmetric
          and each pair's summed squares bound its lead.
    """

    experts: tuple[Callable[[], EvictionPolicy], ...] = attrs.field(
        default=DEFAULT_EXPERTS, converter=tuple, validator=_experts_check)
    half_life: float = attrs.field(default=16.0, validator=real_in(
        low=0, low_open=True, high=math.inf, high_open=True, label="AdaptivePolicy."))
    switch_sigmas: float = attrs.field(default=3.0, validator=real_in(
        low=0, high=math.inf, high_open=True, label="AdaptivePolicy."))
    _mirrors: list[EvictionPolicy] = attrs.field(init=False)
    _shadows: list[Shadow] = attrs.field(init=False)
    # [i][j]: decayed sums over runs of (i's hits - j's hits) and of its square
    _lead: list[list[float]] = attrs.field(init=False)
    _var: list[list[float]] = attrs.field(init=False)
    _hash: dict[BlockId, BlockHash] = attrs.field(factory=dict, init=False)
    _block_of: dict[BlockHash, BlockId] = attrs.field(factory=dict, init=False)
    _parent: dict[BlockId, BlockHash | None] = attrs.field(factory=dict, init=False)
    _leader: int = attrs.field(default=0, init=False)
    _since_halving: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        try:
            self._mirrors = [make() for make in self.experts]
            self._shadows = [Shadow(make()) for make in self.experts]
        except TypeError as exc:  # a factory that needs arguments (``opt`` needs the future)
            raise ConfigError(f"AdaptivePolicy.experts must be factories callable with no arguments, "
                              f"got {quote(self.experts)}: {exc}") from None
        self._lead = [[0.0] * len(self.experts) for _ in self.experts]
        self._var = [[0.0] * len(self.experts) for _ in self.experts]
        bad = [type(m).__name__ for m in self._mirrors
               if not isinstance(m, EvictionPolicy) or pin_hooks(m) is None]
        if bad:
            raise ConfigError(f"AdaptivePolicy.experts must make pin-aware eviction policies "
                              f"(EvictionPolicy with on_pin/on_unpin), got {bad!r}")

    @property
    def leader(self) -> EvictionPolicy:
        """The mirror whose rule names the next victims."""
        return self._mirrors[self._leader]

    @property
    def lead(self) -> dict[str, dict[str, float]]:
        """``lead[a][b]``: decayed shadow hits expert ``a`` scored beyond ``b`` (class names)."""
        names = [type(m).__name__ for m in self._mirrors]
        return {a: dict(zip(names, row, strict=True)) for a, row in zip(names, self._lead, strict=True)}

    # -- notifications -----------------------------------------------------------

    @override
    def on_insert(self, block: BlockId, block_hash: BlockHash,
                  parent: BlockHash | None) -> None:
        # Refused before any mirror hears it: mirrors differ in what they refuse, and one
        # that accepted would keep the block.
        if block in self._hash:
            raise already_tracked(self, block)
        holder = self._block_of.get(block_hash)
        if holder is not None:
            raise hash_already_tracked(self, block, block_hash, holder)
        for mirror in self._mirrors:
            mirror.on_insert(block, block_hash, parent)
        self._hash[block] = block_hash
        self._block_of[block_hash] = block
        self._parent[block] = parent
        self._learn(len(self._hash))
        self._reference(block_hash, parent)

    @override
    def on_access(self, block: BlockId) -> None:
        block_hash = self._hash.get(block)
        if block_hash is None:
            raise not_tracked(self, block)
        for mirror in self._mirrors:
            mirror.on_access(block)
        self._reference(block_hash, self._parent[block])

    @override
    def on_remove(self, block: BlockId) -> None:
        if block not in self._hash:
            raise not_tracked(self, block)
        for mirror in self._mirrors:
            mirror.on_remove(block)
        del self._block_of[self._hash.pop(block)], self._parent[block]

    def on_pin(self, block: BlockId) -> None:
        """Set a block in use aside in every mirror."""
        for mirror in self._mirrors:
            mirror.on_pin(block)  # type: ignore[attr-defined]

    def on_unpin(self, block: BlockId) -> None:
        """Release a block in every mirror."""
        for mirror in self._mirrors:
            mirror.on_unpin(block)  # type: ignore[attr-defined]

    def _reference(self, block_hash: BlockHash, parent: BlockHash | None) -> None:
        capacity = max(self.c, 1)
        hits = [shadow.reference(block_hash, parent, capacity) for shadow in self._shadows]
        if any(hits):  # a run ended: compare the experts' hits in it, pair by pair
            for i, (lead, var) in enumerate(zip(self._lead, self._var, strict=True)):
                for j, other in enumerate(hits):
                    diff = hits[i] - other
                    lead[j] += diff
                    var[j] += diff * diff
        self._since_halving += 1
        if self._since_halving >= self.half_life * capacity:
            self._since_halving = 0
            self._lead = [[x / 2 for x in row] for row in self._lead]
            self._var = [[x / 2 for x in row] for row in self._var]

    # -- decisions -----------------------------------------------------------------

    @override
    def select_victims(self, n: int,
                       is_evictable: Callable[[BlockId], bool]) -> list[BlockId] | None:
        check_count(n)
        leader = self._leader
        best = max(range(len(self._lead)), key=lambda i: self._lead[i][leader])
        lead = self._lead[best][leader]
        if lead > 0 and lead > self.switch_sigmas * math.sqrt(self._var[best][leader]):
            leader = best
        victims = self._mirrors[leader].select_victims(n, is_evictable)
        if victims is not None:  # a selection that fails changes nothing, the leader included
            self._leader = leader
        return victims

    @override
    def __len__(self) -> int:
        return len(self._hash)

    @override
    def check_invariants(self) -> None:
        assert len(self._parent) == len(self._hash) == len(self._block_of), "per-block maps differ in size"
        for mirror in self._mirrors:
            assert len(mirror) == len(self._hash), f"{type(mirror).__name__} mirror tracks other blocks"
            mirror.check_invariants()
        for shadow in self._shadows:
            assert len(shadow) <= max(self.c, 1), "a shadow outgrew the pool"
            shadow.check_invariants()
        k = len(self._lead)
        for i in range(k):
            for j in range(k):
                assert self._lead[i][j] == -self._lead[j][i], "lead is not antisymmetric"
                assert self._var[i][j] == self._var[j][i] >= abs(self._lead[i][j]) * (i != j), \
                    "variance below the lead"
        self._check_capacity()
