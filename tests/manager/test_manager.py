"""``OffloadManager`` unit tests: the request life, plans, completions, reset, errors, regressions."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kvkit.backends.allocator import BlockPool
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.backends.store import EagerStore, LazyStore, NeverStore
from kvkit.errors import ConfigError, RequestStateError, UnknownRequestError
from kvkit.interfaces import (
    Direction,
    GroupKind,
    KVCacheSpec,
    KVGroupSpec,
    OffloadCallback,
    RequestView,
    TransferResult,
)
from kvkit.manager import OffloadManager, RequestState
from kvkit.manager.step import StepPlan
from kvkit.stats import Counter, OffloadStats

BS = 4
SPEC = KVCacheSpec(num_layers=2, block_size=BS, num_kv_heads=1, head_dim=2)
HYBRID = KVCacheSpec(num_layers=2, block_size=BS, num_kv_heads=1, head_dim=2,
                     groups=[KVGroupSpec([0]),
                             KVGroupSpec([1], GroupKind.SLIDING_WINDOW, window=BS)])


def make(store=None, *, cpu=8, gpu=16, world=1, spec=SPEC, own_gpu=True, **kw) -> OffloadManager:
    return OffloadManager(spec, BlockPool(cpu, eviction=LRUPolicy()), store or EagerStore(),
                          gpu=BlockPool(gpu, eviction=LRUPolicy()) if own_gpu else None,
                          world_size=world, **kw)


def results(plan: StepPlan, ok: bool = True, workers: int = 1) -> list[TransferResult]:
    """Every worker's result for every transfer of ``plan``."""
    return [TransferResult(tid, worker=w, ok=ok) for tid, _ in plan for w in range(workers)]


def hashes(prefix: int, n: int) -> list[int]:
    return [prefix * 1000 + i for i in range(n)]


def stored(mgr: OffloadManager, rid: str, hs: list[int], tokens: int, blocks: int) -> None:
    """Request ``rid`` computes ``tokens`` tokens over ``blocks`` fresh GPU blocks per group; its stores land."""
    mgr.add_request(rid, hs, tokens)
    mgr.lookup(rid, 0)
    mgr.on_allocated(rid, [mgr.gpu.allocate(blocks) for _ in mgr.kv.groups])
    mgr.on_computed(rid, tokens)
    mgr.apply_completions(results(mgr.build_step()))


def schedule(mgr: OffloadManager, rid: str, hs: list[int], ntok: int, *, gpu_hit: int = 0,
             accept: int | None = None, table: list[int] | None = None) -> list[int]:
    """Add (if new), look up, allocate (from the manager's GPU pool) and accept the hit."""
    if rid not in mgr._requests:
        mgr.add_request(rid, hs, ntok)
    extra = mgr.lookup(rid, gpu_hit * BS)
    if table is None:
        table = mgr.gpu.allocate(-(-ntok // BS))
    mgr.on_allocated(rid, [table], extra if accept is None else accept)
    return table


def store_all(mgr: OffloadManager, rid: str, hs: list[int], ntok: int) -> list[int]:
    """Run a request to completion and apply its stores; returns its GPU table (still held)."""
    table = schedule(mgr, rid, hs, ntok)
    mgr.on_computed(rid, ntok)
    mgr.apply_completions(results(mgr.build_step()))
    return table


# -- construction --------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"world": 0}, "world_size"),
    ({"world": True}, "world_size"),
    ({"callbacks": [object()]}, "callbacks"),
    ({"null_block": "x"}, "null_block"),
])
def test_bad_options_are_config_errors(kwargs, match):
    """Bad manager options raise ConfigError quoting the value."""
    with pytest.raises(ConfigError, match=match):
        make(**kwargs)


def test_components_are_checked_at_build():
    """A CPU pool, GPU pool or store policy that is not one raises ConfigError naming it."""
    with pytest.raises(ConfigError, match="cpu must be a BlockAllocator"):
        OffloadManager(SPEC, object(), EagerStore())
    with pytest.raises(ConfigError, match="gpu must be a BlockAllocator"):
        OffloadManager(SPEC, BlockPool(4, eviction=LRUPolicy()), EagerStore(), gpu=object())
    with pytest.raises(ConfigError, match="store must be a StorePolicy"):
        OffloadManager(SPEC, BlockPool(4, eviction=LRUPolicy()), object())


def test_write_back_needs_a_gpu_pool_and_one_group():
    """The lazy policy reads GPU eviction candidates: no GPU pool or a hybrid spec is a ConfigError."""
    with pytest.raises(ConfigError, match="gpu="):
        make(LazyStore(), own_gpu=False)
    with pytest.raises(ConfigError, match="one KV group"):
        make(LazyStore(), spec=HYBRID)


def test_cpu_capacity_below_one_block_is_a_config_error():
    """A CPU tier too small for one block fails where it is sized (the pool), not in the manager."""
    assert SPEC.blocks_for(SPEC.bytes_per_block - 1) == 0
    with pytest.raises(ConfigError, match="num_blocks"):
        BlockPool(SPEC.blocks_for(SPEC.bytes_per_block - 1), eviction=LRUPolicy())


# -- typed errors --------------------------------------------------------------


def test_unknown_ids_raise_unknown_request_error_quoting_the_id():
    """Every per-request call on an id never added raises UnknownRequestError naming it."""
    mgr = make()
    calls = [lambda: mgr.lookup("ghost", 0), lambda: mgr.on_allocated("ghost", [[]]),
             lambda: mgr.on_computed("ghost", 0), lambda: mgr.finish("ghost"),
             lambda: mgr.abort("ghost"), lambda: mgr.preempt("ghost"),
             lambda: mgr.extend("ghost", []), lambda: mgr.append_blocks("ghost", [[]])]
    for call in calls:
        with pytest.raises(UnknownRequestError, match="'ghost'"):
            call()


def test_second_finish_and_calls_after_finish_are_state_errors():
    """A finished (or aborted) id raises RequestStateError, never a silent no-op."""
    mgr = make()
    mgr.add_request("a", [], 3)
    mgr.finish("a")
    with pytest.raises(RequestStateError, match="'a' already finished"):
        mgr.finish("a")
    with pytest.raises(RequestStateError, match="'a'"):
        mgr.lookup("a", 0)
    mgr.add_request("b", [], 3)
    mgr.abort("b")
    with pytest.raises(RequestStateError, match="'b'"):
        mgr.abort("b")


@pytest.mark.parametrize(("call", "match"), [
    (lambda m: m.add_request("a", [1], 3), "already live"),
    (lambda m: m.lookup("a", 2), "gpu_hit_tokens=2"),
    (lambda m: m.lookup("a", 3 * BS), "gpu_hit_tokens=12"),
    (lambda m: m.lookup("a", -BS), "gpu_hit_tokens=-4"),
    (lambda m: m.on_allocated("a", [[0, 1, 2]]), "before lookup"),
    (lambda m: m.on_computed("a", 4), "needs a running request"),
    (lambda m: m.preempt("a"), "only a running request"),
    (lambda m: m.extend("a", [], num_tokens=1), "num_tokens=1"),
])
def test_protocol_violations_are_state_errors(call, match):
    """Calls out of order or with bad counts raise RequestStateError quoting the value."""
    mgr = make()
    mgr.add_request("a", hashes(1, 2), 9)
    with pytest.raises(RequestStateError, match=match):
        call(mgr)


def test_allocation_violations_are_state_errors():
    """Accepting more than offered, a wrong table shape, or a decreasing count is refused."""
    mgr = make()
    hs = hashes(1, 3)
    store_all(mgr, "a", hs, 13)
    mgr.add_request("b", hs, 13)
    assert mgr.lookup("b", 0) == 3 * BS
    with pytest.raises(RequestStateError, match="accepted_tokens=16"):
        mgr.on_allocated("b", [[4, 5, 6, 7]], 4 * BS)
    with pytest.raises(RequestStateError, match="accepted_tokens=2"):
        mgr.on_allocated("b", [[4, 5, 6, 7]], 2)
    with pytest.raises(RequestStateError, match="one block list per KV group"):
        mgr.on_allocated("b", [[4, 5, 6, 7], [8]], 0)
    with pytest.raises(RequestStateError, match="positions"):
        mgr.on_allocated("b", [[4, 5]], 3 * BS)  # the table lacks hit positions
    mgr.on_allocated("b", [[4, 5, 6, 7]], 0)
    with pytest.raises(RequestStateError, match="must be 0"):
        mgr.on_allocated("b", [[4, 5, 6, 7]], BS)
    mgr.on_computed("b", 8)
    with pytest.raises(RequestStateError, match="num_computed_tokens=4"):
        mgr.on_computed("b", 4)
    with pytest.raises(RequestStateError, match="num_computed_tokens=20"):
        mgr.on_computed("b", 20)  # beyond the block table
    with pytest.raises(RequestStateError, match="one block list per KV group"):
        mgr.append_blocks("b", [[1], [2]])
    mgr.check_invariants()


def test_unknown_and_repeated_completions_are_counted_not_raised():
    """Unknown ids, bad worker ranks and repeats from one worker only bump stats counters."""
    mgr = make(world=2)
    schedule(mgr, "a", hashes(1, 2), 9)
    mgr.on_computed("a", 9)
    ((tid, _),) = mgr.build_step().stores
    report = mgr.apply_completions([TransferResult(tid + 99), TransferResult(tid, worker=2),
                                    TransferResult(tid, worker=0), TransferResult(tid, worker=0)])
    assert report.loaded == report.load_failed == report.released == frozenset()
    assert mgr.stats.unknown_completions.value == 2
    assert mgr.stats.duplicate_completions.value == 1
    assert mgr.cpu.lookup(hashes(1, 2)) == []  # one worker of two: not findable yet
    mgr.apply_completions([TransferResult(tid, worker=1)])
    assert len(mgr.cpu.lookup(hashes(1, 2))) == 2
    mgr.apply_completions([TransferResult(tid, worker=1)])  # after completion: unknown
    assert mgr.stats.unknown_completions.value == 3
    mgr.check_invariants()


# -- lookup and loads ----------------------------------------------------------


def test_lookup_is_the_contiguous_run_after_the_gpu_hit_and_pins_it():
    """The hit starts at the GPU-hit boundary, stops at the first miss, and is pinned."""
    mgr = make()
    hs = hashes(1, 4)
    store_all(mgr, "a", hs, 17)
    mgr.add_request("b", hs, 17)
    assert mgr.lookup("b", BS) == 3 * BS
    pinned = mgr.request("b").pinned
    assert [mgr.cpu.block_hash(b) for b in pinned] == hs[1:]
    assert all(mgr.cpu.refcount(b) == 1 for b in pinned)
    assert mgr.lookup("b", 0) == 4 * BS  # a repeated lookup replaces the pins
    assert all(mgr.cpu.refcount(b) == 1 for b in mgr.request("b").pinned)
    mgr.check_invariants()
    mgr.add_request("c", [hs[0], 7, hs[2]], 13)
    assert mgr.lookup("c", 0) == BS  # a miss ends the run
    mgr.abort("b")
    mgr.abort("c")
    assert all(mgr.cpu.refcount(b) == 0 for b in range(mgr.cpu.num_blocks))


def test_lookup_leaves_at_least_one_token_to_compute():
    """A prompt of whole blocks gets at most all but its last block from the CPU tier."""
    mgr = make()
    hs = hashes(1, 3)
    store_all(mgr, "a", hs, 12)
    mgr.add_request("b", hs, 12)
    assert mgr.lookup("b", 0) == 2 * BS
    mgr.add_request("c", hs, 13)
    assert mgr.lookup("c", 0) == 3 * BS
    mgr.add_request("d", hs, 13)
    assert mgr.lookup("d", 0, num_tokens=40) == 3 * BS  # capped by hashes, too


def test_load_pairs_hit_i_with_position_gpu_hit_plus_i_and_unpins_the_rest():
    """Accepted hit blocks go to table positions after the GPU hit; the refused rest is unpinned."""
    mgr = make()
    hs = hashes(1, 4)
    store_all(mgr, "a", hs, 17)
    mgr.add_request("b", hs, 17)
    assert mgr.lookup("b", BS) == 3 * BS
    pinned = list(mgr.request("b").pinned)
    gpu_table = mgr.gpu.allocate(5)
    mgr.on_allocated("b", [gpu_table], 2 * BS)
    assert mgr.cpu.refcount(pinned[2]) == 0  # not accepted: released at once
    (tid, plan), = mgr.build_step().loads
    assert plan.direction is Direction.LOAD
    assert plan.src.tolist() == pinned[:2] and plan.dst.tolist() == gpu_table[1:3]
    assert mgr.stats.cpu_hit_tokens.value == 2 * BS and mgr.stats.gpu_hit_tokens.value == BS
    mgr.check_invariants()
    report = mgr.apply_completions([TransferResult(tid)])
    assert report.loaded == {"b"}
    assert all(mgr.cpu.refcount(b) == 0 for b in pinned)
    assert mgr.stats.blocks_loaded.value == 2
    assert mgr.stats.bytes_loaded.value == 2 * SPEC.bytes_per_block


def test_failed_load_is_reported_for_recompute():
    """A load some worker failed releases its pins and names the request in load_failed."""
    mgr = make(world=2)
    hs = hashes(1, 3)
    table = schedule(mgr, "a", hs, 13)
    mgr.on_computed("a", 13)
    mgr.apply_completions(results(mgr.build_step(), workers=2))
    mgr.finish("a")
    mgr.gpu.decref(table)
    schedule(mgr, "b", hs, 13)
    plan = mgr.build_step()
    (tid, _), = plan.loads
    report = mgr.apply_completions([TransferResult(tid, 0), TransferResult(tid, 1, ok=False)])
    assert report.load_failed == {"b"} and not report.loaded
    assert mgr.stats.transfers_failed.value == 1 and mgr.stats.loads_failed.value == 1
    mgr.check_invariants()


def test_a_failed_load_sets_the_count_back_to_the_gpu_hit_and_the_recomputed_blocks_are_stored():
    """An engine that counts a hit computed when it schedules its load (vLLM's synchronous loads) reports past the
    hit in that step; the load fails, and so do the step's stores (its forward pass read the hit): the computed
    count goes back to the GPU-hit boundary and the queue past it is dropped, and the engine's report of its
    recompute confirms the blocks again, so the blocks the CPU tier lacks are stored (each block stored once)."""
    mgr = make()
    hs = hashes(1, 5)
    mgr.gpu.decref(store_all(mgr, "a", hs[:3], 13))
    mgr.finish("a")
    table = schedule(mgr, "b", hs, 21)
    mgr.on_computed("b", 21)  # the hit and the rest, as the engine schedules them
    plan = mgr.build_step()
    assert [b for _, p in plan.stores for b in p.src.tolist()] == table[3:5]
    report = mgr.apply_completions(results(plan, ok=False))
    assert report.load_failed == {"b"}
    r = mgr.request("b")
    assert (r.num_computed_tokens, r.num_confirmed_blocks, r.store_queue) == (0, 0, [])
    mgr.check_invariants()
    mgr.on_computed("b", 21)  # the recompute
    plan = mgr.build_step()
    assert [b for _, p in plan.stores for b in p.src.tolist()] == table[3:5]
    mgr.apply_completions(results(plan))
    assert all(mgr.cpu.lookup([h]) for h in hs)
    mgr.check_invariants()


def test_a_load_failed_for_one_request_fails_it_alone_and_counts_only_the_others_blocks():
    """One load carries two requests' hits; both workers report it ok but left ``b``'s blocks out (``fail_load``,
    told by each): ``b`` alone fails, counted once, and only ``c``'s blocks and bytes count as loaded. A request
    with no load in flight is refused by name and changes nothing."""
    mgr = make(world=2, gpu=32)
    hb, hc = hashes(1, 3), hashes(2, 2)
    for rid, hs, ntok in (("a", hb, 13), ("d", hc, 9)):
        table = schedule(mgr, rid, hs, ntok)
        mgr.on_computed(rid, ntok)
        mgr.apply_completions(results(mgr.build_step(), workers=2))
        mgr.finish(rid)
        mgr.gpu.decref(table)
    schedule(mgr, "b", hb, 13)
    schedule(mgr, "c", hc, 9)
    with pytest.raises(RequestStateError, match="'b' has no load in flight"):
        mgr.fail_load("b")  # its load is not planned yet
    plan = mgr.build_step()
    assert len(plan.loads) == 1  # one copy carries both hits
    for _ in range(2):  # every worker tells
        mgr.fail_load("b")
    with pytest.raises(UnknownRequestError, match="'x'"):
        mgr.fail_load("x")
    report = mgr.apply_completions(results(plan, workers=2))
    assert report.load_failed == {"b"} and report.loaded == {"c"}
    assert mgr.stats.loads_failed.value == 1 and mgr.stats.transfers_failed.value == 0
    assert mgr.stats.blocks_loaded.value == 2 and mgr.stats.bytes_loaded.value == 2 * SPEC.bytes_per_block
    mgr.check_invariants()


def test_sliding_window_group_loads_only_the_window_before_the_hit_end():
    """A sliding-window group loads the trailing window blocks; earlier ones may be null."""
    mgr = make(spec=HYBRID, gpu=32)
    hs = hashes(1, 5)
    full, window = mgr.gpu.allocate(6), mgr.gpu.allocate(6)
    mgr.add_request("a", hs, 21)
    mgr.lookup("a", 0)
    mgr.on_allocated("a", [full, window])
    mgr.on_computed("a", 21)
    plan = mgr.build_step()
    assert [p.group for _, p in plan.stores] == [0, 1]
    mgr.apply_completions(results(plan))
    mgr.add_request("b", hs, 21)
    assert mgr.lookup("b", 0) == 5 * BS
    full_b = mgr.gpu.allocate(6)
    sw_b = [-1, -1, -1, *mgr.gpu.allocate(3)]  # window=4 tokens: the last 2 hit blocks matter
    mgr.on_allocated("b", [full_b, sw_b], 5 * BS)
    loads = {p.group: p for _, p in mgr.build_step().loads}
    assert loads[0].dst.tolist() == full_b[:5]
    assert loads[1].dst.tolist() == sw_b[3:5] and len(loads[1].src) == 2
    assert loads[1].src.tolist() == loads[0].src.tolist()[3:5]
    mgr.check_invariants()


def test_sliding_window_null_inside_the_window_is_refused():
    """A null block where the window needs the hit is an engine bug: RequestStateError."""
    mgr = make(spec=HYBRID)
    hs = hashes(1, 3)
    stored(mgr, "a", hs, 13, 4)
    mgr.add_request("b", hs, 13)
    mgr.lookup("b", 0)
    with pytest.raises(RequestStateError, match="group 1"):
        mgr.on_allocated("b", [[0, 1, 2, 3], [4, 5, -1, 6]], 3 * BS)


def test_block_missing_in_one_group_is_not_stored():
    """A block whose sliding-window part the engine dropped (null) is not stored at all."""
    mgr = make(spec=HYBRID)
    mgr.add_request("a", hashes(1, 3), 13)
    mgr.lookup("a", 0)
    mgr.on_allocated("a", [mgr.gpu.allocate(4), [-1, *mgr.gpu.allocate(3)]])
    mgr.on_computed("a", 13)
    plan = mgr.build_step()
    assert [p.src.tolist() for _, p in plan.stores][1] == mgr.request("a").block_table[1][1:3]
    mgr.apply_completions(results(plan))
    assert mgr.cpu.lookup(hashes(1, 3)) == []  # the chain starts with the missing block
    assert len(mgr.cpu.lookup(hashes(1, 3)[1:])) == 2


class _ScrambledStore(EagerStore):
    """Chooses confirmed blocks out of order, with a gap and a repeat (a run of one request is the usual case)."""

    def on_computed(self, request: RequestView, start: int, stop: int) -> list[int]:
        return [4, 0, 3, 1, 3] if stop == 5 else []


class _Stored(OffloadCallback):
    def __init__(self) -> None:
        self.stored: list[tuple[list[int], list[int | None]]] = []

    def on_cpu_stored(self, hashes, parents) -> None:
        self.stored.append((list(hashes), list(parents)))


def test_scrambled_store_choice_keeps_each_block_with_its_hash_parent_and_sources():
    """Blocks a policy chooses in any order are copied in that order, each from its own GPU block in every
    group, and commit under their own hash and parent; a null in one group drops the block, a repeat is one copy."""
    seen = _Stored()
    mgr = make(_ScrambledStore(), spec=HYBRID, gpu=24, callbacks=[seen])
    hs = hashes(3, 5)
    mgr.add_request("a", hs, 21)
    mgr.lookup("a", 0)
    full, window = mgr.gpu.allocate(6), [-1, *mgr.gpu.allocate(5)]
    mgr.on_allocated("a", [full, window])
    mgr.on_computed("a", 21)
    plan = mgr.build_step()
    assert [p.src.tolist() for _, p in plan.stores] == [[full[4], full[3], full[1]], [window[4], window[3], window[1]]]
    mgr.apply_completions(results(plan))
    assert seen.stored == [([hs[4], hs[3], hs[1]], [hs[3], hs[2], hs[0]])]
    assert mgr.stats.stores_in_flight.value == 1  # the repeat: its first choice is in flight


def test_a_hit_never_stores_the_positions_a_sliding_window_group_did_not_load():
    """A hit loads a sliding-window group's window only; the engine's real GPU blocks before it hold no KV. Once the
    CPU tier lost the hit, the request stores the window and what it computed, never those positions."""
    mgr = make(spec=HYBRID, gpu=32)
    hs = hashes(1, 5)
    stored(mgr, "a", hs, 21, 6)
    mgr.finish("a")
    mgr.add_request("b", hs, 21)
    assert mgr.lookup("b", 0) == 5 * BS
    mgr.on_allocated("b", [mgr.gpu.allocate(6), mgr.gpu.allocate(6)], 5 * BS)  # real blocks before the window too
    plan = mgr.build_step()
    loads = {p.group: p for _, p in plan.loads}
    assert len(loads[1].src) == 2  # window = one block of tokens: positions 3 and 4
    mgr.apply_completions(results(plan))
    mgr.cpu.decref(mgr.cpu.allocate(mgr.cpu.num_free))  # other work evicts the whole CPU tier
    assert mgr.cpu.lookup(hs) == [] and mgr.cpu.lookup(hs[3:]) == []
    mgr.on_computed("b", 21)
    plan = mgr.build_step()
    assert [len(p.src) for _, p in plan.stores] == [2, 2]
    mgr.apply_completions(results(plan))
    assert mgr.cpu.lookup(hs) == [] and len(mgr.cpu.lookup(hs[3:])) == 2
    mgr.check_invariants()


# -- stores --------------------------------------------------------------------


def test_store_commits_only_after_every_worker_and_never_after_a_failure():
    """A store becomes findable when all workers reported ok; a failure discards its blocks."""
    mgr = make(world=2)
    schedule(mgr, "a", hashes(1, 2), 9)
    mgr.on_computed("a", 9)
    plan = mgr.build_step()
    (tid, p), = plan.stores
    cpu_blocks = p.dst.tolist()
    assert all(mgr.cpu.block_hash(b) is None for b in cpu_blocks)
    mgr.apply_completions([TransferResult(tid, 0)])
    assert mgr.cpu.lookup(hashes(1, 2)) == []
    mgr.apply_completions([TransferResult(tid, 1, ok=False)])
    assert mgr.cpu.lookup(hashes(1, 2)) == []
    assert all(mgr.cpu.refcount(b) == 0 for b in cpu_blocks)
    assert mgr.stats.blocks_stored.value == 0 and mgr.stats.transfers_failed.value == 1
    mgr.check_invariants()


def _confirmed(mgr: OffloadManager) -> dict[str, tuple[int, int, list[int]]]:
    return {rid: (r.num_computed_tokens, r.num_confirmed_blocks, list(r.store_queue))
            for rid, r in mgr._requests.items()}


def _progress(mgr: OffloadManager) -> dict[str, tuple]:
    return {rid: (r.num_tokens, r.num_computed_tokens, r.num_confirmed_blocks, list(r.store_queue),
                  [list(row) for row in r.block_table], list(r.block_hashes)) for rid, r in mgr._requests.items()}


_ITEMS = st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 2), st.integers(0, 2), st.booleans(),
                           st.one_of(st.none(), st.integers(0, 7 * BS)), st.integers(0, 9)), max_size=8)


def _advanced(compiled: bool) -> list[OffloadManager]:
    """Two managers alike, three requests running on each: two blocks computed, one hashed (the second waits for
    its hash); the first runs ``advance``'s compiled twin where it was built (``compiled``), or its Python."""
    twins = [make(cpu=32, gpu=64), make(cpu=32, gpu=64)]
    if not compiled:
        twins[0]._advance_twin = None
    for mgr in twins:
        for k, rid in enumerate("abc"):
            schedule(mgr, rid, hashes(k + 1, 1), 2 * BS)
            mgr.on_computed(rid, 2 * BS)
    return twins


@settings(max_examples=80, deadline=None)
@given(spec=_ITEMS, compiled=st.booleans())
def test_advance_is_append_extend_and_on_computed_in_turn_up_to_the_first_refused_item(spec, compiled):
    """A step's items in one ``advance`` (compiled or not) leave each request as ``append_blocks``, ``extend`` and
    ``on_computed`` in turn leave it, and plan the same stores; a refused item (here a count that decreases or
    passes the item's blocks, or a block already in the table) raises, the items before it applied and nothing of
    it or of those after it."""
    twins = _advanced(compiled)
    items, refused, next_hash = [], None, 0
    for rid, num_blocks, num_hashes, with_hashes, count, dup in spec:
        r = twins[1].request(rid)  # as the items before left it
        blocks = twins[0].gpu.allocate(num_blocks)
        assert twins[1].gpu.allocate(num_blocks) == blocks
        bad_block = dup == 0
        if bad_block:
            blocks = blocks + r.block_table[0][:1]
        fresh = [50_000 + next_hash + i for i in range(num_hashes)] if with_hashes else None
        next_hash += num_hashes
        item = (rid, [blocks] if blocks else None, fresh, count)
        capacity = (len(r.block_table[0]) + len(blocks)) * BS
        if refused is None and (bad_block or (count is not None and not r.num_computed_tokens <= count <= capacity)):
            refused = len(items)
        if refused is None:  # the reference: the per-request calls, applied to the other twin
            m = twins[1]
            if item[1] is not None:
                m.append_blocks(rid, item[1])
            if fresh is not None:
                m.extend(rid, fresh)
            if count is not None:
                m.on_computed(rid, count)
        items.append(item)
    if refused is None:
        twins[0].advance(items)
    else:
        with pytest.raises(RequestStateError, match=repr(items[refused][0])):
            twins[0].advance(items)
    assert _progress(twins[0]) == _progress(twins[1])
    assert [(c.src.tolist(), c.dst.tolist()) for _, c in twins[0].build_step()] == \
        [(c.src.tolist(), c.dst.tolist()) for _, c in twins[1].build_step()]


@pytest.mark.skipif(make()._advance_twin is None,
                    reason="advance's compiled twin was not built here")
def test_advance_compiled_applies_a_decode_step_whole_and_leaves_other_items_to_the_python():
    """The compiled twin takes a decode step's items (one block, its hash, the count) all, as the Python applies them,
    and stops, changing nothing, at an item of another shape: numpy ints, two groups' blocks, a tuple of hashes."""
    import numpy as np

    twins = _advanced(False)
    twins[0]._advance_twin = twins[1]._advance_twin
    twins[1]._advance_twin = None
    step = []
    for k, rid in enumerate("abc"):
        (b,) = twins[0].gpu.allocate(1)
        assert twins[1].gpu.allocate(1) == [b]
        step.append((rid, ([b],), [60_000 + k], 3 * BS))
    m = twins[0]
    assert m._advance_twin(step, m._requests, RequestState.RUNNING, BS, m.num_gpu_blocks, m.null_block, m._confirm) == 3
    twins[1].advance(step)
    assert _progress(twins[0]) == _progress(twins[1])
    before = _progress(m)
    for item in [("a", None, None, np.int64(3 * BS)), ("a", [[1], [2]], None, None), ("a", None, (70_000,), None),
                ("a", None, [True], None), ["a", None, None, 3 * BS], ("zz", None, None, None)]:
        assert m._advance_twin([item], m._requests, RequestState.RUNNING, BS, m.num_gpu_blocks, m.null_block,
                       m._confirm) == 0
        assert _progress(m) == before


class LookupOnlyPool(BlockPool):
    """A CPU pool without the batched lookup: the manager asks ``lookup`` hash by hash."""

    contains_many = None


@pytest.mark.parametrize("cpu_pool", [BlockPool, LookupOnlyPool])
def test_stores_are_deduplicated_against_cpu_inflight_and_the_step(cpu_pool):
    """A hash on the CPU tier, in flight, or twice in one step is stored once (the CPU pool asked in one
    call, or a lookup per hash); a whole flush re-offers them and is deduplicated too."""
    mgr = OffloadManager(SPEC, cpu_pool(8, eviction=LRUPolicy()), EagerStore(flush_limit=None),
                         gpu=BlockPool(16, eviction=LRUPolicy()))
    assert (mgr._stores._contains_many is None) == (cpu_pool is LookupOnlyPool)
    hs = hashes(1, 2)
    schedule(mgr, "a", hs, 9)
    schedule(mgr, "b", hs, 9)
    mgr.on_computed("a", 9)
    mgr.on_computed("b", 9)
    first = mgr.build_step()
    assert sum(len(p) for _, p in first.stores) == 2
    mgr.finish("a")  # the flush re-offers both: in flight, so skipped
    assert not mgr.build_step().stores
    mgr.apply_completions(results(first))
    mgr.finish("b")  # now on the CPU tier
    assert not mgr.build_step()
    assert mgr.stats.stores_in_flight.value == 4  # b's in the first step, a's flush while in flight
    assert mgr.stats.stores_deduplicated.value == 2  # b's flush once on the CPU tier
    mgr.check_invariants()


def test_a_full_cpu_tier_stores_fewer_and_never_fails_the_engine():
    """With fewer free CPU blocks than candidates, the first ones are stored and the rest counted."""
    mgr = make(cpu=2)
    schedule(mgr, "a", hashes(1, 4), 17)
    mgr.add_request("pin", hashes(9, 1), 5)
    mgr.on_computed("a", 17)
    plan = mgr.build_step()
    assert plan.stores[0][1].src.tolist() == mgr.request("a").block_table[0][:2]
    assert mgr.stats.stores_dropped.value == 2
    mgr.check_invariants()


def test_never_store_plans_no_stores():
    """With NeverStore nothing is ever stored."""
    mgr = make(NeverStore())
    schedule(mgr, "a", hashes(1, 2), 9)
    mgr.on_computed("a", 9)
    mgr.finish("a")
    assert not mgr.build_step()


def test_lazy_writes_back_the_gpu_eviction_candidates():
    """Write-back stores the GPU pool's next eviction candidates, holding them until done."""
    mgr = make(LazyStore(watermark=0.25), gpu=8)
    table = schedule(mgr, "a", hashes(1, 3), 13)
    mgr.on_computed("a", 13)
    assert not mgr.build_step()  # nothing on progress
    mgr.gpu.commit(table[:3], hashes(1, 3))
    mgr.finish("a")
    mgr.gpu.decref(table)  # three ready blocks become eviction candidates
    plan = mgr.build_step()
    (tid, p), = plan.stores
    assert p.src.tolist() == table[:2]  # ceil(0.25 * 8) = 2, least recently used first
    assert all(mgr.gpu.refcount(b) == 1 for b in p.src.tolist())
    mgr.apply_completions([TransferResult(tid)])
    assert all(mgr.gpu.refcount(b) == 0 for b in p.src.tolist())
    assert len(mgr.cpu.lookup(hashes(1, 2))) == 2
    mgr.check_invariants()


def test_extend_confirms_blocks_already_computed():
    """Hashes arriving after their KV was computed (decode) confirm at once."""
    mgr = make()
    schedule(mgr, "a", hashes(1, 1), 6)
    mgr.append_blocks("a", [mgr.gpu.allocate(1)])
    mgr.on_computed("a", 8)
    assert mgr.request("a").num_confirmed_blocks == 1
    mgr.extend("a", [1001], num_tokens=9)
    assert mgr.request("a").num_confirmed_blocks == 2
    assert len(mgr.build_step().stores[0][1]) == 2


# -- end of life ---------------------------------------------------------------


def test_without_a_gpu_pool_finish_delays_the_free_until_released():
    """An external engine keeps a finished request's blocks until its stores are done."""
    mgr = make(own_gpu=False)
    mgr.add_request("a", hashes(1, 2), 9)
    mgr.lookup("a", 0)
    mgr.on_allocated("a", [[5, 6, 7]])
    mgr.on_computed("a", 9)
    plan = mgr.build_step()
    assert mgr.finish("a") is True
    with pytest.raises(RequestStateError):
        mgr.finish("a")
    mgr.check_invariants()
    report = mgr.apply_completions(results(plan))
    assert report.released == {"a"}
    mgr.add_request("b", [], 1)
    mgr.lookup("b", 0)
    mgr.on_allocated("b", [[1]])
    assert mgr.finish("b") is False
    mgr.check_invariants()


def test_without_a_gpu_pool_queued_stores_delay_the_free_too():
    """Stores chosen but not yet planned also keep the blocks; released after they complete."""
    mgr = make(own_gpu=False)
    mgr.add_request("a", hashes(1, 2), 9)
    mgr.lookup("a", 0)
    mgr.on_allocated("a", [[5, 6, 7]])
    assert mgr.finish("a", num_computed_tokens=9) is True
    plan = mgr.build_step()
    assert plan.stores[0][1].src.tolist() == [5, 6]
    assert mgr.apply_completions(results(plan)).released == {"a"}


def test_without_a_gpu_pool_preempt_says_whether_copies_still_run():
    """Preempting for an external engine drops queued stores and reports in-flight ones, no release."""
    mgr = make(own_gpu=False)
    mgr.add_request("a", hashes(1, 2), 9)
    mgr.lookup("a", 0)
    mgr.on_allocated("a", [[5, 6, 7]])
    mgr.on_computed("a", 4)
    plan = mgr.build_step()  # block 0 in flight
    mgr.on_computed("a", 8)  # block 1 queued
    assert mgr.preempt("a") is True
    assert not mgr.build_step()  # the queued store went with the blocks
    assert not mgr.apply_completions(results(plan)).released
    mgr.lookup("a", 0)
    mgr.on_allocated("a", [[1, 2, 3]])
    assert mgr.preempt("a") is False
    mgr.check_invariants()


def test_request_state_is_a_request_view():
    """The manager hands its per-request records to store policies as ``RequestView``s."""
    mgr = make()
    mgr.add_request("a", hashes(1, 2), 9)
    assert isinstance(mgr.request("a"), RequestView)


def test_with_a_gpu_pool_finish_holds_the_queued_sources():
    """With a GPU pool the engine frees at once; the manager holds the sources it still stores."""
    mgr = make()
    table = schedule(mgr, "a", hashes(1, 2), 9)
    assert mgr.finish("a", num_computed_tokens=9) is False
    mgr.gpu.decref(table)
    assert [mgr.gpu.refcount(b) for b in table] == [1, 1, 0]
    plan = mgr.build_step()
    mgr.apply_completions(results(plan))
    assert all(mgr.gpu.refcount(b) == 0 for b in table)
    assert len(mgr.cpu.lookup(hashes(1, 2))) == 2
    mgr.check_invariants()


def test_a_resumed_request_counts_again_and_one_scheduled_again_after_its_failed_load_does_not():
    """``scheduled_requests`` and ``query_tokens`` count each allocation after a lookup: a request resumed after a
    preemption counts again; one the engine schedules again after its load failed (``load_failed=True``) is the
    same request and does not. A ``load_failed`` that is not a bool is refused, changing nothing."""
    mgr = make()
    table = schedule(mgr, "a", hashes(1, 3), 13)
    with pytest.raises(ConfigError, match=r"preempt\(load_failed=1\)"):
        mgr.preempt("a", load_failed=1)
    assert mgr.request("a").state.value == "running"
    counts = []
    for load_failed in (True, False):
        assert mgr.preempt("a", load_failed=load_failed) is False
        mgr.gpu.decref(table)
        table = schedule(mgr, "a", hashes(1, 3), 13)
        counts.append((mgr.stats.scheduled_requests.value, mgr.stats.query_tokens.value))
    assert counts == [(1, 13), (2, 26)]
    mgr.check_invariants()


def test_preempted_load_is_forgotten_and_its_blocks_held_until_done():
    """A load in flight for a preempted request completes silently; the new incarnation looks up again."""
    mgr = make()
    hs = hashes(1, 3)
    table = store_all(mgr, "a", hs, 13)
    mgr.finish("a")
    mgr.gpu.decref(table)
    table_b = schedule(mgr, "b", hs, 13)
    (tid, plan), = mgr.build_step().loads
    assert mgr.preempt("b") is False
    mgr.gpu.decref(table_b)
    assert all(mgr.gpu.refcount(b) == 1 for b in plan.dst.tolist())  # held by the load
    assert mgr.request("b").state.value == "waiting"
    report = mgr.apply_completions([TransferResult(tid)])
    assert not report.loaded and not report.load_failed
    assert all(mgr.gpu.refcount(b) == 0 for b in table_b)
    assert mgr.lookup("b", 0) == 3 * BS
    mgr.check_invariants()


def test_callbacks_see_every_event():
    """Each hook fires at its event with the right arguments."""
    seen = []

    class Recorder(OffloadCallback):
        def on_lookup(self, *a):
            seen.append(("lookup", *a))

        def on_transfer_submitted(self, tid, direction, n):
            seen.append(("submitted", direction.value, n))

        def on_transfer_completed(self, tid, direction, n, ok):
            seen.append(("completed", direction.value, n, ok))

        def on_evict(self, tier, block, h):
            seen.append(("evict", tier))

        def on_request_finished(self, rid, aborted):
            seen.append(("finished", rid, aborted))

        def on_request_preempted(self, rid):
            seen.append(("preempted", rid))

        def on_reset(self, dropped):
            seen.append(("reset", dropped))

    mgr = make(cpu=2, callbacks=[Recorder()])
    table = schedule(mgr, "a", hashes(1, 2), 9)
    mgr.on_computed("a", 9)
    mgr.apply_completions(results(mgr.build_step()))
    mgr.preempt("a")
    mgr.gpu.decref(table)
    mgr.abort("a")
    schedule(mgr, "b", hashes(2, 2), 9)
    mgr.on_computed("b", 9)
    mgr.finish("b")
    mgr.apply_completions(results(mgr.build_step()))
    mgr.reset()
    assert seen == [
        ("lookup", "a", 0, 0), ("submitted", "store", 2), ("completed", "store", 2, True),
        ("preempted", "a"), ("finished", "a", True), ("lookup", "b", 0, 0),
        ("finished", "b", False), ("evict", "cpu"), ("evict", "cpu"),
        ("submitted", "store", 2), ("completed", "store", 2, True), ("reset", 2)]


# -- stats ---------------------------------------------------------------------


def test_counters_only_grow():
    """A counter rejects negative and NaN amounts and keeps its value."""
    c = Counter()
    c.add(3)
    for bad in (-1, float("nan")):
        with pytest.raises(ValueError, match="only grows"):
            c.add(bad)
    assert c.value == 3 and int(c) == 3
    d = OffloadStats().as_dict()
    assert all(v == 0 for v in d.values()) and "cpu_hit_rate" in d


# -- regressions of failure modes known in the field (docs/guarantees.md) ------------


def test_cpu_hit_evicted_before_allocation_regression_39702():
    """A hit pinned at lookup survives store pressure that evicts everything else before allocation."""
    mgr = make(cpu=4)
    hs = hashes(1, 4)
    table = store_all(mgr, "a", hs, 17)
    mgr.finish("a")
    mgr.gpu.decref(table)
    mgr.add_request("b", hs, 17)
    assert mgr.lookup("b", 0) == 4 * BS
    pinned = list(mgr.request("b").pinned)
    schedule(mgr, "c", hashes(2, 4), 17)  # wants every CPU block for its stores
    mgr.on_computed("c", 17)
    mgr.apply_completions(results(mgr.build_step()))
    assert [mgr.cpu.block_hash(b) for b in pinned] == hs
    mgr.on_allocated("b", [mgr.gpu.allocate(5)], 4 * BS)
    (tid, plan), = mgr.build_step().loads
    assert plan.src.tolist() == pinned
    assert mgr.apply_completions([TransferResult(tid)]).loaded == {"b"}
    mgr.check_invariants()


def test_only_confirmed_blocks_are_stored_regression_45704():
    """Blocks whose hashes are known but whose KV is not yet confirmed are never planned."""
    mgr = make()
    schedule(mgr, "a", hashes(1, 4), 17)
    assert not mgr.build_step()  # scheduled, nothing computed
    mgr.on_computed("a", 7)  # chunked prefill: one full block written
    (_, plan), = mgr.build_step().stores
    assert plan.src.tolist() == mgr.request("a").block_table[0][:1]


def test_last_block_flushed_when_finishing_in_the_same_step_regression_41704():
    """Finishing with the final progress stores the block completed in that last step."""
    mgr = make()
    table = schedule(mgr, "a", hashes(1, 3), 13)
    mgr.on_computed("a", 8)
    mgr.apply_completions(results(mgr.build_step()))
    mgr.finish("a", num_computed_tokens=13)
    plan = mgr.build_step()
    (_, store), = plan.stores
    assert store.src.tolist() == [table[2]]
    mgr.apply_completions(results(plan))
    assert len(mgr.cpu.lookup(hashes(1, 3))) == 3


@pytest.mark.parametrize(("flush_limit", "restored"), [(None, 4), (2, 2), (0, 0)])
def test_a_finish_restores_what_the_tier_evicted_up_to_the_flush_limit(flush_limit, restored):
    """The CPU tier evicts a running request's stored blocks; its finish stores them again, the history's first
    ``flush_limit`` only when the eager store is bounded."""
    mgr = make(EagerStore(flush_limit=flush_limit), cpu=4)
    hs = hashes(1, 4)
    table = schedule(mgr, "a", hs, 17)
    mgr.on_computed("a", 17)
    mgr.apply_completions(results(mgr.build_step()))
    assert len(mgr.cpu.lookup(hs)) == 4
    schedule(mgr, "x", hashes(2, 4), 17)
    mgr.on_computed("x", 17)
    mgr.apply_completions(results(mgr.build_step()))  # evicts a's blocks from the CPU tier
    mgr.abort("x")
    assert mgr.cpu.lookup(hs) == []
    mgr.finish("a")
    plan = mgr.build_step()
    assert [b for _, store in plan.stores for b in store.src.tolist()] == table[:restored]
    mgr.apply_completions(results(plan))
    assert len(mgr.cpu.lookup(hs)) == restored


def test_block_evicted_from_cpu_is_stored_again_no_stale_cursor():
    """A prefix block the CPU tier evicted is stored again by the next request that confirms it."""
    mgr = make(cpu=4)
    hs = hashes(1, 3)
    table = store_all(mgr, "a", hs, 13)  # a keeps its GPU blocks (prefix cached)
    schedule(mgr, "x", hashes(2, 4), 17)
    mgr.on_computed("x", 17)
    mgr.apply_completions(results(mgr.build_step()))  # evicts a's blocks from the CPU tier
    assert mgr.cpu.lookup(hs) == []
    mgr.abort("x")
    mgr.add_request("b", hs, 13)
    assert mgr.lookup("b", 3 * BS) == 0  # all three blocks are GPU hits
    mgr.on_allocated("b", [table[:3] + mgr.gpu.allocate(1)])
    mgr.on_computed("b", 13)
    plan = mgr.build_step()
    assert plan.stores[0][1].src.tolist() == table[:3]  # from block 0, GPU hits included
    mgr.apply_completions(results(plan))
    assert len(mgr.cpu.lookup(hs)) == 3


def test_reset_with_transfers_in_flight_serves_no_hits_regression_57727():
    """Reset abandons transfers in flight, serves no hit, and empties the tier after the drain."""
    mgr = make()
    hs = hashes(1, 3)
    store_all(mgr, "a", hs, 13)
    schedule(mgr, "b", hashes(2, 3), 13)
    mgr.on_computed("b", 13)
    stores = mgr.build_step()
    mgr.add_request("c", hs, 13)
    assert mgr.lookup("c", 0) == 3 * BS
    loads_for = mgr.request("c")
    mgr.on_allocated("c", [mgr.gpu.allocate(4)], 3 * BS)
    loads = mgr.build_step()
    next_id = mgr.next_transfer_id
    assert mgr.reset() is False and not mgr.drained
    mgr.add_request("d", hs, 13)
    assert mgr.lookup("d", 0) == 0  # no hit while draining
    report = mgr.apply_completions(results(stores) + results(loads))
    assert report.load_failed == {"c"} and loads_for.state.value == "running"
    assert mgr.drained and mgr.cpu.num_cached == 0
    assert mgr.lookup("d", 0) == 0
    assert mgr.stats.transfers_abandoned.value == 2 and mgr.stats.resets.value == 1
    mgr.on_allocated("d", [mgr.gpu.allocate(4)])
    mgr.on_computed("d", 13)
    (tid, _), = mgr.build_step().stores
    assert tid >= next_id  # ids never reused across a reset
    mgr.check_invariants()


def test_reset_revokes_an_offered_hit_before_allocation():
    """A hit offered before a reset and accepted after it is reported failed, never loaded."""
    mgr = make()
    hs = hashes(1, 3)
    store_all(mgr, "a", hs, 13)
    mgr.add_request("b", hs, 13)
    assert mgr.lookup("b", 0) == 3 * BS
    assert mgr.reset() is True and mgr.cpu.num_cached == 0
    mgr.on_allocated("b", [mgr.gpu.allocate(4)], 3 * BS)
    assert not mgr.build_step().loads
    assert mgr.apply_completions([]).load_failed == {"b"}
    mgr.check_invariants()


def test_hit_counter_never_negative_for_a_resumed_request():
    """A preempted and resumed request adds to the hit counters again; none ever decreases."""
    mgr = make()
    hs = hashes(1, 3)
    store_all(mgr, "a", hs, 13)
    before = mgr.stats.as_dict()
    schedule(mgr, "b", hs, 13)
    mgr.preempt("b")
    mgr.lookup("b", 0)
    mgr.on_allocated("b", [mgr.gpu.allocate(4)], 0)
    after = mgr.stats.as_dict()
    assert all(after[k] >= before[k] for k in before)
    assert after["cpu_hit_tokens"] == before["cpu_hit_tokens"] + 3 * BS


@settings(max_examples=60, deadline=None)
@given(growth=st.lists(st.lists(st.integers(0, 9), min_size=3, max_size=3), min_size=1, max_size=24),
       store=st.sampled_from([{}, {"flush_limit": None}, {"flush_limit": 2}]), finish_at=st.integers(0, 24))
def test_counts_told_only_when_a_block_completes_plan_what_counts_told_every_step_plan(growth, store, finish_at):
    """Two managers see three requests grow alike, one told every step's computed count, the other only in the steps
    where a block completes (as kvkit's vLLM connector tells them; one request may finish on the way): every step plans
    the same copies, the same blocks end up on the CPU tier, and both keep their invariants."""
    spec = KVCacheSpec(num_layers=1, block_size=4, num_kv_heads=1, head_dim=4)
    twins = [OffloadManager(spec, BlockPool(24, eviction=LRUPolicy()), EagerStore(**store),
                            gpu=BlockPool(256, eviction=LRUPolicy())) for _ in range(2)]
    live = ["a", "b", "c"]
    tokens = dict.fromkeys(live, 0)
    told = [dict.fromkeys(live, 0), dict.fromkeys(live, 0)]

    def key(rid: str, i: int) -> int:
        return ord(rid) << 20 | i

    for m in twins:
        for rid in live:
            m.add_request(rid, [], 0)
            assert m.lookup(rid, 0) == 0
            m.on_allocated(rid, [[]])
    for step, sizes in enumerate(growth):
        items: list[list] = [[], []]
        for rid, k in zip(live, sizes):
            before, tokens[rid] = tokens[rid], tokens[rid] + k
            new_blocks = -(-tokens[rid] // 4) - -(-before // 4)
            fresh = [key(rid, i) for i in range(before // 4, tokens[rid] // 4)] or None
            for i, m in enumerate(twins):
                tell = i == 0 or tokens[rid] // 4 > told[i][rid] // 4
                if tell:
                    told[i][rid] = tokens[rid]
                items[i].append((rid, [m.gpu.allocate(new_blocks)] if new_blocks else None, fresh,
                                tokens[rid] if tell else None))
        plans = []
        for i, m in enumerate(twins):
            m.advance(items[i])
            if step == finish_at:
                m.finish("a")
            plan = m.build_step()
            plans.append([(copy.direction, copy.src.tolist(), copy.dst.tolist()) for _, copy in plan])
            m.apply_completions([TransferResult(tid) for tid, _ in plan])
            m.check_invariants()
        assert plans[0] == plans[1], step
        if step == finish_at:
            live.remove("a")
    every = [key(rid, i) for rid in tokens for i in range(tokens[rid] // 4)]
    assert twins[0].cpu.lookup(every) == twins[1].cpu.lookup(every)
