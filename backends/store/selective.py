"""Store a block only once its hash was confirmed by ``k`` different requests."""

from __future__ import annotations

from itertools import islice

import attrs
from typing_extensions import override

from kvkit.interfaces.store import RequestView, StorePolicy
from kvkit.interfaces.types import BlockHash
from kvkit.validate import at_least

__all__ = ["SelectiveStore"]


@attrs.define
class SelectiveStore(StorePolicy):
    """Stores a block once ``k`` distinct requests confirmed its hash (reuse filter).

    One-off prompts never reach the CPU tier; shared prefixes (system prompts,
    earlier turns) do, from their ``k``-th use on. Back-to-back sightings by
    one request count once (a request confirming its blocks again after a
    preemption is not a second user). Sightings are
    kept for the ``max_tracked`` most recently first-seen hashes (oldest
    forgotten first), so memory stays bounded on endless traces.

    Args:
        k: distinct requests that must confirm a hash before it is stored
            (``k=1`` behaves like eager write-through).
        max_tracked: hashes whose sightings are remembered.

    Invariants: an index is answered only if its hash's count is ``>= k``;
    at most ``max_tracked`` hashes are tracked.
    """

    k: int = attrs.field(default=2, validator=at_least(1))
    max_tracked: int = attrs.field(default=1 << 20, validator=at_least(1))
    # hash -> [distinct requests seen, last request id]; insertion order = age.
    _seen: dict[BlockHash, list] = attrs.field(init=False, factory=dict, repr=False)

    def count(self, block_hash: BlockHash) -> int:
        """Distinct requests that confirmed ``block_hash`` (0 if unknown or forgotten)."""
        entry = self._seen.get(block_hash)
        return entry[0] if entry else 0

    @override
    def on_computed(self, request: RequestView, start: int, stop: int) -> list[int]:
        seen, k, rid = self._seen, self.k, request.request_id
        hashes = request.block_hashes
        chosen = []
        for i in range(start, stop):
            h = hashes[i]
            entry = seen.get(h)
            if entry is None:
                seen[h] = entry = [1, rid]
            elif entry[1] != rid:
                entry[0] += 1
                entry[1] = rid
            if entry[0] >= k:
                chosen.append(i)
        excess = len(seen) - self.max_tracked
        if excess > 0:
            for h in list(islice(seen, excess)):
                del seen[h]
        return chosen

    @override
    def on_finished(self, request: RequestView) -> list[int]:
        # Flush: blocks whose hash crossed k since they were confirmed here.
        seen, k, hashes = self._seen, self.k, request.block_hashes
        return [i for i in range(request.num_confirmed_blocks)
                if (e := seen.get(hashes[i])) is not None and e[0] >= k]

    @override
    def writeback_target(self, gpu_free: int, gpu_blocks: int) -> int:
        return 0

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the sighting table is inconsistent."""
        assert len(self._seen) <= self.max_tracked, (len(self._seen), self.max_tracked)
        assert all(e[0] >= 1 for e in self._seen.values()), "a tracked hash with no sighting"
