"""kvkit's reference engine: a scheduler loop that drives an offload stack as an engine would.

:class:`ReferenceEngine` runs lookup, allocation, loads, compute and stores
step by step, checking every byte it reads back; the simulator and the
Hugging Face integration drive stacks through it.
"""

from kvkit.reference.engine import EngineRequest, ReferenceEngine, StepReport, SyntheticCompute

__all__ = ["EngineRequest", "ReferenceEngine", "StepReport", "SyntheticCompute"]
