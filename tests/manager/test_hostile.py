"""A buggy engine, a raising callback or store policy, or a stuck copy never breaks the manager.

Every refused call raises a typed kvkit error, changes nothing (the manager's
state is compared before and after), and the same manager then serves a fresh
request fully: it stores, and a follow-up hits.
"""

import warnings

import numpy as np
import pytest

from kvkit.backends.allocator import BlockPool
from kvkit.backends.eviction.hinted import HintedPolicy
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.backends.store import EagerStore
from kvkit.errors import ConfigError, KVKitError, RequestStateError
from kvkit.interfaces import KVCacheSpec, OffloadCallback, TransferResult
from kvkit.interfaces.hints import WorkloadHints
from kvkit.manager import OffloadManager
from kvkit.manager.events import Events
from kvkit.testing.doubles import RaisingCallback
from kvkit.testing.hostile import BAD_CALLS, snapshot

BS = 4
SPEC = KVCacheSpec(num_layers=1, block_size=BS, num_kv_heads=1, head_dim=4)
NUM_GPU, NUM_CPU = 32, 16


def make(**kw) -> OffloadManager:
    gpu = BlockPool(NUM_GPU, eviction=LRUPolicy())
    return OffloadManager(SPEC, BlockPool(NUM_CPU, eviction=LRUPolicy()), kw.pop("store", EagerStore()),
                          gpu=gpu, **kw)


def complete(mgr: OffloadManager, plan, ok: bool = True):
    return mgr.apply_completions([TransferResult(tid, ok=ok) for tid, _ in plan])


def serve_fully(mgr: OffloadManager, rid: str, hashes: list[int]) -> None:
    """A request computes and stores every full block; a follow-up with the same prefix hits all but the last."""
    n = len(hashes) * BS
    mgr.add_request(rid, hashes, n)
    assert mgr.lookup(rid, 0) == 0
    table = mgr.gpu.allocate(len(hashes))
    mgr.on_allocated(rid, [table])
    mgr.on_computed(rid, n)
    mgr.finish(rid)
    mgr.gpu.decref(table)
    complete(mgr, mgr.build_step())
    assert mgr.cpu.lookup(hashes) != [], "nothing was stored"
    follow = f"{rid}-again"
    mgr.add_request(follow, hashes, n + 1)
    assert mgr.lookup(follow, 0) == len(hashes) * BS
    mgr.abort(follow)
    mgr.check_invariants()


@pytest.fixture
def mgr() -> OffloadManager:
    """A manager with a waiting request ``w`` (looked up) and a running request ``r`` that computed 2 blocks."""
    m = make()
    m.add_request("w", [101, 102], 8)
    m.lookup("w", 0)
    m.add_request("r", [201, 202, 203], 12)
    m.lookup("r", 0)
    m.on_allocated("r", [m.gpu.allocate(3)])
    m.on_computed("r", 8)
    return m


@pytest.mark.parametrize("call", [c for _, c in BAD_CALLS.values()], ids=BAD_CALLS.keys())
def test_a_refused_call_is_a_kvkit_error_that_changes_nothing(mgr, call):
    """Each bad call raises a kvkit error (quoting it), leaves every piece of state as it was,
    and the manager still serves."""
    plan = mgr.build_step()  # transfers in flight while the bad call comes
    before = snapshot(mgr)
    with pytest.raises(KVKitError):
        call(mgr, "w", "r")
    assert snapshot(mgr) == before
    mgr.check_invariants()
    complete(mgr, plan)
    serve_fully(mgr, "fresh", [901, 902, 903])


def test_numpy_integers_are_accepted_as_ints():
    """NumPy integers for hashes, ids and counts work like ints and are stored as ints."""
    m = make()
    m.add_request("n", np.array([11, 12], dtype=np.int64), np.int64(9))
    assert m.lookup("n", np.int64(0)) == 0
    m.on_allocated("n", [np.array(m.gpu.allocate(2), dtype=np.int32)], np.int64(0))
    m.on_computed("n", np.int64(8))
    r = m.request("n")
    assert all(type(x) is int for x in [*r.block_hashes, *r.block_table[0], r.num_computed_tokens, r.num_tokens])
    m.extend("n", (h for h in [13]), num_tokens=np.int32(12))  # a generator works too
    assert m.request("n").block_hashes == [11, 12, 13]
    m.check_invariants()


def test_a_raising_callback_changes_nothing_kvkit_does():
    """A callback raising in every hook is contained: same plans, same stats, no leak, reset works;
    each hook warns once."""
    quiet, loud = make(), make(callbacks=[RaisingCallback()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for m in (quiet, loud):
            serve_fully(m, "a", [1, 2, 3, 4])
            m.add_request("b", [1, 2, 3, 4, 5], 21)
            m.lookup("b", 0)
            m.on_allocated("b", [m.gpu.allocate(6)], 16)
            plan = m.build_step()
            complete(m, plan, ok=False)
            m.reset()
            m.check_invariants()
    assert {k: v for k, v in loud.stats.as_dict().items() if k != "callback_errors"} == {
        k: v for k, v in quiet.stats.as_dict().items() if k != "callback_errors"}
    assert loud.stats.callback_errors.value > 0 and quiet.stats.callback_errors.value == 0
    messages = [str(w.message) for w in caught if "callback bug" in str(w.message)]
    assert len(messages) == len(set(messages)), "a hook warned more than once"
    assert any("on_transfer_submitted" in m for m in messages) and any("on_evict" in m or "on_reset" in m
                                                                      for m in messages)


class _Propagating(Events):
    def emit(self, hook, *args):
        for cb in self.callbacks:
            getattr(cb, hook)(*args)


class _PropagatingEvents(OffloadManager):
    """Planted bug: callbacks' exceptions reach the manager's control flow."""

    def __attrs_post_init__(self):
        super().__attrs_post_init__()
        self._events = _Propagating(self.callbacks, self.stats.callback_errors)


class RaisesAtSubmit(OffloadCallback):
    def on_transfer_submitted(self, transfer_id, direction, num_blocks):
        raise RuntimeError("boom")


def test_the_planted_propagating_dispatcher_breaks_the_manager():
    """Without containment, a callback raising at submit leaves transfers in flight the engine never got."""
    def store_once(m):
        m.add_request("a", [1, 2, 3], 12)
        m.lookup("a", 0)
        m.on_allocated("a", [m.gpu.allocate(3)])
        m.on_computed("a", 12)
        return m.build_step()

    gpu = BlockPool(NUM_GPU, eviction=LRUPolicy())
    bad = _PropagatingEvents(SPEC, BlockPool(NUM_CPU, eviction=LRUPolicy()), EagerStore(), gpu=gpu,
                             callbacks=[RaisesAtSubmit()])
    with pytest.raises(RuntimeError):
        store_once(bad)
    assert bad.num_in_flight > 0  # stuck: no engine ever received these transfers
    good = make(callbacks=[RaisesAtSubmit()])
    with pytest.warns(RuntimeWarning, match="boom"):
        plan = store_once(good)
    assert len(plan.stores) == good.num_in_flight == 1


class Flaky(EagerStore):
    """A store policy that raises, then answers junk."""

    def on_computed(self, request, start, stop):
        raise ValueError("policy bug")

    def on_finished(self, request):
        return ["0", None]


def test_a_raising_or_junk_store_policy_stores_nothing_and_breaks_nothing():
    """The policy's failures are counted; the request lives on; nothing leaks; the next lookup is consistent."""
    m = make(store=Flaky())
    with pytest.warns(RuntimeWarning, match="policy bug"):
        m.add_request("a", [1, 2], 8)
        m.lookup("a", 0)
        table = m.gpu.allocate(2)
        m.on_allocated("a", [table])
        m.on_computed("a", 8)
    with pytest.warns(RuntimeWarning, match="block indices must be ints"):
        m.finish("a")
    m.gpu.decref(table)
    assert not m.build_step()
    assert m.stats.store_policy_errors.value == 2
    m.check_invariants()
    assert m.cpu.num_cached == 0 and sum(m.cpu.refcount(b) for b in range(NUM_CPU)) == 0


def test_a_forced_reset_does_not_wait_and_never_serves_a_stale_byte():
    """Copies that never complete: ``reset(force=True)`` empties the tier now, quarantines their blocks,
    resumes at once."""
    m = make()
    serve_fully(m, "old", [1, 2, 3])
    m.add_request("store", [11, 12], 8)  # a store that will hang
    m.lookup("store", 0)
    m.on_allocated("store", [m.gpu.allocate(2)])
    m.on_computed("store", 8)
    m.add_request("load", [1, 2, 3], 13)  # a load that will hang
    assert m.lookup("load", 0) == 12
    m.on_allocated("load", [m.gpu.allocate(4)], 12)
    stuck = m.build_step()
    assert stuck.loads and stuck.stores
    held = sum(m.cpu_refs_held().values())
    assert m.reset() is False and not m.drained  # an ordinary reset waits for them
    assert m.reset(force=True) is True and m.drained
    assert m.stats.forced_resets.value == 1 and m.cpu.num_cached == 0
    assert sum(m.cpu_refs_held().values()) == held, "the stuck copies' blocks must stay quarantined"
    m.check_invariants()
    serve_fully(m, "new", [21, 22, 23])  # stores and hits resume at once
    assert m.cpu.lookup([1]) == [] and m.cpu.lookup([11]) == []
    report = complete(m, stuck)  # the late completions land: nothing commits, the load is a failure
    assert report.load_failed == {"load"} and m.cpu.lookup([11]) == [] and m.cpu.lookup([1]) == []
    assert sum(m.cpu_refs_held().values()) == 0
    m.check_invariants()


def test_appended_blocks_may_come_as_any_iterable():
    """An iterator or tuple of rows is read like a list (not a bare TypeError from the one-block fast path)."""
    m = make()
    serve_fully(m, "s", [1, 2])
    m.add_request("a", [5, 6], 8)
    m.lookup("a", 0)
    m.on_allocated("a", [m.gpu.allocate(2)])
    first, second = m.gpu.allocate(2)
    m.append_blocks("a", iter([[first]]))
    m.append_blocks("a", ((second,),))  # vLLM's new_block_ids: a tuple of lists or tuples, one block a step
    assert m.request("a").block_table[0][-2:] == [first, second]
    for rows in ([[second]], ((second,),), ([second],), [(second,)], ((NUM_GPU,),), ([-2],), ((True,),)):
        before = snapshot(m)
        with pytest.raises(RequestStateError) as refused:  # taken, out of range, no id: each shape refused alike
            m.append_blocks("a", rows)
        as_list = [[*rows[0]]]
        with pytest.raises(RequestStateError) as listed:
            m.append_blocks("a", as_list)
        assert str(refused.value).replace(repr(rows), repr(as_list)) == str(listed.value)
        assert snapshot(m) == before
    m.check_invariants()


class _RaisingHints(HintedPolicy):
    """A user's hint-aware policy whose hint handler has a bug."""

    def on_hints(self, hashes, hints):
        raise RuntimeError("hint handler bug")


class _RefusingHints(HintedPolicy):
    """A hint-aware policy that refuses every hint with a kvkit error."""

    def on_hints(self, hashes, hints):
        super().on_hints([*hashes, 1.5], hints)


@pytest.mark.parametrize(("policy", "pattern"), [(_RaisingHints, r"not added: the CPU policy's on_hints raised"),
                                                 (_RefusingHints, r"block hashes must be ints, got 1.5")])
def test_a_refused_hint_adds_no_request(policy, pattern):
    """A hint handler that raises refuses add_request whole (typed): the id stays free, nothing changed."""
    m = OffloadManager(SPEC, BlockPool(NUM_CPU, eviction=policy()), EagerStore(),
                       gpu=BlockPool(NUM_GPU, eviction=LRUPolicy()))
    before = snapshot(m)
    with pytest.raises(ConfigError, match=pattern):
        m.add_request("h", [1, 2], 8, hints=WorkloadHints(priority=1))
    assert snapshot(m) == before
    m.check_invariants()
    m.add_request("h", [1, 2], 8)  # not "already live"
    m.check_invariants()
