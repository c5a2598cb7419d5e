"""Contract suites that any implementation of kvkit's protocols joins in three lines, and test stand-ins.

Each suite loads only what its protocol needs: the eviction, allocator, store
policy and block-store contracts import no torch; the copy contract and
:class:`ThreadedCopy` do.
"""

from kvkit._lazy import lazy_exports

_EXPORTS = {
    "AllocatorContract": "kvkit.testing.allocator_contract:AllocatorContract",
    "BlockStoreContract": "kvkit.testing.blockstore_contract:BlockStoreContract",
    "CopyBackendContract": "kvkit.testing.copy_contract:CopyBackendContract",
    "EvictionPolicyContract": "kvkit.testing.eviction_contract:EvictionPolicyContract",
    "FIFOContract": "kvkit.testing.eviction_contract:FIFOContract",
    "LRUContract": "kvkit.testing.eviction_contract:LRUContract",
    "StorePolicyContract": "kvkit.testing.store_contract:StorePolicyContract",
    "ThreadedCopy": "kvkit.testing.threaded:ThreadedCopy",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
