"""The ``LoadPlanner`` protocol: per request, which hit blocks to load, from which tier, and which to recompute.

A hit in a slower tier is worth using only if bringing it back beats
recomputing it. Recompute and loading can also run at once: the engine
computes the hit *front to back* (block ``i`` needs the KV of blocks ``< i``,
which it produced itself) while the rest of the hit loads *from the back*;
the two sides meet where each has as much work left as the other. A planner
decides, per request, where they meet and whether the hit's last blocks are
worth fetching at all. It decides, never acts: the manager and the engine
carry the plan out.

The hit a planner sees is the one the manager's ``lookup`` offers after the
engine's GPU prefix hit: CPU-tier blocks first, then shared-tier blocks (a
shared block is fetched into a CPU block, then loaded like a CPU hit).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import attrs

from kvkit.errors import PlanError
from kvkit.validate import check_bool, check_enum, check_int, checked, plural, quote

__all__ = ["HitQuery", "HitSource", "LoadPlan", "LoadPlanner"]


class HitSource(enum.StrEnum):
    """Where a hit block is brought back from (a ``str`` enum: a member equals its value)."""

    CPU = "cpu"  # kvkit's CPU tier: one copy to the GPU
    SHARED = "shared"  # the shared tier: a fetch into a CPU block, then the copy to the GPU


def _runs(value: object) -> tuple[tuple[HitSource, int], ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise PlanError(f"HitQuery.runs={quote(value)}: must be a sequence of (source, blocks) pairs")
    out = []
    for item in value:
        if not isinstance(item, tuple) or len(item) != 2:
            raise PlanError(f"HitQuery.runs: {quote(item)} is not a (source, blocks) pair")
        source = check_enum("HitQuery.runs source", item[0], HitSource, error=PlanError)
        blocks = check_int("HitQuery.runs blocks", item[1], 1, error=PlanError)
        out.append((source, blocks))
    return tuple(out)


@attrs.frozen(kw_only=True)
class HitQuery:
    """What a planner knows of one request's hit when it plans.

    Attributes:
        block_size: tokens per block.
        block_bytes: bytes one block moves per worker (every KV group).
        context_tokens: tokens already on the GPU before the hit (its GPU
            prefix hit): the context the hit's first block is computed in.
        runs: the hit after the GPU prefix hit, in prefix order, as
            ``(source, blocks)`` runs of one source each (``blocks >= 1``).
        num_tokens: the request's prompt tokens; the tokens after the hit are
            computed whatever the plan.
        overlap: the engine can compute a head of the hit while the rest
            loads; ``False`` (an engine that loads a prefix before any
            compute, e.g. vLLM) allows only plans with ``compute_blocks == 0``.

    Raises:
        PlanError: a field of the wrong type or range, quoting it.
    """

    block_size: int = attrs.field(converter=checked(check_int, minimum=1, label="HitQuery.", error=PlanError))  # type: ignore[misc]
    block_bytes: int = attrs.field(converter=checked(check_int, minimum=1, label="HitQuery.", error=PlanError))  # type: ignore[misc]
    context_tokens: int = attrs.field(converter=checked(check_int, minimum=0, label="HitQuery.", error=PlanError))  # type: ignore[misc]
    runs: tuple[tuple[HitSource, int], ...] = attrs.field(converter=_runs)
    num_tokens: int = attrs.field(converter=checked(check_int, minimum=1, label="HitQuery.", error=PlanError))  # type: ignore[misc]
    overlap: bool = attrs.field(default=True, converter=checked(check_bool, label="HitQuery.", error=PlanError))  # type: ignore[misc]

    def __attrs_post_init__(self) -> None:
        end = self.context_tokens + self.hit_blocks * self.block_size
        if end >= self.num_tokens:
            raise PlanError(f"HitQuery: context_tokens={self.context_tokens} plus a hit of "
                            f"{plural(self.hit_blocks, 'block')} of {plural(self.block_size, 'token')} reach "
                            f"num_tokens={self.num_tokens}; at least one token is always computed")

    @property
    def hit_blocks(self) -> int:
        """Blocks in the hit."""
        return sum(n for _, n in self.runs)

    def blocks_from(self, start: int, stop: int) -> dict[HitSource, int]:
        """Blocks of hit positions ``[start, stop)`` per source (sources with none left out)."""
        out: dict[HitSource, int] = {}
        pos = 0
        for source, n in self.runs:
            lo, hi = max(start, pos), min(stop, pos + n)
            if hi > lo:
                out[source] = out.get(source, 0) + hi - lo
            pos += n
        return out


@attrs.frozen
class LoadPlan:
    """A planner's answer for one request's hit of ``hit_blocks`` blocks.

    Hit blocks ``[0, compute_blocks)`` (the *head*) are recomputed front to
    back while blocks ``[compute_blocks, compute_blocks + load_blocks)`` (the
    *tail*) load; the hit's remaining blocks are *declined*: computed after
    the tail landed, with the rest of the prompt. A failed load makes its
    blocks recomputed too.

    Raises:
        PlanError: counts that are not ints >= 0 or exceed the hit.
    """

    compute_blocks: int = attrs.field(converter=checked(check_int, minimum=0, label="LoadPlan.", error=PlanError))  # type: ignore[misc]
    load_blocks: int = attrs.field(converter=checked(check_int, minimum=0, label="LoadPlan.", error=PlanError))  # type: ignore[misc]
    hit_blocks: int = attrs.field(converter=checked(check_int, minimum=0, label="LoadPlan.", error=PlanError))  # type: ignore[misc]

    def __attrs_post_init__(self) -> None:
        if self.compute_blocks + self.load_blocks > self.hit_blocks:
            raise PlanError(f"LoadPlan: compute_blocks={self.compute_blocks} + load_blocks={self.load_blocks} "
                            f"exceed the hit of {plural(self.hit_blocks, 'block')}")

    @classmethod
    def load_all(cls, hit_blocks: int) -> LoadPlan:
        """Every hit block loaded, nothing computed alongside (what an engine does without a planner)."""
        return cls(0, hit_blocks, hit_blocks)

    @property
    def accepted_blocks(self) -> int:
        """The prefix of the offered hit the engine keeps: the head, then the tail."""
        return self.compute_blocks + self.load_blocks

    @property
    def declined_blocks(self) -> int:
        """Hit blocks not loaded: the head and the declined end."""
        return self.hit_blocks - self.load_blocks


@runtime_checkable
class LoadPlanner(Protocol):
    """Decides, per request, which hit blocks to load and which to recompute, from its own cost estimates.

    The manager feeds it what completed work cost (:meth:`observe_move`),
    the engine what its confirmed prefills cost (:meth:`observe_compute`);
    :meth:`plan` answers from those estimates.

    What a planner promises (the property tests check it for the default):
        * :meth:`plan` answers a :class:`LoadPlan` for ``query.hit_blocks``
          blocks, with ``compute_blocks == 0`` unless ``query.overlap``.
        * It never chooses a plan its own :meth:`estimate_ms` says is slower
          than loading the whole hit or recomputing it.
        * Its memory is bounded whatever it observes; an observation it
          cannot use (a zero, an outlier) never raises.
    """

    def plan(self, query: HitQuery) -> LoadPlan:
        """The plan for ``query``'s hit."""
        ...

    def estimate_ms(self, query: HitQuery, plan: LoadPlan) -> float | None:
        """Its estimate of the prefill time of ``query`` under ``plan`` in ms; ``None`` before it can estimate."""
        ...

    def observe_move(self, source: HitSource, num_bytes: int, seconds: float) -> None:
        """A move from ``source`` of ``num_bytes`` bytes (per worker) took ``seconds`` (its fixed latency included).

        For ``SHARED`` this is the fetch into CPU blocks alone; the copy from
        there to the GPU is a ``CPU`` move.
        """
        ...

    def observe_compute(self, num_tokens: int, context_tokens: int, seconds: float, *,
                        beside_loads: bool = False) -> None:
        """The engine computed ``num_tokens`` prompt tokens after ``context_tokens`` others in ``seconds``.

        ``beside_loads``: the pass ran while the step's loads and fetches were
        in flight (a plan's head), sharing the host with them.
        """
        ...

    def estimates(self) -> Mapping[str, float | int | None]:
        """Its current estimates, JSON-ready (for stats and reports)."""
        ...
