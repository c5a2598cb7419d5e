"""Built-in load planners: per request, which hit blocks to load and which to recompute."""

from kvkit.backends.plan.estimate import ComputeEstimate, MoveEstimate, SlowdownEstimate
from kvkit.backends.plan.overlap import LoadAllPlanner, OverlapPlanner

__all__ = ["ComputeEstimate", "LoadAllPlanner", "MoveEstimate", "OverlapPlanner", "SlowdownEstimate"]
