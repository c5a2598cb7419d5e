"""Seeded synthetic workloads of several shapes, as Mooncake-style trace requests.

Shapes (:data:`SHAPES`, selectable by name: ``kvkit simulate --shape``,
``kvkit policies --shape``), each a frozen parameter object whose
``requests()`` yields the trace:

* ``chat`` (:class:`SyntheticWorkload`): multi-turn conversations, described below.
* ``agent`` (:class:`AgentWorkload`): agent tool loops. Each session opens
  with one of a few long shared system prompts (tool descriptions), then a
  task; every step appends the model's tool call and the tool's result and
  comes back after a short tool latency. Recency wins: a session's chain is
  reused seconds later, then never again.
* ``rag`` (:class:`RagWorkload`): retrieval-augmented questions. A shared
  instruction, then ``docs_per_request`` documents drawn from a corpus with a
  Zipf popularity (most relevant first), then the question; some questions get
  a follow-up on the same documents. Frequency wins: popular documents recur
  at every distance.
* ``mixed`` (:class:`MixedWorkload`): chat sessions among one-shot batch
  jobs, each request with workload hints (session, kind, retention or a low
  priority) for hint-aware policies (:meth:`MixedWorkload.hinted`).
* ``few-shot`` (:class:`FewShotWorkload`): one of many few-shot templates
  (instructions plus worked examples) with a Zipf popularity that is reshuffled
  every ``drift_every`` requests, then a short input. Popularity is stable
  for a while, then shifts: frequency must also forget.

Every shape but ``chat`` builds prompts from *segments* (a system prompt, a
document, a step): its ``hash_ids`` cut the concatenated segments into
blocks, and two blocks share an id exactly when they hold the same segment
pieces after the same prefix (a partial last block included), numbered in
order of first appearance.

The ``chat`` model:

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

import ast
import itertools
import math
import random
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, ClassVar, Protocol

import attrs

from kvkit.config import DEFAULTS
from kvkit.errors import ConfigError
from kvkit.interfaces.hints import WorkloadHints
from kvkit.sim.traces import TraceRequest
from kvkit.validate import (
    check_int,
    check_int_pair,
    checked,
    did_you_mean,
    is_int,
    known_keywords,
    plural,
    quote,
    real_in,
)

__all__ = ["SHAPES", "AgentWorkload", "FewShotWorkload", "MixedWorkload", "RagWorkload", "SyntheticWorkload", "generate", "shape"]  # noqa: E501

# Every shape field is bounded, so that a generator terminates in bounded time and memory and
# its arithmetic (Zipf powers, log-normal lengths, timestamps in ms) stays within floats:
MAX_COUNT = 1_000_000  # requests, conversations, sessions, prompts, documents, templates, turns
MAX_TOKENS = 1 << 20  # a segment's tokens (lengths, their means), block sizes
MAX_SKEW = 8.0  # Zipf exponents: 8 already gives rank 2 under 0.4% of rank 1's weight
MAX_RATE = 1e6  # arrivals per second, and 1 / the slowest rate (MIN_RATE)
MIN_RATE = 1e-6
MAX_SECONDS = 1e6  # mean gaps, think times, latencies, retentions
MAX_REPEATS = 1000.0  # mean steps or turns of a geometric session
MAX_FOLLOW_UP = 0.99  # a follow-up's chance: below 1, so a chain of follow-ups ends
MAX_SIGMA = 4.0  # a log-normal length's sigma
_MIN_NEW_DOCUMENT = 1e-3  # a RAG request's share of draws that can find its last document (~1000 draws at worst)


def _int_in(low: int, high: int) -> Callable[[Any, attrs.Attribute, Any], None]:
    """An ``attrs`` validator: the field is an int in ``[low, high]`` (``ConfigError`` quoting it)."""

    def validate(inst: object, attribute: attrs.Attribute, value: object) -> None:
        if not is_int(value) or not low <= value <= high:  # type: ignore[operator]
            raise ConfigError(f"{type(inst).__name__}.{attribute.name}={quote(value)}: must be an int in "
                              f"[{low}, {high}]")

    return validate


def _range_up_to_max(inst: object, attribute: attrs.Attribute, value: tuple[int, int]) -> None:
    """An ``attrs`` validator: a (low, high) token range's high is at most ``MAX_TOKENS``."""
    if value[1] > MAX_TOKENS:
        raise ConfigError(f"{type(inst).__name__}.{attribute.name}={quote(value)}: high must be at most {MAX_TOKENS}")


_positive_range = checked(check_int_pair, minimum=1)  # (low, high) with 1 <= low <= high
_count = _int_in(1, MAX_COUNT)
_block_size = _int_in(1, MAX_TOKENS)
_tokens = _int_in(0, MAX_TOKENS)
_tokens_mean = real_in(low=0, low_open=True, high=MAX_TOKENS)
_rate = real_in(low=MIN_RATE, high=MAX_RATE)
_seconds = real_in(low=0, low_open=True, high=MAX_SECONDS)
_skew = real_in(low=0, high=MAX_SKEW)
_repeats = real_in(low=1, high=MAX_REPEATS)


@known_keywords
@attrs.frozen
class SyntheticWorkload:
    """Parameters of a synthetic multi-turn workload; the same values give the same trace.

    Attributes:
        seed: seeds the generator; the only source of randomness.
        num_conversations: conversations in the trace.
        block_size: tokens per block the ``hash_ids`` are cut at.
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
        name: the shape's name in :data:`SHAPES`.
    """

    name: ClassVar[str] = "chat"

    seed: int = attrs.field(default=0, converter=checked(check_int))
    num_conversations: int = attrs.field(default=350, validator=_count)
    block_size: int = attrs.field(default=DEFAULTS.block_size, validator=_block_size)
    conversations_per_s: float = attrs.field(default=1.0, validator=_rate)
    num_system_prompts: int = attrs.field(default=8, validator=_count)
    system_prompt_tokens: tuple[int, int] = attrs.field(default=(256, 3072), converter=checked(check_int_pair),
                                             validator=_range_up_to_max)
    system_prompt_skew: float = attrs.field(default=1.2, validator=_skew)
    max_turns: int = attrs.field(default=16, validator=_count)
    turns_skew: float = attrs.field(default=1.0, validator=_skew)
    user_tokens_mean: float = attrs.field(default=200.0, validator=_tokens_mean)
    output_tokens_mean: float = attrs.field(default=250.0, validator=_tokens_mean)
    length_sigma: float = attrs.field(default=1.0, validator=real_in(low=0, high=MAX_SIGMA))
    think_time_mean_s: float = attrs.field(default=30.0, validator=_seconds)
    max_context_tokens: int = attrs.field(default=32768, validator=_int_in(1, 2 * MAX_TOKENS))

    def __attrs_post_init__(self) -> None:
        # Turn 1 is clipped to fit: it needs room for one user and one output token.
        if self.max_context_tokens < self.system_prompt_tokens[1] + 2:
            raise ConfigError(
                f"max_context_tokens={self.max_context_tokens} leaves no room after a "
                f"system prompt of up to {plural(self.system_prompt_tokens[1], 'token')}"
            )

    def requests(self) -> Iterator[TraceRequest]:
        """This workload's requests, in time order (as :func:`generate`)."""
        return generate(self)


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
        yield TraceRequest(t.timestamp_ms, t.input_length, t.output_length, tuple(ids), line, b)


# -- segment-built shapes ------------------------------------------------------

_Segment = tuple[Hashable, int]  # (content key, tokens)


@attrs.define
class _BlockIds:
    """Hash ids of prompts made of segments: equal pieces after equal prefixes share an id.

    Invariants: ids are dense, numbered in order of first appearance.
    """

    block_size: int
    _ids: dict[tuple[int | None, tuple[tuple[Hashable, int, int], ...]], int] = attrs.field(factory=dict)

    def of(self, segments: Sequence[_Segment]) -> tuple[int, ...]:
        """The ``hash_ids`` of the concatenation of ``segments``, a partial last block included."""
        ids, b = self._ids, self.block_size
        out: list[int] = []
        parent: int | None = None
        piece: list[tuple[Hashable, int, int]] = []
        filled = 0
        for key, tokens in segments:
            offset = 0
            while offset < tokens:
                take = min(b - filled, tokens - offset)
                piece.append((key, offset, offset + take))
                offset += take
                filled += take
                if filled == b:
                    parent = ids.setdefault((parent, tuple(piece)), len(ids))
                    out.append(parent)
                    piece, filled = [], 0
        if piece:
            out.append(ids.setdefault((parent, tuple(piece)), len(ids)))
        return tuple(out)


def _zipf_weights(n: int, skew: float) -> list[float]:
    """Cumulative Zipf weights of ranks ``0..n-1`` (rank ``i`` weighs ``1 / (i + 1) ** skew``)."""
    return list(itertools.accumulate(1 / (i + 1) ** skew for i in range(n)))


def _trace(block_size: int, prompts: list[tuple[float, list[_Segment], int]]) -> Iterator[TraceRequest]:
    """Requests from ``(arrival s, segments, output tokens)``, in time order (stable)."""
    prompts.sort(key=lambda p: p[0])
    ids = _BlockIds(block_size)
    for line, (at_s, segments, output) in enumerate(prompts, start=1):
        yield TraceRequest(round(at_s * 1000), sum(n for _, n in segments), output, ids.of(segments), line,
                           block_size)


@known_keywords
@attrs.frozen
class AgentWorkload:
    """Agent tool loops: a long shared system prompt, a task, then tool calls and results.

    Attributes:
        seed: the only source of randomness.
        num_sessions: agent sessions in the trace.
        block_size: tokens per block.
        sessions_per_s: Poisson arrival rate of sessions.
        num_system_prompts: distinct shared system prompts (Zipf-popular, skew 1).
        system_prompt_tokens: ``(low, high)`` length of a system prompt.
        task_tokens_mean: mean tokens of a session's task (log-normal).
        steps_mean: mean steps of a session (geometric, at least 1).
        call_tokens_mean: mean tokens of a tool call the model emits.
        result_tokens_mean: mean tokens of a tool result.
        tool_latency_mean_s: mean gap between two steps (exponential).
    """

    name: ClassVar[str] = "agent"
    seed: int = attrs.field(default=0, converter=checked(check_int))
    num_sessions: int = attrs.field(default=120, validator=_count)
    block_size: int = attrs.field(default=DEFAULTS.block_size, validator=_block_size)
    sessions_per_s: float = attrs.field(default=0.25, validator=_rate)
    num_system_prompts: int = attrs.field(default=4, validator=_count)
    system_prompt_tokens: tuple[int, int] = attrs.field(default=(2000, 6000), converter=_positive_range,
                                             validator=_range_up_to_max)
    task_tokens_mean: float = attrs.field(default=300.0, validator=_tokens_mean)
    steps_mean: float = attrs.field(default=6.0, validator=_repeats)
    call_tokens_mean: float = attrs.field(default=80.0, validator=_tokens_mean)
    result_tokens_mean: float = attrs.field(default=400.0, validator=_tokens_mean)
    tool_latency_mean_s: float = attrs.field(default=4.0, validator=_seconds)

    def requests(self) -> Iterator[TraceRequest]:
        """This workload's requests, in time order."""
        rng = random.Random(self.seed)
        systems = [rng.randint(*self.system_prompt_tokens) for _ in range(self.num_system_prompts)]
        weights = _zipf_weights(self.num_system_prompts, 1.0)
        prompts: list[tuple[float, list[_Segment], int]] = []
        at_s = 0.0
        for session in range(self.num_sessions):
            at_s += rng.expovariate(self.sessions_per_s)
            system = rng.choices(range(self.num_system_prompts), cum_weights=weights)[0]
            segments: list[_Segment] = [(("system", system), systems[system]),
                                        (("task", session), _lognormal_tokens(rng, self.task_tokens_mean, 1.0))]
            step_s = at_s
            for step in itertools.count():
                call = _lognormal_tokens(rng, self.call_tokens_mean, 0.5)
                prompts.append((step_s, list(segments), call))
                if rng.random() < 1 / self.steps_mean:
                    break
                segments.append((("call", session, step), call))
                segments.append((("result", session, step),
                                 _lognormal_tokens(rng, self.result_tokens_mean, 1.0)))
                step_s += call / 50 + rng.expovariate(1 / self.tool_latency_mean_s)
        return _trace(self.block_size, prompts)


@known_keywords
@attrs.frozen
class RagWorkload:
    """Retrieval-augmented questions over a corpus whose documents have a Zipf popularity.

    Attributes:
        seed: the only source of randomness.
        num_requests: first questions in the trace (follow-ups come on top).
        block_size: tokens per block.
        requests_per_s: Poisson arrival rate of first questions.
        num_documents: documents in the corpus.
        document_tokens: ``(low, high)`` length of a document.
        document_skew: Zipf exponent of document popularity (0: uniform).
        docs_per_request: distinct documents retrieved per question, most popular first.
        instruction_tokens: tokens of the one shared instruction.
        question_tokens_mean: mean tokens of a question (log-normal).
        follow_up_probability: chance a question gets one more on the same documents.
        follow_up_gap_mean_s: mean delay of a follow-up (exponential).
    """

    name: ClassVar[str] = "rag"
    seed: int = attrs.field(default=0, converter=checked(check_int))
    num_requests: int = attrs.field(default=1400, validator=_count)
    block_size: int = attrs.field(default=DEFAULTS.block_size, validator=_block_size)
    requests_per_s: float = attrs.field(default=2.0, validator=_rate)
    num_documents: int = attrs.field(default=3000, validator=_count)
    document_tokens: tuple[int, int] = attrs.field(default=(200, 1200), converter=_positive_range,
                                             validator=_range_up_to_max)
    document_skew: float = attrs.field(default=0.9, validator=_skew)
    docs_per_request: int = attrs.field(default=3, validator=_count)
    instruction_tokens: int = attrs.field(default=400, validator=_tokens)
    question_tokens_mean: float = attrs.field(default=60.0, validator=_tokens_mean)
    follow_up_probability: float = attrs.field(default=0.3, validator=real_in(low=0, high=MAX_FOLLOW_UP))
    follow_up_gap_mean_s: float = attrs.field(default=30.0, validator=_seconds)

    def __attrs_post_init__(self) -> None:
        if self.docs_per_request > self.num_documents:
            raise ConfigError(f"docs_per_request={self.docs_per_request} exceeds "
                              f"num_documents={self.num_documents}")
        # A request draws documents until it has docs_per_request distinct ones: the last draw must
        # find a new one often enough (at worst the most popular ones are taken).
        weights = _zipf_weights(self.num_documents, self.document_skew)
        left = 1 - weights[self.docs_per_request - 2] / weights[-1] if self.docs_per_request > 1 else 1.0
        if left < _MIN_NEW_DOCUMENT:
            raise ConfigError(f"document_skew={quote(self.document_skew)} with docs_per_request="
                              f"{self.docs_per_request} of num_documents={self.num_documents}: the documents past "
                              f"the {self.docs_per_request - 1} most popular get {left:.2g} of the draws, below "
                              f"{_MIN_NEW_DOCUMENT}; lower the skew or the documents per request")

    def requests(self) -> Iterator[TraceRequest]:
        """This workload's requests, in time order."""
        rng = random.Random(self.seed)
        lengths = [rng.randint(*self.document_tokens) for _ in range(self.num_documents)]
        weights = _zipf_weights(self.num_documents, self.document_skew)
        prompts: list[tuple[float, list[_Segment], int]] = []
        at_s = 0.0
        for question in range(self.num_requests):
            at_s += rng.expovariate(self.requests_per_s)
            docs: set[int] = set()
            while len(docs) < self.docs_per_request:
                docs.add(rng.choices(range(self.num_documents), cum_weights=weights)[0])
            context: list[_Segment] = [("instruction", self.instruction_tokens)]
            context += [(("doc", d), lengths[d]) for d in sorted(docs)]  # rank order: popular first
            ask_s = at_s
            for turn in itertools.count():
                context.append((("question", question, turn),
                                _lognormal_tokens(rng, self.question_tokens_mean, 0.7)))
                answer = _lognormal_tokens(rng, 200.0, 0.7)
                prompts.append((ask_s, list(context), answer))
                if rng.random() >= self.follow_up_probability:
                    break
                context.append((("answer", question, turn), answer))
                ask_s += rng.expovariate(1 / self.follow_up_gap_mean_s)
        return _trace(self.block_size, prompts)


@known_keywords
@attrs.frozen
class FewShotWorkload:
    """Few-shot templates with a Zipf popularity that shifts, each followed by a short input.

    Attributes:
        seed: the only source of randomness.
        num_requests: requests in the trace.
        block_size: tokens per block.
        requests_per_s: Poisson arrival rate.
        num_templates: distinct templates.
        template_tokens: ``(low, high)`` length of a template.
        template_skew: Zipf exponent of template popularity.
        drift_every: requests between two reshuffles of the popularity ranks.
        input_tokens_mean: mean tokens of a request's own input (log-normal).
    """

    name: ClassVar[str] = "few-shot"
    seed: int = attrs.field(default=0, converter=checked(check_int))
    num_requests: int = attrs.field(default=2400, validator=_count)
    block_size: int = attrs.field(default=DEFAULTS.block_size, validator=_block_size)
    requests_per_s: float = attrs.field(default=8.0, validator=_rate)
    num_templates: int = attrs.field(default=400, validator=_count)
    template_tokens: tuple[int, int] = attrs.field(default=(800, 4000), converter=_positive_range,
                                             validator=_range_up_to_max)
    template_skew: float = attrs.field(default=1.0, validator=_skew)
    drift_every: int = attrs.field(default=800, validator=_count)
    input_tokens_mean: float = attrs.field(default=150.0, validator=_tokens_mean)

    def requests(self) -> Iterator[TraceRequest]:
        """This workload's requests, in time order."""
        rng = random.Random(self.seed)
        lengths = [rng.randint(*self.template_tokens) for _ in range(self.num_templates)]
        weights = _zipf_weights(self.num_templates, self.template_skew)
        ranks = list(range(self.num_templates))  # ranks[i]: the template of popularity rank i
        prompts: list[tuple[float, list[_Segment], int]] = []
        at_s = 0.0
        for request in range(self.num_requests):
            if request and request % self.drift_every == 0:
                rng.shuffle(ranks)
            at_s += rng.expovariate(self.requests_per_s)
            template = ranks[rng.choices(range(self.num_templates), cum_weights=weights)[0]]
            prompts.append((at_s, [(("template", template), lengths[template]),
                                   (("input", request), _lognormal_tokens(rng, self.input_tokens_mean, 0.7))],
                            _lognormal_tokens(rng, 100.0, 0.7)))
        return _trace(self.block_size, prompts)


@known_keywords
@attrs.frozen
class MixedWorkload:
    """Chat sessions among one-shot batch jobs, each request with its :class:`WorkloadHints`.

    Chat sessions (kind ``"chat"``) open with one shared system prompt and
    come back after exponential think times for a geometric number of turns;
    batch jobs (kind ``"batch"``) are long prompts never seen again, arriving
    as a Poisson process over the same span. :meth:`hinted` gives each
    request what a caller would know: a chat turn carries its session and a
    retention of ``retention_s`` (as hosted prompt caches keep a prefix for
    minutes), a batch job ``priority=-1``.

    Attributes:
        seed: the only source of randomness.
        num_sessions: chat sessions.
        block_size: tokens per block.
        sessions_per_s: Poisson arrival rate of sessions.
        turns_mean: mean turns of a session (geometric, at least 1).
        think_time_mean_s: mean gap between two turns.
        batch_per_s: Poisson arrival rate of batch jobs.
        batch_tokens: ``(low, high)`` length of a batch prompt.
        system_prompt_tokens: tokens of the chat system prompt.
        retention_s: the chat turns' retention hint.
    """

    name: ClassVar[str] = "mixed"
    seed: int = attrs.field(default=0, converter=checked(check_int))
    num_sessions: int = attrs.field(default=200, validator=_count)
    block_size: int = attrs.field(default=DEFAULTS.block_size, validator=_block_size)
    sessions_per_s: float = attrs.field(default=0.5, validator=_rate)
    turns_mean: float = attrs.field(default=4.0, validator=_repeats)
    think_time_mean_s: float = attrs.field(default=60.0, validator=_seconds)
    batch_per_s: float = attrs.field(default=0.5, validator=_rate)
    batch_tokens: tuple[int, int] = attrs.field(default=(1000, 4000), converter=_positive_range,
                                             validator=_range_up_to_max)
    system_prompt_tokens: int = attrs.field(default=1000, validator=_tokens)
    retention_s: float = attrs.field(default=300.0, validator=_seconds)

    def hinted(self) -> tuple[list[TraceRequest], list[WorkloadHints]]:
        """The requests in time order and, one per request, its hints."""
        rng = random.Random(self.seed)
        prompts: list[tuple[float, list[_Segment], int, WorkloadHints]] = []
        at_s = 0.0
        for session in range(self.num_sessions):
            at_s += rng.expovariate(self.sessions_per_s)
            hints = WorkloadHints(ttl_s=self.retention_s, session=f"s{session}", kind="chat")
            context: list[_Segment] = [("system", self.system_prompt_tokens)]
            turn_s = at_s
            for turn in itertools.count():
                context.append((("user", session, turn), _lognormal_tokens(rng, 200.0, 1.0)))
                output = _lognormal_tokens(rng, 250.0, 1.0)
                prompts.append((turn_s, list(context), output, hints))
                if rng.random() < 1 / self.turns_mean:
                    break
                context.append((("reply", session, turn), output))
                turn_s += rng.expovariate(1 / self.think_time_mean_s)
        batch = WorkloadHints(priority=-1, kind="batch")
        at_s, end_s = 0.0, max(p[0] for p in prompts)
        for job in itertools.count():
            at_s += rng.expovariate(self.batch_per_s)
            if at_s > end_s:
                break
            prompts.append((at_s, [(("batch", job), rng.randint(*self.batch_tokens))], 50, batch))
        prompts.sort(key=lambda p: p[0])
        ids = _BlockIds(self.block_size)
        requests = [TraceRequest(round(at * 1000), sum(n for _, n in segments), output, ids.of(segments), line,
                                 self.block_size)
                    for line, (at, segments, output, _) in enumerate(prompts, start=1)]
        return requests, [p[3] for p in prompts]

    def requests(self) -> Iterator[TraceRequest]:
        """This workload's requests, in time order (without their hints)."""
        return iter(self.hinted()[0])


class Shape(Protocol):
    """A workload shape: frozen parameters whose ``requests()`` yields a trace."""

    name: ClassVar[str]

    def requests(self) -> Iterator[TraceRequest]: ...


SHAPES: dict[str, type] = {cls.name: cls for cls in (SyntheticWorkload, AgentWorkload, RagWorkload, FewShotWorkload,
                                                   MixedWorkload)}
"""Every synthetic workload shape by name; each class takes ``seed=`` and ``block_size=``."""


def shape(name: str, *, seed: int = 0, block_size: int = DEFAULTS.block_size) -> Shape:
    """The workload of shape ``name``, seeded, with its default parameters or moved ones.

    ``name`` is a shape's name, optionally followed by ``@`` and
    ``field=value`` pairs separated by ``;`` that replace fields of its class
    (values are Python literals): ``shape("few-shot@num_templates=1200;drift_every=400")``
    is ``FewShotWorkload(seed=0, num_templates=1200, drift_every=400)``.

    Raises:
        ConfigError: ``name`` is not a shape (the valid names are listed), or a
            pair is malformed, names no field of the shape, or has a value the
            shape refuses; each quotes what it got.
    """
    if not isinstance(name, str):
        raise ConfigError(f"a workload shape is named by a string, got {quote(name)}")
    base, _, moved = name.partition("@")
    cls = SHAPES.get(base)
    if cls is None:
        raise ConfigError(f"unknown workload shape {quote(base)} in {quote(name)}; valid shapes: {', '.join(SHAPES)}"
                          f"{did_you_mean(base, list(SHAPES))}")
    fields = {f.name for f in attrs.fields(cls)} - {"seed", "block_size"}
    params: dict[str, object] = {}
    for pair in filter(None, moved.split(";")):
        key, eq, text = (part.strip() for part in pair.partition("="))
        if not eq or key not in fields or key in params:
            problem = "names a field twice" if key in params else f"is not FIELD=VALUE for a field of {base}"
            hint = "" if key in params else did_you_mean(key, sorted(fields))
            raise ConfigError(f"{quote(pair)} in {quote(name)} {problem}; its fields: {', '.join(sorted(fields))}"
                              f"{hint}")
        try:
            params[key] = ast.literal_eval(text)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise ConfigError(f"value {quote(text)} of {key!r} in {quote(name)} is not a Python literal") from None
    try:
        return cls(seed=seed, block_size=block_size, **params)
    except (TypeError, ValueError) as exc:  # the shape's validators, converters and type checks
        raise ConfigError(f"{quote(name)}: {exc}") from None
