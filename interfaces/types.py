"""Value types exchanged through kvkit's protocols.

All are immutable (``attrs.frozen``) and validated on construction, so a bad
value is rejected where it is made, not deep inside a pool or a copy.
"""

from __future__ import annotations

import enum
from typing import NewType

import attrs
import numpy as np

from kvkit.errors import ConfigError, PlanError
from kvkit.validate import at_least, is_int, real_in

__all__ = [
    "BlockHash",
    "BlockId",
    "Direction",
    "GroupKind",
    "KVCacheSpec",
    "KVGroupSpec",
    "Tier",
    "TransferPlan",
    "TransferResult",
]

BlockId = NewType("BlockId", int)
"""Index of a block slot in one pool, in ``[0, num_blocks)``."""

BlockHash = NewType("BlockHash", int)
"""Chained content hash of a block: equal hashes mean equal token prefixes."""

_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


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

    layers: tuple[int, ...] = attrs.field(converter=tuple)
    kind: GroupKind = attrs.field(default=GroupKind.FULL, converter=GroupKind)
    window: int | None = None

    def __attrs_post_init__(self) -> None:
        if not self.layers:
            raise ConfigError("a KV group needs at least one layer, got layers=()")
        if self.kind is GroupKind.SLIDING_WINDOW:
            if not is_int(self.window, 1):
                raise ConfigError(
                    f"a sliding-window group needs a positive window, got window={self.window!r}"
                )
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

    Invariants: every layer belongs to exactly one group.
    """

    num_layers: int = attrs.field(validator=at_least(1))
    block_size: int = attrs.field(validator=at_least(1))
    num_kv_heads: int = attrs.field(validator=at_least(1))
    head_dim: int = attrs.field(validator=at_least(1))
    dtype: str = "bfloat16"
    groups: tuple[KVGroupSpec, ...] = attrs.field(converter=tuple, default=())

    def __attrs_post_init__(self) -> None:
        if self.dtype not in _DTYPE_BYTES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; valid: {sorted(_DTYPE_BYTES)}")
        if not self.groups:
            object.__setattr__(self, "groups", (KVGroupSpec(tuple(range(self.num_layers))),))
        seen = sorted(layer for g in self.groups for layer in g.layers)
        if seen != list(range(self.num_layers)):
            raise ConfigError(
                f"groups must cover layers 0..{self.num_layers - 1} exactly once, got {seen!r}"
            )

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element."""
        return _DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_layer_block(self) -> int:
        """Bytes of K *or* V of one block in one layer (one per-layer region piece)."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across every layer, K and V together."""
        return 2 * self.num_layers * self.bytes_per_layer_block

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


def _id_array(value: object) -> np.ndarray:
    arr = np.asarray(value)
    if arr.size == 0:
        arr = np.zeros(0, dtype=np.int64)  # [] has no int dtype; still read-only below
    elif arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise PlanError(f"block ids must be a 1-D array of ints, got {value!r}")
    elif (arr < 0).any():
        raise PlanError(f"block ids must be non-negative, got {arr[arr < 0][:8].tolist()!r}")
    arr = arr.astype(np.int64, copy=True)
    arr.setflags(write=False)
    return arr


@attrs.frozen(eq=False)
class TransferPlan:
    """Blocks to copy between the GPU and CPU pools, in one direction and group.

    ``src[i]`` is copied onto ``dst[i]``. For a store, ``src`` are GPU block ids
    and ``dst`` CPU block ids; for a load the reverse.

    Invariants: ``len(src) == len(dst)``; ids are non-negative int64 (read-only).
    """

    src: np.ndarray = attrs.field(converter=_id_array)
    dst: np.ndarray = attrs.field(converter=_id_array)
    direction: Direction = attrs.field(converter=Direction)
    group: int = 0

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
        transfer_id: the id the manager gave the transfer.
        worker: the reporting worker's rank.
        ok: ``False`` if the copy failed; the manager then discards its blocks.
        seconds: wall time the copy took on that worker, if measured.
        num_bytes: bytes the worker moved.
    """

    transfer_id: int = attrs.field(validator=at_least(0, label="TransferResult.", error=PlanError))
    worker: int = attrs.field(default=0, validator=at_least(0, label="TransferResult.", error=PlanError))
    ok: bool = True
    seconds: float = attrs.field(default=0.0, validator=real_in(low=0, label="TransferResult.", error=PlanError))
    num_bytes: int = attrs.field(default=0, validator=at_least(0, label="TransferResult.", error=PlanError))
