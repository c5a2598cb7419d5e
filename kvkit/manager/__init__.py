"""The scheduler side of an offload tier: requests, hits, store planning, transfers (no tensors).

:class:`OffloadManager` is the facade an engine drives; the parts it composes
each own their state (see ``docs/architecture.md``).
"""

from kvkit.manager.manager import OffloadManager
from kvkit.manager.requests import Request, RequestState
from kvkit.manager.step import CompletionReport, StepPlan

__all__ = ["CompletionReport", "OffloadManager", "Request", "RequestState", "StepPlan"]
