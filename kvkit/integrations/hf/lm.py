"""The user API: :class:`OffloadedLM` (one model, one stack) and :class:`Conversation` (one chat).

One :meth:`OffloadedLM.generate` call is one request: hash the prompt's full
blocks, restore the longest cached prefix from the GPU and CPU tiers, run the
model on the new tokens only, decode, and store the new blocks, the reply's
too: the request grows by the generated tokens the model ran (all but the
last), so their full blocks are cached and stored as the prompt's are, and a
conversation's next turn computes only its new message and the tail of the
history's last, partial block. The stack's
load planner decides which blocks of a CPU or shared-tier hit to load: on the
CPU (not ``pipelined``) a plan's head is one forward pass of its own, run while
the rest of the hit is fetched and loaded; pipelined, only a prefix of the hit
is loaded and the rest recomputed.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from transformers import GenerationConfig

from kvkit.config import DEFAULTS, StackConfig, name_shared_model
from kvkit.errors import ConfigError, OutOfBlocksError
from kvkit.hashing import hash_blocks
from kvkit.integrations.hf.cache import _Job, _ModelPrefill, _planes
from kvkit.integrations.hf.decode import Generation, _decoder, _token_list
from kvkit.integrations.hf.spec import _check_identity, kv_spec_from_config, model_fingerprint
from kvkit.reference.engine import EngineRequest, ReferenceEngine
from kvkit.stack import OffloadStack, build
from kvkit.validate import check_bool, checked, plural, quote
from kvkit.worker.layouts import allocate_kv


@attrs.define(eq=False)
class OffloadedLM:
    """A causal LM whose prompts reuse prefix KV from the GPU and CPU tiers of ``stack``.

    Args:
        model: a ``transformers`` causal LM of a family in :data:`SUPPORTED_FAMILIES`.
        stack: a stack with one worker whose KV tensors sit on the model's
            device, shaped by :func:`kv_spec_from_config` for this model (any
            block size); :meth:`build` makes one.
        cache_salt: mixed into every block hash besides the model's identity,
            e.g. to keep tenants of one model apart (a tuple of str, int, bytes or tuples).
        model_name: the model's identity instead of its weights fingerprint
            (see :func:`model_fingerprint`); models given one name (and config)
            share KV, so it must name one set of weights.
        pipelined: load reused KV layer by layer, each layer's load overlapping
            the forward pass of the layers before it (``None``, the default:
            on CUDA). ``engine.layered`` switches it between turns.

    Attributes:
        model_id: :func:`model_fingerprint` of the model, mixed into every block
            hash: two models on one stack never reuse each other's blocks,
            the same model wrapped twice does.

    Invariants: one request at a time (batch size 1); after each call the
    full blocks of the prompt and of the reply's KV are in the GPU tier's
    prefix cache and their stores to the CPU tier are submitted (the reply's
    only with one sequence, not beam search, and while the GPU tier has
    free blocks for it).

    Raises:
        UnsupportedModelError: see :func:`kv_spec_from_config`.
        ConfigError: the stack does not fit the model (spec, workers, device),
            or a bad ``model_name``.
        HashInputError: a bad ``cache_salt``.
    """

    model: Any
    stack: OffloadStack
    cache_salt: tuple = attrs.field(default=(), kw_only=True)
    model_name: str | None = attrs.field(default=None, kw_only=True)
    pipelined: bool | None = attrs.field(default=None, kw_only=True, converter=checked(check_bool, optional=True))  # type: ignore[misc]
    model_id: str = attrs.field(init=False)
    engine: ReferenceEngine = attrs.field(init=False)
    _compute: _ModelPrefill = attrs.field(init=False)
    _ids: itertools.count = attrs.field(init=False, factory=itertools.count)

    def __attrs_post_init__(self) -> None:
        spec = self.stack.config.kv
        expected = kv_spec_from_config(self.model.config, block_size=spec.block_size, dtype=self.model.dtype)
        if spec != expected:
            raise ConfigError(f"the stack's KV spec {spec!r} does not fit the model, which needs {expected!r}")
        worker = self.stack.workers[0] if len(self.stack.workers) == 1 else None
        if worker is None or worker.layout is None:
            raise ConfigError(f"the stack needs exactly one worker with a registered KV cache, got "
                              f"{plural(len(self.stack.workers), 'worker')}; hint: OffloadedLM.build(model, ...)")
        device = worker.gpu_kv[0].device
        if device != self.model.device:
            raise ConfigError(f"the stack's KV cache is on {device}, the model on {self.model.device}")
        _check_identity(self.model_name, self.cache_salt)
        self.model_id = model_fingerprint(self.model, model_name=self.model_name)
        self._compute = _ModelPrefill(self.model, spec, _planes(worker.gpu_kv, worker.layout, spec))
        pipelined = device.type == "cuda" if self.pipelined is None else self.pipelined
        self.engine = ReferenceEngine(self.stack, compute=self._compute, layered=pipelined)

    @classmethod
    def build(cls, model: Any, *, block_size: int = DEFAULTS.block_size, layout: str = "per-layer",
              cache_salt: tuple = (), model_name: str | None = None, pipelined: bool | None = None,
              **slots: Any) -> OffloadedLM:
        """Build a stack for ``model`` (KV cache of ``gpu_blocks`` blocks on its device) and wrap it.

        Args:
            model: the causal LM.
            block_size: tokens per block.
            layout: the KV cache layout (see :mod:`kvkit.worker.layouts`).
            cache_salt: see the class.
            model_name: see the class.
            pipelined: see the class.
            **slots: :class:`~kvkit.StackConfig` slots: ``gpu_blocks`` (required;
                a prompt needs ``ceil(len / block_size)`` per KV group),
                ``cpu_blocks`` or ``cpu_bytes``, ``cpu_eviction``, ``store``,
                ``copy``, ``shared``... but ``kv``, which is the model's. ``device``
                is the model's; a shared tier's ``model`` defaults to
                :func:`model_fingerprint`.

        Raises:
            ConfigError: every bad slot at once (an unknown one named with the
                valid ones), or a bad ``model_name`` (before anything is built).
            HashInputError: a bad ``cache_salt`` (before anything is built).
            UnsupportedModelError: see :func:`kv_spec_from_config`.
        """
        _check_identity(model_name, cache_salt)
        if "kv" in slots:
            raise ConfigError(f"kv={quote(slots['kv'])}: the KV spec is the model's (kv_spec_from_config); "
                              f"give block_size=... instead")
        device = slots.setdefault("device", model.device.type)
        if device != model.device.type:
            raise ConfigError(f"device={quote(device)}: the KV cache lives on the model's device, {model.device}")
        spec = kv_spec_from_config(model.config, block_size=block_size, dtype=model.dtype)
        config = StackConfig(kv=spec, **slots)
        if config.shared is not None:  # the shared tier's namespace names this model's weights
            config = name_shared_model(config, model_fingerprint(model, model_name=model_name))
        assert config.gpu_blocks is not None  # StackConfig requires it
        kv = allocate_kv(spec, layout, config.gpu_blocks, model.device)
        return cls(model, build(config, layout=layout, kv_tensors=kv), cache_salt=cache_salt, model_name=model_name,
                   pipelined=pipelined)

    def generate(self, tokens: Sequence[int] | torch.Tensor, max_new_tokens: int | None = None, *,
                 keep_logits: bool = False, stop_tokens: Sequence[int] | None = None,
                 generation_config: GenerationConfig | None = None, tokenizer: Any = None) -> Generation:
        """Generate from the longest cached prefix of ``tokens``, and cache the prompt's KV.

        Without ``generation_config``, kvkit's greedy loop decodes; with one,
        ``model.generate`` does, under that config (greedy, sampling, beam
        search, stop strings), on the restored cache. Either way, tokens equal
        those of the model alone on the whole prompt (greedy: the same tokens;
        sampling: the same tokens for the same ``torch`` seed), up to float
        round-off in the logits (see the tests).

        Args:
            tokens: the prompt's token ids (1-D).
            max_new_tokens: tokens to generate at most; default the config's
                ``max_new_tokens`` if it sets one, else :data:`DEFAULT_NEW_TOKENS`.
            keep_logits: return each generated token's logits (not with beam search).
            stop_tokens: greedy loop only: stop after any of these; default the
                model's ``generation_config.eos_token_id`` (``()`` never stops early).
            generation_config: decode with ``model.generate`` under this config
                (the model's ``generation_config`` fills what it leaves unset).
            tokenizer: the model's tokenizer, which ``generate`` needs for
                ``stop_strings``.

        Raises:
            ConfigError: empty prompt, bad ``max_new_tokens``, or a
                ``generation_config`` kvkit cannot run or ``generate``
                refuses (see :func:`_decoder`); raised before the prompt
                reaches the stack, so nothing changed.
            OutOfBlocksError: the prompt needs more blocks than the GPU tier has.
        """
        ids = _token_list(tokens)
        spec, engine = self.stack.config.kv, self.engine
        rid = f"hf-{next(self._ids)}"
        with torch.no_grad():
            start = time.perf_counter()
            prompt = torch.tensor(ids, device=self.model.device)
            job = _Job(prompt, _decoder(self.model, prompt, max_new_tokens, keep_logits, stop_tokens,
                                        generation_config, tokenizer))
            hashes = hash_blocks(ids, spec.block_size, extra_keys=self._salt,
                                 algorithm=self.stack.config.hash_algorithm)
            engine.add_request(rid, hashes, len(ids))
            self._compute.jobs[rid] = job
            try:
                req = self._prefill(rid)  # restores, prefills and decodes
                self._extend_by_reply(rid, ids, job)
            except BaseException:
                engine.abort(rid)  # waiting or running: its blocks go back, nothing of it is stored
                raise
            finally:
                del self._compute.jobs[rid]
            engine.finish(rid)
            engine.step()  # plan and submit this prompt's stores now (they overlap what comes next)
        assert job.output is not None
        out, logits = job.output
        return Generation(tuple(out), len(ids), req.gpu_hit_tokens, req.cpu_hit_tokens, req.head_tokens,
                          ttft_s=job.first_token_at - start, load_s=job.loaded_at - start,
                          restore_s=job.restored_at - job.loaded_at, prefill_s=job.first_token_at - job.restored_at,
                          decode_s=job.done_at - job.first_token_at, logits=logits)

    @property
    def _salt(self) -> tuple:
        """The block hashes' extra keys: the model's identity, then the user's salt."""
        return (self.model_id, self.cache_salt)

    def _extend_by_reply(self, rid: str, prompt: list[int], job: _Job) -> None:
        """Grow the request by the reply tokens whose KV the decode computed, so their blocks are kept like the
        prompt's; a GPU tier without free blocks for them leaves the reply unkept (the turn is unaffected)."""
        assert job.output is not None
        recorded = job.reply_kv
        if not recorded:  # beam search, or a one-token reply (its token never ran)
            return
        ran = sum(k.shape[-2] for k, _ in next(iter(recorded.values())))
        tokens = prompt + list(job.output[0][:ran])
        spec = self.stack.config.kv
        hashes = hash_blocks(tokens, spec.block_size, extra_keys=self._salt, algorithm=self.stack.config.hash_algorithm)
        held = len(prompt) // spec.block_size
        with contextlib.suppress(OutOfBlocksError):
            self.engine.extend(rid, hashes[held:], len(tokens),
                               lambda req, start: self._compute.write_reply(req, start, job))

    def _prefill(self, rid: str) -> EngineRequest:
        """Step the engine until ``rid`` ran its prefill (a pool still held by stores drains first)."""
        for _attempt in range(2):
            for req in self.engine.step().scheduled:
                if req.request_id == rid:
                    return req
            self.engine.drain()
        raise OutOfBlocksError(f"request {rid!r} could not be scheduled: the GPU tier stays full "
                               f"({self.stack.gpu.num_free} free of {self.stack.gpu.num_blocks})")

    def conversation(self) -> Conversation:
        """A new multi-turn conversation on this model and stack."""
        return Conversation(self)

    def clear_gpu_cache(self) -> int:
        """Wait for transfers in flight, then forget every block the GPU tier caches.

        The next turns find their prefixes on the CPU tier only (benchmarks,
        demonstrations). Returns how many cached blocks were dropped.
        """
        self.engine.drain()
        return self.stack.gpu.reset()

    def check_invariants(self) -> None:
        """Assert the stack's invariants and that no request is left in the engine between calls."""
        self.stack.check_invariants()
        assert not self._compute.jobs, sorted(self._compute.jobs)
        assert not self.engine.running and not self.engine.num_waiting

    def close(self) -> None:
        """Drain and release the stack's workers (unpins the CPU mirror)."""
        self.engine.drain()
        self.stack.close()


@attrs.define(eq=False)
class Conversation:
    """A chat: each turn's prompt is the history, then the new tokens; the reply joins the history.

    Attributes:
        lm: the offloaded model.
        history: every token so far (prompts and replies).
        turns: each turn's :class:`Generation`.
    """

    lm: OffloadedLM
    history: list[int] = attrs.field(factory=list)
    turns: list[Generation] = attrs.field(factory=list)

    def send(self, tokens: Sequence[int] | torch.Tensor, max_new_tokens: int | None = None, *,
             keep_logits: bool = False, stop_tokens: Sequence[int] | None = None,
             generation_config: GenerationConfig | None = None, tokenizer: Any = None) -> Generation:
        """Append ``tokens`` to the history, generate a reply (see :meth:`OffloadedLM.generate`), append it.

        Returns the turn; a call that raises leaves the history as it was.
        """
        prompt = self.history + _token_list(tokens)
        turn = self.lm.generate(prompt, max_new_tokens, keep_logits=keep_logits, stop_tokens=stop_tokens,
                                generation_config=generation_config, tokenizer=tokenizer)
        self.history = prompt + list(turn.tokens)
        self.turns.append(turn)
        return turn

    def check_invariants(self) -> None:
        """Assert the history is the last turn's prompt followed by its reply."""
        if self.turns:
            last = self.turns[-1]
            assert len(self.history) == last.prompt_tokens + len(last.tokens), (len(self.history), last)
        else:
            assert not self.history
