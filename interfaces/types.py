"""Value types exchanged through kvkit's protocols.

All are immutable (``attrs.frozen``) and validate every field on construction,
so a bad value is rejected where it is made, not deep inside a pool or a copy:
a field of the wrong type or range raises :class:`~kvkit.errors.ConfigError`
(specs) or :class:`~kvkit.errors.PlanError` (plans, results) quoting the value,
never a bare ``TypeError``/``ValueError``. Ints are exact (``bool`` is refused,
NumPy integers become ``int``); enum fields take a member or its value.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any, NewType, TypeGuard

import attrs
import numpy as np

from kvkit.errors import ConfigError, PlanError
from kvkit.validate import check_bool, check_enum, check_int, check_real, checked, plural, quote

__all__ = [
    "BlockHash",
    "BlockId",
    "Direction",
    "GroupKind",
    "KVCacheSpec",
    "KVGroupSpec",
    "MAX_LAYERS",
    "Tier",
    "TransferPlan",
    "TransferResult",
]

BlockId = NewType("BlockId", int)
"""Index of a block slot in one pool, in ``[0, num_blocks)``."""

BlockHash = NewType("BlockHash", int)
"""Chained content hash of a block: equal hashes mean equal token prefixes."""

MAX_LAYERS = 2**16
"""Most layers a :class:`KVCacheSpec` describes (real models have a few hundred at most):
a bound, so a junk ``num_layers`` is refused instead of building a huge layer tuple."""

_INT64_LIMIT = 2**63  # byte sizes and block ids travel in int64 descriptor arrays
_MAX_PLAN_IDS = 2**32  # more than any pool has blocks; refused before numpy allocates (or overcommits) for it

_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


def _is_sequence(value: object) -> TypeGuard[Sequence[Any] | np.ndarray]:
    """A list, tuple, range or 1-D array: not a string (its characters are no elements here)."""
    if isinstance(value, np.ndarray):
        return value.ndim == 1
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))


def _layers(value: object) -> tuple[int, ...]:
    """``KVGroupSpec.layers`` as a tuple of distinct ints >= 0 (at least one)."""
    if not _is_sequence(value):
        raise ConfigError(f"KVGroupSpec.layers={quote(value)}: must be a sequence of layer indices (ints >= 0)")
    if not 1 <= len(value) <= MAX_LAYERS:
        raise ConfigError(f"KVGroupSpec.layers: a KV group needs 1 to {MAX_LAYERS} layers, got {len(value)}")
    layers = tuple(value)
    if not all(layer.__class__ is int and layer >= 0 for layer in layers):  # else quote the first bad one
        layers = tuple(check_int(f"KVGroupSpec.layers[{i}]", layer, 0) for i, layer in enumerate(layers))
    if len(set(layers)) != len(layers):
        repeated = sorted(layer for layer, n in Counter(layers).items() if n > 1)
        raise ConfigError(f"KVGroupSpec.layers={quote(layers)}: layers repeat: {quote(repeated)}")
    return layers


def _dtype(value: object) -> str:
    """``KVCacheSpec.dtype``: one of the element type names kvkit knows the size of."""
    if not isinstance(value, str) or value not in _DTYPE_BYTES:
        raise ConfigError(f"KVCacheSpec.dtype={quote(value)}: unknown dtype; valid: {sorted(_DTYPE_BYTES)}")
    return str(value)


def _groups(value: object) -> tuple[KVGroupSpec, ...]:
    """``KVCacheSpec.groups`` as a tuple of :class:`KVGroupSpec` (coverage is checked by the spec)."""
    if not _is_sequence(value) or not all(isinstance(g, KVGroupSpec) for g in value):
        raise ConfigError(f"KVCacheSpec.groups={quote(value)}: must be a sequence of KVGroupSpec")
    return tuple(value)


class GroupKind(enum.Enum):
    """How the layers of one KV group attend to earlier tokens."""

    FULL = "full"
    SLIDING_WINDOW = "sliding_window"


@attrs.frozen
class KVGroupSpec:
    """One KV cache group: layers that share a block table and an attention kind.

    Attributes:
        layers: indices of the model layers in this group.
        kind: full attention, or a sliding window of ``window`` tokens.
        window: tokens a sliding-window layer attends to (``None`` for full).
    """

    layers: tuple[int, ...] = attrs.field(converter=_layers)
    kind: GroupKind = attrs.field(default=GroupKind.FULL,
                                  converter=checked(check_enum, cls=GroupKind, label="KVGroupSpec."))  # type: ignore[misc]
    window: int | None = attrs.field(default=None, converter=checked(check_int, minimum=1, optional=True,  # type: ignore[misc]
                                                                     label="KVGroupSpec."))

    def __attrs_post_init__(self) -> None:
        if self.kind is GroupKind.SLIDING_WINDOW:
            if self.window is None:
                raise ConfigError("a sliding-window group needs a positive window, got window=None")
        elif self.window is not None:
            raise ConfigError(f"a full-attention group takes no window, got window={self.window!r}")

    def blocks_needed(self, num_tokens: int, block_size: int) -> int:
        """Trailing blocks this group reads to attend from token ``num_tokens``.

        Full attention needs every block; a sliding window only those that
        overlap the last ``window`` tokens (plus the block it starts in).
        """
        total = -(-num_tokens // block_size)
        if self.kind is GroupKind.FULL:
            return total
        assert self.window is not None  # a sliding-window group has one (checked when built)
        return min(total, -(-self.window // block_size) + 1)


@attrs.frozen
class KVCacheSpec:
    """Shape of a paged KV cache; the single source of truth for block sizes.

    Attributes:
        num_layers: attention layers in the model.
        block_size: tokens per block.
        num_kv_heads: key/value heads per layer.
        head_dim: elements per head.
        dtype: element type name (``"bfloat16"``, ``"float16"``, ``"float32"``...).
        groups: KV groups; default is one full-attention group of every layer.
        latent: each layer caches one latent vector of ``head_dim`` elements
            per token (MLA: DeepSeek-V2/V3's compressed KV and rope key), not a
            K and a V; such a cache has a single KV head.

    Invariants: every layer belongs to exactly one group; ``1 <= num_layers <=``
    :data:`MAX_LAYERS`; :attr:`bytes_per_block` fits an int64; a latent cache
    has ``num_kv_heads == 1``.
    """

    num_layers: int = attrs.field(converter=checked(check_int, minimum=1, label="KVCacheSpec."))  # type: ignore[misc]
    block_size: int = attrs.field(converter=checked(check_int, minimum=1, label="KVCacheSpec."))  # type: ignore[misc]
    num_kv_heads: int = attrs.field(converter=checked(check_int, minimum=1, label="KVCacheSpec."))  # type: ignore[misc]
    head_dim: int = attrs.field(converter=checked(check_int, minimum=1, label="KVCacheSpec."))  # type: ignore[misc]
    dtype: str = attrs.field(default="bfloat16", converter=_dtype)
    groups: tuple[KVGroupSpec, ...] = attrs.field(converter=_groups, default=())
    latent: bool = attrs.field(default=False, converter=checked(check_bool, label="KVCacheSpec."))  # type: ignore[misc]

    def __attrs_post_init__(self) -> None:
        if self.latent and self.num_kv_heads != 1:
            raise ConfigError(f"KVCacheSpec.num_kv_heads={self.num_kv_heads!r}: a latent (MLA) cache holds one "
                              f"vector per token, so num_kv_heads must be 1")
        if self.num_layers > MAX_LAYERS:
            raise ConfigError(f"KVCacheSpec.num_layers={self.num_layers!r}: must be at most {MAX_LAYERS}")
        if self.bytes_per_block >= _INT64_LIMIT:
            raise ConfigError(f"a block of {self.bytes_per_block} bytes does not fit an int64 "
                              f"(num_layers, block_size, num_kv_heads, head_dim are too large)")
        if not self.groups:
            object.__setattr__(self, "groups", (KVGroupSpec(tuple(range(self.num_layers))),))
        seen = sorted(layer for g in self.groups for layer in g.layers)
        if seen != list(range(self.num_layers)):
            raise ConfigError(
                f"groups must cover layers 0..{self.num_layers - 1} exactly once, got {quote(seen)}"
            )

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element."""
        return _DTYPE_BYTES[self.dtype]

    @property
    def kv_parts(self) -> int:
        """Vectors a layer caches per token and KV head: 2 (a K and a V) or 1 (the :attr:`latent`)."""
        return 1 if self.latent else 2

    @property
    def bytes_per_layer_block(self) -> int:
        """Bytes of K *or* V (or the latent) of one block in one layer (one per-layer region piece)."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across every layer, K and V together (or the latent)."""
        return self.kv_parts * self.num_layers * self.bytes_per_layer_block

    def blocks_for(self, num_bytes: int) -> int:
        """Whole blocks that fit in ``num_bytes``."""
        return num_bytes // self.bytes_per_block


class Tier(enum.StrEnum):
    """A tier of the offload hierarchy: the engine's GPU pool or kvkit's CPU pool.

    A ``str`` enum, so a member equals, hashes and formats as its value:
    code that compares a tier with ``"cpu"`` or prints it keeps working, and
    ``Tier("gpu")`` turns a caller's string into a member.
    """

    GPU = "gpu"
    CPU = "cpu"


class Direction(enum.Enum):
    """Which way a transfer moves bytes."""

    STORE = "store"  # GPU -> CPU (device to host)
    LOAD = "load"  # CPU -> GPU (host to device)


def _id_array(value: object, field: attrs.Attribute) -> np.ndarray:
    """``TransferPlan.src``/``dst`` as a read-only copy: a 1-D int64 array of ids in ``[0, 2**63)``."""
    name = f"TransferPlan.{field.name}"
    try:
        size = len(value)  # type: ignore[arg-type]
    except TypeError:  # no length (a scalar, a 0-d array): numpy makes it 0-d, refused below
        size = 0
    if size > _MAX_PLAN_IDS:
        raise PlanError(f"{name}: {plural(size, 'block id')} (from {quote(value)}) are more than any pool has; "
                        f"at most {_MAX_PLAN_IDS}")
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError, OverflowError, RecursionError, MemoryError):  # ragged, too deep, a CUDA tensor...
        arr = None
    if arr is None or arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise PlanError(f"{name}: block ids must be a 1-D array of ints, got {quote(value)}")
    if arr.size == 0:
        arr = np.zeros(0, dtype=np.int64)  # [] has no int dtype; still read-only below
    elif (arr < 0).any():
        raise PlanError(f"{name}: block ids must be non-negative, got {arr[arr < 0][:8].tolist()!r}")
    elif arr.dtype == np.uint64 and arr.max() >= _INT64_LIMIT:  # would wrap to negative int64
        raise PlanError(f"{name}: block ids must be below 2**63, got {int(arr.max())}")
    arr = arr.astype(np.int64, copy=True)
    arr.setflags(write=False)
    return arr


def _positions(value: object) -> tuple[int, ...]:
    """``TransferResult.lost`` as a sorted tuple of distinct ints >= 0."""
    if not _is_sequence(value):
        raise PlanError(f"TransferResult.lost must be a sequence of plan positions, got {quote(value)}")
    if len(value) > _MAX_PLAN_IDS:
        raise PlanError(f"TransferResult.lost: {plural(len(value), 'position')} (from {quote(value)}) are more "
                        f"than any plan has; at most {_MAX_PLAN_IDS}")
    out = tuple(check_int("TransferResult.lost", v, minimum=0, error=PlanError) for v in value)
    if len(set(out)) != len(out):
        raise PlanError(f"TransferResult.lost names a position twice: {quote(value)}")
    return tuple(sorted(out))


@attrs.frozen(eq=False)
class TransferPlan:
    """Blocks to copy between the GPU and CPU pools, in one direction and group.

    ``src[i]`` is copied onto ``dst[i]``. For a store, ``src`` are GPU block ids
    and ``dst`` CPU block ids; for a load the reverse.

    Invariants: ``len(src) == len(dst)``; ids are non-negative int64 (read-only);
    ``direction`` is a :class:`Direction` (given as a member or ``"store"``/``"load"``);
    ``group`` is an int >= 0.
    """

    src: np.ndarray = attrs.field(converter=attrs.Converter(_id_array, takes_field=True))  # type: ignore[misc]
    dst: np.ndarray = attrs.field(converter=attrs.Converter(_id_array, takes_field=True))  # type: ignore[misc]
    direction: Direction = attrs.field(converter=checked(check_enum, cls=Direction, label="TransferPlan.",  # type: ignore[misc]
                                                         error=PlanError))
    group: int = attrs.field(default=0, converter=checked(check_int, minimum=0, label="TransferPlan.",  # type: ignore[misc]
                                                          error=PlanError))

    def __attrs_post_init__(self) -> None:
        if len(self.src) != len(self.dst):
            raise PlanError(
                f"source and destination differ in length: {len(self.src)} != {len(self.dst)}"
            )

    def __len__(self) -> int:
        return len(self.src)


@attrs.frozen
class TransferResult:
    """A finished transfer as one worker reports it.

    Attributes:
        transfer_id: the id the manager gave the transfer (an int >= 0).
        worker: the reporting worker's rank (an int >= 0).
        ok: ``False`` if the copy failed; the manager then discards its blocks.
            A real ``bool`` (a NumPy bool is converted): ``"False"`` or ``0``
            would read as success or failure by accident, so they are refused.
        seconds: wall time the copy took on that worker, if measured (finite, >= 0).
        num_bytes: bytes the worker moved (an int >= 0).
        lost: with ``ok=True``, the positions in the transfer's plan (``SharedPlan.blocks``)
            of the blocks that failed on that worker while the others landed (sorted, distinct
            ints >= 0; empty: every block landed). Only a shared-tier fetch reports them (its
            blocks commit one by one: a block commits only if no worker lost it); for any other
            transfer, or naming a position beyond its plan, they fail it as a whole.
    """

    transfer_id: int = attrs.field(converter=checked(check_int, minimum=0, label="TransferResult.",  # type: ignore[misc]
                                                     error=PlanError))
    worker: int = attrs.field(default=0, converter=checked(check_int, minimum=0, label="TransferResult.",  # type: ignore[misc]
                                                           error=PlanError))
    ok: bool = attrs.field(default=True, converter=checked(check_bool, label="TransferResult.", error=PlanError))  # type: ignore[misc]
    seconds: float = attrs.field(default=0.0, converter=checked(check_real, low=0, high=math.inf, high_open=True,  # type: ignore[misc]
                                                                label="TransferResult.", error=PlanError))
    num_bytes: int = attrs.field(default=0, converter=checked(check_int, minimum=0, label="TransferResult.",  # type: ignore[misc]
                                                              error=PlanError))
    lost: tuple[int, ...] = attrs.field(default=(), converter=_positions)
