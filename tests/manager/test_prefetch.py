"""``OffloadManager.prefetch``: a waiting request's shared-tier hit fetched into the CPU tier while it waits.

Two instances share one in-process store: the first computes and puts a prompt, the second prefetches it for
a request that has not been scheduled, and the fetch runs through the same shared workers as a shared hit's.
"""

from __future__ import annotations

import time

import pytest

import kvkit
from kvkit.backends.blockstore.memory import MemoryStore
from kvkit.errors import RequestStateError, UnknownRequestError
from kvkit.hashing import hash_blocks
from kvkit.interfaces import HitQuery, LoadPlan, OffloadCallback
from kvkit.reference.engine import ReferenceEngine
from kvkit.testing.doubles import FailingStore

SPEC = kvkit.KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=1, head_dim=4, dtype="float16")
PROMPT = list(range(40))  # 10 blocks; 9 are a hit (at least one token is recomputed)
HASHES = hash_blocks(PROMPT, SPEC.block_size)


class Seen(OffloadCallback):
    def __init__(self):
        self.prefetches = []

    def on_shared_prefetch(self, request_id, prefetch_tokens):
        self.prefetches.append((request_id, prefetch_tokens))


def instance(store, planner="load-all", **kwargs):
    stack = kvkit.build(kv=SPEC, gpu_blocks=16, cpu_blocks=16, copy="torch", device="cpu", cpu_eviction="lru",
                        layout="per-layer", planner=planner, shared={"url": store, "backoff_s": 1e-3}, **kwargs)
    return stack, ReferenceEngine(stack)


@pytest.fixture
def server():
    """A store holding PROMPT's 10 blocks, put by another instance that computed them."""
    store = MemoryStore()
    stack, engine = instance(store)
    engine.add_request("first", HASHES, len(PROMPT))
    engine.step()
    engine.finish("first")
    for _ in range(3):  # stored, then put
        engine.step()
        engine.drain()
    assert stack.stats.blocks_put.value == 10
    stack.close()
    return store


def run(stack, plan):
    """Run ``plan`` on every rank and apply the results (what an engine step does)."""
    for worker in stack.shared_workers:
        worker.submit(plan)
    results = [r for worker in stack.shared_workers for r in worker.drain()]
    return stack.manager.apply_completions(results)


def cpu_refs(stack):
    return [stack.cpu.refcount(b) for b in range(stack.cpu.num_blocks)]


def test_a_prefetched_hit_is_a_cpu_hit_when_the_request_is_scheduled(server):
    seen = Seen()
    stack, _ = instance(server, callbacks=[seen])
    mgr = stack.manager
    mgr.add_request("r", HASHES, len(PROMPT))
    assert mgr.prefetch("r") == 9 * 4 and seen.prefetches == [("r", 36)]
    mgr.check_invariants()
    plan = mgr.build_step()
    assert len(plan.fetches) == 1 and not plan.loads and len(plan.fetches[0][1]) == 9
    assert mgr.cpu_refs_held().total() == 9  # the fetch holds them; the request holds nothing
    run(stack, plan)
    mgr.check_invariants()
    assert cpu_refs(stack) == [0] * 16  # cached, evictable, findable
    assert stack.cpu.lookup(HASHES) == stack.cpu.lookup(HASHES[:9]) and len(stack.cpu.lookup(HASHES)) == 9
    assert stack.stats.blocks_prefetched.value == stack.stats.blocks_fetched.value == 9
    assert mgr.lookup("r", 0) == 36 and mgr.request("r").offered_cpu == 9  # CPU hits now, no fetch left
    assert not mgr.request("r").fetch
    mgr.abort("r")
    mgr.check_invariants()
    assert cpu_refs(stack) == [0] * 16
    stack.close()


def test_the_engine_prefetches_what_it_leaves_waiting_and_loads_it_from_the_cpu_tier(server):
    stack, engine = instance(server)
    gpu = stack.gpu
    hog = gpu.allocate(gpu.num_free)  # no GPU block for anyone
    engine.add_request("r", HASHES, len(PROMPT))
    assert not engine.step().scheduled
    assert engine.step().scheduled == () and stack.stats.blocks_prefetched.value == 9
    req = engine._requests["r"]
    assert req.prefetched == range(9)
    gpu.decref(hog)
    (done,) = engine.step().scheduled
    assert done.cpu_hit_tokens == 36 and stack.stats.shared_hit_tokens.value == 0  # loaded as CPU hits
    assert stack.stats.blocks_fetched.value == 9 and engine.integrity_errors == 0  # fetched once, bytes right
    engine.finish("r")
    engine.step()
    engine.drain()
    assert engine.leaked_blocks() == 0
    stack.check_invariants()
    stack.close()


def test_abort_before_and_while_prefetching_leaks_nothing(server):
    stack, _ = instance(server)
    mgr = stack.manager
    mgr.add_request("a", HASHES, len(PROMPT))
    assert mgr.prefetch("a") == 36
    mgr.abort("a")  # before a step planned the fetch: its blocks are released
    mgr.check_invariants()
    assert cpu_refs(stack) == [0] * 16 and not mgr.build_step().fetches
    mgr.add_request("b", HASHES, len(PROMPT))
    assert mgr.prefetch("b") == 36
    plan = mgr.build_step()
    mgr.abort("b")  # while its fetch is in flight: the fetch still lands, as cached blocks
    mgr.check_invariants()
    run(stack, plan)
    mgr.check_invariants()
    assert cpu_refs(stack) == [0] * 16 and len(stack.cpu.lookup(HASHES)) == 9
    stack.close()


def test_a_failed_prefetch_is_no_hit_and_a_later_lookup_fetches_again(server):
    failing = FailingStore(server)
    stack, _ = instance(failing)
    mgr = stack.manager
    mgr.add_request("r", HASHES, len(PROMPT))
    assert mgr.prefetch("r") == 36
    plan = mgr.build_step()
    failing.down = True
    with pytest.warns(RuntimeWarning, match="shared tier is off"):
        run(stack, plan)
        mgr.check_invariants()
        assert cpu_refs(stack) == [0] * 16 and stack.cpu.lookup(HASHES) == []  # nothing findable, nothing held
        assert stack.stats.fetches_failed.value == 9 and stack.stats.blocks_prefetched.value == 0
        failing.down = False
        for _ in range(100):  # the failure made the tier suspect: its probes bring it back on
            if mgr.shared_status == "on":
                break
            time.sleep(0.002)
            mgr.build_step()
    assert mgr.shared_status == "on"
    assert mgr.lookup("r", 0) == 36 and len(mgr.request("r").fetch) == 9  # a shared hit again
    mgr.abort("r")
    mgr.check_invariants()
    assert cpu_refs(stack) == [0] * 16
    stack.close()


def test_a_prefetch_missing_one_value_keeps_the_others_in_the_cpu_tier(server):
    """A key dropped between a prefetch's lookup and its fetch: that block alone fails (counted, never findable);
    the others are cached CPU blocks, prefetched, so the request's lookup offers the leading run before it as CPU
    hits (no second fetch) and nothing stays held."""
    stack, _ = instance(server)
    mgr = stack.manager
    mgr.add_request("r", HASHES, len(PROMPT))
    assert mgr.prefetch("r") == 36
    plan = mgr.build_step()
    server.drop(stack.shared_workers[0].codec.key(HASHES[6], 0))
    run(stack, plan)
    mgr.check_invariants()
    assert stack.stats.fetches_failed.value == 1
    assert stack.stats.blocks_prefetched.value == stack.stats.blocks_fetched.value == 8
    assert len(stack.cpu.lookup(HASHES)) == 6 and len(stack.cpu.lookup(HASHES[7:])) == 2
    assert cpu_refs(stack) == [0] * 16
    assert mgr.lookup("r", 0) == 24 and mgr.request("r").offered_cpu == 6 and not mgr.request("r").fetch
    mgr.abort("r")
    mgr.check_invariants()
    assert cpu_refs(stack) == [0] * 16
    stack.close()


def test_a_lookup_or_a_second_prefetch_replaces_a_prefetch_no_step_planned(server):
    stack, _ = instance(server)
    mgr = stack.manager
    mgr.add_request("r", HASHES, len(PROMPT))
    assert mgr.prefetch("r") == 36 and mgr.prefetch("r", 8) == 28  # past a GPU hit of 2 blocks
    mgr.check_invariants()
    assert mgr.cpu_refs_held().total() == 7
    assert mgr.lookup("r", 0) == 36  # reserves the hit itself; the prefetch is released
    assert not mgr.request("r").prefetch and mgr.cpu_refs_held().total() == 9
    assert not mgr.build_step().fetches
    mgr.check_invariants()
    mgr.abort("r")
    assert cpu_refs(stack) == [0] * 16
    stack.close()


def test_prefetch_of_an_unknown_running_or_ended_request_is_refused_and_changes_nothing(server):
    stack, engine = instance(server)
    mgr = stack.manager
    with pytest.raises(UnknownRequestError, match="'nobody'"):
        mgr.prefetch("nobody")
    engine.add_request("run", HASHES, len(PROMPT))
    engine.step()
    engine.add_request("done", HASHES, len(PROMPT))
    engine.abort("done")
    mgr.add_request("odd", HASHES, len(PROMPT))
    before = (cpu_refs(stack), stack.stats.as_dict())
    with pytest.raises(RequestStateError, match="'run' is running"):
        mgr.prefetch("run")
    with pytest.raises(RequestStateError, match="'done' already finished"):
        mgr.prefetch("done")
    with pytest.raises(RequestStateError, match="gpu_hit_tokens=3"):
        mgr.prefetch("odd", 3)
    with pytest.raises(RequestStateError, match="'run' is running"):
        engine.prefetch("run")
    with pytest.raises(UnknownRequestError, match="'done'"):
        engine.prefetch("done")
    assert (cpu_refs(stack), stack.stats.as_dict()) == before
    assert not mgr.build_step().fetches
    mgr.check_invariants()
    stack.close()


class SlowTier:
    """A planner whose estimates say the shared tier is slower than recomputing: it loads nothing of it."""

    def plan(self, query: HitQuery) -> LoadPlan:
        return LoadPlan(0, dict(query.runs).get("cpu", 0), query.hit_blocks)

    def estimate_ms(self, query, plan):
        return None

    def observe_move(self, source, num_bytes, seconds):
        pass

    def observe_compute(self, num_tokens, context_tokens, seconds, *, beside_loads=False):
        pass

    def estimates(self):
        return {}


def test_a_prefetch_takes_only_what_the_planner_would_load(server):
    """A prefetch still landing when its request is scheduled must not make the first token later: the planner
    decides, as for a hit found then, and a tier it would not load from is not prefetched."""
    from kvkit.manager import OffloadManager

    stack, _ = instance(server)
    mgr = stack.manager
    slow = OffloadManager(mgr.kv, kvkit.build(kv=SPEC, gpu_blocks=16, cpu_blocks=16).cpu, mgr.store,
                          shared=mgr.shared, planner=SlowTier())
    slow.add_request("r", HASHES, len(PROMPT))
    assert slow.prefetch("r") == 0 and not slow.build_step().fetches
    slow.check_invariants()
    stack.close()


class Broken(SlowTier):
    def plan(self, query):
        raise ValueError("no plan today")


def test_a_failing_planner_is_contained_and_nothing_is_prefetched(server):
    from kvkit.manager import OffloadManager

    stack, _ = instance(server)
    mgr = stack.manager
    broken = OffloadManager(mgr.kv, kvkit.build(kv=SPEC, gpu_blocks=16, cpu_blocks=16).cpu, mgr.store,
                            shared=mgr.shared, planner=Broken())
    broken.add_request("r", HASHES, len(PROMPT))
    with pytest.warns(RuntimeWarning, match="no plan today"):
        assert broken.prefetch("r") == 0
    assert broken.stats.planner_errors.value == 1 and not broken.build_step().fetches
    broken.check_invariants()
    stack.close()
