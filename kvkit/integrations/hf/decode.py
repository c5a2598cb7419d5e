"""Decoding on a restored cache: kvkit's greedy loop, or ``model.generate`` with a ``GenerationConfig``.

Greedy, sampling, beam search and beam sampling are supported through
``model.generate``, one returned sequence; any other ``GenerationConfig`` is a
:class:`~kvkit.errors.ConfigError` raised before the stack is touched.
:func:`generate_without_offload` is the full-recompute reference every
offloaded turn is compared against.
"""

from __future__ import annotations

import copy
import inspect
import operator
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import attrs
import torch
import transformers
from packaging.version import Version
from transformers import DynamicCache, GenerationConfig, StoppingCriteria, StoppingCriteriaList
from typing_extensions import override

from kvkit.errors import ConfigError
from kvkit.validate import check_int, is_int, quote


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
        # torch types its factories as Tensor; transformers annotates the answer as BoolTensor
        return cast(torch.BoolTensor, torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device))


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


class _SetupPassed(Exception):  # noqa: N818 - a signal, not an error
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
    if keep_logits and int(config.num_beams) > 1:
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


_MAX_TOKEN_ID = 1 << 31  # no vocabulary is larger; every id fits the int32/int64 tensors models take


def _token_list(tokens: Any) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1:
            raise ConfigError(f"token ids must be 1-D (batch size 1), got shape {tuple(tokens.shape)}")
        tokens = tokens.tolist()
    try:
        ids = [operator.index(t) for t in tokens]
    except TypeError as exc:
        raise ConfigError(f"token ids must be a sequence of ints, got {quote(tokens)}") from exc
    if not ids:
        raise ConfigError("a prompt needs at least one token, got none")
    bad = [t for t in ids if not 0 <= t < _MAX_TOKEN_ID]
    if bad:  # torch would raise a bare "Overflow" or an index error deep in the forward pass
        raise ConfigError(f"token ids must be ints in [0, 2**31), got {quote(bad[0])} in {quote(tokens)}")
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


@attrs.frozen
class Generation:
    """One generation (kvkit's greedy loop or ``model.generate``) and where its prompt's KV came from.

    Attributes:
        tokens: generated token ids (ends at a stop token or stop string, if one came;
            with beam search, the best beam).
        prompt_tokens: prompt length.
        gpu_hit_tokens: prompt tokens reused from the GPU tier.
        cpu_hit_tokens: prompt tokens loaded from the CPU tier (shared-tier hits included).
        head_tokens: prompt tokens of a CPU or shared-tier hit that the load
            plan recomputed while the rest of the hit loaded (counted in
            ``computed_tokens``; their forward pass is in ``load_s``).
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
    head_tokens: int = 0
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
