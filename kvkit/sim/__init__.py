"""Exploration tools: kvkit's reference engine loop, the trace-driven simulator, synthetic
workloads, trace readers, the eviction-policy study and the library half of the transfer bench."""
