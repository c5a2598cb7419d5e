"""A chat with a Hugging Face model whose conversation KV lives in kvkit's GPU and CPU tiers.

Several users chat with one randomly initialised Llama-style model (built from
a config, nothing is downloaded). Each turn's prompt is the user's whole
history plus a new message. The GPU tier holds about two of the three
conversations, so by a user's next turn the others have pushed part or all of
theirs out: kvkit reuses what the GPU tier kept, loads the rest back from the
CPU tier (earlier replies included: their KV is stored as the prompts' is), and
computes only the new message and the tail of the history's last, partial
block. Per turn it prints the prompt tokens reused from each tier, the tokens
computed, the time to first token with kvkit and with a full recompute, and
checks the answer against ``model.generate`` on the whole history::

    python examples/hf_multiturn.py                 # CPU, about half a minute
    python examples/hf_multiturn.py --sample        # sampling through model.generate
    python examples/hf_multiturn.py --device cuda   # the same on a GPU

Every hit is loaded (``planner="load-all"``), so the computed tokens are
exactly what no tier held; ``--planner overlap`` lets kvkit's load planner
recompute part of a hit instead where it judges that faster (its first hit
from the CPU tier is a one-block probe), and those tokens count as computed.

With ``--sample`` each reply is sampled (temperature 0.8, top-p 0.9) by
``model.generate`` on the restored cache, under one seed per turn, and
checked against ``model.generate`` alone on the same seed. It ends with
``identical: True`` when every generated token equals ``model.generate``'s,
and prints the largest logit difference.
"""

from __future__ import annotations

import argparse

import torch
import transformers

from kvkit.integrations.hf import OffloadedLM, generate_without_offload


def build_model(device: str, *, layers: int = 4, hidden: int = 512, vocab: int = 2048) -> torch.nn.Module:
    """A seeded random Llama-style model (float32; logits span a few units at this init scale)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192, initializer_range=0.1)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(device).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--users", type=int, default=3)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system-tokens", type=int, default=768, help="first message of each user")
    parser.add_argument("--message-tokens", type=int, default=48, help="each later message")
    parser.add_argument("--reply-tokens", type=int, default=12)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--sample", action="store_true", help="sample the replies through model.generate")
    parser.add_argument("--planner", default="load-all", choices=["load-all", "overlap"],
                        help="which blocks of a hit to load (load-all: every one)")
    args = parser.parse_args()
    decoding = {"do_sample": True, "temperature": 0.8, "top_p": 0.9} if args.sample else {"do_sample": False}
    sampling = transformers.GenerationConfig(**decoding) if args.sample else None  # None: kvkit's greedy loop

    model = build_model(args.device)
    vocab = model.config.vocab_size
    longest = args.system_tokens + (args.turns - 1) * (args.message_tokens + args.reply_tokens)
    gpu_blocks = 2 * -(-longest // args.block_size)  # about two conversations of three
    # prefix-lru evicts a conversation from its end, so the GPU tier keeps the start of some.
    lm = OffloadedLM.build(model, gpu_blocks=gpu_blocks, block_size=args.block_size,
                           cpu_blocks=2 * args.users * gpu_blocks, gpu_eviction="prefix-lru",
                           store="eager", copy="torch", planner=args.planner)
    print(f"GPU tier: {gpu_blocks} blocks of {args.block_size} tokens ({gpu_blocks * args.block_size} "
          f"tokens, about two conversations) on {args.device}; CPU tier: {lm.stack.cpu.num_blocks} blocks")
    generate_without_offload(model, list(range(3, 3 + args.message_tokens)), 2)  # warm-up
    print(f"{'turn':>4} {'user':>4} {'prompt':>6} {'GPU tier':>8} {'CPU tier':>8} {'computed':>8} "
          f"{'TTFT kvkit':>10} {'recompute':>9} {'saved':>8}")

    g = torch.Generator().manual_seed(1)
    chats = [lm.conversation() for _ in range(args.users)]
    identical, worst, generated, saved_total = True, 0.0, 0, 0.0
    follow_up_computed = 0  # the most any follow-up turn computed
    for turn in range(args.turns):
        for user, chat in enumerate(chats):
            n = args.system_tokens if turn == 0 else args.message_tokens
            message = torch.randint(3, vocab, (n,), generator=g).tolist()
            prompt = chat.history + message
            seed = 1000 * turn + user
            torch.manual_seed(seed)  # the same seed for kvkit and for generate
            # Stops at EOS, as generate does.
            result = chat.send(message, args.reply_tokens, keep_logits=True, generation_config=sampling)
            recompute = generate_without_offload(model, prompt, 1)  # time to first token without kvkit
            torch.manual_seed(seed)
            reference = model.generate(torch.tensor([prompt], device=model.device), **decoding,
                                       max_new_tokens=args.reply_tokens, output_logits=True,
                                       return_dict_in_generate=True)
            ref_tokens = reference.sequences[0, len(prompt):].tolist()
            ref_logits = torch.stack([x[0] for x in reference.logits]).float().cpu()
            identical &= ref_tokens == list(result.tokens)
            rows = min(len(ref_logits), len(result.logits))
            worst = max(worst, float((ref_logits[:rows] - result.logits[:rows]).abs().max()))
            generated += len(result.tokens)
            if turn:
                follow_up_computed = max(follow_up_computed, result.computed_tokens)
            saved = recompute.ttft_s - result.ttft_s
            saved_total += saved
            print(f"{turn:>4} {user:>4} {result.prompt_tokens:>6} {result.gpu_hit_tokens:>8} "
                  f"{result.cpu_hit_tokens:>8} {result.computed_tokens:>8} {result.ttft_s * 1e3:>8.1f}ms "
                  f"{recompute.ttft_s * 1e3:>7.1f}ms {saved * 1e3:>6.1f}ms")

    lm.engine.drain()
    stats = lm.stack.stats
    print(f"reused {stats.gpu_hit_tokens.value} tokens from the GPU tier and {stats.cpu_hit_tokens.value} "
          f"from the CPU tier of {stats.query_tokens.value} prompt tokens; time to first token saved in "
          f"total: {saved_total:.2f} s")
    print(f"follow-up turns computed at most {follow_up_computed} tokens each (a {args.message_tokens}-token "
          f"message, and the rest of the history's last {args.block_size}-token block)")
    print(f"identical: {identical} (largest logit difference {worst:.2e} over {generated} generated tokens)")
    lm.close()


if __name__ == "__main__":
    main()
