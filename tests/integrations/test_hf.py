"""The Hugging Face integration: multi-turn generation on kvkit's tiers gives the model's own answers.

Models are small, randomly initialised from a config (no downloads), float32
on the CPU, with weights 10x the default init scale so that logits span about
+-6 and depend strongly on every cached key (at the default scale attention is
nearly uniform and a wrong block barely shows). The reference is
``model.generate`` (greedy) on the whole conversation, which recomputes every
prompt from scratch.

Logit tolerance: kvkit changes *how* the prompt's KV is computed, not what.
Without kvkit the prompt is one prefill; with it, the prefix's KV comes from
blocks written by earlier prefills of other lengths and only the suffix's
queries run. Different matrix shapes make BLAS and SDPA accumulate in another
order, so float32 round-off differs: the largest difference seen here is
about 1.2e-5 (2e-6 of the logit range). ``TOL = 5e-4`` allows 40x that for
other CPUs and BLAS builds, and is still ~500x below what one wrong block
does (a corrupted key block moves logits by ~0.2;
:func:`test_a_corrupted_cpu_block_changes_the_logits` checks the comparison
catches it). In bfloat16 on a GPU round-off is ~1e-2 relative (BENCHMARKS.md).
"""

import pytest

transformers = pytest.importorskip("transformers")

import copy
import functools

import hypothesis.strategies as st
import torch
from hypothesis import given, settings
from packaging.version import Version

from kvkit.backends.plan import LoadAllPlanner, OverlapPlanner
from kvkit.errors import ConfigError, HashInputError, KVKitError, OutOfBlocksError, UnsupportedModelError
from kvkit.integrations.hf import OffloadedLM, generate_without_offload, kv_spec_from_config, model_fingerprint
from kvkit.interfaces import GroupKind, LoadPlan

_build = functools.partial(OffloadedLM.build, planner="load-all")
"""``OffloadedLM.build`` loading every hit: these tests check restored turns, so their hits must not depend on
the timings a load planner learns (the planner's own tests pass one)."""

TOL = 5e-4
VOCAB = 512
_SHAPES = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
           "initializer_range": 0.2}


def _model(family: str, seed: int = 0, **overrides):
    """A seeded, randomly initialised float32 causal LM of ``family``."""
    configs = {
        "llama": (transformers.LlamaConfig, {}),
        # Hybrid: layers 0-1 full attention, 2-3 a 24-token sliding window (two KV groups).
        "qwen2": (transformers.Qwen2Config,
                  {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 2}),
        # Every layer a 24-token sliding window (one sliding KV group).
        "mistral": (transformers.MistralConfig, {"sliding_window": 24}),
    }
    cls, extra = configs[family]
    torch.manual_seed(seed)
    config = cls(**{**_SHAPES, **extra, **overrides})
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def models():
    """One model per family, built once for the module."""
    return {f: _model(f) for f in ("llama", "qwen2", "mistral")}


def _user_turns(n: int, length: int = 23, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length,), generator=g).tolist() for _ in range(n)]


def _messages(users: int, turns: int) -> list[list[int]]:
    """Per turn and user: a 100-token first message (a system prompt, say), then 23-token ones."""
    return _user_turns(users, 100) + _user_turns(users * (turns - 1), 23, seed=2)


def _reference(model, prompt, max_new_tokens):
    """Greedy tokens and per-token logits of ``model.generate`` on the whole prompt."""
    out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=max_new_tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.stack([x[0] for x in out.logits]).float().cpu()


def _chat(lm, model, users: int = 3, turns: int = 5, max_new_tokens: int = 6, generation_config=None):
    """Interleave ``users`` conversations for ``turns`` turns; check each turn against greedy generate."""
    chats = [lm.conversation() for _ in range(users)]
    messages = _messages(users, turns)
    worst = 0.0
    for t in range(turns):
        for u, chat in enumerate(chats):
            prompt = chat.history + messages[t * users + u]
            turn = chat.send(messages[t * users + u], max_new_tokens, keep_logits=True,
                             generation_config=generation_config)
            tokens, logits = _reference(model, prompt, max_new_tokens)
            assert list(turn.tokens) == tokens, (t, u)
            worst = max(worst, float((turn.logits - logits).abs().max()))
    assert worst <= TOL, worst
    lm.engine.drain()
    lm.check_invariants()
    for chat in chats:
        chat.check_invariants()
    assert lm.engine.leaked_blocks() == 0
    return chats


def test_llama_turns_restored_from_the_cpu_tier_match_generate(models):
    """Five turns of three users on a GPU tier of one conversation: later turns load from CPU, same answers."""
    model = models["llama"]
    lm = _build(model, gpu_blocks=28, block_size=8, cpu_blocks=200)
    chats = _chat(lm, model)
    for chat in chats:
        assert chat.turns[0].cpu_hit_tokens == chat.turns[0].gpu_hit_tokens == 0
        assert all(turn.cpu_hit_tokens > 0 for turn in chat.turns[1:]), [t.cpu_hit_tokens for t in chat.turns]
        assert all(turn.computed_tokens < turn.prompt_tokens for turn in chat.turns[1:])
    assert lm.stack.stats.cpu_hit_tokens.value > 0


@pytest.mark.parametrize(("family", "tier", "config"), [
    ("llama", "gpu", None),
    ("llama", "cpu", transformers.GenerationConfig(do_sample=False)),
    ("qwen2", "cpu", None),
    ("mistral", "cpu", None),
], ids=["llama-gpu-loop", "llama-cpu-generate", "qwen2-cpu-loop", "mistral-cpu-loop"])
def test_a_follow_up_computes_only_its_message_and_the_last_partial_block(models, family, tier, config):
    """The reply's KV is kept like the prompt's: over a 4-turn chat each follow-up computes at most its new
    message plus one block (the history's partial last block), from the GPU tier (one KV group) or, cleared,
    the CPU tier, full and sliding-window layers alike; tokens and logits equal a full recompute's."""
    model, bs = models[family], 8
    lm = _build(model, gpu_blocks=64, block_size=bs, cpu_blocks=400)
    chat = lm.conversation()
    for t, message in enumerate(_user_turns(4, 23, seed=5)):
        prompt = chat.history + message
        turn = chat.send(message, 12, keep_logits=True, stop_tokens=None if config else (),
                         generation_config=config)
        tokens, logits = _reference(model, prompt, 12)
        assert list(turn.tokens) == tokens and float((turn.logits - logits).abs().max()) <= TOL
        if t:
            assert turn.computed_tokens <= len(message) + bs, (t, turn)
            hit = turn.gpu_hit_tokens if tier == "gpu" else turn.cpu_hit_tokens
            assert hit == turn.prompt_tokens - turn.computed_tokens
        if tier == "cpu":
            lm.clear_gpu_cache()
    _check_clean(lm)
    assert lm.stack.stats.blocks_stored.value >= (len(chat.history) - 1) // bs  # the replies' blocks too


def test_beam_search_keeps_the_prompts_blocks_only_and_a_full_gpu_tier_skips_the_reply(models):
    """Beams' decode steps are not the reply's KV: the next turn recomputes the reply. A GPU tier with no
    block to spare for the reply leaves it unkept and the turn as it was."""
    model, bs = models["llama"], 8
    lm = _build(model, gpu_blocks=64, block_size=bs, cpu_blocks=400)
    beams = lm.conversation()
    first, second = _user_turns(2, 23, seed=6)
    config = transformers.GenerationConfig(num_beams=2, do_sample=False)
    beams.send(first, 12, generation_config=config)
    turn = beams.send(second, 12, generation_config=config)
    assert turn.computed_tokens == len(beams.history) - len(turn.tokens) - (len(first) // bs) * bs
    small = _build(model, gpu_blocks=-(-(len(first) + 1) // bs), block_size=bs, cpu_blocks=400)
    reply = small.conversation().send(first, 12, stop_tokens=())
    assert list(reply.tokens) == _reference(model, first, 12)[0]
    assert small.stack.stats.blocks_stored.value == len(first) // bs  # the prompt's full blocks only
    _check_clean(lm, small)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_sliding_window_models_match_generate(models, family):
    """Hybrid (full + sliding) and all-sliding models reuse cached prefixes longer than their window."""
    model = models[family]
    spec = kv_spec_from_config(model.config, block_size=8, dtype=model.dtype)
    assert any(g.kind is GroupKind.SLIDING_WINDOW and g.window == 24 for g in spec.groups)
    lm = _build(model, gpu_blocks=28 * len(spec.groups), block_size=8, cpu_blocks=200)
    chats = _chat(lm, model)
    assert all(t.gpu_hit_tokens + t.cpu_hit_tokens > 24 for c in chats for t in c.turns[2:])
    assert lm.stack.stats.cpu_hit_tokens.value > 0


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_pipelined_restores_match_generate(models, family):
    """Layer-by-layer restores (each layer restored as the forward pass reaches it) give generate's answers."""
    model = models[family]
    spec = kv_spec_from_config(model.config, block_size=8, dtype=model.dtype)
    lm = _build(model, gpu_blocks=28 * len(spec.groups), block_size=8, cpu_blocks=200, pipelined=True)
    assert lm.engine.layered
    chats = _chat(lm, model, turns=3)
    assert all(turn.cpu_hit_tokens > 0 for chat in chats for turn in chat.turns[1:])


def test_pipelined_passes_without_a_load_teach_the_planner_the_prefill_speed(models):
    """Pipelined, a pass that loaded nothing is pure compute: the load planner observes it (else it would load every
    hit forever, however slow the tier); a pass that waited on loads is not observed."""
    lm = _build(models["llama"], gpu_blocks=28, block_size=8, cpu_blocks=200, pipelined=True, planner="overlap")
    planner = lm.stack.manager.planner
    assert planner.compute_seconds(1, 0) is None
    first = lm.generate(_user_turns(1, length=40)[0], 1, stop_tokens=())
    assert first.cpu_hit_tokens == 0 and planner.compute_seconds(1, 0) is not None


class _LoadAllLearning(OverlapPlanner):
    """Learns as the default planner does, and loads every hit."""

    def plan(self, query):
        return LoadPlan.load_all(query.hit_blocks)


@pytest.mark.parametrize("shared", [False, True], ids=["layered-load", "shared-tier"])
def test_a_pipelined_pass_is_observed_unless_it_waited_on_layered_loads(models, shared):
    """A restored turn's pass is the planner's observation of compute when its loads landed before it (with a
    shared tier, a step fetches, then loads whole), not when it read them layer by layer as they landed."""
    from kvkit.backends.blockstore.memory import MemoryStore

    store = MemoryStore() if shared else None
    prompt = _user_turns(1, length=40)[0]
    lm = _build(models["llama"], gpu_blocks=28, block_size=8, cpu_blocks=200, shared=store, pipelined=True,
                planner=_LoadAllLearning())
    if shared:  # another instance computed the prompt into the store
        writer = _build(models["llama"], gpu_blocks=28, block_size=8, cpu_blocks=200, shared=store)
        writer.generate(prompt, 1, stop_tokens=())
        writer.engine.step()  # the puts of the stores its finish flushed
        writer.engine.drain()
    else:  # its own CPU tier holds the prompt, gone from its GPU
        lm.generate(prompt, 1, stop_tokens=())
        lm.clear_gpu_cache()
    before = lm.stack.manager.planner.estimates()["prefill_samples"]
    turn = lm.generate([*prompt, 5, 6], 1, stop_tokens=())
    assert turn.cpu_hit_tokens > 0 and lm.engine.layered
    assert lm.stack.manager.planner.estimates()["prefill_samples"] == before + shared


def test_pipelined_beam_search_repeats_each_late_layer_like_the_others(models):
    """Beams expand the cache before later layers are restored: those are repeated per beam too."""
    model = models["llama"]
    lm = _build(model, gpu_blocks=28, block_size=8, cpu_blocks=200, pipelined=True)
    chats = _sampled_chat(lm, model, transformers.GenerationConfig(num_beams=3), turns=3, max_new_tokens=4)
    assert all(turn.cpu_hit_tokens > 0 for chat in chats for turn in chat.turns[1:])


def test_pipelined_is_off_on_cpu_by_default_and_checked(models):
    """Pipelining defaults to CUDA only; ``pipelined`` must be a bool or None."""
    assert not _build(models["llama"], gpu_blocks=8, block_size=8, cpu_blocks=8).engine.layered
    with pytest.raises(ConfigError, match="pipelined='yes'"):
        _build(models["llama"], gpu_blocks=8, block_size=8, cpu_blocks=8, pipelined="yes")


@pytest.mark.parametrize("layout", ["per-layer", "blocks-first", "cross-layer", "vllm-cpu"])
def test_every_kv_layout_gives_the_same_answers(models, layout):
    """The model reads and writes blocks correctly in every kvkit layout."""
    model = models["llama"]
    lm = _build(model, gpu_blocks=40, block_size=4, cpu_blocks=200, layout=layout)
    chats = _chat(lm, model, turns=3, max_new_tokens=3)
    assert chats[0].turns[-1].cpu_hit_tokens > 0


def test_the_gpu_tier_alone_gives_the_same_answers(models):
    """With a GPU tier holding every conversation and the `never` store policy, hits are GPU-only."""
    model = models["llama"]
    lm = _build(model, gpu_blocks=100, block_size=8, cpu_blocks=200, store="never")
    chats = _chat(lm, model, turns=3)
    assert all(t.cpu_hit_tokens == 0 for c in chats for t in c.turns)
    assert all(t.gpu_hit_tokens > 0 for c in chats for t in c.turns[1:])


def test_a_corrupted_cpu_block_changes_the_logits(models):
    """The tolerance is meaningful: one wrong restored block moves the logits far beyond TOL."""
    model = models["llama"]
    lm = _build(model, gpu_blocks=20, block_size=8, cpu_blocks=200)
    chat = lm.conversation()
    first, second = _user_turns(2)
    chat.send(first, 4)
    lm.clear_gpu_cache()  # drains the stores, then forgets the GPU copies
    lm.stack.workers[0].cpu_kv[1][0].add_(0.5)  # the K of layer 1 in every CPU block
    prompt = chat.history + second
    turn = chat.send(second, 4, keep_logits=True)
    assert turn.cpu_hit_tokens > 0 and turn.gpu_hit_tokens == 0
    _, logits = _reference(model, prompt, 4)
    assert float((turn.logits[0] - logits[0]).abs().max()) > 100 * TOL


# Each example runs up to 8 generations; 50 keep the ci profile near 10 s on 2 cores.
@settings(max_examples=min(settings.default.max_examples, 50))
@given(family=st.sampled_from(["llama", "qwen2"]), block_size=st.sampled_from([1, 3, 8, 16]),
       lengths=st.lists(st.integers(1, 30), min_size=2, max_size=4), max_new_tokens=st.integers(1, 4),
       slack=st.integers(0, 8), clear=st.booleans())
def test_any_conversation_matches_full_recompute(models, family, block_size, lengths, max_new_tokens, slack,
                                                 clear):
    """For any turn lengths, block size and GPU pool size, tokens and logits equal a full recompute."""
    model = models[family]
    groups = len(kv_spec_from_config(model.config).groups)
    longest = sum(lengths) + max_new_tokens * (len(lengths) - 1)
    gpu_blocks = (-(-longest // block_size) + slack) * groups
    lm = _build(model, gpu_blocks=gpu_blocks, block_size=block_size, cpu_blocks=4 * gpu_blocks)
    chat = lm.conversation()
    g = torch.Generator().manual_seed(sum(lengths))
    for n in lengths:
        message = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        prompt = chat.history + message
        turn = chat.send(message, max_new_tokens, keep_logits=True, stop_tokens=())
        ref = generate_without_offload(model, prompt, max_new_tokens, keep_logits=True, stop_tokens=())
        assert turn.tokens == ref.tokens
        assert float((turn.logits - ref.logits).abs().max()) <= TOL
        assert turn.computed_tokens >= 1 and (turn.gpu_hit_tokens + turn.cpu_hit_tokens) % block_size == 0
        if clear:
            lm.clear_gpu_cache()
    lm.engine.drain()
    lm.check_invariants()
    chat.check_invariants()
    assert lm.engine.leaked_blocks() == 0


class _SplitPlanner(LoadAllPlanner):
    """Recomputes the first half of every hit while the rest loads; with ``decline``, not the last quarter."""

    def __init__(self, decline: bool) -> None:
        self.decline = decline

    def plan(self, query):
        h = query.hit_blocks
        head = h // 2 if query.overlap else 0
        return LoadPlan(head, h - head - (h // 4 if self.decline else 0), h)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("decline", [False, True], ids=["head-tail", "head-tail-declined"])
def test_a_head_recomputed_while_the_tail_loads_gives_generates_answers(models, family, decline):
    """Plans that recompute each hit's head in a forward pass of its own (and decline its end): same tokens
    and logits as generate on the whole prompt."""
    model = models[family]
    groups = len(kv_spec_from_config(model.config, block_size=8).groups)
    lm = _build(model, gpu_blocks=28 * groups, block_size=8, cpu_blocks=200, planner=_SplitPlanner(decline))
    chats = _chat(lm, model, turns=3)
    later = [turn for chat in chats for turn in chat.turns[1:]]
    assert all(turn.head_tokens > 0 and turn.cpu_hit_tokens > 0 for turn in later), later
    assert lm.stack.stats.hit_tokens_overlapped.value == sum(turn.head_tokens for turn in later)


class _RecordingSplit(_SplitPlanner):
    """The split plans, recording every compute observation: (tokens, beside_loads)."""

    def __init__(self) -> None:
        super().__init__(decline=False)
        self.seen: list[tuple[int, bool]] = []

    def observe_compute(self, num_tokens, context_tokens, seconds, *, beside_loads=False):
        self.seen.append((num_tokens, beside_loads))


def test_a_heads_pass_is_observed_as_beside_its_loads_and_the_rest_as_alone(models):
    """A plan's head runs while the tail loads: its pass is observed beside_loads, the prompt's pass after the
    loads landed is not."""
    planner = _RecordingSplit()
    lm = _build(models["llama"], gpu_blocks=28, block_size=8, cpu_blocks=200, planner=planner)
    prompt = _user_turns(1, length=40)[0]
    lm.generate(prompt, 1, stop_tokens=())
    assert planner.seen and not any(beside for _, beside in planner.seen)
    lm.clear_gpu_cache()
    planner.seen.clear()
    turn = lm.generate([*prompt, 5, 6], 1, stop_tokens=())
    rest = turn.computed_tokens - turn.head_tokens
    assert turn.head_tokens > 0 and planner.seen == [(turn.head_tokens, True), (rest, False)]


def test_kv_spec_follows_the_config():
    """Layers, KV heads, head size, dtype and attention groups come from the model config."""
    config = transformers.Qwen2Config(**{**_SHAPES, "num_hidden_layers": 6, "head_dim": 32},
                                      use_sliding_window=True, sliding_window=64, max_window_layers=4)
    spec = kv_spec_from_config(config, block_size=32, dtype=torch.bfloat16)
    assert (spec.num_layers, spec.block_size, spec.num_kv_heads, spec.dtype) == (6, 32, 2, "bfloat16")
    assert spec.head_dim == 32
    assert [(g.layers, g.kind, g.window) for g in spec.groups] == [
        ((0, 1, 2, 3), GroupKind.FULL, None), ((4, 5), GroupKind.SLIDING_WINDOW, 64)]
    llama = kv_spec_from_config(transformers.LlamaConfig(**_SHAPES))
    assert llama.head_dim == 16 and len(llama.groups) == 1 and llama.dtype == "float32"


def test_an_unsupported_family_raises_a_typed_error():
    """A model family kvkit does not hold raises UnsupportedModelError naming it and the supported ones."""
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*llama"):
        kv_spec_from_config(config)
    assert issubclass(UnsupportedModelError, KVKitError) and issubclass(UnsupportedModelError, TypeError)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedModelError):
        _build(model, gpu_blocks=8, cpu_blocks=8)


def test_a_stack_that_does_not_fit_the_model_is_refused(models):
    """A stack shaped for another model, or built without a KV cache, raises ConfigError."""
    import kvkit

    model = models["llama"]
    other = kv_spec_from_config(models["qwen2"].config, dtype=torch.float32)
    with pytest.raises(ConfigError, match="does not fit"):
        OffloadedLM(model, kvkit.build(kv=other, gpu_blocks=8, cpu_blocks=8, layout="per-layer", device="cpu"))
    spec = kv_spec_from_config(model.config, dtype=torch.float32)
    with pytest.raises(ConfigError, match="one worker"):
        OffloadedLM(model, kvkit.build(kv=spec, gpu_blocks=8, cpu_blocks=8, device="cpu"))
    with pytest.raises(ConfigError, match="device='cuda'"):
        _build(model, gpu_blocks=8, cpu_blocks=8, device="cuda")


def test_build_takes_its_slots_from_stack_config(models):
    """``OffloadedLM.build``'s slots are StackConfig's: an unknown one or a missing gpu_blocks is one ConfigError
    listing every problem, with the valid slots; the KV spec is the model's."""
    model = models["llama"]
    with pytest.raises(ConfigError, match="did you mean 'gpu_blocks'") as info:
        _build(model, gpu_blcks=8, cpu_blocks=8, cpu_eviction="bogus")
    problems = " ".join(info.value.problems)
    assert "valid: kv, gpu_blocks" in problems and "gpu_blocks=None" in problems and "bogus" in problems
    with pytest.raises(ConfigError, match="the KV spec is the model's"):
        _build(model, kv=kv_spec_from_config(model.config), gpu_blocks=8, cpu_blocks=8)


def test_bad_requests_raise_and_leave_the_stack_clean(models):
    """Empty prompts, bad lengths and prompts larger than the GPU tier raise typed errors, leaking nothing."""
    lm = _build(models["llama"], gpu_blocks=4, block_size=4, cpu_blocks=16)
    with pytest.raises(ConfigError, match="at least one token"):
        lm.generate([], 2)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        lm.generate([5, 6], 0)
    with pytest.raises(OutOfBlocksError, match="more than the whole GPU pool"):
        lm.generate(list(range(3, 40)), 2)
    with pytest.raises(ConfigError, match="sequence of ints"):
        lm.generate([5, 6.5], 2)
    for bad in (2**63, -1, 2**31):
        with pytest.raises(ConfigError, match=rf"token ids must be ints in \[0, 2\*\*31\), got {bad}"):
            lm.generate([5, bad], 2)
    assert lm.generate([5, 6, 7], 2, stop_tokens=()).tokens
    lm.engine.drain()
    lm.check_invariants()
    assert lm.engine.leaked_blocks() == 0 and lm.engine.num_waiting == 0


# --- two models on one stack: keyed by the model's identity ---------------------------------------------------


def _reused(turn) -> int:
    return turn.gpu_hit_tokens + turn.cpu_hit_tokens


def _check_clean(*lms) -> None:
    for lm in lms:
        lm.engine.drain()
        lm.check_invariants()
        assert lm.engine.leaked_blocks() == 0


def test_two_models_on_one_stack_never_reuse_each_others_kv(models):
    """Another model's blocks, on the GPU or the CPU tier, are never a hit: its answers are its own."""
    first, second = models["llama"], _model("llama", seed=1)
    lm = _build(first, gpu_blocks=40, block_size=4, cpu_blocks=200)
    other = OffloadedLM(second, lm.stack)
    assert other.model_id != lm.model_id
    prompts = _user_turns(2, 37)
    assert [_reused(lm.generate(p, 3)) for p in prompts] == [0, 0]
    for i, prompt in enumerate(prompts):  # the first model's blocks on both tiers, then on the CPU tier only
        if i:
            lm.clear_gpu_cache()
        turn = other.generate(prompt, 3, keep_logits=True, stop_tokens=())
        ref = generate_without_offload(second, prompt, 3, keep_logits=True, stop_tokens=())
        assert _reused(turn) == 0 and turn.tokens == ref.tokens
        assert float((turn.logits - ref.logits).abs().max()) <= TOL
    assert _reused(lm.generate(prompts[1] + [3], 3)) == 36  # the first model's own blocks still serve it
    _check_clean(lm, other)


def test_the_same_model_wrapped_twice_reuses_its_kv(models):
    """The same model object, or a copy of it, on one stack finds the blocks the first one cached."""
    model = models["llama"]
    lm = _build(model, gpu_blocks=40, block_size=4, cpu_blocks=200)
    prompt = _user_turns(1, 37)[0]
    lm.generate(prompt, 3)
    for twin in (model, copy.deepcopy(model)):
        again = OffloadedLM(twin, lm.stack)
        assert again.model_id == lm.model_id
        turn = again.generate([*prompt, 7], 3, keep_logits=True, stop_tokens=())
        ref = generate_without_offload(model, [*prompt, 7], 3, keep_logits=True, stop_tokens=())
        assert _reused(turn) == 36 and turn.tokens == ref.tokens
        assert float((turn.logits - ref.logits).abs().max()) <= TOL
        _check_clean(lm, again)


def test_one_user_given_name_makes_two_models_share_kv(models):
    """``model_name`` replaces the weights fingerprint: equal names share blocks (the caller's responsibility)."""
    first, second = models["llama"], _model("llama", seed=1)
    lm = _build(first, gpu_blocks=40, block_size=4, cpu_blocks=200, model_name="tiny-llama@r1")
    prompt = _user_turns(1, 37)[0]
    lm.generate(prompt, 3)
    shared = OffloadedLM(second, lm.stack, model_name="tiny-llama@r1")
    apart = OffloadedLM(second, lm.stack, model_name="tiny-llama@r2")
    assert shared.model_id == lm.model_id != apart.model_id
    assert _reused(shared.generate([*prompt, 3], 2)) == 36
    assert _reused(apart.generate([*prompt, 4], 2)) == 0
    _check_clean(lm, shared, apart)


def test_the_fingerprint_follows_config_dtype_and_weights(models):
    """Equal models digest equally; a changed sampled weight, config value or dtype changes the digest."""
    model = models["llama"]
    base = model_fingerprint(model)
    twin = copy.deepcopy(model)
    assert model_fingerprint(twin) == base and len(base) == 64
    with torch.no_grad():
        twin.model.layers[2].self_attn.k_proj.weight[0, 0] += 1.0  # the first element is always sampled
    assert model_fingerprint(twin) != base
    other_config = _model("llama", rope_theta=5000.0)
    assert model_fingerprint(other_config) != base
    assert model_fingerprint(copy.deepcopy(model).to(torch.float16)) != base
    named = model_fingerprint(model, model_name="m")
    assert named == model_fingerprint(_model("llama", seed=1), model_name="m") != base
    assert named != model_fingerprint(model, model_name="n")


def test_a_model_without_weights_in_memory_needs_a_name():
    """Weights on the meta device cannot be fingerprinted: ConfigError, unless a name identifies the model."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**_SHAPES))
    with pytest.raises(ConfigError, match=r"meta device.*model_name="):
        model_fingerprint(model)
    assert len(model_fingerprint(model, model_name="llama-on-meta")) == 64


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"model_name": ""}, ConfigError, "model_name='': must be a non-empty str"),
    ({"model_name": 7}, ConfigError, "model_name=7"),
    ({"cache_salt": [1]}, HashInputError, "extra_keys must be a tuple, got \\[1\\]"),
    ({"cache_salt": (True,)}, HashInputError, "got True"),
])
def test_a_bad_name_or_salt_is_refused_at_construction(models, kwargs, error, message):
    """A bad model_name or cache_salt raises its typed error when the wrapper is made, not at the first turn."""
    lm = _build(models["llama"], gpu_blocks=8, block_size=4, cpu_blocks=16)
    with pytest.raises(error, match=message):
        OffloadedLM(models["llama"], lm.stack, **kwargs)
    with pytest.raises(error, match=message):
        _build(models["llama"], gpu_blocks=8, block_size=4, cpu_blocks=16, **kwargs)
    assert lm.generate([5, 6, 7], 1).tokens  # the stack serves the next call


# --- decoding through model.generate with a GenerationConfig ----------------------------------------------------

SAMPLING = transformers.GenerationConfig(do_sample=True, temperature=1.5, top_p=0.9, top_k=0)


def _tokenizer():
    """A byte-level BPE tokenizer of VOCAB tokens, trained here on random ASCII (no download)."""
    from tokenizers import ByteLevelBPETokenizer

    g = torch.Generator().manual_seed(3)
    letters = "abcdefghijklmnop "
    text = ["".join(letters[i] for i in torch.randint(len(letters), (2000,), generator=g)) for _ in range(20)]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(text, vocab_size=VOCAB, min_frequency=1, show_progress=False)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
    assert len(tokenizer) == VOCAB
    return tokenizer


def _with(config, **changes):
    """A copy of ``config`` with ``changes``."""
    config = copy.deepcopy(config)
    config.update(**changes)
    return config


def _sampled_chat(lm, model, config, *, users: int = 3, turns: int = 4, max_new_tokens: int = 6):
    """Interleaved chats decoded by ``generate`` under ``config``; each turn equals ``model.generate`` on one seed."""
    chats = [lm.conversation() for _ in range(users)]
    messages = _messages(users, turns)
    for t in range(turns):
        for u, chat in enumerate(chats):
            message, seed = messages[t * users + u], 1000 * t + u
            prompt = torch.tensor([chat.history + message], device=model.device)
            torch.manual_seed(seed)
            turn = chat.send(message, max_new_tokens, generation_config=config)
            torch.manual_seed(seed)
            ref = model.generate(prompt, generation_config=_with(config, max_new_tokens=max_new_tokens))
            assert list(turn.tokens) == ref[0, prompt.shape[1]:].tolist(), (t, u)
    _check_clean(lm)
    return chats


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_sampled_turns_restored_from_the_cpu_tier_match_generate_on_the_same_seed(models, family):
    """Sampling (temperature, top-p) through kvkit gives model.generate's tokens for the seed, CPU hits included."""
    model = models[family]
    groups = len(kv_spec_from_config(model.config).groups)
    lm = _build(model, gpu_blocks=28 * groups, block_size=8, cpu_blocks=200)
    chats = _sampled_chat(lm, model, SAMPLING)
    last = chats[0].turns[-1]
    greedy, _ = _reference(model, chats[0].history[:last.prompt_tokens], len(last.tokens))
    assert list(last.tokens) != greedy  # the config really sampled
    for chat in chats:
        assert all(turn.cpu_hit_tokens > 0 for turn in chat.turns[1:]), [t.cpu_hit_tokens for t in chat.turns]
        assert all(turn.computed_tokens < turn.prompt_tokens for turn in chat.turns[1:])


@pytest.mark.parametrize(("family", "config"), [
    ("llama", transformers.GenerationConfig(num_beams=3)),
    ("mistral", transformers.GenerationConfig(num_beams=3)),
    ("llama", transformers.GenerationConfig(num_beams=2, do_sample=True, temperature=1.5, length_penalty=0.5)),
], ids=["llama-beam-search", "mistral-beam-search", "llama-beam-sample"])
def test_beam_search_on_the_restored_cache_matches_generate(models, family, config):
    """Beams expand and reorder the restored cache (full and sliding-window layers) as generate's own."""
    model = models[family]
    lm = _build(model, gpu_blocks=28, block_size=8, cpu_blocks=200)
    chats = _sampled_chat(lm, model, config, turns=3, max_new_tokens=4)
    assert all(turn.cpu_hit_tokens > 0 for chat in chats for turn in chat.turns[1:])


@pytest.mark.parametrize("config", [
    transformers.GenerationConfig(do_sample=False),
    pytest.param(transformers.GenerationConfig(do_sample=False, prefill_chunk_size=5),
                 marks=pytest.mark.skipif(Version(transformers.__version__) < Version("5.21"),
                                          reason="chunked prefill continues a cache from transformers 5.21")),
], ids=["greedy", "chunked-prefill"])
def test_greedy_through_generate_equals_the_greedy_loop(models, config):
    """Greedy ``generate`` on the restored cache gives the loop's tokens, logits and hits;
    what it stored serves later turns."""
    model = models["qwen2"]
    loop, through = (_build(model, gpu_blocks=56, block_size=8, cpu_blocks=200) for _ in range(2))
    chats = (loop.conversation(), through.conversation())
    for message in _messages(1, 4):
        a = chats[0].send(message, 5, keep_logits=True)
        b = chats[1].send(message, 5, keep_logits=True, generation_config=config)
        assert a.tokens == b.tokens and (a.gpu_hit_tokens, a.cpu_hit_tokens) == (b.gpu_hit_tokens, b.cpu_hit_tokens)
        assert float((a.logits - b.logits).abs().max()) <= TOL
        assert b.ttft_s == pytest.approx(b.load_s + b.restore_s + b.prefill_s)
        loop.clear_gpu_cache()  # the next turn restores what each stored, from the CPU tier
        through.clear_gpu_cache()
    assert all(turn.cpu_hit_tokens > 0 for turn in chats[1].turns[1:])
    _check_clean(loop, through)


def test_greedy_through_generate_matches_generate_over_a_conversation(models):
    """The conversation check of the greedy loop, decoded by generate: tokens and logits equal generate's."""
    model = models["llama"]
    lm = _build(model, gpu_blocks=28, block_size=8, cpu_blocks=200)
    chats = _chat(lm, model, turns=3, generation_config=transformers.GenerationConfig(do_sample=False))
    assert all(turn.cpu_hit_tokens > 0 for chat in chats for turn in chat.turns[1:])


def test_stop_strings_stop_generation(models):
    """A stop string (which needs the tokenizer) ends the reply where model.generate's ends."""
    model, tokenizer = models["llama"], _tokenizer()
    lm = _build(model, gpu_blocks=40, block_size=8, cpu_blocks=200)
    chat = lm.conversation()
    first, second = _user_turns(2)
    chat.send(first, 4)
    prompt = chat.history + second
    free, _ = _reference(model, prompt, 12)
    at = next(i for i in range(1, 12) if tokenizer.decode(free[i]).strip().isalpha())  # a printable token
    stop = tokenizer.decode(free[at])
    config = transformers.GenerationConfig(stop_strings=[stop], max_new_tokens=12)
    turn = chat.send(second, generation_config=config, tokenizer=tokenizer)
    ref = model.generate(torch.tensor([prompt]), generation_config=config, tokenizer=tokenizer)
    assert list(turn.tokens) == ref[0, len(prompt):].tolist()
    assert len(turn.tokens) <= at + 1 < 12 and tokenizer.decode(list(turn.tokens)).endswith(stop)
    assert turn.gpu_hit_tokens + turn.cpu_hit_tokens > 0
    _check_clean(lm)


def _state(lm, chat):
    """What a refused call must not change: counters, both pools, the engine, the history and torch's RNG."""
    gpu, cpu = lm.stack.gpu, lm.stack.cpu
    return (lm.stack.stats.as_dict(), gpu.num_free, cpu.num_free, [gpu.refcount(b) for b in range(gpu.num_blocks)],
            lm.engine.num_waiting, list(chat.history), len(chat.turns), torch.random.get_rng_state())


GC = transformers.GenerationConfig


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"generation_config": GC(do_sample=True, temperature=0.0)}, "generate refuses.*temperature"),
    ({"generation_config": GC(do_sample=True, top_k=-1)}, "generate refuses.*top_k"),
    ({"generation_config": GC(num_beams=0)}, "num_beams=0: must be an int >= 1"),
    ({"generation_config": GC(num_beams=2, num_return_sequences=2)}, "num_return_sequences=2: a turn has one reply"),
    ({"generation_config": GC(num_beams=4, num_beam_groups=2, diversity_penalty=1.0)},
     "'group_beam_search' decoding; kvkit runs \\['greedy_search', 'sample', 'beam_search', 'beam_sample'\\]"),
    ({"generation_config": GC(num_beams=2, force_words_ids=[[5]])}, "'constrained_beam_search' decoding"),
    ({"generation_config": GC(prompt_lookup_num_tokens=3)}, "'assisted_generation' decoding"),
    ({"generation_config": GC(cache_implementation="static")}, "cache_implementation='static'.*must be None"),
    ({"generation_config": GC(use_cache=False)}, "use_cache=False"),
    ({"generation_config": GC(num_beams=2), "keep_logits": True}, "keep_logits=True with num_beams=2"),
    ({"generation_config": GC(stop_strings=["ab"])}, "stop_strings=\\['ab'\\] need the model's tokenizer"),
    ({"generation_config": GC(use_cache=False, num_beams=2, num_return_sequences=2)}, "2 configuration problems"),
    ({"generation_config": {"do_sample": True}}, "must be a transformers.GenerationConfig"),
    ({"generation_config": GC(do_sample=True), "stop_tokens": ()}, "stop_tokens=\\(\\) with a generation_config"),
    ({"tokenizer": object()}, "tokenizer= serves the stop_strings"),
    ({"generation_config": GC(do_sample=True), "max_new_tokens": 0}, "max_new_tokens"),
])
def test_a_generation_config_kvkit_cannot_run_is_refused_and_changes_nothing(models, kwargs, message):
    """Bad or unsupported decoding settings raise ConfigError before the stack, the history or the RNG moves."""
    lm = _build(models["llama"], gpu_blocks=20, block_size=8, cpu_blocks=200)
    chat = lm.conversation()
    first, second = _user_turns(2)
    chat.send(first, 3)
    lm.clear_gpu_cache()  # the next turn's prefix is on the CPU tier only
    before = _state(lm, chat)
    with pytest.raises(ConfigError, match=message):
        chat.send(second, **{"max_new_tokens": 3, **kwargs})
    after = _state(lm, chat)
    assert before[:-1] == after[:-1] and torch.equal(before[-1], after[-1])
    turn = chat.send(second, 3, generation_config=SAMPLING)
    kept = (len(first) + 3 - 1) // 8 * 8  # the first turn's prompt and the 2 reply tokens it ran, in full blocks
    assert turn.cpu_hit_tokens == kept and turn.gpu_hit_tokens == 0  # still served from the CPU tier
    _check_clean(lm)


def test_chunked_prefill_is_refused_where_transformers_restarts_the_prompt(models, monkeypatch):
    """Before transformers 5.21 a chunked prefill ignores the restored cache's length: ConfigError, naming both."""
    lm = _build(models["llama"], gpu_blocks=8, block_size=4, cpu_blocks=16)
    monkeypatch.setattr(transformers, "__version__", "5.20.0")
    with pytest.raises(ConfigError, match=r"prefill_chunk_size=5 needs transformers>=5.21.*installed: 5.20.0"):
        lm.generate([5, 6, 7], 2, generation_config=GC(prefill_chunk_size=5))
    _check_clean(lm)

@pytest.mark.gpu
@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "whole"])
def test_on_cuda_turns_restored_from_the_cpu_tier_match_generate(pipelined):
    """The same conversation check with the model and the GPU tier on a CUDA device (float32)."""
    model = _model("llama").to("cuda")
    lm = _build(model, gpu_blocks=28, block_size=8, cpu_blocks=200, pipelined=pipelined)
    assert lm.engine.layered is pipelined
    chats = _chat(lm, model)
    assert all(turn.cpu_hit_tokens > 0 for chat in chats for turn in chat.turns[1:])
    lm.close()


@pytest.mark.gpu
def test_on_cuda_sampled_turns_match_generate_on_the_same_seed():
    """Sampling through generate with the model and the GPU tier on CUDA: generate's tokens for each seed."""
    model = _model("llama").to("cuda")
    lm = _build(model, gpu_blocks=28, block_size=8, cpu_blocks=200)
    chats = _sampled_chat(lm, model, SAMPLING)
    assert all(turn.cpu_hit_tokens > 0 for chat in chats for turn in chat.turns[1:])
    lm.close()


@pytest.mark.parametrize(("split", "pipelined"), [(False, False), (True, False), (True, True)],
                         ids=["load-all", "head-tail", "head-tail-pipelined"])
def test_a_second_instance_restores_a_prefix_from_the_shared_tier(models, split, pipelined):
    """Two stacks sharing one store: the second answers from KV the first computed, as generate does; with a
    plan that recomputes each hit's head while the tail is fetched and loaded too, pipelined or not."""
    from kvkit.backends.blockstore.memory import MemoryStore

    model, store = models["llama"], MemoryStore()
    first = _build(model, gpu_blocks=40, block_size=4, cpu_blocks=200, shared=store)
    second = _build(model, gpu_blocks=40, block_size=4, cpu_blocks=200, shared=store, pipelined=pipelined,
                    **({"planner": _SplitPlanner(decline=False)} if split else {}))
    assert second.engine.overlaps
    prompt = _user_turns(1, 37)[0]
    first.generate(prompt, 3)
    first.engine.step()  # the puts of the stores its finish flushed
    first.engine.drain()
    turn = second.generate([*prompt, 7], 3, keep_logits=True, stop_tokens=())
    ref = generate_without_offload(model, [*prompt, 7], 3, keep_logits=True, stop_tokens=())
    head = 16 if split else 0  # 9 blocks of 4 found; a split recomputes the first 4
    assert (turn.head_tokens, turn.cpu_hit_tokens) == (head, 36 - head) and turn.tokens == ref.tokens
    assert second.stack.stats.shared_hit_tokens.value == 36 - head
    assert float((turn.logits - ref.logits).abs().max()) <= TOL
    _check_clean(second, second)
