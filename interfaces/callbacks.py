"""``OffloadCallback``: hooks for every offload event (Lightning style)."""

from __future__ import annotations

from kvkit.interfaces.types import BlockHash, BlockId, Direction, Tier

__all__ = ["OffloadCallback"]


class OffloadCallback:
    """Override any hook to observe a stack; every hook is a no-op here.

    Callbacks observe; they are never needed for correctness. An exception
    raised inside one is contained: the call that emitted the event completes
    as if the callback had returned, the error is counted in
    ``OffloadStats.callback_errors``, and a ``RuntimeWarning`` names the hook
    (once per callback and hook), so a bug in an observer is neither silent
    nor able to wedge the tier.
    """

    def on_lookup(self, request_id: str, gpu_hit_tokens: int, cpu_hit_tokens: int) -> None:
        """A lookup found ``cpu_hit_tokens`` on the CPU tier beyond the GPU hit."""

    def on_transfer_submitted(self, transfer_id: int, direction: Direction, num_blocks: int) -> None:
        """A store or load of ``num_blocks`` blocks entered the step plan."""

    def on_transfer_completed(self, transfer_id: int, direction: Direction, num_blocks: int,
                              ok: bool) -> None:
        """A transfer completed on every worker (``ok`` is ``False`` if any failed or it was abandoned)."""

    def on_cpu_stored(self, hashes: list[BlockHash], parents: list[BlockHash | None]) -> None:
        """``hashes`` became findable on the CPU tier (a store from the GPU, or a fetch from the shared tier).

        ``parents[i]`` is the hash before ``hashes[i]`` in its request's chain
        (``None`` for a first block, or where the store did not know it). A hash
        the CPU tier already held is not repeated here.
        """

    def on_shared_stored(self, hashes: list[BlockHash]) -> None:
        """A put landed on every worker: the shared tier holds ``hashes``."""

    def on_evict(self, tier: Tier, block: BlockId, block_hash: BlockHash) -> None:
        """``tier`` evicted ``block`` holding ``block_hash`` (a str enum: ``tier == "cpu"`` works)."""

    def on_request_finished(self, request_id: str, aborted: bool) -> None:
        """A request finished or was aborted; its per-request state is being released."""

    def on_request_preempted(self, request_id: str) -> None:
        """A running request was preempted; it waits to be looked up again."""

    def on_reset(self, dropped_blocks: int) -> None:
        """The CPU tier was emptied after draining in-flight transfers."""

    def on_shared_hit(self, request_id: str, shared_hit_tokens: int) -> None:
        """The engine accepted ``shared_hit_tokens`` from the shared tier (they are fetched, then loaded)."""

    def on_shared_prefetch(self, request_id: str, prefetch_tokens: int) -> None:
        """A waiting request's shared-tier hit of ``prefetch_tokens`` is being fetched into the CPU tier (prefetch)."""

    def on_shared_fetch(self, num_blocks: int, ok: bool) -> None:
        """``num_blocks`` blocks of a shared-tier fetch into CPU blocks settled: ``ok``, they landed on every
        worker; else they failed. A fetch settles key by key: once for its blocks that landed, once for those
        that failed."""

    def on_shared_put(self, num_blocks: int, ok: bool) -> None:
        """A put of ``num_blocks`` CPU blocks into the shared tier settled (``ok``: landed on every worker)."""

    def on_shared_state(self, available: bool, reason: str) -> None:
        """The shared tier turned off (a failure; it backs off) or came back on (a probe succeeded)."""
