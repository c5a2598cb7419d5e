"""kvkit's protocols and the value types they exchange (``kvkit.interfaces``)."""

from kvkit.interfaces.allocator import BlockAllocator
from kvkit.interfaces.callbacks import OffloadCallback
from kvkit.interfaces.capabilities import (
    BatchedPolicy,
    EvictionOrder,
    EvictionWindow,
    ExplainsUnavailability,
    HeadCompute,
    IndexedPolicy,
    PinAwarePolicy,
    PrefillCompute,
    ReportsAvailability,
    SelfChecking,
    TimedCopy,
    WindowedPolicy,
)
from kvkit.interfaces.copy import CopyBackend, Region
from kvkit.interfaces.eviction import EvictionPolicy
from kvkit.interfaces.plan import HitQuery, HitSource, LoadPlan, LoadPlanner
from kvkit.interfaces.store import RequestView, StorePolicy
from kvkit.interfaces.types import (
    BlockHash,
    BlockId,
    Direction,
    GroupKind,
    KVCacheSpec,
    KVGroupSpec,
    Tier,
    TransferPlan,
    TransferResult,
)

__all__ = [
    "BatchedPolicy",
    "BlockAllocator",
    "BlockHash",
    "BlockId",
    "CopyBackend",
    "Direction",
    "EvictionOrder",
    "EvictionPolicy",
    "EvictionWindow",
    "ExplainsUnavailability",
    "GroupKind",
    "HeadCompute",
    "HitQuery",
    "HitSource",
    "IndexedPolicy",
    "KVCacheSpec",
    "KVGroupSpec",
    "LoadPlan",
    "LoadPlanner",
    "OffloadCallback",
    "PinAwarePolicy",
    "PrefillCompute",
    "Region",
    "ReportsAvailability",
    "RequestView",
    "SelfChecking",
    "TimedCopy",
    "StorePolicy",
    "Tier",
    "TransferPlan",
    "TransferResult",
    "WindowedPolicy",
]
