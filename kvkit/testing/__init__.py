"""Contract suites that any implementation of kvkit's protocols joins in three lines."""

from kvkit.testing.allocator_contract import AllocatorContract
from kvkit.testing.eviction_contract import EvictionPolicyContract, FIFOContract, LRUContract

__all__ = ["AllocatorContract", "EvictionPolicyContract", "FIFOContract", "LRUContract"]
