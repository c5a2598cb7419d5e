"""Ended request incarnations: the delayed free of their GPU blocks, and which ids ended lately.

An incarnation's ``holds`` counts the in-flight batches and detached stores
that read or write its GPU blocks. An ended request whose blocks are still
touched while the manager holds no GPU reference on them (external engines)
is parked with ``delay_free``: the engine keeps its blocks until the last
hold drops, and the id is then released (listed once in a report's
``released``).

Invariants: a parked request is ended, ``delay_free`` and ``holds > 0``; an id
is released at most once per incarnation; at most ``_REMEMBER_ENDED`` recent
ids are remembered, oldest dropped first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import attrs

from kvkit.manager.requests import Request, RequestState

__all__ = ["EndedRequests"]

_REMEMBER_ENDED = 1 << 16  # ended ids remembered to tell "already finished" from "unknown"


@attrs.define
class EndedRequests:
    """Parked incarnations awaiting their delayed free, recently ended ids, ids released."""

    _parked: dict[str, Request] = attrs.field(init=False, factory=dict)
    _recent: OrderedDict[str, None] = attrs.field(init=False, factory=OrderedDict)  # O(1) pop of the oldest
    _released: set[str] = attrs.field(init=False, factory=set)

    def __contains__(self, request_id: str) -> bool:
        """``request_id`` ended: parked, or remembered as recently ended."""
        return request_id in self._parked or request_id in self._recent

    def is_parked(self, request_id: str) -> bool:
        """``request_id`` ended and the engine still keeps its GPU blocks for it."""
        return request_id in self._parked

    def parked(self) -> Iterable[Request]:
        """The incarnations awaiting their delayed free."""
        return self._parked.values()

    def revive(self, request_id: str) -> None:
        """``request_id`` is live again (a new request reuses it)."""
        self._recent.pop(request_id, None)

    def end(self, r: Request, delay_free: bool) -> None:
        """``r`` finished or was aborted; park it if the engine must keep its blocks."""
        r.delay_free = delay_free
        if delay_free:
            self._parked[r.request_id] = r
        else:
            self._remember(r.request_id)

    def drop_holds(self, owners: Iterable[Request | None]) -> None:
        """One batch or detached store of each of ``owners`` is done (an owner may repeat, ``None`` is skipped);
        release a parked owner at its last hold."""
        ended = RequestState.ENDED
        for r in owners:
            if r is None:
                continue
            r.holds -= 1
            if not r.holds and r.state is ended and r.delay_free:
                rid = r.request_id
                self._released.add(rid)
                if self._parked.get(rid) is r:
                    del self._parked[rid]
                    self._remember(rid)

    def take_released(self) -> frozenset[str]:
        """Ids released since the last call."""
        out = frozenset(self._released)
        self._released.clear()
        return out

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if a parked incarnation should not be parked."""
        for rid, r in self._parked.items():
            assert r.request_id == rid, (rid, r.request_id)
            assert r.state is RequestState.ENDED and r.delay_free and r.holds > 0, rid
        assert len(self._recent) <= _REMEMBER_ENDED, len(self._recent)

    def _remember(self, rid: str) -> None:
        self._recent[rid] = None
        if len(self._recent) > _REMEMBER_ENDED:
            self._recent.popitem(last=False)
