"""A stateful machine driving whole stacks through the reference engine, moving real bytes."""

import hypothesis.strategies as st
import pytest
from hypothesis import target
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvkit
from kvkit.backends.blockstore.memory import MemoryStore
from kvkit.errors import OutOfBlocksError, RequestStateError
from kvkit.hashing import hash_blocks
from kvkit.interfaces import OffloadCallback
from kvkit.reference.engine import ReferenceEngine
from kvkit.testing.doubles import FailingStore

SPEC = kvkit.KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=1, head_dim=4, dtype="float16")
HYBRID = kvkit.KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=1, head_dim=4, dtype="float16",
                           groups=[kvkit.KVGroupSpec([0]),
                                   kvkit.KVGroupSpec([1], kind="sliding_window", window=6)])
PREFIXES = [list(range(100 * p, 100 * p + 24)) for p in range(2)]
HINTS = st.builds(kvkit.WorkloadHints, priority=st.integers(-1, 2), ttl_s=st.none() | st.floats(0.5, 60),
                  kind=st.sampled_from([None, "chat", "batch"]))


class _Fetching(OffloadCallback):
    """Tells the machine each shared hit the manager accepts (after the step's lookups, before its fetch)."""

    def __init__(self, machine):
        self.machine = machine

    def on_shared_hit(self, request_id, shared_hit_tokens):
        self.machine.lose(request_id)


class EngineMachine(RuleBasedStateMachine):
    """Random requests with shared prefixes, salts and hints, finishes, aborts, preemptions and resets.

    Stacks vary by store policy, CPU eviction policy (hint-aware ones
    included), hybrid KV groups, world size, shared tier, load planner and
    layered loads.

    After every step: every loaded block's bytes equal what the engine wrote for
    its content, and every component's invariants hold. At teardown, once all
    requests end and transfers drain, nothing is pinned or leaked. With a
    shared tier, its server drops keys and goes down at random (a key also
    between a step's lookup and its fetch): a fetched block's bytes are
    checked like any loaded block's, a request whose load failed fetched a
    key lost in its step (a load's other requests keep their hits), and the
    step loaded exactly the hit blocks of the requests whose load did not
    fail (the rest of each prompt is computed).
    """

    @initialize(store=st.sampled_from(["eager", "lazy", "selective"]),
                eviction=st.sampled_from(["lru", "arc", "s3fifo", "lirs", "hit-density", "hinted"]),
                hybrid=st.booleans(), world_size=st.integers(1, 2),
                shared=st.sampled_from([None, "write-through", "write-back"]),
                layered=st.booleans(), planner=st.sampled_from(["overlap", "load-all"]), prefetch=st.booleans())
    def setup(self, store, eviction, hybrid, world_size, shared, layered, planner, prefetch):
        spec = HYBRID if hybrid and store != "lazy" else SPEC
        self.server = MemoryStore() if shared else None
        self.shared = FailingStore(self.server) if shared else None
        self.losing: int | None = None  # the next step drops this key (by index) of the first shared hit it fetches
        self.fetching: dict[str, list] = {}  # this step's shared hits: request -> hashes fetched
        self.lost: set = set()  # hashes whose key this step dropped after its lookup
        self.stack = kvkit.build(kv=spec, gpu_blocks=12 * len(spec.groups), cpu_blocks=12, store=store,
                                 cpu_eviction=eviction, layout="per-layer", device="cpu",
                                 world_size=world_size, planner=planner, callbacks=[_Fetching(self)],
                                 shared=None if shared is None else {"url": self.shared, "write": shared,
                                                                      "backoff_s": 1e-3})
        self.engine = ReferenceEngine(self.stack, layered=layered, prefetch_waiting=prefetch)
        self.report = None  # the last step's
        self.next_id = 0

    @rule(prefix=st.integers(0, 1), extra=st.integers(1, 13), salt=st.sampled_from([None, "a"]),
          seed=st.integers(0, 3), hints=st.none() | HINTS)
    def add(self, prefix, extra, salt, seed, hints=None):
        self._add(PREFIXES[prefix] + [7 * seed + i for i in range(extra)], salt, hints)

    def _add(self, tokens, salt=None, hints=None):
        """Queue a request of ``tokens``; its id, or ``None`` if the GPU pool could never hold it."""
        hashes = hash_blocks(tokens, SPEC.block_size, extra_keys=(salt,) if salt else ())
        rid = f"r{self.next_id}"
        try:
            self.engine.add_request(rid, hashes, len(tokens), hints=hints)
        except OutOfBlocksError:
            return None
        self.next_id += 1
        return rid

    @rule(prefix=st.integers(0, 1), extra=st.integers(1, 13), salt=st.sampled_from([None, "a"]),
          forget=st.booleans())
    def whole_turn(self, prefix, extra, salt, forget):
        """One request from arrival to finish in two steps, optionally clearing the GPU cache after."""
        before = self.next_id
        self.add(prefix, extra, salt, seed=0)
        if self.next_id == before:
            return
        self._step()
        rid = f"r{before}"
        if any(r.request_id == rid for r in self.engine.running):
            self.engine.finish(rid)
        self._step()
        if forget:
            self.forget_gpu_cache()

    @rule()
    def step(self):
        self._step()

    @precondition(lambda self: self.server is not None)
    @rule(i=st.integers(0, 99))
    def step_losing_a_fetched_key(self, i):
        """The server drops a key between the step's lookups and its fetch (a shared hit's block on one rank)."""
        self.losing = i
        self._step()

    @precondition(lambda self: self.server is not None)
    @rule(sizes=st.tuples(st.integers(1, 4), st.integers(1, 4)), i=st.integers(0, 99))
    def two_fetches_one_key_lost(self, sizes, i):
        """Short prompts of both prefixes are served and put, the GPU and CPU tiers forget them, then a request
        of each arrives: the step that fetches both loses one key of a fetched block."""
        prompts = [PREFIXES[p][:SPEC.block_size * n + 1] for p, n in enumerate(sizes)]
        for tokens in prompts:
            rid = self._add(tokens)
            self._step()
            if any(r.request_id == rid for r in self.engine.running):
                self.engine.finish(rid)
            self._step()
        self._step()  # the turns' stores committed: put them
        self.forget_gpu_cache()
        self.forget_cpu_cache()
        for tokens in prompts:
            self._add(tokens)
        self.step_losing_a_fetched_key(i)

    def _step(self):
        """One engine step; checks which loads failed and what was loaded."""
        stats = self.stack.stats
        loaded, failed = stats.blocks_loaded.value, stats.loads_failed.value
        self.fetching, self.lost = {}, set()
        report = self.engine.step()
        self.losing = None
        for rid in report.load_failed:
            assert self.lost.intersection(self.fetching.get(rid, ())), f"{rid}'s load failed, reading no lost block"
        kept = [r for r in report.scheduled if r.request_id not in report.load_failed]
        assert stats.blocks_loaded.value - loaded == sum(r.cpu_hit_tokens // SPEC.block_size for r in kept)
        assert stats.loads_failed.value - failed == len(report.load_failed)
        self.report = report

    def lose(self, request_id):
        """As the manager accepts ``request_id``'s shared hit, drop one key of it if a step asked for that."""
        r = self.stack.manager.request(request_id)
        hashes = r.block_hashes[r.fetch_start:r.fetch_start + len(r.fetch)]
        self.fetching[request_id] = hashes
        if self.losing is not None and hashes:
            i, self.losing = self.losing, None
            block_hash = hashes[i % len(hashes)]
            if self.server.drop(self.stack.manager.shared.codec.key(block_hash, i % self.stack.config.world_size)):
                self.lost.add(block_hash)

    @precondition(lambda self: self.engine.running)
    @rule(data=st.data())
    def finish(self, data):
        req = data.draw(st.sampled_from(self.engine.running))
        self.engine.finish(req.request_id)

    @precondition(lambda self: self.engine.running)
    @rule(data=st.data())
    def preempt(self, data):
        req = data.draw(st.sampled_from(self.engine.running))
        self.engine.preempt(req.request_id)

    @precondition(lambda self: self.engine.running or self.engine.num_waiting)
    @rule(data=st.data())
    def abort(self, data):
        ids = [r.request_id for r in self.engine.running] + [
            r.request_id for r in self.engine._waiting]
        self.engine.abort(data.draw(st.sampled_from(ids)))

    @precondition(lambda self: self.engine.num_waiting)
    @rule(data=st.data())
    def prefetch(self, data):
        """A waiting request's shared-tier hit is prefetched (again); a running one's is refused."""
        req = data.draw(st.sampled_from(list(self.engine._waiting)))
        assert self.engine.prefetch(req.request_id) % SPEC.block_size == 0
        if self.engine.running:
            with pytest.raises(RequestStateError):
                self.engine.prefetch(self.engine.running[0].request_id)

    @rule()
    def forget_gpu_cache(self):
        """Other work takes every free GPU block, evicting the whole GPU prefix cache."""
        gpu = self.stack.gpu
        gpu.decref(gpu.allocate(gpu.num_free))

    @rule(prefix=st.integers(0, 1), extra=st.integers(1, 13))
    def wait_for_gpu_blocks(self, prefix, extra):
        """A turn of ``prefix`` is served (and put), then another arrives while other work holds every free GPU
        block and the GPU and CPU tiers forgot what they cached: the step leaves it waiting (its shared-tier hit
        is prefetched), then the blocks come free."""
        self.whole_turn(prefix, extra, None, forget=False)
        self._step()  # the turn's stores committed: put them
        self.forget_gpu_cache()
        self.forget_cpu_cache()
        gpu = self.stack.gpu
        hog = gpu.allocate(gpu.num_free)
        self.add(prefix, extra, None, seed=1)
        self._step()
        gpu.decref(hog)

    @rule()
    def forget_cpu_cache(self):
        """Other work takes every free CPU block, evicting what the CPU tier cached (the shared tier still has it)."""
        cpu = self.stack.cpu
        cpu.decref(cpu.allocate(cpu.num_free))

    @rule()
    def reset(self):
        self.engine.reset_cpu_tier()

    @precondition(lambda self: self.server is not None)
    @rule(i=st.integers(0, 99))
    def server_drops(self, i):
        """The shared tier's server evicts a key of its own accord."""
        held = list(self.server._values)
        if held:
            self.server.drop(held[i % len(held)])

    @precondition(lambda self: self.shared is not None)
    @rule(down=st.booleans())
    def server_state(self, down):
        """The shared tier's server stops answering, or comes back."""
        self.shared.down = down

    @invariant()
    def bytes_and_invariants_hold(self):
        assert self.engine.integrity_errors == 0
        self.stack.check_invariants()

    def teardown(self):
        if currently_in_test_context():  # not when a test replays the machine by hand
            target(float(self.stack.stats.blocks_loaded), label="blocks loaded from the CPU tier")
            target(float(self.stack.stats.blocks_prefetched), label="blocks prefetched from the shared tier")
        if self.shared is not None:
            self.shared.down = False
        for req in list(self.engine.running):
            self.engine.finish(req.request_id)
        for _ in range(4 * self.engine.num_waiting + 4):  # nothing else runs: each is admitted within a few steps
            if not self.engine.num_waiting:
                break
            self.engine.step()
            for req in list(self.engine.running):
                self.engine.finish(req.request_id)
        assert not self.engine.num_waiting, "requests still wait although nothing else holds a GPU block"
        self.engine.step()
        self.engine.drain()
        self.engine.step()
        self.engine.drain()
        assert self.engine.integrity_errors == 0
        assert self.engine.leaked_blocks() == 0
        self.stack.check_invariants()
        self.stack.close()


TestEngineMachine = EngineMachine.TestCase


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("layered", [False, True])
def test_machine_replays_a_key_lost_under_one_of_two_fetches(world_size, layered):
    """The machine's checks of a step's failed loads, replayed on the case they exist for: two requests fetch
    their shared hits in one step and a key of the first one's is lost; only that request recomputes its hit,
    the other loads its own (checked), and only its blocks count loaded."""
    machine = EngineMachine()
    machine.setup(store="eager", eviction="lru", hybrid=False, world_size=world_size, shared="write-through",
                  layered=layered, planner="load-all", prefetch=False)
    machine.two_fetches_one_key_lost((2, 3), 0)
    report = machine.report
    assert report.load_failed == {"r2"} and machine.lost
    assert [(r.request_id, r.cpu_hit_tokens) for r in report.scheduled] == [("r2", 0), ("r3", 12)]
    machine.bytes_and_invariants_hold()
    machine.teardown()


def test_machine_catches_a_copy_that_misplaces_blocks(monkeypatch):
    """A backend that writes each block one slot off is found by the byte checks."""
    import numpy as np
    import pytest
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    from kvkit.backends.copy.torch_copy import TorchCopy
    from kvkit.interfaces import TransferPlan

    real = TorchCopy.submit

    def shifted(self, plan, *, after=None):
        if len(plan) > 1 and plan.direction is kvkit.Direction.LOAD:
            plan = TransferPlan(np.roll(plan.src, 1), plan.dst, plan.direction, plan.group)
        return real(self, plan, after=after)

    monkeypatch.setattr(TorchCopy, "submit", shifted)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(EngineMachine, settings=settings(
            max_examples=200, stateful_step_count=30, deadline=None, database=None, derandomize=True,
            phases=[Phase.generate, Phase.target], report_multiple_bugs=False,
            suppress_health_check=list(HealthCheck)))
