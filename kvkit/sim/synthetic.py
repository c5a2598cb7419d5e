"""A seeded synthetic multi-turn chat workload, as Mooncake-style trace requests.

The model:

* Conversations arrive as a Poisson process (``conversations_per_s``).
* Each opens with one of ``num_system_prompts`` shared system prompts, chosen
  with a Zipf skew (prompt ``i`` has weight ``1 / (i + 1) ** system_prompt_skew``),
  so popular prompts share their leading blocks across many conversations.
* The number of turns is skewed too: ``k`` in ``1..max_turns`` with weight
  ``1 / k ** turns_skew`` (most chats are short, a few are long).
* Turn ``k``'s prompt is turn ``k - 1``'s prompt, plus its output, plus a new
  user message, so its ``hash_ids`` extend the previous turn's chain.
  User messages and outputs have log-normal lengths (``length_sigma``).
* Turns are spaced by exponential think times (``think_time_mean_s``; the gap
  covers generating the reply as well as the user's reading and typing).
* A conversation ends early before a turn whose prompt plus output would
  exceed ``max_context_tokens``; its first turn is clipped to fit instead.

Hash ids follow the Mooncake convention exactly: one id per block of
``block_size`` tokens (the last, partial block included), equal ids at equal
positions mean equal prefixes, a block whose content was not seen before gets
a fresh id, and ids are numbered in order of first appearance in the trace. A
partial block gets a fresh id, since its content differs from the full block
the next turn has at that position.

The default size (350 conversations: about 1,500 requests and 250,000 to
350,000 block references at 16-token blocks, over about 14 simulated minutes)
keeps a full simulation well within a minute on two cores. Larger
``block_size`` give proportionally fewer block references.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator

import attrs

from kvkit._renamed import renamed_keywords
from kvkit.config import DEFAULTS
from kvkit.errors import ConfigError
from kvkit.sim.traces import TraceRequest
from kvkit.validate import at_least, is_int, real_in

__all__ = ["SyntheticWorkload", "generate"]

_positive_int = at_least(1)
_positive_float = real_in(low=0, low_open=True, high=math.inf, high_open=True)  # finite and > 0
_skew = real_in(low=0, high=math.inf, high_open=True)  # finite and >= 0


@renamed_keywords(block_tokens="block_size")
@attrs.frozen
class SyntheticWorkload:
    """Parameters of a synthetic multi-turn workload; the same values give the same trace.

    Attributes:
        seed: seeds the generator; the only source of randomness.
        num_conversations: conversations in the trace.
        block_size: tokens per block the ``hash_ids`` are cut at (``block_tokens=``
            is its deprecated old name).
        conversations_per_s: Poisson arrival rate of new conversations.
        num_system_prompts: distinct shared system prompts.
        system_prompt_tokens: ``(low, high)`` bounds of a system prompt's
            length, drawn uniformly once per prompt (``low`` may be 0).
        system_prompt_skew: Zipf exponent of system-prompt popularity (0: uniform).
        max_turns: most turns a conversation has.
        turns_skew: Zipf exponent of the number of turns (0: uniform).
        user_tokens_mean: mean tokens of a user message.
        output_tokens_mean: mean tokens of a reply.
        length_sigma: log-normal shape of message and reply lengths.
        think_time_mean_s: mean gap between a conversation's turns, seconds.
        max_context_tokens: most tokens of prompt plus reply in one turn.
    """

    seed: int = attrs.field(default=0, validator=attrs.validators.instance_of(int))
    num_conversations: int = attrs.field(default=350, validator=_positive_int)
    block_size: int = attrs.field(default=DEFAULTS.block_size, validator=_positive_int)
    conversations_per_s: float = attrs.field(default=1.0, validator=_positive_float)
    num_system_prompts: int = attrs.field(default=8, validator=_positive_int)
    system_prompt_tokens: tuple[int, int] = attrs.field(default=(256, 3072), converter=tuple)
    system_prompt_skew: float = attrs.field(default=1.2, validator=_skew)
    max_turns: int = attrs.field(default=16, validator=_positive_int)
    turns_skew: float = attrs.field(default=1.0, validator=_skew)
    user_tokens_mean: float = attrs.field(default=200.0, validator=_positive_float)
    output_tokens_mean: float = attrs.field(default=250.0, validator=_positive_float)
    length_sigma: float = attrs.field(default=1.0, validator=_skew)
    think_time_mean_s: float = attrs.field(default=30.0, validator=_positive_float)
    max_context_tokens: int = attrs.field(default=32768, validator=_positive_int)

    @system_prompt_tokens.validator
    def _check_system_prompt_tokens(self, attribute: attrs.Attribute, value: tuple) -> None:
        if (len(value) != 2 or not all(is_int(v) for v in value)
                or not 0 <= value[0] <= value[1]):
            raise ConfigError(f"system_prompt_tokens must be (low, high) ints with "
                              f"0 <= low <= high, got {value!r}")

    def __attrs_post_init__(self) -> None:
        # Turn 1 is clipped to fit: it needs room for one user and one output token.
        if self.max_context_tokens < self.system_prompt_tokens[1] + 2:
            raise ConfigError(
                f"max_context_tokens={self.max_context_tokens} leaves no room after a "
                f"system prompt of up to {self.system_prompt_tokens[1]} tokens"
            )


@attrs.frozen
class _Turn:
    timestamp_ms: int
    conversation: int
    turn: int
    system_prompt: int
    input_length: int
    output_length: int


def _lognormal_tokens(rng: random.Random, mean: float, sigma: float) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # so the distribution's mean is `mean`
    return max(1, round(rng.lognormvariate(mu, sigma)))


def _draw(w: SyntheticWorkload) -> tuple[list[int], list[_Turn]]:
    """Draw the system prompts' lengths and every conversation's turns, in time order."""
    rng = random.Random(w.seed)
    low, high = w.system_prompt_tokens
    system_lengths = [rng.randint(low, high) for _ in range(w.num_system_prompts)]
    system_weights = list(itertools.accumulate(
        1 / (i + 1) ** w.system_prompt_skew for i in range(w.num_system_prompts)))
    turn_weights = list(itertools.accumulate(
        1 / k ** w.turns_skew for k in range(1, w.max_turns + 1)))
    turns: list[_Turn] = []
    start_s = 0.0
    for conv in range(w.num_conversations):
        start_s += rng.expovariate(w.conversations_per_s)
        system = rng.choices(range(w.num_system_prompts), cum_weights=system_weights)[0]
        num_turns = rng.choices(range(1, w.max_turns + 1), cum_weights=turn_weights)[0]
        context = system_lengths[system]  # tokens before this turn's user message
        at_s = start_s
        for turn in range(num_turns):
            user = _lognormal_tokens(rng, w.user_tokens_mean, w.length_sigma)
            output = _lognormal_tokens(rng, w.output_tokens_mean, w.length_sigma)
            if context + user + output > w.max_context_tokens:
                if turn > 0:
                    break
                user = min(user, w.max_context_tokens - context - 1)
                output = min(output, w.max_context_tokens - context - user)
            turns.append(_Turn(round(at_s * 1000), conv, turn, system, context + user, output))
            context += user + output
            at_s += rng.expovariate(1 / w.think_time_mean_s)
    turns.sort(key=lambda t: (t.timestamp_ms, t.conversation, t.turn))
    return system_lengths, turns


def generate(workload: SyntheticWorkload | None = None) -> Iterator[TraceRequest]:
    """Yield the requests of ``workload`` (default parameters if ``None``) in time order.

    Deterministic: the same workload (seed included) yields the same requests.
    ``line`` numbers the requests from 1, as :func:`~kvkit.sim.traces.write_trace`
    would put them in a file.
    """
    w = workload if workload is not None else SyntheticWorkload()
    b = w.block_size
    system_lengths, turns = _draw(w)
    fresh = itertools.count()
    # Ids of each system prompt's full blocks, given on the prompt's first use.
    system_chains: dict[int, list[int]] = {}
    # Ids of each conversation's full blocks so far; later turns only extend it.
    chains: dict[int, list[int]] = {}
    for line, t in enumerate(turns, start=1):
        chain = chains.get(t.conversation)
        if chain is None:
            shared = system_chains.get(t.system_prompt)
            if shared is None:
                shared = [next(fresh) for _ in range(system_lengths[t.system_prompt] // b)]
                system_chains[t.system_prompt] = shared
            chain = chains[t.conversation] = list(shared)
        full_blocks = t.input_length // b
        chain.extend(next(fresh) for _ in range(full_blocks - len(chain)))
        ids = chain[:full_blocks]
        if t.input_length % b:
            ids.append(next(fresh))
        yield TraceRequest(t.timestamp_ms, t.input_length, t.output_length, tuple(ids), line)
