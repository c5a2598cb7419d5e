"""Contract suites that any implementation of kvkit's protocols joins in three lines, and test stand-ins."""

from kvkit.testing.allocator_contract import AllocatorContract
from kvkit.testing.blockstore_contract import BlockStoreContract
from kvkit.testing.copy_contract import CopyBackendContract
from kvkit.testing.eviction_contract import EvictionPolicyContract, FIFOContract, LRUContract
from kvkit.testing.store_contract import StorePolicyContract
from kvkit.testing.threaded import ThreadedCopy

__all__ = ["AllocatorContract", "BlockStoreContract", "CopyBackendContract", "EvictionPolicyContract",
           "FIFOContract", "LRUContract", "StorePolicyContract", "ThreadedCopy"]
