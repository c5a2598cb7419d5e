"""Exploring offload stacks: the trace-driven simulator, fleets, workloads, traces and policy studies.

Nothing here is on an engine's path: :mod:`~kvkit.sim.simulator` replays a
trace through real stacks under a cost model, :mod:`~kvkit.sim.fleet` runs N
instances behind a router, :mod:`~kvkit.sim.synthetic` generates workloads,
:mod:`~kvkit.sim.traces` reads and writes Mooncake traces,
:mod:`~kvkit.sim.policy_study` replays eviction policies against the optimum
and :mod:`~kvkit.sim.baselines` runs libCacheSim's policies beside them.
"""

from kvkit._lazy import lazy_exports

_EXPORTS = {
    "BUILTIN_TRACES": "kvkit.sim.traces:BUILTIN_TRACES",
    "CostModel": "kvkit.sim.simulator:CostModel",
    "FleetResult": "kvkit.sim.fleet:FleetResult",
    "HitStats": "kvkit.sim.policy_study:HitStats",
    "LIBCACHESIM_POLICIES": "kvkit.sim.baselines:LIBCACHESIM_POLICIES",
    "ModelShape": "kvkit.sim.simulator:ModelShape",
    "OPT": "kvkit.sim.policy_study:OPT",
    "PolicyStudy": "kvkit.sim.policy_study:PolicyStudy",
    "SHAPES": "kvkit.sim.synthetic:SHAPES",
    "SimConfig": "kvkit.sim.simulator:SimConfig",
    "SimResult": "kvkit.sim.simulator:SimResult",
    "Simulator": "kvkit.sim.simulator:Simulator",
    "SyntheticWorkload": "kvkit.sim.synthetic:SyntheticWorkload",
    "TraceClock": "kvkit.sim.policy_study:TraceClock",
    "TraceRequest": "kvkit.sim.traces:TraceRequest",
    "compare_fleets": "kvkit.sim.fleet:compare_fleets",
    "default_policies": "kvkit.sim.policy_study:default_policies",
    "generate": "kvkit.sim.synthetic:generate",
    "libcachesim_study": "kvkit.sim.baselines:libcachesim_study",
    "read_trace": "kvkit.sim.traces:read_trace",
    "replay": "kvkit.sim.policy_study:replay",
    "shape": "kvkit.sim.synthetic:shape",
    "simulate": "kvkit.sim.simulator:simulate",
    "simulate_fleet": "kvkit.sim.fleet:simulate_fleet",
    "study": "kvkit.sim.policy_study:study",
    "write_trace": "kvkit.sim.traces:write_trace",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
