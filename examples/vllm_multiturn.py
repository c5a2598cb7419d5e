"""Serve multi-turn conversations with kvkit's CPU tier under vLLM.

Each turn sends every conversation's whole history (earlier prompts, the
model's answers, a new user message) as token ids. vLLM's own KV pool is kept
small (``--gpu-blocks``), so by the next turn it has evicted most earlier
turns; kvkit's CPU tier loads them back instead of recomputing them. Per turn
it prints the prompt tokens vLLM computed, the tokens its own prefix cache
served, and the tokens kvkit loaded::

    python examples/vllm_multiturn.py --model Qwen/Qwen2.5-0.5B-Instruct
    python examples/vllm_multiturn.py --model PATH --no-kvkit   # the same run without kvkit

vLLM runs in its default multiprocess mode (``--in-process`` keeps the engine
in this process). ``--json PATH`` also writes the turns, with every generated
token, to a JSON file for comparisons.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

WORDS = ("the", "cache", "block", "token", "model", "memory", "prefix", "turn", "answer", "query",
         "fast", "small", "again", "layer", "reads", "writes", "keeps", "loads", "stores", "why")


@dataclass
class Turn:
    """What one turn of every conversation cost."""

    turn: int
    prompt_tokens: int = 0
    computed_tokens: int = 0  # prompt tokens vLLM ran the model on
    vllm_cached_tokens: int = 0  # served by vLLM's own prefix cache
    kvkit_loaded_tokens: int = 0  # loaded from kvkit's CPU tier
    kvkit_reloaded_tokens: int = 0  # loaded again after vLLM preempted a request
    seconds: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)


def make_llm(model: str, *, kvkit: bool = True, gpu_blocks: int = 10, block_size: int = 32,
             max_model_len: int = 256, cpu_bytes: str = "4MiB", cpu_eviction: str = "lru",
             store: str = "eager", copy: str = "torch", dtype: str = "float32", seed: int = 0,
             max_num_seqs: int = 8, extra_config: dict[str, Any] | None = None, kv_role: str = "kv_both",
             **engine_args: Any) -> Any:
    """A vLLM engine whose KV pool holds ``gpu_blocks`` blocks, with kvkit's connector if ``kvkit``.

    ``extra_config`` replaces the ``kv_connector_extra_config`` built from the other arguments;
    ``kv_role`` is vLLM's (``kv_consumer`` loads and never stores); ``engine_args`` go to ``vllm.LLM`` as they are.
    """
    from vllm import LLM
    from vllm.config import KVTransferConfig

    extra: dict[str, Any] = {}
    if kvkit:
        if extra_config is None:
            extra_config = {"cpu_bytes": cpu_bytes, "cpu_eviction": cpu_eviction, "store": store, "copy": copy}
        extra["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVKitConnector", kv_connector_module_path="kvkit.integrations.vllm",
            kv_role=kv_role, kv_connector_extra_config=extra_config)
    return LLM(model=model, tokenizer=model, dtype=dtype, block_size=block_size, seed=seed,
               enable_prefix_caching=True, enforce_eager=True, max_model_len=max_model_len,
               max_num_seqs=max_num_seqs, num_gpu_blocks_override=gpu_blocks,
               kv_cache_memory_bytes=gpu_blocks * (1 << 20),  # on CPU: do not reserve 90 % of RAM
               **extra, **engine_args)


def user_messages(tokenizer: Any, num_conversations: int, num_turns: int, words: int,
                  seed: int = 0) -> list[list[list[int]]]:
    """Seeded user messages as token ids: ``[conversation][turn]``."""
    rng = random.Random(seed)
    return [[tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(words)) + "?",
                              add_special_tokens=False)
             for _ in range(num_turns)] for _ in range(num_conversations)]


def serve(llm: Any, messages: list[list[list[int]]], max_tokens: int = 16) -> list[Turn]:
    """Run every conversation turn by turn (all conversations of a turn in one batch)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    histories = [[] for _ in messages]
    turns = []
    for t in range(len(messages[0])):
        prompts = [history + conv[t] for history, conv in zip(histories, messages)]
        start = time.perf_counter()
        results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               use_tqdm=False)
        turn = Turn(t + 1, seconds=time.perf_counter() - start)
        for i, (prompt, res) in enumerate(zip(prompts, results)):
            kv = res.kv_transfer_params or {}
            loaded = kv.get("kvkit_loaded_tokens", 0)
            turn.prompt_tokens += len(prompt)
            turn.computed_tokens += len(prompt) - res.num_cached_tokens
            turn.vllm_cached_tokens += res.num_cached_tokens - loaded
            turn.kvkit_loaded_tokens += loaded
            turn.kvkit_reloaded_tokens += kv.get("kvkit_reloaded_tokens", 0)
            out = list(res.outputs[0].token_ids)
            turn.outputs.append(out)
            histories[i] = prompt + out
        turns.append(turn)
    return turns


def print_table(turns: list[Turn]) -> None:
    """One line per turn: where its prompt tokens came from."""
    print(f"{'turn':>4} {'prompt':>7} {'computed':>9} {'vLLM cache':>11} {'kvkit':>7} {'seconds':>8}")
    for t in turns:
        print(f"{t.turn:>4} {t.prompt_tokens:>7} {t.computed_tokens:>9} {t.vllm_cached_tokens:>11} "
              f"{t.kvkit_loaded_tokens:>7} {t.seconds:>8.2f}")
    reloaded = sum(t.kvkit_reloaded_tokens for t in turns)
    if reloaded:
        print(f"kvkit also reloaded {reloaded} tokens of requests vLLM preempted and resumed")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face model id or local path")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--words", type=int, default=12, help="words per user message")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn")
    ap.add_argument("--gpu-blocks", type=int, default=10, help="vLLM's KV pool, in blocks")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--cpu-bytes", default="4MiB", help="kvkit's CPU tier per worker")
    ap.add_argument("--cpu-eviction", default="lru")
    ap.add_argument("--store", default="eager")
    ap.add_argument("--copy", default="torch")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-kvkit", action="store_true", help="run without the connector")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="workers, one shard each (on CPU set VLLM_CPU_OMP_THREADS_BIND, e.g. '0|1')")
    ap.add_argument("--in-process", action="store_true", help="no engine subprocesses")
    ap.add_argument("--json", metavar="PATH", help="also write the turns as JSON to PATH")
    args = ap.parse_args(argv)
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = make_llm(args.model, kvkit=not args.no_kvkit, gpu_blocks=args.gpu_blocks,
                   block_size=args.block_size, max_model_len=args.max_model_len,
                   cpu_bytes=args.cpu_bytes, cpu_eviction=args.cpu_eviction, store=args.store,
                   copy=args.copy, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size)
    messages = user_messages(llm.get_tokenizer(), args.conversations, args.turns, args.words)
    turns = serve(llm, messages, args.max_tokens)
    print_table(turns)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"turns": [asdict(t) for t in turns]}, f)


if __name__ == "__main__":  # vLLM's multiprocess mode spawns: keep the guard
    main()
