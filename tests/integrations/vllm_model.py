"""Builds a tiny, deterministic Llama checkpoint that vLLM can load offline.

Helper for the vLLM integration tests, not a test module. The suite runs with
``--import-mode=importlib``, which puts no test folder on ``sys.path``, so a
bare ``import vllm_model`` fails unless something adds this folder: either
``pythonpath = ["tests/integrations"]`` in ``[tool.pytest.ini_options]``, or a
``conftest.py`` here that loads this file with
``importlib.util.spec_from_file_location`` and exposes a fixture.
It imports only the standard library at module level, so it can be imported
where vLLM and transformers are missing.

Each checkpoint is a byte-level BPE tokenizer trained on generated text and a
2-layer model with seeded random weights, saved with ``save_pretrained``:
``LlamaForCausalLM`` (full attention), ``MistralForCausalLM`` with a sliding
window on every layer (vLLM: one ``SlidingWindowSpec`` KV group) and
``Gemma3ForCausalLM`` alternating sliding-window and full-attention layers
(vLLM's hybrid allocator: one group of each kind) and a bfloat16
``DeepseekV3ForCausalLM`` with multi-head latent attention (vLLM: one
``MLAAttentionSpec`` group, a 576-element latent per token, the only size
vLLM's CPU MLA kernels take). Same arguments give
byte-identical files. The shapes fit vLLM's CPU attention backend (head size
32; it needs block sizes that are multiples of 32). Building takes about a
second.
"""

from __future__ import annotations

import random
from pathlib import Path

__all__ = [
    "HEAD_DIM",
    "HIDDEN_SIZE",
    "NUM_HEADS",
    "NUM_KV_HEADS",
    "NUM_LAYERS",
    "SLIDING_WINDOW",
    "build_tiny_deepseek",
    "build_tiny_gemma3",
    "build_tiny_llama",
    "build_tiny_mistral",
]

NUM_LAYERS = 2
HIDDEN_SIZE = 128
HEAD_DIM = 32
NUM_HEADS = HIDDEN_SIZE // HEAD_DIM
# Fewer KV heads than query heads (GQA) so a test can tell the two apart in
# the KV cache layout.
NUM_KV_HEADS = 2
# Two blocks of 32 tokens: a window vLLM keeps in 2 blocks, much shorter than the prompts.
SLIDING_WINDOW = 64

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "qu", "ph", "ox")
_SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")


def _corpus(rng: random.Random, num_lines: int) -> list[str]:
    """Pseudo-words with punctuation, so BPE learns word and space merges."""
    lines = []
    for _ in range(num_lines):
        words = (
            "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(4, 16))
        )
        lines.append(" ".join(words) + rng.choice(".,?!"))
    return lines


def _train_tokenizer(seed: int, vocab_size: int):
    # Imported here so this module imports without vLLM's extra dependencies.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(_SPECIAL_TOKENS),
        # The full byte alphabet keeps every string encodable, so detokenized
        # output of the random model always round-trips.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(seed), 2000), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def _common(tokenizer, max_position_embeddings: int, initializer_range: float) -> dict:
    return dict(
        vocab_size=len(tokenizer), hidden_size=HIDDEN_SIZE, intermediate_size=2 * HIDDEN_SIZE,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=max_position_embeddings, initializer_range=initializer_range,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )


def _save(path: Path, seed: int, tokenizer, model_cls, config) -> Path:
    import torch

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_tiny_llama(
    path: Path,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    max_position_embeddings: int = 4096,
    initializer_range: float = 0.2,
) -> Path:
    """Writes tokenizer, config and float32 weights to ``path`` and returns it.

    ``initializer_range`` is ten times Llama's default: larger weights give
    peaked logits, so greedy decoding is stable against rounding differences
    between compute paths (full prefill versus a prefix-cache hit).
    The global torch RNG state is left unchanged.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _train_tokenizer(seed, vocab_size)
    config = LlamaConfig(**_common(tokenizer, max_position_embeddings, initializer_range))
    return _save(path, seed, tokenizer, LlamaForCausalLM, config)


def build_tiny_mistral(path: Path, *, seed: int = 0, vocab_size: int = 512,
                       sliding_window: int = SLIDING_WINDOW, initializer_range: float = 0.2) -> Path:
    """A Mistral whose every layer attends to the last ``sliding_window`` tokens (as :func:`build_tiny_llama`)."""
    from transformers import MistralConfig, MistralForCausalLM

    tokenizer = _train_tokenizer(seed, vocab_size)
    config = MistralConfig(**_common(tokenizer, 4096, initializer_range), sliding_window=sliding_window)
    return _save(path, seed, tokenizer, MistralForCausalLM, config)


def build_tiny_gemma3(path: Path, *, seed: int = 0, vocab_size: int = 512,
                      sliding_window: int = SLIDING_WINDOW, initializer_range: float = 0.2) -> Path:
    """A Gemma-3 text model: layer 0 sliding-window, layer 1 full attention (as :func:`build_tiny_llama`)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tokenizer = _train_tokenizer(seed, vocab_size)
    config = Gemma3TextConfig(**_common(tokenizer, 4096, initializer_range), sliding_window=sliding_window,
                              layer_types=["sliding_attention", "full_attention"])
    return _save(path, seed, tokenizer, Gemma3ForCausalLM, config)


def build_tiny_deepseek(path: Path, *, seed: int = 0, vocab_size: int = 512, initializer_range: float = 0.2) -> Path:
    """A DeepSeek-V3 with MLA (kv_lora_rank 512 + rope 64: vLLM's CPU MLA size), dense layers, bfloat16."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    tokenizer = _train_tokenizer(seed, vocab_size)
    common = _common(tokenizer, 4096, initializer_range)
    del common["head_dim"]  # MLA's head sizes are the three below
    common.update(num_key_value_heads=NUM_HEADS, dtype="bfloat16")
    config = DeepseekV3Config(**common, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=HEAD_DIM,
                              v_head_dim=HEAD_DIM, q_lora_rank=None, rope_scaling=None,
                              first_k_dense_replace=NUM_LAYERS,  # no MoE layer; the router fields stay unused
                              n_routed_experts=2, num_experts_per_tok=1, n_group=1, topk_group=1,
                              moe_intermediate_size=HIDDEN_SIZE)
    return _save(path, seed, tokenizer, DeepseekV3ForCausalLM, config)
