"""Multi-turn generation with a Hugging Face causal LM whose prefix KV lives in kvkit blocks.

:class:`OffloadedLM` wraps a ``transformers`` causal LM and an
:class:`~kvkit.OffloadStack` and drives both through kvkit's
:class:`~kvkit.reference.engine.ReferenceEngine`, replacing its synthetic compute
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

from kvkit.errors import BackendUnavailableError

try:  # the layered cache API kvkit builds on
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer  # noqa: F401
except ImportError as exc:  # transformers missing, or older than the layered cache API (4.56)
    raise BackendUnavailableError(
        "kvkit.integrations.hf needs transformers>=4.56 (layered DynamicCache); "
        "install it with: pip install 'kvkit[hf]'") from exc

from kvkit.integrations.hf.decode import DEFAULT_NEW_TOKENS, generate_without_offload
from kvkit.integrations.hf.lm import Conversation, Generation, OffloadedLM
from kvkit.integrations.hf.spec import SUPPORTED_FAMILIES, kv_spec_from_config, model_fingerprint

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
