"""Multi-turn generation with a Hugging Face causal LM whose prefix KV lives in kvkit blocks.

:class:`OffloadedLM` wraps a ``transformers`` causal LM and an
:class:`~kvkit.OffloadStack` and drives both through kvkit's
:class:`~kvkit.sim.engine_loop.ReferenceEngine`, replacing its synthetic compute
with the model. One :meth:`OffloadedLM.generate` call is one request:

1. hash the prompt's full blocks; the engine finds the longest cached prefix
   on the GPU tier, then continues it from the CPU tier (pinned, loaded);
2. the reused blocks become the model's own cache object (a ``DynamicCache``
   of the installed ``transformers``: full-attention layers get the whole
   prefix, sliding-window layers the blocks inside their window);
3. the model runs on the new tokens only, and decodes on that cache: kvkit's
   greedy loop by default, or ``model.generate`` with a ``GenerationConfig``
   (sampling, beam search, stop strings), given the restored cache and the
   whole prompt so that it prefills only the new tokens;
4. once the first token is chosen, the new tokens' KV, as the model handed it
   to its cache, is written into the request's GPU blocks, which the engine
   then publishes and the store policy sends to the CPU tier. Decoded tokens
   are not written to blocks: the next turn's prompt holds them, so that turn
   computes and stores them with its new tokens.

Example::

    lm = OffloadedLM.build(model, gpu_blocks=256, cpu_bytes="4GiB")
    chat = lm.conversation()
    turn = chat.send(user_token_ids, max_new_tokens=32)
    turn.gpu_hit_tokens, turn.cpu_hit_tokens, turn.computed_tokens, turn.ttft_s
    sampled = chat.send(more_ids, generation_config=GenerationConfig(do_sample=True, top_p=0.9))

Blocks are keyed by the model's identity (:func:`model_fingerprint`: its
config, dtype and a fingerprint of its weights, or a name the user gives), so
two models on one stack never reuse each other's KV, while the same model
wrapped twice does.

Supported: decoder-only families in :data:`SUPPORTED_FAMILIES` whose cache
layers are plain full-attention or sliding-window layers, on CPU or CUDA,
batch size 1, ``transformers >= 4.56`` (layered caches). Anything else raises
:class:`~kvkit.errors.UnsupportedModelError`. Through ``model.generate``:
greedy, sampling, beam search and beam sampling, one returned sequence; any
other ``GenerationConfig`` raises :class:`~kvkit.errors.ConfigError` before
the stack is touched.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import inspect
import itertools
import json
import operator
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from packaging.version import Version
from typing_extensions import override

from kvkit._renamed import renamed_keywords
from kvkit.config import DEFAULTS, StackConfig
from kvkit.errors import BackendUnavailableError, ConfigError, OutOfBlocksError, UnsupportedModelError
from kvkit.hashing import BlockHasher, hash_blocks
from kvkit.interfaces import GroupKind, KVCacheSpec, KVGroupSpec
from kvkit.sim.engine_loop import EngineRequest, PrefillCompute, ReferenceEngine
from kvkit.stack import OffloadStack, build
from kvkit.validate import check_bool, check_int, checked, is_int, quote
from kvkit.worker.layouts import allocate_kv

try:
    import transformers
    from transformers import DynamicCache, GenerationConfig, StoppingCriteria, StoppingCriteriaList
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
except ImportError as exc:  # transformers missing, or older than the layered cache API (4.56)
    raise BackendUnavailableError(
        "kvkit.integrations.hf needs transformers>=4.56 (layered DynamicCache); "
        "install it with: pip install 'kvkit[hf]'") from exc

__all__ = [
    "DEFAULT_NEW_TOKENS",
    "SUPPORTED_FAMILIES",
    "Conversation",
    "Generation",
    "OffloadedLM",
    "generate_without_offload",
    "kv_spec_from_config",
    "model_fingerprint",
]

SUPPORTED_FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
"""``config.model_type`` values whose attention and cache kvkit was tested against."""


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def kv_spec_from_config(config: Any, *, block_size: int = DEFAULTS.block_size, dtype: object = None) -> KVCacheSpec:
    """The ``KVCacheSpec`` of a model built from ``config``, with one KV group per attention kind.

    The layer kinds come from the cache ``transformers`` itself builds for the
    config: full-attention layers form one group, sliding-window layers one
    group per window size.

    Args:
        config: a ``transformers`` model config (``PretrainedConfig``).
        block_size: tokens per kvkit block.
        dtype: KV element type (a ``torch.dtype`` or its name); default the
            config's dtype, else float32.

    Raises:
        UnsupportedModelError: a family outside :data:`SUPPORTED_FAMILIES`, or
            a cache layer that is neither full attention nor a sliding window.
        ConfigError: a bad block size or dtype.
    """
    text = _text_config(config)
    family = getattr(text, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(
            f"model family {family!r} is not supported by kvkit.integrations.hf; supported: "
            f"{list(SUPPORTED_FAMILIES)} (decoder-only, full or sliding-window attention)")
    num_layers = int(text.num_hidden_layers)
    layers = DynamicCache(config=config).layers
    if len(layers) != num_layers:
        raise UnsupportedModelError(
            f"{family!r} config builds {len(layers)} cache layers for {num_layers} hidden layers "
            f"(shared or missing KV); kvkit needs one cache layer per layer")
    full: list[int] = []
    sliding: dict[int, list[int]] = {}
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer:
            full.append(i)
        elif type(layer) is DynamicSlidingWindowLayer:
            sliding.setdefault(int(layer.sliding_window), []).append(i)
        else:
            raise UnsupportedModelError(
                f"layer {i} of {family!r} uses a {type(layer).__name__} cache; kvkit holds only "
                f"DynamicLayer (full attention) and DynamicSlidingWindowLayer")
    groups = [KVGroupSpec(full)] if full else []
    # HF's window W covers the query itself; the group's window covers the W tokens attended.
    groups += [KVGroupSpec(ls, kind=GroupKind.SLIDING_WINDOW, window=w) for w, ls in sorted(sliding.items())]
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    if dtype is None:
        dtype = getattr(text, "dtype", None) or torch.float32
    return KVCacheSpec(num_layers=num_layers, block_size=block_size, num_kv_heads=kv_heads,
                       head_dim=head_dim, dtype=_dtype_name(dtype), groups=groups)


_SAMPLES_PER_TENSOR = 64
_NOT_IDENTITY = ("_name_or_path",)  # where the config was loaded from, not what the model is


def model_fingerprint(model: Any, *, model_name: str | None = None) -> str:
    """A hex SHA-256 digest of what makes ``model``'s KV mean what it means; kvkit salts its blocks with it.

    It digests the config (``config.to_dict()`` without the path it was loaded
    from), the dtype, and either ``model_name`` or a fingerprint of the weights: for
    every parameter its name, shape, dtype and the bytes of 64 evenly spaced
    elements (one small gather per tensor; the weights are not read whole).
    Equal models (the same object, a copy, the same checkpoint loaded twice)
    get equal digests; another config, dtype or set of weights gets another.

    The weights fingerprint samples: a fine-tune that changed only a few rows
    of a tensor may keep its base model's digest. Give ``model_name`` (a model
    id and revision, say) to be sure, or to skip the sampling. The name
    replaces the weights: two models given one name and config are treated as
    one, and share KV; keeping names distinct is the caller's responsibility.

    Raises:
        ConfigError: ``model_name`` is not a non-empty str, or a parameter has
            no data to sample (the meta device) and no ``model_name`` was given.
    """
    _check_model_name(model_name)
    config = {k: v for k, v in model.config.to_dict().items() if k not in _NOT_IDENTITY}
    digest = hashlib.sha256(b"kvkit-hf-model-v1")
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(f"\0dtype={_dtype_name(model.dtype)}\0".encode())
    if model_name is not None:
        digest.update(b"name\0" + model_name.encode("utf-8", "surrogatepass"))
        return digest.hexdigest()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if param.device.type == "meta":
                raise ConfigError(f"parameter {pname!r} is on the meta device, so its weights cannot be "
                                  f"fingerprinted; pass model_name= to name the model")
            flat = param.detach().reshape(-1)
            count = min(flat.numel(), _SAMPLES_PER_TENSOR)
            # Exact integer positions: the same tensor gives the same sample on every device.
            where = torch.arange(count, device=flat.device) * (flat.numel() - 1) // max(count - 1, 1)
            sample = flat.index_select(0, where).view(torch.uint8).cpu().numpy().tobytes()
            digest.update(f"\0{pname}\0{tuple(param.shape)}\0{param.dtype}\0".encode() + sample)
    return digest.hexdigest()


def _check_model_name(model_name: object) -> None:
    if model_name is not None and (not isinstance(model_name, str) or not model_name):
        raise ConfigError(f"model_name={quote(model_name)}: must be a non-empty str (or None: fingerprint the weights)")


def _check_identity(model_name: object, cache_salt: object) -> None:
    """Refuse a bad ``model_name`` or ``cache_salt`` now, before a stack is built or a prompt hashed."""
    _check_model_name(model_name)
    BlockHasher(1, extra_keys=cache_salt)  # encodes the salt once: a bad key raises HashInputError


@attrs.frozen
class Generation:
    """One generation (kvkit's greedy loop or ``model.generate``) and where its prompt's KV came from.

    Attributes:
        tokens: generated token ids (ends at a stop token or stop string, if one came;
            with beam search, the best beam).
        prompt_tokens: prompt length.
        gpu_hit_tokens: prompt tokens reused from the GPU tier.
        cpu_hit_tokens: prompt tokens loaded from the CPU tier.
        ttft_s: seconds from the call to the first token on the host.
        load_s: seconds from the call until the reused KV was usable on the
            model's device (checking the ``GenerationConfig``, hashing, lookup,
            allocation, CPU->GPU copies).
        restore_s: seconds turning the reused blocks into the model's cache object.
        prefill_s: seconds from the restored cache to the first token: the
            forward pass over the computed tokens (through ``generate``: its
            setup and choosing the first token too).
        decode_s: seconds after the first token: writing the computed
            tokens' KV into blocks (queued behind the first token, which does
            not need it), then decoding the remaining tokens.
        logits: ``[len(tokens), vocab]`` float32 logits on the CPU, one row per
            generated token (the model's, before any sampling processor), if asked for.

    Invariants: ``ttft_s == load_s + restore_s + prefill_s`` (device
    synchronised at each boundary); hits are block-aligned and leave at least
    one prompt token to compute.
    """

    tokens: tuple[int, ...]
    prompt_tokens: int
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    ttft_s: float = 0.0
    load_s: float = 0.0
    restore_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    logits: torch.Tensor | None = attrs.field(default=None, repr=False)

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens the model computed (the rest was reused)."""
        return self.prompt_tokens - self.gpu_hit_tokens - self.cpu_hit_tokens


def _forward_kwargs(model: Any) -> tuple[str, dict[str, int]]:
    """The cache argument's name and the last-logits-only argument of ``model.forward``.

    ``transformers`` renamed ``past_key_values`` to ``cache`` in 5.x, and
    ``num_logits_to_keep`` to ``logits_to_keep`` in 4.50.
    """
    params = inspect.signature(model.forward).parameters
    cache_name = "cache" if "cache" in params else "past_key_values"
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return cache_name, {name: 1}
    return cache_name, {}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
            self.layers[layer_idx].cumulative_length = seen

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


DEFAULT_NEW_TOKENS = 16
"""Tokens generated at most when neither ``max_new_tokens`` nor the ``GenerationConfig`` says."""

_CHUNKED_CONTINUES = Version("5.21")
"""The first ``transformers`` whose chunked prefill continues a cache it is given."""

_GENERATE_MODES = ("greedy_search", "sample", "beam_search", "beam_sample")
"""``GenerationConfig`` decoding modes that run on one restored cache (beams reorder and expand it)."""


def _stop_set(model: Any, stop_tokens: Sequence[int] | None) -> frozenset[int]:
    if stop_tokens is None:
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        stop_tokens = () if eos is None else [eos] if isinstance(eos, int) else eos
    return frozenset(int(t) for t in stop_tokens)


def _decode(model: Any, cache: DynamicCache, first_logits: torch.Tensor, max_new_tokens: int,
            stop: frozenset[int], keep_logits: bool) -> tuple[list[int], torch.Tensor | None]:
    """Greedy decoding from the prompt's last logits, extending ``cache`` in place."""
    cache_name, _ = _forward_kwargs(model)
    logits = first_logits
    tokens: list[int] = []
    kept: list[torch.Tensor] = []
    while True:
        if keep_logits:
            kept.append(logits.float().cpu())
        tokens.append(int(torch.argmax(logits)))
        if len(tokens) == max_new_tokens or tokens[-1] in stop:
            break
        step = torch.tensor([[tokens[-1]]], device=logits.device)
        logits = model(input_ids=step, **{cache_name: cache}, use_cache=True).logits[0, -1]
    return tokens, torch.stack(kept) if keep_logits else None


_Decoded = tuple[list[int], torch.Tensor | None]


@attrs.frozen
class _Greedy:
    """kvkit's greedy loop: one forward over the new tokens, then one per generated token."""

    max_new_tokens: int
    stop: frozenset[int]
    keep_logits: bool

    def run(self, model: Any, cache: DynamicCache, prompt: torch.Tensor, start: int,
            prefilled: Callable[[], None]) -> _Decoded:
        """Decode ``prompt`` (1-D) on ``cache``, which holds its first ``start`` tokens.

        ``prefilled`` is called once, after the forward over the new tokens.
        """
        cache_name, last_only = _forward_kwargs(model)
        first = model(input_ids=prompt[None, start:], **{cache_name: cache}, use_cache=True, **last_only)
        prefilled()
        return _decode(model, cache, first.logits[0, -1], self.max_new_tokens, self.stop, self.keep_logits)


class _FirstToken(StoppingCriteria):
    """Never stops ``generate``; calls ``prefilled`` once, when the first token was chosen."""

    def __init__(self, prefilled: Callable[[], None]) -> None:
        self._prefilled: Callable[[], None] | None = prefilled

    @override
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        if self._prefilled is not None:
            self._prefilled()
            self._prefilled = None
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@attrs.frozen
class _Generate:
    """``model.generate`` under ``config``, given the restored cache and the whole prompt.

    ``generate`` finds the cache's length and prefills only the tokens after
    it; for beam search the cache is first repeated once per beam (``generate``
    expands the prompt, not a cache it is given), and ``generate`` reorders it.
    """

    config: GenerationConfig
    tokenizer: Any
    num_beams: int
    keep_logits: bool

    def run(self, model: Any, cache: DynamicCache, prompt: torch.Tensor, start: int,
            prefilled: Callable[[], None]) -> _Decoded:
        """Like :meth:`_Greedy.run`; ``prefilled`` is called once the first token was chosen."""
        if self.num_beams > 1:
            cache.batch_repeat_interleave(self.num_beams)
        cache_name, _ = _forward_kwargs(model)
        out = model.generate(prompt[None], generation_config=self.config, tokenizer=self.tokenizer,
                             stopping_criteria=StoppingCriteriaList([_FirstToken(prefilled)]),
                             **{cache_name: cache})
        logits = torch.stack([row[0] for row in out.logits]).float().cpu() if self.keep_logits else None
        return out.sequences[0, len(prompt):].tolist(), logits


class _SetupPassed(Exception):  # noqa: N818 (a signal, not an error)
    """Raised at ``generate``'s first forward by :func:`_check_with_generate`: its own checks passed."""


def _check_with_generate(model: Any, prompt: torch.Tensor, config: GenerationConfig, tokenizer: Any) -> None:
    """Let ``model.generate`` check ``config`` for ``prompt`` without running the model.

    ``generate`` validates the config and builds its logits processors and
    stopping criteria (refusing, say, ``temperature=0`` or stop strings it
    cannot tokenise) before its first forward pass; a hook stops it there. No
    layer runs and no random number is drawn.

    Raises:
        ConfigError: what ``generate`` raised (a ``ValueError`` or ``TypeError``), as its cause.
    """
    def stop(module: Any, args: Any, kwargs: Any) -> None:
        raise _SetupPassed

    handle = model.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        model.generate(prompt[None], generation_config=config, tokenizer=tokenizer)
    except _SetupPassed:
        pass
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"model.generate refuses this generation_config: {exc}") from exc
    finally:
        handle.remove()


def _generate_problems(config: GenerationConfig, keep_logits: bool, tokenizer: Any) -> list[str]:
    """What kvkit cannot run of ``config`` (the one ``generate`` would use, model defaults filled in)."""
    if not is_int(config.num_beams, 1):  # generate divides by it before any check of its own
        return [f"num_beams={quote(config.num_beams)}: must be an int >= 1"]
    problems = []
    mode = config.get_generation_mode().value
    if mode not in _GENERATE_MODES:
        problems.append(f"generation_config selects {mode!r} decoding; kvkit runs {list(_GENERATE_MODES)} on the "
                        f"restored cache (no assistant model, prompt lookup, constraints, beam groups or DoLa)")
    if config.num_return_sequences != 1:
        problems.append(f"num_return_sequences={quote(config.num_return_sequences)}: a turn has one reply, "
                        f"so it must be 1 (num_beams={config.num_beams} still searches that many beams)")
    if config.cache_implementation is not None:
        problems.append(f"cache_implementation={quote(config.cache_implementation)}: generate runs on the "
                        f"DynamicCache kvkit restored, so it must be None")
    if config.use_cache is False:
        problems.append("use_cache=False: generate must decode on the restored cache, so it must be True")
    if keep_logits and config.num_beams > 1:
        problems.append(f"keep_logits=True with num_beams={config.num_beams}: logits are kept for one sequence; "
                        f"use num_beams=1 or keep_logits=False")
    if config.prefill_chunk_size is not None and Version(transformers.__version__) < _CHUNKED_CONTINUES:
        problems.append(f"prefill_chunk_size={quote(config.prefill_chunk_size)} needs transformers>="
                        f"{_CHUNKED_CONTINUES} (before, a chunked prefill starts the prompt over on the restored "
                        f"cache); installed: {transformers.__version__}")
    if config.stop_strings is not None and tokenizer is None:
        problems.append(f"stop_strings={quote(config.stop_strings)} need the model's tokenizer: pass tokenizer=")
    return problems


def _decoder(model: Any, prompt: torch.Tensor, max_new_tokens: int | None, keep_logits: bool,
             stop_tokens: Sequence[int] | None, generation_config: GenerationConfig | None,
             tokenizer: Any) -> _Greedy | _Generate:
    """How one request decodes; every refusal is raised here, before the request reaches the stack.

    Raises:
        ConfigError: a bad ``max_new_tokens``; ``stop_tokens`` with a config
            (its ``eos_token_id`` says when to stop); ``tokenizer`` without one;
            a config that is not a ``GenerationConfig``, that kvkit cannot run
            (see :func:`_generate_problems`, every problem at once) or that
            ``model.generate`` refuses.
    """
    if max_new_tokens is not None:
        _check_new_tokens(max_new_tokens)
    if generation_config is None:
        if tokenizer is not None:
            raise ConfigError("tokenizer= serves the stop_strings of a generation_config; pass generation_config= too")
        return _Greedy(max_new_tokens or DEFAULT_NEW_TOKENS, _stop_set(model, stop_tokens), keep_logits)
    if not isinstance(generation_config, GenerationConfig):
        raise ConfigError(f"generation_config={quote(generation_config)}: must be a transformers.GenerationConfig")
    if stop_tokens is not None:
        raise ConfigError(f"stop_tokens={quote(stop_tokens)} with a generation_config: set its eos_token_id "
                          f"(and stop_strings) instead")
    config = copy.deepcopy(generation_config)
    config.max_new_tokens = max_new_tokens or config.max_new_tokens or DEFAULT_NEW_TOKENS
    config.return_dict_in_generate, config.output_logits = True, keep_logits
    # The private merge is generate's own: it fills in the model's defaults (a checkpoint may set num_beams).
    effective, _ = model._prepare_generation_config(config)
    problems = _generate_problems(effective, keep_logits, tokenizer)
    if problems:
        raise ConfigError(problems)
    _check_with_generate(model, prompt, config, tokenizer)
    return _Generate(config, tokenizer, effective.num_beams, keep_logits)


def _token_list(tokens: object) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1:
            raise ConfigError(f"token ids must be 1-D (batch size 1), got shape {tuple(tokens.shape)}")
        tokens = tokens.tolist()
    try:
        ids = [operator.index(t) for t in tokens]  # type: ignore[union-attr]
    except TypeError as exc:
        raise ConfigError(f"token ids must be a sequence of ints, got {tokens!r}") from exc
    if not ids:
        raise ConfigError("a prompt needs at least one token, got none")
    return ids


def _check_new_tokens(max_new_tokens: object) -> None:
    check_int("max_new_tokens", max_new_tokens, 1)


def generate_without_offload(model: Any, tokens: Sequence[int] | torch.Tensor, max_new_tokens: int = DEFAULT_NEW_TOKENS,
                             *, keep_logits: bool = False,
                             stop_tokens: Sequence[int] | None = None) -> Generation:
    """Greedy generation that prefills the whole prompt: the recompute baseline, timed the same way.

    Same decoding loop as :meth:`OffloadedLM.generate`, from an empty cache.
    """
    ids = _token_list(tokens)
    _check_new_tokens(max_new_tokens)
    device = model.device
    first_token_at = 0.0

    def prefilled() -> None:
        nonlocal first_token_at
        _sync(device)
        first_token_at = time.perf_counter()

    with torch.no_grad():
        start = time.perf_counter()
        greedy = _Greedy(max_new_tokens, _stop_set(model, stop_tokens), keep_logits)
        out, logits = greedy.run(model, DynamicCache(config=model.config), torch.tensor(ids, device=device), 0,
                                 prefilled)
        _sync(device)
        ttft, decode = first_token_at - start, time.perf_counter() - first_token_at
    return Generation(tuple(out), len(ids), ttft_s=ttft, prefill_s=ttft, decode_s=decode, logits=logits)


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


@attrs.define(eq=False)
class _Job:
    """A request's prompt on the model's device, how it decodes, and what came out when."""

    tokens: torch.Tensor
    decoder: _Greedy | _Generate
    output: _Decoded | None = None
    loaded_at: float = 0.0
    restored_at: float = 0.0
    first_token_at: float = 0.0
    done_at: float = 0.0


@attrs.define(eq=False)
class _ModelPrefill(PrefillCompute):
    """The reference engine's compute: restores the reused blocks into a model cache, runs the model.

    The request's prefill continues into its decoding (one request at a time),
    so the engine step that prefills a prompt also generates its reply.

    Invariants: reads only blocks the engine says hold reused KV (before
    ``first_block``, and for a sliding-window group only those inside its
    window); writes every recomputed block of every group before returning,
    with the KV the model computed for the prompt (decoded tokens' KV is not written).
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

        def prefilled() -> None:  # the prompt's forward passes are over: every layer holds its KV
            _sync(device)
            job.first_token_at = time.perf_counter()
            # Queued after the first token, before any decode step and before the prompt's stores are planned.
            self._write_back(request, first_block, cache.recorded or {})
            cache.recorded = None

        job.output = job.decoder.run(self.model, cache, job.tokens, first_block * self.spec.block_size, prefilled)
        _sync(device)
        job.done_at = time.perf_counter()
        if cache.recorded is not None:
            raise UnsupportedModelError("the model returned from generation before choosing a first token; "
                                        "kvkit could not store the prompt's KV")
        return 0  # a model cannot check bytes; the logits comparison in the tests does

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

    def _write_back(self, req: EngineRequest, first: int,
                    recorded: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Write the new tokens' KV (as the model cached it) into blocks ``first..`` of every group.

        One scatter per layer and plane; slots past the last token keep whatever they held
        (no hash covers a partial block, so nothing reads them).
        """
        if len(recorded) != self.spec.num_layers:
            raise UnsupportedModelError(
                f"the model updated {len(recorded)} of {self.spec.num_layers} cache layers; "
                f"kvkit needs every layer to cache its own KV")
        bs = self.spec.block_size
        device = self.planes[0][0].device
        for g, group in enumerate(self.spec.groups):
            new = torch.arange(sum(k.shape[-2] for k, _ in recorded[group.layers[0]]), device=device)
            table = torch.tensor(req.table[g][first:], device=device)
            where = (table[new // bs], new % bs)  # (block, offset) of each new token
            for layer in group.layers:
                for plane, pieces in zip(self.planes[layer], zip(*recorded[layer], strict=True), strict=True):
                    # Row 0: beam search runs the prompt once per beam, every row the same.
                    rows = (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-2))[0].transpose(0, 1)
                    plane.index_put_(where, rows)


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
    prompt's full blocks are in the GPU tier's prefix cache and their stores
    to the CPU tier are submitted.

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
    pipelined: bool | None = attrs.field(default=None, kw_only=True, converter=checked(check_bool, optional=True))
    model_id: str = attrs.field(init=False)
    engine: ReferenceEngine = attrs.field(init=False)
    _compute: _ModelPrefill = attrs.field(init=False)
    _ids: itertools.count = attrs.field(init=False, factory=itertools.count)

    def __attrs_post_init__(self) -> None:
        spec = self.stack.config.kv
        expected = kv_spec_from_config(self.model.config, block_size=spec.block_size, dtype=self.model.dtype)
        if spec != expected:
            raise ConfigError(f"the stack's KV spec {spec!r} does not fit the model, which needs {expected!r}")
        if len(self.stack.workers) != 1 or self.stack.workers[0].layout is None:
            raise ConfigError(f"the stack needs exactly one worker with a registered KV cache, got "
                              f"{len(self.stack.workers)} worker(s); hint: OffloadedLM.build(model, ...)")
        worker = self.stack.workers[0]
        device = worker.gpu_kv[0].device
        if device != self.model.device:
            raise ConfigError(f"the stack's KV cache is on {device}, the model on {self.model.device}")
        _check_identity(self.model_name, self.cache_salt)
        self.model_id = model_fingerprint(self.model, model_name=self.model_name)
        self._compute = _ModelPrefill(self.model, spec, _planes(worker.gpu_kv, worker.layout, spec))
        pipelined = device.type == "cuda" if self.pipelined is None else self.pipelined
        self.engine = ReferenceEngine(self.stack, compute=self._compute, layered=pipelined)

    @classmethod
    @renamed_keywords(eviction="cpu_eviction")
    def build(cls, model: Any, *, gpu_blocks: int, block_size: int = DEFAULTS.block_size, layout: str = "per-layer",
              cache_salt: tuple = (), model_name: str | None = None, pipelined: bool | None = None,
              **slots: Any) -> OffloadedLM:
        """Build a stack for ``model`` (KV cache of ``gpu_blocks`` blocks on its device) and wrap it.

        Args:
            model: the causal LM.
            gpu_blocks: GPU-tier blocks; a prompt needs ``ceil(len / block_size)``
                per KV group.
            block_size: tokens per block.
            layout: the KV cache layout (see :mod:`kvkit.worker.layouts`).
            cache_salt: see the class.
            model_name: see the class.
            pipelined: see the class.
            **slots: the rest of :class:`~kvkit.StackConfig` (``cpu_blocks`` or
                ``cpu_bytes``, ``cpu_eviction``, ``store``, ``copy``, ``shared``...);
                ``device`` is the model's; with ``shared``, ``shared_model``
                defaults to :func:`model_fingerprint`.

        Raises:
            ConfigError: every bad slot at once, or a bad ``model_name`` (before anything is built).
            HashInputError: a bad ``cache_salt`` (before anything is built).
            UnsupportedModelError: see :func:`kv_spec_from_config`.
        """
        _check_identity(model_name, cache_salt)
        device = slots.pop("device", model.device.type)
        if device != model.device.type:
            raise ConfigError(f"device={device!r}: the KV cache lives on the model's device, {model.device}")
        spec = kv_spec_from_config(model.config, block_size=block_size, dtype=model.dtype)
        if slots.get("shared") is not None:  # the shared tier's namespace names this model's weights
            slots.setdefault("shared_model", model_fingerprint(model, model_name=model_name))
        config = StackConfig(kv=spec, gpu_blocks=gpu_blocks, device=device, **slots)
        kv = allocate_kv(spec, layout, gpu_blocks, model.device)
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
            except BaseException:
                engine.abort(rid)  # waiting or running: its blocks go back, nothing of it is stored
                raise
            finally:
                del self._compute.jobs[rid]
            engine.finish(rid)
            engine.step()  # plan and submit this prompt's stores now (they overlap what comes next)
        assert job.output is not None
        out, logits = job.output
        return Generation(tuple(out), len(ids), req.gpu_hit_tokens, req.cpu_hit_tokens,
                          ttft_s=job.first_token_at - start, load_s=job.loaded_at - start,
                          restore_s=job.restored_at - job.loaded_at, prefill_s=job.first_token_at - job.restored_at,
                          decode_s=job.done_at - job.first_token_at, logits=logits)

    @property
    def _salt(self) -> tuple:
        """The block hashes' extra keys: the model's identity, then the user's salt."""
        return (self.model_id, self.cache_salt)

    def _prefill(self, rid: str) -> EngineRequest:
        """Step the engine until ``rid`` ran its prefill (a pool still held by stores drains first)."""
        for attempt in range(2):
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

