"""Composition of the shared tier: a store from a URL or an instance, the value format as a codec.

A stack's scheduler and every worker rank use the one store directly: each
collects the results of its own tickets (``BlockStore.poll(tickets)``), so
nothing sorts results between them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from kvkit.interfaces import BlockHash, KVCacheSpec
from kvkit.interfaces.shared import BlockStore
from kvkit.shared.format import HEADER_SIZE, Namespace, ValueStatus, block_key, check_value, encode_header
from kvkit.shared.urls import open_block_store, process_wide

if TYPE_CHECKING:
    from kvkit.config import StackConfig
    from kvkit.shared.scheduler import SharedTierSpec

__all__ = ["FormatCodec", "SharedConnection", "connect_shared", "open_shared"]


def open_shared(value: str | BlockStore) -> tuple[BlockStore, bool]:
    """The store ``value`` names, and whether the caller owns it (must close it).

    ``value`` is a :class:`~kvkit.interfaces.shared.BlockStore` instance (its
    giver keeps owning it) or a URL :func:`~kvkit.shared.urls.open_block_store`
    opens; the caller owns what that built, never the process's ``memory://`` stores.

    Raises:
        ConfigError: neither a store nor a URL :func:`~kvkit.shared.urls.open_block_store` accepts, quoting it.
        BackendUnavailableError: the URL's store cannot run here.
    """
    if isinstance(value, BlockStore) and not isinstance(value, type):
        return value, False
    store = open_block_store(value)  # type: ignore[arg-type]  # anything else: a ConfigError quoting it
    return store, not process_wide(store)


@attrs.frozen
class FormatCodec:
    """The shared tier's value format (:mod:`kvkit.shared.format`) as a :class:`~kvkit.interfaces.shared.BlockCodec`.

    Attributes:
        namespace: what gives the bytes their meaning (model, spec, layout, TP size).
        secret: HMAC secret shared by every instance of a deployment, or ``None``.
    """

    namespace: Namespace
    secret: bytes | None = None
    header_bytes: int = attrs.field(default=HEADER_SIZE, init=False)

    @classmethod
    def for_stack(cls, spec: KVCacheSpec, world_size: int, *, model: str, layout: str,
                  secret: bytes | None = None) -> FormatCodec:
        """The codec of a stack: ``model`` names the weights (and revision), ``layout`` the payload.

        Raises:
            BackendUnavailableError: the value format cannot run here (no ``xxhash``), before any store is used.
        """
        codec = cls(Namespace(model=model, spec=spec, layout=layout, tp_size=world_size), secret)
        encode_header(codec.namespace, 0, 0, [], secret=secret)  # fails now, not inside a worker's first put
        return codec

    def key(self, block_hash: BlockHash, rank: int) -> bytes:
        return block_key(self.namespace, _fold(block_hash), rank)

    def seal(self, header: memoryview, block_hash: BlockHash, rank: int, payload: Sequence[memoryview]) -> None:
        header[:] = encode_header(self.namespace, _fold(block_hash), rank, payload, secret=self.secret)

    def check(self, header: memoryview, block_hash: BlockHash, rank: int, payload: Sequence[memoryview]) -> bool:
        return check_value(self.namespace, _fold(block_hash), rank, header, payload,
                           secret=self.secret) is ValueStatus.OK


_HASH_MASK = (1 << 128) - 1


def _fold(block_hash: BlockHash) -> BlockHash:
    """The value format's 128-bit block hash: wider hashes (vLLM's SHA-256 digests) keep their low 128 bits.

    Any 128 bits of a cryptographic digest are as collision-resistant as the
    format's field allows; kvkit's own hashes already fit and are unchanged.
    """
    return BlockHash(block_hash & _HASH_MASK) if block_hash > _HASH_MASK else block_hash


@attrs.frozen
class SharedConnection:
    """One process's connection to the shared tier of a :class:`~kvkit.config.StackConfig`.

    Attributes:
        spec: the scheduler's view (the store, the codec, write mode, back-off).
        store: the store the scheduler and every worker rank use.
        owned: whether this process opened ``store`` (and must close it).
    """

    spec: SharedTierSpec
    store: BlockStore
    owned: bool


def connect_shared(config: StackConfig, *, layout: str) -> SharedConnection:
    """Open ``config.shared`` and build its codec: the one path of every stack, kvkit's own and vLLM's.

    ``layout`` is the CPU payload layout the namespace names.

    Raises:
        ConfigError / BackendUnavailableError: as :func:`open_shared` and :meth:`FormatCodec.for_stack`.
    """
    from kvkit.shared.scheduler import SharedTierSpec

    store, owned = open_shared(config.shared)
    codec = FormatCodec.for_stack(config.kv, config.world_size, model=config.shared_model, layout=layout,
                                  secret=config.shared_secret)
    spec = SharedTierSpec(store=store, codec=codec, write=config.shared_write,
                          backoff_s=config.shared_backoff_s, max_backoff_s=60 * config.shared_backoff_s)
    return SharedConnection(spec, store, owned)
