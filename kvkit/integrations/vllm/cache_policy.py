"""kvkit's eviction policies as the eviction policy of vLLM's own ``OffloadingConnector`` (a vLLM ``CachePolicy``).

vLLM's CPU offloading manager (``CPUOffloadingManager``, also the primary
tier of ``TieringOffloadingSpec``) keeps its chunks in a ``CachePolicy`` it
loads by name: ``eviction_policy`` names the class and
``cache_policy_module_path`` the module it is read from, so no registration
is needed::

    "kv_connector_extra_config": {
        "cpu_bytes_to_use": 8000000000,
        "eviction_policy": "KVKitCachePolicy",          # kvkit's default CPU policy (hit-density)
        "cache_policy_module_path": "kvkit.integrations.vllm.cache_policy",
    }

Any policy of :data:`kvkit.EVICTION` (built-in or registered through the
``kvkit.backends`` entry points) is named ``"kvkit-<name>"``
(``"kvkit-s3fifo"``, ``"kvkit-lru"``): vLLM's own ``"lru"`` and ``"arc"``
win over any module path, so kvkit's names carry the prefix. An unknown
``kvkit-`` name raises :class:`~kvkit.errors.ConfigError` quoting it and
listing the valid ones.

How vLLM's calls map onto the kvkit policy (:class:`~kvkit.interfaces.EvictionPolicy`):

* a chunk is a kvkit block whose id is its CPU slot (``chunk_id``, unique
  among the cached chunks) and whose hash is its ``OffloadKey`` read as a
  big-endian integer; ``insert`` is ``on_insert``, ``remove`` and every
  eviction ``on_remove``. vLLM's ``CachePolicy`` never learns a chunk's
  predecessor, so every chunk enters as the head of its own chain (parent
  ``None``): prefix-aware policies rank chunks by their own statistics and
  never see an orphan.
* a chunk may be evicted exactly when its ``ref_cnt`` is 0 (stored and no
  transfer reading it) and it is not in ``evict``'s ``protected`` set; a
  pin-aware policy hears of every change through its pin hooks (``insert``
  of a pending chunk, ``mark_non_evictable`` pin; ``mark_evictable`` unpins).
* a hit is ``on_access``: ``touch`` for every key it names that is cached,
  and a finished request for the cached keys it reused (loaded from the
  CPU tier), never for the chunks it only inserted. Both report a prefix
  tail first, so its head, which every continuation needs, is the most
  recent (as vLLM's LRU orders it).
* ``evict(n, protected)`` asks the policy for ``n`` victims; when it cannot
  choose ``n`` the answer is ``None`` and nothing changed (both contracts
  are atomic). ``clear`` starts a new policy: learned state goes too, as
  vLLM's contract asks.
"""

from __future__ import annotations

from kvkit.integrations.vllm.version import check_vllm_version

check_vllm_version()  # before vLLM's internals, which move between releases

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import ClassVar

from typing_extensions import override
from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys

from kvkit.config import DEFAULTS
from kvkit.errors import ConfigError
from kvkit.interfaces import EvictionPolicy
from kvkit.interfaces.capabilities import pin_hooks
from kvkit.interfaces.types import BlockHash, BlockId
from kvkit.registry import EVICTION
from kvkit.validate import quote

__all__ = ["NAME_PREFIX", "KVKitCachePolicy", "cache_policy_class"]

NAME_PREFIX = "kvkit-"
"""What starts the ``eviction_policy`` name of a kvkit policy other than the default (``"kvkit-lfu"``)."""


def _hash(key: OffloadKey) -> BlockHash:
    return BlockHash(int.from_bytes(key, "big"))


class KVKitCachePolicy(CachePolicy):
    """A vLLM ``CachePolicy`` whose eviction decisions are a kvkit policy's (:attr:`policy_name`).

    vLLM builds it with the CPU tier's size (``cache_capacity``, in chunks);
    the kvkit policy is built by name from :data:`kvkit.EVICTION`, with no
    options, as kvkit's own CPU tier builds it.

    Invariants:
        * ``_chunks`` holds exactly the cached chunks, ``_keys`` maps each
          one's ``chunk_id`` back to its key, and the kvkit policy tracks
          exactly those ids.
        * A kvkit policy with pin hooks hears ``on_pin`` when a cached
          chunk's ``ref_cnt`` leaves 0 (or it is inserted pending) and
          ``on_unpin`` when it returns to 0, so the chunks it may choose are
          exactly those vLLM may evict.
    """

    policy_name: ClassVar[str] = DEFAULTS.cpu_eviction
    """The :data:`kvkit.EVICTION` name this class builds (a subclass per name: :func:`cache_policy_class`)."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._chunks: dict[OffloadKey, ChunkStatus] = {}
        self._keys: dict[BlockId, OffloadKey] = {}
        self._policy: EvictionPolicy
        self._pins: tuple[Callable[[BlockId], None], Callable[[BlockId], None]] | None
        self._start()

    @property
    def policy(self) -> EvictionPolicy:
        """The kvkit policy deciding now (a new one after each :meth:`clear`)."""
        return self._policy

    def _start(self) -> None:
        self._policy = EVICTION.create(self.policy_name, slot="eviction_policy")
        self._pins = pin_hooks(self._policy)
        self._chunks.clear()
        self._keys.clear()

    @override
    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self._chunks.get(key)

    @override
    def insert(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        block = BlockId(chunk.chunk_id)
        self._policy.on_insert(block, _hash(key), None)
        self._chunks[key] = chunk
        self._keys[block] = key
        if chunk.ref_cnt != 0 and self._pins is not None:
            self._pins[0](block)

    @override
    def remove(self, key: OffloadKey) -> None:
        block = BlockId(self._chunks.pop(key).chunk_id)
        del self._keys[block]
        self._policy.on_remove(block)

    @override
    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self._access(reversed(list(keys)))

    @override
    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]], insertion_only_keys: set[OffloadKey],
                            reused_keys: set[OffloadKey], req_context: ReqContext) -> None:
        ordered = order_request_keys(key_groups, req_context)
        self._access(key for key in reversed(ordered) if key in reused_keys)

    def _access(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            chunk = self._chunks.get(key)
            if chunk is not None:
                self._policy.on_access(BlockId(chunk.chunk_id))

    @override
    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n == 0:
            return []

        def is_evictable(block: BlockId) -> bool:
            key = self._keys.get(block)
            return key is not None and key not in protected and self._chunks[key].ref_cnt == 0

        victims = self._policy.select_victims(n, is_evictable)
        if victims is None:
            return None
        evicted = []
        for block in victims:
            key = self._keys[block]
            evicted.append((key, self._chunks[key]))
            self.remove(key)
        return evicted

    @override
    def clear(self) -> None:
        self._start()

    @override
    def mark_evictable(self, key: OffloadKey) -> None:
        if self._pins is not None:
            self._pins[1](BlockId(self._chunks[key].chunk_id))

    @override
    def mark_non_evictable(self, key: OffloadKey) -> None:
        if self._pins is not None:
            self._pins[0](BlockId(self._chunks[key].chunk_id))

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the maps disagree with each other or with the kvkit policy."""
        assert len(self._keys) == len(self._chunks) == len(self._policy), (
            len(self._keys), len(self._chunks), len(self._policy))
        for block, key in self._keys.items():
            assert self._chunks[key].chunk_id == block, (key, block, self._chunks[key].chunk_id)
        self._policy.check_invariants()


@functools.cache
def _subclass(name: str) -> type[KVKitCachePolicy]:
    if name == KVKitCachePolicy.policy_name:
        return KVKitCachePolicy
    return type(f"{NAME_PREFIX}{name}", (KVKitCachePolicy,), {
        "__module__": __name__, "policy_name": name,
        "__doc__": f"A vLLM ``CachePolicy`` deciding with kvkit's {name!r} eviction policy."})


def cache_policy_class(name: str) -> type[KVKitCachePolicy]:
    """The ``CachePolicy`` class deciding with kvkit's eviction policy ``name`` (one class per name).

    Raises:
        ConfigError: ``name`` is not a registered kvkit eviction policy, or
            cannot run here (the message quotes it and lists the valid names).
    """
    if not isinstance(name, str):
        raise ConfigError(f"eviction_policy={quote(name)}: must be a kvkit eviction policy name")
    problem = EVICTION.check(name, slot="eviction_policy")
    if problem is not None:
        raise ConfigError(problem)
    return _subclass(name)


def __getattr__(name: str) -> type[KVKitCachePolicy]:
    """``"kvkit-<policy>"``: the class of that kvkit policy, as vLLM's ``getattr(module, eviction_policy)`` reads it."""
    if name.startswith(NAME_PREFIX):
        return cache_policy_class(name.removeprefix(NAME_PREFIX))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
