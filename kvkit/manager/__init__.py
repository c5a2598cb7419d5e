"""The scheduler side of an offload tier: requests, hits, store planning, transfers (no tensors).

:class:`OffloadManager` is the facade an engine drives; the parts it composes
each own their state (see ``docs/architecture.md``). The names below resolve
on first use, so a part (``kvkit.manager.events``) imports without the facade.
"""

from kvkit._lazy import lazy_exports

_EXPORTS = {
    "CompletionReport": "kvkit.manager.step:CompletionReport",
    "OffloadManager": "kvkit.manager.manager:OffloadManager",
    "Progress": "kvkit.manager.requests:Progress",
    "Request": "kvkit.manager.requests:Request",
    "RequestState": "kvkit.manager.requests:RequestState",
    "StepPlan": "kvkit.manager.step:StepPlan",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
