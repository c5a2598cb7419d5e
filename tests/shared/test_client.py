"""The shared (third) tier through ``kvkit.build`` and the reference engine, with checked bytes."""

import re
import threading
import time
import traceback
import warnings

import attrs
import pytest

import kvkit
from kvkit.backends.blockstore.memory import MemoryStore
from kvkit.config import SharedConfig
from kvkit.errors import ConfigError, RequestStateError
from kvkit.hashing import hash_blocks
from kvkit.interfaces import OffloadCallback
from kvkit.interfaces.types import TransferResult
from kvkit.reference.engine import ReferenceEngine
from kvkit.testing.doubles import FailingStore

SPEC = kvkit.KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=1, head_dim=4, dtype="float32")
TOKENS = list(range(40))  # 10 blocks: a shared hit of 9 (one token is always recomputed)
HASHES = hash_blocks(TOKENS, SPEC.block_size)


class Hooks(OffloadCallback):
    """Records the shared-tier hooks."""

    def __init__(self):
        self.calls = []

    def on_shared_hit(self, request_id, tokens):
        self.calls.append(("hit", tokens))

    def on_shared_fetch(self, num_blocks, ok):
        self.calls.append(("fetch", ok))

    def on_shared_put(self, num_blocks, ok):
        self.calls.append(("put", ok))

    def on_shared_state(self, available, reason):
        self.calls.append(("state", available))


class Clock:
    """The shared tier's clock, moved only by the test: back-off and retries happen when it says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def instance(shared, *, world_size=2, write="write-through", callbacks=(), backoff=1.0, cpu_blocks=16, clock=None):
    # LRU: write-back puts the CPU tier's next victims, and these tests count on them being its oldest blocks.
    stack = kvkit.build(kv=SPEC, gpu_blocks=16, cpu_blocks=cpu_blocks, copy="torch", device="cpu",
                        cpu_eviction="lru", layout="per-layer", world_size=world_size, callbacks=list(callbacks),
                        shared=SharedConfig(url=shared, write=write, backoff_s=backoff))
    if clock is not None:
        tier = stack.manager._shared
        tier.spec = attrs.evolve(tier.spec, clock=clock)
    return stack, ReferenceEngine(stack)


def serve(engine, rid, tokens=TOKENS, steps=4):
    """Run one request to completion and let its stores and puts land; returns the scheduled request."""
    engine.add_request(rid, hash_blocks(tokens, SPEC.block_size), len(tokens))
    req = engine.step().scheduled[0]
    engine.finish(rid)
    for _ in range(steps):
        engine.step()
    engine.drain()
    return req


@pytest.mark.parametrize("write", ["write-through", "write-back"])
def test_second_instance_reuses_the_first_ones_prefix_byte_identical(write):
    """Two instances (two ranks each) share a store: the second loads the first's prefix, bytes checked."""
    store = MemoryStore()
    a, ea = instance(store, write=write, cpu_blocks=16)
    b, eb = instance(store, write=write)
    serve(ea, "a1")
    put = int(a.stats.blocks_put.value)  # write-back: the CPU tier's next 4 victims, its oldest blocks
    assert put == (10 if write == "write-through" else 4)
    hit = min(put, 9)  # one token is always recomputed
    req = serve(eb, "b1")
    assert req.cpu_hit_tokens == 4 * hit and b.stats.shared_hit_tokens.value == 4 * hit
    assert b.stats.blocks_fetched.value == hit and b.stats.loads_failed.value == 0
    assert eb.integrity_errors == 0 and ea.integrity_errors == 0
    assert sum(w.invalid_values for w in b.shared_workers) == 0
    for stack in (a, b):
        stack.check_invariants()
    again = serve(eb, "b2")  # now the second instance's own: nothing fetched again
    assert again.gpu_hit_tokens + again.cpu_hit_tokens == 36 and b.stats.blocks_fetched.value == hit


def test_a_hit_needs_every_ranks_key():
    """A block whose rank-1 shard is gone ends the shared hit there."""
    store = MemoryStore()
    _, ea = instance(store)
    b, eb = instance(store)
    serve(ea, "a1")
    store.drop(b.shared_workers[1].codec.key(HASHES[3], 1))
    req = serve(eb, "b1")
    assert req.cpu_hit_tokens == 3 * SPEC.block_size and eb.integrity_errors == 0


def test_a_key_gone_between_lookup_and_fetch_makes_the_request_recompute():
    """The server evicts a key after the lookup: that block's fetch fails (the others land and are findable),
    the load reading it fails, the bytes are recomputed."""
    store = MemoryStore()
    _, ea = instance(store)
    b, eb = instance(store)
    serve(ea, "a1")
    eb.add_request("b1", HASHES, len(TOKENS))
    assert b.manager.lookup("b1", 0) == 36
    store.drop(b.shared_workers[0].codec.key(HASHES[5], 0))
    b.manager.on_allocated("b1", [b.gpu.allocate(10)], 36)
    plan = b.manager.build_step()
    for worker in b.shared_workers:
        worker.submit(plan)
    report = b.manager.apply_completions([r for w in b.shared_workers for r in w.drain()])
    assert report.load_failed == {"b1"} and not report.loaded
    assert b.stats.fetches_failed.value == 1 and b.stats.blocks_fetched.value == 8
    assert b.shared_workers[0].missing_values == 1
    b.check_invariants()
    assert b.cpu.num_cached == 8, "the fetch's clean blocks were discarded"
    assert len(b.cpu.lookup(HASHES)) == 5, "the failed block of the fetch is findable"


def _planned_fetch(store, callbacks=()):
    """Instance B with a step planned that fetches its 9-block shared hit of ``TOKENS`` (from A) and loads it."""
    _, ea = instance(store)
    b, eb = instance(store, callbacks=callbacks)
    serve(ea, "a1")
    eb.add_request("b1", HASHES, len(TOKENS))
    assert b.manager.lookup("b1", 0) == 36
    b.manager.on_allocated("b1", [b.gpu.allocate(10)], 36)
    return b, b.manager.build_step()


@pytest.mark.parametrize(("lost", "fetched"), [
    ({0: [1], 1: [1, 4]}, [0, 2, 3, 5, 6, 7, 8]),  # a block is intact only if no rank lost it
    ({0: [0, 2, 4, 6, 8], 1: [1, 3, 5, 7]}, []),  # every block lost on some rank: failed as a whole
    ({0: [9]}, []),  # a position beyond the plan: failed as a whole
])
def test_a_fetch_commits_the_blocks_no_rank_lost_and_fails_as_a_whole_when_none_is_left(lost, fetched):
    """Each rank's ``TransferResult.lost`` adds up: only the blocks no rank lost commit (findable, counted
    fetched, in bytes too), the others are discarded and counted failed; with none left, or a position beyond
    the plan, the fetch fails as a whole (``on_shared_fetch`` once for the blocks that landed, once for the
    others)."""
    hooks = Hooks()
    b, plan = _planned_fetch(MemoryStore(), [hooks])
    (tid, fetch), = plan.fetches
    results = [TransferResult(tid, rank, lost=lost.get(rank, ())) for rank in range(2)]
    report = b.manager.apply_completions(results + [TransferResult(t, rank) for t, _ in plan.loads for rank in (0, 1)])
    assert report.loaded == {"b1"}  # these results say the load read its blocks; the worker fails it (above)
    assert b.stats.blocks_fetched.value == len(fetched) and b.stats.fetches_failed.value == 9 - len(fetched)
    assert b.stats.bytes_fetched.value == len(fetched) * b.manager.kv.bytes_per_block
    assert sorted(i for i, h in enumerate(fetch.hashes) if b.cpu.lookup([h])) == fetched
    assert [ok for kind, ok in hooks.calls if kind == "fetch"] == [True] * bool(fetched) + [False]
    b.check_invariants()


def test_blocks_lost_by_a_transfer_other_than_a_fetch_fail_it_as_a_whole():
    """``TransferResult.lost`` on a load (not a shared-tier fetch) fails that load: its request recomputes."""
    b, plan = _planned_fetch(MemoryStore())
    (fetch_id, _), = plan.fetches
    results = [TransferResult(fetch_id, rank) for rank in (0, 1)]
    results += [TransferResult(t, rank, lost=[0] if rank else ()) for t, _ in plan.loads for rank in (0, 1)]
    report = b.manager.apply_completions(results)
    assert report.load_failed == {"b1"} and b.stats.blocks_fetched.value == 9 and b.stats.blocks_loaded.value == 0
    b.check_invariants()


def test_a_corrupted_value_is_a_counted_miss_never_loaded():
    """One flipped payload byte: that rank's check fails, the request recomputes with correct bytes."""
    store = MemoryStore()
    _, ea = instance(store)
    b, eb = instance(store)
    serve(ea, "a1")
    key = b.shared_workers[1].codec.key(HASHES[2], 1)
    value = bytearray(store._values[key])
    value[-1] ^= 0xFF
    store._values[key] = bytes(value)
    req = serve(eb, "b1")
    assert b.shared_counts == {"missing_values": 0, "invalid_values": 1, "transport_errors": 0}
    assert b.stats.loads_failed.value == 1
    assert req.cpu_hit_tokens == 0 and eb.integrity_errors == 0


def test_a_down_server_turns_the_tier_off_loudly_and_back_on():
    """Puts to a down server fail: one warning, the tier backs off, requests are served; a probe brings it back."""
    hooks, clock = Hooks(), Clock()
    store = FailingStore(MemoryStore(), down=True)
    stack, engine = instance(store, callbacks=[hooks], backoff=0.05, clock=clock)
    with pytest.warns(RuntimeWarning, match="shared tier is off"):
        serve(engine, "r1")
        serve(engine, "r2", [9000 + t for t in range(40)])
    assert stack.stats.shared_outages.value == 1 and stack.stats.puts_failed.value > 0
    assert stack.manager.shared_status.startswith("off")
    assert ("state", False) in hooks.calls and engine.integrity_errors == 0
    assert stack.shared_counts["transport_errors"] > 0
    assert "backing off 0.05 s" in stack.manager.shared_status  # no retry yet: the clock stood still
    store.down = False
    clock.now += 0.05
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # coming back is not a warning
        for _ in range(3):
            engine.step()
    assert stack.manager.shared_status == "on" and stack.stats.shared_recoveries.value == 1
    assert ("state", True) in hooks.calls
    serve(engine, "r3", [5000 + t for t in range(40)])
    assert stack.stats.blocks_put.value >= 9 and ("put", True) in hooks.calls


def test_a_failed_retry_doubles_the_back_off():
    """Each failed probe doubles the interval (capped); the status line says how long."""
    store, clock = FailingStore(MemoryStore(), down=True), Clock()
    stack, engine = instance(store, backoff=0.02, clock=clock)
    with pytest.warns(RuntimeWarning):
        serve(engine, "r1")
    assert "backing off 0.02 s" in stack.manager.shared_status
    clock.now += 0.02
    engine.step()  # the probe goes out...
    engine.step()  # ...and fails
    assert "backing off 0.04 s" in stack.manager.shared_status and stack.stats.shared_outages.value == 1


def test_hooks_see_hits_fetches_and_puts():
    """on_shared_hit / on_shared_fetch / on_shared_put fire with the lifecycle."""
    store, hooks = MemoryStore(), Hooks()
    _, ea = instance(store, callbacks=[hooks])
    _, eb = instance(store, callbacks=[hooks])
    serve(ea, "a1")
    serve(eb, "b1")
    assert ("put", True) in hooks.calls and ("hit", 36) in hooks.calls and ("fetch", True) in hooks.calls


def test_memory_urls_share_one_store_per_name():
    """``memory://NAME`` stacks of one process share a store; another name does not."""
    _, ea = instance("memory://test-urls")
    _, eb = instance("memory://test-urls")
    _, ec = instance("memory://other-name")
    serve(ea, "a1")
    assert serve(eb, "b1").cpu_hit_tokens == 36
    assert serve(ec, "c1").cpu_hit_tokens == 0


def test_scheduler_only_stacks_share_keys_without_bytes():
    """The simulator's stacks (no workers' bytes) still put and find every rank's key."""
    store = MemoryStore()
    stacks = [kvkit.build(kv=SPEC, gpu_blocks=16, cpu_blocks=16, copy=None, shared=store, world_size=2)
              for _ in range(2)]
    engines = [ReferenceEngine(s) for s in stacks]
    serve(engines[0], "a")
    assert serve(engines[1], "b").cpu_hit_tokens == 36
    assert stacks[1].stats.blocks_fetched.value == 9


def test_different_models_never_share_blocks():
    """The namespace separates models: same tokens, another ``shared.model``, no hit."""
    store = MemoryStore()
    _, ea = instance(store)
    other = kvkit.build(kv=SPEC, gpu_blocks=16, cpu_blocks=16, copy="torch", device="cpu", layout="per-layer",
                        shared={"url": store, "model": "another-model"}, world_size=2)
    serve(ea, "a1")
    assert serve(ReferenceEngine(other), "b1").cpu_hit_tokens == 0


@pytest.mark.parametrize(("shared", "quoted"), [
    (42, "shared=42"),
    ("no-scheme", "shared.url='no-scheme'"),
    ({"url": "memory://", "write": "write-sideways"}, "shared.write='write-sideways'"),
    ({"url": "memory://", "model": ""}, "shared.model=''"),
    ({"url": "memory://", "backoff_s": 0}, "shared.backoff_s=0"),
    ({"url": "memory://", "tenant": "a:b"}, "shared.tenant='a:b'"),
    ({"url": "memory://", "secret": "text"}, "shared.secret: must be non-empty bytes, got a str"),
    ({"url": "memory://", "wrte": "write-back"}, "did you mean 'write'?"),
])
def test_config_refuses_a_bad_shared_tier(shared, quoted):
    """Every field of the shared tier is validated, the bad value quoted, beside the config's other problems."""
    with pytest.raises(ConfigError, match=re.escape(quoted)) as info:
        kvkit.StackConfig(kv=SPEC, gpu_blocks=4, cpu_blocks=4, shared=shared, world_size=0)
    assert "world_size=0" in str(info.value)


def test_the_secret_is_never_shown():
    """The shared tier's secret appears in no repr (of the config, the stack's spec, its codec) and no error."""
    config = kvkit.StackConfig(kv=SPEC, gpu_blocks=4, cpu_blocks=4, copy=None, device="cpu",
                               shared=SharedConfig(url="memory://secret-test", secret=b"hunter2-top-secret"))
    assert config.shared.secret == b"hunter2-top-secret"
    stack = kvkit.build(config)
    shown = [repr(config), repr(config.shared), str(config), repr(stack.manager), repr(stack)]
    assert not any("hunter2" in text for text in shown)
    for bad in ("hunter2-as-text", b""):
        with pytest.raises(ConfigError) as info:
            SharedConfig(url="memory://", secret=bad)
        assert "hunter2" not in str(info.value) and "shared.secret" in str(info.value)
    stack.close()


def test_a_url_string_is_the_common_case():
    """``shared="memory://"`` is ``SharedConfig(url="memory://")``; a mapping of its fields is taken too."""
    config = kvkit.StackConfig(kv=SPEC, gpu_blocks=4, cpu_blocks=4, shared="memory://")
    assert config.shared == SharedConfig(url="memory://")
    assert kvkit.StackConfig(kv=SPEC, gpu_blocks=4, cpu_blocks=4, shared={"url": "memory://"}).shared == config.shared


def test_write_back_needs_a_pool_that_previews_its_victims():
    """write-back with a CPU pool lacking eviction_candidates is refused at build."""
    from kvkit.backends.allocator import BlockPool
    from kvkit.backends.eviction.lru import LRUPolicy
    from kvkit.backends.store import EagerStore
    from kvkit.manager import OffloadManager
    from kvkit.shared.client import FormatCodec
    from kvkit.shared.scheduler import SharedTierSpec

    class Plain:  # a BlockAllocator that hides eviction_candidates
        def __init__(self, pool):
            self._pool = pool

        def __getattr__(self, name):
            if name in ("eviction_candidates", "eviction_window", "in_eviction_window"):
                raise AttributeError(name)
            return getattr(self._pool, name)

    spec = SharedTierSpec(store=MemoryStore(), codec=FormatCodec.for_stack(SPEC, 1, model="m", layout="none"),
                          write="write-back")
    cpu = Plain(BlockPool(4, eviction=LRUPolicy()))
    with pytest.raises(ConfigError, match="write-back"):
        OffloadManager(SPEC, cpu, EagerStore(), gpu=BlockPool(4, eviction=LRUPolicy()), shared=spec)


class RaisingStore(MemoryStore):
    """A client whose every put and get raises, as a broken client library might."""

    def put(self, keys, values):
        raise ConnectionError("client library bug")

    def get(self, keys, buffers):
        raise ConnectionError("client library bug")


def test_a_client_that_raises_fails_its_transfers_never_the_step():
    """put/get raising inside a worker: the put is reported failed and the tier turns off; requests go on."""
    stack, engine = instance(RaisingStore())
    with pytest.warns(RuntimeWarning, match="probe raised"):
        serve(engine, "r1")
        serve(engine, "r2", [4000 + t for t in range(40)])
    assert stack.stats.puts_failed.value > 0 and stack.stats.shared_outages.value == 1
    assert stack.shared_counts["transport_errors"] > 0 and engine.integrity_errors == 0
    stack.check_invariants()


def test_a_file_url_store_is_owned_and_closed_by_its_stack(tmp_path):
    """``shared="file://..."``: the stack opens the disk store, the next stack reads it, close() closes it."""
    url = f"file://{tmp_path}?capacity_bytes=16MiB"
    a, ea = instance(url)
    serve(ea, "a1")
    assert a.owns_shared_store and a.stats.blocks_put.value == 10
    a.close()
    assert a.shared_store.closed
    b, eb = instance(url)
    assert serve(eb, "b1").cpu_hit_tokens == 36 and eb.integrity_errors == 0
    b.close()


def test_open_shared_owns_only_what_it_built(tmp_path):
    """A store instance stays its giver's and memory:// stores the process's; a file:// store is the caller's."""
    from kvkit.shared.client import open_shared

    given = MemoryStore()
    assert open_shared(given) == (given, False)
    store, owned = open_shared("memory://test-client-owned")
    assert not owned and store is kvkit.open_block_store("memory://test-client-owned")
    store, owned = open_shared(f"file://{tmp_path}?capacity_bytes=1MiB")
    assert owned
    store.close()
    with pytest.raises(ConfigError, match="block store URL 42"):
        open_shared(42)


@pytest.mark.parametrize("shared", ["memory://test-client-kept", MemoryStore()], ids=["memory-url", "instance"])
def test_a_stack_never_closes_a_store_it_does_not_own(shared):
    """Closing a stack leaves the process's memory:// store and a user-given store open for the others."""
    a, ea = instance(shared)
    serve(ea, "a1")
    assert not a.owns_shared_store
    a.close()
    assert not a.shared_store.closed
    _, eb = instance(shared)
    assert serve(eb, "b1").cpu_hit_tokens == 36


@pytest.fixture
def real_server():
    """A Valkey server of this test's own (to kill, pause and restart), or a skip."""
    from kvkit.errors import BackendUnavailableError
    from kvkit.testing.servers import LocalServer, server_binary

    try:
        server = LocalServer(server_binary()).start()
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    yield server
    server.stop()


@pytest.mark.parametrize("fault", ["killed", "paused"])
def test_a_real_server_that_dies_or_stalls_never_fails_a_request(real_server, fault):
    """Killed or SIGSTOPped mid-run: requests go on with right bytes, the tier turns off, then comes back."""
    url = real_server.url + "?request_timeout_s=0.3&connect_timeout_s=0.3&retry_interval_s=0.05"
    stack, engine = instance(url, backoff=0.05)
    serve(engine, "warm")
    assert stack.stats.blocks_put.value == 10
    real_server.kill() if fault == "killed" else real_server.pause()
    started = time.monotonic()
    with pytest.warns(RuntimeWarning, match="shared tier is off"):
        for i in range(3):
            serve(engine, f"down{i}", [3000 * (i + 1) + t for t in range(40)])
    assert time.monotonic() - started < 10, "requests waited on the dead server"
    assert stack.stats.shared_outages.value == 1 and engine.integrity_errors == 0
    real_server.start() if fault == "killed" else real_server.resume()
    deadline = time.monotonic() + 10
    while stack.manager.shared_status != "on" and time.monotonic() < deadline:
        time.sleep(0.06)
        engine.step()
    assert stack.manager.shared_status == "on" and stack.stats.shared_recoveries.value >= 1
    put = stack.stats.blocks_put.value
    serve(engine, "after", [8000 + t for t in range(40)])
    assert stack.stats.blocks_put.value > put and engine.integrity_errors == 0
    stack.close()


class _Held:
    """A store in front of another whose answers stay held back until ``release``."""

    def __init__(self, inner):
        self.inner, self.held, self.holding = inner, [], True

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def poll(self, tickets, timeout=0.0):
        wanted = set(tickets)
        self.held += self.inner.poll(wanted, 0.0)
        if self.holding:
            return []
        out = [r for r in self.held if r.ticket in wanted]
        self.held = [r for r in self.held if r.ticket not in wanted]
        return out

    def release(self):
        self.holding = False


def test_a_fetch_the_store_answers_too_late_fails_without_raising_and_is_reported_failed():
    """A fetch past wait_timeout_s fails all its blocks at once; the late answer is reported failed, never ok."""
    from kvkit.interfaces import Direction
    from kvkit.interfaces.shared import SharedPlan
    from kvkit.shared.client import FormatCodec
    from kvkit.shared.worker import SharedTierWorker

    codec = FormatCodec.for_stack(SPEC, 1, model="m", layout="none")
    store = _Held(MemoryStore())
    store.release()
    worker = SharedTierWorker(SPEC, store, codec, wait_timeout_s=0.05)
    worker.put([(1, SharedPlan(Direction.STORE, [3], [HASHES[0]]))])
    assert [r.ok for r in worker.take_store_results()] == [True]
    store.holding = True
    start = time.monotonic()
    assert worker.fetch([(2, SharedPlan(Direction.LOAD, [5], [HASHES[0]]))]) == {5}
    assert time.monotonic() - start < 1.0
    assert worker.take_store_results() == []  # still in flight
    store.release()
    assert [(r.transfer_id, r.ok) for r in worker.take_store_results()] == [(2, False)]
    worker.check_invariants()


def test_fetches_started_together_are_each_checked_whichever_the_store_answers_first():
    """Several gets started in one step: answering one never finishes another unchecked (each is checked once)."""
    from kvkit.interfaces import Direction
    from kvkit.interfaces.shared import SharedPlan
    from kvkit.shared.client import FormatCodec
    from kvkit.shared.worker import SharedTierWorker

    codec = FormatCodec.for_stack(SPEC, 1, model="m", layout="none")
    store = MemoryStore()
    worker = SharedTierWorker(SPEC, store, codec, wait_timeout_s=1.0)
    worker.put([(1, SharedPlan(Direction.STORE, [3, 4], HASHES[:2]))])
    assert [r.ok for r in worker.take_store_results()] == [True]
    fetches = [(2, SharedPlan(Direction.LOAD, [5], HASHES[:1])), (3, SharedPlan(Direction.LOAD, [6], HASHES[1:2])),
               (4, SharedPlan(Direction.LOAD, [7], HASHES[2:3]))]  # the last was never put: missing
    assert worker.fetch(fetches) == {7}
    assert sorted((r.transfer_id, r.ok) for r in worker.take_store_results()) == [(2, True), (3, True), (4, False)]
    assert worker.missing_values == 1
    worker.check_invariants()


def test_a_step_without_fetches_never_waits_on_a_put_in_flight():
    """No fetch to wait for: the worker does not poll the store, so a slow put never holds the step."""
    from kvkit.interfaces import Direction
    from kvkit.interfaces.shared import SharedPlan
    from kvkit.shared.client import FormatCodec
    from kvkit.shared.worker import SharedTierWorker

    class Timed(_Held):
        def poll(self, tickets, timeout=0.0):
            self.waits.append(timeout)
            return super().poll(tickets, timeout)

    store = Timed(MemoryStore())
    store.waits = []
    worker = SharedTierWorker(SPEC, store, FormatCodec.for_stack(SPEC, 1, model="m", layout="none"),
                              wait_timeout_s=5.0)
    worker.put([(1, SharedPlan(Direction.STORE, [3], [HASHES[0]]))])  # held back: still in flight
    assert worker.fetch([]) == set()
    assert store.waits == []
    store.release()
    assert [r.ok for r in worker.take_store_results()] == [True]


class _NoDeadline(MemoryStore):
    """A third-party store written to a protocol whose ``contains`` took no deadline."""

    def contains(self, keys):  # type: ignore[override]
        return super().contains(keys)


def test_a_store_whose_contains_takes_no_deadline_is_refused_at_build_never_in_a_step(tmp_path):
    """A step passes its deadline to ``contains``: a store that cannot take it is a ``ConfigError`` naming its
    class when the stack is built (given as an instance, or opened from a registered URL scheme and then closed),
    not a failure in every step."""
    from kvkit.registry import SHARED

    with pytest.raises(ConfigError, match=r"_NoDeadline: contains\(keys\) takes no timeout_s"):
        instance(_NoDeadline())
    built = []

    def factory(url, **options):
        built.append(_NoDeadline(**options))
        return built[-1]

    SHARED.register("nodeadline", factory, override=True)
    with pytest.raises(ConfigError, match="takes no timeout_s"):
        instance("nodeadline://x")
    assert len(built) == 1 and built[0].closed


class SlowPuts(OffloadCallback):
    """Sleeps in every put's hook once armed: a step that applies a put's result runs long."""

    def __init__(self):
        self.armed = False
        self.in_step = threading.Event()

    def on_shared_put(self, num_blocks, ok):
        if self.armed:
            self.in_step.set()
            time.sleep(0.3)


@pytest.mark.parametrize("layout", ["per-layer", None], ids=["bytes", "scheduler-only"])
def test_close_from_another_thread_waits_for_the_step_then_refuses_the_next(real_server, layout):
    """close() mid-step, from another thread: the step ends unharmed, every kvkit thread ends, a later step
    raises RequestStateError."""
    slow = SlowPuts()
    stack = kvkit.build(kv=SPEC, gpu_blocks=16, cpu_blocks=16, copy="torch", device="cpu", layout=layout,
                        callbacks=[slow], shared=SharedConfig(url=real_server.url))
    engine = ReferenceEngine(stack)
    assert stack.owns_shared_store
    errors, refused = [], []

    def drive():  # steps until a call is refused; a call that started before close() must end unharmed
        try:
            for i in range(100):
                slow.armed = i > 0
                tokens = [1000 * i + t for t in range(40)]
                engine.add_request(f"r{i}", hash_blocks(tokens, SPEC.block_size), len(tokens))
                engine.step()
                engine.finish(f"r{i}")
                engine.step()
        except RequestStateError as exc:
            refused.append(exc)
        except Exception as exc:  # noqa: BLE001 - the test reports what the driving thread met
            errors.append(exc)

    driver = threading.Thread(target=drive)
    driver.start()
    assert slow.in_step.wait(10), "no put reached its hook"
    try:
        stack.close()
    finally:
        driver.join(10)
    assert errors == [] and not driver.is_alive()
    assert len(refused) == 1  # the loop's first call after close() was refused
    frames = [frame.name for frame in traceback.extract_tb(refused[0].__traceback__)]
    assert frames == ["drive", "call", "admit"], frames  # refused as it started, not midway
    assert [t.name for t in threading.enumerate() if t.name.startswith("kvkit")] == []
    with pytest.raises(RequestStateError, match="the stack is closed"):
        engine.step()
    with pytest.raises(RequestStateError, match="the stack is closed"):
        stack.manager.build_step()
