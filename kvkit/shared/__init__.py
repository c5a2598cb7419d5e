"""The shared tier: a store of block values shared by every instance of a deployment.

One room holds its implementation: :mod:`~kvkit.shared.urls` opens a block
store from a URL; :mod:`~kvkit.shared.format` frames values (header,
checksum, optional HMAC) and names their keys; :mod:`~kvkit.shared.client`
connects a stack to its store (who owns it, the codec); :mod:`~kvkit.shared.scheduler`
finds shared hits and plans fetches and puts for the manager;
:mod:`~kvkit.shared.worker` runs them on each worker rank. The protocols
(``BlockStore``, ``BlockCodec``) live in :mod:`kvkit.interfaces.shared`, the
stores themselves in ``kvkit.backends.blockstore``.
"""

from kvkit._lazy import lazy_exports

__all__ = ["SharedTierSpec", "open_block_store"]

__getattr__, __dir__ = lazy_exports(__name__, {
    "SharedTierSpec": "kvkit.shared.scheduler:SharedTierSpec",
    "open_block_store": "kvkit.shared.urls:open_block_store",
})
