"""A hint-aware policy: honours requests' priorities and retention times over a base policy."""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from itertools import islice

import attrs
from typing_extensions import override

from kvkit.backends.eviction._common import LearnsCapacity, check_count, define_policy, not_tracked, pin_mismatch
from kvkit.backends.eviction.adaptive import AdaptivePolicy
from kvkit.errors import ConfigError
from kvkit.interfaces.capabilities import pin_hooks
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.hints import HintAwarePolicy, WorkloadHints
from kvkit.interfaces.types import BlockHash, BlockId
from kvkit.validate import is_callable, is_int, quote

__all__ = ["HintedPolicy"]

_PENDING_SPAN = 4  # pools' worth of hints kept for hashes not cached (yet)


@define_policy
class HintedPolicy(LearnsCapacity, HintAwarePolicy):
    """Evicts hinted low-priority blocks first and retained blocks last; the base policy orders the rest.

    Rules, from first to last victim:

    1. Blocks hinted ``priority < 0`` (nobody will ask again), oldest hint first.
    2. Ordinary blocks, by the ``base`` policy (``adaptive`` by default).
    3. Retained blocks: hinted ``priority > 0``, or hinted ``ttl_s`` and used
       less than ``ttl_s`` ago (by ``clock``); lowest priority first, then
       earliest deadline. A retention that ran out makes the block ordinary
       again (it re-enters the base at its old place). A hit renews it.

    The base policy tracks every block; the low-priority and retained ones
    are held aside in it as if pinned (its pin hooks), so its selections never
    scan them, and blocks in use are set aside here too. A block's hint is
    the latest :meth:`on_hints` gave its hash before it was inserted or hit;
    hints for hashes not cached are kept for about ``4 * c`` hashes.

    Args:
        base: the policy factory (class) for ordinary blocks; it must be pin-aware.
        clock: seconds, monotonic (``time.monotonic``; a simulator passes its own).
        capacity: the pool's size, or ``None`` to learn it.

    Invariants:
        * The base tracks exactly the tracked blocks; a block is held in it
          iff it is in use, low-priority or retained.
        * Low-priority and retained blocks are disjoint; the blocks in use
          among them are parked, the others listed.
    """

    base: Callable[[], EvictionPolicy] = attrs.field(default=AdaptivePolicy, validator=is_callable(label="HintedPolicy.", what="a policy factory (a class)"))  # noqa: E501
    clock: Callable[[], float] = attrs.field(default=time.monotonic, repr=False)
    _policy: EvictionPolicy = attrs.field(init=False)
    _pending: OrderedDict[BlockHash, WorkloadHints] = attrs.field(factory=OrderedDict, init=False)
    _hash: dict[BlockId, BlockHash] = attrs.field(factory=dict, init=False)
    _hints: dict[BlockId, WorkloadHints] = attrs.field(factory=dict, init=False)
    _in_use: set[BlockId] = attrs.field(factory=set, init=False)
    _low: dict[BlockId, None] = attrs.field(factory=dict, init=False)  # evictable, oldest first
    # retained block -> (priority, deadline); evictable ones also in _order (lazy heap)
    _kept: dict[BlockId, tuple[int, float]] = attrs.field(factory=dict, init=False)
    _order: list[tuple[int, float, int, BlockId]] = attrs.field(factory=list, init=False)
    # listed retained block -> the seq of its one valid _order entry (any other entry of it is stale)
    _listed: dict[BlockId, int] = attrs.field(factory=dict, init=False)
    _expiry: list[tuple[float, int, BlockId]] = attrs.field(factory=list, init=False)
    _seq: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        self._policy = self.base()
        if not isinstance(self._policy, EvictionPolicy) or pin_hooks(self._policy) is None:
            raise ConfigError(f"HintedPolicy.base must make a pin-aware eviction policy, got {self._policy!r}")

    def hints_of(self, block: BlockId) -> WorkloadHints | None:
        """The hint a tracked block carries (``None``: none)."""
        if block not in self._hash:
            raise not_tracked(self, block)
        return self._hints.get(block)

    # -- notifications -----------------------------------------------------------

    @override
    def on_hints(self, hashes: Sequence[BlockHash], hints: WorkloadHints) -> None:
        if not isinstance(hints, WorkloadHints):
            raise ConfigError(f"hints must be a WorkloadHints, got {quote(hints)}")
        if isinstance(hashes, (str, bytes)) or not isinstance(hashes, Iterable):
            raise ConfigError(f"hashes={quote(hashes)}: must be a sequence of block hashes (ints)")
        hashes = list(hashes)  # checked whole before any is heard: a refusal changes no priority
        bad = [h for h in hashes if not is_int(h)]
        if bad:
            raise ConfigError(f"hashes={quote(hashes)}: block hashes must be ints, got {quote(bad[0])}")
        pending = self._pending
        for block_hash in hashes:
            pending.pop(block_hash, None)
            pending[block_hash] = hints
        bound = _PENDING_SPAN * max(self.c, 256)
        while len(pending) > bound:
            pending.popitem(last=False)

    @override
    def on_insert(self, block: BlockId, block_hash: BlockHash, parent: BlockHash | None) -> None:
        self._policy.on_insert(block, block_hash, parent)
        self._hash[block] = block_hash
        self._learn(len(self._hash))
        self._use(block)

    @override
    def on_access(self, block: BlockId) -> None:
        if block not in self._hash:
            raise not_tracked(self, block)
        self._policy.on_access(block)
        self._use(block)

    @override
    def on_remove(self, block: BlockId) -> None:
        if block not in self._hash:
            raise not_tracked(self, block)
        self._policy.on_remove(block)
        self._hints.pop(block, None)
        self._low.pop(block, None)
        self._kept.pop(block, None)
        self._listed.pop(block, None)
        self._in_use.discard(block)
        del self._hash[block]

    def on_pin(self, block: BlockId) -> None:
        """A block in use: held in the base (unless already held) and set aside here."""
        if block not in self._hash:
            raise not_tracked(self, block)
        if block in self._in_use:
            raise pin_mismatch(self, block, pinned=True)
        self._in_use.add(block)
        self._listed.pop(block, None)  # parked: its entry goes stale; release lists it anew
        if self._low.pop(block, False) is None or block in self._kept:
            return  # already held in the base
        self._policy.on_pin(block)  # type: ignore[attr-defined]

    def on_unpin(self, block: BlockId) -> None:
        """Released: back among the low-priority, retained or (base) ordinary blocks."""
        if block not in self._hash:
            raise not_tracked(self, block)
        if block not in self._in_use:
            raise pin_mismatch(self, block, pinned=False)
        self._in_use.remove(block)
        hints = self._hints.get(block)
        if hints is not None and hints.priority < 0:
            self._low[block] = None
        elif block in self._kept:
            self._list_kept(block)
        else:
            self._policy.on_unpin(block)  # type: ignore[attr-defined]

    def _use(self, block: BlockId) -> None:
        """Apply the block's (latest) hint at an insert or hit."""
        hints = self._pending.pop(self._hash[block], None) or self._hints.get(block)
        if hints is None:
            return
        self._hints[block] = hints
        held = block in self._in_use or block in self._low or block in self._kept
        self._low.pop(block, None)
        if hints.priority < 0:
            if not held:
                self._policy.on_pin(block)  # type: ignore[attr-defined]
            if block not in self._in_use:
                self._low[block] = None
            self._kept.pop(block, None)
            self._listed.pop(block, None)
            return
        if hints.priority == 0 and hints.ttl_s is None:
            self._kept.pop(block, None)
            self._listed.pop(block, None)
            if held and block not in self._in_use:
                self._policy.on_unpin(block)  # type: ignore[attr-defined]
            return
        deadline = math.inf if hints.ttl_s is None else self.clock() + hints.ttl_s
        if not held:
            self._policy.on_pin(block)  # type: ignore[attr-defined]
        self._kept[block] = (hints.priority, deadline)
        self._seq += 1
        if deadline != math.inf:
            heapq.heappush(self._expiry, (deadline, self._seq, block))
        if block not in self._in_use:
            self._list_kept(block)

    def _list_kept(self, block: BlockId) -> None:
        priority, deadline = self._kept[block]
        self._seq += 1
        self._listed[block] = self._seq
        heapq.heappush(self._order, (priority, deadline, self._seq, block))

    def _expire(self) -> None:
        """Make ordinary every retained block whose deadline passed."""
        now, expiry, kept = self.clock(), self._expiry, self._kept
        while expiry and expiry[0][0] <= now:
            deadline, _, block = heapq.heappop(expiry)
            entry = kept.get(block)
            if entry is None or entry[1] != deadline:
                continue  # removed, renewed or made ordinary since
            del kept[block]
            self._listed.pop(block, None)
            if block not in self._in_use:
                self._policy.on_unpin(block)  # type: ignore[attr-defined]

    # -- decisions -----------------------------------------------------------------

    @override
    def select_victims(self, n: int, is_evictable: Callable[[BlockId], bool]) -> list[BlockId] | None:
        check_count(n)
        self._expire()
        chosen = list(islice(filter(is_evictable, self._low), n))
        if len(chosen) == n:
            return chosen
        taken = set(chosen)

        def ordinary(block: BlockId) -> bool:
            return block not in taken and is_evictable(block)

        rest = self._policy.select_victims(n - len(chosen), ordinary)
        if rest is not None:
            return chosen + rest
        kept = self._kept_in_order(n - len(chosen), is_evictable)
        taken.update(kept)
        rest = self._policy.select_victims(n - len(chosen) - len(kept), ordinary)
        return None if rest is None else chosen + rest + kept

    def _kept_in_order(self, n: int, is_evictable: Callable[[BlockId], bool]) -> list[BlockId]:
        """Up to ``n`` evictable retained blocks, lowest priority then earliest deadline (stale entries dropped)."""
        order, listed = self._order, self._listed
        found: list[BlockId] = []
        fresh: list[tuple[int, float, int, BlockId]] = []
        while order and len(found) < n:
            entry = heapq.heappop(order)
            if listed.get(entry[3]) != entry[2]:
                continue  # stale (removed, renewed, expired or parked since): dropping it changes nothing
            fresh.append(entry)
            block = entry[3]
            if is_evictable(block):
                found.append(block)
        for entry in fresh:  # still retained until the pool removes them
            heapq.heappush(order, entry)
        return found

    @override
    def __len__(self) -> int:
        return len(self._hash)

    @override
    def check_invariants(self) -> None:
        assert len(self._policy) == len(self._hash), "the base tracks other blocks"
        assert self._low.keys().isdisjoint(self._kept), "a block is both low-priority and retained"
        assert self._in_use.isdisjoint(self._low), "a block in use is listed low-priority"
        for block in self._low:
            assert self._hints[block].priority < 0, f"block {block} is listed low-priority without the hint"
        assert self._in_use <= self._hash.keys() and self._kept.keys() <= self._hash.keys(), "untracked state"
        assert self._listed.keys() == self._kept.keys() - self._in_use, "a retained block is listed iff not in use"
        self._policy.check_invariants()
        self._check_capacity()
