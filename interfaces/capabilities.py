"""Optional capabilities: protocols a component may satisfy beyond its main one.

Each is runtime-checkable and checked *once*, where a component is adopted (a
pool's constructor, a registry's probe, the transfer engine's construction,
the manager's build), never by ``getattr`` at a call site. None carries
default behaviour: a component defines the members or lacks the capability.
A method member set to ``None`` counts as absent (``isinstance`` refuses it),
so a subclass can opt out of a capability its parent has.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from kvkit.errors import ConfigError
from kvkit.interfaces.allocator import BlockAllocator
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.types import BlockHash, BlockId

__all__ = [
    "BatchedLookup",
    "BatchedPolicy",
    "EvictionOrder",
    "EvictionWindow",
    "ExplainsUnavailability",
    "HeadCompute",
    "IndexedPolicy",
    "LayeredCopy",
    "PinAwarePolicy",
    "PrefillCompute",
    "ReportsAvailability",
    "SelfChecking",
    "TimedCopy",
    "WindowedPolicy",
    "batch_hooks",
    "pin_hooks",
]


@runtime_checkable
class PinAwarePolicy(EvictionPolicy, Protocol):
    """An eviction policy that also hears when its blocks come into and go out of use.

    A driver (a pool) that finds this capability reports every such
    transition, so the policy can set in-use blocks aside instead of
    skipping them in every :meth:`~EvictionPolicy.select_victims`.

    Invariants:
        * Between ``on_pin(b)`` and the next ``on_unpin(b)`` or
          :meth:`~EvictionPolicy.on_remove` (either may follow),
          ``is_evictable(b)`` is false; after ``on_unpin(b)`` it may be true
          again and ``b`` must be selectable again. ``on_access`` may arrive
          in between (a hit on a block in use).
        * A driver calls ``on_pin`` only on an unpinned tracked block and
          ``on_unpin`` only on a pinned one (the built-in policies raise
          ``PoolUsageError`` otherwise); a removed block is no longer pinned.
        * The converse does not hold: a driver may call no hooks at all, so
          ``select_victims`` still honours ``is_evictable`` for every block
          and returns only evictable ones.
        * A driver decides once, when it adopts the policy (:func:`pin_hooks`),
          whether to call the hooks; hooks added to the object later are not used.
    """

    def on_pin(self, block: BlockId) -> None:
        """A tracked block came into use: its first reference was taken (refcount 0 -> 1).

        A block inserted while referenced (a pool commits every block that way)
        gets ``on_pin`` right after :meth:`~EvictionPolicy.on_insert`.
        """
        ...

    def on_unpin(self, block: BlockId) -> None:
        """A pinned block's last reference went (refcount 1 -> 0)."""
        ...


def pin_hooks(policy: EvictionPolicy) -> tuple[Callable[[BlockId], None], Callable[[BlockId], None]] | None:
    """``policy``'s bound ``(on_pin, on_unpin)`` if it is a :class:`PinAwarePolicy`, else ``None``.

    Call it once, when adopting the policy.

    Raises:
        ConfigError: ``policy`` defines one hook without the other, or a hook
            that is not callable (half a capability is a mistake, not an opt-out).
    """
    if isinstance(policy, PinAwarePolicy) and callable(policy.on_pin) and callable(policy.on_unpin):
        return policy.on_pin, policy.on_unpin
    # Not the capability: only say why when it looks like an attempt at it.
    on_pin, on_unpin = getattr(policy, "on_pin", None), getattr(policy, "on_unpin", None)
    if on_pin is None and on_unpin is None:
        return None
    raise ConfigError(
        f"eviction policy {type(policy).__name__} needs both pin hooks callable or neither, "
        f"got on_pin={on_pin!r}, on_unpin={on_unpin!r}"
    )


@runtime_checkable
class IndexedPolicy(EvictionPolicy, Protocol):
    """An eviction policy that reads its driver's hash index instead of keeping a copy of its own.

    A prefix-aware policy needs the block of a hash (a parent's, to link its
    children) and the hash of a block; a pool already keeps both, a map for
    :meth:`~BlockAllocator.lookup` and a hash per block id. A pool that finds
    this capability hands them over once, so a tracked block costs one map
    entry and one hash slot instead of two, and tells its size, so the
    policy can size its per-block arrays once instead of growing them.

    Invariants:
        * The driver calls :meth:`use_index` at most once, before the policy
          tracks any block, and never replaces the map afterwards; it names
          no block id of ``num_blocks`` or more.
        * At every notification, ``index`` maps the hash of each block the
          policy tracks to that block and ``hashes[b]`` is the hash of each
          such block ``b``: the driver sets a block's entry and hash before
          it tells the policy of the insert and clears them after it tells
          of the removal, so during a call they may also hold blocks that
          call inserts or removes. The policy ignores what it finds there
          for a block it does not track.
        * The policy only reads ``index`` and ``hashes``; a policy never given
          them keeps its own.
    """

    def use_index(self, index: Mapping[BlockHash, BlockId], hashes: Sequence[BlockHash | None],
                  num_blocks: int) -> None:
        """Read blocks by hash from ``index`` and hashes by block from ``hashes`` from now on (the driver
        keeps both as promised); every block id the driver uses is below ``num_blocks`` (an int >= 1)."""
        ...


@runtime_checkable
class BatchedPolicy(PinAwarePolicy, Protocol):
    """A pin-aware policy that also hears a pool call's blocks in one call, not one call per block.

    The per-block hooks stay the reference: each batch hook is defined as
    the per-block hooks called for its blocks in order, and a policy's tests
    compare the two. A driver that finds the capability (:func:`batch_hooks`)
    may use either for any call.

    Invariants:
        * ``insert_pinned(blocks, hashes, parents)`` leaves the policy exactly
          as ``on_insert(b, h, p)`` then ``on_pin(b)`` for each triple in order
          would (a pool commits every block referenced); ``pin_many``,
          ``unpin_many``, ``access_many`` and ``remove_many`` exactly as
          ``on_pin``, ``on_unpin``, ``on_access`` and ``on_remove`` for each
          block in order: the same state, hence the same later selections.
        * The per-block hooks' preconditions hold for each block in its turn
          (a driver validates first); on a violation a batch raises as the
          per-block hook would, with the blocks before it applied.
    """

    def insert_pinned(self, blocks: Sequence[BlockId], hashes: Sequence[BlockHash],
                      parents: Sequence[BlockHash | None]) -> None:
        """Each ``blocks[i]`` became ready under ``hashes[i]`` (parent ``parents[i]``) and is in use."""
        ...

    def pin_many(self, blocks: Sequence[BlockId]) -> None:
        """``on_pin`` for each block, in order."""
        ...

    def unpin_many(self, blocks: Sequence[BlockId]) -> None:
        """``on_unpin`` for each block, in order."""
        ...

    def access_many(self, blocks: Sequence[BlockId]) -> None:
        """``on_access`` for each block, in order."""
        ...

    def remove_many(self, blocks: Sequence[BlockId]) -> None:
        """``on_remove`` for each block, in order."""
        ...


_BATCH_HOOKS = ("insert_pinned", "pin_many", "unpin_many", "access_many", "remove_many")


def batch_hooks(policy: EvictionPolicy) -> BatchedPolicy | None:
    """``policy`` if it is a :class:`BatchedPolicy` (with its pin hooks), else ``None``.

    Call it once, when adopting the policy.

    Raises:
        ConfigError: ``policy`` defines some batch hooks but not all, or one
            that is not callable (half a capability is a mistake, not an opt-out).
    """
    hooks = [getattr(policy, name, None) for name in _BATCH_HOOKS]
    if all(callable(hook) for hook in hooks) and isinstance(policy, BatchedPolicy) \
            and pin_hooks(policy) is not None:
        return policy
    if all(hook is None for hook in hooks):
        return None
    raise ConfigError(
        f"eviction policy {type(policy).__name__} needs all batch hooks callable, with its pin hooks, "
        f"or none, got " + ", ".join(f"{name}={hook!r}" for name, hook in zip(_BATCH_HOOKS, hooks)))


@runtime_checkable
class BatchedLookup(BlockAllocator, Protocol):
    """A pool that tells in one call which of many hashes a ready block carries; the manager's store
    planning asks it about every candidate of a step.

    Invariants:
        * ``contains_many(hashes)[i] == bool(lookup([hashes[i]]))`` for every ``i``; it changes nothing.
        * Every hash must be an int (a NumPy integer is converted), else ``PoolUsageError``.
    """

    def contains_many(self, hashes: Sequence[BlockHash]) -> list[bool]:
        """Per hash, in order, whether a ready block carries it."""
        ...


@runtime_checkable
class EvictionOrder(BlockAllocator, Protocol):
    """A pool that can preview its eviction order; write-back store policies need one.

    Invariants:
        * ``eviction_candidates(n)`` returns ``min(n, evictable blocks)``
          distinct evictable blocks, the next victim first: those
          :meth:`~BlockAllocator.allocate` would evict next, in that order.
        * It evicts nothing and changes no refcount, hash or index entry (a
          policy whose selection updates internal state, such as CLOCK bits,
          updates it as a real selection would).
        * A count that is not a non-negative int raises ``PoolUsageError``.
    """

    def eviction_candidates(self, n: int) -> list[BlockId]:
        """The next up-to-``n`` blocks the policy would evict now, next victim first."""
        ...


@runtime_checkable
class EvictionWindow(EvictionOrder, Protocol):
    """A pool that follows its next eviction candidates as they change; write-back reads it incrementally.

    Invariants:
        * ``eviction_window(n)`` returns the blocks among ``eviction_candidates(n)``
          now (as a set) that were not among them at the previous call with
          the same ``n`` (all of them at the first call, or when ``n``
          changed), each once, the earliest to join first; repeated calls with
          nothing changed in between return ``[]``.
        * ``in_eviction_window(b)`` tells whether ``b`` is among the candidates
          of the latest ``eviction_window`` call, as they are now (valid until
          the pool changes).
        * Neither evicts anything or changes a refcount, hash or index entry;
          a count that is not a non-negative int raises ``PoolUsageError``.
        * With a policy whose selection changes its state (S3-FIFO), "the
          candidates now" are those of the selection the call itself makes.
    """

    def eviction_window(self, n: int) -> list[BlockId]:
        """The blocks that joined the next ``n`` eviction candidates since the previous call."""
        ...

    def in_eviction_window(self, block: BlockId) -> bool:
        """Whether ``block`` is one of the next ``n`` eviction candidates (``n`` of the latest window call)."""
        ...


@runtime_checkable
class WindowedPolicy(PinAwarePolicy, Protocol):
    """A pin-aware policy that tracks its next ``n`` victims itself, so its pool's window costs O(change).

    The window is the first ``n`` blocks :meth:`~EvictionPolicy.select_victims`
    would return if every unpinned tracked block were evictable (as it is
    under a pool that calls the pin hooks). A pool uses the capability only
    together with the hooks.

    Invariants:
        * After ``watch(n)`` and until the next ``watch``, ``in_window(b)`` is
          true exactly for the blocks of that window, after every notification.
        * ``entered()`` returns, and forgets, the blocks that joined the window
          since the previous ``entered()`` (or ``watch``) and are still in it,
          each once; together with the blocks in it at the previous call they
          make up the whole window.
    """

    def watch(self, n: int) -> None:
        """Track the first ``n`` victims from now on (``0``: stop)."""
        ...

    def entered(self) -> list[BlockId]:
        """The blocks that joined the window since the previous call and are still in it."""
        ...

    def in_window(self, block: BlockId) -> bool:
        """Whether ``block`` is in the window now."""
        ...


@runtime_checkable
class ReportsAvailability(Protocol):
    """A component class (or factory) that can tell whether it runs on this machine.

    A registry checks the loaded class itself, so ``is_available`` is a
    ``classmethod`` or ``staticmethod``; a component without it is available
    wherever it imports.

    Invariants: ``is_available()`` builds nothing and is safe to call from a
    listing; a registry treats an exception from it as "unavailable".
    """

    @classmethod
    def is_available(cls) -> bool:
        """Whether the component's libraries and devices are present here."""
        ...


@runtime_checkable
class ExplainsUnavailability(ReportsAvailability, Protocol):
    """A component class that also says *why* it cannot run here (``kvkit list`` shows it).

    Invariants: ``unavailable_reason()`` is ``None`` exactly when
    ``is_available()`` is true, else a one-line reason; like
    ``is_available`` it is a ``classmethod`` or ``staticmethod``.
    """

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why the component cannot run on this machine, or ``None`` if it can."""
        ...


@runtime_checkable
class SelfChecking(Protocol):
    """A component that can verify its own internal state (tests, notebooks, its owner's checks).

    Invariants: ``check_invariants()`` changes nothing; it raises
    ``AssertionError`` when the state is inconsistent and returns ``None``
    otherwise. It may be slow: never on a hot path.
    """

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if internal state is inconsistent."""
        ...


@runtime_checkable
class LayeredCopy(Protocol):
    """A copy backend that runs a plan in stages of regions and marks each stage's completion on the device.

    What layer-wise pipelining needs: a load whose first layers are readable
    while later ones still copy, a store whose layer ``i`` reads only after
    the kernel that wrote layer ``i``.

    Invariants (kvkit's ``CopyBackendContract`` checks them):
        * ``stages`` are consecutive, non-empty ``range`` s that cover the
          plan's group's regions (indices in registration order) exactly;
          anything else raises ``PlanError`` and launches nothing.
        * ``after`` is one event (waited for before the first stage) or a
          sequence with one event (or ``None``) per stage, waited for before
          that stage: a stage never reads its source before its event.
        * The answer is one handle for the whole plan (reported by ``poll``
          exactly once, as ``submit``'s) and exactly one tuple per stage, of
          device events that complete once that stage and every earlier one
          landed; an empty tuple means the stage already landed (its bytes are
          in place when ``submit_stages`` returns). A consumer makes its
          stream wait for them (no host synchronisation) before it reads; the
          ``TransferEngine`` waits whole (by poll) for a load whose answer is
          not one tuple per stage or has a stage without events.
        * A raising call leaves nothing of the plan running, as ``submit``.
    """

    def submit_stages(self, plan: Any, stages: Any, *, after: Any = None) -> tuple[int, list[tuple[Any, ...]]]:
        """Launch ``plan`` stage by stage; answer its handle and each stage's completion events."""
        ...


@runtime_checkable
class TimedCopy(Protocol):
    """A copy backend that measures its copies' own time (what bandwidth figures divide by).

    Invariants:
        * After :meth:`~kvkit.interfaces.CopyBackend.poll` reported ``handle``,
          ``copy_seconds(handle)`` answers the seconds its bytes spent moving
          (from the copy's start to its end, not to the poll that saw it),
          until the next ``poll``; ``None`` for a handle it did not time or
          that an earlier poll reported.
    """

    def copy_seconds(self, handle: int) -> float | None:
        """The copy's own seconds of ``handle``, reported by the last poll; ``None`` if not timed."""
        ...


@runtime_checkable
class PrefillCompute(Protocol):
    """The forward pass of the reference engine loop: writes the KV a scheduled prefill recomputes.

    The engine is a :class:`kvkit.reference.engine.ReferenceEngine` and the
    request one of its ``EngineRequest`` s (annotated loosely: interfaces
    import nothing of the layers above them).

    Invariants the engine keeps for it: :meth:`prefill` runs once per scheduled
    request and step, after the step's loads landed (blocks before
    ``first_block`` of every group hold the reused KV: GPU hits, then the head
    a :class:`HeadCompute` wrote, then loaded CPU hits) and before the engine
    publishes the request's full blocks and confirms them to the manager, so
    only what it wrote can be stored. With a
    ``layered`` engine the loads may still run: the compute calls
    ``engine.wait_layer(layer)`` before it reads a layer's reused blocks, and a
    request whose load then fails is computed again without its CPU hit.
    """

    def prefill(self, engine: Any, request: Any, first_block: int) -> int:
        """Write the KV of ``request``'s blocks ``first_block..`` into its GPU blocks (``request.table``).

        Returns:
            Reused blocks found with wrong bytes (0 when it checks none).
        """
        ...


@runtime_checkable
class HeadCompute(PrefillCompute, Protocol):
    """A prefill compute that also computes the *head* of a hit while the hit's tail loads.

    A load plan (:mod:`kvkit.interfaces.plan`) may recompute the first blocks
    of a CPU or shared-tier hit instead of loading them, at the same time as
    the rest loads. An engine whose compute has this capability runs those
    plans; with any other compute it asks only for plans that load a prefix.

    Invariants the engine keeps for it: :meth:`prefill_head` runs once per
    scheduled request with a head and step, before :meth:`prefill`, while
    the step's loads may still be running; the blocks it reads (before
    ``start``: the GPU hit) are in place and no load writes the blocks it
    writes. :meth:`prefill` then sees the head as reused KV (its blocks are
    before ``first_block``).
    """

    def prefill_head(self, engine: Any, request: Any, start: int, stop: int) -> None:
        """Write the KV of ``request``'s blocks ``[start, stop)`` from the blocks before ``start``."""
        ...
