"""The value types: plans keep equal lengths (invariant 7's last clause), and every field refuses junk."""

import math
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvkit.errors import ConfigError, KVKitError, PlanError, SpecMismatchError
from kvkit.interfaces import (
    Direction,
    GroupKind,
    KVCacheSpec,
    KVGroupSpec,
    Region,
    Tier,
    TransferPlan,
    TransferResult,
)

ids = st.lists(st.integers(0, 2**40), max_size=20)


@given(ids, ids, st.sampled_from(["store", "load"]))
def test_a_plan_exists_only_with_equal_lengths(src, dst, direction):
    """Unequal lists raise a PlanError quoting both lengths; equal ones give read-only int64 arrays."""
    if len(src) != len(dst):
        with pytest.raises(PlanError, match=rf"differ in length: {len(src)} != {len(dst)}"):
            TransferPlan(src, dst, direction)
        return
    plan = TransferPlan(src, dst, direction)
    assert len(plan) == len(src) and plan.src.tolist() == src and plan.dst.tolist() == dst
    for arr in (plan.src, plan.dst):
        assert arr.dtype == np.int64 and not arr.flags.writeable


@given(st.lists(st.integers(-(2**40), -1), min_size=1, max_size=5))
def test_negative_ids_are_plan_errors_quoting_them(bad):
    """A negative block id is refused, quoted in the message."""
    with pytest.raises(PlanError, match=rf"non-negative, got \[{bad[0]}"):
        TransferPlan(bad, [0] * len(bad), "load")


@pytest.mark.parametrize("field", ["transfer_id", "worker", "seconds", "num_bytes"])
@pytest.mark.parametrize("bad", [-1, float("nan"), "3"])
def test_a_result_with_a_negative_or_non_numeric_field_is_a_plan_error(field, bad):
    """A worker result with a negative, NaN or non-numeric count raises PlanError quoting it."""
    kwargs = {"transfer_id": 0, field: bad}
    with pytest.raises(PlanError, match=f"TransferResult.{field}={bad!r}: must be an? (int >= 0|number in \\[0)"):
        TransferResult(**kwargs)


# --- every field of every value type: junk in, only kvkit errors out ------------------------------------------


class _HostileRepr:
    """A value whose repr raises: a message quoting it must not fail."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


_a_list_that_holds_itself: list = []
_a_list_that_holds_itself.append(_a_list_that_holds_itself)

_ODD = [
    None, True, False, 0, -1, 1, 2**63, 10**400, 1.5, -0.0, math.nan, math.inf, -math.inf, 1j,
    "", "full", "sliding_window", "store", "load", "gpu", "FULL", "bfloat16", "float32", "x" * 1000, b"store",
    bytearray(b"0"), [], [0], [0, 0], [[0], [0, 1]], (0,), range(3), range(10**12), {0: 1}, {0}, frozenset(),
    object(), _HostileRepr(), _a_list_that_holds_itself, Fraction(1, 3), Decimal("1"), Decimal("NaN"),
    GroupKind.FULL, GroupKind.SLIDING_WINDOW, Direction.STORE, Direction.LOAD, Tier.GPU,
    KVGroupSpec([0]), np.int64(3), np.int8(-1), np.uint64(2**63), np.bool_(True), np.float32(1.0),
    np.float64(math.nan), np.str_("load"), np.array(3), np.array([0, 1]), np.array([[0, 1]]),
    np.array([], dtype=np.float64), np.array([2**63], dtype=np.uint64), np.array(["a"]), np.array([0.5]),
    np.array([True]), np.zeros((0, 2), dtype=np.int64),
]
junk = st.one_of(
    st.sampled_from(_ODD),
    st.builds(lambda: -(10**5000)),  # too long to repr; kept out of sampled_from, which reprs its elements
    st.none(), st.booleans(), st.integers(), st.floats(), st.complex_numbers(), st.text(max_size=8),
    st.binary(max_size=8), st.fractions(), st.decimals(),
    st.lists(st.one_of(st.integers(-3, 2**64), st.booleans(), st.floats(), st.text(max_size=2)), max_size=6),
    st.tuples(st.integers(-2, 5), st.text(max_size=2)),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=3),
    st.recursive(st.integers(0, 3), lambda inner: st.lists(inner, max_size=3), max_leaves=8),
    hnp.arrays(st.sampled_from(["int64", "int8", "uint64", "float64", "bool", "complex128", "U2", "S2"]),
               hnp.array_shapes(min_dims=0, max_dims=2, max_side=3)),
)
"""Values of every kind a caller (or a buggy engine) might pass for any field."""

_VALID: dict[type, dict[str, object]] = {
    KVGroupSpec: {"layers": [0, 1], "kind": "sliding_window", "window": 16},
    KVCacheSpec: {"num_layers": 2, "block_size": 16, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16",
                  "groups": [KVGroupSpec([0]), KVGroupSpec([1])]},
    TransferPlan: {"src": [0, 1], "dst": [2, 3], "direction": "store", "group": 1},
    TransferResult: {"transfer_id": 3, "worker": 1, "ok": True, "seconds": 0.5, "num_bytes": 4096, "lost": [2, 0]},
}


def _well_typed(made: object) -> None:
    """What a constructor accepted has exact field types: ints are ints, bools bools, enums members."""
    exact_ints = {KVGroupSpec: ["window"] if made.__class__ is KVGroupSpec and made.window is not None else [],
                  KVCacheSpec: ["num_layers", "block_size", "num_kv_heads", "head_dim"],
                  TransferPlan: ["group"],
                  TransferResult: ["transfer_id", "worker", "num_bytes"]}[made.__class__]
    for name in exact_ints:
        assert type(getattr(made, name)) is int, (name, getattr(made, name))
    if isinstance(made, KVGroupSpec):
        assert made.layers and all(type(x) is int and x >= 0 for x in made.layers)
        assert isinstance(made.kind, GroupKind)
    elif isinstance(made, KVCacheSpec):
        assert type(made.dtype) is str and made.bytes_per_block > 0
        assert all(isinstance(g, KVGroupSpec) for g in made.groups)
    elif isinstance(made, TransferPlan):
        assert isinstance(made.direction, Direction) and made.src.dtype == made.dst.dtype == np.int64
    else:
        assert type(made.ok) is bool and type(made.seconds) is float and math.isfinite(made.seconds)
        assert type(made.lost) is tuple and all(type(x) is int and x >= 0 for x in made.lost)
        assert list(made.lost) == sorted(set(made.lost))


@settings(max_examples=max(300, settings.default.max_examples))
@given(cls=st.sampled_from(sorted(_VALID, key=lambda c: c.__name__)), data=st.data())
def test_junk_in_any_field_raises_only_kvkit_errors(cls, data):
    """Junk of any type in any subset of fields raises a KVKitError, or builds a well-typed object."""
    fields = _VALID[cls]
    bad = data.draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, unique=True), label="fields")
    kwargs = {**fields, **{name: data.draw(junk, label=name) for name in bad}}
    try:
        made = cls(**kwargs)
    except KVKitError as exc:
        assert isinstance(exc, (ConfigError, PlanError)) and str(exc)  # noqa: PT017 - either outcome is allowed
        return
    _well_typed(made)


@pytest.mark.parametrize("cls", sorted(_VALID, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_every_odd_value_in_every_field_raises_only_kvkit_errors(cls):
    """Each listed odd value, in each field alone, raises a KVKitError or builds a well-typed object."""
    for name in _VALID[cls]:
        for value in [*_ODD, -10 ** 5000]:
            try:
                made = cls(**{**_VALID[cls], name: value})
            except (ConfigError, PlanError):
                continue
            _well_typed(made)


def _tensors():
    torch = pytest.importorskip("torch")
    return [torch.zeros(3, 4), torch.zeros(2, 4), torch.zeros(3, 4, dtype=torch.float16), torch.zeros(3, 5),
            torch.zeros(3), torch.zeros(()), torch.zeros(0, 4), torch.zeros(3, 0), torch.zeros(4).expand(3, 4),
            torch.zeros(4, 3).t(), torch.zeros(3, 4).to_sparse(), torch.zeros(3, 4, device="meta"),
            torch.zeros(3, 2, 2)[:, :, 0]]


@settings(max_examples=max(300, settings.default.max_examples))
@given(data=st.data())
def test_junk_regions_raise_only_kvkit_errors(data):
    """Region takes a non-empty name, two compatible tensors with non-overlapping blocks and a group >= 0."""
    pieces = st.one_of(st.sampled_from(_tensors()), junk)
    name, group = data.draw(st.one_of(st.just("r"), junk)), data.draw(st.one_of(st.just(0), junk))
    gpu, cpu = data.draw(pieces), data.draw(pieces)
    try:
        region = Region(name, gpu, cpu, group=group)
    except (ConfigError, SpecMismatchError) as exc:
        assert str(exc)  # noqa: PT017 - either outcome is allowed
        return
    assert type(region.name) is str and region.name and type(region.group) is int and region.group >= 0
    assert region.piece_bytes > 0 and region.gpu.stride(0) * region.gpu.element_size() >= region.piece_bytes


def test_every_odd_value_or_tensor_in_every_region_field_raises_only_kvkit_errors():
    """Each odd value and odd tensor, in each Region field alone, raises a KVKitError or builds a valid region."""
    torch = pytest.importorskip("torch")
    valid = {"name": "r", "gpu": torch.zeros(3, 4), "cpu": torch.zeros(2, 4), "group": 1}
    for field in valid:
        for value in _ODD + _tensors():
            try:
                region = Region(**{**valid, field: value})
            except (ConfigError, SpecMismatchError):
                continue
            assert type(region.group) is int and region.piece_bytes > 0


@pytest.mark.parametrize(("make", "error", "message"), [
    (lambda: KVGroupSpec([0], kind="bogus"), ConfigError, r"kind='bogus': must be one of \['full', 'sliding_window'\]"),
    (lambda: KVGroupSpec([0], window=True), ConfigError, r"window=True: must be an int >= 1"),
    (lambda: KVGroupSpec(5), ConfigError, r"layers=5: must be a sequence"),
    (lambda: KVGroupSpec("01"), ConfigError, r"layers='01': must be a sequence"),
    (lambda: KVGroupSpec([0, 2, 0]), ConfigError, r"layers repeat: \[0\]"),
    (lambda: KVGroupSpec([]), ConfigError, r"needs 1 to 65536 layers, got 0"),
    (lambda: KVGroupSpec([0], "sliding_window"), ConfigError, r"needs a positive window, got window=None"),
    (lambda: KVCacheSpec(1, 16, 1, 8, groups=[0]), ConfigError, r"groups=\[0\]: must be a sequence of KVGroupSpec"),
    (lambda: KVCacheSpec(1, 16, 1, 8, dtype=["bf16"]), ConfigError, r"dtype=\['bf16'\]: unknown dtype; valid: "),
    (lambda: KVCacheSpec(True, 16, 1, 8), ConfigError, r"num_layers=True: must be an int >= 1"),
    (lambda: KVCacheSpec(10**9, 16, 1, 8), ConfigError, r"num_layers=1000000000: must be at most 65536"),
    (lambda: KVCacheSpec(1, 2**40, 2**20, 2**10), ConfigError, r"does not fit an int64"),
    (lambda: TransferResult(0, ok="False"), PlanError, r"ok='False': must be a bool"),
    (lambda: TransferResult(0, ok=0), PlanError, r"ok=0: must be a bool"),
    (lambda: TransferResult(0, seconds=math.inf), PlanError, r"seconds=inf: must be a number in \[0, inf\)"),
    (lambda: TransferResult(0, seconds=10**400), PlanError, r"seconds=1000.*\.\.\.: must be a number"),
    (lambda: TransferResult(-(10**5000)), PlanError, r"transfer_id=<int of 16610 bits>: must be an int >= 0"),
    (lambda: TransferResult(_HostileRepr()), PlanError, r"transfer_id=<_HostileRepr>: must be an int"),
    (lambda: TransferResult(0, lost=[1, -1]), PlanError, r"lost=-1: must be an int >= 0"),
    (lambda: TransferResult(0, lost=[2, 2]), PlanError, r"lost names a position twice: \[2, 2\]"),
    (lambda: TransferResult(0, lost="12"), PlanError, r"lost must be a sequence of plan positions, got '12'"),
    (lambda: TransferPlan([0], [1], "sideways"), PlanError,
     r"direction='sideways': must be one of \['store', 'load'\]"),
    (lambda: TransferPlan([0], [1], ["store"]), PlanError, r"direction=\['store'\]"),
    (lambda: TransferPlan([0], [1], "load", group="0"), PlanError, r"group='0': must be an int >= 0"),
    (lambda: TransferPlan([[0], [1, 2]], [1, 2], "load"), PlanError, r"src: block ids must be a 1-D array of ints"),
    (lambda: TransferPlan(np.zeros((0, 2), np.int64), [], "load"), PlanError, r"src: block ids must be a 1-D"),
    (lambda: TransferPlan(np.array([2**63], np.uint64), [0], "load"), PlanError, r"below 2\*\*63"),
    (lambda: TransferPlan(range(10**12), [0], "load"), PlanError,
     r"src: 1000000000000 block ids .* at most 4294967296"),
])
def test_the_issue_examples_are_typed_errors_quoting_the_value(make, error, message):
    """Each example of the issue (and its neighbours) is one typed kvkit error quoting the bad value."""
    with pytest.raises(error, match=message):
        make()


def test_numpy_scalars_become_python_values_and_enums_take_values_or_members():
    """NumPy ints and bools are converted; an enum field takes its member or the member's value."""
    group = KVGroupSpec(np.arange(2), kind="sliding_window", window=np.int32(8))
    assert group.layers == (0, 1) and type(group.layers[0]) is int and type(group.window) is int
    assert KVGroupSpec([0], kind=GroupKind.FULL).kind is GroupKind.FULL
    spec = KVCacheSpec(np.int64(2), np.uint16(16), np.int8(1), np.int64(8), dtype=np.str_("float16"),
                       groups=(group,))
    assert [type(v) for v in (spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim)] == [int] * 4
    assert spec == KVCacheSpec(2, 16, 1, 8, dtype="float16", groups=[KVGroupSpec([0, 1], "sliding_window", 8)])
    result = TransferResult(np.int64(4), np.int32(1), ok=np.bool_(False), seconds=np.float32(0.25),
                            num_bytes=np.uint64(64))
    assert result == TransferResult(4, 1, ok=False, seconds=0.25, num_bytes=64) and result.ok is False
    plan = TransferPlan(np.array([1], np.uint8), (2,), np.str_("load"), group=np.int16(1))
    assert plan.direction is Direction.LOAD and type(plan.group) is int and plan.src.dtype == np.int64
    assert TransferPlan([0], [1], Direction.STORE).direction is Direction.STORE


def test_a_latent_spec_caches_one_vector_per_token_and_layer():
    """An MLA (latent) block is half a K/V block of the same head size, and a latent spec has one KV head."""
    kv = KVCacheSpec(num_layers=3, block_size=16, num_kv_heads=1, head_dim=576, dtype="bfloat16")
    latent = KVCacheSpec(num_layers=3, block_size=16, num_kv_heads=1, head_dim=576, dtype="bfloat16", latent=True)
    assert (kv.kv_parts, latent.kv_parts) == (2, 1)
    assert latent.bytes_per_block == 3 * 16 * 576 * 2 == kv.bytes_per_block // 2
    with pytest.raises(ConfigError, match="num_kv_heads=8: a latent"):
        KVCacheSpec(num_layers=3, block_size=16, num_kv_heads=8, head_dim=576, latent=True)
    with pytest.raises(ConfigError, match="latent='yes'"):
        KVCacheSpec(num_layers=3, block_size=16, num_kv_heads=1, head_dim=576, latent="yes")
