"""Tests for the synthetic multi-turn workload generator."""

import itertools
import math
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvkit.errors import ConfigError
from kvkit.sim.synthetic import SyntheticWorkload, generate
from kvkit.sim.traces import read_trace, write_trace

workloads = st.builds(
    SyntheticWorkload,
    seed=st.integers(0, 2**32),
    num_conversations=st.integers(1, 25),
    block_size=st.sampled_from([1, 4, 16, 64]),
    num_system_prompts=st.integers(1, 4),
    system_prompt_tokens=st.tuples(st.integers(0, 200), st.integers(0, 200)).map(sorted),
    system_prompt_skew=st.floats(0, 3),
    max_turns=st.integers(1, 8),
    turns_skew=st.floats(0, 3),
    user_tokens_mean=st.floats(1, 300),
    output_tokens_mean=st.floats(1, 300),
    max_context_tokens=st.integers(202, 4000),
)


def _check_prefix_chains(requests, block_size):
    """Assert Mooncake's id rules: one id per block; an id always has one position, parent and fill."""
    where = {}
    next_new = 0
    for r in requests:
        assert len(r.hash_ids) == math.ceil(r.input_length / block_size)
        for pos, block in enumerate(r.hash_ids):
            parent = r.hash_ids[pos - 1] if pos else None
            # a partial last block is other content than the full block at its place
            tokens = min(r.input_length, (pos + 1) * block_size)
            assert where.setdefault(block, (pos, parent, tokens)) == (pos, parent, tokens)
            # ids are numbered in order of first appearance
            assert block <= next_new
            next_new = max(next_new, block + 1)


@given(workloads)
def test_chains_are_prefix_consistent(workload):
    """Every id sits at one position after one parent, one id per block, numbered as first seen."""
    _check_prefix_chains(list(generate(workload)), workload.block_size)


@given(workloads)
def test_same_seed_same_trace(workload):
    """Generating twice from the same workload gives identical requests."""
    assert list(generate(workload)) == list(generate(workload))


@given(workloads)
def test_round_trips_through_write_and_read(workload):
    """A synthetic trace written as JSONL reads back unchanged at its block size."""
    requests = list(generate(workload))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "synthetic.jsonl"
        write_trace(path, requests)
        assert list(read_trace(path, block_size=workload.block_size)) == requests


@given(workloads)
def test_later_turns_extend_earlier_chains(workload):
    """Requests sharing a block past every system prompt are turns of one chat, each extending the last."""
    b = workload.block_size
    private = workload.system_prompt_tokens[1] // b + 1  # first block no system prompt fills
    by_block = defaultdict(list)
    for r in generate(workload):
        if (private + 1) * b <= r.input_length:
            by_block[r.hash_ids[private]].append(r)
    for turns in by_block.values():
        for earlier, later in itertools.pairwise(turns):
            full = earlier.input_length // b
            assert later.input_length > earlier.input_length + earlier.output_length
            assert later.hash_ids[:full] == earlier.hash_ids[:full]


@given(workloads)
def test_shape_follows_the_workload(workload):
    """Requests arrive in time order, fit the context, and open with at most one chain per system prompt."""
    requests = list(generate(workload))
    assert [r.line for r in requests] == list(range(1, len(requests) + 1))
    assert workload.num_conversations <= len(requests)
    assert len(requests) <= workload.num_conversations * workload.max_turns
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in itertools.pairwise(requests))
    assert all(r.input_length > 0 and r.input_length + r.output_length
               <= workload.max_context_tokens for r in requests)
    low = workload.system_prompt_tokens[0]
    if low >= workload.block_size:
        assert len({r.hash_ids[0] for r in requests}) <= workload.num_system_prompts


def test_different_seeds_differ():
    """Two seeds give two different traces."""
    small = SyntheticWorkload(num_conversations=20)
    assert list(generate(small)) != list(generate(SyntheticWorkload(num_conversations=20, seed=1)))


def test_default_size_suits_a_quick_simulation():
    """The default workload has roughly 1,500 requests and a few hundred thousand block references."""
    requests = list(generate())
    assert 1000 <= len(requests) <= 2500
    assert 100_000 <= sum(len(r.hash_ids) for r in requests) <= 600_000
    # multi-turn reuse: far fewer distinct blocks than references
    assert len({b for r in requests for b in r.hash_ids}) < sum(len(r.hash_ids) for r in requests) / 3


@pytest.mark.parametrize("kwargs", [
    {"num_conversations": 0},
    {"block_size": -16},
    {"conversations_per_s": 0.0},
    {"conversations_per_s": math.inf},
    {"system_prompt_tokens": (10, 5)},
    {"system_prompt_tokens": (-1, 5)},
    {"system_prompt_tokens": (1, 2, 3)},
    {"system_prompt_skew": -1.0},
    {"max_turns": 0},
    {"think_time_mean_s": -2.0},
    {"max_context_tokens": 3000},  # the longest system prompt is 3072 tokens
])
def test_bad_parameters_raise_config_error(kwargs):
    """Invalid workload parameters raise ConfigError quoting the value."""
    with pytest.raises(ConfigError):
        SyntheticWorkload(**kwargs)


