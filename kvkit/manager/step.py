"""What the manager hands the engine each step: the transfers to run, and what finished."""

from __future__ import annotations

import math

import attrs

from kvkit.interfaces.shared import SharedPlan
from kvkit.interfaces.types import TransferPlan

__all__ = ["CompletionReport", "StepPlan"]


@attrs.frozen
class StepPlan:
    """The transfers of one scheduler step, for every worker to run.

    Attributes:
        loads: ``(transfer_id, plan)`` pairs, CPU -> GPU, at most one per KV
            group. A load must finish before the compute that reads its blocks.
        stores: ``(transfer_id, plan)`` pairs, GPU -> CPU, at most one per KV
            group. A store must run after the compute that wrote its sources
            (confirmed in an earlier step) and before anything overwrites them.
        fetches: ``(transfer_id, SharedPlan)`` pairs, shared tier -> CPU (at
            most two: this step's loads' and the prefetches', which no load
            reads). Each worker runs them *before* this step's loads, which
            read the fetched blocks, and reports a load that reads a block its
            fetch failed as failed.
        puts: ``(transfer_id, SharedPlan)`` pairs, CPU -> shared tier (at most one).
        fetch_wait_s: the most seconds a worker waits for ``fetches``, from their
            start: what the shared tier's deadline of one step left after the
            step's lookups (``SharedTierSpec.lookup_budget_s``; ``inf``: only
            the worker's own ``wait_timeout_s``). A fetch not answered by then
            fails on that rank, and the load reading it is reported failed.

    Invariants: transfer ids are unique and increase across steps (and resets).
    """

    loads: tuple[tuple[int, TransferPlan], ...] = ()
    stores: tuple[tuple[int, TransferPlan], ...] = ()
    fetches: tuple[tuple[int, SharedPlan], ...] = ()
    puts: tuple[tuple[int, SharedPlan], ...] = ()
    fetch_wait_s: float = math.inf

    def __bool__(self) -> bool:
        return bool(self.loads or self.stores or self.fetches or self.puts)

    def __iter__(self):
        """Every copy ``(transfer_id, plan)`` pair, loads first (shared-tier transfers are not copies)."""
        yield from self.loads
        yield from self.stores


@attrs.frozen
class CompletionReport:
    """Requests whose transfers finished in one ``apply_completions`` call.

    Attributes:
        loaded: requests whose CPU hit is now on their GPU blocks (compute may
            read it).
        load_failed: requests whose load failed or was abandoned by a reset:
            their CPU-hit tokens are invalid and must be recomputed from the
            GPU-hit boundary.
        released: finished or aborted requests for which ``finish``/``abort``
            returned ``True``: the engine may now free their GPU blocks.
    """

    loaded: frozenset[str] = frozenset()
    load_failed: frozenset[str] = frozenset()
    released: frozenset[str] = frozenset()
