"""Synthetic workload shapes: deterministic, Mooncake-conventional ids, validated, selectable by name."""

from __future__ import annotations

import pytest

from kvkit.errors import ConfigError
from kvkit.sim.synthetic import SHAPES, AgentWorkload, FewShotWorkload, RagWorkload, SyntheticWorkload, shape


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_shape_is_deterministic_and_numbers_ids_in_order(name: str) -> None:
    """The same seed gives the same trace; ids are dense in order of first appearance; time never goes back."""
    first = list(shape(name, seed=3, block_size=64).requests())
    assert first == list(shape(name, seed=3, block_size=64).requests())
    assert first != list(shape(name, seed=4, block_size=64).requests())
    seen = -1
    for request in first:
        assert len(request.hash_ids) == -(-request.input_length // 64)
        for h in request.hash_ids:
            assert h <= seen + 1
            seen = max(seen, h)
    assert [r.timestamp_ms for r in first] == sorted(r.timestamp_ms for r in first)
    assert [r.line for r in first] == list(range(1, len(first) + 1))


def test_agent_steps_extend_their_session_and_share_the_system_prompt() -> None:
    """Every step but a session's first extends an earlier prompt; all sessions share the system prompt's blocks."""
    w = AgentWorkload(num_sessions=6, num_system_prompts=1, block_size=64)
    requests = list(w.requests())
    common = w.system_prompt_tokens[0] // 64
    assert len({r.hash_ids[:common] for r in requests}) == 1
    extends = [r for i, r in enumerate(requests)
               if any(len(o.hash_ids) > common + 1 and r.hash_ids[:len(o.hash_ids) - 1] == o.hash_ids[:-1]
                      for o in requests[:i])]
    assert len(extends) == len(requests) - w.num_sessions


def test_rag_popular_documents_are_shared_across_questions() -> None:
    """With a steep popularity, many first questions share the blocks after the instruction."""
    requests = list(RagWorkload(num_requests=200, document_skew=2.0, follow_up_probability=0,
                                block_size=64).requests())
    after_instruction = [r.hash_ids[400 // 64 + 2] for r in requests]
    assert len(set(after_instruction)) < len(requests) / 4


def test_few_shot_popularity_drifts() -> None:
    """The most used template before a reshuffle is not the most used one after it."""
    w = FewShotWorkload(num_requests=1200, drift_every=600, num_templates=50, block_size=64)
    requests = list(w.requests())

    def top(part):
        counts: dict[int, int] = {}
        for r in part:
            counts[r.hash_ids[0]] = counts.get(r.hash_ids[0], 0) + 1
        return max(counts, key=counts.__getitem__)

    assert top(requests[:600]) != top(requests[600:])


def test_unknown_shape_lists_the_valid_ones() -> None:
    """A bad name quotes itself and names every shape."""
    with pytest.raises(ConfigError, match=r"'chatt'.*chat, agent, rag, few-shot"):
        shape("chatt")


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_shape_name_can_move_parameters(name: str) -> None:
    """``shape("name@field=value;...")`` is the shape's class with those fields, same seed and block size."""
    cls = SHAPES[name]
    field = {"chat": "num_conversations", "agent": "num_sessions", "rag": "num_requests",
             "few-shot": "num_requests", "mixed": "num_sessions"}[name]
    moved = shape(f"{name}@ {field} = 7 ;", seed=5, block_size=64)
    assert moved == cls(seed=5, block_size=64, **{field: 7})
    assert list(moved.requests()) == list(cls(seed=5, block_size=64, **{field: 7}).requests())
    assert shape(f"{name}@", seed=5) == shape(name, seed=5) == cls(seed=5)


@pytest.mark.parametrize(("name", "quoted"), [
    ("few-shot@nope=1", r"'nope=1' in 'few-shot@nope=1'.*drift_every"),  # no such field
    ("few-shot@num_templates", r"'num_templates'.*FIELD=VALUE"),  # no value
    ("few-shot@seed=3", r"'seed=3'"),  # seed and block_size are the keywords'
    ("few-shot@num_templates=abc", r"'abc' of 'num_templates'.*literal"),
    ("few-shot@num_templates=0", r"'few-shot@num_templates=0'.*num_templates"),  # the shape's validator
    ("few-shot@template_tokens=5", r"'few-shot@template_tokens=5'"),  # the shape's converter
    ("chatt@max_turns=3", r"'chatt'.*chat, agent"),
    ("few-shot@num_templates=5;num_templates=6", r"'num_templates=6'.*twice"),
    ("rag@document_skew={[]: 1}", r"'\{\[\]: 1\}' of 'document_skew'.*literal"),
    (None, "string, got None"),
])
def test_bad_moved_parameters_are_config_errors_quoting_them(name: object, quoted: str) -> None:
    """Every malformed or refused pair is a ConfigError quoting it, never a TypeError."""
    with pytest.raises(ConfigError, match=quoted):
        shape(name)  # type: ignore[arg-type]


@pytest.mark.parametrize(("cls", "kwargs"), [
    (AgentWorkload, {"system_prompt_tokens": (10, 5)}),
    (AgentWorkload, {"steps_mean": 0.5}),
    (RagWorkload, {"docs_per_request": 5, "num_documents": 3}),
    (RagWorkload, {"follow_up_probability": 1.5}),
    (FewShotWorkload, {"drift_every": 0}),
])
def test_bad_parameters_are_refused(cls, kwargs) -> None:
    """Each shape validates its parameters on construction."""
    with pytest.raises(ConfigError):
        cls(**kwargs)


def test_chat_is_the_original_generator() -> None:
    """The chat shape is :class:`SyntheticWorkload`, unchanged."""
    assert SHAPES["chat"] is SyntheticWorkload
