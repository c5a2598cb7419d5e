"""``OverlapPlanner``: the default load planner, from online estimates of each side's speed.

The time model it plans with, for a hit of ``h`` blocks after a GPU prefix
hit of ``context`` tokens, when the head ``[0, k)`` is computed while the
tail ``[k, e)`` loads and ``[e, h)`` is declined:

* *compute side*: ``C(k) = compute(k * block_size tokens after context)``,
  one forward pass (its fixed cost included: a head costs a pass of its own),
  from the heads observed beside their step's loads once there are any (a
  head shares the host with the loads, and may run slower than a pass alone):
  their own fit where they span a factor of two in size and it is slower
  than the prefill fit in both its fixed and its per-token cost, else the
  prefill fit times their median slowdown (heads of similar sizes cannot
  tell the two costs apart);
* *load side*: ``L(k, e)``: each source of the tail pays its fixed latency
  once and its bytes over its bandwidth; a shared-tier block is fetched into
  a CPU block and then copied like a CPU block, so it pays both moves;
* first token at ``max(C(k), L(k, e)) + compute(the tokens after e)``.

:meth:`OverlapPlanner.plan` answers the plan with the least modelled time
(ties go to the plan that loads more) among tail ends ``e`` at the run
boundaries, with, for each ``e``, the meeting point ``k`` where ``C``
(rising) crosses ``L`` (falling), found by bisection; without
``query.overlap`` only ``k = 0``. Within a run whose meeting point stays in
one source's blocks, each more block loaded shortens the rest more than it
lengthens the overlap, so declining part of a run never beats declining
none or all of it; where the meeting point crosses into another source's
blocks, or sits between two whole blocks, an end inside a run may do better
by at most about one block's compute and move. Probes aside, the plan is never slower, by
the model, than loading the whole hit or recomputing it.

Until it has an estimate of compute, it loads the whole hit: what an engine
without a planner does. Until it also has one of every source in the hit,
it *probes*: it loads one block (the hit's last, or with no overlap its
first) and computes the rest, so a source's first observation costs at most
one block's move, whatever its speed. While every observation of a source
is of one size, its estimate charges the move's fixed latency to each byte,
which overstates any longer move; so, with overlap, where the best plan
loads less, it probes again with the longest tail that by that estimate
lands while the head computes, if that tail moves a clearly different number
of bytes and costs, by the model, at most ``probe_share`` more than the best
plan: the second size tells latency and bandwidth apart. A
source it declines entirely gets no new observation, so its estimate stays
as it was until a plan uses it again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs
from typing_extensions import override

from kvkit.backends.plan.estimate import ComputeEstimate, MoveEstimate, SlowdownEstimate
from kvkit.interfaces.plan import HitQuery, HitSource, LoadPlan, LoadPlanner
from kvkit.validate import at_least, check_real, checked

__all__ = ["LoadAllPlanner", "OverlapPlanner"]


_HEAD_SPAN = 2.0  # heads this far apart in size (largest over smallest) tell a fixed cost from a per-token one


@attrs.define(eq=False)
class OverlapPlanner(LoadPlanner):
    """Plans each hit for the soonest first token (see the module docstring).

    Args:
        window: observations each estimate keeps (bounded memory).
        probe_share: the most a second probe may cost beyond the best plan,
            by the model, as a share of it (0: it never costs more).
        prefill_tokens_per_s: the engine's prefill speed, used until its
            first observed computation (``None``: none until then).
    """

    window: int = attrs.field(default=64, validator=at_least(2))
    probe_share: float = attrs.field(default=0.1, converter=checked(check_real, low=0, high=math.inf, high_open=True))  # type: ignore[misc]
    prefill_tokens_per_s: float | None = attrs.field(
        default=None, converter=checked(check_real, optional=True, low=0, low_open=True, high=math.inf, high_open=True))  # type: ignore[misc]
    _moves: dict[HitSource, MoveEstimate] = attrs.field(init=False)
    _compute: ComputeEstimate = attrs.field(init=False)
    _head: ComputeEstimate = attrs.field(init=False)  # passes beside the step's loads (heads): their own fit
    _slowdown: SlowdownEstimate = attrs.field(init=False)  # ... and their slowdown over the prefill fit

    def __attrs_post_init__(self) -> None:
        self._moves = {s: MoveEstimate(self.window) for s in HitSource}
        self._compute = ComputeEstimate(self.window, self.prefill_tokens_per_s)
        self._head = ComputeEstimate(self.window)
        self._slowdown = SlowdownEstimate(self.window)

    @override
    def observe_move(self, source: HitSource, num_bytes: int, seconds: float) -> None:
        move = self._moves.get(source)
        if move is not None:
            move.observe(num_bytes, seconds)

    @override
    def observe_compute(self, num_tokens: int, context_tokens: int, seconds: float, *,
                        beside_loads: bool = False) -> None:
        if beside_loads:
            self._head.observe(num_tokens, context_tokens, seconds)
            self._slowdown.observe(num_tokens, context_tokens, seconds)
        else:
            self._compute.observe(num_tokens, context_tokens, seconds)

    @override
    def estimates(self) -> Mapping[str, float | int | None]:
        out: dict[str, float | int | None] = {
            f"prefill_{k}": v for k, v in self._compute.as_dict().items()}
        out |= {f"head_{k}": v for k, v in self._head.as_dict().items()}
        slowdown = self._slowdown.factor(self._compute)
        out["head_slowdown"] = None if slowdown is None else round(slowdown, 4)
        for source, move in self._moves.items():
            out |= {f"{source.value}_{k}": v for k, v in move.as_dict().items()}
        return out

    @override
    def estimate_ms(self, query: HitQuery, plan: LoadPlan) -> float | None:
        model = _Model.of(self, query)
        if model is None or plan.hit_blocks != query.hit_blocks:
            return None
        return model.ms(plan.compute_blocks, plan.accepted_blocks)

    @override
    def plan(self, query: HitQuery) -> LoadPlan:
        h = query.hit_blocks
        if not h or self.compute_seconds(1, 0) is None:
            return LoadPlan.load_all(h)
        model = _Model.of(self, query)
        if model is None:  # a source without an estimate: probe it with one block
            return LoadPlan(h - 1, 1, h) if query.overlap else LoadPlan(0, 1, h)
        ends = [0]
        for _, n in query.runs:
            ends.append(ends[-1] + n)
        best = (model.ms(0, 0), 0, 0, 0)  # (time, -loaded, k, e): recompute the whole hit
        for e in ends[1:]:
            for k in model.meeting_points(e) if query.overlap else (0,):
                best = min(best, (model.ms(k, e), k - e, k, e))
        least, _, k, e = best
        if query.overlap:
            probe = min(model.meeting_points(h)[-1], h - 1)  # the longest tail that lands while the head computes
            if e - k < h - probe and model.ms(probe, h) <= least * (1 + self.probe_share) \
                    and self._teaches(model, probe, h):
                return LoadPlan(probe, h - probe, h)
        return LoadPlan(k, e - k, h)

    def _teaches(self, model: _Model, k: int, h: int) -> bool:
        """Whether loading hit blocks ``[k, h)`` moves, from some source of the hit whose every observation is
        of one size, a clearly different number of bytes."""
        counts = model.query.blocks_from(k, h)
        moved = {HitSource.CPU: sum(counts.values()), **counts}
        return any(self._moves[source].teaches(blocks * model.query.block_bytes) for source, blocks in moved.items())

    def move_seconds(self, source: HitSource, num_bytes: float) -> float | None:
        """Estimated seconds of one move of ``num_bytes`` from ``source`` (``None`` before an observation)."""
        return self._moves[source].seconds(num_bytes)

    def compute_seconds(self, tokens: float, context: float) -> float | None:
        """Estimated seconds to compute ``tokens`` after ``context`` (``None`` without an estimate)."""
        return self._compute.seconds(tokens, context)

    def head_seconds(self, tokens: float, context: float) -> float | None:
        """:meth:`compute_seconds` for a head, a pass beside the step's loads (sharing the host with them, it
        may run slower than a pass alone), once heads were observed so: by their own fit where they span at
        least ``_HEAD_SPAN`` in size and it is slower than the prefill fit in both its fixed and its per-token
        cost, else (heads of similar sizes cannot tell the two apart, and their fit reads noise) by the
        prefill fit times their median slowdown."""
        seconds = self.compute_seconds(tokens, context)
        own, alone = self._head.fit(), self._compute.fit()
        if seconds is None or own is None or alone is None:
            return seconds
        if self._slowdown.span() >= _HEAD_SPAN and own[0] >= alone[0] and own[1] >= alone[1]:
            return self._head.seconds(tokens, context)
        factor = self._slowdown.factor(self._compute)
        return seconds if factor is None else seconds * factor


@attrs.frozen
class _Model:
    """The planner's time model for one query (see the module docstring); times in seconds."""

    planner: OverlapPlanner
    query: HitQuery

    @classmethod
    def of(cls, planner: OverlapPlanner, query: HitQuery) -> _Model | None:
        """The model, or ``None`` while compute or a source of the hit has no estimate."""
        if planner.compute_seconds(1, 0) is None:
            return None
        needed = {s for s, _ in query.runs} | ({HitSource.CPU} if query.runs else set())
        if any(planner.move_seconds(s, 1) is None for s in needed):
            return None
        return cls(planner, query)

    def compute(self, k: int) -> float:
        """Seconds to compute the head: hit blocks ``[0, k)``, beside the tail's loads."""
        q = self.query
        return self.planner.head_seconds(k * q.block_size, q.context_tokens) or 0.0

    def load(self, k: int, e: int) -> float:
        """Seconds to load the tail: hit blocks ``[k, e)``."""
        counts = self.query.blocks_from(k, e)
        shared, b = counts.get(HitSource.SHARED, 0), self.query.block_bytes
        fetch = self.planner.move_seconds(HitSource.SHARED, shared * b) if shared else 0.0
        return (fetch or 0.0) + (self.planner.move_seconds(HitSource.CPU, sum(counts.values()) * b) or 0.0)

    def rest(self, e: int) -> float:
        """Seconds to compute everything after hit block ``e``: the declined blocks and the prompt's end."""
        q = self.query
        done = q.context_tokens + e * q.block_size
        return self.planner.compute_seconds(q.num_tokens - done, done) or 0.0

    def ms(self, k: int, e: int) -> float:
        """Modelled prefill time in ms with head ``[0, k)`` and tail ``[k, e)``."""
        return 1e3 * (max(self.compute(k), self.load(k, e)) + self.rest(e))

    def meeting_points(self, e: int) -> tuple[int, ...]:
        """The heads to try for tail end ``e``: both sides of where compute (rising) meets load (falling)."""
        lo, hi = 0, e  # the least k in [0, e] with compute(k) >= load(k, e)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.compute(mid) >= self.load(mid, e):
                hi = mid
            else:
                lo = mid + 1
        return (lo - 1, lo) if lo else (0,)


@attrs.define(eq=False)
class LoadAllPlanner(LoadPlanner):
    """Loads every hit it is offered: the behaviour of an engine without a planner (a baseline).

    It keeps no estimate, so :meth:`estimate_ms` is always ``None``.
    """

    @override
    def plan(self, query: HitQuery) -> LoadPlan:
        return LoadPlan.load_all(query.hit_blocks)

    @override
    def estimate_ms(self, query: HitQuery, plan: LoadPlan) -> None:
        return None

    @override
    def observe_move(self, source: HitSource, num_bytes: int, seconds: float) -> None:
        return None

    @override
    def observe_compute(self, num_tokens: int, context_tokens: int, seconds: float, *,
                        beside_loads: bool = False) -> None:
        return None

    @override
    def estimates(self) -> Mapping[str, float | int | None]:
        return {}
