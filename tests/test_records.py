"""Every field of every configuration record is validated with the typed-error promise.

For each field of each record, values of the wrong type (chosen from the field's
annotation: a bool where an int or a number goes, a string where a bool goes, an
object everywhere) raise ``ConfigError`` (a ``ValueError`` too) naming the field
and quoting the value (a secret: never). A field added without validation fails
here. An unknown keyword is a ``ConfigError`` naming the valid ones.
"""

import re

import attrs
import pytest

import kvkit.manager  # noqa: F401 - first: importing kvkit.shared.scheduler alone runs into an import cycle
from kvkit.backends.blockstore.memory import MemoryStore
from kvkit.config import SharedConfig, StackConfig
from kvkit.errors import ConfigError
from kvkit.interfaces import KVCacheSpec
from kvkit.interfaces.hints import WorkloadHints
from kvkit.shared.client import FormatCodec
from kvkit.shared.format import Namespace
from kvkit.shared.scheduler import SharedTierSpec
from kvkit.sim.simulator import STACK_SLOTS, CostModel, ModelShape, SimConfig
from kvkit.sim.synthetic import SHAPES
from kvkit.validate import quote

KV = KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=1, head_dim=4, dtype="float32")
_CODEC = FormatCodec(Namespace(model="m", spec=KV, layout="per-layer", tp_size=1))

BASES = {
    StackConfig: {"kv": KV, "gpu_blocks": 4, "cpu_blocks": 4, "device": "cpu", "copy": None},
    SharedConfig: {"url": "memory://"},
    SimConfig: {},
    CostModel: {},
    ModelShape: {"name": "m", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8},
    SharedTierSpec: {"store": MemoryStore(), "codec": _CODEC},
    WorkloadHints: {},
    **{cls: {} for cls in SHAPES.values()},
}
"""Each record, with the fewest valid arguments that build it."""

_EXCLUSIVE = {"cpu_bytes": "cpu_blocks"}  # giving one of these drops the other from the base


def _fields(cls):
    """``(field name, annotation)`` of every keyword the record takes (a SimConfig also takes its stack slots)."""
    fields = [(f.alias, f.type) for f in attrs.fields(cls) if f.init]
    if cls is SimConfig:
        stack = attrs.fields_dict(StackConfig)
        fields += [(slot, stack[slot].type) for slot in STACK_SLOTS]
    return fields


def _wrong_values(annotation):
    """Values of types the annotation does not name: a bool is not an int, a string not a bool."""
    names = set(re.findall(r"\w+", annotation))
    candidates = [("object", object())]
    if "bool" not in names:
        candidates.append(("bool", True))
    if not names & {"str", "Any"}:
        candidates.append(("str", "yes"))
    if "float" not in names:
        candidates.append(("float", 1.5))
    if not names & {"int", "float"}:
        candidates.append(("int", 7))
    if "bytes" not in names:
        candidates.append(("bytes", b"x"))
    return candidates


CASES = [pytest.param(cls, name, value, id=f"{cls.__name__}.{name}={kind}")
         for cls in BASES for name, annotation in _fields(cls) for kind, value in _wrong_values(annotation)]


def test_every_record_builds_from_its_base():
    """The bases are valid, so each failure below is the wrong field's."""
    for cls, base in BASES.items():
        cls(**base)


@pytest.mark.parametrize(("cls", "name", "value"), CASES)
def test_a_wrong_typed_field_is_a_config_error_naming_it(cls, name, value):
    """The field's wrong-typed value raises ConfigError naming the field and quoting the value (never a secret)."""
    kwargs = {k: v for k, v in BASES[cls].items() if k != _EXCLUSIVE.get(name)}
    with pytest.raises(ConfigError) as info:
        cls(**{**kwargs, name: value})
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert name in message, message
    if name != "secret":
        assert quote(value) in message, message


@pytest.mark.parametrize("cls", list(BASES))
def test_an_unknown_keyword_is_a_config_error_with_the_valid_ones(cls):
    """A misspelt keyword is a ConfigError naming it, the valid fields and the closest one, never a TypeError."""
    name = _fields(cls)[0][0]
    misspelt = name + "s"
    with pytest.raises(ConfigError, match=re.escape(misspelt)) as info:
        cls(**BASES[cls], **{misspelt: 1})
    assert f"did you mean {name!r}?" in str(info.value) and "valid: " in str(info.value)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: SimConfig(verify="yes"), "verify='yes': must be a bool"),
    (lambda: SHAPES["chat"](seed=True), "seed=True: must be an int"),
    (lambda: SimConfig(gpu_blocks=True), "gpu_blocks=True: must be an int >= 1"),
    (lambda: WorkloadHints(priority=False), "WorkloadHints.priority=False: must be an int"),
])
def test_the_issue_s_cases(call, message):
    """Strings are not bools and bools are not ints, in every record."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        call()
