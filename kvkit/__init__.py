"""kvkit: compose, drive, explore and prove CPU offload tiers for paged KV caches.

``import kvkit`` never imports CuPy or touches CUDA; backends load lazily
through the registry.
"""

from kvkit import errors
from kvkit.config import StackConfig, parse_bytes
from kvkit.interfaces import (
    BlockAllocator,
    BlockHash,
    BlockId,
    CopyBackend,
    Direction,
    EvictionPolicy,
    GroupKind,
    KVCacheSpec,
    KVGroupSpec,
    OffloadCallback,
    Region,
    StorePolicy,
    TransferPlan,
    TransferResult,
)
from kvkit.manager import OffloadManager
from kvkit.stack import OffloadStack, build

__version__ = "0.1.0"

__all__ = [
    "BlockAllocator",
    "BlockHash",
    "BlockId",
    "CopyBackend",
    "Direction",
    "EvictionPolicy",
    "GroupKind",
    "KVCacheSpec",
    "KVGroupSpec",
    "OffloadCallback",
    "Region",
    "OffloadManager",
    "OffloadStack",
    "StackConfig",
    "build",
    "StorePolicy",
    "TransferPlan",
    "TransferResult",
    "errors",
    "parse_bytes",
]
