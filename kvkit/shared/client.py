"""Composition of the shared tier: store URLs or instances, one client per user, the value format as a codec.

The stack gives the scheduler and every worker rank its own *client* of the
one shared store: a store instance shared in one process (``memory://``, or
an instance passed by the user) answers ``poll`` with every finished ticket,
so :class:`StoreClient` routes each result to the client whose call it was.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from kvkit.backends.blockstore.memory import MemoryStore
from kvkit.errors import ConfigError, KVKitError
from kvkit.interfaces import BlockHash, KVCacheSpec

if TYPE_CHECKING:
    from kvkit.config import StackConfig
    from kvkit.shared.scheduler import SharedTierSpec
from kvkit.interfaces.shared import BlockStore, StoreResult
from kvkit.shared.format import HEADER_SIZE, Namespace, ValueStatus, block_key, check_value, encode_header
from kvkit.validate import quote

__all__ = ["FormatCodec", "SharedConnection", "StoreClient", "connect_shared", "open_shared", "shared_clients"]

_MEMORY: dict[str, MemoryStore] = {}
_MEMORY_LOCK = threading.Lock()


def open_shared(value: str | BlockStore) -> tuple[BlockStore, bool]:
    """The store ``value`` names, and whether the caller owns it (must close it).

    ``value`` is a :class:`~kvkit.interfaces.shared.BlockStore` instance
    (the caller keeps owning it), ``"memory://"`` or ``"memory://NAME"`` (one
    in-process :class:`~kvkit.backends.blockstore.memory.MemoryStore` per name,
    shared by every stack of the process), or any URL
    :func:`~kvkit.shared.urls.open_block_store` accepts (``file:///path?capacity_bytes=50GiB``,
    ``valkey://host:port/db``...).

    Raises:
        ConfigError: not a store and not a URL any store accepts, quoting it.
        BackendUnavailableError: the URL's store cannot run here.
    """
    if isinstance(value, BlockStore) and not isinstance(value, type):
        return value, False
    if not isinstance(value, str) or "://" not in value:
        raise ConfigError(f"shared={quote(value)}: must be a BlockStore instance or a URL such as "
                          f"'memory://', 'file:///path' or 'valkey://host:6379/0'")
    if value.startswith("memory://"):
        with _MEMORY_LOCK:
            return _MEMORY.setdefault(value[len("memory://"):], MemoryStore()), False
    from kvkit.shared.urls import open_block_store

    return open_block_store(value), True


@attrs.define(eq=False)
class _Router:
    """Hands each finished ticket of one store to the client that queued it."""

    store: BlockStore
    lock: threading.Lock = attrs.field(factory=threading.Lock)
    owner: dict[int, int] = attrs.field(factory=dict)  # ticket -> client id
    ready: dict[int, list[StoreResult]] = attrs.field(factory=dict)
    orphans: dict[int, StoreResult] = attrs.field(factory=dict)  # reported before its call returned

    def call(self, client: int, method: str, keys: Sequence[bytes], buffers: Sequence) -> int:
        with self.lock:
            ticket = getattr(self.store, method)(keys, buffers)
            res = self.orphans.pop(ticket, None)
            if res is None:
                self.owner[ticket] = client
            else:
                self.ready.setdefault(client, []).append(res)
            return ticket

    def poll(self, client: int, timeout: float) -> list[StoreResult]:
        with self.lock:
            if not self.ready.get(client):
                for res in self.store.poll(timeout):
                    who = self.owner.pop(res.ticket, None)
                    if who is None:
                        self.orphans[res.ticket] = res
                    else:
                        self.ready.setdefault(who, []).append(res)
            return self.ready.pop(client, [])


_ROUTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ROUTERS_LOCK = threading.Lock()


def _router(store: BlockStore) -> _Router:
    with _ROUTERS_LOCK:
        try:
            router = _ROUTERS.get(store)
            if router is None:
                router = _ROUTERS[store] = _Router(store)
        except TypeError:  # not weakly referenceable: one router per call, so never share such a store
            router = _Router(store)
        return router


@attrs.define(eq=False)
class StoreClient:
    """One user's view of a shared store: ``poll`` reports only the tickets this client queued.

    ``close`` closes the client, not the store (others may still use it).
    """

    router: _Router
    _closed: bool = attrs.field(default=False, init=False)

    @property
    def store(self) -> BlockStore:
        """The store every client of it shares."""
        return self.router.store

    def contains(self, keys: Sequence[bytes]) -> int:
        return 0 if self._closed else self.router.store.contains(keys)

    def put(self, keys: Sequence[bytes], values: Sequence[Sequence[memoryview]]) -> int:
        self._check_open()
        return self.router.call(id(self), "put", keys, values)

    def get(self, keys: Sequence[bytes], buffers: Sequence[Sequence[memoryview]]) -> int:
        self._check_open()
        return self.router.call(id(self), "get", keys, buffers)

    def poll(self, timeout: float = 0.0) -> list[StoreResult]:
        return self.router.poll(id(self), timeout)

    def close(self) -> None:
        self._closed = True

    def check_invariants(self) -> None:
        self.router.store.check_invariants()

    def _check_open(self) -> None:
        if self._closed:
            raise KVKitError("this shared-store client is closed")


def shared_clients(store: BlockStore, n: int) -> list[StoreClient]:
    """``n`` clients of ``store`` (the scheduler's and one per worker rank)."""
    router = _router(store)
    return [StoreClient(router) for _ in range(n)]


@attrs.frozen
class FormatCodec:
    """The shared tier's value format (:mod:`kvkit.shared.format`) as a :class:`~kvkit.interfaces.shared.BlockCodec`.

    Attributes:
        namespace: what gives the bytes their meaning (model, spec, layout, TP size).
        secret: HMAC secret shared by every instance of a deployment, or ``None`` (never in the repr).
    """

    namespace: Namespace
    secret: bytes | None = attrs.field(default=None, repr=False)
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
        spec: the scheduler's view (its client, the codec, write mode, back-off).
        clients: one more client per worker rank this process runs.
        store: the store every client shares.
        owned: whether this process opened ``store`` (and must close it).
    """

    spec: SharedTierSpec
    clients: list[StoreClient]
    store: BlockStore
    owned: bool


def connect_shared(config: StackConfig, *, layout: str, workers: int) -> SharedConnection:
    """Open ``config.shared.url`` and build its codec: the one path of every stack, kvkit's own and vLLM's.

    ``layout`` is the CPU payload layout the namespace names; ``workers`` how
    many worker ranks of ``config.world_size`` this process runs (each gets a client).

    Raises:
        ConfigError / BackendUnavailableError: as :func:`open_shared` and :meth:`FormatCodec.for_stack`.
    """
    from kvkit.config import UNNAMED_MODEL
    from kvkit.shared.scheduler import SharedTierSpec

    shared = config.shared
    store, owned = open_shared(shared.url)
    clients = shared_clients(store, workers + 1)  # the scheduler's, then one per rank
    codec = FormatCodec.for_stack(config.kv, config.world_size, model=shared.model or UNNAMED_MODEL, layout=layout,
                                  secret=shared.secret)
    spec = SharedTierSpec(store=clients[0], codec=codec, write=shared.write,
                          backoff_s=shared.backoff_s, max_backoff_s=60 * shared.backoff_s)
    return SharedConnection(spec, clients[1:], store, owned)
