"""kvkit's block stores (disk, Valkey) as a secondary tier of vLLM's own ``OffloadingConnector``.

vLLM's ``TieringOffloadingSpec`` keeps a CPU primary tier and cascades every
chunk stored there to its secondary tiers; a chunk found only in a
secondary tier is promoted back into the primary tier before the GPU loads
it. A tier is loaded by class name (``type``) from ``module_path``; the
other keys of its entry are passed to :class:`KVKitSecondaryTier`::

    "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8000000000,
        "secondary_tiers": [{
            "type": "KVKitSecondaryTier",
            "module_path": "kvkit.integrations.vllm.tier",
            "url": "file:///var/cache/kvkit?capacity_bytes=200GiB",   # or valkey://host:6379/0
        }],
    }

Rules:

* The store is opened with :func:`kvkit.shared.open_block_store` from
  ``url``; every key of the entry but vLLM's (``type``, ``module_path``,
  ``backpressure``) and the tier's (``url``, ``tenant``, ``locality``) is an
  option of the store (``capacity_bytes``, ``request_timeout_s``...), as are
  the URL's query parameters. A new store belongs to the tier, which closes it
  at ``shutdown``; a ``memory://NAME`` store belongs to the process.
* One value per chunk: the primary tier's row of that chunk (every
  worker's bytes, as vLLM lays them out), under the key
  ``kvkit:<tenant>:vllm:<identity>:<OffloadKey hex>``. ``identity`` digests
  the fields vLLM's own file tier names its directory by (model, dtype,
  tokens per hash, chunk size, KV groups, parallelism when the bytes are not
  portable) and the row's length, so engines that would read a chunk
  differently never share a key, and engines that read it alike share it.
  Values carry no kvkit header: a read whose length is not the row's fails
  (the store's contract), and nothing else is checked.
* Nothing blocks the scheduler: stores and promotions are the store's
  queued ``put``/``get`` calls, polled by ``get_finished_jobs``; a lookup
  is answered ``RETRY`` until vLLM's ``AsyncLookupManager`` has asked the
  store (one ``contains`` per request and step, on its thread). ``contains``
  counts the leading run of present keys, so a key after the first absent
  one in a batch is a miss (recomputed, never wrong).
* A password (or another secret) in ``url`` or among the options is taken
  with a ``UserWarning`` that shows none of it (the entry is in vLLM's
  ``kv_transfer_config``, on its command line and in the arguments vLLM
  logs at start): name where every process reads it instead
  (``password_env``, ``password_file``), as the connector's ``shared`` does.
* Values are never authenticated: a store that talks to a node beyond
  loopback is warned about once, by the shared tier's rule
  (:func:`kvkit.shared.client.warn_unauthenticated`).
* The store decides what to keep (the disk store's ``capacity_bytes``,
  Valkey's ``maxmemory`` and ``ttl_s``): the tier never evicts, and writes
  a chunk again rather than ask whether it is there (writes of one key are
  idempotent).
* A promotion reports the keys that did not land as failed (the primary
  tier frees their slots) and marks them misses, so vLLM does not promote
  them again for the requests asking now.
* ``drain_jobs`` waits until every submitted job is reported (each within
  the store's request deadline); the results go out with the next
  ``get_finished_jobs``.
"""

from __future__ import annotations

from kvkit.integrations.vllm.version import check_vllm_version

check_vllm_version()  # before vLLM's internals, which move between releases

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
from typing_extensions import override
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvkit.errors import ConfigError
from kvkit.integrations.vllm.settings import warn_logged_password
from kvkit.interfaces.shared import DEFAULT_TENANT, BlockStore, StoreResult, check_tenant
from kvkit.shared.client import warn_unauthenticated
from kvkit.shared.urls import open_block_store, process_wide
from kvkit.validate import quote

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["DRAIN_POLL_S", "KVKitSecondaryTier", "tier_key_prefix"]

DRAIN_POLL_S = 0.05
"""Seconds ``drain_jobs`` waits in one poll of the store for its next result."""


def tier_key_prefix(offloading_spec: OffloadingSpec, tenant: str, chunk_bytes: int) -> bytes:
    """What every key of a tier with this vLLM configuration, tenant and row length starts with.

    Raises:
        ConfigError: ``tenant`` is not a tenant id (quoted).
    """
    check_tenant("tenant", tenant)
    identity = FileMapper.from_offloading_spec(
        root_dir="", offloading_spec=offloading_spec,
        blocks_per_file=offloading_spec.blocks_per_chunk, parallel_agnostic=True).get_run_config()
    identity["chunk_bytes"] = chunk_bytes
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return b"kvkit:%s:vllm:%s:" % (tenant.encode(), digest[:32].encode())


def _locality(value: str | None) -> Locality | None:
    if value is None:
        return None
    try:
        return Locality(value)
    except ValueError:
        raise ConfigError(f"locality={quote(value)}: must be one of "
                          f"{', '.join(repr(m.value) for m in Locality)}") from None


@attrs.frozen
class _Job:
    job_id: int
    keys: list[OffloadKey]
    promotion: bool


class _StoreLookups(AsyncLookupManager):
    """vLLM's asynchronous lookups, answered by the store's ``contains`` on the lookup thread."""

    def __init__(self, tier: KVKitSecondaryTier) -> None:
        self._tier = tier
        super().__init__(tier_type=tier.tier_type)

    @override
    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> list[bool]:
        present = self._tier.store.contains([self._tier.store_key(key) for key in keys])
        return [i < present for i in range(len(keys))]


class KVKitSecondaryTier(SecondaryTierManager):
    """A vLLM secondary tier over a kvkit :class:`~kvkit.interfaces.shared.BlockStore` (see the module's rules).

    Args:
        offloading_spec, primary_kv_view, tier_type, backpressure_detector:
            what vLLM's ``SecondaryTierFactory`` passes every tier.
        url: the store (:func:`kvkit.shared.open_block_store`).
        tenant: the second field of every key (a Valkey ACL pattern
            ``~kvkit:<tenant>:*`` confines it).
        locality: ``"LOCAL"`` or ``"REMOTE"`` (vLLM's per-request tier
            filters read it), or ``None``.
        **options: options of the store.

    Raises:
        ConfigError: a bad URL, option, tenant or locality (quoted).
        BackendUnavailableError: the store cannot run here.

    Invariants: ``_jobs`` holds exactly the tickets submitted and not yet
    reported, each once; ``_finished`` only results of jobs no longer in it.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str, *,
                 url: str, tenant: str = DEFAULT_TENANT, locality: str | None = None,
                 backpressure_detector: BackpressureDetector | None = None, **options: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = _locality(locality)
        self._prefix = tier_key_prefix(offloading_spec, tenant, self.block_size_bytes)
        warn_logged_password("kv_connector_extra_config['secondary_tiers'] (KVKitSecondaryTier)", url, options)
        self._store = open_block_store(url, **options)
        self._owns_store = not process_wide(self._store)
        try:
            warn_unauthenticated(self._store, None)  # the values carry no header: never authenticated
        except BaseException:  # the warning raised (warnings as errors): nothing of the tier stays open
            if self._owns_store:
                self._store.close()
            raise
        self._rows = primary_kv_view.cast("B")
        self._jobs: dict[int, _Job] = {}
        self._finished: list[JobResult] = []
        self._lookups = _StoreLookups(self)

    @property
    def store(self) -> BlockStore:
        """The block store this tier reads and writes."""
        return self._store

    def store_key(self, key: OffloadKey) -> bytes:
        """The store key of the chunk ``key``."""
        return self._prefix + key.hex().encode()

    def _row(self, chunk_id: int) -> memoryview:
        size = self.block_size_bytes
        return self._rows[chunk_id * size:(chunk_id + 1) * size]

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        present = self._lookups.lookup(key, req_context)
        if present is None:
            return LookupResult.RETRY
        return LookupResult.HIT if present else LookupResult.MISS

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self._store.put)

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self._store.get)

    def _submit(self, job: TransferJob, call: Callable[[list[bytes], list[list[memoryview]]], int]) -> None:
        keys = list(job.keys)
        ticket = call([self.store_key(key) for key in keys], [[self._row(int(c))] for c in job.chunk_ids])
        self._jobs[ticket] = _Job(job.job_id, keys, job.is_promotion)

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        finished, self._finished = self._finished, []
        if self._jobs:
            finished.extend(self._reported(self._store.poll(list(self._jobs))))
        return finished

    def _reported(self, results: Sequence[StoreResult]) -> list[JobResult]:
        reported = []
        for result in results:
            job = self._jobs.pop(result.ticket)
            failed = [job.keys[i] for i in result.failed]
            landed = len(job.keys) - len(failed)
            successful = None
            if job.promotion and failed:
                self._lookups.mark_miss(failed)
                lost = set(failed)
                successful = tuple(key for key in job.keys if key not in lost) or None
            reported.append(JobResult(job_id=job.job_id, success=result.ok, successful_keys=successful,
                                      transfer_bytes=landed * self.block_size_bytes))
        return reported

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    @override
    def drain_jobs(self) -> None:
        while self._jobs:
            self._finished.extend(self._reported(self._store.poll(list(self._jobs), timeout=DRAIN_POLL_S)))

    @override
    def shutdown(self) -> None:
        """Finish every job, stop the lookup thread, close a store the tier opened, release the primary's rows."""
        self.drain_jobs()
        self._lookups.shutdown()
        if self._owns_store:
            self._store.close()
        self._rows.release()

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if a reported job is still pending, or the store's bookkeeping is inconsistent."""
        pending = {job.job_id for job in self._jobs.values()}
        assert len(pending) == len(self._jobs), self._jobs
        assert not pending & {result.job_id for result in self._finished}, (pending, self._finished)
        self._store.check_invariants()
