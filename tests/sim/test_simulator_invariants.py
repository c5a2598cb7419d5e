"""``Simulator.check_invariants`` holds after every request it is fed, and catches a clock gone back."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvkit.sim.simulator import SimConfig, Simulator
from kvkit.sim.synthetic import SyntheticWorkload, generate

workloads = st.builds(SyntheticWorkload, seed=st.integers(0, 2**16), num_conversations=st.integers(1, 8),
                      block_size=st.just(16), max_turns=st.integers(1, 4),
                      system_prompt_tokens=st.tuples(st.integers(0, 100), st.integers(0, 100)).map(sorted),
                      max_context_tokens=st.integers(202, 600))


@given(workloads, st.integers(8, 60), st.integers(1, 80), st.sampled_from(["eager", "lazy", "never"]))
def test_invariants_hold_after_every_request(workload, gpu_blocks, cpu_blocks, store):
    """Feeding requests one at a time keeps the stack and the simulator's bookkeeping consistent."""
    sim = Simulator(SimConfig(block_size=16, gpu_blocks=gpu_blocks, cpu_blocks=cpu_blocks, store=store))
    for request in generate(workload):
        sim.feed(request)
        sim.check_invariants()
    result = sim.close()
    sim.check_invariants()
    assert result.leaked_blocks == 0


def test_a_clock_moved_past_running_requests_is_caught():
    """A running request whose modelled end lies before the clock fails the check."""
    sim = Simulator(SimConfig(block_size=16, gpu_blocks=32, cpu_blocks=8))
    request = next(generate(SyntheticWorkload(seed=1, num_conversations=1, block_size=16,
                                                     system_prompt_tokens=(50, 50), max_context_tokens=400)))
    sim.feed(request)
    sim._clock_ms = sim._running[0][0] + 1.0
    with pytest.raises(AssertionError, match="ended in the past"):
        sim.check_invariants()
