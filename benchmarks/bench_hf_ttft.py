"""Time to first token of a follow-up turn: prefix restored from kvkit's CPU tier versus recomputed.

A randomly initialised Hugging Face Llama model (Llama-3-8B shapes by default:
32 layers, hidden 4096, 32 heads, 8 KV heads, head dim 128, MLP 14336, vocab
128256), bf16, SDPA attention, built directly on the GPU. Per context length
``C`` (a multiple of the block size):

1. turn 1: the model prefills ``C`` context tokens through
   :class:`~kvkit.integrations.hf.OffloadedLM`; its blocks are stored to the
   CPU tier (drained before timing);
2. **restore**: the GPU tier is cleared (``clear_gpu_cache``), then a
   follow-up turn of the context plus ``--new-tokens`` fresh tokens runs: the
   ``C`` context tokens are loaded from the CPU tier, restored into the model's
   ``DynamicCache`` and only the new tokens are prefilled. Its phases:
   ``load`` (hash, lookup, allocation, CPU->GPU copy, until the blocks are
   usable), ``restore`` (blocks -> cache object), ``prefill`` (new tokens,
   their KV into blocks, first token);
   then the same follow-up again **pipelined** (``lm.engine.layered``): each
   layer's load overlaps the forward pass of the layers before it;
3. **gpu hit**: the same follow-up with the prefix still in the GPU tier;
4. **recompute**: ``generate_without_offload`` on the same follow-up prompt
   (one prefill of ``C + new`` tokens from an empty cache).

Every TTFT ends with the first token's logits on the host (device
synchronised). Medians of ``--repeats`` runs, each follow-up with different new
tokens. The first follow-up's first-token logits are compared with the
recompute's and with a **chunked** control without kvkit: ``transformers``
alone prefills the context into its own cache, then the new tokens. In bf16
one-shot and chunked prefills differ by round-off; the restored turn should
equal the chunked control, since kvkit hands the model the same KV bytes.

    python benchmarks/bench_hf_ttft.py --contexts 8192,32768 --copy torch,auto --json out.json
    python benchmarks/bench_hf_ttft.py --tiny --device cpu           # shapes for a CPU smoke run
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
import time
from typing import Any

import torch
import transformers

from kvkit import COPY, hash_blocks
from kvkit.integrations.hf import OffloadedLM, generate_without_offload

LLAMA3_8B = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
             "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256}
TINY = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 32, "intermediate_size": 512, "vocab_size": 1024}


def build_model(shapes: dict[str, int], device: str, dtype: torch.dtype, max_len: int) -> Any:
    """A seeded random Llama model made on ``device`` in ``dtype`` (no download, no CPU copy)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**shapes, max_position_embeddings=max_len)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def chunked_logits(model: Any, context: list[int], new: list[int]) -> tuple[torch.Tensor, float]:
    """Last logits of ``context + new`` with ``transformers`` alone, prefilled in two chunks.

    Also the seconds of the second chunk (``new`` on a cache holding ``context``,
    until its first token is on the host): the floor under any restored TTFT.
    """
    params = inspect.signature(model.forward).parameters
    cache = {"cache" if "cache" in params else "past_key_values": transformers.DynamicCache(config=model.config)}
    with torch.no_grad():
        for chunk in (context, new):
            _sync(str(model.device.type))
            start = time.perf_counter()
            ids = torch.tensor([chunk], device=model.device)
            logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache).logits[0, -1]
            int(logits.argmax())
    return logits.float().cpu(), time.perf_counter() - start


def _median(runs: list[Any], field: str) -> float:
    return statistics.median(getattr(r, field) for r in runs)


def bench_context(lm: OffloadedLM, model: Any, context: int, new: int, repeats: int, seed: int) -> dict:
    """Turn 1, then restore / GPU-hit / (recompute by the caller) follow-ups for one context length."""
    vocab = model.config.vocab_size
    ctx = _tokens(context, vocab, seed)
    first = lm.generate(ctx, 1, stop_tokens=())
    lm.engine.drain()
    restores, pipelined, hits = [], [], []
    for rep in range(repeats):
        # Whole, then layered, each on new tokens of its own (a repeat would hit the first one's stored blocks).
        for layered, runs, salt in ((False, restores, 1), (True, pipelined, 501)):
            lm.engine.layered = layered
            lm.clear_gpu_cache()
            runs.append(lm.generate(ctx + _tokens(new, vocab, seed + salt + rep), 1, keep_logits=True, stop_tokens=()))
        hits.append(lm.generate(ctx + _tokens(new, vocab, seed + 1000 + rep), 1, stop_tokens=()))
        lm.engine.drain()
    assert all(r.cpu_hit_tokens == context and r.gpu_hit_tokens == 0 for r in restores + pipelined), restores
    assert all(h.gpu_hit_tokens == context for h in hits), hits
    start = time.perf_counter()
    hash_blocks(ctx + _tokens(new, vocab, seed), lm.stack.config.kv.block_size)
    hash_s = time.perf_counter() - start
    kv_bytes = context // lm.stack.config.kv.block_size * lm.stack.config.kv.bytes_per_block
    load = _median(restores, "load_s")
    return {
        "context": context, "new_tokens": new, "turn1_ttft_s": first.ttft_s,
        "restore_ttft_s": _median(restores, "ttft_s"), "restore_load_s": load,
        "restore_restore_s": _median(restores, "restore_s"), "restore_prefill_s": _median(restores, "prefill_s"),
        "hash_s": hash_s, "loaded_bytes": kv_bytes, "load_gbps": kv_bytes / load / 1e9,
        "gpu_hit_ttft_s": _median(hits, "ttft_s"), "restore_runs_s": [r.ttft_s for r in restores],
        "pipelined_ttft_s": _median(pipelined, "ttft_s"), "pipelined_runs_s": [r.ttft_s for r in pipelined],
        "_restores": restores, "_pipelined": pipelined,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="8192,32768", help="comma-separated context lengths")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--copy", default="torch", help="comma-separated copy backends ('auto', 'torch'...)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layout", default="per-layer")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke run)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    contexts = [int(c) for c in args.contexts.split(",")]
    copies = []
    for copy in args.copy.split(","):
        why = COPY.why_unavailable(copy)
        if why is None:
            copies.append(copy)
        else:
            print(f"skip copy={copy!r}: {why}")
    dtype = getattr(torch, args.dtype)
    bs, new, reps = args.block_size, args.new_tokens, args.repeats
    longest = max(contexts) + new
    started = time.perf_counter()
    model = build_model(TINY if args.tiny else LLAMA3_8B, args.device, dtype, longest + 64)
    _sync(args.device)
    print(f"model built in {time.perf_counter() - started:.1f} s: "
          f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params, {dtype}, {args.device}")
    generate_without_offload(model, _tokens(min(contexts), model.config.vocab_size, 7), 1)  # warm-up

    # The GPU tier holds the longest follow-up; the CPU tier every context and follow-up.
    gpu_blocks = -(-longest // bs) + 4
    cpu_blocks = sum(-(-(c + 2 * new * reps) // bs) for c in contexts) + 8
    results: dict[str, Any] = {"machine": platform.node(), "device": torch.cuda.get_device_name()
                               if args.device == "cuda" else platform.processor(),
                               "torch": torch.__version__, "transformers": transformers.__version__,
                               "dtype": args.dtype, "block_size": bs, "layout": args.layout, "runs": []}
    recompute: dict[int, tuple[float, torch.Tensor, torch.Tensor]] = {}
    piped_refs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # the pipelined follow-up's one-shot and chunked
    floor: dict[int, float] = {}  # transformers alone: the new tokens on a cache it filled itself
    for c in contexts:
        ctx, fresh = _tokens(c, model.config.vocab_size, c), _tokens(new, model.config.vocab_size, c + 1)
        runs = [generate_without_offload(model, ctx + fresh, 1, keep_logits=True, stop_tokens=())
                for _ in range(reps)]
        chunked = [chunked_logits(model, ctx, _tokens(new, model.config.vocab_size, c + 1 + 7 * i))
                   for i in range(reps)]
        recompute[c] = (_median(runs, "ttft_s"), runs[0].logits[0], chunked[0][0])
        floor[c] = statistics.median(t for _, t in chunked)
        other = _tokens(new, model.config.vocab_size, c + 501)
        piped_refs[c] = (generate_without_offload(model, ctx + other, 1, keep_logits=True, stop_tokens=()).logits[0],
                         chunked_logits(model, ctx, other)[0])
        print(f"recompute {c + new} tokens: {recompute[c][0] * 1e3:.1f} ms; one-shot vs chunked prefill "
              f"without kvkit: max |dlogit| {float((recompute[c][1] - recompute[c][2]).abs().max()):.3g}; "
              f"transformers alone, {new} tokens on its own cache of {c}: {floor[c] * 1e3:.1f} ms")
    for copy in copies:
        lm = OffloadedLM.build(model, gpu_blocks=gpu_blocks, block_size=bs, layout=args.layout,
                               cpu_blocks=cpu_blocks, copy=copy)
        pinned = lm.stack.workers[0].mirror_pinned
        for c in contexts:
            r = bench_context(lm, model, c, new, reps, seed=c)
            restores, layered = r.pop("_restores"), r.pop("_pipelined")
            ttft, one_shot, chunked = recompute[c]
            got = restores[0].logits[0]  # the same follow-up tokens as the recompute runs
            piped = layered[0].logits[0]
            r.update(copy=copy, mirror_pinned=pinned, recompute_ttft_s=ttft, hf_alone_new_tokens_s=floor[c],
                     pipelined_vs_hf_alone=r["pipelined_ttft_s"] / floor[c],
                     speedup=ttft / r["restore_ttft_s"],
                     transfer_share=r["restore_load_s"] / r["restore_ttft_s"],
                     first_token_equal=int(got.argmax()) == int(one_shot.argmax()),
                     first_logits_max_abs_diff=float((got - one_shot).abs().max()),
                     first_logits_vs_chunked_max_abs_diff=float((got - chunked).abs().max()),
                     one_shot_vs_chunked_max_abs_diff=float((one_shot - chunked).abs().max()),
                     first_logits_scale=float(one_shot.abs().max()),
                     pipelined_speedup=ttft / r["pipelined_ttft_s"],
                     pipelined_vs_gpu_hit=r["pipelined_ttft_s"] / r["gpu_hit_ttft_s"],
                     pipelined_first_token_equal=int(piped.argmax()) == int(piped_refs[c][0].argmax()),
                     pipelined_vs_chunked_max_abs_diff=float((piped - piped_refs[c][1]).abs().max()))
            results["runs"].append(r)
            print(f"copy={copy:6s} context {c:6d}: restore {r['restore_ttft_s'] * 1e3:7.1f} ms "
                  f"(load {r['restore_load_s'] * 1e3:.1f} = {r['transfer_share']:.0%}, {r['load_gbps']:.1f} GB/s; "
                  f"restore {r['restore_restore_s'] * 1e3:.1f}; prefill {r['restore_prefill_s'] * 1e3:.1f}) "
                  f"vs recompute {ttft * 1e3:7.1f} ms -> {r['speedup']:.1f}x; "
                  f"GPU hit {r['gpu_hit_ttft_s'] * 1e3:.1f} ms; "
                  f"first token equal {r['first_token_equal']}, max |dlogit| {r['first_logits_max_abs_diff']:.3g} "
                  f"of {r['first_logits_scale']:.3g} (vs chunked: {r['first_logits_vs_chunked_max_abs_diff']:.3g})")
            print(f"copy={copy:6s} context {c:6d}: pipelined {r['pipelined_ttft_s'] * 1e3:7.1f} ms -> "
                  f"{r['pipelined_speedup']:.1f}x recompute, {r['pipelined_vs_gpu_hit']:.2f}x GPU hit, "
                  f"{r['pipelined_vs_hf_alone']:.2f}x transformers alone; first token "
                  f"equal {r['pipelined_first_token_equal']}, vs chunked max |dlogit| "
                  f"{r['pipelined_vs_chunked_max_abs_diff']:.3g}")
        lm.close()
    print(f"total {time.perf_counter() - started:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
