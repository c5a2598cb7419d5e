"""The ``StorePolicy`` protocol: which GPU blocks are copied to the CPU tier, and when."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from kvkit.interfaces.types import BlockHash

__all__ = ["RequestView", "StorePolicy"]


@runtime_checkable
class RequestView(Protocol):
    """What a store policy may read about one request (read-only)."""

    @property
    def request_id(self) -> str:
        """The engine's request id."""
        ...

    @property
    def block_hashes(self) -> Sequence[BlockHash]:
        """Chained hashes of the request's full blocks so far, in order."""
        ...

    @property
    def num_confirmed_blocks(self) -> int:
        """Full blocks whose KV the engine confirmed computed (safe to store)."""
        ...


@runtime_checkable
class StorePolicy(Protocol):
    """Decides which confirmed GPU blocks go to the CPU tier. Decides, never acts.

    The manager asks the policy, filters its answer, and builds the copies. The
    policy names blocks by their index in the request (``0`` is the first
    block of the prompt).

    Invariants (kept by the manager whatever a policy answers):
        * Only confirmed blocks (index ``< num_confirmed_blocks``) are stored.
        * A hash already on the CPU tier, or with a store in flight, is not
          stored again (deduplication across requests and steps).
        * Indices are re-derived from the request each time, never from a
          cursor cached across CPU evictions: a block evicted from the CPU
          tier while still on the GPU can be stored again.

    What a policy promises (``kvkit.testing.StorePolicyContract`` checks it):
        * ``on_computed`` answers ints in ``[start, stop)``; ``on_finished``
          answers ints below ``num_confirmed_blocks``; repeats are allowed
          (the manager drops them).
        * ``writeback_target`` answers an int in ``[0, gpu_blocks]``, the same
          for the same arguments. The manager asks ``writeback_target(0,
          gpu_blocks)`` once, when it is built: a policy that answers 0 there
          is never asked again (it does not write back).
        * The policy never changes the ``RequestView`` it is handed.
    """

    def on_computed(self, request: RequestView, start: int, stop: int) -> Iterable[int]:
        """Blocks ``[start, stop)`` of ``request`` were just confirmed; return indices to store now.

        ``start`` is 0 at a request's first confirmation (its GPU prefix hits
        included) and again after every preemption.
        """
        ...

    def on_finished(self, request: RequestView) -> Iterable[int]:
        """``request`` finished; return indices to store before its GPU blocks are released."""
        ...

    def writeback_target(self, gpu_free: int, gpu_blocks: int) -> int:
        """How many of the GPU pool's next eviction candidates to keep stored ahead.

        Write-back (lazy) policies return a watermark, which needs a GPU pool
        that is an :class:`~kvkit.interfaces.capabilities.EvictionOrder`
        (checked once, when the manager is built); the others return 0.
        """
        ...
