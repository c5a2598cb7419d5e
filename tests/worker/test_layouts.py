"""Tests for kvkit.worker.layouts: shapes, regions, piece bytes and validation errors."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvkit.errors import ConfigError, SpecMismatchError
from kvkit.interfaces import KVCacheSpec, KVGroupSpec
from kvkit.testing.kvdata import TWO_GROUPS, spec_layouts
from kvkit.worker.layouts import (
    LAYOUTS,
    allocate_kv,
    check_layouts,
    kv_nbytes,
    kv_shape,
    kv_views,
    layouts_for,
    regions_for,
    torch_dtype,
    validate_kv,
)

SPEC = KVCacheSpec(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
LATENT = KVCacheSpec(num_layers=3, block_size=4, num_kv_heads=1, head_dim=8, dtype="bfloat16", latent=True)
KV_LAYOUTS = layouts_for(SPEC)  # every layout but MLA's latent one


def _spec(layout):
    return LATENT if layout == "latent" else SPEC

EXPECTED_SHAPES = {
    "per-layer": [(2, 5, 4, 2, 8)] * 3,
    "blocks-first": [(5, 2, 4, 2, 8)] * 3,
    "cross-layer": [(5, 3, 2, 4, 2, 8)],
    "vllm-cpu": [(5, 2, 4, 16)] * 3,
    "latent": [(5, 4, 8)] * 3,
}

EXPECTED_REGIONS = {
    "per-layer": (["layer0.k", "layer0.v", "layer1.k", "layer1.v", "layer2.k", "layer2.v"],
                  SPEC.bytes_per_layer_block),
    "blocks-first": (["layer0", "layer1", "layer2"], 2 * SPEC.bytes_per_layer_block),
    "cross-layer": (["kv"], SPEC.bytes_per_block),
    "vllm-cpu": (["layer0", "layer1", "layer2"], 2 * SPEC.bytes_per_layer_block),
    "latent": (["layer0", "layer1", "layer2"], LATENT.bytes_per_layer_block),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shapes(layout):
    """Each layout has the documented tensor shapes, dtype and byte total."""
    spec = _spec(layout)
    assert kv_shape(spec, layout, 5) == EXPECTED_SHAPES[layout]
    tensors = allocate_kv(spec, layout, 5)
    assert [tuple(t.shape) for t in tensors] == EXPECTED_SHAPES[layout]
    assert all(t.dtype == torch.bfloat16 for t in tensors)
    assert sum(t.numel() * t.element_size() for t in tensors) == kv_nbytes(spec, layout, 5) == 5 * spec.bytes_per_block
    assert validate_kv(spec, layout, tensors) == 5


@pytest.mark.parametrize("layout", LAYOUTS)
def test_regions(layout):
    """Regions have the documented names and piece bytes, and pair both tiers' block counts."""
    spec = _spec(layout)
    regions = regions_for(spec, layout, allocate_kv(spec, layout, 5), allocate_kv(spec, layout, 7))
    names, piece = EXPECTED_REGIONS[layout]
    assert [r.name for r in regions] == names
    assert all(r.piece_bytes == piece for r in regions)
    assert sum(r.piece_bytes for r in regions) == spec.bytes_per_block
    assert all(r.gpu.shape[0] == 5 and r.cpu.shape[0] == 7 for r in regions)


def test_per_layer_regions_are_k_and_v_halves():
    """The per-layer K region views index 0 of the layer tensor and V index 1."""
    gpu = allocate_kv(SPEC, "per-layer", 5)
    regions = regions_for(SPEC, "per-layer", gpu, allocate_kv(SPEC, "per-layer", 2))
    assert regions[2].gpu.data_ptr() == gpu[1][0].data_ptr()
    assert regions[3].gpu.data_ptr() == gpu[1][1].data_ptr()


HALVES = [f"layer{i}.{kv}" for i in range(3) for kv in "kv"]
LAYERS = ["layer0", "layer1", "layer2"]
LB = SPEC.bytes_per_layer_block

# (gpu layout, cpu layout) -> region names, piece bytes, GPU and CPU block stride bytes
EXPECTED_MIXED = {
    ("per-layer", "blocks-first"): (HALVES, LB, LB, 2 * LB),
    ("per-layer", "cross-layer"): (HALVES, LB, LB, SPEC.bytes_per_block),
    ("blocks-first", "per-layer"): (HALVES, LB, 2 * LB, LB),
    ("blocks-first", "cross-layer"): (LAYERS, 2 * LB, 2 * LB, SPEC.bytes_per_block),
    ("cross-layer", "per-layer"): (HALVES, LB, SPEC.bytes_per_block, LB),
    ("cross-layer", "blocks-first"): (LAYERS, 2 * LB, SPEC.bytes_per_block, 2 * LB),
}


@pytest.mark.parametrize(("layout", "cpu_layout"), sorted(EXPECTED_MIXED))
def test_mixed_regions(layout, cpu_layout):
    """Different tier layouts pair their largest common piece, strided as each layout lays it out."""
    gpu, cpu = allocate_kv(SPEC, layout, 5), allocate_kv(SPEC, cpu_layout, 7)
    regions = regions_for(SPEC, layout, gpu, cpu, cpu_layout=cpu_layout)
    names, piece, gpu_stride, cpu_stride = EXPECTED_MIXED[layout, cpu_layout]
    assert [r.name for r in regions] == names
    assert all(r.piece_bytes == piece and r.gpu.shape[0] == 5 and r.cpu.shape[0] == 7 for r in regions)
    assert all(r.stride_bytes("gpu") == gpu_stride and r.stride_bytes("cpu") == cpu_stride for r in regions)
    assert sum(r.piece_bytes for r in regions) == SPEC.bytes_per_block


def test_cross_layer_cpu_pieces_sit_at_layer_offsets():
    """Against a cross-layer CPU tier, layer i's V of CPU block b starts (2i + 1) layer blocks into block b."""
    cpu = allocate_kv(SPEC, "cross-layer", 4)
    regions = regions_for(SPEC, "per-layer", allocate_kv(SPEC, "per-layer", 2), cpu, cpu_layout="cross-layer")
    base = cpu[0].data_ptr()
    for r in regions:
        layer, half = int(r.name[5]), "kv".index(r.name[-1])
        assert r.cpu[3].data_ptr() == base + 3 * SPEC.bytes_per_block + (2 * layer + half) * LB


def _views(regions):
    return [(r.name, r.group, t.data_ptr(), t.shape, t.stride()) for r in regions for t in (r.gpu, r.cpu)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpu_layout_none_is_the_same_layout(layout):
    """cpu_layout=None and cpu_layout=layout give the same regions as before, view for view."""
    spec = _spec(layout)
    gpu, cpu = allocate_kv(spec, layout, 5), allocate_kv(spec, layout, 7)
    default = regions_for(spec, layout, gpu, cpu)
    explicit = regions_for(spec, layout, gpu, cpu, cpu_layout=layout)
    assert _views(default) == _views(explicit)


@pytest.mark.parametrize(("layout", "cpu_layout"), [
    *[(lay, "vllm-cpu") for lay in KV_LAYOUTS if lay != "vllm-cpu"],
    *[("vllm-cpu", lay) for lay in KV_LAYOUTS if lay != "vllm-cpu"]])
def test_vllm_cpu_pairs_only_with_itself(layout, cpu_layout):
    """vllm-cpu pieces are [H, block_size, 2*D], so mixing it with another layout names both layouts."""
    pattern = f"'vllm-cpu'.*GPU layout '{layout}' with CPU layout '{cpu_layout}'"
    with pytest.raises(ConfigError, match=pattern):
        check_layouts(SPEC, layout, cpu_layout)
    with pytest.raises(ConfigError, match=pattern):
        regions_for(SPEC, layout, allocate_kv(SPEC, layout, 2), allocate_kv(SPEC, cpu_layout, 2),
                    cpu_layout=cpu_layout)


def test_unknown_cpu_layout_is_quoted():
    """An unknown CPU layout is quoted next to the valid names."""
    with pytest.raises(ConfigError, match=r"'nhd'.*per-layer"):
        check_layouts(SPEC, "per-layer", "nhd")
    with pytest.raises(ConfigError, match=r"'nhd'.*per-layer"):
        regions_for(SPEC, "per-layer", allocate_kv(SPEC, "per-layer", 2), allocate_kv(SPEC, "per-layer", 2),
                    cpu_layout="nhd")


@pytest.mark.parametrize("layout", ["per-layer", "blocks-first"])
def test_cross_layer_cpu_needs_one_group(layout):
    """A cross-layer CPU tier spans every layer per block, so a two-group spec is refused."""
    with pytest.raises(ConfigError, match=r"single KV group.*2 groups"):
        check_layouts(TWO_GROUPS, layout, "cross-layer")
    with pytest.raises(ConfigError, match="single KV group"):
        check_layouts(TWO_GROUPS, "cross-layer", layout)
    check_layouts(TWO_GROUPS, layout, "per-layer")


@pytest.mark.parametrize(("layout", "cpu_layout"), [("per-layer", "blocks-first"), ("blocks-first", "per-layer")])
def test_mixed_region_groups_follow_spec(layout, cpu_layout):
    """Mixed-layout regions carry the group of their layer."""
    regions = regions_for(TWO_GROUPS, layout, allocate_kv(TWO_GROUPS, layout, 2),
                          allocate_kv(TWO_GROUPS, cpu_layout, 3), cpu_layout=cpu_layout)
    assert [(r.name, r.group) for r in regions] == [("layer0.k", 0), ("layer0.v", 0), ("layer1.k", 1), ("layer1.v", 1)]


@pytest.mark.parametrize("layout", [lay for lay in KV_LAYOUTS if lay != "cross-layer"])
def test_region_groups_follow_spec(layout):
    """Each region carries the group of its layer."""
    spec = KVCacheSpec(3, 4, 2, 8, groups=[KVGroupSpec([1]), KVGroupSpec([0, 2], "sliding_window", 8)])
    regions = regions_for(spec, layout, allocate_kv(spec, layout, 2), allocate_kv(spec, layout, 2))
    by_layer = {r.name.split(".")[0]: r.group for r in regions}
    assert by_layer == {"layer0": 1, "layer1": 0, "layer2": 1}


@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_a_latent_cache_has_only_the_latent_layout(layout):
    """MLA's latent has no K and V: every other layout refuses it, and the latent layout refuses K/V caches."""
    assert layouts_for(LATENT) == ("latent",)
    with pytest.raises(ConfigError, match=rf"layout '{layout}' cannot hold .* no K and V; valid: \['latent'\]"):
        check_layouts(LATENT, layout)
    with pytest.raises(ConfigError, match=r"layout 'latent' cannot hold .*latent=False"):
        check_layouts(SPEC, "latent", layout)
    with pytest.raises(ConfigError, match="num_kv_heads must be 1"):
        KVCacheSpec(num_layers=1, block_size=4, num_kv_heads=2, head_dim=8, latent=True)


def test_cross_layer_rejects_several_groups():
    """A cross-layer piece spans every layer, so a multi-group spec is refused."""
    spec = KVCacheSpec(2, 4, 2, 8, groups=[KVGroupSpec([0]), KVGroupSpec([1])])
    with pytest.raises(ConfigError, match="single KV group"):
        kv_shape(spec, "cross-layer", 3)


def test_unknown_layout_lists_valid_names():
    """An unknown layout name is quoted next to the valid ones."""
    with pytest.raises(ConfigError, match=r"'nhd'.*per-layer"):
        kv_shape(SPEC, "nhd", 3)


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8"])
def test_torch_dtype_matches_spec_size(name):
    """Every spec dtype maps to a torch dtype of the spec's element size."""
    spec = KVCacheSpec(1, 1, 1, 1, dtype=name)
    assert torch_dtype(spec).itemsize == spec.dtype_bytes


@given(spec_layouts(), st.integers(1, 4))
def test_views_tile_buffer(spec_layout, num_blocks):
    """Every region piece of every block covers the carved buffer exactly once."""
    spec, layout = spec_layout
    buf = torch.empty(kv_nbytes(spec, layout, num_blocks), dtype=torch.uint8)
    views = kv_views(spec, layout, num_blocks, buf)
    assert validate_kv(spec, layout, views) == num_blocks
    regions = regions_for(spec, layout, views, views)
    spans = sorted((r.cpu[b].data_ptr(), r.piece_bytes) for r in regions for b in range(num_blocks))
    cursor = buf.data_ptr()
    for start, size in spans:
        assert start == cursor
        cursor += size
    assert cursor == buf.data_ptr() + buf.numel()
    assert all(r.stride_bytes("cpu") == r.piece_bytes for r in regions)


def test_views_reject_wrong_buffer():
    """A buffer of the wrong size is refused, quoting the size needed."""
    need = kv_nbytes(SPEC, "per-layer", 2)
    with pytest.raises(SpecMismatchError, match=str(need)):
        kv_views(SPEC, "per-layer", 2, torch.empty(need + 1, dtype=torch.uint8))


def _wrong_count(ts):
    return ts + ts[:1]


def _wrong_shape(ts):
    return [ts[0][..., :-1].contiguous(), *ts[1:]]


def _wrong_dtype(ts):
    return [*ts[:-1], ts[-1].float()]


def _non_contiguous(ts):
    t = ts[0]
    dims = list(reversed(range(t.dim())))
    return [t.new_empty(t.shape[::-1]).permute(*dims), *ts[1:]]


def _other_device(ts):
    return [*ts[:-1], ts[-1].to("meta")]


MUTATIONS = [
    (_wrong_count, r"needs \d+ tensors? for 3 layers, got \d+"),
    (_wrong_shape, r"shape \(.*\), layout .* expects \("),
    (_wrong_dtype, r"dtype torch.float32, spec says 'bfloat16'"),
    (_non_contiguous, r"not contiguous: shape .* strides"),
    (_other_device, r"tensor \d+ holds no plain memory on cpu or cuda: layout torch.strided, device meta"),
]


@pytest.mark.parametrize(("layout", "mutate", "pattern"), [
    (layout, mutate, pattern) for layout in LAYOUTS for mutate, pattern in MUTATIONS
    # one cross-layer tensor cannot disagree with itself on device
    if not (layout == "cross-layer" and mutate is _other_device)
])
def test_validate_errors_quote_values(layout, mutate, pattern):
    """validate_kv refuses bad tensors with a message quoting what disagrees."""
    spec = _spec(layout)
    bad = mutate(allocate_kv(spec, layout, 5))
    with pytest.raises(SpecMismatchError, match=pattern):
        validate_kv(spec, layout, bad)
