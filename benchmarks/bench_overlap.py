"""First token of a follow-up whose prefix sits in a shared store behind a slow link: load, recompute or overlap.

A seeded, randomly initialised Hugging Face Llama (``--shapes``: small
float32 shapes on the CPU by default, or a 7-8B model's shapes on a GPU) runs
real forward passes. A *writer* instance prefills a context of ``--context``
tokens; its blocks go through its CPU tier into the shared store: an
in-process one, or (``--store valkey``) a Valkey server started on loopback.
A *reader* instance, with its own GPU and CPU tiers (emptied before every
measurement), answers a follow-up turn: the context plus ``--new-tokens``
fresh tokens. The reader's store is the writer's behind
:class:`ThrottledStore`, a link of a given bandwidth: each fetch takes
``bytes / bandwidth`` before the store's own fetch starts. Three load planners:

* **load**: every hit block fetched and loaded, then the new tokens computed
  (``load-all``: an engine without a planner);
* **recompute**: every hit block recomputed (a planner that declines all);
* **overlap**: kvkit's default planner: the hit's head is computed while its
  tail is fetched and loaded, where its own estimates say they meet.

Steps: measure recompute and unthrottled load; the *crossover* bandwidth B is
where load-only would take as long as recompute (``fetched bytes /
(recompute - unthrottled load)``). Then with the store alone (no throttle) and
at ``B/10``, ``B`` and ``10 B`` each
planner's time to first token, the median of ``--repeats`` repeats (the
three planners interleaved within each repeat). The overlap's planner is a
fresh one per bandwidth, warmed first as a serving engine's would be: one
fresh prompt of the context's length, which misses every tier (it learns the
model's prefill speed from it), then ``--warmup`` follow-ups (it learns the
link). The overlap's first-token logits are compared with a full
recompute's (``generate_without_offload``).

    python benchmarks/bench_overlap.py --json out.json
    python benchmarks/bench_overlap.py --context 4096 --repeats 7
    python benchmarks/bench_overlap.py --device cuda --shapes qwen-7b --dtype bfloat16 --store valkey \
        --context 32768

When unthrottled loading is not faster than recomputing, there is no crossover
and only the store-alone row is measured. The logits check holds in float32
(``TOL``); in bfloat16 the first token is compared and the largest logit
difference reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import statistics
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import transformers

from kvkit.backends.blockstore.memory import MemoryStore
from kvkit.backends.plan import LoadAllPlanner, OverlapPlanner
from kvkit.integrations.hf import OffloadedLM, generate_without_offload
from kvkit.interfaces import LoadPlan
from kvkit.interfaces.shared import BlockStore
from kvkit.shared import open_block_store
from kvkit.testing.servers import LocalServer

SHAPES = {
    "small": {"num_hidden_layers": 8, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 8,
              "head_dim": 64, "intermediate_size": 1536, "vocab_size": 4096},
    # Llama-3-8B: 128 KiB of bfloat16 KV a token
    "llama-8b": {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256},
    # Qwen2.5-7B's attention (4 KV heads): 56 KiB of bfloat16 KV a token, the compute of a 7.6 B model
    "qwen-7b": {"num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
                "head_dim": 128, "intermediate_size": 18944, "vocab_size": 152064},
}
TOL = 5e-4  # float32 logits, as docs/huggingface.md and tests/integrations/test_hf.py hold a restored prefill to


class ThrottledStore:
    """A ``BlockStore`` in front of another whose fetches cross a link of ``gbps`` (10**9 bytes/s): each ``get``
    waits ``bytes / bandwidth`` before the values arrive. ``contains``, ``put`` and ``poll`` pass through."""

    def __init__(self, inner: BlockStore, gbps: float, owned: bool = False) -> None:
        self.inner, self.gbps, self.owned = inner, gbps, owned

    def contains(self, keys: Sequence[bytes]) -> int:
        return self.inner.contains(keys)

    def put(self, keys: Sequence[bytes], values: Sequence[Sequence[memoryview]]) -> int:
        return self.inner.put(keys, values)

    def get(self, keys: Sequence[bytes], buffers: Sequence[Sequence[memoryview]]) -> int:
        if self.gbps != float("inf"):
            time.sleep(sum(b.nbytes for parts in buffers for b in parts) / (self.gbps * 1e9))
        return self.inner.get(keys, buffers)

    def poll(self, tickets: Collection[int], timeout: float = 0.0) -> list:
        return self.inner.poll(tickets, timeout)

    def close(self) -> None:
        """Closes the inner store only if it is this reader's own connection."""
        if self.owned:
            self.inner.close()

    def check_invariants(self) -> None:
        self.inner.check_invariants()


class RecomputePlanner(LoadAllPlanner):
    """Recomputes every hit block: the follow-up as if nothing were cached."""

    def plan(self, query: Any) -> LoadPlan:
        return LoadPlan(0, 0, query.hit_blocks)


def build_model(shapes: dict[str, int], device: str, dtype: torch.dtype) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**shapes, max_position_embeddings=65536)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reader(model: Any, store: Any, planner: Any, blocks: int, bs: int) -> OffloadedLM:
    return OffloadedLM.build(model, gpu_blocks=blocks, block_size=bs, cpu_blocks=blocks, shared=store,
                             planner=planner, model_name="bench-overlap")


def follow_up(lm: OffloadedLM, prompt: list[int]) -> Any:
    """One follow-up from the shared tier alone: both of the reader's own tiers emptied first."""
    lm.clear_gpu_cache()
    lm.engine.reset_cpu_tier()
    lm.engine.drain()
    return lm.generate(prompt, 1, keep_logits=True, stop_tokens=())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2048, help="context tokens in the shared store")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=4,
                        help="follow-ups that teach each overlap planner the link, after one fresh prompt")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="small", help="the model's shapes")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--store", choices=("memory", "valkey"), default="memory",
                        help="the shared store: in-process, or a Valkey server started on loopback")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        if args.store == "valkey":
            server = stack.enter_context(LocalServer())
            measure(args, lambda: open_block_store(server.url), owned=True)
        else:
            memory = MemoryStore()
            measure(args, lambda: memory, owned=False)


def measure(args: argparse.Namespace, open_store: Callable[[], Any], owned: bool) -> None:
    """The whole measurement over stores from ``open_store`` (each reader's own when ``owned``)."""
    bs, ctx_len, new = args.block_size, args.context, args.new_tokens
    shapes, dtype = SHAPES[args.shapes], getattr(torch, args.dtype)
    torch.set_grad_enabled(False)
    model = build_model(shapes, args.device, dtype)
    blocks = -(-(ctx_len + new) // bs) + 8
    context = _tokens(ctx_len, 1, shapes["vocab_size"])
    writer = OffloadedLM.build(model, gpu_blocks=blocks, block_size=bs, cpu_blocks=blocks, shared=open_store(),
                               model_name="bench-overlap")
    writer.generate(context, 1, stop_tokens=())
    stats = writer.stack.stats
    for _ in range(100):  # its stores, then their puts into the shared tier (deferred ones go in later steps)
        writer.engine.step()
        writer.engine.drain()
        if stats.blocks_put.value >= ctx_len // bs:
            break
    assert stats.blocks_put.value >= ctx_len // bs, {k: v for k, v in stats.as_dict().items() if "put" in k}
    prompts = iter(context + _tokens(new, 100 + i, shapes["vocab_size"]) for i in range(10**6))

    def link(gbps: float) -> ThrottledStore:
        return ThrottledStore(open_store(), gbps, owned)

    def run(planner: Any, gbps: float, n: int) -> list[Any]:
        lm = reader(model, link(gbps), planner, blocks, bs)
        try:
            return [follow_up(lm, next(prompts)) for _ in range(n)]
        finally:
            lm.close()

    generate_without_offload(model, next(prompts), 1)  # warm-up
    recompute = statistics.median(g.ttft_s for g in run(RecomputePlanner(), math.inf, args.repeats))
    fast = run(LoadAllPlanner(), math.inf, args.repeats)
    fetched = ctx_len // bs * writer.stack.config.kv.bytes_per_block
    assert all(g.cpu_hit_tokens == ctx_len // bs * bs for g in fast), [g.cpu_hit_tokens for g in fast]
    load_floor = statistics.median(g.ttft_s for g in fast)
    crossover = fetched / (recompute - load_floor) / 1e9 if recompute > load_floor else None
    print(f"context {ctx_len} tokens ({fetched / 2**20:.1f} MiB fetched): recompute {recompute * 1e3:.1f} ms, "
          f"unthrottled load {load_floor * 1e3:.1f} ms; crossover "
          + (f"{crossover * 1e3:.1f} MB/s" if crossover else "none (loading is never faster)"))

    bandwidths = [("store", math.inf)]
    if crossover is not None:
        bandwidths += [("B/10", crossover / 10), ("B", crossover), ("10B", crossover * 10)]
    rows = []
    for label, gbps in bandwidths:
        overlap = OverlapPlanner()
        lm = reader(model, link(gbps), overlap, blocks, bs)
        try:
            follow_up(lm, _tokens(ctx_len, 2 + len(rows), shapes["vocab_size"]))  # a miss: the prefill speed
            for _ in range(args.warmup):
                follow_up(lm, next(prompts))
            times: dict[str, list[float]] = {"load": [], "recompute": [], "overlap": []}
            plans = []
            for _ in range(args.repeats):
                times["load"] += [g.ttft_s for g in run(LoadAllPlanner(), gbps, 1)]
                times["recompute"] += [g.ttft_s for g in run(RecomputePlanner(), gbps, 1)]
                prompt = next(prompts)
                turn = follow_up(lm, prompt)
                times["overlap"].append(turn.ttft_s)
                plans.append((turn.cpu_hit_tokens, turn.prompt_tokens - turn.computed_tokens))
            ref = generate_without_offload(model, prompt, 1, keep_logits=True, stop_tokens=())
            dlogit = float((turn.logits.float() - ref.logits.float()).abs().max())
            estimates = dict(lm.stack.manager.planner.estimates())
        finally:
            lm.close()
        med = {k: statistics.median(v) for k, v in times.items()}
        best = min(med["load"], med["recompute"])
        row = {"bandwidth": label, "gbps": None if gbps == math.inf else gbps,
               **{f"{k}_ttft_s": v for k, v in med.items()},
               **{f"{k}_runs_s": v for k, v in times.items()},
               "overlap_vs_best": med["overlap"] / best, "overlap_vs_load": med["overlap"] / med["load"],
               "overlap_vs_recompute": med["overlap"] / med["recompute"],
               "load_vs_recompute": med["load"] / med["recompute"], "overlap_loaded_tokens": plans,
               "first_token_equal": int(turn.logits[0].argmax()) == int(ref.logits[0].argmax()),
               "recompute_top2_margin": float(ref.logits[0].float().topk(2).values.diff().abs()),
               "max_abs_dlogit": dlogit, "planner": estimates}
        rows.append(row)
        rate = "store alone" if gbps == math.inf else f"{gbps * 1e3:8.1f} MB/s"
        print(f"{label:>5} {rate}: load {med['load'] * 1e3:7.1f} ms, recompute "
              f"{med['recompute'] * 1e3:7.1f} ms, overlap {med['overlap'] * 1e3:7.1f} ms "
              f"({row['overlap_vs_best']:.2f}x the better; loaded {plans[-1][0]} of {ctx_len} tokens); "
              f"max |dlogit| vs recompute {dlogit:.2g}")
    writer.close()
    at = {r["bandwidth"]: r for r in rows}
    logits_ok = all(r["first_token_equal"] and (dtype != torch.float32 or r["max_abs_dlogit"] <= TOL) for r in rows)
    checks = {"logits_within_tolerance": logits_ok}
    if crossover is not None:
        checks.update({
            "crossover_within_20pct": abs(at["B"]["load_vs_recompute"] - 1) <= 0.2,
            "overlap_at_B_le_0.75x_best": at["B"]["overlap_vs_best"] <= 0.75,
            "overlap_at_10B_within_10pct_of_load": at["10B"]["overlap_vs_load"] <= 1.1,
            "overlap_at_B/10_within_10pct_of_recompute": at["B/10"]["overlap_vs_recompute"] <= 1.1,
        })
    print("checks: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in checks.items()))
    if args.json:
        out = {"date": time.strftime("%Y-%m-%d"), "machine": platform.node(), "processor": platform.processor(),
               "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
               "threads": torch.get_num_threads(), "torch": torch.__version__,
               "transformers": transformers.__version__, "shapes": args.shapes, "dtype": args.dtype,
               "store": args.store, "context": ctx_len, "new_tokens": new,
               "block_size": bs, "repeats": args.repeats, "fetched_bytes": fetched, "recompute_ttft_s": recompute,
               "unthrottled_load_ttft_s": load_floor, "crossover_gbps": crossover, "rows": rows, "checks": checks}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
