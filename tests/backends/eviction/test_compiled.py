"""Each compiled loop against its pure-Python reference: the same calls leave the same state, byte for byte."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvkit.backends.eviction.hit_density import HitDensityPolicy, booking


@pytest.mark.compiler
def test_the_compiled_booking_was_built() -> None:
    """Where a C compiler is, the install built the booking loops, and the policy runs them by default."""
    assert booking.COMPILED is not None, "pip install -e . did not build hit_density/_booking.c"
    assert HitDensityPolicy()._books is booking.COMPILED


def _state(policy: HitDensityPolicy) -> dict[str, Any]:
    """Every field of the policy the booking reads or writes, and what its decisions read."""
    fields = ("_where", "_cls", "_uses", "_last", "_next", "_prev", "_ends", "_dirty", "_recent",
              "_ghost_recent", "_ghost_hash", "_ghost_cls", "_ghost_uses", "_ghost_last", "_ghost_live",
              "_ghost_at", "_ghost_base", "_clock", "_tracked", "_tip", "_reused", "_turnover", "_evictions",
              "_high_water", "_next_refresh")
    state = {name: getattr(policy, name) for name in fields}
    state["_last"], state["_next"], state["_prev"], state["_ghost_last"] = (
        bytes(state[name]) for name in ("_last", "_next", "_prev", "_ghost_last"))
    model = policy.model
    state["model"] = (model.rows, model.reuses.tolist(), model.ends.tolist())
    shift = policy._shift
    state["shift"] = (shift.shifts, shift._window, shift._held, shift._scale,
                      shift._history.tolist(), shift._pool.tolist(), shift._decayed.tolist())
    return state


def _hash(conversation: int, position: int) -> int:
    return conversation * 1000 + position + 1


# Stores of chain pieces (listed one block at a time, or parked as a batch), hits, pins, unpins and evictions.
_OPS = st.lists(st.one_of(
    st.tuples(st.just("store"), st.integers(0, 6), st.integers(0, 12), st.integers(1, 40), st.booleans()),
    st.tuples(st.just("hit"), st.integers(0, 6), st.integers(1, 12), st.integers(1, 6)),
    st.tuples(st.just("unpin"), st.integers(0, 40)),
    st.tuples(st.just("pin"), st.integers(0, 12)),
    st.tuples(st.just("evict"), st.integers(1, 30)),
), max_size=80)


@pytest.mark.skipif(booking.COMPILED is None, reason="the compiled loops were not built")
@settings(max_examples=150, deadline=None)
@example(ops=[("store", 0, 0, 4, False), ("hit", 0, 4, 6), ("evict", 4), ("store", 0, 0, 4, True)], capacity=16,
         span=2.0)  # a chain hit six times, evicted and stored again: its ghost's reuses climb past 3
@given(ops=_OPS, capacity=st.sampled_from([None, 4, 16]), span=st.sampled_from([1.0, 2.0]))
def test_compiled_booking_is_the_reference(ops: list[tuple[Any, ...]], capacity: int | None, span: float) -> None:
    """Two policies take the same calls, one running the compiled booking loops, one the reference.
    Small capacities refresh the model inside a batch (the booking stops and resumes), and evicted chains
    stored again hit the ghost: after every call both hold the same state, and make the same choices."""
    twins = [HitDensityPolicy(capacity=capacity, ghost_span=span) for _ in range(2)]
    twins[1]._books = booking.REFERENCE
    compiled, reference = twins
    free = list(range(200))
    block_of: dict[int, int] = {}  # hash -> its tracked block
    parked: list[int] = []
    for op in ops:
        if op[0] == "store":
            _, conversation, start, n, pinned = op
            hashes = [h for h in (_hash(conversation, i) for i in range(start, start + n)) if h not in block_of]
            hashes = hashes[:len(free)]
            parents = [h - 1 if h % 1000 != 1 else None for h in hashes]
            blocks = [free.pop() for _ in hashes]
            if not blocks:
                continue
            block_of.update(zip(hashes, blocks))
            for policy in twins:
                if pinned:
                    policy.insert_pinned(blocks, hashes, parents)
                else:
                    for block, block_hash, parent in zip(blocks, hashes, parents):
                        policy.on_insert(block, block_hash, parent)
            if pinned:
                parked += blocks
        elif op[0] == "hit":
            _, conversation, length, times = op  # hit often: reuse counts climb past the first levels
            hit = [block_of[h] for h in (_hash(conversation, i) for i in range(length)) if h in block_of]
            for policy in twins:
                policy.access_many(hit * times)
        elif op[0] == "pin":
            pinning = [block for block in block_of.values() if block not in parked][:op[1]]
            for policy in twins:
                policy.pin_many(pinning)
            parked += pinning
        elif op[0] == "unpin":
            leaving, parked = parked[:op[1]], parked[op[1]:]
            for policy in twins:
                policy.unpin_many(leaving)
        else:
            unpinned = set(range(200)).difference(parked).__contains__
            chosen = [policy.select_victims(op[1], unpinned) for policy in twins]
            assert chosen[0] == chosen[1]
            if chosen[0]:
                for policy in twins:
                    policy.remove_many(chosen[0])
                gone = set(chosen[0])
                for block_hash in [h for h, block in block_of.items() if block in gone]:
                    del block_of[block_hash]
                free += chosen[0]
        assert _state(compiled) == _state(reference)
    for policy in twins:
        policy.check_invariants()
