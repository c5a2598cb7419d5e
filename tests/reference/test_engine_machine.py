"""A stateful machine driving whole stacks through the reference engine, moving real bytes."""

import hypothesis.strategies as st
import pytest
from hypothesis import target
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvkit
from kvkit.backends.blockstore.memory import MemoryStore
from kvkit.errors import OutOfBlocksError, RequestStateError
from kvkit.hashing import hash_blocks
from kvkit.reference.engine import ReferenceEngine
from kvkit.testing.doubles import FailingStore

SPEC = kvkit.KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=1, head_dim=4, dtype="float16")
HYBRID = kvkit.KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=1, head_dim=4, dtype="float16",
                           groups=[kvkit.KVGroupSpec([0]),
                                   kvkit.KVGroupSpec([1], kind="sliding_window", window=6)])
PREFIXES = [list(range(100 * p, 100 * p + 24)) for p in range(2)]
HINTS = st.builds(kvkit.WorkloadHints, priority=st.integers(-1, 2), ttl_s=st.none() | st.floats(0.5, 60),
                  kind=st.sampled_from([None, "chat", "batch"]))


class EngineMachine(RuleBasedStateMachine):
    """Random requests with shared prefixes, salts and hints, finishes, aborts, preemptions and resets.

    Stacks vary by store policy, CPU eviction policy (hint-aware ones
    included), hybrid KV groups, world size, shared tier, load planner and
    layered loads.

    After every step: every loaded block's bytes equal what the engine wrote for
    its content, and every component's invariants hold. At teardown, once all
    requests end and transfers drain, nothing is pinned or leaked. With a
    shared tier, its server drops keys and goes down at random: a fetched
    block's bytes are checked like any loaded block's.
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
        self.stack = kvkit.build(kv=spec, gpu_blocks=12 * len(spec.groups), cpu_blocks=12, store=store,
                                 cpu_eviction=eviction, layout="per-layer", device="cpu",
                                 world_size=world_size, planner=planner,
                                 shared=None if shared is None else {"url": self.shared, "write": shared,
                                                                      "backoff_s": 1e-3})
        self.engine = ReferenceEngine(self.stack, layered=layered, prefetch_waiting=prefetch)
        self.next_id = 0

    @rule(prefix=st.integers(0, 1), extra=st.integers(1, 13), salt=st.sampled_from([None, "a"]),
          seed=st.integers(0, 3), hints=st.none() | HINTS)
    def add(self, prefix, extra, salt, seed, hints=None):
        tokens = PREFIXES[prefix] + [7 * seed + i for i in range(extra)]
        hashes = hash_blocks(tokens, SPEC.block_size, extra_keys=(salt,) if salt else ())
        try:
            self.engine.add_request(f"r{self.next_id}", hashes, len(tokens), hints=hints)
        except OutOfBlocksError:
            return
        self.next_id += 1

    @rule(prefix=st.integers(0, 1), extra=st.integers(1, 13), salt=st.sampled_from([None, "a"]),
          forget=st.booleans())
    def whole_turn(self, prefix, extra, salt, forget):
        """One request from arrival to finish in two steps, optionally clearing the GPU cache after."""
        before = self.next_id
        self.add(prefix, extra, salt, seed=0)
        if self.next_id == before:
            return
        self.engine.step()
        rid = f"r{before}"
        if any(r.request_id == rid for r in self.engine.running):
            self.engine.finish(rid)
        self.engine.step()
        if forget:
            self.forget_gpu_cache()

    @rule()
    def step(self):
        self.engine.step()

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
        self.engine.step()  # the turn's stores committed: put them
        self.forget_gpu_cache()
        self.forget_cpu_cache()
        gpu = self.stack.gpu
        hog = gpu.allocate(gpu.num_free)
        self.add(prefix, extra, None, seed=1)
        self.engine.step()
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
