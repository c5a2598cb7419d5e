"""Misuse of an ``OffloadManager`` the way a buggy engine would: calls it must refuse, changing nothing.

:data:`BAD_CALLS` maps a description to ``(needs, call)``; ``call(manager,
waiting_id, running_id)`` must raise a :class:`~kvkit.errors.KVKitError` and
leave :func:`snapshot` unchanged. ``needs`` names the request kinds the call
uses (``"waiting"``: looked up, not allocated; ``"running"``: allocated with
more than one computed block). Block ids and group counts are derived from
the manager the calls are given, so the table serves any manager.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import attrs

from kvkit.interfaces.types import BlockId, TransferResult
from kvkit.manager import OffloadManager

if TYPE_CHECKING:
    from kvkit.backends.allocator.pool import BlockPool

__all__ = ["BAD_CALLS", "snapshot"]


def snapshot(mgr: OffloadManager) -> tuple:
    """Everything a refused call must leave as it was: requests, references, stats, transfers, both pools."""
    reqs = {rid: copy.deepcopy(attrs.asdict(mgr.request(rid), recurse=False)) for rid in list(mgr._requests)}
    gpu = mgr.gpu
    return (reqs, mgr.cpu_refs_held(), mgr.gpu_refs_held(), mgr.stats.as_dict(), mgr.num_in_flight,
            mgr.next_transfer_id, [mgr.cpu.refcount(b) for b in map(BlockId, range(mgr.cpu.num_blocks))],
            None if gpu is None else [gpu.refcount(b) for b in map(BlockId, range(gpu.num_blocks))],
            cast("BlockPool", mgr.cpu).num_cached)


def _n(m: OffloadManager) -> int:
    return m.num_gpu_blocks or 1 << 20


def _short_table(m: OffloadManager, rid: str) -> list[list[BlockId]]:
    """``rid``'s table cut one block short of its computed tokens."""
    r = m.request(rid)
    keep = -(-r.num_computed_tokens // m.kv.block_size) - 1
    return [row[:keep] for row in r.block_table]


Call = Callable[[OffloadManager, str, str], object]

BAD_CALLS: dict[str, tuple[frozenset[str], Call]] = {k: (frozenset(n), c) for k, (n, c) in {
    "add: id not a str": ((), lambda m, w, r: m.add_request(7, [1], 4)),
    "add: unhashable id": ((), lambda m, w, r: m.add_request(["x"], [1], 4)),
    "add: live id": (("waiting",), lambda m, w, r: m.add_request(w, [1], 4)),
    "add: str hash": ((), lambda m, w, r: m.add_request("x", ["a"], 4)),
    "add: bool hash": ((), lambda m, w, r: m.add_request("x", [True], 4)),
    "add: float hash": ((), lambda m, w, r: m.add_request("x", [1.0], 4)),
    "add: None hash": ((), lambda m, w, r: m.add_request("x", [None], 4)),
    "add: hashes not iterable": ((), lambda m, w, r: m.add_request("x", 5, 4)),
    "add: hashes a str": ((), lambda m, w, r: m.add_request("x", "12", 4)),
    "add: negative tokens": ((), lambda m, w, r: m.add_request("x", [1], -1)),
    "add: float tokens": ((), lambda m, w, r: m.add_request("x", [1], 4.0)),
    "add: too few tokens": ((), lambda m, w, r: m.add_request("x", [1, 2], 5)),
    "lookup: unknown": ((), lambda m, w, r: m.lookup("nope", 0)),
    "lookup: id a list": (("waiting",), lambda m, w, r: m.lookup([w], 0)),
    "lookup: running": (("running",), lambda m, w, r: m.lookup(r, 0)),
    "lookup: unaligned": (("waiting",), lambda m, w, r: m.lookup(w, 3)),
    "lookup: negative": (("waiting",), lambda m, w, r: m.lookup(w, -4)),
    "lookup: bool": (("waiting",), lambda m, w, r: m.lookup(w, True)),
    "lookup: beyond": (("waiting",), lambda m, w, r: m.lookup(w, 1 << 30)),
    "lookup: bad num_tokens": (("waiting",), lambda m, w, r: m.lookup(w, 0, num_tokens=-1)),
    "alloc: id beyond pool": (("waiting",), lambda m, w, r: m.on_allocated(w, [[_n(m) + 3, 1]])),
    "alloc: negative id": (("waiting",), lambda m, w, r: m.on_allocated(w, [[-2, 1]])),
    "alloc: float id": (("waiting",), lambda m, w, r: m.on_allocated(w, [[1.0, 2]])),
    "alloc: bool id": (("waiting",), lambda m, w, r: m.on_allocated(w, [[True, 2]])),
    "alloc: str id": (("waiting",), lambda m, w, r: m.on_allocated(w, [["1", 2]])),
    "alloc: None id": (("waiting",), lambda m, w, r: m.on_allocated(w, [[None, 2]])),
    "alloc: duplicate id": (("waiting",), lambda m, w, r: m.on_allocated(w, [[5, 5]])),
    "alloc: groups": (("waiting",), lambda m, w, r: m.on_allocated(w, [[1, 2]] * (len(m.kv.groups) + 1))),
    "alloc: row not a sequence": (("waiting",), lambda m, w, r: m.on_allocated(w, [7])),
    "alloc: table not a sequence": (("waiting",), lambda m, w, r: m.on_allocated(w, None)),
    "alloc: accepted beyond offer": (("waiting",), lambda m, w, r: m.on_allocated(
        w, [[1, 2]], (m.request(w).offered_blocks + 1) * m.kv.block_size)),
    "alloc: running gets accepted": (("running",), lambda m, w, r: m.on_allocated(r, [m.request(r).block_table[0]], 4)),
    "alloc: running table shorter than computed": (("running",), lambda m, w, r: m.on_allocated(r, _short_table(m, r))),
    "append: duplicate of the table": (("running",),
                                       lambda m, w, r: m.append_blocks(r, [[m.request(r).block_table[0][0]]])),
    "append: duplicate within": (("running",), lambda m, w, r: m.append_blocks(r, [[30, 30]])),
    "append: beyond pool": (("running",), lambda m, w, r: m.append_blocks(r, [[_n(m)]])),
    "append: bool": (("running",), lambda m, w, r: m.append_blocks(r, [[True]])),
    "append: float": (("running",), lambda m, w, r: m.append_blocks(r, [[30.0]])),
    "append: groups": (("running",), lambda m, w, r: m.append_blocks(r, [[30]] * (len(m.kv.groups) + 1))),
    "append: waiting": (("waiting",), lambda m, w, r: m.append_blocks(w, [[30]])),
    "append: an iterator of a duplicate": (("running",), lambda m, w, r: m.append_blocks(
        r, iter([[m.request(r).block_table[0][0]]]))),
    "append: a tuple of a duplicate": (("running",), lambda m, w, r: m.append_blocks(
        r, ((m.request(r).block_table[0][0],),))),
    "append: rows an int": (("running",), lambda m, w, r: m.append_blocks(r, 5)),
    "append: rows None": (("running",), lambda m, w, r: m.append_blocks(r, None)),
    "append: a row an int": (("running",), lambda m, w, r: m.append_blocks(r, [7])),
    "extend: str hash": (("running",), lambda m, w, r: m.extend(r, ["h"])),
    "extend: bad tokens": (("running",), lambda m, w, r: m.extend(r, [1], num_tokens=-1)),
    "extend: tokens below blocks": (("running",), lambda m, w, r: m.extend(r, [1], num_tokens=4)),
    "computed: float": (("running",), lambda m, w, r: m.on_computed(r, 8.0)),
    "computed: bool": (("running",), lambda m, w, r: m.on_computed(r, True)),
    "computed: decreasing": (("running",), lambda m, w, r: m.on_computed(r, m.request(r).num_computed_tokens - 1)),
    "computed: beyond table": (("running",), lambda m, w, r: m.on_computed(
        r, len(m.request(r).block_table[0]) * m.kv.block_size + 1)),
    "computed: str": (("running",), lambda m, w, r: m.on_computed(r, "12")),
    "computed: None": (("running",), lambda m, w, r: m.on_computed(r, None)),
    "advance: not iterable": ((), lambda m, w, r: m.advance(5)),
    "advance: not a 4-tuple": (("running",), lambda m, w, r: m.advance([(r, None, None)])),
    "advance: decreasing": (("running",), lambda m, w, r: m.advance(
        [(r, None, None, m.request(r).num_computed_tokens - 1)])),
    "advance: waiting": (("waiting",), lambda m, w, r: m.advance([(w, None, None, 0)])),
    "advance: str hash": (("running",), lambda m, w, r: m.advance([(r, None, ["h"], None)])),
    "advance: a block twice": (("running",), lambda m, w, r: m.advance(
        [(r, [[m.request(r).block_table[0][0]]], None, None)])),
    "advance: count beyond its new block": (("running",), lambda m, w, r: m.advance(
        [(r, [[30]], [1], (len(m.request(r).block_table[0]) + 2) * m.kv.block_size)])),
    "results: None item": ((), lambda m, w, r: m.apply_completions([None])),
    "results: not iterable": ((), lambda m, w, r: m.apply_completions(5)),
    "results: a good one then junk": ((), lambda m, w, r: m.apply_completions([TransferResult(0), "done"])),
    "results: a lost position negative": ((), lambda m, w, r: m.apply_completions([TransferResult(0, lost=[-1])])),
    "reset: force not bool": ((), lambda m, w, r: m.reset(force="yes")),
    "finish: id not a str": ((), lambda m, w, r: m.finish(123)),
    "finish: bad progress": (("running",), lambda m, w, r: m.finish(r, -1)),
    "abort: None": ((), lambda m, w, r: m.abort(None)),
    "preempt: waiting": (("waiting",), lambda m, w, r: m.preempt(w)),
}.items()}
