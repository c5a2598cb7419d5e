"""The bridge between kvkit blocks and a ``transformers`` cache object.

Reused blocks become the model's own ``DynamicCache`` (full-attention layers
get the whole prefix, sliding-window layers the blocks inside their window);
the new tokens' KV, as the model handed it to its cache, is written into the
request's GPU blocks once the first token is chosen. The reply's KV (every
generated token the model ran, so all but the last) is kept as each decode
step hands it over, for :meth:`_ModelPrefill.write_reply` once the request
grew by those tokens; with beam search it is not kept (the steps' rows are
beams that get reordered, not the reply's).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import attrs
import torch
from transformers import DynamicCache
from typing_extensions import override

from kvkit.errors import UnsupportedModelError
from kvkit.integrations.hf.decode import _Decoded, _forward_kwargs, _Generate, _Greedy, _sync
from kvkit.interfaces import GroupKind, HeadCompute, KVCacheSpec
from kvkit.reference.engine import EngineRequest, ReferenceEngine
from kvkit.validate import plural

if TYPE_CHECKING:
    from transformers.cache_utils import DynamicSlidingWindowLayer


class _RecordingCache(DynamicCache):
    """A ``DynamicCache`` that also keeps the KV each layer receives while ``recorded`` is a dict.

    A sliding-window layer keeps only its window, so the new tokens' KV is
    taken where the model hands it over, before any layer trims it. A chunked
    prefill (``prefill_chunk_size``) hands a layer its tokens in pieces, kept in order.
    """

    recorded: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
    # Pipelined restores: per layer, what restores its reused KV, run just before the layer first uses the cache.
    pending: dict[int, Callable[[], tuple[torch.Tensor, torch.Tensor, int | None]]] | None = None
    repeats: int = 1  # batch_repeat_interleave so far: a pending layer is repeated as the others were

    def restore(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, seen: int | None) -> None:
        """Put a layer's reused KV in place; ``seen``: the tokens a sliding-window layer must count (else None)."""
        if self.repeats > 1:
            keys, values = keys.repeat_interleave(self.repeats, 0), values.repeat_interleave(self.repeats, 0)
        super().update(keys, values, layer_idx)
        if seen is not None:  # it got the window's blocks only; it must count (and position) the whole prefix
            cast("DynamicSlidingWindowLayer", self.layers[layer_idx]).cumulative_length = seen

    @override
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pending and layer_idx in self.pending:
            self.restore(layer_idx, *self.pending.pop(layer_idx)())
        if self.recorded is not None:
            self.recorded.setdefault(layer_idx, []).append((key_states, value_states))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @override
    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.repeats *= repeats


def _planes(tensors: Sequence[torch.Tensor], layout: str,
            spec: KVCacheSpec) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, K and V of every block as ``[num_blocks, block_size, heads, head_dim]`` views."""
    if layout == "per-layer":
        return [(t[0], t[1]) for t in tensors]
    if layout == "blocks-first":
        return [(t[:, 0], t[:, 1]) for t in tensors]
    if layout == "cross-layer":
        return [(tensors[0][:, i, 0], tensors[0][:, i, 1]) for i in range(spec.num_layers)]
    if layout == "vllm-cpu":  # [blocks, heads, block_size, 2 * head_dim]: K then V per token row
        d = spec.head_dim
        return [(t[..., :d].transpose(1, 2), t[..., d:].transpose(1, 2)) for t in tensors]
    raise UnsupportedModelError(f"kvkit.integrations.hf cannot read KV layout {layout!r}")


_Recorded = dict[int, list[tuple[torch.Tensor, torch.Tensor]]]
"""Per layer, the K and V pieces the model handed its cache, in order."""


@attrs.define(eq=False)
class _Job:
    """A request's prompt on the model's device, how it decodes, and what came out when.

    ``reply_kv``: once decoded, the KV of the generated tokens the model ran
    (all but the last), per layer; ``None`` with beam search.
    """

    tokens: torch.Tensor
    decoder: _Greedy | _Generate
    output: _Decoded | None = None
    reply_kv: _Recorded | None = None
    loaded_at: float = 0.0
    restored_at: float = 0.0
    first_token_at: float = 0.0
    done_at: float = 0.0

    @property
    def keeps_reply(self) -> bool:
        """Whether the decode steps' KV is the reply's: one sequence (no beams)."""
        return not (isinstance(self.decoder, _Generate) and self.decoder.num_beams > 1)


@attrs.define(eq=False)
class _ModelPrefill(HeadCompute):
    """The reference engine's compute: restores the reused blocks into a model cache, runs the model.

    The request's prefill continues into its decoding (one request at a time),
    so the engine step that prefills a prompt also generates its reply. A
    load plan's head is one more forward pass, over the head's tokens on the
    GPU hit alone, while the rest of the hit loads. Each forward pass's time
    is the stack's load planner's observation of compute, except a pass
    that read a hit loaded layer by layer beside it (it also waited on the
    loads; with a shared tier, loads land before the pass).

    Invariants: reads only blocks the engine says hold reused KV (before
    ``first_block``, and for a sliding-window group only those inside its
    window); writes every recomputed block of every group before returning,
    with the KV the model computed for the prompt; decoded tokens' KV is
    written by :meth:`write_reply` only, into blocks the engine added for them.
    """

    model: Any
    spec: KVCacheSpec
    planes: list[tuple[torch.Tensor, torch.Tensor]]
    jobs: dict[str, _Job] = attrs.field(factory=dict)

    @override
    def prefill(self, engine: ReferenceEngine, request: EngineRequest, first_block: int) -> int:
        """Decode the request on its restored prefix; the new tokens' KV goes to blocks ``first_block..``."""
        job = self.jobs[request.request_id]
        device = job.tokens.device
        pipelined = engine.layered
        if not pipelined:
            _sync(device)  # phase times: the loads landed, the device is idle
        job.loaded_at = time.perf_counter()
        cache = self._restore(request, first_block, engine if pipelined else None)
        if not pipelined:  # pipelined, the load and the restore run inside the forward pass
            _sync(device)
        job.restored_at = time.perf_counter()
        cache.recorded = {}
        start = first_block * self.spec.block_size
        reply: list[_Recorded] = []  # the decode steps' KV, once the prompt's was written

        def prefilled() -> None:  # the prompt's forward passes are over: every layer holds its KV
            _sync(device)
            job.first_token_at = time.perf_counter()
            if not (engine.layered_loads and request.cpu_hit_tokens):  # else the pass also waited on its loads
                self._observe(engine, len(job.tokens) - start, start, job.first_token_at - job.restored_at)
            # Queued after the first token, before any decode step and before the prompt's stores are planned.
            self._write_back(request, start, cache.recorded or {})
            cache.recorded = {} if job.keeps_reply else None
            reply.append({} if cache.recorded is None else cache.recorded)

        job.output = job.decoder.run(self.model, cache, job.tokens, start, prefilled)
        _sync(device)
        job.done_at = time.perf_counter()
        if not reply:
            raise UnsupportedModelError("the model returned from generation before choosing a first token; "
                                        "kvkit could not store the prompt's KV")
        job.reply_kv = reply[0] if job.keeps_reply else None
        cache.recorded = None
        return 0  # a model cannot check bytes; the logits comparison in the tests does

    def write_reply(self, request: EngineRequest, start: int, job: _Job) -> None:
        """Write ``job``'s reply KV (see :class:`_Job`) into the request's blocks from token ``start`` on."""
        assert job.reply_kv is not None, "write_reply without a recorded reply"
        self._write_back(request, start, job.reply_kv)

    @override
    def prefill_head(self, engine: ReferenceEngine, request: EngineRequest, start: int, stop: int) -> None:
        """One forward pass over the tokens of blocks ``[start, stop)`` on the GPU hit; their KV into those blocks."""
        job = self.jobs[request.request_id]
        bs = self.spec.block_size
        began = time.perf_counter()
        cache = self._restore(request, start)
        cache.recorded = {}
        cache_name, last_only = _forward_kwargs(self.model)
        self.model(input_ids=job.tokens[None, start * bs: stop * bs], **{cache_name: cache}, use_cache=True,
                   **last_only)
        self._write_back(request, start * bs, cache.recorded)
        _sync(job.tokens.device)
        self._observe(engine, (stop - start) * bs, start * bs, time.perf_counter() - began, engine.beside_loads)

    @staticmethod
    def _observe(engine: ReferenceEngine, tokens: int, context: int, seconds: float,
                 beside_loads: bool = False) -> None:
        """Tell the stack's load planner what computing ``tokens`` after ``context`` took (``beside_loads``:
        while the step's loads ran)."""
        planner = engine.stack.manager.planner
        if planner is not None:
            planner.observe_compute(tokens, context, seconds, beside_loads=beside_loads)

    def _restore(self, req: EngineRequest, first: int, engine: ReferenceEngine | None = None) -> _RecordingCache:
        """A fresh model cache holding the KV of the request's first ``first`` blocks.

        With ``engine`` (pipelined) only each group's first layer is restored
        now, which the model reads to size its masks; every other layer is
        restored when the forward pass reaches it, once ``engine.wait_layer``
        says its load landed, so its load overlaps the layers before it.
        """
        cache = _RecordingCache(config=self.model.config)
        if not first:
            return cache
        bs = self.spec.block_size
        prefix = first * bs
        device = self.planes[0][0].device
        cache.pending = {}
        for g, group in enumerate(self.spec.groups):
            lo = first - group.blocks_needed(prefix, bs)
            ids = torch.tensor(req.table[g][lo:first], device=device)
            seen = prefix if group.kind is GroupKind.SLIDING_WINDOW else None
            for n, layer in enumerate(group.layers):
                restore = functools.partial(self._layer_kv, engine, ids, layer, seen)
                if engine is None or n == 0:
                    cache.restore(layer, *restore())
                else:
                    cache.pending[layer] = restore
        return cache

    def _layer_kv(self, engine: ReferenceEngine | None, ids: torch.Tensor, layer: int,
                  seen: int | None) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """Blocks ``ids`` of ``layer`` as the model caches K and V (after that layer's load, if ``engine``)."""
        if engine is not None:
            engine.wait_layer(layer)
        k, v = (p.index_select(0, ids).flatten(0, 1).transpose(0, 1).unsqueeze(0) for p in self.planes[layer])
        return k, v, seen

    def _write_back(self, req: EngineRequest, start: int, recorded: _Recorded) -> None:
        """Write the KV of tokens ``start..`` (as the model cached it) into the request's blocks of every group.

        One scatter per layer and plane; slots past the last token keep whatever they held
        (no hash covers a partial block, so nothing reads them).
        """
        if len(recorded) != self.spec.num_layers:
            raise UnsupportedModelError(
                f"the model updated {len(recorded)} of {plural(self.spec.num_layers, 'cache layer')}; "
                f"kvkit needs every layer to cache its own KV")
        bs = self.spec.block_size
        device = self.planes[0][0].device
        for g, group in enumerate(self.spec.groups):
            new = start + torch.arange(sum(k.shape[-2] for k, _ in recorded[group.layers[0]]), device=device)
            table = torch.tensor(req.table[g], device=device)
            where = (table[new // bs], new % bs)  # (block, offset) of each new token
            for layer in group.layers:
                for plane, pieces in zip(self.planes[layer], zip(*recorded[layer], strict=True), strict=True):
                    # Row 0: beam search runs the prompt once per beam, every row the same.
                    rows = (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-2))[0].transpose(0, 1)
                    plane.index_put_(where, rows)
